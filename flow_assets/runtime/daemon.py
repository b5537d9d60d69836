"""``flowopt daemon``: ``dagster-daemon`` whose sensor loop runs every
``FLOWOPT_SENSOR_LOOP_SECONDS`` instead of Dagster's fixed 5 s.

Why: a sensor is evaluated no more often than the daemon's sensor loop comes round, whatever its
``minimum_interval_seconds``, and Dagster fixes that loop at 5 s (``MIN_INTERVAL_LOOP_TIME`` in
``dagster._daemon.sensor``, read at the end of every iteration; no instance or CLI setting exposes
it). A training round is a chain of sensor hops (collection -> data plane -> round -> history,
each started by a sensor seeing the one before it finish), so on the demo's short rounds the wait
for the next loop, 2.5 s on average per hop, was a large part of the round
(``docs/benchmarks.md``, ``training_round``).

The loop time is set once, in this process, before Dagster starts its daemon threads (nothing else
runs yet to read it), then Dagster's own CLI runs unchanged: ``flowopt daemon run -w
workspace.yaml`` takes exactly ``dagster-daemon``'s arguments. A Dagster release without that
constant is run as it is, at its own loop time, with a warning.

It also wakes the sensor loop and the run queue when a run finishes or is queued
(``FLOWOPT_RUN_WATCH_SECONDS``, :func:`install_run_watch`): both loops otherwise sleep out their
time whatever happens, so each hop of a round also waited half a loop and half a dequeue interval
on average. A sensor then ticks right after a run that finished since its last tick, even
within its ``minimum_interval_seconds`` (one such early tick per interval at most, :func:`ticks_on_news`): that
interval (an integer, at least 1 s) was longer than a round's data-plane run.
"""

from __future__ import annotations

import functools
import logging
import os
import sys
import threading
import time
import warnings

from flow_assets.settings import DEFAULT_SENSOR_LOOP_SECONDS

log = logging.getLogger(__name__)


def set_sensor_loop(seconds: float) -> bool:
    """Make this process's Dagster sensor daemon start an iteration at most every ``seconds``
    (an iteration that takes longer is followed at once by the next). Call it before the daemon
    threads start.

    Returns:
        Whether this Dagster release has the loop constant (false: nothing was changed, a
        warning says so).

    Raises:
        ValueError: ``seconds`` is not positive.
    """
    if not seconds > 0:
        raise ValueError(f"the sensor loop time must be positive seconds, got {seconds!r}")
    import dagster._daemon.sensor as sensor_daemon

    if not isinstance(getattr(sensor_daemon, "MIN_INTERVAL_LOOP_TIME", None), (int, float)):
        warnings.warn("this Dagster release has no dagster._daemon.sensor.MIN_INTERVAL_LOOP_TIME: the sensor loop keeps Dagster's own time", stacklevel=2)
        return False
    sensor_daemon.MIN_INTERVAL_LOOP_TIME = seconds
    return True


#: least seconds between two reads of a run storage on a database server: each read is two
#: queries, which a SQLite file's ``stat`` cannot stand in for there
SERVER_POLL_SECONDS = 1.0
#: run statuses after which a sensor may have something new to do
FINISHED_STATUSES = ("SUCCESS", "FAILURE", "CANCELED")


