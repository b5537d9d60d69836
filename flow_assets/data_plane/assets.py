"""The data plane: interaction_logs -> trajectories -> rewards -> advantages, per log batch.

Each asset reads its input partition from the lake, calls the pure functions of
``flow_assets.logs`` / ``flow_assets.rl``, writes its partition atomically and returns the metadata
a person wants in the UI.

Memory is bounded whatever the size of a batch: records and steps stream through in chunks
(:data:`~flow_assets.logs.tables.CHUNK_RECORDS` records / ~64 MiB), and the per-step tables are
read and written by polars' streaming engine. Custom reward functions see the batch one chunk of
records at a time, and the judge one chunk of whole groups at a time (a chunk is larger only when
one group alone is). What grows with a batch is one small row per trajectory (ids seen, rewards,
judge scores, advantages), not its steps or their text.
"""


from collections.abc import Iterable, Iterator
from functools import partial

import polars as pl
from dagster import (
    AssetCheckResult,
    AssetCheckSeverity,
    AssetCheckSpec,
    AssetSpec,
    AssetExecutionContext,
    Config,
    MaterializeResult,
    MetadataValue,
    asset,
)
from pydantic import Field

from flow_assets.core.config import dagster_config
from flow_assets.logs.chunks import parallel_trajectory_tables, read_chunks, worker_count
from flow_assets.logs.records import display_path
from flow_assets.logs.redact import DEFAULT_FIELDS, DEFAULT_PATTERNS, RedactionConfig, Redactor
from flow_assets.logs.schema import Trajectory
from flow_assets.logs import tables
from flow_assets.logs.tables import (
    INTERACTION_LOGS_SCHEMA,
    QUARANTINE_SCHEMA,
    STEPS_SCHEMA,
    TRAJECTORIES_SCHEMA,
    interaction_logs_frame,
    quarantine_frame,
    trajectory_tables,
)
from flow_assets.core.metadata import histogram_markdown, preview_table
from flow_assets.core.partitions import log_batches
from flow_assets.core.versions import DATA_OWNERS, code_version
from flow_assets.rl.advantages import AdvantageConfig, pooled_advantages
from flow_assets.rl.credit import CreditConfig, step_advantages
from flow_assets.judge.client import JUDGEMENT_SCHEMA, GroupJudgement, judge_groups_sync, judge_totals, judgement_table
from flow_assets.rl.rewards import RewardConfig, chunked_custom_rewards, group_chunks, reward_table, trajectory_groups
from resources.judge import JudgeEndpoint
from resources.lake import TrajectoryLake

GROUP = "data_plane"


class InteractionLogsConfig(Config):
    """How a log batch is read."""

    parse_workers: int = Field(
        0,
        ge=0,
        description="processes that validate JSONL records in parallel; 0 = one per CPU core for "
        "a batch of at least 32 MiB and none below, 1 = read in this process only",
    )
    redact_secrets: bool = Field(
        True,
        description="replace API keys, bearer tokens and password-like fields by [REDACTED:<kind>] when the "
        "batch's file is copied into the lake (before anything is parsed or stored); false keeps the bytes as "
        "they are. Applies when the copy is made, i.e. at the batch's first run",
    )
    redact_fields: list[str] = Field(
        default_factory=lambda: list(DEFAULT_FIELDS),
        description="substrings of field names (case-insensitive) whose string values are redacted; pass and pwd "
        "are redacted as whole names (flow_assets/logs/redact.py)",
    )
    redact_patterns: dict[str, str] = Field(
        default_factory=lambda: dict(DEFAULT_PATTERNS),
        description="kind -> regular expression (RE2 syntax) of secret values, redacted wherever they occur",
    )

    def redaction(self) -> RedactionConfig:
        """The pure redaction settings of this config."""
        return RedactionConfig(self.redact_secrets, dict(self.redact_patterns), tuple(self.redact_fields))


