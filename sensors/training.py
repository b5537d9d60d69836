"""``training_round_sensor``: every batch of the trainable policy's rollouts gets its round.

A batch qualifies when its ``advantages`` partition is materialised and its trajectories include
rollouts of the trainable policy (the task source's ``agent_id`` with logged token ids). Batches
of other agents (e.g. the tau-bench or FireAct logs) stop after ``advantages``. Rounds run one at
a time (pool ``training``), so each starts from the champion the previous round left.
"""

import json

import polars as pl
from dagster import AssetKey, DefaultSensorStatus, RunRequest, SensorEvaluationContext, SensorResult, SkipReason, sensor

from flow_assets.jobs import training_round_job
from resources.lake import TrajectoryLake
from resources.tasks import TaskSourceResource


@sensor(job=training_round_job, minimum_interval_seconds=30, default_status=DefaultSensorStatus.RUNNING)
def training_round_sensor(context: SensorEvaluationContext, lake: TrajectoryLake, tasks: TaskSourceResource):
    """Requests ``training_round_job`` once per new batch of trainable rollouts (cursor: the
    batches already decided, trainable or not)."""
    decided: set[str] = set(json.loads(context.cursor) if context.cursor else [])
    ready = context.instance.get_materialized_partitions(AssetKey("advantages")) - decided
    requests, skipped = [], []
    for key in sorted(ready):
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
