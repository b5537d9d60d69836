"""``FlowoptInstance``: Dagster's instance with SQLite storage that skips the schema check of a database Dagster already created.

Why: Dagster's SQLite storages open each database (runs, schedules, the event-log index, each
run's event log) with ``check_alembic_revision``, which parses every alembic revision script
Dagster ships (0.1-0.2 s of CPU each on this project's 2-core machine). Every sensor evaluation
builds a new ``DagsterInstance`` in the code server, and that check was ~70% of an idle code
server's CPU (``docs/benchmarks.md``, "the idle daemon"); every launched run opened the event-log
index and its own run's database the same way before its first step (0.4-0.5 s a run, measured
with cProfile inside the run workers of a daemon's round). The check only decides whether a
database is new (then Dagster creates and stamps its tables); it never raises for a database at
an old revision, and it does nothing else for one that is stamped. So a database whose
``alembic_version`` table holds a revision is opened without it (reading that table takes
milliseconds), and a process that has seen a database initialised skips even that read while the
file is still there. A database without a stamp (new, or deleted since) goes through Dagster's
own path, which creates it.

Configured in ``dagster.yaml``, where it changes only the defaults (a ``storage:`` section, e.g.
PostgreSQL, is used as it is)::

    instance_class:
      module: flow_assets.runtime.instance
      class: FlowoptInstance

The storage follows the instance's directory exactly as Dagster's default SQLite storage does
(``history/runs.db``, ``history/runs/``, ``schedules/schedules.db``), so an instance created
before this class opens unchanged.
"""

import os
import threading
from collections.abc import Mapping

import yaml
from alembic.runtime.migration import MigrationContext
from dagster import DagsterInstance
from dagster._core.instance.ref import InstanceRef
from dagster._core.storage.event_log.sqlite.sqlite_event_log import SqliteEventLogStorage
from dagster._core.storage.runs.sqlite.sqlite_run_storage import SqliteRunStorage
from dagster._core.storage.schedules.sqlite.sqlite_schedule_storage import SqliteScheduleStorage
from dagster._core.storage.sqlite import create_db_conn_string
from dagster._core.storage.sqlite_storage import (
    DagsterSqliteStorage,
    _event_logs_directory,
    _runs_directory,
    _schedule_directory,
)
from dagster._serdes import ConfigurableClassData
from sqlalchemy import create_engine, inspect
from sqlalchemy.pool import NullPool

_lock = threading.Lock()
_initialised: set[str] = set()  # absolute paths of SQLite files this process found initialised


def db_path(conn_string: str) -> str:
    """The absolute path of the file a ``sqlite:///...`` connection string opens."""
    return os.path.abspath(conn_string.removeprefix("sqlite:///"))


def schema_checked(path: str) -> bool:
    """Whether this process has already found the SQLite database at ``path`` initialised (its
    tables created and stamped) and the file is still there."""
    with _lock:
        known = path in _initialised
    return known and os.path.exists(path)


def mark_checked(path: str) -> None:
    """Record that the SQLite database at ``path`` is initialised (after Dagster's own check)."""
    with _lock:
        _initialised.add(path)


def stamped(path: str, tables: tuple[str, ...] = ()) -> bool:
    """Whether the SQLite database at ``path`` exists, carries an alembic revision (Dagster
    created its tables and stamped it) and has ``tables``: then Dagster's schema check would
    leave it as it is. Reads the file only (never creates it).

    Raises:
        sqlalchemy.exc.DatabaseError: the file is not a SQLite database (Dagster's own check
            fails the same way).
    """
    if not os.path.isfile(path):
        return False
    engine = create_engine(f"sqlite:///{path}", poolclass=NullPool)
    try:
        with engine.connect() as conn:
            if MigrationContext.configure(conn).get_current_revision() is None:
                return False
            return not tables or set(tables) <= set(inspect(conn).get_table_names())
    finally:
        engine.dispose()


class _CheckedOnceFromLocal:
    """``from_local`` of a single-file Dagster SQLite storage (``<base_dir>/<_db_name>.db``):
    directly when this process has seen it initialised or it is stamped (:func:`stamped`), else
    through Dagster's check (which creates a new database)."""

    _db_name: str
    #: tables Dagster's ``from_local`` adds to a stamped database that lacks them
    _required_tables: tuple[str, ...] = ()

    @classmethod
    def from_local(cls, base_dir: str, inst_data: ConfigurableClassData | None = None):
        conn_string = create_db_conn_string(base_dir, cls._db_name)
        path = db_path(conn_string)
        if schema_checked(path):
            return cls(conn_string, inst_data)
        if stamped(path, cls._required_tables):
            mark_checked(path)
            return cls(conn_string, inst_data)
        storage = super().from_local(base_dir, inst_data)
        mark_checked(path)
        return storage

    @classmethod
    def from_config_value(cls, inst_data, config_value):
        """Built from ``dagster.yaml`` data: ``{"base_dir": directory}`` (Dagster's own names its class)."""
        return cls.from_local(inst_data=inst_data, **config_value)


