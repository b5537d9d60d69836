"""Rollouts as canonical trajectories, and lake rows back into training samples.

A rollout of the trainable policy is logged as a one-step trajectory: the step (kind ``answer``)
carries ``input = {"prompt": text, "prompt_token_ids": [...]}``, ``output`` = the completion text,
``token_ids`` = the sampled completion ids and ``logprobs`` = their behaviour log-probs. Training
reads the ids back as they are (token in, token out) and never re-tokenises generated text.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import orjson
import polars as pl

from flow_assets.logs.schema import Outcome, Step, Trajectory
from flow_assets.policy.sampling import Rollout
from flow_assets.policy.trainer import TrainingSample
from flow_assets.tasks.sources import Task


def rollout_trajectories(
    tasks: Sequence[Task],
    rollouts: Sequence[Rollout],
    scores: Sequence[float],
    agent_id: str,
    adapter_version: str,
    batch_id: str,
    timestamp: str | None = None,
) -> list[Trajectory]:
    """One canonical trajectory per rollout (``rollouts[k]`` answers ``tasks[rollouts[k].prompt_index]``).

    A rollout that failed (``error`` set) is kept, with an ``error`` step, success ``False`` and
    score 0, so the batch still shows it; it has no tokens and so never reaches the gradient.

    Args:
        scores: the verifier's reward in [0, 1] per rollout; success means score == 1.
    """
    out = []
    for rollout, score in zip(rollouts, scores, strict=True):
        task = tasks[rollout.prompt_index]
        failed = rollout.error is not None
        step = Step(
            index=0,
            kind="answer",
            module="policy",
            input={"prompt": rollout.prompt, "prompt_token_ids": list(rollout.prompt_ids)},
            output=rollout.error if failed else rollout.completion_text,
            status="error" if failed else "ok",
            token_ids=None if failed else list(rollout.completion_ids),
            logprobs=None if failed else list(rollout.logprobs),
        )
        score = 0.0 if failed else float(score)
        out.append(
            Trajectory(
                trajectory_id=f"{batch_id}/{task.task_id}/{rollout.sample_index}",
                task_id=task.task_id,
                agent_id=agent_id,
                adapter_version=adapter_version,
                query=task.query,
                steps=[step],
                final_answer=None if failed else rollout.completion_text,
                outcome=Outcome(success=score >= 1.0, score=score),
                timestamp=timestamp,
                metadata={"split": task.split, "source": task.source, "finished": rollout.finished},
            )
        )
    return out


def write_jsonl(trajectories: Sequence[Trajectory]) -> bytes:
    """The canonical JSONL bytes of ``trajectories`` (one object per line)."""
    return b"".join(t.model_dump_json().encode() + b"\n" for t in trajectories)


def batch_id_for(adapter_version: str, task_ids: Sequence[str], seed: int) -> str:
    """A short id naming one collection (same champion, tasks and seed -> same id)."""
    digest = hashlib.sha256(orjson.dumps([adapter_version, list(task_ids), seed])).hexdigest()
    return f"{adapter_version}-{digest[:10]}"


def training_samples(steps: pl.DataFrame, step_advantages: pl.DataFrame, trajectories: pl.DataFrame, agent_id: str) -> list[TrainingSample]:
    """Training samples of one batch: the token-carrying steps of ``agent_id``'s trajectories with
    their per-step advantage.

    Args:
        steps: the batch's ``steps`` table (``input`` JSON with ``prompt_token_ids``, ``token_ids``,
            ``logprobs``).
        step_advantages: ``trajectory_id, index, advantage``.
        trajectories: ``trajectory_id, task_id, agent_id``.

    Returns:
        Samples in table order; steps without tokens or advantage are left out.
    """
    rows = (
        steps.filter(pl.col("token_ids").is_not_null())
        .join(trajectories.select("trajectory_id", "task_id", "agent_id"), on="trajectory_id", maintain_order="left")
        .filter(pl.col("agent_id") == agent_id)
        .join(step_advantages, on=["trajectory_id", "index"], maintain_order="left")
        .filter(pl.col("advantage").is_not_null())
    )
    samples = []
    for row in rows.iter_rows(named=True):
        prompt = orjson.loads(row["input"])
        samples.append(
            TrainingSample(
                prompt_ids=list(prompt["prompt_token_ids"]),
                completion_ids=list(row["token_ids"]),
                advantage=float(row["advantage"]),
                behaviour_logprobs=list(row["logprobs"]) if row["logprobs"] is not None else None,
                task_id=row["task_id"],
            )
        )
    return samples
