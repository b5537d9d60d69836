"""Per-batch and per-source summaries of the lake, as printed by ``flowopt ingest`` / ``demo``."""

from __future__ import annotations

import polars as pl

from flow_assets.logs.records import display_path
from flow_assets.rl.advantages import AdvantageConfig, group_advantages
from resources.lake import TrajectoryLake

_QUERIES = {
    "trajectories": """select batch, count(*) as trajectories, count(distinct task_id) as tasks,
                              sum(n_steps)::bigint as steps from trajectories group by batch""",
    "rewards": """select batch, avg(r_outcome) as mean_outcome, avg(reward) as mean_shaped_reward,
                         count(*) filter (where reward is null) as unlabelled
                  from rewards group by batch""",
    "advantages": """select batch, count(*) as groups,
                            count(*) filter (where not zero_variance) as groups_with_signal,
                            count(*) filter (where mixed) as groups_mixed_outcome
                     from (select batch, group_key, bool_and(zero_variance) as zero_variance,
                                  max(r_outcome) > min(r_outcome) as mixed
                           from advantages where reward is not null group by batch, group_key) group by batch""",
    "quarantine": "select batch, count(*) as quarantined from quarantine group by batch",
}

_COUNTS = ("trajectories", "unlabelled", "tasks", "groups", "groups_with_signal", "groups_mixed_outcome", "steps", "quarantined")

_SUMMARY_SCHEMA = {
    "batch": pl.String, "source": pl.String, "file": pl.String,
    **dict.fromkeys(_COUNTS, pl.Int64), "mean_outcome": pl.Float64, "mean_shaped_reward": pl.Float64,
}  # fmt: skip


def batch_summary(lake: TrajectoryLake, keys: list[str] | None = None) -> pl.DataFrame:
    """One row per batch that has been read (its ``interaction_logs`` materialised), sorted by
    batch, restricted to ``keys`` when given: ``batch, source, file, trajectories, unlabelled, tasks,
    groups, groups_with_signal, groups_mixed_outcome, steps, quarantined, mean_outcome,
    mean_shaped_reward``. Counts are 0 (never missing) for a batch whose records were all
    quarantined; the means are null there.

    ``unlabelled`` counts trajectories without a logged outcome (stored, no reward, in no group).
    ``mean_outcome`` is the mean logged task outcome (success 1/0, or the score in [0, 1]);
    ``mean_shaped_reward`` the mean total reward after shaping terms (``rewards`` asset), which
    is what GRPO normalises. ``groups_with_signal`` counts groups whose total reward varies (a
    non-zero advantage somewhere: DeepSeekMath GRPO, Shao et al. 2024, eq. 3);
    ``groups_mixed_outcome`` those whose logged outcome varies.
    """
    read = set(lake.batches("interaction_logs")) | set(lake.batches("quarantine"))
    manifests = pl.DataFrame(
        [{"batch": m.key, "source": m.source, "file": display_path(m.file_name)} for m in lake.registered_batches() if m.key in read],
        schema={"batch": pl.String, "source": pl.String, "file": pl.String},
    )
    if keys is not None:
        manifests = manifests.filter(pl.col("batch").is_in(keys))
    frame = manifests
    con = lake.duckdb() if not manifests.is_empty() else None
    for table, query in _QUERIES.items():
        if con is not None and lake.batches(table):
            frame = frame.join(con.sql(query).pl(), on="batch", how="left")
    for column, dtype in _SUMMARY_SCHEMA.items():
        if column not in frame.columns:
            frame = frame.with_columns(pl.lit(None, dtype).alias(column))
    return (
        frame.select([pl.col(c).cast(t) for c, t in _SUMMARY_SCHEMA.items()])
        .with_columns(pl.col(*_COUNTS).fill_null(0), pl.col("mean_outcome", "mean_shaped_reward").round(4))
        .sort("batch")
    )


def source_summary(lake: TrajectoryLake, per_batch: pl.DataFrame) -> pl.DataFrame:
    """Totals per source over ``per_batch``, plus the groups formed when the same ``task_id`` is
    pooled across the source's batches (``group_scope="source"``): ``pooled_groups`` and
    ``pooled_groups_with_signal``, and ``pooled_groups_mixed_outcome``."""
    totals = per_batch.group_by("source").agg(
        files=pl.len(),
        trajectories=pl.col("trajectories").sum(),
        groups=pl.col("groups").sum(),
        groups_with_signal=pl.col("groups_with_signal").sum(),
        groups_mixed_outcome=pl.col("groups_mixed_outcome").sum(),
        steps=pl.col("steps").sum(),
        quarantined=pl.col("quarantined").sum(),
        mean_outcome=(pl.col("mean_outcome") * pl.col("trajectories")).sum() / pl.col("trajectories").sum(),
        mean_shaped_reward=(pl.col("mean_shaped_reward") * pl.col("trajectories")).sum() / pl.col("trajectories").sum(),
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
            pooled_groups_with_signal=(~pl.col("zero_variance")).sum(),
            pooled_groups_mixed_outcome=pl.col("mixed").sum(),
        )
    )
    return (
        totals.join(pooled, on="source", how="left")
        .with_columns(pl.col("mean_outcome", "mean_shaped_reward").round(4))
        .sort("source")
    )