class RunWatch:
    """A thread that reads the instance's run storage every ``poll_seconds`` and counts what changed
    since it started: runs that finished (succeeded, failed or were cancelled) and runs newly queued.

    Why: Dagster's sensor and run-queue loops sleep between iterations whatever happens, so a
    round of three runs, each started by a sensor that sees the one before it finish, waited
    about half a sensor loop and half a dequeue interval per run (``docs/benchmarks.md``,
    ``training_round``). The loops :func:`install_run_watch` patches wait on this watch instead,
    and wake as soon as it sees a change.

    A poll reads the run table (the most recently updated finished run, and the ids of up to 100
    queued runs: ~10 ms of CPU with SQLite, most of it opening connections) only when it may have
    changed: with Dagster's SQLite run storage, when the database file's modification time or size
    moved (a ``stat``: microseconds); any other storage (PostgreSQL) is read at most once a
    second (:data:`SERVER_POLL_SECONDS`), whatever ``poll_seconds`` says.

    Args:
        instance: the Dagster instance whose runs to watch (its run storage must be safe to read
            from another thread: Dagster's SQL storages are).
        poll_seconds: seconds between two reads, > 0.
        shutdown: an event that stops the thread (as :meth:`stop` does); waiters return within
            ``poll_seconds`` of it.

    Raises:
        ValueError: ``poll_seconds`` is not positive.
    """

    def __init__(self, instance, poll_seconds: float, shutdown: threading.Event):
        if not poll_seconds > 0:
            raise ValueError(f"the run watch's poll time must be positive seconds, got {poll_seconds!r}")
        self._instance, self.poll_seconds, self._shutdown = instance, poll_seconds, shutdown
        self._changed, self._stopped = threading.Condition(), threading.Event()
        #: changes seen so far: finished runs, newly queued runs (monotonic counters)
        self.finished = self.queued = 0
        #: wall-clock time (seconds since the epoch, as Dagster stamps a sensor's ticks) at which
        #: the latest finished run was seen; 0.0 before the first. A run seen then ended before it.
        self.finished_seen_at = 0.0
        #: wall-clock time (seconds since the epoch) by which a waiter returns even without news:
        #: when a sensor refused an early tick becomes due (:func:`ticks_on_news`); None: none
        self.due_at: float | None = None
        self._db_file = _sqlite_file(instance.run_storage)
        if self._db_file is None:
            self.poll_seconds = max(poll_seconds, SERVER_POLL_SECONDS)
        self._stamp = self._file_stamp()
        self._last_finished = self._read_finished()
        self._queued_ids = self._read_queued()
        self._thread = threading.Thread(target=self._loop, name="flowopt-run-watch", daemon=True)

    def _read_finished(self) -> tuple | None:
        from dagster import DagsterRunStatus, RunsFilter

        records = self._instance.get_run_records(
            RunsFilter(statuses=[DagsterRunStatus(s) for s in FINISHED_STATUSES]), limit=1, order_by="update_timestamp", ascending=False
        )  # fmt: skip
        return (records[0].dagster_run.run_id, records[0].update_timestamp) if records else None

    def _read_queued(self) -> frozenset[str]:
        from dagster import DagsterRunStatus, RunsFilter

        return frozenset(self._instance.get_run_ids(RunsFilter(statuses=[DagsterRunStatus.QUEUED]), limit=100))

    def _file_stamp(self) -> tuple[int, int] | None:
        if self._db_file is None:
            return None
        try:
            stat = os.stat(self._db_file)
        except OSError:
            return None
        return stat.st_mtime_ns, stat.st_size

    def poll(self) -> tuple[bool, bool]:
        """Read the run storage once (if it may have changed); count and announce what changed.

        Returns:
            ``(a run finished, a run was queued)`` since the previous poll.
        """
        stamp = self._file_stamp()
        if stamp is not None and stamp == self._stamp:
            return False, False
        self._stamp = stamp
        finished, queued = self._read_finished(), self._read_queued()
        new_finish, new_queue = finished != self._last_finished, bool(queued - self._queued_ids)
        self._last_finished, self._queued_ids = finished, queued
        if new_finish or new_queue:
            with self._changed:
                if new_finish:
                    self.finished_seen_at = time.time()
                self.finished += new_finish
                self.queued += new_queue
                self._changed.notify_all()
        return new_finish, new_queue

    def _loop(self) -> None:
        while not self._stopped.wait(self.poll_seconds) and not self._shutdown.is_set():
            try:
                self.poll()
            except Exception as error:  # a storage hiccup must not end the watch: the loops still run on their timers
                log.warning("run watch: reading the run storage failed: %s", error)
        with self._changed:
            self._changed.notify_all()

    def start(self) -> "RunWatch":
        self._thread.start()
        return self

    def stop(self) -> None:
        """End the thread (within ``poll_seconds``)."""
        self._stopped.set()

    def seen(self) -> tuple[int, int]:
        """The counters now, ``(finished, queued)``: pass them to :meth:`wait`."""
        with self._changed:
            return self.finished, self.queued

    def wait(self, timeout: float, since: tuple[int, int], queued_too: bool) -> tuple[int, int]:
        """Block until a run finished (or, with ``queued_too``, was queued) after ``since`` was
        read, the shutdown event is set, ``timeout`` seconds passed, or the due time
        (:meth:`due_by`) came; a due time that came is cleared.

        Returns:
            The counters when it returned (the next call's ``since``).
        """

        def news() -> bool:
            return self.finished > since[0] or (queued_too and self.queued > since[1]) or self._shutdown.is_set()

        with self._changed:
            deadline = time.monotonic() + max(0.0, timeout)
            while not news():
                left = deadline - time.monotonic()
                if self.due_at is not None:
                    left = min(left, self.due_at - time.time())
                if left <= 0:
                    break
                self._changed.wait(left)
            if self.due_at is not None and self.due_at <= time.time():
                self.due_at = None
            return self.finished, self.queued

    def due_by(self, at: float) -> None:
        """Make :meth:`wait` return by wall-clock time ``at`` (seconds since the epoch) at the
        latest, news or not (an earlier due time set before stands); waiters now waiting too."""
        with self._changed:
            self.due_at = at if self.due_at is None else min(self.due_at, at)
            self._changed.notify_all()