class CheckedSqliteRunStorage(_CheckedOnceFromLocal, SqliteRunStorage):
    """Dagster's SQLite run storage (``<base_dir>/runs.db``), its schema checked only when it is
    not stamped yet (or lacks ``instance_info``)."""

    _db_name = "runs"
    _required_tables = ("instance_info",)


class CheckedSqliteScheduleStorage(_CheckedOnceFromLocal, SqliteScheduleStorage):
    """Dagster's SQLite schedule and sensor storage (``<base_dir>/schedules.db``), its schema
    checked only when it is not stamped yet."""

    _db_name = "schedules"


class CheckedSqliteEventLogStorage(SqliteEventLogStorage):
    """Dagster's SQLite event log (an index database and one database per run under
    ``base_dir``), each database's schema checked only when it is not stamped yet."""

    @classmethod
    def from_config_value(cls, inst_data, config_value):
        """Built from ``dagster.yaml`` data: ``{"base_dir": directory}`` (Dagster's own names its class)."""
        return cls(inst_data=inst_data, **config_value)

    def _initdb(self, engine, for_index_shard=False) -> None:
        # Dagster calls this on a storage's first connection to each shard; the check inside it
        # is the part that costs, and its answer does not change while the file exists
        path = db_path(str(engine.url))
        if schema_checked(path):
            return
        if stamped(path):
            mark_checked(path)
            return
        super()._initdb(engine, for_index_shard=for_index_shard)
        mark_checked(path)


class CheckedSqliteStorage(DagsterSqliteStorage):
    """Dagster's default SQLite storage under an instance directory, made of the three checked
    storages above (same files, same layout as ``DagsterSqliteStorage``)."""

    def __init__(self, base_dir: str, inst_data: ConfigurableClassData | None = None):
        # DagsterSqliteStorage.__init__ names its three storage classes; set what it sets
        self.base_dir = base_dir
        self._run_storage = CheckedSqliteRunStorage.from_local(_runs_directory(base_dir))
        self._event_log_storage = CheckedSqliteEventLogStorage(_event_logs_directory(base_dir))
        self._schedule_storage = CheckedSqliteScheduleStorage.from_local(_schedule_directory(base_dir))
        self._inst_data = inst_data
        super(DagsterSqliteStorage, self).__init__()

    @classmethod
    def from_config_value(cls, inst_data, config_value):
        """Built from ``dagster.yaml`` data: ``{"base_dir": instance directory}``."""
        return cls.from_local(inst_data=inst_data, **config_value)


def _class_data(cls: type, base_dir: str) -> ConfigurableClassData:
    return ConfigurableClassData(cls.__module__, cls.__name__, yaml.dump({"base_dir": base_dir}, default_flow_style=False))


class FlowoptInstance(DagsterInstance):
    """A ``DagsterInstance`` whose default storage is :class:`CheckedSqliteStorage`.

    Everything else is Dagster's: the other defaults, and any section ``dagster.yaml`` sets
    (``storage: postgres: ...`` replaces the SQLite default entirely).
    """

    @classmethod
    def config_schema(cls) -> dict:
        """No settings of its own (Dagster asks a custom instance class for its schema)."""
        return {}

    @staticmethod
    def config_defaults(base_dir: str) -> Mapping[str, ConfigurableClassData | None]:
        """Dagster's defaults for an instance in ``base_dir``, with the checked SQLite storages."""
        defaults = dict(InstanceRef.config_defaults(base_dir))
        defaults["storage"] = _class_data(CheckedSqliteStorage, base_dir)
        defaults["run_storage"] = _class_data(CheckedSqliteRunStorage, _runs_directory(base_dir))
        defaults["event_log_storage"] = _class_data(CheckedSqliteEventLogStorage, _event_logs_directory(base_dir))
        defaults["schedule_storage"] = _class_data(CheckedSqliteScheduleStorage, _schedule_directory(base_dir))
        return defaults
