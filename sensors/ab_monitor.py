"""``ab_monitor_sensor``: runs the live A/B's test as live traffic lands, and carries out its
decision in the registry.

Each tick, while the registry has a challenger:

1. If the latest ``ab_test_report`` about this challenger decided ``promote`` or ``rollback``
   (or ``inconclusive``: the sample cap was reached undecided, and the challenger is withdrawn),
   the sensor concludes the A/B in the registry (:meth:`AdapterRegistry.conclude_challenger`):
   the event records the decision, the evidence (the report's numbers) and who decided
   (``ab_monitor_sensor``, with the report's run id). The change is reported to the instance as
   a materialisation of ``champion``, like every promotion and rollback.
2. Otherwise, when a log batch holding trajectories of either adapter has finished its data
   plane since the last report, it requests ``ab_test_job`` on that batch (one report covers
   every batch since the challenger started, so the newest batch is enough).

A person can decide first with ``flowopt promote`` / ``flowopt rollback``; the sensor then finds
no challenger and does nothing.
"""

from __future__ import annotations

import polars as pl
from dagster import AssetKey, DefaultSensorStatus, RunRequest, SensorEvaluationContext, SensorResult, SkipReason, sensor

from flow_assets.training.champion import champion_materialization
from flow_assets.jobs import ab_test_job
from resources.lake import TrajectoryLake
from resources.registry import AdapterRegistry, RegistryError
from sensors.settings import sensor_interval

#: report decisions the sensor carries out, and what each does to the challenger
ACTIONS = {"promote": "promote", "rollback": "rollback", "inconclusive": "rollback"}


def _latest_report(instance, challenger: str):
    event = instance.get_latest_materialization_event(AssetKey("ab_test_report"))
    if event is None or event.asset_materialization is None:
        return None
    meta = event.asset_materialization.metadata
    if meta.get("challenger") is None or meta["challenger"].value != challenger:
        return None
    return event


def _has_live_traffic(lake: TrajectoryLake, key: str, versions: tuple[str, str]) -> bool:
    try:
        frame = lake.scan_partition("trajectories", key).filter(pl.col("adapter_version").is_in(list(versions))).select(pl.len()).collect()
    except FileNotFoundError:
        return False
    return frame.item() > 0


@sensor(
    job=ab_test_job,
    minimum_interval_seconds=sensor_interval(),
    default_status=DefaultSensorStatus.RUNNING,  # a no-op until a challenger exists (FLOWOPT_LIVE_AB)
    description="While a challenger is in live A/B: requests ab_test_report on each new log batch of live traffic, "
    "and promotes or withdraws the challenger in the registry when the report's sequential test decides.",
)
def ab_monitor_sensor(context: SensorEvaluationContext, registry: AdapterRegistry, lake: TrajectoryLake):
    challenger = registry.challenger()
    if not challenger:
        return SkipReason("no challenger in live A/B")
    version, champion = challenger["version"], challenger["champion"]
    report = _latest_report(context.instance, version)
    if report is not None:
        meta = report.asset_materialization.metadata
        decision = meta["decision"].value
        if decision in ACTIONS:
            evidence = {k: v.value for k, v in meta.items() if k not in ("arms",)}
            try:
                after = registry.conclude_challenger(
                    ACTIONS[decision], by=f"ab_monitor_sensor (ab_test_report run {report.run_id})", reason=meta["reason"].value, evidence=evidence
                )
            except RegistryError as exc:
                return SkipReason(f"live A/B of {version} decided {decision}, but the registry refused: {exc}")
            context.instance.report_runless_asset_event(champion_materialization(registry.load()))
            return SkipReason(f"live A/B of {version} vs {champion}: {decision}; champion is now {after['version']} ({meta['reason'].value})")
    # the newest batch whose data plane finished after the last report, if it holds live traffic
    reported = report.timestamp if report is not None else challenger["since"]
    records = context.instance.fetch_materializations(AssetKey("rewards"), limit=20).records
    fresh = [r for r in records if r.timestamp > reported and r.partition_key]
    for record in fresh:  # newest first
        if _has_live_traffic(lake, record.partition_key, (champion, version)):
            key = record.partition_key
            return SensorResult(run_requests=[RunRequest(partition_key=key, run_key=f"ab:{version}:{key}:{record.storage_id}")])
    return SkipReason(f"live A/B of {version} vs {champion}: no new live traffic since the last report")
