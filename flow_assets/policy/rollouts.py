"""Lake rows back into training samples: every LLM turn of a trajectory is one training row.

The gateway logs each turn of a rollout as a step carrying ``prompt_token_ids`` (the chat
template exactly as it rendered it), ``token_ids`` (what was sampled), ``logprobs`` (the
behaviour log-probs) and ``temperature``. Training reads those ids back as they are (token in,
token out): text is never re-tokenised, and tool results, which reach the policy only as part of
a later turn's prompt, are context and never trained.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import orjson
import polars as pl

from flow_assets.policy.configs import TrainingSample


def batch_id_for(adapter_version: str, task_ids: Sequence[str], seed: int) -> str:
    """A short id naming one collection (same champion, tasks and seed -> same id)."""
    digest = hashlib.sha256(orjson.dumps([adapter_version, list(task_ids), seed])).hexdigest()
    return f"{adapter_version}-{digest[:10]}"


def training_samples(steps: pl.DataFrame, step_advantages: pl.DataFrame, trajectories: pl.DataFrame, agent_id: str) -> list[TrainingSample]:
    """Training rows of one batch: the token-carrying turns of ``agent_id``'s trajectories, each
    with its per-step advantage (the ``advantages`` asset's credit assignment).

    Args:
        steps: the batch's ``steps`` table (``prompt_token_ids``, ``token_ids``, ``logprobs``,
            ``temperature``).
        step_advantages: ``trajectory_id, index, advantage``.
        trajectories: ``trajectory_id, task_id, agent_id``.

    Returns:
        One sample per turn, in table order; steps without prompt or completion ids, or without
        an advantage, are left out. A turn without a logged temperature is read as T = 1.
    """
    rows = (
        steps.filter(pl.col("token_ids").is_not_null() & pl.col("prompt_token_ids").is_not_null())
        .join(trajectories.select("trajectory_id", "task_id", "agent_id"), on="trajectory_id", maintain_order="left")
        .filter(pl.col("agent_id") == agent_id)
        .join(step_advantages.select("trajectory_id", "index", "advantage"), on=["trajectory_id", "index"], maintain_order="left")
        .filter(pl.col("advantage").is_not_null())
        .select("prompt_token_ids", "token_ids", "advantage", "logprobs", "task_id", "temperature")
    )
    return [
        TrainingSample(
            prompt_ids=list(prompt),
            completion_ids=list(tokens),
            advantage=float(advantage),
            behaviour_logprobs=list(logprobs) if logprobs is not None else None,
            task_id=task_id,
            temperature=1.0 if temperature is None else float(temperature),
        )
        for prompt, tokens, advantage, logprobs, task_id, temperature in rows.iter_rows()
    ]