#: the files new log batches come from; external (Dagster does not write them), here for lineage
landed_logs = AssetSpec(
    "landed_logs",
    group_name=GROUP,
    deps=["rollouts"],
    owners=DATA_OWNERS,
    description="Log files in the landing directory (FLOWOPT_LANDING), written by agents' own logging, by the "
    "gateway (flowopt serve), by flowopt ingest and by rollouts; new_logs_sensor makes each settled file one "
    "log batch partition.",
)


@asset(
    partitions_def=log_batches,
    group_name=GROUP,
    kinds={"parquet"},
    deps=[landed_logs],
    owners=DATA_OWNERS,
    code_version=code_version("flow_assets.logs"),
    check_specs=[
        AssetCheckSpec(
            "records_conserved",
            asset="interaction_logs",
            blocking=True,
            description="valid + quarantined records = records read: nothing was silently dropped. Blocking: "
            "a batch that fails it goes no further (no trajectories, no training).",
        )
    ],
)
def interaction_logs(
    context: AssetExecutionContext, config: InteractionLogsConfig, lake: TrajectoryLake
) -> MaterializeResult:
    """Raw records of one log batch, parsed and validated; bad records go to quarantine
    with file, line, field and reason. Fails (this partition only) if the file is unreadable.
    The batch's file is copied into the lake first, with secrets redacted
    (flow_assets/logs/redact.py; counts in the metadata), so nothing stored holds them."""
    key = context.partition_key
    manifest = lake.batch_manifest(key)
    if not lake.batch_snapshot(key).exists():
        redactor = Redactor(config.redaction())
        workers = worker_count(config.parse_workers, manifest.original_path)
        lake.snapshot_batch(key, partial(redactor.stream, workers=workers) if config.redact_secrets else None)
        lake.write_batch_note(key, "redaction", {"enabled": config.redact_secrets, "redacted": dict(redactor.counts)})
    snapshot = lake.batch_snapshot(key)
    redaction = lake.read_batch_note(key, "redaction") or {"enabled": False, "redacted": {}}
    workers = worker_count(config.parse_workers, snapshot)
    n_valid = n_quarantined = 0
    quarantine_head = quarantine_frame([])
    with (
        read_chunks(
            snapshot, manifest.fmt, workers=workers, max_records=tables.CHUNK_RECORDS, max_bytes=tables.CHUNK_BYTES
        ) as stream,
        lake.partition_writer("interaction_logs", key, INTERACTION_LOGS_SCHEMA) as logs_out,
        lake.partition_writer("quarantine", key, QUARANTINE_SCHEMA) as quarantine_out,
    ):
        for chunk in stream:
            logs_out.write(interaction_logs_frame(chunk.valid, stream.format, n_valid))
            quarantined = quarantine_frame(chunk.quarantined)
            quarantine_out.write(quarantined)
            if quarantine_head.height < 5:
                quarantine_head = pl.concat([quarantine_head, quarantined.head(5)]).head(5)
            n_valid += chunk.valid.height
            n_quarantined += len(chunk.quarantined)
    records_read = stream.records_read
    conserved = n_valid + n_quarantined == records_read
    return MaterializeResult(
        metadata={
            "file": display_path(manifest.original_path),
            "source": manifest.source,
            "format": stream.format,
            "sha256": manifest.sha256,
            "records_read": records_read,
            "parse_workers": workers,
            "valid": n_valid,
            "quarantined": n_quarantined,
            "quarantine_preview": preview_table(quarantine_head.drop("raw")),
            "redacted": sum(redaction["redacted"].values()),
            "redacted_by_kind": MetadataValue.json(redaction["redacted"]) if redaction["enabled"] else "redaction off",
        },
        check_results=[
            AssetCheckResult(
                check_name="records_conserved",
                passed=conserved,
                severity=AssetCheckSeverity.ERROR,
                metadata={"records_read": records_read, "valid + quarantined": n_valid + n_quarantined},
            )
        ],
    )


