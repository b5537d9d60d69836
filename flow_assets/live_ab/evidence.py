"""Live A/B evidence from the lake: the outcomes of champion and challenger on live traffic.

Plain functions (no Dagster): ``ab_test_report`` calls them on the lake's ``trajectories`` and
``rewards`` tables, across every batch, and hands the outcome stream to the sequential test
(:mod:`flow_assets.live_ab.stats`).

What counts as an observation of an adapter: a *labelled* trajectory (its outcome logged: success
or not) whose ``adapter_version`` is that adapter and whose ``timestamp`` is at or after the
challenger's start. Before the start the champion served everyone, and mixing that traffic in would
compare two periods rather than two adapters. Unlabelled trajectories (no outcome yet) are counted
but not tested. The observations are ordered by timestamp, the order the sequential test sees.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timezone

import numpy as np
import polars as pl

from flow_assets.rl.eval_stats import mean_interval, wilson_interval


@dataclass(frozen=True)
class ArmSummary:
    """One side of the live A/B.

    Attributes:
        version: the adapter version.
        n: labelled trajectories (observations); ``unlabelled``: those without an outcome yet.
        successes / success_rate / success_ci: count, rate and 95% Wilson interval (NaN when n=0).
        mean_reward / reward_ci: mean total reward of the labelled trajectories and its 95%
            Student-t interval (NaN when no reward is known).
    """

    version: str
    n: int
    unlabelled: int
    successes: int
    success_rate: float
    success_ci: tuple[float, float]
    mean_reward: float
    reward_ci: tuple[float, float]


def live_observations(trajectories: pl.LazyFrame | pl.DataFrame, rewards: pl.LazyFrame | pl.DataFrame, versions: tuple[str, str], since: float) -> pl.DataFrame:
    """The live trajectories of both adapters since the A/B started.

    Args:
        trajectories: the lake's ``trajectories`` table (``trajectory_id, adapter_version,
            outcome_success, timestamp``), any number of batches.
        rewards: the lake's ``rewards`` table (``trajectory_id, reward``); a trajectory without a
            row gets a null reward.
        versions: ``(champion, challenger)``.
        since: the challenger's start, UNIX seconds (UTC).

    Returns:
        ``trajectory_id, adapter_version, success (bool, null = unlabelled), reward, at`` sorted by
        ``at`` (UTC datetime) then ``trajectory_id``; one row per trajectory id (a trajectory
        landed twice counts once).
    """
    start = datetime.fromtimestamp(since, timezone.utc)
    at = pl.col("timestamp").str.to_datetime(time_zone="UTC", strict=False)
    frame = (
        trajectories.lazy()
        .filter(pl.col("adapter_version").is_in(list(versions)))
        .select("trajectory_id", "adapter_version", pl.col("outcome_success").alias("success"), at.alias("at"))
        .filter(pl.col("at") >= start)
        .unique("trajectory_id", keep="first")
        .join(rewards.lazy().select("trajectory_id", "reward").unique("trajectory_id", keep="first"), on="trajectory_id", how="left")
        .sort("at", "trajectory_id")
    )
    return frame.collect()


def arm_summary(observations: pl.DataFrame, version: str) -> ArmSummary:
    """:class:`ArmSummary` of ``version`` in :func:`live_observations`' frame."""
    mine = observations.filter(pl.col("adapter_version") == version)
    labelled = mine.filter(pl.col("success").is_not_null())
    n, wins = labelled.height, int(labelled["success"].sum() or 0)
    rewards = [r for r in labelled["reward"].to_list() if r is not None and np.isfinite(r)]
    mean = mean_interval(rewards) if rewards else None
    nan = float("nan")
    return ArmSummary(
        version=version,
        n=n,
        unlabelled=mine.height - n,
        successes=wins,
        success_rate=wins / n if n else nan,
        success_ci=wilson_interval(wins, n) if n else (nan, nan),
        mean_reward=mean.mean if mean else nan,
        reward_ci=(mean.ci_low, mean.ci_high) if mean else (nan, nan),
    )


def outcome_stream(observations: pl.DataFrame, version: str) -> np.ndarray:
    """The labelled outcomes of ``version`` in arrival order, ``[n]`` int64 (1 = success), as the
    sequential test reads each arm."""
    mine = observations.filter((pl.col("adapter_version") == version) & pl.col("success").is_not_null())
    return mine["success"].cast(pl.Int64).to_numpy()


def ab_windows(history: list[dict]) -> list[tuple[float, float]]:
    """The periods in which a live A/B ran, from the registry's history: ``[(start, end)]`` in UNIX
    seconds, from each ``challenge`` event to the ``promote`` / ``withdraw`` that ended it, or to
    infinity while it runs (a challenge ended by a hand-made promotion or rollback ends there too).
    """
    windows: list[tuple[float, float]] = []
    open_since: float | None = None
    for event in history:
        action, at = event.get("action"), event.get("at")
        if at is None:
            continue
        if action == "challenge":
            open_since = float(at)
        elif open_since is not None and action in ("promote", "withdraw", "rollback"):
            windows.append((open_since, float(at)))
            open_since = None
    if open_since is not None:
        windows.append((open_since, float("inf")))
    return windows


def served_during_ab(trajectories: pl.DataFrame, windows: list[tuple[float, float]]) -> int:
    """How many of ``trajectories`` (``timestamp`` column, ISO 8601) were served while a live A/B
    ran (:func:`ab_windows`). Those are the experiment's evidence: ``training_round_sensor`` does
    not train on their batch, because a candidate trained on them could replace the champion the
    experiment compares against, and its traffic mixes two policies."""
    if not windows or trajectories.height == 0:
        return 0
    at = trajectories.select(pl.col("timestamp").str.to_datetime(time_zone="UTC", strict=False).dt.epoch("ms") / 1000.0).to_series()
    inside = pl.lit(False)
    for start, end in windows:
        inside = inside | ((pl.col("at") >= start) & (pl.col("at") < end))
    return int(pl.DataFrame({"at": at}).select(inside.fill_null(False).sum()).item())
