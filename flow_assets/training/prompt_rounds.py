"""Prompt-policy rounds (#30): a better prompt for an agent whose model flowopt cannot train,
learned from the agent's own flows and gated like an adapter round.

A round on one log batch (``docs/training.md``, "Prompt-policy rounds"):

1. **Demonstrations**: the batch's successful flows of the agent (text; proxy captures carry no
   token ids), one per task, never a held-out task (:func:`~flow_assets.policy.prompt_search.demonstration_pool`).
2. **Search** (DSPy's bootstrap few-shot with random search): candidate 0 is the champion prompt,
   candidates 1..n add ``k`` drawn demonstrations; all are scored on the same train tasks (none
   of the batch's, none held out), sampled; the best mean reward wins (ties: the earlier).
3. **Gate**: champion and winner on the held-out split, sampled at the same temperature, paired
   by task; McNemar's exact test (McNemar 1947; the exact binomial form on the discordant pairs).
   The winner passes only when it is not the champion itself, gains, and p < ``alpha``.

Every call of steps 2 and 3 goes through an in-process proxy to the upstream model
(:class:`~flow_assets.serving.gateway.upstream.Upstream`, :func:`proxy_scores`), or, for a hosted
policy (a LoRA adapter whose round schedule gave this turn to its prompt), through an in-process
hosting gateway serving the champion's adapter under each prompt (:func:`hosted_scores`: the
candidates differ from the champion by the prompt only), and lands in the round's own scratch
directory, never in the landing the sensors read (held-out flows must never train); what they cost
is summed from those flows' usage (:func:`landed_usage`), checked against the round's token budget
after each step, and recorded for the monthly budget (:mod:`flow_assets.training.budget`).

No Dagster here: :mod:`flow_assets.training.prompt_assets` wraps it.
"""

from __future__ import annotations

import asyncio
import json
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import polars as pl

from flow_assets.logs.schema import Trajectory
from flow_assets.policy.prompt import PromptPolicy, hosted_version
from flow_assets.policy.store import PolicyStore
from flow_assets.policy.prompt_search import Demonstration, best_candidate, demonstration_pool, fewshot_candidates
from flow_assets.rl.evaluation import EVAL_SCHEMA, compare_policies
from flow_assets.serving.agents.evaluation import evaluation_rows
from flow_assets.serving.agents.harness import AgentFn, HarnessConfig, run_rollouts
from flow_assets.serving.gateway.engine import AdapterRef, AdapterResolver
from flow_assets.tasks.sources import Task

if TYPE_CHECKING:
    from flow_assets.serving.gateway.upstream import Upstream


class PromptRoundError(RuntimeError):
    """A prompt round cannot run or must stop (no upstream, the champion is not a prompt policy,
    the round's token budget spent); the message says which and what was spent."""


@dataclass(frozen=True)
class PromptRoundSettings:
    """A prompt round's knobs.

    Attributes:
        k: demonstrations per candidate.
        num_candidates: candidates besides the champion prompt.
        search_tasks: train tasks every candidate is scored on.
        heldout_tasks: held-out tasks of the gate (``None``: the whole held-out split).
        temperature: sampling temperature of search and gate (the agents' deployed one).
        concurrency: agents at once per policy.
        seed: the candidates' draw and the search tasks' draw.
        min_score: the least reward that makes a flow a demonstration.
        max_round_tokens: upstream tokens (prompt + completion) the round may spend; ``None``: no cap.
            Checked after the search and after the gate: a search that spent it stops the round
            before the gate; a gate that spent it promotes nothing.
        alpha: the gate's significance level.
        reflection_calls: task evaluations GEPA may spend rewriting the winner's instructions
            (:mod:`flow_assets.training.prompt_reflection`); 0 (default): no reflective rewriting.
        reflection_minibatch: train tasks per GEPA minibatch.
    """

    k: int = 3
    num_candidates: int = 4
    search_tasks: int = 32
    heldout_tasks: int | None = None
    temperature: float = 0.5
    concurrency: int = 64
    seed: int = 0
    min_score: float = 1.0
    max_round_tokens: int | None = None
    alpha: float = 0.05
    reflection_calls: int = 0
    reflection_minibatch: int = 4


