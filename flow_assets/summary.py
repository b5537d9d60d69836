"""Per-batch and per-source summaries of the lake, as printed by ``flowopt ingest`` / ``demo``."""

from __future__ import annotations

import polars as pl

from flow_assets.rl.advantages import AdvantageConfig, group_advantages
from resources.lake import TrajectoryLake

_PER_BATCH = """
with t as (select batch, count(*) as trajectories, count(distinct task_id) as tasks,
                  sum(n_steps)::bigint as steps from trajectories group by batch),
     r as (select batch, avg(reward) as mean_reward, avg(r_outcome) as mean_outcome
           from rewards group by batch),
     g as (select batch, count(*) as groups,
                  count(*) filter (where not zero_variance) as groups_nonzero_advantage,
                  count(*) filter (where mixed) as groups_mixed_outcome
           from (select batch, group_key, bool_and(zero_variance) as zero_variance,
                        max(r_outcome) > min(r_outcome) as mixed
                 from advantages group by batch, group_key) group by batch),
     q as (select batch, count(*) as quarantined from quarantine group by batch)
select t.batch, t.trajectories, g.groups, g.groups_nonzero_advantage, g.groups_mixed_outcome, t.steps,
       coalesce(q.quarantined, 0) as quarantined, r.mean_reward, r.mean_outcome
from t left join r using (batch) left join g using (batch) left join q using (batch)
"""


_SUMMARY_SCHEMA = {
    "batch": pl.String, "source": pl.String, "file": pl.String, "trajectories": pl.Int64, "groups": pl.Int64,
    "groups_nonzero_advantage": pl.Int64, "groups_mixed_outcome": pl.Int64, "steps": pl.Int64,
    "quarantined": pl.Int64, "mean_reward": pl.Float64, "mean_outcome": pl.Float64,
}


def batch_summary(lake: TrajectoryLake, keys: list[str] | None = None) -> pl.DataFrame:
    """One row per materialised batch: ``batch, source, file, trajectories, groups,
    groups_nonzero_advantage, groups_mixed_outcome, steps, quarantined, mean_reward,
    mean_outcome`` (rewards unitless), sorted by batch; restricted to ``keys`` when given.

    ``groups_nonzero_advantage`` counts groups whose total reward varies (shaped terms included);
    ``groups_mixed_outcome`` those whose logged outcome varies.
    """
    if not all(lake.batches(t) for t in ("trajectories", "rewards", "advantages", "quarantine")):
        return pl.DataFrame(schema=_SUMMARY_SCHEMA)  # nothing materialised end to end yet
    frame = lake.duckdb().sql(_PER_BATCH).pl()
    manifests = pl.DataFrame(
        [{"batch": m.key, "source": m.source, "file": m.file_name} for m in lake.registered_batches()],
        schema={"batch": pl.String, "source": pl.String, "file": pl.String},
    )
    frame = manifests.join(frame, on="batch", how="inner").sort("batch")
    if keys is not None:
        frame = frame.filter(pl.col("batch").is_in(keys))
    return frame.with_columns(pl.col("mean_reward", "mean_outcome").round(4))


def source_summary(lake: TrajectoryLake, per_batch: pl.DataFrame) -> pl.DataFrame:
    """Totals per source over ``per_batch``, plus the groups formed when the same ``task_id`` is
    pooled across the source's batches (``group_scope="source"``): ``pooled_groups`` and
    ``pooled_groups_nonzero_advantage``, and ``pooled_groups_mixed_outcome``."""
    totals = per_batch.group_by("source").agg(
        files=pl.len(),
        trajectories=pl.col("trajectories").sum(),
        groups=pl.col("groups").sum(),
        groups_nonzero_advantage=pl.col("groups_nonzero_advantage").sum(),
        groups_mixed_outcome=pl.col("groups_mixed_outcome").sum(),
        steps=pl.col("steps").sum(),
        quarantined=pl.col("quarantined").sum(),
        mean_reward=(pl.col("mean_reward") * pl.col("trajectories")).sum() / pl.col("trajectories").sum(),
        success_rate=(pl.col("mean_outcome") * pl.col("trajectories")).sum() / pl.col("trajectories").sum(),
    )
    rewards = lake.scan("rewards").filter(pl.col("batch").is_in(per_batch["batch"].to_list())).collect()
    pooled = (
        group_advantages(
            rewards.with_columns(group_key=pl.col("source") + "/" + pl.col("task_id")),
            AdvantageConfig(group_scope="source"),
        )
        .group_by("source", "group_key")
        .agg(pl.col("zero_variance").first(), mixed=pl.col("r_outcome").max() > pl.col("r_outcome").min())
        .group_by("source")
        .agg(
            pooled_groups=pl.len(),
            pooled_groups_nonzero_advantage=(~pl.col("zero_variance")).sum(),
            pooled_groups_mixed_outcome=pl.col("mixed").sum(),
        )
    )
    return (
        totals.join(pooled, on="source", how="left")
        .with_columns(pl.col("mean_reward", "success_rate").round(4))
        .sort("source")
    )
