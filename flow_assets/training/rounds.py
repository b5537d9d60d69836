"""A training round, as plain functions with typed hand-offs (no Dagster here).

    build_base_policy    the tiny model, SFT on demonstrations, champion v0 -> BasePolicyResult
    collect_batch        the champion's agents work on train tasks through the gateway, G per
                         task; the batch lands in the landing directory     -> CollectionResult
    [the data plane: interaction_logs -> trajectories -> rewards -> advantages]
    train_candidate      GRPO on the batch's turn rows, from the champion   -> RoundSummary
    evaluate_candidate   candidate vs champion agents on held-out tasks     -> EvaluationResult
    promote_candidate    the gate re-checked, the registry written          -> Promotion

Each result is a frozen dataclass written and read by one pair of functions (``round.json``,
``evaluation.json`` in the round's directory ``<models>/runs/<batch>/``), so the Dagster assets,
the demo, the benchmarks and the tests all pass the same typed objects.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import gc
import json
import math
import shutil
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Protocol

import numpy as np
import polars as pl

from flow_assets.core.atomic import write_json_atomic
from flow_assets.core.memory import release_free_memory
from flow_assets.serving.agents.evaluation import agents_rows
from flow_assets.serving.agents.harness import AgentFn, HarnessConfig, run_rollouts
from flow_assets.serving.gateway.config import GatewayConfig
from flow_assets.serving.gateway.engine import AdapterRef
from flow_assets.policy.chat import conversation_rows
from flow_assets.policy.configs import GRPOTrainerConfig, SFTConfig, TinyModelConfig, TrainingSample
from flow_assets.policy.rollouts import TextSamples, batch_id_for, text_training_samples, training_samples
from flow_assets.policy.store import PolicyStore
from flow_assets.policy.prompt import PROMPT_POLICY_FILE, carry_prompt
from flow_assets.rl.evaluation import EVAL_SCHEMA, compare_policies, summarise_policy
from flow_assets.rl.gate import GateConfig, GateResult, check_finite_loss, check_gain, check_kl
from flow_assets.tasks.sources import Task, TaskSource, is_held_out, task_tools

# The model code (torch, transformers, peft) is imported inside the functions that train, sample or
# save a model: the code location imports this module, and its sensors and data-plane runs never
# touch a model, so they should not pay seconds of imports for one.
if TYPE_CHECKING:
    from flow_assets.policy.trainer import StepMetrics


class Registry(Protocol):
    """What a round needs of the adapter registry (:class:`resources.registry.AdapterRegistry`)."""

    def champion(self) -> dict[str, Any] | None: ...
    def load(self) -> dict[str, Any]: ...
    def set_candidate(self, adapter_path: str, batch: str, parent_version: str) -> None: ...
    def promote(self, version: str, adapter_path: str, metrics: dict, by: str, reason: str, action: str = "promote") -> dict: ...
    def next_version(self) -> str: ...
    def challenger(self) -> dict[str, Any] | None: ...
    def start_challenger(self, version: str, adapter_path: str, metrics: dict, share: float, by: str, reason: str) -> dict: ...


class RoundError(RuntimeError):
    """A round cannot go on (no champion, no trainable rollouts, a changed champion)."""


def require_champion(registry: Registry) -> dict[str, Any]:
    """The champion entry.

    Raises:
        RoundError: there is none yet (``base_policy`` was never materialised).
    """
    champion = registry.champion()
    if champion is None:
        raise RoundError("no champion in the registry: materialise base_policy first")
    return champion


# -- base policy -----------------------------------------------------------------------------------
@dataclass(frozen=True)
class BasePolicyResult:
    """What ``build_base_policy`` did: SFT demonstrations (conversations) and rows (assistant
    turns), steps, mean loss of the last 10 steps (nats per token), seconds, parameters."""

    demonstrations: int
    rows: int
    steps: int
    final_loss: float
    seconds: float
    parameters: int


def build_base_policy(
    store: PolicyStore,
    registry: Registry,
    source: TaskSource,
    model: TinyModelConfig,
    sft: SFTConfig,
    demonstrations: int,
    by: str,
) -> BasePolicyResult:
    """The tiny model saved into ``store.base_path``, warm-started by SFT on the demonstration
    conversations of ``source``'s first ``demonstrations`` train tasks (one row per assistant
    turn, rendered with the chat template), then champion ``v0`` (an identity adapter).

    Raises:
        ValueError: no demonstrations.
    """
    from flow_assets.policy.sft import sft_on_rows
    from flow_assets.policy.tiny_model import save_tiny_policy

    if store.base_path.exists():
        shutil.rmtree(store.base_path)
    save_tiny_policy(store.base_path, model)
    base, tokenizer = store.load()
    tasks = source.tasks("train")[:demonstrations]
    rows = [row for t in tasks for row in conversation_rows(tokenizer, source.demonstration(t), task_tools(source, t))]
    result = sft_on_rows(base, rows, tokenizer.pad_token_id, sft)
    base.save_pretrained(str(store.base_path))
    register_identity_adapter(store, registry, by, "base policy (SFT warm start)")
    return BasePolicyResult(
        len(tasks), len(rows), result.steps, float(np.mean(result.losses[-10:])) if result.losses else float("nan"), result.seconds,
        sum(p.numel() for p in base.parameters()),
    )  # fmt: skip


def spread_sample(tasks: list[Task], count: int, seed: int) -> list[Task]:
    """``count`` of ``tasks`` drawn without replacement by a seeded permutation, kept in their
    original order, so a source listed category by category (BFCL) gives every category its share
    instead of the first category only. All of them when ``count >= len(tasks)``."""
    if count >= len(tasks):
        return list(tasks)
    keep = np.sort(np.random.default_rng(seed).permutation(len(tasks))[:count])
    return [tasks[i] for i in keep]


def warm_start_adapter(
    store: PolicyStore, registry: Registry, source: TaskSource, sft: SFTConfig, demonstrations: int, by: str
) -> BasePolicyResult:
    """A LoRA adapter on the user's base model, trained by SFT on the demonstration conversations
    of ``demonstrations`` train tasks (:func:`spread_sample` with ``sft.seed``; one row per assistant
    turn, rendered with the chat template and the task's own tools, loss on the assistant tokens
    only: :func:`~flow_assets.policy.sft.sft_on_rows`), saved and promoted as champion ``v1`` over
    ``v0`` (the model as it is, which stays in the registry: the baseline every later champion is
    compared with). The base weights are not touched. What the warm start is for: a base that never
    emits the task's output format (SmolLM2 on BFCL answers in prose) gives every GRPO group the
    same reward, hence zero advantages; the demonstrations put it where GRPO has signal.

    Raises:
        ValueError: no demonstrations (``demonstrations < 1`` or no train tasks).
        RoundError: the champion is not ``v0`` (a warm start comes right after ``base_policy``).
    """
    from flow_assets.policy.lora import save_lora_adapter
    from flow_assets.policy.sft import sft_on_rows

    if require_champion(registry)["version"] != "v0":
        raise RoundError("a warm start goes on v0 only: materialise base_policy again first")
    base, tokenizer = store.load()
    model = store.new_adapter(base)
    tasks = spread_sample(source.tasks("train"), demonstrations, sft.seed)
    rows = [row for t in tasks for row in conversation_rows(tokenizer, source.demonstration(t), task_tools(source, t))]
    result = sft_on_rows(model, rows, tokenizer.pad_token_id, sft)
    v1 = store.adapter_dir("v1")
    if v1.exists():
        shutil.rmtree(v1)
    save_lora_adapter(model, v1)
    loss = float(np.mean(result.losses[-10:])) if result.losses else float("nan")
    registry.promote(
        "v1", str(v1), {"base": str(store.base_path), "sft_demonstrations": len(tasks), "sft_rows": len(rows),
                        "sft_steps": result.steps, "sft_final_loss": loss},
        by=by, reason=f"SFT warm start (LoRA) on {len(tasks)} train tasks' demonstrations",
    )  # fmt: skip
    return BasePolicyResult(
        len(tasks), len(rows), result.steps, loss, result.seconds, sum(p.numel() for p in model.parameters() if p.requires_grad)
    )


def register_identity_adapter(store: PolicyStore, registry: Registry, by: str, reason: str) -> str:
    """Save a fresh (identity) LoRA adapter on the base model as ``v0`` and register it as the
    champion. Returns its directory."""
    from flow_assets.policy.lora import save_lora_adapter

    base, _ = store.load()
    v0 = store.adapter_dir("v0")
    if v0.exists():
        shutil.rmtree(v0)
    save_lora_adapter(store.new_adapter(base), v0)
    registry.promote("v0", str(v0), {"base": str(store.base_path)}, by=by, reason=reason, action="register")
    return str(v0)


# -- collection ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class CollectConfig:
    """One collection: the champion's agents work on ``tasks_per_batch`` train tasks, ``group_size`` each.

    Each field's description is its ``metadata["description"]`` (:mod:`flow_assets.core.config`).
    """

    tasks_per_batch: int = field(default=512, metadata={"description": (
        "train tasks per batch, drawn without replacement.")})
    group_size: int = field(default=8, metadata={"description": "agents (rollouts) per task, the GRPO group size G."})
    temperature: float = field(default=1.0, metadata={"description": (
        "sampling temperature imposed on every call of the rollouts.")})
    top_p: float = field(default=1.0, metadata={"description": "nucleus threshold imposed on every call."})
    seed: int = field(default=0, metadata={"description": (
        "base seed; the batch number is added to it (task choice and sampling seeds: each rollout samples with a seed of "
        "its own, so the same champion collects the same batch whatever order its agents' calls arrive in).")})
    concurrency: int = field(default=256, metadata={"description": "agents running at once."})
    timeout_s: float = field(default=120.0, metadata={"description": (
        "an agent running longer is cancelled (an error rollout), seconds.")})


@dataclass(frozen=True)
class CollectionResult:
    """What a collection landed.

    Attributes:
        path: the landed JSONL file; ``batch`` its name (stem).
        champion: the registry version whose agents collected it.
        rollouts / failed_rollouts: counts; a failed rollout is an error trajectory.
        success_rate: share of rollouts the verifier scored 1.
        mean_llm_calls / mean_tool_calls: per rollout.
        seconds: wall time of the agents' work (gateway start included).
    """

    path: str
    batch: str
    champion: str
    rollouts: int
    failed_rollouts: int
    success_rate: float
    mean_llm_calls: float
    mean_tool_calls: float
    seconds: float


def landing_source(agent_id: str) -> str:
    """The landing sub-directory of an agent's rollouts (``flowopt:calculator`` -> ``flowopt-calculator``)."""
    return agent_id.replace(":", "-")


