"""The data plane: interaction_logs -> trajectories -> rewards -> advantages, per log batch.

Each asset reads its input partition from the lake, calls the pure functions of
``flow_assets.logs`` / ``flow_assets.rl``, writes its partition atomically and returns the metadata
a person wants in the UI.
"""


import polars as pl
from dagster import (
    AssetCheckResult,
    AssetCheckSeverity,
    AssetCheckSpec,
    AssetExecutionContext,
    Config,
    MaterializeResult,
    MetadataValue,
    asset,
)
from pydantic import Field

from flow_assets.logs.reader import parse_file
from flow_assets.logs.schema import Trajectory
from flow_assets.logs.tables import (
    interaction_logs_frame,
    quarantine_frame,
    split_duplicates,
    trajectory_tables,
)
from flow_assets.metadata import histogram_markdown, preview_table
from flow_assets.partitions import log_batches
from flow_assets.rl.advantages import AdvantageConfig, group_advantages
from flow_assets.rl.credit import CreditConfig, step_advantages
from flow_assets.rl.rewards import RewardConfig, custom_rewards, reward_table
from resources.lake import TrajectoryLake

GROUP = "data_plane"


@asset(
    partitions_def=log_batches,
    group_name=GROUP,
    kinds={"parquet"},
    check_specs=[AssetCheckSpec("records_conserved", asset="interaction_logs")],
)
def interaction_logs(context: AssetExecutionContext, lake: TrajectoryLake) -> MaterializeResult:
    """Raw records of one log batch, parsed and validated; bad records go to ``quarantine``
    with file, line, field and reason. Fails (this partition only) if the file is unreadable."""
    key = context.partition_key
    manifest = lake.batch_manifest(key)
    result = parse_file(lake.batch_snapshot(key), manifest.fmt)
    valid, quarantined = split_duplicates(result)
    lake.write_partition("interaction_logs", key, interaction_logs_frame(valid, result.format))
    quarantine = quarantine_frame(quarantined)
    lake.write_partition("quarantine", key, quarantine)
    conserved = len(valid) + len(quarantined) == result.records_read
    return MaterializeResult(
        metadata={
            "file": manifest.original_path,
            "source": manifest.source,
            "format": result.format,
            "sha256": manifest.sha256,
            "records_read": result.records_read,
            "valid": len(valid),
            "quarantined": len(quarantined),
            "quarantine_preview": preview_table(quarantine.drop("raw")),
        },
        check_results=[
            AssetCheckResult(
                check_name="records_conserved",
                passed=conserved,
                severity=AssetCheckSeverity.ERROR,
                metadata={"records_read": result.records_read, "valid + quarantined": len(valid) + len(quarantined)},
            )
        ],
    )


@asset(partitions_def=log_batches, group_name=GROUP, kinds={"parquet"}, deps=[interaction_logs])
def trajectories(context: AssetExecutionContext, lake: TrajectoryLake) -> MaterializeResult:
    """Canonical tables ``trajectories`` (one row per trajectory) and ``steps`` (one per step)."""
    key = context.partition_key
    logs = lake.read_partition("interaction_logs", key)
    traj, steps = trajectory_tables(logs["record_json"], lake.batch_manifest(key).source)
    lake.write_partition("trajectories", key, traj)
    lake.write_partition("steps", key, steps)
    kinds = steps.group_by("kind").len().sort("kind")
    return MaterializeResult(
        metadata={
            "trajectories": traj.height,
            "steps": steps.height,
            "tasks": traj["task_id"].n_unique(),
            "agents": traj["agent_id"].n_unique(),
            "steps_by_kind": {k: int(n) for k, n in kinds.iter_rows()},
            "success_rate": MetadataValue.float(float(traj["outcome_success"].mean() or 0.0)),
            "preview": preview_table(traj.drop("metadata")),
        }
    )


class RewardsConfig(Config):
    """Weights of the reward terms (seed formula of DESIGN.md) and custom reward functions."""

    outcome: float = Field(1.0, description="weight of the logged outcome (score, else success)")
    tool_success: float = Field(0.1, description="added per successful tool call")
    verify: float = Field(0.05, description="added per verify step")
    step_penalty: float = Field(-0.01, description="added per step")
    custom: dict[str, list[str]] = Field(
        default_factory=dict,
        description="agent type (agent_id before ':', or '*') -> 'module:function' reward fns",
    )

    def to_reward_config(self) -> RewardConfig:
        """The pure-code config these fields describe."""
        return RewardConfig(
            outcome=self.outcome,
            tool_success=self.tool_success,
            verify=self.verify,
            step_penalty=self.step_penalty,
            custom={k: tuple(v) for k, v in self.custom.items()},
        )


