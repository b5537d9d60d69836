"""Per-step credit assignment: how a trajectory's advantage is shared among its steps.

For a trajectory of ``n`` steps with advantage ``A``, step ``i`` (0-based) gets

    broadcast:   A_i = A                          Flow-GRPO / AgentFlow (Li et al. 2025): every
                                                  turn of the flow receives the outcome advantage
    discounted:  A_i = gamma ** (n - i - 1) * A   the last decision gets full credit, earlier ones
                                                  geometrically less (gamma in (0, 1])
"""

from __future__ import annotations

from dataclasses import dataclass

from typing import TypeVar

import polars as pl

FrameT = TypeVar("FrameT", pl.DataFrame, pl.LazyFrame)


@dataclass(frozen=True)
class CreditConfig:
    """Attributes:
    mode: ``"broadcast"`` or ``"discounted"``.
    gamma: discount per step for ``"discounted"``, in (0, 1]; ignored for ``"broadcast"``.
    """

    mode: str = "broadcast"
    gamma: float = 0.9

    def __post_init__(self) -> None:
        if self.mode not in ("broadcast", "discounted"):
            raise ValueError(f"credit mode must be 'broadcast' or 'discounted', got {self.mode!r}")
        if not 0.0 < self.gamma <= 1.0:
            raise ValueError(f"gamma must be in (0, 1], got {self.gamma}")


def step_advantages(steps: FrameT, trajectory_advantages: FrameT, config: CreditConfig) -> FrameT:
    """Advantage of every step (formulas in the module docstring).

    Args:
        steps: one row per step with ``trajectory_id`` and ``index`` (0-based, 0..n-1).
        trajectory_advantages: one row per trajectory with ``trajectory_id`` and ``advantage``.
            Both eager, or both lazy (the result is then a query to run or sink, e.g. by the
            streaming engine, so a batch's steps need not fit in memory).

    Returns:
        ``trajectory_id, index, advantage`` for every step, in the order of ``steps``. A step
        whose trajectory has no advantage row gets a null advantage (it was not scored).
    """
    joined = steps.select("trajectory_id", "index").join(
        trajectory_advantages.select("trajectory_id", "advantage"),
        on="trajectory_id",
        how="left",
        maintain_order="left",
    )
    if config.mode == "broadcast":
        return joined
    n = pl.len().over("trajectory_id")
    weight = pl.lit(config.gamma, pl.Float64).pow((n - pl.col("index") - 1).cast(pl.Float64))
    return joined.with_columns(advantage=pl.col("advantage") * weight)
