"""``flowopt daemon``'s run watch: it sees runs finish and runs queued in a real instance's run
storage (written by another process, as a run worker writes it), wakes whoever waits at once, and
the run queue's loop it drives starts its next iteration at the news instead of at the end of its
interval."""

import subprocess
import sys
import threading
import time
from types import SimpleNamespace

import pytest
from dagster import DagsterRunStatus
from dagster._core.events import DagsterEvent, DagsterEventType
from dagster._core.remote_origin import InProcessCodeLocationOrigin, RemoteJobOrigin, RemoteRepositoryOrigin
from dagster._core.test_utils import create_run_for_test
from dagster._core.types.loadable_target_origin import LoadableTargetOrigin

import flow_assets.runtime.daemon as daemon_module
from flow_assets.runtime.daemon import RunWatch, _dequeue_loop, _watched, _WakingShutdown, run_daemon, ticks_on_news
from flow_assets.runtime.local import REPO_ROOT, local_instance

#: a queued run must name the code location it comes from; nothing here loads it
ORIGIN = RemoteJobOrigin(RemoteRepositoryOrigin(InProcessCodeLocationOrigin(LoadableTargetOrigin(python_file=__file__)), "repo"), "job")


def _queue(instance):
    """A new run, moved to QUEUED the way Dagster's queued run coordinator does it."""
    run = create_run_for_test(instance, job_name="job", remote_job_origin=ORIGIN)
    instance.report_dagster_event(DagsterEvent(event_type_value=DagsterEventType.RUN_ENQUEUED.value, job_name="job"), run_id=run.run_id)
    assert instance.get_run_by_id(run.run_id).status == DagsterRunStatus.QUEUED
    return run


def _finish_elsewhere(home, run_id: str) -> None:
    """Fail ``run_id`` from another process (a run worker's place), on the same instance."""
    code = (
        "import sys; from flow_assets.runtime.local import local_instance\n"
        "i = local_instance(sys.argv[1]); i.report_run_failed(i.get_run_by_id(sys.argv[2]))\n"
    )
    subprocess.run([sys.executable, "-c", code, str(home), run_id], cwd=REPO_ROOT, check=True, timeout=120)


def test_a_poll_sees_a_run_queued_and_a_run_finished_and_nothing_else(tmp_path):
    instance = local_instance(tmp_path / "home")
    watch = RunWatch(instance, 0.05, threading.Event())
    assert watch.poll() == (False, False)
    run = _queue(instance)
    assert watch.poll() == (False, True)
    assert watch.poll() == (False, False)  # still queued: not news again
    _finish_elsewhere(tmp_path / "home", run.run_id)
    assert watch.poll() == (True, False)
    assert watch.poll() == (False, False)
    assert watch.seen() == (1, 1)


def test_an_unchanged_run_database_is_not_read(tmp_path, monkeypatch):
    """With SQLite the watch reads the run table only when the database file changed: a poll of an
    idle instance is a ``stat``, not two queries (about 10 ms of CPU each poll, four times a second)."""
    instance = local_instance(tmp_path / "home")
    watch = RunWatch(instance, 0.05, threading.Event())
    reads = []
    real = instance.get_run_records
    monkeypatch.setattr(instance, "get_run_records", lambda *a, **k: reads.append(1) or real(*a, **k))
    for _ in range(20):
        assert watch.poll() == (False, False)
    assert reads == []
    _queue(instance)
    assert watch.poll() == (False, True) and len(reads) == 1


def test_a_run_storage_on_postgresql_is_read_at_most_once_a_second_and_its_runs_are_seen(tmp_path):
    """Without a SQLite file to ``stat``, every poll is two queries: the watch polls a PostgreSQL
    run storage no more than once a second, and sees its runs as it sees SQLite's."""
    from dagster import instance_for_test

    from flow_assets.runtime.daemon import SERVER_POLL_SECONDS
    from tests.conftest import postgres_database

    with postgres_database() as db, instance_for_test(temp_dir=str(tmp_path), overrides={"storage": {"postgres": {"postgres_db": db}}}) as instance:
        assert type(instance.run_storage).__name__ == "PostgresRunStorage"
        watch = RunWatch(instance, 0.1, threading.Event())
        assert watch.poll_seconds == SERVER_POLL_SECONDS == 1.0
        assert watch.poll() == (False, False)
        run = _queue(instance)
        assert watch.poll() == (False, True)
        instance.report_run_failed(instance.get_run_by_id(run.run_id))
        assert watch.poll() == (True, False)


