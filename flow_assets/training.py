"""Training rounds: base policy, rollout collection, GRPO checkpoint, evaluation, gated promotion.

    base_policy                      (once)  tiny model + SFT warm start, or the user's model
    collect_rollouts_job             (op)    champion answers train tasks, G rollouts each -> landing/
    [new_logs_sensor + log_batch_job]        interaction_logs -> trajectories -> rewards -> advantages
    training_round_job  (per batch, pool "training"):
        policy_checkpoint -> evaluation_report (+ blocking checks) -> promoted_adapter

Files of one round live in ``<models_root>/runs/<batch key>/``: ``checkpoints/``, ``adapter/`` (the
candidate), ``round.json`` (training summary) and ``evaluation.json`` (report + gate).
"""

import dataclasses
import json
import math
import shutil
import time
from pathlib import Path

import numpy as np
import polars as pl
import torch
from dagster import (
    AssetCheckResult,
    AssetCheckSeverity,
    AssetCheckSpec,
    AssetExecutionContext,
    Config,
    Failure,
    MaterializeResult,
    MetadataValue,
    OpExecutionContext,
    asset,
    job,
    op,
)
from pydantic import Field

from flow_assets.data_plane import advantages
from flow_assets.metadata import preview_table
from flow_assets.partitions import log_batches
from flow_assets.policy.evaluate import evaluate_policy
from flow_assets.policy.lora import save_lora_adapter
from flow_assets.policy.rollouts import batch_id_for, rollout_trajectories, training_samples, write_jsonl
from flow_assets.policy.sampling import SamplingConfig, completion_logprobs
from flow_assets.policy.sft import SFTConfig, sft_train
from flow_assets.policy.tiny_model import TinyModelConfig, save_tiny_policy
from flow_assets.policy.trainer import GRPOTrainerConfig, config_to_dict, train_grpo_round
from flow_assets.rl.evaluation import compare_policies
from flow_assets.rl.gate import GateConfig, check_finite_loss, check_gain, check_kl
from flow_assets.rl.grpo_loss import GRPOLossConfig, k3_kl
from resources.landing import LogLanding
from resources.lake import TrajectoryLake
from resources.policy import PolicyModel
from resources.registry import AdapterRegistry
from resources.tasks import TaskSourceResource

GROUP = "training"
_TINY, _SFT, _TRAIN = TinyModelConfig(), SFTConfig(), GRPOTrainerConfig()  # defaults live in the pure configs
POOL = "training"  # dagster.yaml: pools default_limit 1, granularity run -> one round at a time


def _round_dir(policy: PolicyModel, key: str) -> Path:
    return Path(policy.models_root) / "runs" / key


def _write_json(path: Path, content: dict) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(content, indent=2, sort_keys=True))
    tmp.replace(path)


def _champion(registry: AdapterRegistry) -> dict:
    champ = registry.champion()
    if champ is None:
        raise Failure(f"no champion in {registry.path}: materialise base_policy first")
    return champ


# -- base policy ----------------------------------------------------------------------------------
class BasePolicyConfig(Config):
    """The tiny demo model and its supervised warm start (ignored when base_model_path is set)."""

    hidden_size: int = Field(_TINY.hidden_size, description="model width")
    intermediate_size: int = Field(_TINY.intermediate_size, description="MLP width")
    num_hidden_layers: int = Field(_TINY.num_hidden_layers, description="decoder blocks")
    num_attention_heads: int = Field(_TINY.num_attention_heads, description="attention heads")
    sft_demonstrations: int = Field(1000, description="train-split tasks used as demonstrations")
    sft_steps: int = Field(_SFT.steps, description="SFT optimizer steps")
    sft_batch_size: int = Field(_SFT.batch_size, description="demonstrations per SFT step")
    sft_learning_rate: float = Field(_SFT.learning_rate, description="SFT learning rate")
    seed: int = Field(0, description="model init and SFT order seed")