@dataclass(frozen=True)
class Usage:
    """Upstream tokens of some landed flows.

    Attributes:
        prompt_tokens / completion_tokens: summed from each trajectory's ``metadata`` (the usage the
            upstream reported; a turn without usage counts 0).
        trajectories: flows counted.
        unreported_turns: turns whose upstream reported no usage (their tokens are missing above).
    """

    prompt_tokens: int = 0
    completion_tokens: int = 0
    trajectories: int = 0
    unreported_turns: int = 0

    @property
    def total(self) -> int:
        """Prompt + completion tokens."""
        return self.prompt_tokens + self.completion_tokens

    def __add__(self, other: Usage) -> Usage:
        return Usage(self.prompt_tokens + other.prompt_tokens, self.completion_tokens + other.completion_tokens,
                     self.trajectories + other.trajectories, self.unreported_turns + other.unreported_turns)  # fmt: skip


def landed_usage(directory: Path) -> Usage:
    """:class:`Usage` of every trajectory in the JSONL files under ``directory`` (none: zero)."""
    prompt = completion = n = unreported = 0
    for path in sorted(Path(directory).rglob("*.jsonl")):
        for line in path.read_text().splitlines():
            meta = json.loads(line).get("metadata") or {}
            prompt += int(meta.get("prompt_tokens") or 0)
            completion += int(meta.get("completion_tokens") or 0)
            unreported += int(meta.get("usage_unreported_turns") or 0)
            n += 1
    return Usage(prompt, completion, n, unreported)


def server_failures(directory: Path) -> dict[str, int]:
    """Calls the model server failed (``metadata.failed_calls`` with a status of 500 or more:
    unreachable, timed out, crashed), per served version, in the trajectories under ``directory``."""
    counts: dict[str, int] = {}
    for path in sorted(Path(directory).rglob("*.jsonl")):
        for line in path.read_text().splitlines():
            for failure in (json.loads(line).get("metadata") or {}).get("failed_calls") or []:
                if int(failure.get("status") or 0) >= 500:
                    counts[failure.get("version", "")] = counts.get(failure.get("version", ""), 0) + 1
    return counts


def landed_flows(directory: Path) -> list[Trajectory]:
    """Every trajectory in the JSONL files under ``directory``, in file then line order."""
    return [Trajectory.model_validate_json(line) for p in sorted(Path(directory).rglob("*.jsonl")) for line in p.read_text().splitlines()]


def search_tasks_for(train: Sequence[Task], used: set[str], n: int, seed: int) -> list[Task]:
    """``n`` train tasks for the search, none of ``used`` (the batch's own tasks: their flows are
    the demonstrations), drawn with ``seed`` in task-id order.

    Raises:
        PromptRoundError: fewer than ``n`` such tasks."""
    free = sorted((t for t in train if t.task_id not in used), key=lambda t: t.task_id)
    if len(free) < n:
        raise PromptRoundError(f"the train split has {len(free)} tasks outside the batch, fewer than the {n} search tasks asked for")
    return random.Random(seed).sample(free, n)


