"""``FlowoptInstance``: the repository's dagster.yaml builds it, its SQLite storage is Dagster's
layout, and a database's schema is checked only when the database is not stamped (new, or gone
since): once per process at most, and never in a process that opens databases Dagster created."""

import shutil
import sqlite3
import uuid
from pathlib import Path

import dagster._core.storage.event_log.sqlite.sqlite_event_log as event_log_module
import dagster._core.storage.runs.sqlite.sqlite_run_storage as run_module
import dagster._core.storage.schedules.sqlite.sqlite_schedule_storage as schedule_module
import pytest

import flow_assets.runtime.instance as instance_module
from dagster import DagsterInstance, DagsterRun
from dagster._core.instance.ref import InstanceRef

from flow_assets.runtime.instance import (
    CheckedSqliteEventLogStorage,
    CheckedSqliteRunStorage,
    CheckedSqliteScheduleStorage,
    FlowoptInstance,
)
from flow_assets.runtime.local import REPO_ROOT, local_instance


@pytest.fixture
def alembic_checks(monkeypatch):
    """Counts the real ``check_alembic_revision`` calls of Dagster's three SQLite storages, by
    the path of the database checked (the real function runs)."""
    seen: list[str] = []
    for module in (run_module, schedule_module, event_log_module):
        real = module.check_alembic_revision

        def counted(config, conn, real=real):
            seen.append(Path(conn.engine.url.database).name)
            return real(config, conn)

        monkeypatch.setattr(module, "check_alembic_revision", counted)
    return seen


def _home(tmp_path: Path) -> Path:
    # a path no other test used: the cache of checked databases is per process
    home = tmp_path / f"home-{uuid.uuid4().hex[:8]}"
    home.mkdir()
    shutil.copyfile(REPO_ROOT / "dagster.yaml", home / "dagster.yaml")
    return home


def test_repository_yaml_builds_flowopt_instance_with_dagsters_sqlite_layout(tmp_path):
    home = _home(tmp_path)
    instance = DagsterInstance.from_config(str(home))
    try:
        assert isinstance(instance, FlowoptInstance)
        assert isinstance(instance.run_storage, CheckedSqliteRunStorage)
        assert isinstance(instance.event_log_storage, CheckedSqliteEventLogStorage)
        assert isinstance(instance.schedule_storage, CheckedSqliteScheduleStorage)
        instance.add_run(DagsterRun(job_name="a_job", run_id=str(uuid.uuid4())))
        instance.add_dynamic_partitions("log_batches", ["b1"])
    finally:
        instance.dispose()
    # Dagster's own layout: a plain DagsterInstance (no config file: Dagster's defaults) over the
    # same directory sees the run and the partition
    for name in ("history/runs.db", "history/runs/index.db", "schedules/schedules.db"):
        assert (home / name).is_file(), name
    plain = DagsterInstance.from_ref(InstanceRef.from_dir(str(home), config_filename="absent.yaml"))
    try:
        assert type(plain) is DagsterInstance
        assert [run.job_name for run in plain.get_runs()] == ["a_job"]
        assert plain.get_dynamic_partitions("log_batches") == ["b1"]
    finally:
        plain.dispose()


def test_schema_checked_once_per_process_then_again_when_the_file_is_gone(tmp_path, alembic_checks):
    home = _home(tmp_path)
    ref = InstanceRef.from_dir(str(home))

    def build_and_query():
        instance = DagsterInstance.from_ref(ref)
        try:
            instance.get_runs(limit=1)
            instance.get_dynamic_partitions("log_batches")
            return instance.event_log_storage.get_asset_records()
        finally:
            instance.dispose()

    build_and_query()
    assert {"runs.db", "schedules.db", "index.db"} <= set(alembic_checks)
    alembic_checks.clear()
    for _ in range(3):
        build_and_query()
    assert alembic_checks == []  # the later instances of this process skip the check

    (home / "history" / "runs.db").unlink()
    for suffix in ("-wal", "-shm"):
        (home / "history" / f"runs.db{suffix}").unlink(missing_ok=True)
    build_and_query()  # a deleted database is checked, and so created, again
    assert alembic_checks == ["runs.db"]
    tables = {row[0] for row in sqlite3.connect(home / "history" / "runs.db").execute("select name from sqlite_master")}
    assert {"runs", "alembic_version"} <= tables


def test_a_new_process_opens_the_databases_dagster_stamped_without_the_check(tmp_path, alembic_checks, monkeypatch):
    """A run worker or a code server opens databases another process created: the runs, the
    schedules, the event-log index and the run's own event log. None of them is checked (each
    check parses every revision script), and what Dagster wrote reads back; a database file
    that is there but not stamped (an empty file) still goes through Dagster's path, which
    creates its tables."""
    from dagster import DagsterEvent, DagsterEventType, EventLogEntry
    from dagster._core.events import EngineEventData

    home = _home(tmp_path)
    ref = InstanceRef.from_dir(str(home))
    run_id = str(uuid.uuid4())
    creator = DagsterInstance.from_ref(ref)
    try:
        creator.add_run(DagsterRun(job_name="a_job", run_id=run_id))
        event = DagsterEvent(DagsterEventType.ENGINE_EVENT.value, "a_job", message="from the creator", event_specific_data=EngineEventData())
        creator.store_event(EventLogEntry(error_info=None, level="INFO", user_message="from the creator", run_id=run_id, timestamp=1.0,
                                          dagster_event=event, job_name="a_job"))  # fmt: skip
    finally:
        creator.dispose()
    assert (home / "history" / "runs" / f"{run_id}.db").is_file()

    monkeypatch.setattr(instance_module, "_initialised", set())  # another process: nothing seen yet
    alembic_checks.clear()
    opener = DagsterInstance.from_ref(ref)
    try:
        assert [r.run_id for r in opener.get_runs()] == [run_id]
        assert [e.user_message for e in opener.all_logs(run_id)] == ["from the creator"]
        opener.get_dynamic_partitions("log_batches")
    finally:
        opener.dispose()
    assert alembic_checks == []

    # present but not stamped: Dagster's own path, which creates the tables
    monkeypatch.setattr(instance_module, "_initialised", set())
    (home / "schedules" / "schedules.db").unlink()
    (home / "schedules" / "schedules.db").touch()
    DagsterInstance.from_ref(ref).dispose()
    assert alembic_checks == ["schedules.db"]
    assert instance_module.stamped(str(home / "schedules" / "schedules.db"))


def test_local_instance_and_a_storage_section(tmp_path):
    instance = local_instance(tmp_path / "local")
    try:
        assert isinstance(instance, FlowoptInstance)
        assert isinstance(instance.run_storage, CheckedSqliteRunStorage)
    finally:
        instance.dispose()
    # a `storage` section is used as it is: the defaults are not consulted
    home = _home(tmp_path)
    with open(home / "dagster.yaml", "a") as f:
        f.write("storage:\n  sqlite:\n    base_dir: " + str(tmp_path / "elsewhere") + "\n")
    other = DagsterInstance.from_config(str(home))
    try:
        assert isinstance(other, FlowoptInstance)
        assert type(other.run_storage).__name__ == "SqliteRunStorage"
        assert (tmp_path / "elsewhere" / "history" / "runs.db").is_file()
    finally:
        other.dispose()