def collect_batch(
    store: PolicyStore,
    source: TaskSource,
    agent: AgentFn,
    agent_id: str,
    registry: Registry,
    landing_dir: str | Path,
    config: CollectConfig | None = None,
    workers: int = 0,
    ray_address: str | None = None,
) -> CollectionResult:
    """Run the champion's agents on a batch of train tasks through an in-process gateway (real
    HTTP) and land the batch as ``<landing>/<source>/r<round>-<id>.jsonl`` (round = batches landed
    before it + 1; its partition key then starts with ``r<round>``, see ``flow_assets.logs.landing.batch_key``).

    With ``workers`` > 0 the agents run on that many Ray rollout workers instead, each a gateway
    replica with its share of the tasks (all G rollouts of a task on one), on the cluster at
    ``ray_address`` (``None``: a local one); the batch still lands as one file, each rollout
    exactly once even when a worker dies (:func:`~flow_assets.cluster.ray_rollouts.collect_on_ray`).

    Raises:
        RoundError: no champion.
        GatewayError / OSError: the gateway could not be started or refused the rollouts.
        RuntimeError: the Ray driver failed (``workers`` > 0).
    """
    config = config or CollectConfig()
    champion = require_champion(registry)
    folder = landing_source(agent_id)
    out_dir = Path(landing_dir) / folder
    batch_number = len(list(out_dir.glob("*.jsonl"))) if out_dir.is_dir() else 0
    seed = config.seed + batch_number
    train = source.tasks("train")
    rng = np.random.default_rng(seed)
    chosen = [train[i] for i in rng.choice(len(train), size=min(config.tasks_per_batch, len(train)), replace=False)]
    batch = f"r{batch_number + 1:04d}-{batch_id_for(champion['version'], [t.task_id for t in chosen], seed)}"
    harness = HarnessConfig(config.concurrency, config.timeout_s, "policy", config.temperature, config.top_p, land=True, seed=seed)
    gateway = GatewayConfig(default_max_tokens=store.max_new_tokens, seed=seed)
    started = time.perf_counter()
    if workers:
        from flow_assets.cluster.ray_rollouts import run_collect_driver

        landed = run_collect_driver(store, source, agent, agent_id, chosen, config.group_size, batch, folder, harness, gateway, workers,
                                    landing_dir, address=ray_address)  # fmt: skip
        return CollectionResult(str(landed.path), batch, champion["version"], landed.rollouts, landed.failed_rollouts, landed.success_rate,
                                landed.mean_llm_calls, landed.mean_tool_calls, time.perf_counter() - started)  # fmt: skip
    from flow_assets.serving.gateway.serve import serve_policy  # the web stack, only where a gateway is served

    with serve_policy(store, landing_dir, config=gateway) as server:
        results = asyncio.run(
            run_rollouts(server.url, agent, chosen, source.score, config.group_size,
                         agent_id=agent_id, batch=batch, source=folder, config=harness)
        )  # fmt: skip
    seconds = time.perf_counter() - started
    return CollectionResult(
        path=str(out_dir / f"{batch}.jsonl"),
        batch=batch,
        champion=champion["version"],
        rollouts=len(results),
        failed_rollouts=sum(r.error is not None for r in results),
        success_rate=float(np.mean([r.success for r in results])) if results else 0.0,
        mean_llm_calls=float(np.mean([r.llm_calls for r in results])) if results else 0.0,
        mean_tool_calls=float(np.mean([r.tool_calls for r in results])) if results else 0.0,
        seconds=seconds,
    )