def test_a_waiter_wakes_when_another_process_finishes_a_run(tmp_path):
    instance = local_instance(tmp_path / "home")
    run = _queue(instance)
    stop = threading.Event()
    watch = RunWatch(instance, 0.05, stop).start()
    try:
        since = watch.seen()
        threading.Timer(0.2, _finish_elsewhere, (tmp_path / "home", run.run_id)).start()
        started = time.monotonic()
        now = watch.wait(300.0, since, queued_too=False)
        waited = time.monotonic() - started
    finally:
        stop.set()
    assert now == (since[0] + 1, since[1]), "the wait ended without news"
    assert waited < 120.0  # it ended at the news (the other process: a few seconds), not after 300 s


def test_the_run_queue_loop_starts_its_next_iteration_when_a_run_is_queued(tmp_path):
    """:func:`_dequeue_loop`, watched as :func:`install_run_watch` installs it, on a stand-in for
    Dagster's queue daemon whose interval is 600 s: the second iteration follows a newly queued
    run, not the interval; the loop ends at shutdown, and its watch thread with it."""
    instance = local_instance(tmp_path / "home")
    shutdown = threading.Event()
    iterations: list[float] = []

    class QueueDaemon:
        interval_seconds = 600.0
        _logger = None

        def run_iteration(self, context):
            iterations.append(time.monotonic())
            yield None

    before = set(threading.enumerate())
    loop = _watched(_dequeue_loop, queued_too=True, poll_seconds=0.05)(QueueDaemon(), SimpleNamespace(instance=instance), shutdown)
    driver = threading.Thread(target=lambda: [None for _ in loop], daemon=True)
    driver.start()
    try:
        deadline = time.monotonic() + 60
        while not iterations and time.monotonic() < deadline:
            time.sleep(0.05)
        (watch_thread,) = [t for t in set(threading.enumerate()) - before if t.name == "flowopt-run-watch"]
        _queue(instance)
        while len(iterations) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        shutdown.set()
        driver.join(timeout=30)
    assert len(iterations) == 2 and not driver.is_alive()
    watch_thread.join(timeout=30)
    assert not watch_thread.is_alive()


def test_a_watched_loop_closed_early_stops_its_watch(tmp_path):
    """Dagster may start a daemon's loop again after an error: the loop it drops takes its watch
    thread with it, with no shutdown."""
    instance = local_instance(tmp_path / "home")

    def core_loop(self, context, shutdown_event):
        while True:
            yield None

    before = set(threading.enumerate())
    loop = _watched(core_loop, queued_too=False, poll_seconds=0.05)(None, SimpleNamespace(instance=instance), threading.Event())
    next(loop)
    (watch_thread,) = [t for t in set(threading.enumerate()) - before if t.name == "flowopt-run-watch"]
    loop.close()
    watch_thread.join(timeout=30)
    assert not watch_thread.is_alive()


def test_a_woken_sensor_loop_waits_out_the_sensors_minimum_interval_but_not_its_loop_time(tmp_path):
    """Dagster skips a sensor ticked less than its minimum interval ago: a sensor loop woken by a
    run that ends 0.1 s after an iteration still starts the next one a whole interval (here 1.5 s)
    after the previous ended, and never later than its own loop time."""
    instance = local_instance(tmp_path / "home")
    shutdown = threading.Event()
    watch = RunWatch(instance, 0.05, shutdown).start()
    try:
        for loop_time, least, most in ((30.0, 1.5, 25.0), (0.8, 0.75, 20.0)):
            run = _queue(instance)
            event = _WakingShutdown(shutdown, watch, queued_too=False, min_gap=1.5)
            threading.Timer(0.1, instance.report_run_failed, (instance.get_run_by_id(run.run_id),)).start()
            started = time.monotonic()
            assert event.wait(loop_time) is False
            waited = time.monotonic() - started
            assert least <= waited < most, (loop_time, waited)
    finally:
        shutdown.set()


def _ticked(at: float):
    """A sensor's state as Dagster's sensor daemon keeps it, its last tick started at ``at``."""
    from dagster._core.scheduler.instigation import SensorInstigatorData

    return SimpleNamespace(instigator_data=SensorInstigatorData(last_tick_start_timestamp=at, min_interval=30))


