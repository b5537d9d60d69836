"""Workflow self-optimisation in the graph: step statistics per log batch, and proposals.

``workflow_step_stats`` (one partition per log batch) is a polars aggregation of the batch's
``steps`` and ``trajectories``. ``workflow_proposals`` pools every batch per agent, derives a
definition for an agent that has none, runs the rules of :mod:`flow_assets.workflows.proposals`
against each current definition and stores the proposals in the workflow directory, where a
person reviews them (``flowopt proposals``). No asset changes a definition that exists.
"""

import json

import polars as pl
from dagster import AssetExecutionContext, MaterializeResult, MetadataValue, TableColumn, TableSchema, asset
from pydantic import Field

from flow_assets.core.config import dagster_config
from flow_assets.data_plane.assets import trajectories
from flow_assets.core.metadata import preview_table
from flow_assets.core.partitions import log_batches
from flow_assets.core.versions import DATA_OWNERS, code_version
from flow_assets.workflows.derive import DeriveConfig, derive_workflows
from flow_assets.workflows.proposals import Proposal, ProposalConfig, agent_logs, propose
from flow_assets.workflows.stats import StepStatsConfig, step_statistics
from resources.lake import TrajectoryLake
from resources.workflows import WorkflowDirectory

GROUP = "workflows"

WorkflowStepStatsConfig = dagster_config(StepStatsConfig, "WorkflowStepStatsConfig")
WorkflowDeriveConfig = dagster_config(DeriveConfig, "WorkflowDeriveConfig")
WorkflowRulesConfig = dagster_config(ProposalConfig, "WorkflowRulesConfig")


class WorkflowProposalsConfig(WorkflowRulesConfig):
    """The rules' minimum of evidence (these fields), how statistics are computed and how a
    definition is derived for an agent that has none."""

    stats: WorkflowStepStatsConfig = Field(default_factory=WorkflowStepStatsConfig, description="interval level and failure reasons of the pooled statistics")
    derive: WorkflowDeriveConfig = Field(default_factory=WorkflowDeriveConfig, description="how a definition is read off the logs for an agent without one")


_COLUMN_TYPES = {pl.Int64: "int", pl.Float64: "float", pl.Boolean: "bool", pl.String: "string"}
#: the columns of the statistics a person reads first (the rest are in the lake table)
_PREVIEW = ["agent_id", "tool", "position", "calls", "errors", "call_success_rate", "latency_p50_ms", "latency_p95_ms",
            "confidence_mean", "taken_n", "taken_success", "skipped_n", "skipped_success", "taken_minus_skipped",
            "taken_minus_skipped_low", "taken_minus_skipped_high", "failure_reasons"]  # fmt: skip


def _stats_preview(table: pl.DataFrame) -> MetadataValue:
    return preview_table(table.select(_PREVIEW).with_columns(pl.col(pl.Float64).round(3)), n=500)


@asset(
    partitions_def=log_batches,
    group_name=GROUP,
    kinds={"parquet", "polars"},
    deps=[trajectories],
    owners=DATA_OWNERS,
    code_version=code_version("flow_assets.workflows.stats"),
)
def workflow_step_stats(context: AssetExecutionContext, config: WorkflowStepStatsConfig, lake: TrajectoryLake) -> MaterializeResult:
    """Per agent and tool, in one log batch: calls, success rate, latency p50/p95, mean confidence
    where logged, failure reasons, and the trajectory's success when the step is taken, skipped or
    fails, each with a 95% interval (Wilson; differences by Newcombe's hybrid score method)."""
    key = context.partition_key
    batch = pl.lit(key).alias("batch")
    table = step_statistics(
        lake.scan_partition("steps", key).with_columns(batch), lake.scan_partition("trajectories", key).with_columns(batch), config.to_pure()
    )
    lake.write_partition("workflow_step_stats", key, table)
    return MaterializeResult(
        metadata={
            "dagster/row_count": MetadataValue.int(table.height),
            "dagster/column_schema": TableSchema(columns=[TableColumn(n, _COLUMN_TYPES.get(t, "string")) for n, t in table.schema.items()]),
            "agents": MetadataValue.int(table["agent_id"].n_unique()),
            "calls": MetadataValue.int(int(table["calls"].sum())),
            "failed_calls": MetadataValue.int(int(table["errors"].sum())),
            "step_stats": _stats_preview(table),
        }
    )