class TrajectoriesConfig(Config):
    """How a batch's canonical tables are built from its ``interaction_logs``."""

    table_workers: int = Field(
        0,
        ge=0,
        description="processes that build the trajectories and steps rows in parallel, a Parquet row group each; "
        "0 = one per CPU core for a batch of at least 32 MiB and none below (as parse_workers), 1 = in this process only",
    )


def _trajectory_parts(lake: TrajectoryLake, key: str, source: str, workers: int) -> Iterator[tuple[pl.DataFrame, pl.DataFrame]]:
    if workers > 1:
        yield from parallel_trajectory_tables(lake.partition_path("interaction_logs", key), source, workers)
        return
    for chunk in lake.iter_partition("interaction_logs", key, rows=tables.CHUNK_RECORDS, columns=["record_json"]):
        # to_list() converts the column in one call: iterating a polars Series value by value
        # cost ~7x as much (2.0 s vs 0.28 s per 1M steps)
        yield trajectory_tables(chunk["record_json"].to_list(), source)


@asset(partitions_def=log_batches, group_name=GROUP, kinds={"parquet"}, deps=[interaction_logs], owners=DATA_OWNERS,
       code_version=code_version("flow_assets.logs.tables", "flow_assets.logs.schema"))
def trajectories(context: AssetExecutionContext, config: TrajectoriesConfig, lake: TrajectoryLake) -> MaterializeResult:
    """Canonical tables trajectories (one row per trajectory) and steps (one per step)."""
    key = context.partition_key
    source = lake.batch_manifest(key).source
    # one core built these rows at ~4.3 s per 1M steps while the other idled: a batch large
    # enough for parse workers gets table workers too (the same rows, in the same order)
    workers = worker_count(config.table_workers, lake.batch_snapshot(key))
    with (
        lake.partition_writer("trajectories", key, TRAJECTORIES_SCHEMA) as traj_out,
        lake.partition_writer("steps", key, STEPS_SCHEMA) as steps_out,
    ):
        for traj, steps in _trajectory_parts(lake, key, source, workers):
            traj_out.write(traj)
            steps_out.write(steps)
    traj = lake.scan_partition("trajectories", key)
    facts = traj.select(
        trajectories=pl.len(),
        tasks=pl.col("task_id").n_unique(),
        agents=pl.col("agent_id").n_unique(),
        success_rate=pl.col("outcome_success").cast(pl.Float64).mean(),
    ).collect(engine="streaming").row(0, named=True)
    kinds = lake.scan_partition("steps", key).group_by("kind").len().sort("kind").collect(engine="streaming")
    return MaterializeResult(
        metadata={
            "trajectories": facts["trajectories"],
            "steps": int(kinds["len"].sum()),
            "table_workers": workers,
            "tasks": facts["tasks"],
            "agents": facts["agents"],
            "steps_by_kind": {k: int(n) for k, n in kinds.iter_rows()},
            "success_rate": MetadataValue.float(float(facts["success_rate"] or 0.0)),
            "preview": preview_table(traj.head(5).collect().drop("metadata")),
        }
    )


RewardsConfig = dagster_config(RewardConfig, "RewardsConfig")
AdvantageRunConfig = dagster_config(AdvantageConfig, "AdvantageRunConfig")
CreditRunConfig = dagster_config(CreditConfig, "CreditRunConfig")


class AdvantagesConfig(AdvantageRunConfig):
    """Group normalisation (the advantage config's fields) and per-step credit assignment."""

    credit: CreditRunConfig = Field(default_factory=CreditRunConfig, description="how a trajectory's advantage is shared among its steps")


@asset(partitions_def=log_batches, group_name=GROUP, kinds={"parquet"}, deps=[trajectories], owners=DATA_OWNERS,
       code_version=code_version("flow_assets.rl.rewards", "flow_assets.rl.reward_fns", "flow_assets.judge.client"))