def test_a_sensor_within_its_interval_ticks_early_after_a_run_finishes_once_per_interval(tmp_path):
    """Dagster's own test of a sensor's minimum interval, wrapped by ``ticks_on_news``: a sensor
    that ticked a second ago (interval 30 s) is skipped, unless the run watch saw a run (finished
    by another process) end after that tick started; Dagster asks twice for one tick and gets the
    same answer; a second early tick within the same interval is refused, however many runs end."""
    import dagster._daemon.sensor as sensor_daemon

    instance = local_instance(tmp_path / "home")
    watches: list = []
    is_under = ticks_on_news(sensor_daemon.is_under_min_interval, watches)
    sensor = SimpleNamespace(min_interval_seconds=30, selector_id="sensor-a")  # what Dagster reads of the remote sensor
    other = SimpleNamespace(min_interval_seconds=30, selector_id="sensor-b")
    before_the_run = _ticked(time.time() - 1)
    assert is_under(before_the_run, sensor) is True  # no watch yet: Dagster's answer
    watches.append(RunWatch(instance, 0.05, threading.Event()))
    assert is_under(before_the_run, sensor) is True
    assert is_under(_ticked(time.time() - 31), sensor) is False  # its interval passed: Dagster's answer
    runs = [_queue(instance), _queue(instance)]
    assert watches[-1].poll() == (False, True)
    assert is_under(before_the_run, sensor) is True  # a queued run is no news for a sensor
    _finish_elsewhere(tmp_path / "home", runs[0].run_id)
    assert watches[-1].poll() == (True, False)
    assert is_under(before_the_run, sensor) is False
    assert is_under(before_the_run, sensor) is False  # the same tick, asked again before it is marked
    early_tick = _ticked(time.time())
    assert is_under(early_tick, sensor) is True  # the tick after the news saw it
    time.sleep(0.01)  # the next finish is seen after the early tick started
    _finish_elsewhere(tmp_path / "home", runs[1].run_id)
    assert watches[-1].poll() == (True, False)
    assert is_under(early_tick, sensor) is True  # one early tick per interval: this one waits
    # ... for the loop to come round when it is due, not for the next news or the loop's own time
    assert abs(watches[-1].due_at - (early_tick.instigator_data.last_tick_start_timestamp + 30)) < 1
    assert is_under(early_tick, other) is False  # another sensor has its own early tick


def test_a_waiter_returns_when_it_is_due_without_news_and_the_due_time_is_then_cleared(tmp_path):
    """The sensor loop waits on the watch; a due time set while it waits (a sensor refused an
    early tick) ends the wait then, long before its own timeout, and is cleared once it came."""
    watch = RunWatch(local_instance(tmp_path / "home"), 0.05, threading.Event())
    waited: list[float] = []

    def waiter():
        started = time.monotonic()
        watch.wait(30.0, watch.seen(), queued_too=False)
        waited.append(time.monotonic() - started)

    thread = threading.Thread(target=waiter)
    thread.start()
    time.sleep(0.2)
    watch.due_by(time.time() + 0.5)
    watch.due_by(time.time() + 20)  # a later due time does not move an earlier one
    thread.join(timeout=30)
    assert 0.6 <= waited[0] < 15, waited
    assert watch.due_at is None


def test_the_watch_is_installed_on_dagsters_daemons_and_a_bad_poll_time_is_refused(monkeypatch):
    import dagster._daemon.sensor as sensor_daemon
    from dagster._daemon.daemon import SensorDaemon
    from dagster._daemon.run_coordinator.queued_run_coordinator_daemon import QueuedRunCoordinatorDaemon

    monkeypatch.setattr(SensorDaemon, "core_loop", SensorDaemon.core_loop)
    monkeypatch.setattr(QueuedRunCoordinatorDaemon, "core_loop", QueuedRunCoordinatorDaemon.core_loop)
    monkeypatch.setattr(sensor_daemon, "is_under_min_interval", sensor_daemon.is_under_min_interval)
    sensor_loop, interval_test = SensorDaemon.core_loop, sensor_daemon.is_under_min_interval
    assert daemon_module.install_run_watch(0.25) is True
    assert SensorDaemon.core_loop.__wrapped__ is sensor_loop
    assert QueuedRunCoordinatorDaemon.core_loop.__wrapped__ is _dequeue_loop
    assert sensor_daemon.is_under_min_interval.__wrapped__ is interval_test
    with pytest.raises(ValueError, match="positive"):
        daemon_module.install_run_watch(0)
    with pytest.raises(ValueError, match="poll time"):
        run_daemon(["--version"], run_watch_seconds=-1)


def test_the_sensor_loop_time_is_set_on_dagsters_sensor_daemon(monkeypatch):
    import dagster._daemon.sensor as sensor_daemon

    monkeypatch.setattr(sensor_daemon, "MIN_INTERVAL_LOOP_TIME", sensor_daemon.MIN_INTERVAL_LOOP_TIME)
    assert daemon_module.set_sensor_loop(2.5) is True and sensor_daemon.MIN_INTERVAL_LOOP_TIME == 2.5
    with pytest.raises(ValueError, match="positive"):
        daemon_module.set_sensor_loop(0)
