"""Held-out agents as evaluation rows: every served policy's agents on the same tasks in each
mode, through one gateway, turned into :data:`~flow_assets.rl.evaluation.EVAL_SCHEMA` rows.

Shared by the in-process evaluation (:func:`flow_assets.training.rounds.evaluate_agents`) and the
Ray rollout workers (:mod:`flow_assets.cluster.ray_rollouts`), each of which runs it against a
gateway of its own.
"""

from __future__ import annotations

import asyncio
from typing import Any

from flow_assets.serving.agents.harness import AgentFn, HarnessConfig, RolloutResult, ScoreFn, run_rollouts
from flow_assets.tasks.sources import Task


def evaluation_rows(results: list[RolloutResult], policy: str, mode: str) -> list[dict[str, Any]]:
    """One :data:`~flow_assets.rl.evaluation.EVAL_SCHEMA` row per rollout (a failed one scores 0)."""
    return [
        {
            "policy": policy, "mode": mode, "task_id": r.task_id, "completion": r.answer, "reward": r.score,
            "success": r.success, "completion_tokens": r.completion_tokens, "llm_calls": r.llm_calls,
            "tool_calls": r.tool_calls,
        }
        for r in results
    ]  # fmt: skip


def agents_rows(url: str, score: ScoreFn, agent: AgentFn, agent_id: str, tasks: list[Task], names: list[str], temperatures: dict[str, float],
                concurrency: int, timeout_s: float, seed: int | None = None) -> list[dict[str, Any]]:  # fmt: skip
    """The agents of every served name in ``names`` on ``tasks`` in each mode of ``temperatures``
    (mode -> sampling temperature), through the gateway at ``url``: one name after the other, all
    of a name's modes at once, ``concurrency`` agents per name and mode, each cancelled after
    ``timeout_s`` seconds; nothing lands. Their :func:`evaluation_rows`, by name, then mode, then
    task. ``seed`` (:attr:`~flow_assets.serving.agents.harness.HarnessConfig.seed`) is the same
    for every name and mode: a task's rollout draws the same random numbers under each policy.

    One name at a time because each name is its own LoRA adapter, and the gateway's batcher
    decodes one adapter at a time: with two names in flight, every call of the other adapter at
    the head of its queue stops the running batch from taking in more calls until it has drained
    to its longest row, so continuous batching degrades into static batches, one per switch.
    """

    async def one_name(name: str) -> dict:
        runs = {
            (name, mode): run_rollouts(url, agent, tasks, score, 1, agent_id=agent_id,
                                       config=HarnessConfig(concurrency, timeout_s, name, temperature, None, land=False, seed=seed))
            for mode, temperature in temperatures.items()
        }  # fmt: skip
        return dict(zip(runs, await asyncio.gather(*runs.values())))

    results = {key: res for name in names for key, res in asyncio.run(one_name(name)).items()}
    return [row for (name, mode), res in results.items() for row in evaluation_rows(res, name, mode)]