def proxy_scores(upstream: Upstream, registry_path: Path, prompts: dict[str, PromptPolicy], tasks: Sequence[Task], score, agent: AgentFn,
                 agent_id: str, temperatures: dict[str, float], concurrency: int, scratch: Path) -> tuple[pl.DataFrame, Usage]:  # fmt: skip
    """Every prompt's agents on ``tasks`` (one rollout each per mode) through one in-process proxy
    to ``upstream``, all at once; the flows land under ``scratch/flows`` only.

    Args:
        registry_path: the registry the proxy resolves other names with (the prompts are served
            under their own keys, saved to ``scratch/prompts/<key>``).
        temperatures: mode name -> sampling temperature, e.g. ``{"sampled": 0.5, "greedy": 0.0}``.
        concurrency: agents at once per prompt and mode.

    Returns:
        Rows of :data:`~flow_assets.rl.evaluation.EVAL_SCHEMA` (``policy``: the prompt's key,
        ``mode``: the mode's name) and the :class:`Usage` of those rollouts.
    """
    # the web stack (FastAPI, httpx) only where a gateway is served: the code location imports this module
    from flow_assets.serving.gateway.app import Gateway
    from flow_assets.serving.gateway.server import GatewayServer

    refs = {name: AdapterRef(name, str(p.save(scratch / "prompts" / name))) for name, p in prompts.items()}
    landing = scratch / "flows"
    before = landed_usage(landing)
    gateway = Gateway(None, AdapterResolver(registry_path, refs), landing, upstream=upstream)
    with GatewayServer(gateway) as server:
        rows = _scores(server.url, list(refs), tasks, score, agent, agent_id, temperatures, concurrency, scratch.name)
    return rows, _minus(landed_usage(landing), before)


def hosted_scores(store: PolicyStore, adapter_dir: str | Path, prompts: dict[str, PromptPolicy], tasks: Sequence[Task], score, agent: AgentFn,
                  agent_id: str, temperatures: dict[str, float], concurrency: int, scratch: Path) -> tuple[pl.DataFrame, Usage]:  # fmt: skip
    """:func:`proxy_scores` for a hosted policy: every prompt served over the LoRA adapter of
    ``adapter_dir`` (its files copied under ``scratch/prompts/<key>`` with the prompt, by
    :func:`~flow_assets.policy.prompt.hosted_version`) by one in-process hosting gateway on
    ``store``'s base model; the flows land under ``scratch/flows`` only, with their token ids.

    Returns:
        As :func:`proxy_scores`; the :class:`Usage` counts the hosted policy's own tokens.

    Raises:
        FileNotFoundError: ``adapter_dir`` is not a LoRA adapter directory.
        OSError: the base model cannot be loaded.
    """
    from flow_assets.serving.gateway.serve import serve_policy  # the web stack only where a gateway is served

    refs = {name: AdapterRef(name, str(hosted_version(adapter_dir, p, scratch / "prompts" / name))) for name, p in prompts.items()}
    landing = scratch / "flows"
    before = landed_usage(landing)
    with serve_policy(store, landing, extra=refs) as server:
        rows = _scores(server.url, list(refs), tasks, score, agent, agent_id, temperatures, concurrency, scratch.name)
    return rows, _minus(landed_usage(landing), before)


def _scores(url: str, names: list[str], tasks: Sequence[Task], score, agent: AgentFn, agent_id: str, temperatures: dict[str, float],
            concurrency: int, batch: str) -> pl.DataFrame:  # fmt: skip
    """Every named policy's agents on ``tasks`` in every mode, all at once, through the gateway at ``url``."""
    runs = [(name, mode, t) for name in names for mode, t in temperatures.items()]

    async def everything():
        return await asyncio.gather(*(
            run_rollouts(url, agent, tasks, score, 1, agent_id=agent_id, batch=f"{batch}-{name}-{mode}", source="round",
                         config=HarnessConfig(concurrency, 3600.0, name, t, None))
            for name, mode, t in runs
        ))  # fmt: skip

    results = asyncio.run(everything())
    rows = [row for (name, mode, _), res in zip(runs, results) for row in evaluation_rows(res, name, mode)]
    return pl.DataFrame(rows, schema=EVAL_SCHEMA)


def _minus(a: Usage, b: Usage) -> Usage:
    return Usage(a.prompt_tokens - b.prompt_tokens, a.completion_tokens - b.completion_tokens, a.trajectories - b.trajectories,
                 a.unreported_turns - b.unreported_turns)  # fmt: skip


@dataclass(frozen=True)
class PromptSearch:
    """Step 2's outcome.

    Attributes:
        candidates: candidate 0 (the champion prompt) first.
        mean_rewards: each candidate's mean reward on the search tasks.
        best: index of the winner.
        demonstrations: the pool's size (successful flows, one per task).
        search_task_ids: the train tasks they were scored on.
        usage: what the search cost upstream.
    """

    candidates: list[PromptPolicy]
    mean_rewards: list[float]
    best: int
    demonstrations: int
    search_task_ids: list[str]
    usage: Usage