def _sqlite_file(run_storage) -> str | None:
    """The database file of Dagster's SQLite run storage (``None`` for any other storage)."""
    from dagster._core.storage.runs.sqlite.sqlite_run_storage import SqliteRunStorage

    from flow_assets.runtime.instance import db_path

    conn_string = getattr(run_storage, "_conn_string", None)
    return db_path(conn_string) if isinstance(run_storage, SqliteRunStorage) and conn_string else None


class _WakingShutdown:
    """Stands in for a daemon's shutdown event inside its loop: ``wait(t)`` returns as soon as
    ``watch`` sees news (what is new since the previous ``wait`` returned), the shutdown event is
    set, or ``t`` seconds pass; everything else is the real event's.

    ``min_gap``: seconds a wait woken by news still lasts at least, counted from when it was
    called (the end of the loop's previous iteration), never past ``t``. The sensor loop needs it
    where :func:`ticks_on_news` cannot be installed: Dagster skips a sensor ticked less than its
    ``minimum_interval_seconds`` ago, so an iteration woken too soon after the previous one would
    skip the very sensor the news is for.
    """

    def __init__(self, shutdown: threading.Event, watch: RunWatch, queued_too: bool, min_gap: float = 0.0):
        self._shutdown, self._watch, self._queued_too, self._min_gap = shutdown, watch, queued_too, min_gap
        self._since = watch.seen()
        #: whether the last ``wait`` ended for news
        self.woke = False

    def is_set(self) -> bool:
        return self._shutdown.is_set()

    def wait(self, timeout: float | None = None) -> bool:
        called, since = time.monotonic(), self._since
        timeout = 3600.0 if timeout is None else max(0.0, timeout)
        self._since = self._watch.wait(timeout, since, self._queued_too)
        self.woke = self._since[0] > since[0] or (self._queued_too and self._since[1] > since[1])
        if self.woke and not self._shutdown.is_set():
            rest = called + min(self._min_gap, timeout) - time.monotonic()
            if rest > 0:
                self._shutdown.wait(rest)
        return self._shutdown.is_set()

    def __getattr__(self, name: str):
        return getattr(self._shutdown, name)


def _watched(core_loop, queued_too: bool, poll_seconds: float, min_gap: float = 0.0, watches: list | None = None):
    """``core_loop`` (a Dagster daemon's generator method) run with :class:`_WakingShutdown` for
    its shutdown event, and a :class:`RunWatch` of its own for as long as it runs (appended to
    ``watches`` when given, the latest last)."""

    @functools.wraps(core_loop)
    def loop(self, workspace_process_context, shutdown_event):
        watch = RunWatch(workspace_process_context.instance, poll_seconds, shutdown_event).start()
        if watches is not None:
            watches.append(watch)
            del watches[:-1]  # a loop started again after an error replaces its watch
        try:
            yield from core_loop(self, workspace_process_context, _WakingShutdown(shutdown_event, watch, queued_too, min_gap))
        finally:  # Dagster may start the loop again after an error: one watch per loop that runs
            watch.stop()

    return loop


