"""Group-relative advantages (GRPO).

For a group ``g`` of trajectories that attempted the same task, with rewards ``r_1..r_G``:

    A_i = (r_i - mean(r)) / (std(r) + eps)      GRPO, Shao et al. 2024 (DeepSeekMath), eq. 3
    A_i =  r_i - mean(r)                         Dr. GRPO, Liu et al. 2025, sec. 3.2 (scale_by_std=False)

``std`` is the sample standard deviation (ddof=1), as TRL's ``GRPOTrainer`` computes it, so that
flowopt and the reference implementation agree on the same group. A group whose rewards are all
equal (including a group of one) carries no learning signal: it is flagged ``zero_variance`` and
its advantages are exactly 0, so it contributes no gradient.

Multi-turn rollouts train one row per LLM turn, and the field normalises those rows in two ways
(``normalise_over``):

- ``"rollout"`` (default; Agent Lightning v1.0, ``algorithm.enable_rollout_level_advantage``):
  the statistics are over the group's rollouts, one reward each; each rollout's advantage is
  then given to its turns by the credit scheme (:mod:`flow_assets.rl.credit`). A rollout counts
  once however many turns it took.
- ``"turn"`` (AgentFlow's Flow-GRPO as its code runs it: verl's GRPO over turn rows grouped by
  query): every turn row carries its rollout's reward, and mean and std are over all turn rows
  of the group, so a rollout with more turns weighs more in the statistics (a rollout of ``k``
  turns counts ``k`` times). Each rollout's turns still share one advantage. Rollouts without a
  turn (an agent that never called the model) have no row and do not count.

Turns are the ``n_turns`` column: a trajectory's decisions (every step but observations).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import polars as pl


@dataclass(frozen=True)
class AdvantageConfig:
    """How rewards become advantages.

    Attributes:
        scale_by_std: divide by the group's std (GRPO); ``False`` gives Dr. GRPO's unscaled
            advantage, which avoids up-weighting near-uniform groups.
        eps: added to the std so that small-variance groups do not explode (TRL uses 1e-4).
        group_scope: ``"batch"`` groups the same ``task_id`` inside one log batch;
            ``"source"`` groups the same ``task_id`` across all batches of one source
            (e.g. five agents' runs of the same 50 tau2 tasks).
        normalise_over: ``"rollout"`` (one value per trajectory in the group statistics, Agent
            Lightning v1.0) or ``"turn"`` (one per turn row, AgentFlow); see module docstring.
    """

    scale_by_std: bool = True
    eps: float = 1e-4
    group_scope: Literal["batch", "source"] = "batch"
    normalise_over: Literal["rollout", "turn"] = "rollout"

    def __post_init__(self) -> None:
        if self.group_scope not in ("batch", "source"):
            raise ValueError(f"group_scope must be 'batch' or 'source', got {self.group_scope!r}")
        if self.normalise_over not in ("rollout", "turn"):
            raise ValueError(f"normalise_over must be 'rollout' or 'turn', got {self.normalise_over!r}")
        if not self.eps >= 0:
            raise ValueError(f"eps must be >= 0, got {self.eps}")


def group_advantages(rewards: pl.DataFrame, config: AdvantageConfig) -> pl.DataFrame:
    """Advantages of every trajectory relative to its group (formula in the module docstring).

    Args:
        rewards: one row per trajectory with at least ``group_key`` (String) and ``reward``
            (Float64, finite), and ``n_turns`` (integer >= 0) when ``normalise_over == "turn"``.
            Other columns are carried through.

    Returns:
        The input rows in the same order, plus ``group_size`` (UInt32: trajectories, or turn
        rows with ``"turn"``), ``group_mean``, ``group_std`` (Float64; null for a group of one),
        ``zero_variance`` (Boolean) and ``advantage`` (Float64; 0.0 in zero-variance groups).

    Raises:
        ValueError: a reward is null or not finite; ``n_turns`` missing for ``"turn"``.
    """
    if rewards["reward"].null_count() or not rewards["reward"].is_finite().all():
        raise ValueError("rewards must be finite and non-null before computing advantages")
    reward = pl.col("reward")
    if config.normalise_over == "turn":
        if "n_turns" not in rewards.columns:
            raise ValueError("normalise_over='turn' needs an n_turns column")
        # the statistics of the turn rows: each trajectory's reward counted n_turns times
        w = pl.col("n_turns").cast(pl.Float64)
        total = w.sum().over("group_key")
        mean = (w * reward).sum().over("group_key") / total
        var = (w * (reward - mean) ** 2).sum().over("group_key") / (total - 1)
        counted = pl.when(w > 0).then(reward)
        out = rewards.with_columns(
            group_size=total.cast(pl.UInt32),
            group_mean=mean,
            group_std=pl.when(total > 1).then(var.sqrt()),
            zero_variance=(counted.max().over("group_key") == counted.min().over("group_key")).fill_null(True),
        )
    else:
        out = rewards.with_columns(
            group_size=pl.len().over("group_key").cast(pl.UInt32),
            group_mean=reward.mean().over("group_key"),
            group_std=reward.std(ddof=1).over("group_key"),
            zero_variance=(reward.max().over("group_key") == reward.min().over("group_key")),
        )
    centred = pl.col("reward") - pl.col("group_mean")
    scaled = centred / (pl.col("group_std") + config.eps) if config.scale_by_std else centred
    return out.with_columns(
        advantage=pl.when(pl.col("zero_variance")).then(0.0).otherwise(scaled).cast(pl.Float64)
    )