def rewards(context: AssetExecutionContext, config: RewardsConfig, lake: TrajectoryLake, judge: JudgeEndpoint) -> MaterializeResult:
    """Reward components per trajectory (outcome, tool success, verify, step penalty, custom, and
    the scoring agent's judge score when a judge is configured) and their total reward; a group
    the judge could not score gets no reward (no gradient), with the reason."""
    key = context.partition_key
    cfg = config.to_pure()
    custom = verdicts = None
    judge_meta: dict = {}
    if cfg.custom:
        custom = {}
        chunks = lake.iter_partition("interaction_logs", key, rows=tables.CHUNK_RECORDS, columns=["record_json"])
        for part in chunked_custom_rewards((c["record_json"].to_list() for c in chunks), cfg):
            custom.update(part)
    if judge.enabled:
        verdicts, judge_meta = _judge(context, judge, _group_chunks(lake, key))
    steps = lake.scan_partition("steps", key)
    table = reward_table(lake.scan_partition("trajectories", key), steps, cfg, custom, verdicts).with_columns(
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
                for c in ("r_outcome", "r_tool_success", "r_verify", "r_step_penalty", "r_custom", "r_judge")
            },
            **judge_meta,
            "preview": preview_table(table),
        }
    )


def _group_chunks(lake: TrajectoryLake, key: str) -> Iterator[dict[str, list[Trajectory]]]:
    """A batch's trajectories as ``task_id -> trajectories``, whole groups at a time, about
    :data:`~flow_assets.logs.tables.CHUNK_RECORDS` trajectories per chunk (more only for one
    larger group): memory is bounded by a chunk whatever the batch, even when a group's trials lie
    far apart in the log (tau-bench's lie a whole trial round apart)."""
    logs = lake.scan_partition("interaction_logs", key)
    for chunk in group_chunks(logs.select("record", "task_id"), tables.CHUNK_RECORDS):
        # the record range lets the reader skip the row groups that hold none of these groups
        records = (
            logs.filter(pl.col("record").is_between(chunk.first_record, chunk.last_record) & pl.col("task_id").is_in(list(chunk.task_ids)))
            .select("record", "record_json")
            .collect(engine="streaming")
            .sort("record")
        )
        yield trajectory_groups(records["record_json"].to_list())


def _judge(
    context: AssetExecutionContext, judge: JudgeEndpoint, chunks: Iterable[dict[str, list[Trajectory]]]
) -> tuple[pl.DataFrame, dict]:
    """The scoring agent's verdicts on a batch's groups (one group per task id), asked chunk by
    chunk of whole groups (:func:`_group_chunks`), and their metadata: groups scored and dropped
    (with the reasons), requests, cache hits, tokens, USD."""
    settings = judge.settings()
    cache = judge.cache()
    verdicts: list[GroupJudgement] = []
    sizes: dict[str, int] = {}
    parts: list[pl.DataFrame] = [pl.DataFrame(schema=JUDGEMENT_SCHEMA)]
    for groups in chunks:
        chunk_verdicts = judge_groups_sync(groups, settings, judge.base_url, judge.api_key, cache)
        parts.append(judgement_table(chunk_verdicts, groups))
        verdicts.extend(chunk_verdicts)
        sizes.update((task_id, len(group)) for task_id, group in groups.items())
    totals = judge_totals(verdicts)
    dropped = [v for v in verdicts if v.error is not None]
    for v in dropped[:20]:
        context.log.warning(f"judge dropped group {v.task_id!r} ({sizes[v.task_id]} trajectories): {v.error}")
    context.log.info(
        f"judge {settings.model} ({settings.mode}): {totals['groups_scored']} groups scored, {totals['groups_dropped']} dropped; "
        f"{totals['calls']} requests, {totals['cached']} from the cache, {totals['prompt_tokens']} + {totals['completion_tokens']} tokens, "
        f"${totals['cost_usd']:.4f}"
    )
    reasons = "\n".join(["| task | trajectories | reason |", "|---|---|---|"] + [
        f"| {v.task_id} | {sizes[v.task_id]} | {v.error.replace('|', '/')} |" for v in dropped[:50]
    ])  # fmt: skip
    meta = {
        "judge_model": settings.model,
        "judge_mode": settings.mode,
        "judge_groups_scored": MetadataValue.int(totals["groups_scored"]),
        "judge_groups_dropped": MetadataValue.int(totals["groups_dropped"]),
        "judge_requests": MetadataValue.int(totals["calls"]),
        "judge_cache_hits": MetadataValue.int(totals["cached"]),
        "judge_prompt_tokens": MetadataValue.int(totals["prompt_tokens"]),
        "judge_completion_tokens": MetadataValue.int(totals["completion_tokens"]),
        "judge_cost_usd": MetadataValue.float(round(totals["cost_usd"], 6)),
    }
    if dropped:
        meta["judge_dropped"] = MetadataValue.md(reasons)
    return pl.concat(parts), meta