def _dequeue_loop(self, workspace_process_context, shutdown_event):
    """The run queue's loop (``QueuedRunCoordinatorDaemon``): an iteration, then a wait of the
    rest of the dequeue interval that ends early when ``shutdown_event`` (a
    :class:`_WakingShutdown`) says a run was queued or finished. Dagster's own loop waits out the
    interval in 0.5 s slices whatever happens."""
    from dagster._daemon.daemon import SpanMarker
    from dagster._utils.error import serializable_error_info_from_exc_info

    while not shutdown_event.is_set():
        started = time.monotonic()
        yield SpanMarker.START_SPAN
        try:
            yield from self.run_iteration(workspace_process_context)
        except Exception:
            error = serializable_error_info_from_exc_info(sys.exc_info())
            self._logger.error("Caught error:\n%s", error)
            yield error
        yield SpanMarker.END_SPAN
        # wake early for news, but keep yielding at least every 0.5 s for the daemon's heartbeat
        while (left := self.interval_seconds - (time.monotonic() - started)) > 0:
            if shutdown_event.wait(min(left, 0.5)):
                return
            yield None
            if shutdown_event.woke:
                break
        yield None


def ticks_on_news(under_min_interval, watches: list):
    """A stand-in for Dagster's ``is_under_min_interval(state, sensor, ...)`` (the sensor daemon's
    test of whether a sensor ticked less than its ``minimum_interval_seconds`` ago, so must be
    skipped) that lets a sensor tick once ahead of its interval when the sensor loop's run watch
    (the last of ``watches``) saw a run finish after that sensor's last tick started, at most once
    per interval.

    Why: every flowopt sensor reacts to a run's end (a collection's file, a data plane's
    ``advantages``, a finished round), and a sensor's interval is an integer of at least 1 s. A
    data-plane run took ~0.8 s to launch and run, so the training-round sensor, which had ticked
    in the iteration that requested it, waited out the rest of its second after the run ended:
    0.60-0.67 s, a round's longest hop (``docs/benchmarks.md``). The cap keeps the interval a
    bound on cost: a sensor ticks at most twice per interval, however many runs finish (a burst
    of log batches would otherwise tick every sensor after each of them). A sensor refused an
    early tick makes the watch's waiter return when it is due (:meth:`RunWatch.due_by`), so it
    waits no longer than its interval, as it did before.

    Dagster asks twice per tick (when it picks the sensors, and again before it marks the tick):
    the same state gets the same answer.

    Args:
        under_min_interval: Dagster's function, called first; its answer stands unless it says
            "skip" and there is news.
        watches: holds the sensor loop's :class:`RunWatch` once the loop runs (``_watched``).

    Returns:
        The replacement, with Dagster's signature.
    """
    lock = threading.Lock()
    #: sensor -> (the last tick's start it was let tick early after, when that was granted)
    early: dict[str, tuple[float, float]] = {}

    @functools.wraps(under_min_interval)
    def is_under_min_interval(state, remote_sensor, *args, **kwargs) -> bool:
        if not under_min_interval(state, remote_sensor, *args, **kwargs):
            return False
        data = getattr(state, "instigator_data", None)
        last_tick = max(getattr(data, "last_tick_timestamp", None) or 0.0, getattr(data, "last_tick_start_timestamp", None) or 0.0)
        if not (watches and watches[-1].finished_seen_at > last_tick):
            return True
        key, now = getattr(remote_sensor, "selector_id", None) or remote_sensor.name, time.time()
        with lock:
            granted = early.get(key)
            if granted is not None and granted[0] == last_tick:
                return False  # the same tick, asked again
            interval = remote_sensor.min_interval_seconds or 0
            if granted is not None and now - granted[1] < interval:
                # it ticked early within this interval already: the loop, which would otherwise
                # sleep until the next news or its loop time, comes round when it is due
                watches[-1].due_by(granted[1] + interval)
                return True
            early[key] = (last_tick, now)
            return False

    return is_under_min_interval


