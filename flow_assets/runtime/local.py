"""Running flowopt on a local Dagster instance without a daemon: one sensor tick, then its runs.

This is what the daemon does with a sensor's result, done in-process so that ``flowopt ingest``,
``flowopt demo`` and the tests need no server: the runs, materialisations and partitions land in
the instance under ``DAGSTER_HOME`` and are visible in the UI afterwards (``make ui``).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

from dagster import (
    DagsterInstance,
    Definitions,
    RunRequest,
    SensorResult,
    build_sensor_context,
)

from filelock import FileLock

from flow_assets.runtime.recovery import process_tags
from flow_assets.settings import DEFAULT_DAGSTER_HOME

REPO_ROOT = Path(__file__).resolve().parents[2]


def local_instance(home: str | os.PathLike | None = None) -> DagsterInstance:
    """The persistent instance in ``home`` (default: ``./.dagster_home``; callers pass their
    settings' ``dagster_home``, i.e. ``$DAGSTER_HOME`` where set).

    The directory is created, and the repository's ``dagster.yaml`` copied into it when it has
    none, so a fresh clone works without setup; the storage is created under an inter-process
    lock, so concurrent first calls do not race. The process environment is left as it is (other
    threads may read it at any moment): subprocesses get ``DAGSTER_HOME`` passed explicitly.
    """
    path = Path(home or DEFAULT_DAGSTER_HOME).resolve()
    path.mkdir(parents=True, exist_ok=True)
    # Creating a new instance's storage (tables, alembic stamps) is not safe to race: two first
    # ingests at once left "alembic_version has more than one head". One process creates it, under
    # a lock in DAGSTER_HOME; the others then open the finished storage.
    with FileLock(str(path / ".flowopt-instance.lock")):
        template = REPO_ROOT / "dagster.yaml"
        if template.exists() and not (path / "dagster.yaml").exists():
            shutil.copyfile(template, path / "dagster.yaml")
        instance = DagsterInstance.from_config(str(path))
        instance.get_runs(limit=1)  # touch run, event log and schedule storage while locked
        instance.get_dynamic_partitions("log_batches")
    return instance


def _root_message(error) -> str:
    # Dagster wraps the asset's exception; the user needs the innermost message (it names the file)
    while error.cause is not None:
        error = error.cause
    return error.message.strip()


@dataclass
class TickOutcome:
    """What one sensor tick asked for and what its runs did."""

    cursor: str | None
    added_partitions: list[str] = field(default_factory=list)
    run_requests: list[RunRequest] = field(default_factory=list)
    succeeded: list[str] = field(default_factory=list)
    failed: dict[str, str] = field(default_factory=dict)


def tick_sensor(defs: Definitions, instance: DagsterInstance, sensor_name: str, cursor: str | None = None) -> TickOutcome:
    """Evaluate ``sensor_name`` once and add the dynamic partitions it requests to ``instance``.

    Returns:
        The new cursor, the partitions added and the run requests (not yet executed).
    """
    sensor_def = defs.resolve_sensor_def(sensor_name)
    with build_sensor_context(instance=instance, cursor=cursor, resources=defs.resources, sensor_name=sensor_name) as ctx:
        result = sensor_def(ctx)
        new_cursor = ctx.cursor
    outcome = TickOutcome(cursor=new_cursor)
    if isinstance(result, SensorResult):
        outcome.cursor = result.cursor if result.cursor is not None else new_cursor
        for request in result.dynamic_partitions_requests or []:
            instance.add_dynamic_partitions(request.partitions_def_name, list(request.partition_keys))
            outcome.added_partitions.extend(request.partition_keys)
        outcome.run_requests = [r for r in (result.run_requests or []) if isinstance(r, RunRequest)]
    return outcome


def run_job(
    defs: Definitions,
    instance: DagsterInstance,
    job_name: str,
    partition_key: str | None = None,
    run_config: dict | None = None,
    log_level: str = "CRITICAL",
    tags: dict | None = None,
):
    """Execute ``job_name`` once, in process, as a run recorded on ``instance``.

    ``log_level`` applies to the console only (the instance keeps every event, stack traces
    included, for the UI). The run is tagged with this process (:func:`~flow_assets.runtime.recovery.process_tags`).
    Returns the ``ExecuteInProcessResult``; failures do not raise.
    """
    config = dict(run_config or {})
    config.setdefault("loggers", {"console": {"config": {"log_level": log_level}}})
    # the run names this process, so that if the process dies the run can be told dead
    # (flow_assets/runtime/recovery.py) instead of staying STARTED forever
    tags = {**process_tags(), **(tags or {})}
    return defs.resolve_job_def(job_name).execute_in_process(
        instance=instance, partition_key=partition_key, run_config=config, tags=tags, raise_on_error=False
    )


def execute_requests(
    defs: Definitions,
    instance: DagsterInstance,
    job_name: str,
    outcome: TickOutcome,
    run_config: dict | None = None,
    log_level: str = "WARNING",
) -> TickOutcome:
    """Execute each run request of ``outcome`` as a run of ``job_name`` on ``instance``.

    A failing run (e.g. an unreadable log file) is recorded in ``outcome.failed`` with its error
    and does not stop the other partitions. ``log_level`` applies to the console only; the full
    event log is stored in the instance either way.
    """
    for request in outcome.run_requests:
        result = run_job(
            defs, instance, job_name, request.partition_key, run_config or request.run_config, log_level, request.tags
        )
        if result.success:
            outcome.succeeded.append(request.partition_key)
        else:
            errors, _ = failure_messages(result)
            outcome.failed[request.partition_key] = "; ".join(errors) or "run failed"
    return outcome


def failure_messages(result) -> tuple[list[str], list[str]]:
    """The innermost error message of each failed step of a run's result (they name the file),
    and each one's full Dagster error with its stack trace (for ``--verbose``)."""
    errors = [
        e.event_specific_data.error
        for e in result.all_events
        if e.is_step_failure and e.event_specific_data and e.event_specific_data.error
    ]
    return [_root_message(e) for e in errors], [e.to_string() for e in errors]


def stop_process_group(process: subprocess.Popen, timeout: float = 60.0) -> None:
    """SIGTERM to ``process``'s group (it was started with ``start_new_session``), wait up to
    ``timeout`` seconds for the leader, then SIGKILL whatever of the group is left: a code server
    the webserver or the daemon started can outlive them (seen on a PostgreSQL-backed instance:
    orphaned ``dagster api grpc`` processes of 600 MB each)."""
    try:
        os.killpg(process.pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    try:
        process.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        pass
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    process.wait()