@asset(partitions_def=log_batches, group_name=GROUP, kinds={"parquet"}, deps=[trajectories])
def rewards(context: AssetExecutionContext, config: RewardsConfig, lake: TrajectoryLake) -> MaterializeResult:
    """Reward components per trajectory (outcome, tool success, verify, step penalty, custom)
    and their total ``reward``."""
    key = context.partition_key
    cfg = config.to_reward_config()
    traj = lake.read_partition("trajectories", key)
    custom = None
    if cfg.custom:
        records = lake.read_partition("interaction_logs", key)["record_json"]
        custom = custom_rewards((Trajectory.model_validate_json(r) for r in records), cfg)
    table = reward_table(traj, lake.read_partition("steps", key), cfg, custom).with_columns(
        source=pl.lit(lake.batch_manifest(key).source)
    )
    lake.write_partition("rewards", key, table)
    reward = table["reward"]
    return MaterializeResult(
        metadata={
            "trajectories": table.height,
            "reward_mean": MetadataValue.float(float(reward.mean() or 0.0)),
            "reward_std": MetadataValue.float(float(reward.std() or 0.0)),
            "reward_histogram": histogram_markdown(reward),
            "component_means": {
                c: round(float(table[c].mean() or 0.0), 6)
                for c in ("r_outcome", "r_tool_success", "r_verify", "r_step_penalty", "r_custom")
            },
            "preview": preview_table(table),
        }
    )


class AdvantagesConfig(Config):
    """Group normalisation and per-step credit assignment options."""

    scale_by_std: bool = Field(True, description="GRPO std scaling; false = Dr. GRPO")
    eps: float = Field(1e-4, description="added to the group std")
    group_scope: str = Field("batch", description="'batch' or 'source' (same task_id across a source's batches)")
    credit: str = Field("broadcast", description="'broadcast' or 'discounted'")
    gamma: float = Field(0.9, description="discount per step for 'discounted' credit")


@asset(
    partitions_def=log_batches,
    group_name=GROUP,
    kinds={"parquet"},
    deps=[rewards],
    check_specs=[AssetCheckSpec("advantages_finite", asset="advantages")],
)
def advantages(context: AssetExecutionContext, config: AdvantagesConfig, lake: TrajectoryLake) -> MaterializeResult:
    """Group-normalised advantages per trajectory (``advantages``) and per step
    (``step_advantages``); zero-variance groups flagged and given advantage 0."""
    key = context.partition_key
    adv_cfg = AdvantageConfig(config.scale_by_std, config.eps, config.group_scope)
    credit_cfg = CreditConfig(config.credit, config.gamma)
    own = lake.read_partition("rewards", key)
    if adv_cfg.group_scope == "batch":
        pool = own.with_columns(batch=pl.lit(key))
    else:
        # the source's other batches as materialised now; re-materialise to take in later ones
        source = own["source"][0] if own.height else None
        others = (
            lake.scan("rewards").filter((pl.col("source") == source) & (pl.col("batch") != key)).collect()
            if source is not None
            else own.clear().with_columns(batch=pl.lit(key))
        )
        pool = pl.concat([own.with_columns(batch=pl.lit(key)), others.select(own.columns + ["batch"])])
    scored = group_advantages(pool.with_columns(group_key=pl.col("task_id")), adv_cfg)
    table = scored.filter(pl.col("batch") == key).drop("batch")
    lake.write_partition("advantages", key, table)
    steps = step_advantages(lake.read_partition("steps", key), table, credit_cfg)
    lake.write_partition("step_advantages", key, steps)
    groups = table.group_by("group_key").agg(pl.col("zero_variance").first())
    n_groups = groups.height
    n_zero = int(groups["zero_variance"].sum())
    finite = bool(table["advantage"].is_finite().all()) and bool(steps["advantage"].drop_nulls().is_finite().all())
    return MaterializeResult(
        metadata={
            "trajectories": table.height,
            "groups": n_groups,
            "groups_nonzero_advantage": n_groups - n_zero,
            "zero_variance_share": MetadataValue.float(n_zero / n_groups if n_groups else 0.0),
            "group_scope": adv_cfg.group_scope,
            "credit": credit_cfg.mode,
            "advantage_histogram": histogram_markdown(table["advantage"]),
            "preview": preview_table(table),
        },
        check_results=[AssetCheckResult(check_name="advantages_finite", passed=finite, severity=AssetCheckSeverity.ERROR)],
    )


data_plane_assets = [interaction_logs, trajectories, rewards, advantages]