def _markdown_table(proposals: list[Proposal], status: dict[str, str]) -> str:
    if not proposals:
        return "_no proposal: no step of any agent passed a rule with the minimum of evidence_"
    lines = ["| id | agent | rule | step | effect on success (interval) | trajectories | status | why |", "|---|---|---|---|---|---:|---|---|"]
    for p in proposals:
        e = p.evidence
        effect = f"{e.effect:+.3f} ({e.effect_low:+.3f}, {e.effect_high:+.3f}) at {e.level:.1%}"
        cells = [p.id, p.agent_id, p.rule, p.step_id, effect, str(e.n_trajectories), status[p.id], p.summary]
        lines.append("| " + " | ".join(c.replace("|", "\\|").replace("\n", " ") for c in cells) + " |")
    return "\n".join(lines)


def _markdown_patches(proposals: list[Proposal]) -> str:
    if not proposals:
        return "_no proposal_"
    return "\n\n".join(f"**{p.id}** ({p.agent_id}, version {p.base_version}): {p.summary}\n\n```json\n{json.dumps(p.patch, indent=1)}\n```" for p in proposals)


@asset(
    group_name=GROUP,
    kinds={"polars", "json"},
    deps=[trajectories, workflow_step_stats],
    owners=DATA_OWNERS,
    code_version=code_version("flow_assets.workflows"),
)
def workflow_proposals(
    context: AssetExecutionContext, config: WorkflowProposalsConfig, lake: TrajectoryLake, workflows: WorkflowDirectory
) -> MaterializeResult:
    """Proposed changes to each agent's workflow as JSON Patch (RFC 6902), with their evidence,
    from the steps of every log batch pooled per agent. An agent without a definition gets one
    derived from its logs (version 1). Proposals wait in the workflow directory for a person:
    flowopt proposals list / show / approve / reject. Nothing is applied here."""
    pure = config.to_pure()
    steps, trajectories_ = lake.scan("steps"), lake.scan("trajectories")
    stats = step_statistics(steps, trajectories_, config.stats.to_pure())
    logs = agent_logs(steps, trajectories_, stats, config.stats.to_pure())
    board = workflows.board()
    store = board.store
    derived = []
    # under the directory's lock: a review in between would leave proposals against an old version
    with store.locked():
        for definition in derive_workflows(steps, trajectories_, config.derive.to_pure()):
            _, created = store.register(definition, by="workflow_proposals", reason="derived from the logs: the agent had no definition")
            if created:
                derived.append(definition.agent_id)
        judged = [a for a in store.agents() if a in logs]
        proposals = [p for agent in judged for p in propose(store.current(agent), logs[agent], pure)]
        summary = board.record(proposals, judged)
        status = {p.id: board.get(p.id).status for p in proposals}
        versions = {a: store.current(a).version for a in judged}
    for p in proposals:
        context.log.info(f"{p.id} [{status[p.id]}] {p.agent_id}: {p.summary}")
    return MaterializeResult(
        metadata={
            "dagster/row_count": MetadataValue.int(len(proposals)),
            "proposals": MetadataValue.md(_markdown_table(proposals, status)),
            "patches": MetadataValue.md(_markdown_patches(proposals)),
            "new": MetadataValue.int(len(summary.new)),
            "superseded": MetadataValue.int(len(summary.superseded)),
            "open": MetadataValue.int(len(board.find(status="open"))),
            "agents": MetadataValue.json(versions),
            "derived_definitions": MetadataValue.json(derived),
            "comparison": pure.comparison,
            "workflow_directory": MetadataValue.path(str(store.root)),
            "pooled_step_stats": _stats_preview(stats),
            "review": MetadataValue.md("`flowopt proposals list`, `flowopt proposals show ID`, `flowopt proposals approve ID --by NAME`, "
                                       "`flowopt proposals reject ID --reason TEXT` (see docs/workflows.md)"),  # fmt: skip
        }
    )


workflow_assets = [workflow_step_stats, workflow_proposals]
