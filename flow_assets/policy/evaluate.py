"""Held-out evaluation of one policy: per task, greedy and sampled, scored by the verifier."""

from __future__ import annotations

from collections.abc import Sequence

import polars as pl

from flow_assets.policy.sampling import SamplingConfig
from flow_assets.tasks.sources import Task, TaskSource

EVAL_SCHEMA = {
    "policy": pl.String,
    "mode": pl.String,
    "task_id": pl.String,
    "completion": pl.String,
    "reward": pl.Float64,
    "success": pl.Boolean,
    "completion_tokens": pl.Int64,
}


def evaluate_policy(
    sample_fn,
    tasks: Sequence[Task],
    source: TaskSource,
    policy_name: str,
    max_new_tokens: int,
    seed: int = 1234,
) -> pl.DataFrame:
    """Answer every task once greedily (temperature 0) and once sampled (temperature 1).

    The sampled answers use a fixed ``seed``, so the same policy always gets the same numbers and
    two policies are compared on the same random stream.

    Args:
        sample_fn: ``fn(prompts, SamplingConfig) -> list[Rollout]`` (e.g. ``PolicyModel.sample``
            bound to one adapter).
        policy_name: stored in the ``policy`` column (``"candidate"`` / ``"champion"``).

    Returns:
        One row per (mode, task) with :data:`EVAL_SCHEMA`; a failed rollout counts as reward 0.
    """
    prompts = [t.prompt for t in tasks]
    rows = []
    for mode, temperature in (("greedy", 0.0), ("sampled", 1.0)):
        config = SamplingConfig(num_samples=1, temperature=temperature, max_new_tokens=max_new_tokens, seed=seed)
        for rollout in sample_fn(prompts, config):
            task = tasks[rollout.prompt_index]
            ok = rollout.error is None
            reward = float(source.score(task, rollout.completion_text)) if ok else 0.0
            rows.append(
                {
                    "policy": policy_name,
                    "mode": mode,
                    "task_id": task.task_id,
                    "completion": rollout.completion_text if ok else None,
                    "reward": reward,
                    "success": reward >= 1.0,
                    "completion_tokens": len(rollout.completion_ids),
                }
            )
    return pl.DataFrame(rows, schema=EVAL_SCHEMA)
