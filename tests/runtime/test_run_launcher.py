"""WarmRunLauncher on a real Dagster instance (SQLite on disk): each run gets a process of its own
that was started ahead of time with its imports done, runs to its real end status, can be
terminated, and a worker that dies fails its run instead of leaving it STARTED; a spare whose
preloaded project code changed runs the run cold. Each with spares started as fresh interpreters
and with spares forked by the fork server (which refuses to fork once a module started threads).
The daemon-driven path is in test_deployment."""

import os
import subprocess
import sys
import textwrap
import time

import pytest
from dagster import DagsterInstance, DagsterRunStatus
from dagster._core.definitions.reconstruct import ReconstructableJob
from dagster._grpc.types import ExecuteRunArgs
from dagster._serdes import serialize_value

from flow_assets.runtime.run_launcher import PID_TAG, WARM_TAG, WarmRunLauncher

JOBS = textwrap.dedent(
    """
    import gc, os, time
    import numpy as np
    from dagster import in_process_executor, job, op

    @op(config_schema={"out": str})
    def write_pid(context):
        open(context.op_config["out"] + f"/{context.run_id}", "w").write(f"{os.getpid()} {os.getsid(0)} {np.random.random()} {os.getppid()} {gc.get_freeze_count()}")

    # tagged as flowopt's model jobs are: a launch waits for a fork server still importing
    @job(executor_def=in_process_executor, tags={"flowopt/loads_models": "true"})
    def quick():
        write_pid()

    @job(executor_def=in_process_executor)
    def light():
        write_pid()

    @op
    def sleep_long():
        for _ in range(600):
            time.sleep(0.1)

    @job(executor_def=in_process_executor)
    def slow():
        sleep_long()

    @op
    def die():
        os._exit(3)

    @job(executor_def=in_process_executor)
    def dies():
        die()
    """
)


# None: every spare a fresh interpreter; a list: the fork server's modules
@pytest.fixture(params=[None, ["numpy", "dagster"]], ids=["fresh", "forked"])
def setup(tmp_path, request):
    jobs = tmp_path / "jobs.py"
    jobs.write_text(JOBS)
    out = tmp_path / "out"
    out.mkdir()
    home = tmp_path / "home"
    home.mkdir()
    (home / "dagster.yaml").write_text(
        "telemetry: {enabled: false}\nrun_launcher:\n  module: flow_assets.runtime.run_launcher\n  class: WarmRunLauncher\n"
        "  config: {preload_modules: [dagster], spares: 2" + (f", fork_server_modules: {request.param}" if request.param else "") + "}\n"
    )
    instance = DagsterInstance.from_config(str(home))
    yield instance, jobs, out
    instance.run_launcher.dispose()
    instance.dispose()


def _launch(instance, jobs, name, run_config=None):
    recon = ReconstructableJob.for_file(str(jobs), name)
    job = recon.get_definition()
    # the job's run tags, as the daemon's sensor runs get them
    run = instance.create_run_for_job(job, run_config=run_config, job_code_origin=recon.get_python_origin(), tags=job.run_tags)
    instance.launch_run(run.run_id, workspace=None)
    return run.run_id


def _wait(instance, run_id, statuses, timeout=120):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        run = instance.get_run_by_id(run_id)
        if run.status in statuses:
            return run
        time.sleep(0.2)
    raise AssertionError(f"run {run_id} still {instance.get_run_by_id(run_id).status} after {timeout} s")


def _wait_for_a_ready_spare(launcher, timeout=120):
    """Blocks until one of ``launcher``'s spares has printed its ready line (its imports done):
    how long that takes depends on what else the machine runs (a fixed 1 s wait failed under a
    three-worker suite, 2026-11-29), so the tests that expect a warm hand-off wait for it."""
    from flow_assets.runtime.run_launcher import _is_ready

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with launcher._lock:
            if any(w.poll() is None and _is_ready(w) for w in launcher._spares):
                return
        time.sleep(0.1)
    raise AssertionError(f"no spare of the launcher was ready after {timeout} s")


def _one_spare_instance(tmp_path, fork_server_modules: str):
    """An instance whose launcher keeps one spare, forked from a fork server that imports
    ``fork_server_modules`` (YAML list items); the jobs file and the ops' output directory."""
    home = tmp_path / "home"
    home.mkdir()
    (home / "dagster.yaml").write_text(
        "telemetry: {enabled: false}\nrun_launcher:\n  module: flow_assets.runtime.run_launcher\n  class: WarmRunLauncher\n"
        f"  config: {{preload_modules: [dagster], spares: 1, fork_server_modules: [{fork_server_modules}]}}\n"
    )
    jobs = tmp_path / "jobs.py"
    jobs.write_text(JOBS)
    out = tmp_path / "out"
    out.mkdir()
    return DagsterInstance.from_config(str(home)), jobs, out