# -- training --------------------------------------------------------------------------------------
@dataclass(frozen=True)
class RoundSummary:
    """What ``train_candidate`` did (``round.json``).

    Attributes:
        batch: the log batch trained on.
        parent_version / parent_adapter: the champion it started from.
        candidate_adapter: the trained adapter's directory.
        losses / grad_norms: per optimizer step.
        kl_to_behaviour: mean KL(behaviour || candidate), nats per token, on the batch's turns.
        num_samples: turn rows trained on; dropped_zero_advantage: rows left out (advantage 0).
        resumed_from: checkpoint step it resumed from, else ``None``; final_step: steps done.
        training_seconds: wall time of the optimisation.
        reward_mean / reward_std: of the batch's trajectories; zero_variance_share: of its groups.
        negate_advantages: trained against the advantages (a test of the gate).
        config: the trainer's exact config.
        turns_captured / turns_text: turn rows from the gateway's captured token ids, and from
            text logs re-rendered with the policy's chat template (their behaviour log-probs
            recomputed by the version that logged them).
        update_rule: ``"grpo"``: the clipped GRPO surrogate (captured and own-policy text rows);
            ``"awr"``: advantage-weighted likelihood (another model's flows).
        sources: the landing sources of the agent's trajectories in the batch, sorted.
        text_turns_skipped: text turns that could not be rendered (e.g. after a user message the
            canonical record does not keep); text_temperature_assumed: text trajectories that
            logged no sampling temperature, scored at T = 1; text_held_out_trajectories: text
            trajectories left out because their task is in the held-out split.
    """

    batch: str
    parent_version: str
    parent_adapter: str
    candidate_adapter: str
    losses: list[float]
    grad_norms: list[float]
    kl_to_behaviour: float
    num_samples: int
    dropped_zero_advantage: int
    resumed_from: int | None
    final_step: int
    training_seconds: float
    reward_mean: float
    reward_std: float
    zero_variance_share: float
    negate_advantages: bool
    config: dict[str, Any] = field(default_factory=dict)
    turns_captured: int = 0
    turns_text: int = 0
    update_rule: str = "grpo"
    text_turns_skipped: int = 0
    text_temperature_assumed: int = 0
    sources: list[str] = field(default_factory=list)
    text_held_out_trajectories: int = 0


