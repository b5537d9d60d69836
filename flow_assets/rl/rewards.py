"""Trajectory rewards: the logged outcome plus shaped terms plus custom reward functions.

For trajectory ``tau`` with steps ``s_1..s_n`` (DESIGN.md, "rewards"):

    reward(tau) = w_outcome * outcome(tau)
                + w_tool_success * #{s_i : kind == tool and status == ok}
                + w_verify * #{s_i : kind == verify}
                + w_step * n
                + sum_f custom_f(tau)
                + w_judge * judge(tau)

``outcome(tau)`` is the logged score when there is one, else 1.0/0.0 from the logged success.
``judge(tau)`` is the scoring agent's score in [0, 1] (:mod:`flow_assets.rl.judge`) when a judge
is configured. A trajectory whose group the judge could not score gets a null reward (no
gradient), never a zero; a trajectory without a logged outcome is rewarded when the judge scored it.
Every component is returned on its own so that a user can see which term moved a group.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import polars as pl

from flow_assets.imports import import_function
from flow_assets.logs.schema import Trajectory
from flow_assets.rl.judge import JUDGEMENT_SCHEMA

#: A custom reward function: ``fn(trajectory: Trajectory) -> float``. It receives the validated
#: canonical trajectory (query, steps, final_answer, outcome, metadata) and returns one finite
#: number, added to the total as its own component. It must be a pure function of its input.
RewardFn = Callable[[Trajectory], float]


class RewardFunctionError(ValueError):
    """A custom reward function could not be loaded, or returned something that is not a finite
    number. The message names the function (``module:function``) and the trajectory."""


@dataclass(frozen=True)
class RewardConfig:
    """Weights of the reward terms. The defaults are the seed formula of DESIGN.md.

    Attributes:
        outcome: weight of the logged outcome (score, else success as 1/0).
        tool_success: added per successful tool call (``kind == "tool"`` and ``status == "ok"``).
        verify: added per verification step (``kind == "verify"``).
        step_penalty: added per step (negative: a length penalty).
        judge: weight of the scoring agent's score (only when a judge endpoint is configured).
        custom: agent type -> ``"module:function"`` paths of custom reward functions. The agent
            type of a trajectory is its ``agent_id`` up to the first ``":"``; the key ``"*"``
            applies to every agent.
    """

    outcome: float = 1.0
    tool_success: float = 0.1
    verify: float = 0.05
    step_penalty: float = -0.01
    judge: float = 1.0
    custom: Mapping[str, tuple[str, ...]] = field(default_factory=dict)

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


def custom_rewards(trajectories: Iterable[Trajectory], config: RewardConfig) -> dict[str, float]:
    """Sum of the custom reward functions that apply to each trajectory.

    Returns:
        ``trajectory_id -> custom reward`` for the trajectories that have at least one function.

    Raises:
        RewardFunctionError: a function could not be loaded, raised, or returned a non-finite or
            non-numeric value (the message names the function and the trajectory).
    """
    cache: dict[str, list[tuple[str, RewardFn]]] = {}
    out: dict[str, float] = {}
    for trajectory in trajectories:
        kind = agent_type(trajectory.agent_id)
        if kind not in cache:
            cache[kind] = resolve_custom(config, trajectory.agent_id)
        if not cache[kind]:
            continue
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
        out[trajectory.trajectory_id] = total
    return out


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
        judge: the scoring agent's verdicts (:func:`flow_assets.rl.judge.judgement_table`:
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