@asset(group_name=GROUP, kinds={"pytorch"})
def base_policy(
    context: AssetExecutionContext,
    config: BasePolicyConfig,
    policy: PolicyModel,
    tasks: TaskSourceResource,
    registry: AdapterRegistry,
) -> MaterializeResult:
    """The base model every adapter sits on, and champion ``v0`` (an identity LoRA adapter).

    Default: a tiny Llama-style model with a character tokenizer, saved with ``save_pretrained``
    and warm-started by SFT on demonstrations of the task source's train split. With
    ``base_model_path`` set, the user's model is registered as it is.
    """
    started = time.perf_counter()
    meta: dict = {}
    if policy.base_model_path is None:
        base = policy.base_path
        if base.exists():
            shutil.rmtree(base)
        save_tiny_policy(
            base,
            TinyModelConfig(
                hidden_size=config.hidden_size,
                intermediate_size=config.intermediate_size,
                num_hidden_layers=config.num_hidden_layers,
                num_attention_heads=config.num_attention_heads,
                seed=config.seed,
            ),
        )
        model, tokenizer = policy.load()
        demos = [(t.prompt, t.demonstration) for t in tasks.source().tasks("train")[: config.sft_demonstrations]]
        sft = sft_train(
            model, tokenizer, demos, SFTConfig(
                steps=config.sft_steps,
                batch_size=config.sft_batch_size,
                learning_rate=config.sft_learning_rate,
                seed=config.seed,
            ),
        )
        model.save_pretrained(str(base))
        meta.update(
            sft_demonstrations=len(demos),
            sft_steps=sft.steps,
            sft_final_loss=MetadataValue.float(float(np.mean(sft.losses[-10:]))),
            sft_seconds=MetadataValue.float(sft.seconds),
            parameters=sum(p.numel() for p in model.parameters()),
        )
    model, _ = policy.load()
    v0 = policy.adapter_dir("v0")
    if v0.exists():
        shutil.rmtree(v0)
    save_lora_adapter(policy.new_adapter(model), v0)
    registry.promote("v0", str(v0), {"base": str(policy.base_path)}, by=f"dagster run {context.run_id}", reason="base policy (SFT warm start)", action="register")
    return MaterializeResult(metadata={**meta, "base_path": str(policy.base_path), "champion": "v0", "seconds": time.perf_counter() - started})


# -- rollout collection ---------------------------------------------------------------------------
class CollectConfig(Config):
    """One collection: the champion answers ``tasks_per_batch`` train tasks, ``group_size`` times each."""

    tasks_per_batch: int = Field(512, description="train tasks per batch")
    group_size: int = Field(8, description="rollouts per task (GRPO group size G)")
    temperature: float = Field(1.0, description="sampling temperature")
    top_p: float = Field(1.0, description="nucleus sampling threshold")
    seed: int = Field(0, description="base seed; the batch number is added to it")


@op
def collect_rollouts(
    context: OpExecutionContext,
    config: CollectConfig,
    policy: PolicyModel,
    tasks: TaskSourceResource,
    registry: AdapterRegistry,
    landing: LogLanding,
) -> str:
    """Sample the champion on a batch of train tasks, score each rollout with the verifier, and
    write the batch as canonical JSONL into the landing directory (``.tmp`` then rename), where
    ``new_logs_sensor`` picks it up. Returns the landed file's path."""
    champ = _champion(registry)
    source = tasks.source()
    out_dir = Path(landing.directory) / tasks.agent_id.replace(":", "-")
    out_dir.mkdir(parents=True, exist_ok=True)
    batch_number = len(list(out_dir.glob("*.jsonl")))
    seed = config.seed + batch_number
    train = source.tasks("train")
    rng = np.random.default_rng(seed)
    chosen = [train[i] for i in rng.choice(len(train), size=min(config.tasks_per_batch, len(train)), replace=False)]
    sampling = SamplingConfig(
        num_samples=config.group_size, temperature=config.temperature, top_p=config.top_p,
        max_new_tokens=policy.max_new_tokens, seed=seed,
    )
    started = time.perf_counter()
    rollouts = policy.sample([t.prompt for t in chosen], sampling, adapter_path=champ["adapter_path"])
    generation_seconds = time.perf_counter() - started
    scores = [source.score(chosen[r.prompt_index], r.completion_text) if r.error is None else 0.0 for r in rollouts]
    batch_id = batch_id_for(champ["version"], [t.task_id for t in chosen], seed)
    trajectories = rollout_trajectories(chosen, rollouts, scores, tasks.agent_id, champ["version"], batch_id)
    target = out_dir / f"rollouts-{batch_number:04d}-{batch_id}.jsonl"
    tmp = target.with_name(target.name + ".tmp")
    tmp.write_bytes(write_jsonl(trajectories))
    tmp.rename(target)
    context.add_output_metadata(
        {
            "file": str(target),
            "champion": champ["version"],
            "rollouts": len(rollouts),
            "failed_rollouts": sum(r.error is not None for r in rollouts),
            "success_rate": MetadataValue.float(float(np.mean([s >= 1.0 for s in scores]))),
            "generation_seconds": MetadataValue.float(generation_seconds),
        }
    )
    return str(target)