def write_round_summary(summary: RoundSummary, run_dir: Path) -> Path:
    """Write ``run_dir/round.json`` atomically."""
    path = Path(run_dir) / "round.json"
    write_json_atomic(path, dataclasses.asdict(summary), sort_keys=True)
    return path


def read_round_summary(run_dir: Path) -> RoundSummary:
    """Read ``run_dir/round.json``.

    Raises:
        FileNotFoundError: the round has not been trained.
    """
    return RoundSummary(**json.loads((Path(run_dir) / "round.json").read_text()))


def kl_to_behaviour(
    model, samples: list[TrainingSample], pad_id: int, max_samples: int | None = None, micro_batch_size: int = 16, seed: int = 0
) -> float:
    """Mean KL(behaviour || trained policy), nats per token, on the batch's own completions.

    The completions were sampled from the behaviour policy, so the k3 estimator
    ``(r - 1) - log r`` with ``r = pi_new / pi_old`` (Schulman 2020, "Approximating KL
    divergence") is unbiased and non-negative for KL(pi_old || pi_new). Each row is scored at the
    temperature it was sampled at, like the behaviour log-probs. With ``max_samples`` the mean is
    taken over that many rows drawn without replacement (``seed``), still unbiased; rows are
    scored ``micro_batch_size`` at a time (memory).
    """
    import torch

    from flow_assets.policy.sampling import completion_logprobs
    from flow_assets.rl.grpo_loss import k3_kl

    with_lp = [s for s in samples if s.behaviour_logprobs and s.completion_ids]
    if not with_lp:
        return 0.0
    if max_samples is not None and len(with_lp) > max_samples:
        chosen = np.random.default_rng(seed).choice(len(with_lp), size=max_samples, replace=False)
        with_lp = [with_lp[i] for i in sorted(chosen)]
    total, tokens = 0.0, 0.0
    with torch.no_grad():
        for start in range(0, len(with_lp), micro_batch_size):
            micro = with_lp[start : start + micro_batch_size]
            logp, mask = completion_logprobs(
                model, [s.prompt_ids for s in micro], [s.completion_ids for s in micro], pad_id, [s.temperature for s in micro]
            )  # [mb, seq] each
            old = torch.zeros_like(logp)
            for i, s in enumerate(micro):
                old[i, : len(s.behaviour_logprobs)] = torch.tensor(s.behaviour_logprobs)
            total += float((k3_kl(old, logp) * mask).sum())
            tokens += float(mask.sum())
    return total / tokens


def text_behaviour_logprobs(
    store: PolicyStore, registry: Registry, champion: dict[str, Any], model, pad_id: int, text: TextSamples, micro_batch_size: int = 16
) -> list[TrainingSample]:
    """``text.samples`` with their behaviour log-probs: a teacher-forced pass (no gradient) of the
    version each trajectory logged (``adapter_version``), at the sample's temperature, so the
    importance ratio of a text row compares the trained policy with the policy that wrote the
    text, as for a captured row. A row that names no version, or one the registry does not
    hold, is scored by the champion (``model``, before training): the policy the round starts
    from is then the assumed behaviour policy.
    """
    import torch

    from flow_assets.policy.sampling import completion_logprobs

    known = {e["version"]: e["adapter_path"] for e in registry.load()["history"] if e.get("version") and e.get("adapter_path")}
    by_version: dict[str, list[int]] = {}
    for i, version in enumerate(text.adapter_versions):
        chosen = version if version in known and version != champion["version"] else champion["version"]
        by_version.setdefault(chosen, []).append(i)
    out = list(text.samples)
    for version, indices in by_version.items():
        scorer = model if version == champion["version"] else store.load(known[version], trainable=False)[0]
        with torch.no_grad():
            for start in range(0, len(indices), micro_batch_size):
                chunk = indices[start : start + micro_batch_size]
                micro = [text.samples[i] for i in chunk]
                logp, _ = completion_logprobs(
                    scorer, [s.prompt_ids for s in micro], [s.completion_ids for s in micro], pad_id, [s.temperature for s in micro]
                )  # [mb, seq]: row r's completion token t at column t (as kl_to_behaviour reads them)
                for row, i in enumerate(chunk):
                    values = logp[row, : len(out[i].completion_ids)].tolist()
                    out[i] = dataclasses.replace(out[i], behaviour_logprobs=values)
    return out