def _messages(instance, run_id):
    return [(e.dagster_event.message if e.dagster_event else None) or e.user_message for e in instance.all_logs(run_id)]


FINISHED = {DagsterRunStatus.SUCCESS, DagsterRunStatus.FAILURE, DagsterRunStatus.CANCELED}


def test_each_run_gets_its_own_prestarted_process_and_succeeds(setup):
    instance, jobs, out = setup
    assert isinstance(instance.run_launcher, WarmRunLauncher)
    config = {"ops": {"write_pid": {"config": {"out": str(out)}}}}
    first = _launch(instance, jobs, "quick", config)
    assert _wait(instance, first, FINISHED).status == DagsterRunStatus.SUCCESS
    _wait_for_a_ready_spare(instance.run_launcher)  # the spare started at the first launch
    second = _launch(instance, jobs, "quick", config)
    run = _wait(instance, second, FINISHED)
    assert run.status == DagsterRunStatus.SUCCESS
    written = [(out / r).read_text().split() for r in (first, second)]
    pids = [int(w[0]) for w in written]
    # the op ran in the worker the launcher named, a different process per run, each the leader of
    # a session of its own (terminating one run signals no other), numpy seeded afresh in each
    assert pids == [int(instance.get_run_by_id(r).tags[PID_TAG]) for r in (first, second)]
    assert pids[0] != pids[1] and [int(w[1]) for w in written] == pids
    assert written[0][2] != written[1][2]
    server = instance.run_launcher._fork_server
    assert (server is not None and server.ready()) == (instance.run_launcher.fork_server_modules != ())
    # with a fork server, the first run too was forked from it (its launch, tagged loads_models,
    # waited for the server's imports): a fresh interpreter would have imported them a second time
    parents = [int(w[3]) for w in written]
    assert parents == [server.process.pid if server is not None else os.getpid()] * 2
    assert instance.get_run_by_id(first).tags[WARM_TAG] == "false"  # nothing was waiting yet
    assert run.tags[WARM_TAG] == "true"
    # the spare froze what it had imported: Python's full collections during the run skip it
    assert int(written[1][4]) > 10_000
    messages = _messages(instance, second)
    assert any(f"Handed to run worker pid {pids[1]} (a spare, imports done)" in m for m in messages), messages


def test_a_run_not_tagged_as_loading_models_does_not_wait_for_the_fork_server(tmp_path):
    """The data plane's runs import no model library: launched while the fork server still
    imports torch, such a run gets a fresh interpreter at once instead of waiting."""
    instance, jobs, out = _one_spare_instance(tmp_path, "numpy, dagster, torch")
    try:
        run_id = _launch(instance, jobs, "light", {"ops": {"write_pid": {"config": {"out": str(out)}}}})
        assert instance.run_launcher._fork_server.starting()  # torch is still being imported: the launch did not wait
        assert _wait(instance, run_id, FINISHED).status == DagsterRunStatus.SUCCESS
        assert int((out / run_id).read_text().split()[3]) == os.getpid()  # a fresh interpreter this process started
    finally:
        instance.run_launcher.dispose()
        instance.dispose()


def test_terminate_interrupts_the_run_and_a_dead_worker_fails_its_run(setup):
    instance, jobs, _ = setup
    slow = _launch(instance, jobs, "slow")
    _wait(instance, slow, {DagsterRunStatus.STARTED})
    assert instance.run_launcher.terminate(slow)
    assert _wait(instance, slow, FINISHED).status == DagsterRunStatus.CANCELED
    dies = _launch(instance, jobs, "dies")
    run = _wait(instance, dies, FINISHED)
    assert run.status == DagsterRunStatus.FAILURE
    messages = _messages(instance, dies)
    assert any("exited with code 3 before the run finished" in m for m in messages), messages


def test_a_spare_whose_project_code_changed_runs_cold(tmp_path):
    # a preloaded module of the project (outside site-packages) changes on disk after the import
    project = tmp_path / "project"
    project.mkdir()
    (project / "stale_mod.py").write_text("VALUE = 1\n")
    home = tmp_path / "home"
    home.mkdir()
    instance = DagsterInstance.from_config(str(home))
    worker = subprocess.Popen(
        [sys.executable, "-m", "flow_assets.runtime.run_launcher", "stale_mod"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(project)},
    )  # fmt: skip
    worker.stdin.write(serialize_value(instance.get_ref()) + "\n")
    worker.stdin.flush()
    assert worker.stdout.readline().startswith("ready ")
    time.sleep(0.05)
    (project / "stale_mod.py").write_text("VALUE = 2\n")
    jobs = tmp_path / "jobs.py"
    jobs.write_text(JOBS)
    recon = ReconstructableJob.for_file(str(jobs), "quick")
    args = ExecuteRunArgs(job_origin=recon.get_python_origin(), run_id="no-such-run", instance_ref=instance.get_ref())
    _, err = worker.communicate(serialize_value(args) + "\n", timeout=120)
    assert "source file(s) changed since preloading" in err and "stale_mod.py" in err
    assert worker.returncode != 0 and "no-such-run" in err  # the cold `dagster api execute_run` looked for the run
    instance.dispose()


