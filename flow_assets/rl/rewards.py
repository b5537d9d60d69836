"""Trajectory rewards: the logged outcome plus shaped terms plus custom reward functions.

For trajectory ``tau`` with steps ``s_1..s_n`` (docs/architecture.md, "The reward"):

    reward(tau) = w_outcome * outcome(tau)
                + w_tool_success * #{s_i : kind == tool and status == ok}
                + w_verify * #{s_i : kind == verify}
                + w_step * n
                + sum_f custom_f(tau)
                + w_judge * judge(tau)

``outcome(tau)`` is the logged score when there is one, else 1.0/0.0 from the logged success.
``judge(tau)`` is the scoring agent's score in [0, 1] (:mod:`flow_assets.judge.client`) when a judge
is configured. A trajectory whose group the judge could not score gets a null reward (no
gradient), never a zero; a trajectory without a logged outcome is rewarded when the judge scored it.
Every component is returned on its own so that a user can see which term moved a group.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import polars as pl

from flow_assets.core.imports import import_function
from flow_assets.logs.schema import Trajectory
from flow_assets.judge.client import JUDGEMENT_SCHEMA

#: A custom reward function: ``fn(trajectory: Trajectory) -> float``. It receives the validated
#: canonical trajectory (query, steps, final_answer, outcome, metadata) and returns one finite
#: number, added to the total as its own component. It must be a pure function of its input.
RewardFn = Callable[[Trajectory], float]


class RewardFunctionError(ValueError):
    """A custom reward function could not be loaded, or returned something that is not a finite
    number. The message names the function (``module:function``) and the trajectory."""


@dataclass(frozen=True)
class RewardConfig:
    """Weights of the reward terms. The defaults are the formula of docs/architecture.md, "The reward".

    Each field's description is its ``metadata["description"]`` (:mod:`flow_assets.core.config`).
    """

    outcome: float = field(default=1.0, metadata={"description": (
        "weight of the logged outcome (score, else success as 1/0).")})
    tool_success: float = field(default=0.1, metadata={"description": (
        "added per successful tool call (``kind == \"tool\"`` and ``status == \"ok\"``).")})
    verify: float = field(default=0.05, metadata={"description": (
        "added per verification step (``kind == \"verify\"``).")})
    step_penalty: float = field(default=-0.01, metadata={"description": "added per step (negative: a length penalty)."})
    judge: float = field(default=1.0, metadata={"description": (
        "weight of the scoring agent's score (only when a judge endpoint is configured).")})
    custom: Mapping[str, tuple[str, ...]] = field(default_factory=dict, metadata={"description": (
        "agent type -> ``\"module:function\"`` paths of custom reward functions. The agent type of a trajectory is its "
        "``agent_id`` up to the first ``\":\"``; the key ``\"*\"`` applies to every agent.")})

    @classmethod
    def outcome_only(cls) -> RewardConfig:
        """The plain logged outcome, no shaping (GRPO as in DeepSeekMath)."""
        return cls(tool_success=0.0, verify=0.0, step_penalty=0.0)


def agent_type(agent_id: str) -> str:
    """The agent type used to pick custom reward functions: ``agent_id`` up to its first ``:``."""
    return agent_id.split(":", 1)[0]


def load_reward_fn(path: str) -> RewardFn:
    """Import a custom reward function from ``"package.module:function"``.

    Raises:
        RewardFunctionError: the path is malformed, the module or attribute does not exist, or
            the object is not callable with one positional argument.
    """
    return import_function(path, "reward function", RewardFunctionError, 1)


def resolve_custom(config: RewardConfig, agent_id: str) -> list[tuple[str, RewardFn]]:
    """The custom reward functions that apply to ``agent_id`` (its type's, then ``"*"``'s)."""
    paths = [*config.custom.get(agent_type(agent_id), ()), *config.custom.get("*", ())]
    return [(p, load_reward_fn(p)) for p in paths]


def _custom_scorer(config: RewardConfig) -> Callable[[Trajectory], float | None]:
    """``score(trajectory)``: the sum of the custom reward functions that apply to it, or None when
    none applies; functions are resolved once per agent type, for as long as ``score`` lives.

    Raises (from ``score``):
        RewardFunctionError: as :func:`custom_rewards`.
    """
    cache: dict[str, list[tuple[str, RewardFn]]] = {}

    def score(trajectory: Trajectory) -> float | None:
        kind = agent_type(trajectory.agent_id)
        if kind not in cache:
            cache[kind] = resolve_custom(config, trajectory.agent_id)
        if not cache[kind]:
            return None
        total = 0.0
        for path, fn in cache[kind]:
            try:
                value: Any = fn(trajectory)
            except Exception as exc:  # a user's function: say which one failed, and on what
                raise RewardFunctionError(
                    f"reward function {path!r} raised on trajectory {trajectory.trajectory_id!r}: {exc!r}"
                ) from exc
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise RewardFunctionError(
                    f"reward function {path!r} returned {value!r} for trajectory "
                    f"{trajectory.trajectory_id!r}; expected a finite number"
                )
            total += float(value)
        return total

    return score


def custom_rewards(trajectories: Iterable[Trajectory], config: RewardConfig) -> dict[str, float]:
    """Sum of the custom reward functions that apply to each trajectory.

    Returns:
        ``trajectory_id -> custom reward`` for the trajectories that have at least one function.

    Raises:
        RewardFunctionError: a function could not be loaded, raised, or returned a non-finite or
            non-numeric value (the message names the function and the trajectory).
    """
    score = _custom_scorer(config)
    out: dict[str, float] = {}
    for trajectory in trajectories:
        value = score(trajectory)
        if value is not None:
            out[trajectory.trajectory_id] = value
    return out


def chunked_custom_rewards(record_chunks: Iterable[Sequence[str]], config: RewardConfig) -> Iterator[dict[str, float]]:
    """:func:`custom_rewards` over a batch read chunk by chunk, in bounded memory: each chunk of
    canonical records is validated into trajectories, scored and let go before the next is read.

    Args:
        record_chunks: the batch's canonical trajectory JSON (the ``record_json`` column of the
            lake's ``interaction_logs``), one sequence of strings per chunk, read lazily.
        config: the reward config (its ``custom`` functions; the weights are not used here).

    Yields:
        Per chunk, in order: ``trajectory_id -> custom reward`` for its trajectories that have at
        least one function (an empty dict when none has). The union over the chunks equals
        :func:`custom_rewards` of the whole batch; functions are resolved once for all chunks.

    Raises:
        RewardFunctionError: as :func:`custom_rewards`, for the first failing trajectory in order.
        pydantic.ValidationError: a record is not a valid canonical trajectory.
    """
    score = _custom_scorer(config)
    for records in record_chunks:
        out: dict[str, float] = {}
        for record in records:
            trajectory = Trajectory.model_validate_json(record)
            value = score(trajectory)
            if value is not None:
                out[trajectory.trajectory_id] = value
        yield out


@dataclass(frozen=True)
class GroupChunk:
    """Whole groups of a batch to be read and scored together (:func:`group_chunks`).

    Attributes:
        task_ids: the groups, in the order of their first record.
        trajectories: how many trajectories they hold together.
        first_record / last_record: the smallest and largest record number among them
            (``interaction_logs.record``: a trajectory's position in its batch, 0-based); a reader
            needs to look only between them.
    """

    task_ids: tuple[str, ...]
    trajectories: int
    first_record: int
    last_record: int


def group_chunks(records: pl.DataFrame | pl.LazyFrame, max_trajectories: int) -> list[GroupChunk]:
    """Cut a batch into chunks of whole groups (one group per ``task_id``, the judge's groups), for
    scoring that needs a group together (the judge's relative mode) in bounded memory.

    Groups are taken in the order of their first record and packed greedily: a chunk takes the
    next group while it holds at most ``max_trajectories`` trajectories with it, so a chunk holds
    at most ``max_trajectories`` unless one group alone is larger (that group is a chunk of its
    own: a group is never split).

    Args:
        records: one row per trajectory with ``record`` (integer, its position in the batch) and
            ``task_id`` (String): the lake's ``interaction_logs`` table or those two columns of it.
        max_trajectories: the chunk bound, >= 1.

    Returns:
        The chunks in order; every group is in exactly one. Empty for an empty batch.

    Raises:
        ValueError: ``max_trajectories`` < 1.
    """
    if max_trajectories < 1:
        raise ValueError(f"max_trajectories must be >= 1, got {max_trajectories}")
    groups = (
        records.lazy()
        .group_by("task_id")
        .agg(n=pl.len(), first=pl.col("record").min(), last=pl.col("record").max())
        .sort("first")
        .collect()
    )
    chunks: list[GroupChunk] = []
    ids: list[str] = []
    size, first, last = 0, 0, 0
    for task_id, n, lo, hi in groups.iter_rows():
        if ids and size + n > max_trajectories:
            chunks.append(GroupChunk(tuple(ids), size, first, last))
            ids, size = [], 0
        if not ids:
            first, last = lo, hi
        ids.append(task_id)
        size, first, last = size + n, min(first, lo), max(last, hi)
    if ids:
        chunks.append(GroupChunk(tuple(ids), size, first, last))
    return chunks


def trajectory_groups(records: Iterable[str]) -> dict[str, list[Trajectory]]:
    """Canonical trajectory JSON validated and grouped by ``task_id``: ``task_id -> its
    trajectories``, groups in the order of their first record, trajectories in record order
    (what :func:`flow_assets.judge.client.judge_groups` takes).

    Raises:
        pydantic.ValidationError: a record is not a valid canonical trajectory.
    """
    groups: dict[str, list[Trajectory]] = {}
    for record in records:
        trajectory = Trajectory.model_validate_json(record)
        groups.setdefault(trajectory.task_id, []).append(trajectory)
    return groups


def reward_table(
    trajectories: pl.DataFrame | pl.LazyFrame,
    steps: pl.DataFrame | pl.LazyFrame,
    config: RewardConfig,
    custom: Mapping[str, float] | None = None,
    judge: pl.DataFrame | None = None,
) -> pl.DataFrame:
    """Rewards of a batch, term by term (formula in the module docstring), vectorised.

    Args:
        trajectories: one row per trajectory with ``trajectory_id, task_id, agent_id,
            outcome_success, outcome_score`` (the lake's ``trajectories`` table), eager or lazy.
        steps: one row per step with ``trajectory_id, kind, status`` (the ``steps`` table); a
            lazy frame is aggregated by the streaming engine, reading only those columns.
        custom: ``trajectory_id -> custom reward`` from :func:`custom_rewards`.
        judge: the scoring agent's verdicts (:func:`flow_assets.judge.client.judgement_table`:
            ``trajectory_id, judge_score, judge_error``), or None without a judge.

    Returns:
        One row per trajectory, in the input order: ``trajectory_id, task_id, agent_id,
        r_outcome, r_tool_success, r_verify, r_step_penalty, r_custom, r_judge, reward``
        (Float64), ``judge_error`` (String) and ``judge_cost_usd`` (Float64, USD; both null
        without a judge). ``reward`` is null for a trajectory
        with neither a logged outcome nor a judge score (unlabelled), and for one whose group the
        judge dropped (``judge_error`` says why).
    """
    counts = (
        steps.lazy()
        .group_by("trajectory_id")
        .agg(
            n_steps=pl.len(),
            n_tool_ok=((pl.col("kind") == "tool") & (pl.col("status") == "ok")).sum(),
            n_verify=(pl.col("kind") == "verify").sum(),
        )
        .collect(engine="streaming")
    )
    custom_df = pl.DataFrame(
        {"trajectory_id": list((custom or {}).keys()), "r_custom": list((custom or {}).values())},
        schema={"trajectory_id": pl.String, "r_custom": pl.Float64},
    )
    outcome = (
        pl.when(pl.col("outcome_score").is_not_null())
        .then(pl.col("outcome_score"))
        .otherwise(pl.col("outcome_success").cast(pl.Float64))
    )
    table = (
        trajectories.lazy()
        .select("trajectory_id", "task_id", "agent_id", "outcome_success", "outcome_score")
        .collect()
        .join(counts, on="trajectory_id", how="left", maintain_order="left")
        .join(custom_df, on="trajectory_id", how="left", maintain_order="left")
        .with_columns(pl.col("n_steps", "n_tool_ok", "n_verify").fill_null(0))
        .select(
            "trajectory_id",
            "task_id",
            "agent_id",
            r_outcome=(config.outcome * outcome).cast(pl.Float64),
            r_tool_success=(config.tool_success * pl.col("n_tool_ok")).cast(pl.Float64),
            r_verify=(config.verify * pl.col("n_verify")).cast(pl.Float64),
            r_step_penalty=(config.step_penalty * pl.col("n_steps")).cast(pl.Float64),
            r_custom=pl.col("r_custom").fill_null(0.0),
        )
    )
    terms = ["r_outcome", "r_tool_success", "r_verify", "r_step_penalty", "r_custom"]
    if judge is None:  # the columns exist either way, so every partition of the table has one schema
        judge = pl.DataFrame(schema=JUDGEMENT_SCHEMA)
    # an unlabelled trajectory (neither an outcome logged nor a judge score) has no reward yet:
    # shaping terms alone would rank it against labelled ones on length and tool use only
    table = table.join(judge.select(*JUDGEMENT_SCHEMA), on="trajectory_id", how="left", maintain_order="left")
    table = table.with_columns(r_judge=(config.judge * pl.col("judge_score")).cast(pl.Float64)).drop("judge_score")
    labelled = pl.col("r_outcome").is_not_null() | pl.col("r_judge").is_not_null()
    return table.select(
        "trajectory_id", "task_id", "agent_id", *terms, "r_judge",
        reward=pl.when(labelled & pl.col("judge_error").is_null()).then(pl.sum_horizontal(*terms, "r_judge")),
        judge_error="judge_error",
        judge_cost_usd="judge_cost_usd",
    )  # fmt: skip
