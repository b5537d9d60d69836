"""Runs whose process died: found, marked failed, their half-written files removed, their batches
run again.

``flowopt ingest`` (and the demos) execute runs in their own process. A process killed mid-run
(``kill -9``, out of memory, a lost machine) leaves its run ``STARTED`` forever, and Dagster's run
monitoring cannot tell (the default run launcher has no worker health check). So every run
flowopt executes in process carries tags naming its process (:func:`process_tags`: host, pid and
the process's start time, which tells a reused pid apart). Before work starts, ``flowopt ingest``
and each ``new_logs_sensor`` tick call :func:`recover_dead_runs`: a run that is not finished and
whose process is gone is reported failed (``flowopt/died`` tag, a message that says so), and
the temporary files its writers left in the lake are removed. Its batch is then not
"ingested" (the last asset never materialised), so ``flowopt ingest`` runs it again, and the
sensor requests it again (:func:`batches_to_rerun`). Re-running is idempotent by construction:
every table's partition is replaced as a whole, never appended to.

Only runs started on this host are judged; a run from another machine is never marked dead.

A landed file that grows after it was registered (its writer paused past the sensor's settle
time, then appended) would land its first part twice: once as the batch registered early, once
in the batch of the whole file. :func:`retire_grown_batches` retires the early batch when the
whole file's batch is registered (its bytes are a prefix of the file now, so nothing is lost).
"""

from __future__ import annotations

import os
import socket

import psutil
from dagster import DagsterInstance, DagsterRunStatus, RunsFilter

from flow_assets.core.partitions import log_batches
from flow_assets.logs.landing import LandedFile, grown_from

HOST_TAG = "flowopt/host"
PID_TAG = "flowopt/pid"
PROCESS_STARTED_TAG = "flowopt/process_started"
DIED_TAG = "flowopt/died"
PARTITION_NAME_TAG = "dagster/partition"  # the tag Dagster puts on a partitioned run
UNFINISHED = [DagsterRunStatus.NOT_STARTED, DagsterRunStatus.STARTING, DagsterRunStatus.STARTED]


def process_tags() -> dict[str, str]:
    """Tags that name this process: host name, pid, and its start time (UNIX seconds, 2 decimals)."""
    started = psutil.Process(os.getpid()).create_time()
    return {HOST_TAG: socket.gethostname(), PID_TAG: str(os.getpid()), PROCESS_STARTED_TAG: f"{started:.2f}"}


def process_alive(tags: dict[str, str]) -> bool | None:
    """Whether the process named by ``tags`` (:func:`process_tags`) still runs: ``None`` when it
    cannot be told here (no such tags, or another host)."""
    if tags.get(HOST_TAG) != socket.gethostname() or PID_TAG not in tags:
        return None
    try:
        started = psutil.Process(int(tags[PID_TAG])).create_time()
    except (psutil.NoSuchProcess, ValueError):
        return False
    except psutil.AccessDenied:
        return True  # it exists; someone else's process is alive
    return f"{started:.2f}" == tags.get(PROCESS_STARTED_TAG)  # a reused pid is another process


def recover_dead_runs(instance: DagsterInstance, lake=None) -> list[str]:
    """Report every unfinished run of this host whose process is gone as failed, tag it
    ``flowopt/died``, and remove its partition's temporary files from ``lake`` (when given).

    Returns:
        The run ids recovered.
    """
    recovered = []
    host = socket.gethostname()
    for run in instance.get_runs(RunsFilter(statuses=UNFINISHED, tags={HOST_TAG: host})):
        if process_alive(run.tags) is not False:
            continue
        instance.report_run_failed(
            run, message=f"the process that ran this run (pid {run.tags.get(PID_TAG)} on {host}) died before it finished; "
            "flowopt marked it failed and runs its batch again"  # fmt: skip
        )
        instance.add_run_tags(run.run_id, {DIED_TAG: "true"})
        key = run.tags.get(PARTITION_NAME_TAG)
        if lake is not None and key:
            lake.remove_partial_files(key)
        recovered.append(run.run_id)
    return recovered


def batches_to_rerun(instance: DagsterInstance, job_name: str = "log_batch_job") -> dict[str, str]:
    """Partition key -> id of its dead run, for every batch of ``job_name`` whose latest run died
    (tagged ``flowopt/died`` by :func:`recover_dead_runs`) and that has run neither before nor
    since with success, nor is running now."""
    dead = instance.get_runs(RunsFilter(job_name=job_name, statuses=[DagsterRunStatus.FAILURE], tags={DIED_TAG: "true"}))
    out: dict[str, str] = {}
    for run in dead:
        key = run.tags.get(PARTITION_NAME_TAG)
        if not key or key in out:
            continue
        latest = instance.get_runs(RunsFilter(job_name=job_name, tags={PARTITION_NAME_TAG: key}), limit=1)
        succeeded = instance.get_runs(
            RunsFilter(job_name=job_name, statuses=[DagsterRunStatus.SUCCESS], tags={PARTITION_NAME_TAG: key}), limit=1
        )
        if latest and latest[0].run_id == run.run_id and not succeeded:
            out[key] = run.run_id
    return out


def retire_grown_batches(instance: DagsterInstance, lake, landed: LandedFile) -> tuple[list[str], list[str]]:
    """Retire the batches registered from ``landed``'s name whose bytes are a strict prefix of
    the file now (:func:`flow_assets.logs.landing.grown_from`): their dynamic partition and every row and
    snapshot of theirs in ``lake`` go, because the batch of the whole file holds all their records.
    Nothing is retired while one of them has an unfinished run (it would write rows back); the
    caller waits for a later tick then.

    Returns:
        ``(keys retired, keys with an unfinished run)``; at most one of them is non-empty.
    """
    grown = grown_from(landed, lake.registered_batches())
    busy = [k for k in grown if instance.get_runs(RunsFilter(statuses=UNFINISHED, tags={PARTITION_NAME_TAG: k}), limit=1)]
    if busy:
        return [], busy
    for key in grown:
        if instance.has_dynamic_partition(log_batches.name, key):
            instance.delete_dynamic_partition(log_batches.name, key)
        lake.drop_batch(key)
    return grown, []