def test_a_fork_server_whose_imports_started_threads_does_not_fork(tmp_path):
    """polars starts its allocator's threads when imported: forking after that is unsafe, so the
    server says so and the spares are fresh interpreters; runs still succeed."""
    instance, jobs, out = _one_spare_instance(tmp_path, "polars")
    config = {"ops": {"write_pid": {"config": {"out": str(out)}}}}
    try:
        first = _launch(instance, jobs, "quick", config)
        assert _wait(instance, first, FINISHED).status == DagsterRunStatus.SUCCESS
        server = instance.run_launcher._fork_server
        deadline = time.monotonic() + 60
        while server.starting() and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not server.ready() and not server.starting()
        _wait_for_a_ready_spare(instance.run_launcher)
        second = _launch(instance, jobs, "quick", config)
        assert _wait(instance, second, FINISHED).status == DagsterRunStatus.SUCCESS
        assert instance.get_run_by_id(second).tags[WARM_TAG] == "true"  # a fresh-interpreter spare
    finally:
        instance.run_launcher.dispose()
        instance.dispose()


def _delayed_instance(tmp_path, name, delay):
    home = tmp_path / name
    home.mkdir()
    (home / "dagster.yaml").write_text(
        "telemetry: {enabled: false}\nrun_launcher:\n  module: flow_assets.runtime.run_launcher\n  class: WarmRunLauncher\n"
        f"  config: {{preload_modules: [dagster], spares: 1, spare_delay_seconds: {delay}}}\n"
    )
    return DagsterInstance.from_config(str(home))


def test_the_used_spare_is_replaced_spare_delay_seconds_after_a_launch(tmp_path):
    jobs = tmp_path / "jobs.py"
    jobs.write_text(JOBS)
    out = tmp_path / "out"
    out.mkdir()
    config = {"ops": {"write_pid": {"config": {"out": str(out)}}}}
    instance = _delayed_instance(tmp_path, "home", 3.0)
    launcher = instance.run_launcher
    try:
        assert launcher.spare_delay_seconds == 3.0
        launched = time.monotonic()
        first = _launch(instance, jobs, "quick", config)
        with launcher._lock:
            spares = list(launcher._spares)
        if time.monotonic() - launched < 2.5:  # a stalled machine could pass the delay here
            assert spares == []  # not replaced at once: the new spare would compete with the run's start
        assert _wait(instance, first, FINISHED).status == DagsterRunStatus.SUCCESS
        _wait_for_a_ready_spare(launcher)  # replaced after the delay
        second = _launch(instance, jobs, "quick", config)
        assert _wait(instance, second, FINISHED).tags[WARM_TAG] == "true"
    finally:
        launcher.dispose()
        instance.dispose()

    # a replacement still waiting when the launcher is disposed is never started
    other = _delayed_instance(tmp_path, "other", 0.5)
    try:
        third = _launch(other, jobs, "quick", config)
        other.run_launcher.dispose()
        time.sleep(1.5)
        assert other.run_launcher._spares == []
        assert _wait(other, third, FINISHED).status == DagsterRunStatus.SUCCESS
    finally:
        other.dispose()

    with pytest.raises(Exception, match="spare_delay_seconds must be >= 0"):
        WarmRunLauncher(spare_delay_seconds=-1)


def test_a_spare_builds_the_repository_of_its_preloaded_code_location(monkeypatch, capsys):
    """The repository a run's worker would build before its first event is built by the spare
    while it waits: flowopt's own code location with its jobs; a module without Definitions adds
    nothing, and one whose repository cannot be built is left to the run (a line on stderr)."""
    import types

    from dagster import Definitions, asset

    import flow_assets.definitions
    from flow_assets.runtime.run_launcher import build_repositories

    def twice(name):
        @asset(name=name)
        def one():
            return 1

        return one

    broken = types.ModuleType("flowopt_test_broken_location")
    broken.defs = Definitions(assets=[twice("same"), twice("same")])  # two assets with one key: fails when built
    monkeypatch.setitem(sys.modules, broken.__name__, broken)
    built = build_repositories([broken.__name__, "flow_assets.definitions", "flow_assets.settings", "not_imported_anywhere"])
    assert len(built) == 1
    assert {"log_batch_job", "training_round_job"} <= {job.name for job in built[0].get_all_jobs()}
    assert built[0] is flow_assets.definitions.defs.get_repository_def()  # what the run's worker gets: the built one
    assert "building the repository of flowopt_test_broken_location failed" in capsys.readouterr().err