@job(description="The champion answers a batch of train tasks; the batch lands for new_logs_sensor.")
def collect_rollouts_job():
    """Collect one batch of rollouts."""
    collect_rollouts()


# -- training round -------------------------------------------------------------------------------
class TrainConfig(Config):
    """GRPO round settings (stored with every checkpoint)."""

    learning_rate: float = Field(_TRAIN.learning_rate, description="AdamW learning rate")
    num_epochs: int = Field(_TRAIN.num_epochs, description="passes over the batch")
    minibatch_size: int = Field(_TRAIN.minibatch_size, description="completions per optimizer step")
    max_grad_norm: float = Field(_TRAIN.max_grad_norm, description="gradient clipping norm")
    eps_low: float = Field(_TRAIN.loss.eps_low, description="clip range below 1")
    eps_high: float = Field(_TRAIN.loss.eps_high, description="clip range above 1")
    beta: float = Field(_TRAIN.loss.beta, description="k3 KL weight to the reference (0: no reference pass)")
    loss_type: str = Field(_TRAIN.loss.loss_type, description="token aggregation: grpo | bnpo | dapo | dr_grpo")
    checkpoint_every: int = Field(4, description="steps between checkpoints")
    negate_advantages: bool = Field(False, description="train AGAINST the advantages (tests the gate)")
    seed: int = Field(0, description="minibatch order and RNG seed")

    def trainer_config(self, output_dir: Path) -> GRPOTrainerConfig:
        """The pure trainer's config for a round writing into ``output_dir``."""
        return GRPOTrainerConfig(
            output_dir=str(output_dir),
            learning_rate=self.learning_rate,
            num_epochs=self.num_epochs,
            minibatch_size=self.minibatch_size,
            max_grad_norm=self.max_grad_norm,
            loss=GRPOLossConfig(eps_low=self.eps_low, eps_high=self.eps_high, beta=self.beta, loss_type=self.loss_type),
            checkpoint_every=self.checkpoint_every,
            seed=self.seed,
        )


def _kl_to_behaviour(model, samples, pad_id: int) -> float:
    """Mean KL(behaviour || trained policy), nats per token, on the batch's own completions.

    The completions were sampled from the behaviour policy, so the k3 estimator
    ``(r - 1) - log r`` with ``r = pi_new / pi_old`` (Schulman 2020) is unbiased and
    non-negative for KL(pi_old || pi_new); ``k3_kl(a, b)`` computes it for ``d = b - a``.
    """
    with_lp = [s for s in samples if s.behaviour_logprobs and s.completion_ids]
    if not with_lp:
        return 0.0
    with torch.no_grad():
        logp, mask = completion_logprobs(model, [s.prompt_ids for s in with_lp], [s.completion_ids for s in with_lp], pad_id)
    old = torch.zeros_like(logp)
    for i, s in enumerate(with_lp):
        old[i, : len(s.behaviour_logprobs)] = torch.tensor(s.behaviour_logprobs)
    return float((k3_kl(old, logp) * mask).sum() / mask.sum())