@asset(
    partitions_def=log_batches,
    group_name=GROUP,
    kinds={"parquet"},
    deps=[rewards],
    owners=DATA_OWNERS,
    code_version=code_version("flow_assets.rl.advantages", "flow_assets.rl.credit"),
    check_specs=[
        AssetCheckSpec(
            "advantages_finite",
            asset="advantages",
            blocking=True,
            description="every trajectory and step advantage is finite. Blocking: the run fails and "
            "training_round_sensor never starts a round on the batch.",
        )
    ],
)
def advantages(context: AssetExecutionContext, config: AdvantagesConfig, lake: TrajectoryLake) -> MaterializeResult:
    """Group-normalised advantages per trajectory (advantages) and per step
    (step_advantages); zero-variance groups flagged and given advantage 0."""
    key = context.partition_key
    adv_cfg = config.to_pure()
    credit_cfg = config.credit.to_pure()
    # lazy scans: pooled_advantages reads the peers only for group_scope="source" and the steps
    # only for normalise_over="turn"
    across_source = adv_cfg.group_scope == "source"
    peers = lake.scan("rewards") if across_source else None
    pool_steps = lake.scan("steps") if across_source else lake.scan_partition("steps", key).with_columns(batch=pl.lit(key))
    table = pooled_advantages(lake.read_partition("rewards", key), key, adv_cfg, peers, pool_steps)
    # a null reward is either unlabelled or a group the judge could not score: both carry no gradient
    judge_dropped = int(table["judge_error"].is_not_null().sum()) if "judge_error" in table.columns else 0
    n_unlabelled = int(table["reward"].is_null().sum()) - judge_dropped
    lake.write_partition("advantages", key, table)
    steps = step_advantages(lake.scan_partition("steps", key), table.lazy(), credit_cfg)
    lake.sink_partition("step_advantages", key, steps)
    groups = table.filter(pl.col("reward").is_not_null()).group_by("group_key").agg(pl.col("zero_variance").first())
    n_groups = groups.height
    n_zero = int(groups["zero_variance"].sum())
    steps_finite = (
        lake.scan_partition("step_advantages", key)
        .select(pl.col("advantage").drop_nulls().is_finite().all())
        .collect(engine="streaming")
        .item()
    )
    finite = bool(table["advantage"].is_finite().all()) and bool(steps_finite)
    return MaterializeResult(
        metadata={
            "trajectories": table.height,
            "unlabelled": n_unlabelled,
            "judge_dropped": judge_dropped,
            "groups": n_groups,
            "groups_with_signal": n_groups - n_zero,
            "zero_variance_share": MetadataValue.float(n_zero / n_groups if n_groups else 0.0),
            "group_scope": adv_cfg.group_scope,
            "normalise_over": adv_cfg.normalise_over,
            "credit": credit_cfg.mode,
            "advantage_histogram": histogram_markdown(table["advantage"]),
            "preview": preview_table(table),
        },
        check_results=[AssetCheckResult(check_name="advantages_finite", passed=finite, severity=AssetCheckSeverity.ERROR)],
    )


data_plane_assets = [interaction_logs, trajectories, rewards, advantages]