def train_candidate(
    store: PolicyStore,
    registry: Registry,
    batch: str,
    tables: dict[str, pl.DataFrame],
    agent_id: str,
    config: GRPOTrainerConfig,
    negate_advantages: bool = False,
    kl_samples: int | None = 256,
    on_step: Callable[[StepMetrics], None] | None = None,
    sources: Mapping[str, str] | None = None,
    tools: list[dict[str, Any]] | None = None,
    workers: int = 0,
    ray_address: str | None = None,
    launch: Callable[[list[str]], None] | None = None,
) -> tuple[RoundSummary, list[StepMetrics]]:
    """Train a candidate adapter from the champion on ``batch`` and save it (round directory
    ``store.round_dir(batch)``: ``checkpoints/``, ``adapter/``, ``round.json``).

    Args:
        tables: the batch's lake partitions ``steps``, ``step_advantages``, ``trajectories`` and
            ``advantages``.
        agent_id: the trainable agent (the task source's own): its turns train with the clipped
            GRPO surrogate, from captured token ids or re-rendered from its text logs.
        sources: ``agent_id -> update rule`` of the agents whose flows train the policy
            (:meth:`resources.loop.TrainingLoop.update_rules`); ``None``: ``agent_id`` alone. The
            round takes the batch's ``"grpo"`` agents' turns when it has any (update rule
            ``"grpo"``), else its ``"awr"`` agents' text turns (advantage-weighted likelihood:
            another model's flows have no behaviour log-probs of this policy). Text trajectories
            of held-out tasks (:func:`~flow_assets.tasks.sources.is_held_out`) never train.
        tools: the tool specifications logged text turns are rendered with, where the logs did
            not keep them.
        config: the trainer's settings (``output_dir`` is set to the round's checkpoints).
        negate_advantages: train against the advantages (to test that the gate blocks it).
        kl_samples: rows the gate's KL to the behaviour policy is estimated on (``None``: all).
        on_step: called with each optimizer step's metrics as it finishes (a run's log); with
            ``workers``, once per step after the data-parallel update ends.
        workers: 0 (the default): the update runs in this process; N >= 1: data-parallel over N
            Ray Train workers (:mod:`flow_assets.cluster.ray_training`, the ``ray`` extra) on the
            cluster at ``ray_address`` (``None``: a local one the driver process starts), with the
            same checkpoints and resume; the summary's ``training_seconds`` is then rank 0's own
            training time, without the driver's and the workers' start.
        launch: with ``workers``, how the Ray driver process is started
            (:func:`~flow_assets.cluster.ray_training.run_driver`; e.g. through Dagster Pipes).

    Returns:
        The summary (also written) and the per-step metrics.

    Raises:
        RoundError: no champion, or the batch holds no trainable turn of ``agent_id``.
    """
    from flow_assets.policy.lora import save_lora_adapter
    from flow_assets.policy.trainer import CheckpointMismatch, train_grpo_round

    rules = dict(sources or {}) | {agent_id: "grpo"}
    present = set(tables["trajectories"]["agent_id"].to_list()) & set(rules)
    grpo_agents = sorted(a for a in present if rules[a] == "grpo")
    update_rule = "grpo" if grpo_agents else "awr"
    trained_agents = grpo_agents or sorted(a for a in present if rules[a] == "awr")
    captured = [s for a in grpo_agents for s in training_samples(tables["steps"], tables["step_advantages"], tables["trajectories"], a)]
    champion = require_champion(registry)
    model, tokenizer = store.load(champion["adapter_path"], trainable=True)
    text = TextSamples([], [], 0, 0, [], 0)
    if "interaction_logs" in tables:
        text = text_training_samples(
            tables["interaction_logs"], tables["step_advantages"], trained_agents, tokenizer,
            max_length=getattr(model.config, "max_position_embeddings", None), held_out=is_held_out, tools=tools,
            # exact under token-level aggregation, and a long transcript then costs one pass
            pack=update_rule == "awr" and config.awr.loss_type in ("dapo", "bnpo"),
        )  # fmt: skip
    if text.samples and update_rule == "grpo":
        rescored = text_behaviour_logprobs(store, registry, champion, model, tokenizer.pad_token_id, text, config.micro_batch_size or 16)
        text = dataclasses.replace(text, samples=rescored)
    samples = captured + text.samples
    if not samples:
        reasons = "; ".join(sorted({why for _, _, why in text.skipped}))[:500]
        raise RoundError(
            f"batch {batch} has no trainable turn of {', '.join(map(repr, trained_agents or [agent_id]))} (with token ids, or as "
            f"text the policy's chat template renders{': ' + reasons if reasons else ''})"
        )
    config = dataclasses.replace(config, update_rule=update_rule)
    if negate_advantages:
        samples = [dataclasses.replace(s, advantage=-s.advantage) for s in samples]
    run_dir = store.round_dir(batch)
    run_dir.mkdir(parents=True, exist_ok=True)
    config = dataclasses.replace(config, output_dir=str(run_dir / "checkpoints"))
    # checkpoints are resumed only by the same round (after a kill, or training.pause): grown from
    # the same champion (recorded here; a directory without the record is of unknown origin), with
    # the same settings and samples (the trainer checks those). Another round on this batch (a new
    # champion, a job with other settings) starts afresh.
    parent_file = run_dir / "parent_version"
    if not parent_file.exists() or parent_file.read_text() != champion["version"]:
        shutil.rmtree(run_dir / "checkpoints", ignore_errors=True)
    parent_file.write_text(champion["version"])
    if workers:
        result = _train_on_ray(store, champion["adapter_path"], model, samples, config, workers, ray_address, run_dir, on_step, launch)
    else:
        try:
            result = train_grpo_round(model, samples, config, resume=True, on_step=on_step)
        except CheckpointMismatch:
            shutil.rmtree(run_dir / "checkpoints", ignore_errors=True)
            result = train_grpo_round(model, samples, config, resume=True, on_step=on_step)
    candidate = save_lora_adapter(model, run_dir / "adapter")
    # trained under the champion's prompt policy (its captured ids hold it): served under it too,
    # so the gate compares the weights alone (docs/training.md, "Both at once")
    (candidate / PROMPT_POLICY_FILE).unlink(missing_ok=True)
    carry_prompt(champion["adapter_path"], candidate)
    registry.set_candidate(str(candidate), batch, champion["version"])
    advantages = tables["advantages"]
    groups = advantages.group_by("group_key").agg(pl.col("zero_variance").first())
    summary = RoundSummary(
        batch=batch,
        parent_version=champion["version"],
        parent_adapter=champion["adapter_path"],
        candidate_adapter=str(candidate),
        losses=[s.loss for s in result.steps],
        grad_norms=[s.grad_norm for s in result.steps],
        kl_to_behaviour=kl_to_behaviour(
            model, samples, tokenizer.pad_token_id, kl_samples, config.micro_batch_size or 16, config.seed
        ),
        num_samples=result.num_samples,
        dropped_zero_advantage=result.num_dropped_zero_advantage,
        resumed_from=result.resumed_from,
        final_step=result.final_step,
        training_seconds=result.seconds,
        reward_mean=float(advantages["reward"].mean()),
        reward_std=float(advantages["reward"].std() or 0.0),
        zero_variance_share=float(groups["zero_variance"].mean()),
        negate_advantages=negate_advantages,
        config=config.to_dict(),
        turns_captured=len(captured),
        turns_text=text.turns,
        text_turns_skipped=len(text.skipped),
        text_temperature_assumed=text.assumed_temperature,
        text_held_out_trajectories=text.held_out_trajectories,
        update_rule=update_rule,
        sources=sorted({s for s in tables["trajectories"].filter(pl.col("agent_id").is_in(trained_agents))["source"].to_list() if s}),
    )
    write_round_summary(summary, run_dir)
    return summary, result.steps