@asset(partitions_def=log_batches, group_name=GROUP, kinds={"pytorch"}, deps=[advantages], pool=POOL)
def policy_checkpoint(
    context: AssetExecutionContext,
    config: TrainConfig,
    lake: TrajectoryLake,
    policy: PolicyModel,
    tasks: TaskSourceResource,
    registry: AdapterRegistry,
) -> MaterializeResult:
    """A candidate LoRA adapter: the champion trained on this batch's groups with the clipped
    GRPO surrogate. Checkpoints every N steps; a re-run after a kill resumes from the latest."""
    key = context.partition_key
    samples = training_samples(
        lake.read_partition("steps", key),
        lake.read_partition("step_advantages", key),
        lake.read_partition("trajectories", key),
        tasks.agent_id,
    )
    if not samples:
        raise Failure(f"batch {key} has no rollouts of the trainable policy {tasks.agent_id!r}")
    if config.negate_advantages:
        samples = [dataclasses.replace(s, advantage=-s.advantage) for s in samples]
    champ = _champion(registry)
    model, tokenizer = policy.load(champ["adapter_path"], trainable=True)
    run_dir = _round_dir(policy, key)
    run_dir.mkdir(parents=True, exist_ok=True)
    # checkpoints of an interrupted run are resumed only if they grew from the same champion
    parent_file = run_dir / "parent_version"
    if parent_file.exists() and parent_file.read_text() != champ["version"]:
        shutil.rmtree(run_dir / "checkpoints", ignore_errors=True)
    parent_file.write_text(champ["version"])
    trainer_cfg = config.trainer_config(run_dir / "checkpoints")
    result = train_grpo_round(model, samples, trainer_cfg, resume=True)
    candidate = save_lora_adapter(model, run_dir / "adapter")
    kl = _kl_to_behaviour(model, samples, tokenizer.pad_token_id)
    adv = lake.read_partition("advantages", key)
    groups = adv.group_by("group_key").agg(pl.col("zero_variance").first())
    steps = pl.DataFrame([vars(s) for s in result.steps]) if result.steps else pl.DataFrame()
    lake.write_partition("training_steps", key, steps)
    summary = {
        "batch": key,
        "parent_version": champ["version"],
        "parent_adapter": champ["adapter_path"],
        "candidate_adapter": str(candidate),
        "losses": [s.loss for s in result.steps],
        "grad_norms": [s.grad_norm for s in result.steps],
        "kl_to_behaviour": kl,
        "num_samples": result.num_samples,
        "dropped_zero_advantage": result.num_dropped_zero_advantage,
        "resumed_from": result.resumed_from,
        "final_step": result.final_step,
        "training_seconds": result.seconds,
        "reward_mean": float(adv["reward"].mean()),
        "reward_std": float(adv["reward"].std() or 0.0),
        "zero_variance_share": float(groups["zero_variance"].mean()),
        "negate_advantages": config.negate_advantages,
        "config": config_to_dict(trainer_cfg),
    }
    _write_json(run_dir / "round.json", summary)
    last = result.steps[-1] if result.steps else None
    return MaterializeResult(
        metadata={
            "parent_champion": champ["version"],
            "candidate_adapter": str(candidate),
            "steps": result.final_step,
            "resumed_from_step": result.resumed_from if result.resumed_from is not None else -1,
            "samples": result.num_samples,
            "dropped_zero_advantage": result.num_dropped_zero_advantage,
            "loss": MetadataValue.float(last.loss if last else float("nan")),
            "grad_norm": MetadataValue.float(last.grad_norm if last else float("nan")),
            "clip_fraction": MetadataValue.float(float(np.mean([s.clip_fraction for s in result.steps])) if last else 0.0),
            "kl_to_behaviour": MetadataValue.float(kl),
            "reward_mean": MetadataValue.float(summary["reward_mean"]),
            "reward_std": MetadataValue.float(summary["reward_std"]),
            "zero_variance_share": MetadataValue.float(summary["zero_variance_share"]),
            "training_seconds": MetadataValue.float(result.seconds),
            "steps_preview": preview_table(steps, n=10) if last else MetadataValue.text("no training step"),
        }
    )


class EvaluationConfig(Config):
    """Held-out evaluation and the promotion gate's thresholds."""

    max_tasks: int = Field(500, description="held-out tasks evaluated (the first N, fixed order)")
    seed: int = Field(1234, description="sampling seed, the same for both policies")
    metric: str = Field("sampled", description="gate on 'sampled' (T=1) or 'greedy' success")
    min_gain: float = Field(0.0, description="least success-rate gain (0 = not worse)")
    require_significance: bool = Field(False, description="also require McNemar p < alpha")
    alpha: float = Field(0.05, description="significance level")
    max_kl: float = Field(0.5, description="bound on KL to the behaviour policy, nats/token")

    def gate(self) -> GateConfig:
        """The pure gate config."""
        return GateConfig(self.metric, self.min_gain, self.require_significance, self.alpha, self.max_kl)


GATE_CHECKS = ("gain", "finite_loss", "kl_bound")


def _gate_results(round_summary: dict, report: dict, gate: GateConfig):
    return [
        check_gain(report, gate),
        check_finite_loss(round_summary["losses"], round_summary["grad_norms"]),
        check_kl(round_summary["kl_to_behaviour"], gate),
    ]


