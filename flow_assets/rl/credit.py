"""Per-step credit assignment: how a trajectory's advantage is shared among its steps.

For a trajectory with advantage ``A``, step ``i`` gets

    broadcast:   A_i = A                     Flow-GRPO / AgentFlow (Li et al. 2025, "In-the-Flow
                                             Agentic System Optimization"): every turn of the flow
                                             receives the outcome advantage
    discounted:  A_i = gamma ** k_i * A      k_i = the number of decisions after step i: the last
                                             decision gets full credit, earlier ones geometrically
                                             less (gamma in (0, 1])

A decision is any step but an ``observation`` (a tool result logged as its own step, as the
gateway logs multi-turn rollouts): a tool result between two LLM turns does not count as a turn,
so a turn is discounted by the turns after it, whatever the agent's tools returned in between.
For logs without observation steps ``k_i = n - i - 1``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, TypeVar

import polars as pl

FrameT = TypeVar("FrameT", pl.DataFrame, pl.LazyFrame)


@dataclass(frozen=True)
class CreditConfig:
    """How a trajectory's advantage is credited to its turns; each field's description is its ``metadata["description"]``."""

    mode: Literal["broadcast", "discounted"] = field(default="broadcast", metadata={"description": (
        "``\"broadcast\"`` or ``\"discounted\"``.")})
    gamma: float = field(default=0.9, metadata={"description": (
        "discount per step for ``\"discounted\"``, in (0, 1]; ignored for ``\"broadcast\"``.")})

    def __post_init__(self) -> None:
        if self.mode not in ("broadcast", "discounted"):
            raise ValueError(f"credit mode must be 'broadcast' or 'discounted', got {self.mode!r}")
        if not 0.0 < self.gamma <= 1.0:
            raise ValueError(f"gamma must be in (0, 1], got {self.gamma}")


def step_advantages(steps: FrameT, trajectory_advantages: FrameT, config: CreditConfig) -> FrameT:
    """Advantage of every step (formulas in the module docstring).

    Args:
        steps: one row per step with ``trajectory_id``, ``index`` (0-based, 0..n-1, in order
            within a trajectory) and ``kind``.
        trajectory_advantages: one row per trajectory with ``trajectory_id`` and ``advantage``.
            Both eager, or both lazy (the result is then a query to run or sink, e.g. by the
            streaming engine, so a batch's steps need not fit in memory).

    Returns:
        ``trajectory_id, index, advantage`` for every step, in the order of ``steps``. A step
        whose trajectory has no advantage row gets a null advantage (it was not scored).
    """
    joined = steps.select("trajectory_id", "index", "kind").join(
        trajectory_advantages.select("trajectory_id", "advantage"),
        on="trajectory_id",
        how="left",
        maintain_order="left",
    )
    if config.mode == "broadcast":
        return joined.drop("kind")
    decision = (pl.col("kind") != "observation").cast(pl.Int64)
    later = decision.cum_sum(reverse=True).over("trajectory_id") - decision  # k_i: decisions after step i
    weight = pl.lit(config.gamma, pl.Float64).pow(later.cast(pl.Float64))
    return joined.with_columns(advantage=pl.col("advantage") * weight).drop("kind")
