"""Group-relative advantages (GRPO).

For a group ``g`` of trajectories that attempted the same task, with rewards ``r_1..r_G``:

    A_i = (r_i - mean(r)) / (std(r) + eps)      GRPO, Shao et al. 2024 (DeepSeekMath), eq. 3
    A_i =  r_i - mean(r)                         Dr. GRPO, Liu et al. 2025, sec. 3.2 (scale_rewards=False)

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

A log batch's advantages come from :func:`pooled_advantages`: the batch's rewards are pooled with
the other batches of the same source when ``group_scope == "source"`` (:func:`pool_groups`), given
their turn counts when ``normalise_over == "turn"`` (:func:`with_turn_counts`), grouped by
``task_id`` and normalised by :func:`group_advantages`. Each step is a pure function of frames; the
``advantages`` asset only reads the lake and writes what they return.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar, Literal

import polars as pl


@dataclass(frozen=True)
class AdvantageConfig:
    """How rewards become advantages.

    Each field's description is its ``metadata["description"]`` (:mod:`flow_assets.core.config`).
    """

    #: old field name -> new one; a saved run config with an old name is refused, naming the new one
    RENAMED: ClassVar[dict[str, str]] = {"scale_by_std": "scale_rewards"}

    scale_rewards: bool = field(default=True, metadata={"description": (
        "divide by the group's std (GRPO; TRL's ``scale_rewards`` ``True`` / ``\"group\"``); ``False`` gives Dr. GRPO's "
        "unscaled advantage (TRL's ``\"none\"``), which avoids up-weighting near-uniform groups.")})
    eps: float = field(default=1e-4, metadata={"description": (
        "added to the std so that small-variance groups do not explode (TRL uses 1e-4).")})
    group_scope: Literal["batch", "source"] = field(default="batch", metadata={"description": (
        "``\"batch\"`` groups the same ``task_id`` inside one log batch; ``\"source\"`` groups the same ``task_id`` "
        "across all batches of one source (e.g. five agents' runs of the same 50 tau2 tasks).")})
    normalise_over: Literal["rollout", "turn"] = field(default="rollout", metadata={"description": (
        "``\"rollout\"`` (one value per trajectory in the group statistics, Agent Lightning v1.0) or ``\"turn\"`` (one "
        "per turn row, AgentFlow); see module docstring.")})

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
    scaled = centred / (pl.col("group_std") + config.eps) if config.scale_rewards else centred
    return out.with_columns(
        advantage=pl.when(pl.col("zero_variance")).then(0.0).otherwise(scaled).cast(pl.Float64)
    )


def pool_groups(own: pl.DataFrame, batch: str, peers: pl.DataFrame | pl.LazyFrame | None = None) -> pl.DataFrame:
    """The rows a batch's groups are formed from: its own rewards and, with ``peers``, the rewards
    of the other batches of its source (``group_scope == "source"``).

    Args:
        own: the batch's rewards table, one row per trajectory (the lake's ``rewards`` partition:
            ``trajectory_id, task_id, reward, ..., source``), without a ``batch`` column.
        batch: the batch's partition key.
        peers: the whole ``rewards`` table, all batches, with a ``batch`` column (the lake's
            ``scan("rewards")``), or None to pool the batch alone. Only the rows of ``own``'s
            source (its first row's ``source``) and of other batches are taken; they are read
            as materialised now, so a later batch enters the pool when this one is re-materialised.

    Returns:
        ``own``'s rows in their order with ``batch`` (String) set to ``batch``, then the peers'
        rows (columns of ``own`` plus ``batch``). An empty ``own`` pools nothing from its peers
        (it has no source to match).

    Raises:
        polars.exceptions.ColumnNotFoundError: ``peers`` are given and a column of ``own``
            (``source`` among them) is missing from them or from ``own``.
    """
    pooled = own.with_columns(batch=pl.lit(batch))
    if peers is None or own.height == 0 or own["source"][0] is None:
        return pooled
    others = peers.lazy().filter((pl.col("source") == own["source"][0]) & (pl.col("batch") != batch)).collect()
    return pl.concat([pooled, others.select(own.columns + ["batch"])])


def turn_counts(steps: pl.DataFrame | pl.LazyFrame) -> pl.DataFrame:
    """Each trajectory's turns: its decisions, i.e. the steps whose ``kind`` is not ``"observation"``.

    Args:
        steps: one row per step with ``batch, trajectory_id, kind`` (the lake's ``steps`` table
            with its ``batch`` column); a lazy frame is aggregated by the streaming engine.

    Returns:
        ``batch, trajectory_id, n_turns`` (Int64 >= 0), one row per trajectory that has a step,
        in no particular order.
    """
    return (
        steps.lazy()
        .group_by("batch", "trajectory_id")
        .agg(n_turns=(pl.col("kind") != "observation").sum().cast(pl.Int64))
        .collect(engine="streaming")
    )


def with_turn_counts(pool: pl.DataFrame, steps: pl.DataFrame | pl.LazyFrame) -> pl.DataFrame:
    """``pool`` with each trajectory's ``n_turns`` (:func:`turn_counts`), what
    ``normalise_over == "turn"`` weighs rewards by (module docstring).

    Args:
        pool: one row per trajectory with ``batch, trajectory_id`` (:func:`pool_groups`).
        steps: steps with ``batch, trajectory_id, kind``, covering at least the pool's batches;
            rows of other batches are left out before aggregating.

    Returns:
        ``pool``'s rows in their order plus ``n_turns`` (Int64; 0 for a trajectory without steps).
    """
    steps = steps.lazy().filter(pl.col("batch").is_in(pool["batch"].unique().to_list()))
    return pool.join(turn_counts(steps), on=["batch", "trajectory_id"], how="left", maintain_order="left").with_columns(
        pl.col("n_turns").fill_null(0)
    )


def pooled_advantages(
    own: pl.DataFrame,
    batch: str,
    config: AdvantageConfig,
    peers: pl.DataFrame | pl.LazyFrame | None = None,
    steps: pl.DataFrame | pl.LazyFrame | None = None,
) -> pl.DataFrame:
    """A batch's advantages: its trajectories grouped by ``task_id``, within the batch or across
    its source (:func:`pool_groups`), each labelled one normalised in its group by
    :func:`group_advantages` (GRPO, Shao et al. 2024, DeepSeekMath eq. 3; Dr. GRPO, Liu et al.
    2025, with ``scale_rewards=False``). Trajectories without a reward (unlabelled, or dropped by
    the judge) stay out of every group's statistics and keep a null advantage: no gradient.

    Args:
        own: the batch's rewards table (see :func:`pool_groups`); ``reward`` Float64, null or finite.
        batch: its partition key.
        config: how rewards become advantages.
        peers: the whole ``rewards`` table with ``batch`` (needed with ``group_scope == "source"``,
            ignored with ``"batch"``).
        steps: steps with ``batch, trajectory_id, kind`` covering the pooled batches (needed with
            ``normalise_over == "turn"``, ignored with ``"rollout"``).

    Returns:
        ``own``'s trajectories, the labelled ones first (in ``own``'s order) then the unlabelled
        ones: ``own``'s columns plus ``group_key`` (String, the task id), ``n_turns`` (Int64;
        only with ``"turn"``) and ``group_size, group_mean, group_std, zero_variance, advantage``
        as :func:`group_advantages` returns them (null for unlabelled rows).

    Raises:
        ValueError: ``peers`` missing for ``"source"``, ``steps`` missing for ``"turn"``, or a
            non-null reward that is not finite.
    """
    if config.group_scope == "source" and peers is None:
        raise ValueError("group_scope='source' needs the rewards of the source's other batches (peers)")
    if config.normalise_over == "turn" and steps is None:
        raise ValueError("normalise_over='turn' needs the steps of the pooled batches")
    pool = pool_groups(own, batch, peers if config.group_scope == "source" else None)
    if config.normalise_over == "turn":
        pool = with_turn_counts(pool, steps)
    pool = pool.with_columns(group_key=pl.col("task_id"))
    labelled = pool.filter(pl.col("reward").is_not_null())
    scored = pl.concat([group_advantages(labelled, config), pool.filter(pl.col("reward").is_null())], how="diagonal_relaxed")
    return scored.filter(pl.col("batch") == batch).drop("batch")
