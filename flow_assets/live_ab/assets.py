"""Live A/B as Dagster assets: ``ab_test_report`` tests the challenger against the champion on
live traffic after each log batch; ``ab_monitor_sensor`` (sensors/ab_monitor.py) requests it and
acts on its decision."""


import math

import numpy as np

from dagster import AssetCheckResult, AssetCheckSeverity, AssetCheckSpec, AssetExecutionContext, MaterializeResult, MetadataValue, asset

from flow_assets.data_plane.assets import rewards
from flow_assets.live_ab.evidence import arm_summary, live_observations, outcome_stream
from flow_assets.core.partitions import log_batches
from flow_assets.live_ab.stats import ABConfig, ab_decision
from flow_assets.core.versions import TRAINING_OWNERS, code_version
from resources.lake import TrajectoryLake
from resources.live_ab import LiveAB
from resources.registry import AdapterRegistry

GROUP = "live"
AB_CHECKS = {
    "challenger_not_worse": (
        "The always-valid sequential test has not found the challenger worse than the champion on live "
        "traffic. Blocking: when it fails, ab_monitor_sensor withdraws the challenger (a rollback). "
        "Metadata: both success rates, the difference and its always-valid interval, the p-value."
    ),
    "challenger_better": (
        "The always-valid sequential test has found the challenger better than the champion on live "
        "traffic: ab_monitor_sensor promotes it. A warning, not an error, while the test keeps collecting."
    ),
}


def _earlier_looks(context: AssetExecutionContext, challenger: str) -> list[tuple[int, int]]:
    """``(n_champion, n_challenger)`` labelled outcomes at each earlier report on ``challenger``."""
    records = context.instance.fetch_materializations(context.assets_def.key, limit=10_000).records
    looks = []
    for record in records:
        meta = record.asset_materialization.metadata
        if "challenger" in meta and meta["challenger"].value == challenger and "n_challenger" in meta:
            looks.append((int(meta["n_champion"].value), int(meta["n_challenger"].value)))
    return looks


def _float(x: float) -> MetadataValue:
    return MetadataValue.float(round(x, 6) if math.isfinite(x) else float("nan"))


@asset(
    partitions_def=log_batches,
    group_name=GROUP,
    deps=[rewards],
    owners=TRAINING_OWNERS,
    code_version=code_version("flow_assets.live_ab.evidence", "flow_assets.live_ab.stats"),
    check_specs=[
        AssetCheckSpec("challenger_not_worse", asset="ab_test_report", blocking=True, description=AB_CHECKS["challenger_not_worse"]),
        AssetCheckSpec("challenger_better", asset="ab_test_report", description=AB_CHECKS["challenger_better"]),
    ],
)
def ab_test_report(context: AssetExecutionContext, lake: TrajectoryLake, registry: AdapterRegistry, live_ab: LiveAB) -> MaterializeResult:
    """Champion vs challenger on live traffic, as of this batch: every labelled trajectory of
    either adapter since the challenger started (all batches), success rate and mean reward per
    adapter with 95% intervals, and the always-valid sequential test's decision (promote,
    rollback, continue, inconclusive), which ab_monitor_sensor carries out in the registry."""
    challenger = registry.challenger()
    if not challenger:
        return MaterializeResult(
            metadata={"decision": "none", "reason": "no challenger in live A/B"},
            check_results=[
                AssetCheckResult(check_name="challenger_not_worse", passed=True, description="no challenger"),
                AssetCheckResult(check_name="challenger_better", passed=True, severity=AssetCheckSeverity.WARN, description="no challenger"),
            ],
        )
    champion_version, challenger_version = challenger["champion"], challenger["version"]
    observations = live_observations(lake.scan("trajectories"), lake.scan("rewards"), (champion_version, challenger_version), challenger["since"])
    arms = {side: arm_summary(observations, version) for side, version in (("champion", champion_version), ("challenger", challenger_version))}
    config = ABConfig(alpha=live_ab.alpha, min_samples_per_arm=live_ab.min_samples_per_arm, max_samples_per_arm=live_ab.max_samples_per_arm)
    champion_outcomes = outcome_stream(observations, champion_version)
    challenger_outcomes = outcome_stream(observations, challenger_version)
    # the test's looks are the reports made on this challenger so far, and this one: the p-value
    # is the running best over the looks actually taken, not over every prefix nobody looked at
    now = (champion_outcomes.size, challenger_outcomes.size)
    looks = [now]
    for look in sorted({x for x in _earlier_looks(context, challenger_version) if x[0] <= now[0] and x[1] <= now[1]}, reverse=True):
        if look[1] <= looks[-1][1] and look != looks[-1]:  # a look is a point both arms had passed
            looks.append(look)
    looks.reverse()
    result = ab_decision(champion_outcomes, challenger_outcomes, config, checkpoints=np.array(looks, dtype=np.int64).reshape(-1, 2))
    context.log.info(f"live A/B {challenger_version} vs {champion_version}: {result.reason}")
    numbers = {
        "champion_success": _float(arms["champion"].success_rate),
        "challenger_success": _float(arms["challenger"].success_rate),
        "diff": _float(result.diff),
        "diff_ci_low": _float(result.diff_interval[0]),
        "diff_ci_high": _float(result.diff_interval[1]),
        "p_value": _float(result.p_value),
        "n_champion": MetadataValue.int(arms["champion"].n),
        "n_challenger": MetadataValue.int(arms["challenger"].n),
    }
    table = "\n".join(
        ["| adapter | side | labelled | unlabelled | success (95% CI) | mean reward (95% CI) |", "|---|---|---|---|---|---|"]
        + [
            f"| {a.version} | {side} | {a.n} | {a.unlabelled} | {a.success_rate:.3f} ({a.success_ci[0]:.3f}-{a.success_ci[1]:.3f}) "
            f"| {a.mean_reward:.3f} ({a.reward_ci[0]:.3f}-{a.reward_ci[1]:.3f}) |"
            for side, a in arms.items()
        ]
    )
    return MaterializeResult(
        metadata={
            "decision": result.decision,
            "reason": result.reason,
            "champion": champion_version,
            "challenger": challenger_version,
            "share": MetadataValue.float(float(challenger["share"])),
            "arms": MetadataValue.md(table),
            **numbers,
        },
        check_results=[
            AssetCheckResult(
                check_name="challenger_not_worse",
                passed=result.decision != "rollback",
                severity=AssetCheckSeverity.ERROR,
                description=result.reason,
                metadata=numbers,
            ),
            AssetCheckResult(
                check_name="challenger_better",
                passed=result.decision == "promote",
                severity=AssetCheckSeverity.WARN,
                description=result.reason,
                metadata=numbers,
            ),
        ],
    )


live_assets = [ab_test_report]