def install_run_watch(poll_seconds: float, sensor_interval_seconds: float = 0.0) -> bool:
    """Make this process's Dagster sensor daemon and run queue wake when a run finishes or is
    queued, seen by a :class:`RunWatch` every ``poll_seconds``, instead of sleeping out their loop
    times. Call it before the daemon threads start. A sensor ticks right after a run that
    finished since its last tick, even within its minimum interval, one such early tick per
    interval at most (:func:`ticks_on_news`), and otherwise no more often than that interval. On a Dagster release without the interval test
    ``ticks_on_news`` replaces, a woken sensor loop instead starts its next iteration no sooner
    than ``sensor_interval_seconds`` (the sensors' ``minimum_interval_seconds``) after its previous
    one ended, so that the sensor the news is for is not skipped.

    Returns:
        Whether this Dagster release has the daemon classes and the shapes patched (false:
        nothing was changed, a warning says so).

    Raises:
        ValueError: ``poll_seconds`` is not positive.
    """
    if not poll_seconds > 0:
        raise ValueError(f"the run watch's poll time must be positive seconds, got {poll_seconds!r}")
    try:
        from dagster._daemon.daemon import SensorDaemon, SpanMarker
        from dagster._daemon.run_coordinator.queued_run_coordinator_daemon import QueuedRunCoordinatorDaemon
    except ImportError as error:
        warnings.warn(f"this Dagster release has not the daemons flowopt's run watch wakes ({error}): they keep their own timers", stacklevel=2)
        return False
    if "core_loop" not in vars(SensorDaemon) or not hasattr(QueuedRunCoordinatorDaemon, "run_iteration") or not hasattr(SpanMarker, "START_SPAN"):
        warnings.warn("this Dagster release's daemons are not the shape flowopt's run watch wakes: they keep their own timers", stacklevel=2)
        return False
    import dagster._daemon.sensor as sensor_daemon

    watches: list[RunWatch] = []
    if callable(getattr(sensor_daemon, "is_under_min_interval", None)):
        sensor_daemon.is_under_min_interval = ticks_on_news(sensor_daemon.is_under_min_interval, watches)
        min_gap = 0.0
    else:
        warnings.warn("this Dagster release has no dagster._daemon.sensor.is_under_min_interval: a woken sensor loop waits out the sensors' interval", stacklevel=2)
        min_gap = sensor_interval_seconds
    SensorDaemon.core_loop = _watched(SensorDaemon.core_loop, queued_too=False, poll_seconds=poll_seconds, min_gap=min_gap, watches=watches)
    QueuedRunCoordinatorDaemon.core_loop = _watched(_dequeue_loop, queued_too=True, poll_seconds=poll_seconds)
    return True


def run_daemon(argv: list[str], sensor_loop_seconds: float = DEFAULT_SENSOR_LOOP_SECONDS, run_watch_seconds: float = 0.0, sensor_interval_seconds: float = 0.0) -> int:
    """Run ``dagster-daemon`` with ``argv`` (e.g. ``["run", "-w", "workspace.yaml"]``) in this
    process, its sensor loop set to ``sensor_loop_seconds`` first (:func:`set_sensor_loop`; the
    default leaves Dagster's own) and, with ``run_watch_seconds`` > 0, its sensor loop and run
    queue woken by a :class:`RunWatch` that polls that often (:func:`install_run_watch`; a woken
    sensor loop waits for ``sensor_interval_seconds``, the sensors' minimum interval).

    Returns:
        ``dagster-daemon``'s exit status.

    Raises:
        ValueError: ``sensor_loop_seconds`` is not positive, or ``run_watch_seconds`` is negative.
    """
    if run_watch_seconds < 0:
        raise ValueError(f"the run watch's poll time must be >= 0 seconds (0: off), got {run_watch_seconds!r}")
    if sensor_loop_seconds != DEFAULT_SENSOR_LOOP_SECONDS:
        set_sensor_loop(sensor_loop_seconds)
    if run_watch_seconds:
        install_run_watch(run_watch_seconds, sensor_interval_seconds)
    from dagster._daemon.cli import create_dagster_daemon_cli

    try:
        create_dagster_daemon_cli().main(args=list(argv), prog_name="dagster-daemon", standalone_mode=True)
    except SystemExit as stop:
        return stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
    return 0