def search_prompt(champion: PromptPolicy, flows: Sequence[Trajectory], held_out_ids: Sequence[str], search_on: Sequence[Task],
                  score_candidates: Callable[[dict[str, PromptPolicy]], tuple[pl.DataFrame, Usage]],
                  settings: PromptRoundSettings) -> PromptSearch:  # fmt: skip
    """Steps 1 and 2 of the module docstring. ``score_candidates`` runs the prompts it is given
    (keys ``c0``, ``c1``, ...) on ``search_on`` (e.g. :func:`proxy_scores` bound to them)."""
    pool: list[Demonstration] = demonstration_pool(flows, settings.min_score, held_out=held_out_ids)
    candidates = fewshot_candidates(champion, pool, settings.k, settings.num_candidates, settings.seed) if pool else [champion]
    rows, usage = score_candidates({f"c{i}": c for i, c in enumerate(candidates)})
    scores = [rows.filter(pl.col("policy") == f"c{i}")["reward"].to_list() for i in range(len(candidates))]
    best = best_candidate(scores)
    means = [round(sum(s) / len(s), 4) if s else 0.0 for s in scores]
    return PromptSearch(candidates, means, best, len(pool), [t.task_id for t in search_on], usage)


def gate_report(rows: pl.DataFrame, alpha: float, candidate_is_champion: bool, failures: dict[str, int] | None = None) -> dict:
    """Step 3's verdict from the paired held-out rows of policies ``champion`` and ``candidate``
    (one ``sampled`` row per policy and task). ``failures``: calls the model server failed per
    policy (:func:`server_failures`); any makes the gate block, since a task lost to the server
    counts as the prompt's failure and the two sides need not have lost the same tasks.

    Returns:
        ``champion`` / ``candidate`` success rates, ``gain`` (candidate - champion, in success
        rate), ``mcnemar_p`` (exact), ``n_tasks``, ``server_failures``, ``passed`` and ``reason``.

    Raises:
        ValueError: as :func:`~flow_assets.rl.evaluation.compare_policies` (a policy missing, task sets differ).
    """
    r = compare_policies(rows)["sampled"]
    gain, p = float(r["gain"]), float(r["mcnemar"]["p_value"])
    failed = {k: v for k, v in sorted((failures or {}).items()) if v}
    passed = not candidate_is_champion and gain > 0 and p < alpha and not failed
    if candidate_is_champion:
        reason = "no candidate beat the champion prompt on the search tasks"
    elif failed:
        reason = (f"the model server failed {sum(failed.values())} calls of the gate ({', '.join(f'{k} {v}' for k, v in failed.items())}; "
                  f"gain {gain:+.3f}): the outcomes are not comparable, run the round again")  # fmt: skip
    elif passed:
        reason = f"gain {gain:+.3f} with McNemar p {p:.2g} < {alpha}"
    else:
        reason = f"gain {gain:+.3f} with McNemar p {p:.2g}: not significant at {alpha}" if gain > 0 else f"gain {gain:+.3f}: no gain"
    return {"champion": r["champion"]["success_rate"]["rate"], "candidate": r["candidate"]["success_rate"]["rate"], "gain": gain,
            "mcnemar_p": p, "n_tasks": r["n_tasks"], "server_failures": failed, "passed": passed, "reason": reason}  # fmt: skip


def check_token_budget(spent: Usage, settings: PromptRoundSettings, step: str) -> None:
    """Raises :class:`PromptRoundError` when ``spent`` reached ``settings.max_round_tokens``."""
    if settings.max_round_tokens is not None and spent.total >= settings.max_round_tokens:
        raise PromptRoundError(f"the round spent {spent.total} upstream tokens by the end of its {step}, "
                               f"its budget is {settings.max_round_tokens}: it stops here")  # fmt: skip