def _train_on_ray(store: PolicyStore, adapter: str, model, samples: list[TrainingSample], config: GRPOTrainerConfig, workers: int,
                  ray_address: str | None, run_dir: Path, on_step, launch) -> Any:  # fmt: skip
    """The update of :func:`train_candidate` on ``workers`` Ray Train workers, driven from a
    process of its own (:func:`~flow_assets.cluster.ray_training.run_driver`); ``model`` (this
    process's copy) gets the trained weights. Checkpoints of another round are removed here,
    before the workers start, as the in-process path does."""
    from peft import set_peft_model_state_dict
    from safetensors.torch import load_file

    from flow_assets.cluster.ray_training import run_driver
    from flow_assets.policy.trainer import CheckpointMismatch, GRPORoundTrainer, TrainingPaused

    try:
        GRPORoundTrainer(model, samples, config).resume_from_latest()
    except CheckpointMismatch:
        shutil.rmtree(run_dir / "checkpoints", ignore_errors=True)
    result, trained = run_driver(store, adapter, samples, config, workers, run_dir / "data_parallel", address=ray_address, launch=launch)
    set_peft_model_state_dict(model, load_file(str(trained / "adapter_model.safetensors")))
    for metrics in result.steps if on_step else ():
        if result.resumed_from is None or metrics.step > result.resumed_from:
            # the steps are reported once the update is over: a pause asked meanwhile has nothing left to pause
            with contextlib.suppress(TrainingPaused):
                on_step(metrics)
    return result


# -- evaluation ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class EvaluationConfig:
    """Held-out evaluation and the promotion gate's thresholds.

    Each field's description is its ``metadata["description"]`` (:mod:`flow_assets.core.config`).
    """

    max_tasks: int = field(default=500, metadata={"description": (
        "held-out tasks evaluated (``task_sample`` says which N; fixed for a given source).")})
    task_sample: Literal["first", "spread"] = field(default="first", metadata={"description": (
        "which ``max_tasks`` held-out tasks: the ``first`` N in the source's order, or N ``spread`` over the split by a "
        "fixed seeded sample (for sources listed category by category, such as BFCL, whose first N would be one category).")})
    concurrency: int = field(default=128, metadata={"description": (
        "agents running at once (per policy and mode; four run side by side).")})
    timeout_s: float = field(default=120.0, metadata={"description": (
        "an agent running longer counts as a failure, seconds.")})
    modes: tuple[Literal["greedy", "sampled"], ...] = field(default=("greedy", "sampled"), metadata={"description": (
        "``greedy`` (T = 0) and / or ``sampled`` (T = ``sampled_temperature``); the gate's metric must be one.")})
    sampled_temperature: float = field(default=1.0, metadata={"description": (
        "the temperature of the ``sampled`` mode; 1 (the policy's own distribution) by default; a small real model is "
        "usually served cooler (the real-model demo evaluates and collects at 0.7).")})
    dtype: Literal["float32", "bfloat16"] = field(default="float32", metadata={"description": (
        "the precision the evaluated policies' weights are served in (transformers backend). ``bfloat16`` evaluates "
        "faster on a CPU with bfloat16 matrix units (AMX) or a GPU; both sides of the comparison use it, and the "
        "rollouts that train are still sampled in float32, the precision the trainer recomputes their log-probs in.")})
    seed: int | None = field(default=0, metadata={"description": (
        "sampling seed of the held-out rollouts: the rollout of a task draws the same random numbers under every policy "
        "evaluated (common random numbers: the paired comparison's variance drops, and a policy scores the same each time "
        "it is evaluated); ``None``: unseeded.")})
    gate: GateConfig = field(default_factory=GateConfig, metadata={"description": "the promotion gate's thresholds."})

    def held_out_tasks(self, source: TaskSource) -> list[Task]:
        """The held-out tasks this evaluation runs: ``max_tasks`` of ``source``'s held-out split,
        chosen as ``task_sample`` says (``spread``: :func:`spread_sample` with seed 0, always the same)."""
        held_out = source.tasks("held_out")
        if self.task_sample == "spread":
            return spread_sample(held_out, self.max_tasks, seed=0)
        return held_out[: self.max_tasks]

    def __post_init__(self) -> None:
        if not self.modes or set(self.modes) - set(MODES):
            raise ValueError(f"modes must be some of {sorted(MODES)}, got {self.modes!r}")
        if self.gate.metric not in self.modes:
            raise ValueError(f"the gate's metric {self.gate.metric!r} is not among the evaluated modes {self.modes!r}")
        if not self.sampled_temperature > 0:
            raise ValueError(f"sampled_temperature must be > 0, got {self.sampled_temperature}")
        if self.dtype not in ("float32", "bfloat16"):
            raise ValueError(f"dtype must be 'float32' or 'bfloat16', got {self.dtype!r}")

    @property
    def temperatures(self) -> dict[str, float]:
        """Sampling temperature of each evaluated mode."""
        return {mode: 0.0 if mode == "greedy" else self.sampled_temperature for mode in self.modes}