@asset(
    partitions_def=log_batches,
    group_name=GROUP,
    kinds={"pytorch"},
    deps=[policy_checkpoint],
    pool=POOL,
    check_specs=[AssetCheckSpec(name, asset="evaluation_report", blocking=True) for name in GATE_CHECKS],
)
def evaluation_report(
    context: AssetExecutionContext,
    config: EvaluationConfig,
    lake: TrajectoryLake,
    policy: PolicyModel,
    tasks: TaskSourceResource,
) -> MaterializeResult:
    """Candidate vs champion on the same held-out tasks, greedy and sampled: success rate, mean
    reward and completion length with 95% intervals, McNemar and paired bootstrap; the gate's
    blocking checks (gain, finite loss, KL bound) decide whether promotion may run."""
    key = context.partition_key
    run_dir = _round_dir(policy, key)
    summary = json.loads((run_dir / "round.json").read_text())
    source = tasks.source()
    held_out = source.tasks("held_out")[: config.max_tasks]
    started = time.perf_counter()
    frames = []
    for name, adapter in (("candidate", summary["candidate_adapter"]), ("champion", summary["parent_adapter"])):
        loaded = policy.load(adapter)
        sample_fn = lambda prompts, cfg, loaded=loaded, adapter=adapter: policy.sample(prompts, cfg, adapter, loaded)  # noqa: E731
        frames.append(evaluate_policy(sample_fn, held_out, source, name, policy.max_new_tokens, config.seed))
    generation_seconds = time.perf_counter() - started
    rows = pl.concat(frames)
    lake.write_partition("evaluations", key, rows)
    report = compare_policies(rows)
    gate = config.gate()
    results = _gate_results(summary, report, gate)
    _write_json(
        run_dir / "evaluation.json",
        {"report": report, "gate_config": vars(gate), "generation_seconds": generation_seconds,
         "gate": {r.name: {"passed": r.passed, "reason": r.reason} for r in results}},
    )
    flat = {
        f"{mode}_{policy_name}_success": MetadataValue.float(report[mode][policy_name]["success_rate"]["rate"])
        for mode in report for policy_name in ("candidate", "champion")
    }
    return MaterializeResult(
        metadata={
            **flat,
            "held_out_tasks": len(held_out),
            "gain": MetadataValue.float(report[gate.metric]["gain"] if gate.metric in report else float("nan")),
            "mcnemar_p": MetadataValue.float(report[gate.metric]["mcnemar"]["p_value"] if gate.metric in report else float("nan")),
            "report": MetadataValue.json(report),
            "generation_seconds": MetadataValue.float(generation_seconds),
        },
        check_results=[
            AssetCheckResult(check_name=r.name, passed=r.passed, severity=AssetCheckSeverity.ERROR, description=r.reason)
            for r in results
        ],
    )


@asset(partitions_def=log_batches, group_name=GROUP, deps=[evaluation_report], pool=POOL)
def promoted_adapter(context: AssetExecutionContext, policy: PolicyModel, registry: AdapterRegistry) -> MaterializeResult:
    """The candidate becomes the champion: re-checks the gate on the stored results, refuses a
    candidate trained from a champion that has since changed, then writes the registry
    atomically (version, adapter, metrics, who promoted it and why)."""
    key = context.partition_key
    run_dir = _round_dir(policy, key)
    summary = json.loads((run_dir / "round.json").read_text())
    evaluation = json.loads((run_dir / "evaluation.json").read_text())
    results = _gate_results(summary, evaluation["report"], GateConfig(**evaluation["gate_config"]))
    failed = [r for r in results if not r.passed]
    if failed:
        raise Failure("promotion refused: " + "; ".join(f"{r.name}: {r.reason}" for r in failed))
    champ = _champion(registry)
    if champ["version"] != summary["parent_version"]:
        raise Failure(f"candidate of batch {key} was trained from {summary['parent_version']}, but the champion is now {champ['version']}")
    version = f"v{sum(1 for e in registry.load()['history'] if e['action'] == 'promote') + 1}"
    target = policy.adapter_dir(version)
    if target.exists():
        shutil.rmtree(target)
    shutil.copytree(summary["candidate_adapter"], target)
    metric = evaluation["gate_config"]["metric"]
    mode = evaluation["report"][metric]
    metrics = {
        "batch": key,
        f"{metric}_success": mode["candidate"]["success_rate"]["rate"],
        "gain": mode["gain"],
        "mcnemar_p": mode["mcnemar"]["p_value"],
        "kl_to_behaviour": summary["kl_to_behaviour"],
    }
    reason = "; ".join(r.reason for r in results)
    registry.promote(version, str(target), metrics, by=f"dagster run {context.run_id} (partition {key})", reason=reason)
    return MaterializeResult(metadata={"champion": version, "previous": champ["version"], "adapter": str(target), "reason": reason, **{k: v for k, v in metrics.items() if isinstance(v, float) and math.isfinite(v)}})


training_assets = [base_policy, policy_checkpoint, evaluation_report, promoted_adapter]
