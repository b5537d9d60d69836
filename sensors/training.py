"""``training_round_sensor``: every batch of the trainable policy's rollouts gets its round.

A batch qualifies when its ``advantages`` partition is materialised and its trajectories include
rollouts of the trainable policy (the task source's ``agent_id`` with logged token ids), and the
blocking data checks of the run that produced it passed (a batch with non-finite advantages
never reaches training). Batches
of other agents (e.g. the tau-bench or FireAct logs) stop after ``advantages``. Rounds run one at
a time (pool ``training``), so each starts from the champion the previous round left.
"""

import json

import polars as pl
from dagster import (
    AssetKey,
    AssetRecordsFilter,
    DagsterEventType,
    DagsterInstance,
    DefaultSensorStatus,
    RunRequest,
    SensorEvaluationContext,
    SensorResult,
    SkipReason,
    sensor,
)

from flow_assets.jobs import training_round_job
from resources.lake import TrajectoryLake
from resources.tasks import TaskSourceResource


DATA_CHECKS = ("advantages_finite", "records_conserved")


def failed_data_checks(instance: DagsterInstance, key: str) -> list[str]:
    """Names of the blocking data checks (:data:`DATA_CHECKS`) that failed in the run that last
    materialised batch ``key``'s ``advantages`` (empty when they passed or it was never materialised)."""
    records = instance.fetch_materializations(AssetRecordsFilter(asset_key=AssetKey("advantages"), asset_partitions=[key]), limit=1).records
    if not records:
        return []
    failed = []
    for entry in instance.all_logs(records[0].run_id, of_type=DagsterEventType.ASSET_CHECK_EVALUATION):
        evaluation = entry.dagster_event.event_specific_data
        if evaluation.check_name in DATA_CHECKS and not evaluation.passed:
            failed.append(evaluation.check_name)
    return sorted(set(failed))


@sensor(job=training_round_job, minimum_interval_seconds=30, default_status=DefaultSensorStatus.RUNNING)
def training_round_sensor(context: SensorEvaluationContext, lake: TrajectoryLake, tasks: TaskSourceResource):
    """Requests ``training_round_job`` once per new batch of trainable rollouts (cursor: the
    batches already decided, trainable or not)."""
    decided: set[str] = set(json.loads(context.cursor) if context.cursor else [])
    ready = context.instance.get_materialized_partitions(AssetKey("advantages")) - decided
    requests, skipped = [], []
    for key in sorted(ready):
        failed = failed_data_checks(context.instance, key)
        if failed:
            decided.add(key)
            skipped.append(key)
            context.log.warning(f"batch {key}: data check(s) {', '.join(failed)} failed; no training round")
            continue
        traj = lake.read_partition("trajectories", key)
        trainable = traj.filter(pl.col("agent_id") == tasks.agent_id).height > 0
        decided.add(key)
        if trainable:
            requests.append(RunRequest(run_key=f"train:{key}", partition_key=key))
        else:
            skipped.append(key)
    cursor = json.dumps(sorted(decided))
    if not requests:
        reason = f"no new batch of {tasks.agent_id}" + (f"; {len(skipped)} other batches stop after advantages" if skipped else "")
        return SensorResult(skip_reason=SkipReason(reason), cursor=cursor)
    return SensorResult(run_requests=requests, cursor=cursor)