#: the evaluation modes
MODES = ("greedy", "sampled")


@dataclass(frozen=True)
class EvaluationResult:
    """What ``evaluate_candidate`` found (``evaluation.json``).

    Attributes:
        report: :func:`~flow_assets.rl.evaluation.compare_policies`' report.
        gate_config: the thresholds it was gated with.
        gate: one :class:`~flow_assets.rl.gate.GateResult` per check (``gain``, ``finite_loss``,
            ``kl_bound``).
        generation_seconds: wall time of the agents' work.
    """

    report: dict[str, Any]
    gate_config: GateConfig
    gate: tuple[GateResult, ...]
    generation_seconds: float

    @property
    def passed(self) -> bool:
        """Every check passed."""
        return all(r.passed for r in self.gate)


def write_evaluation(result: EvaluationResult, run_dir: Path) -> Path:
    """Write ``run_dir/evaluation.json`` atomically."""
    path = Path(run_dir) / "evaluation.json"
    write_json_atomic(path, dataclasses.asdict(result), sort_keys=True)
    return path


def read_evaluation(run_dir: Path) -> EvaluationResult:
    """Read ``run_dir/evaluation.json``.

    Raises:
        FileNotFoundError: the round has not been evaluated.
    """
    raw = json.loads((Path(run_dir) / "evaluation.json").read_text())
    return EvaluationResult(
        raw["report"], GateConfig(**raw["gate_config"]), tuple(GateResult(**g) for g in raw["gate"]), raw["generation_seconds"]
    )


def gate_results(summary: RoundSummary, report: dict[str, Any], gate: GateConfig) -> tuple[GateResult, ...]:
    """The gate's three checks on a round (:mod:`flow_assets.rl.gate`)."""
    return (
        check_gain(report, gate),
        check_finite_loss(summary.losses, summary.grad_norms),
        check_kl(summary.kl_to_behaviour, gate),
    )


def evaluate_agents(
    store: PolicyStore,
    source: TaskSource,
    agent: AgentFn,
    agent_id: str,
    tasks: list[Task],
    policies: dict[str, AdapterRef],
    config: EvaluationConfig,
    scratch_dir: str | Path,
    workers: int = 0,
    ray_address: str | None = None,
) -> tuple[pl.DataFrame, float]:
    """Every policy's agents on ``tasks`` in each of ``config.modes`` (greedy T = 0, sampled at
    ``config.sampled_temperature``), one policy after the other through one in-process gateway
    (:func:`~flow_assets.serving.agents.evaluation.agents_rows` says why); the rollouts do not land
    (held-out tasks never train). With ``workers`` > 0, over that many Ray rollout
    workers instead, each a gateway replica with its shard of the tasks
    (:mod:`flow_assets.cluster.ray_rollouts`), on the cluster at ``ray_address`` (``None``: a
    local one).

    Before and after, the memory the allocator kept from the phase before (a training run's
    tensors, the decoding cache) goes back to the system (:func:`~flow_assets.core.memory.release_free_memory`),
    so a process that trains and then evaluates peaks at the larger of the two, not their sum.

    Returns:
        Rows of :data:`~flow_assets.rl.evaluation.EVAL_SCHEMA` and the wall time, seconds.
    """
    started = time.perf_counter()
    if workers:
        from flow_assets.cluster.ray_rollouts import run_eval_driver

        rows = run_eval_driver(store, source, agent, agent_id, tasks, policies, config, workers, Path(scratch_dir) / "rollout_workers",
                               address=ray_address)  # fmt: skip
        return rows, time.perf_counter() - started
    from flow_assets.serving.gateway.serve import serve_policy  # the web stack, only where a gateway is served

    gc.collect()  # a trained model's reference cycles (PEFT wrappers) go before the release
    release_free_memory()
    with serve_policy(store, scratch_dir, extra=policies, dtype=config.dtype) as server:
        rows = agents_rows(server.url, source.score, agent, agent_id, tasks, list(policies), config.temperatures, config.concurrency, config.timeout_s,
                           config.seed)  # fmt: skip
    release_free_memory()
    return pl.DataFrame(rows, schema=EVAL_SCHEMA), time.perf_counter() - started


def evaluate_candidate(
    store: PolicyStore,
    source: TaskSource,
    agent: AgentFn,
    agent_id: str,
    summary: RoundSummary,
    config: EvaluationConfig,
    workers: int = 0,
    ray_address: str | None = None,
) -> tuple[pl.DataFrame, EvaluationResult]:
    """Candidate vs the champion it grew from, on ``config.held_out_tasks`` (``max_tasks`` of them), and
    the gate's verdict; writes ``evaluation.json`` into the round's directory. ``workers`` /
    ``ray_address``: as :func:`evaluate_agents` (0: in process)."""
    run_dir = store.round_dir(summary.batch)
    held_out = config.held_out_tasks(source)
    policies = {
        "candidate": AdapterRef("candidate", summary.candidate_adapter),
        "champion": AdapterRef(summary.parent_version, summary.parent_adapter),
    }
    rows, seconds = evaluate_agents(store, source, agent, agent_id, held_out, policies, config, run_dir, workers, ray_address)
    report = compare_policies(rows)
    result = EvaluationResult(report, config.gate, gate_results(summary, report, config.gate), seconds)
    write_evaluation(result, run_dir)
    return rows, result


def evaluate_version(
    store: PolicyStore,
    source: TaskSource,
    agent: AgentFn,
    agent_id: str,
    version: AdapterRef,
    config: EvaluationConfig,
    scratch_dir: str | Path,
) -> tuple[pl.DataFrame, dict[str, Any], float]:
    """One registry version's agents on ``config.held_out_tasks`` (the same
    tasks, modes and temperatures a round's gate uses; ``config.gate`` is not read): what
    ``training.evaluate`` answers.

    Returns:
        Rows of :data:`~flow_assets.rl.evaluation.EVAL_SCHEMA` (``policy`` = the version),
        :func:`~flow_assets.rl.evaluation.summarise_policy`'s report, and the wall time, seconds.

    Raises:
        OSError: the base model or the version's adapter cannot be loaded.
    """
    held_out = config.held_out_tasks(source)
    rows, seconds = evaluate_agents(store, source, agent, agent_id, held_out, {version.version: version}, config, scratch_dir)
    return rows, summarise_policy(rows), seconds


# -- promotion -------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Promotion:
    """A promotion: the new champion ``version`` (from ``previous``), its adapter, the metrics and
    the reason recorded in the registry; ``challenger``: it entered live A/B against ``previous``
    instead of replacing it."""

    version: str
    previous: str
    adapter_path: str
    metrics: dict[str, Any]
    reason: str
    challenger: bool = False


def promote_candidate(store: PolicyStore, registry: Registry, batch: str, by: str, live_ab_share: float = 0.0) -> Promotion:
    """Make the round's candidate the champion, after re-checking its stored gate; with
    ``live_ab_share`` > 0 it becomes the challenger instead, served to that share of live
    sessions until the live A/B decides (``ab_test_report``).

    Raises:
        RoundError: a gate check failed, the champion changed since the candidate's parent
            (a candidate trained from an old champion must not replace a newer one), or (live
            A/B) another challenger is still being tested.
        FileNotFoundError: the round was not trained or evaluated.
    """
    run_dir = store.round_dir(batch)
    summary, evaluation = read_round_summary(run_dir), read_evaluation(run_dir)
    results = gate_results(summary, evaluation.report, evaluation.gate_config)
    failed = [r for r in results if not r.passed]
    if failed:
        raise RoundError("promotion refused: " + "; ".join(f"{r.name}: {r.reason}" for r in failed))
    champion = require_champion(registry)
    if champion["version"] != summary.parent_version:
        raise RoundError(
            f"candidate of batch {batch} was trained from {summary.parent_version}, but the champion is now {champion['version']}"
        )
    if live_ab_share > 0 and registry.challenger():
        raise RoundError(f"{registry.challenger()['version']} is still in live A/B against {champion['version']}; this candidate waits for its decision")
    version = registry.next_version()
    target = store.adapter_dir(version)
    if target.exists():
        shutil.rmtree(target)
    shutil.copytree(summary.candidate_adapter, target)
    metric = evaluation.gate_config.metric
    mode = evaluation.report[metric]
    metrics = {
        "batch": batch,
        f"{metric}_success": mode["candidate"]["success_rate"]["rate"],
        "gain": mode["gain"],
        "mcnemar_p": mode["mcnemar"]["p_value"],
        "kl_to_behaviour": summary.kl_to_behaviour,
    }
    reason = "; ".join(r.reason for r in results)
    if live_ab_share > 0:
        registry.start_challenger(version, str(target), metrics, live_ab_share, by=by, reason=f"passed the held-out gate ({reason}); live A/B at {live_ab_share:.0%}")
    else:
        registry.promote(version, str(target), metrics, by=by, reason=reason)
    return Promotion(version, champion["version"], str(target), metrics, reason, challenger=live_ab_share > 0)


def finite_metrics(metrics: dict[str, Any]) -> dict[str, float]:
    """The finite float entries of ``metrics`` (what Dagster metadata can plot)."""
    return {k: v for k, v in metrics.items() if isinstance(v, float) and math.isfinite(v)}
