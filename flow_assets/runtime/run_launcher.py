"""A run launcher whose run processes are started ahead of time, with the heavy imports done.

Dagster's default launcher asks the code server for each run, and the code server spawns a fresh
interpreter that imports Dagster, the code location and, inside the steps, torch / transformers /
peft: on this project's 2-core machine that is 2-4 s of every run before its first step, paid 4
times per training round (collect, data plane, round, history). :class:`WarmRunLauncher` keeps one
*spare* worker: a fresh interpreter (started with ``subprocess``, never forked, so the daemon's
threads do not matter) that has already imported ``preload_modules`` and waits on its stdin.
Launching a run hands the spare the run's :class:`ExecuteRunArgs` (what ``dagster api
execute_run`` takes) and starts the next spare, so the import cost is paid while the previous run
works, not on the critical path. When no spare has finished its imports (a burst of launches),
the run goes to a new worker that preloads nothing and imports what its steps need, as under the
default launcher. Every run still gets a process of its own that nothing ran in
before: the isolation of the default launcher is kept.

Stale code: a spare that imported the project's own modules (anything outside the standard library
and site-packages) before they changed on disk would run old code; just before executing, the
worker compares those files' modification times with the ones it imported and, if any changed,
replaces itself (``os.execv``) with a cold ``python -m dagster api execute_run``.

Configured in ``dagster.yaml``::

    run_launcher:
      module: flow_assets.runtime.run_launcher
      class: WarmRunLauncher
      config:
        preload_modules: [torch, flow_assets.definitions]

Nothing is started until the first launch, so processes that only load the instance (the
webserver, ``dagster definitions validate``, tests) pay nothing.
"""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
import sysconfig
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from dagster import _check as check
from dagster._core.launcher.base import CheckRunHealthResult, LaunchRunContext, RunLauncher, WorkerStatus
from dagster._serdes import ConfigurableClass, ConfigurableClassData

#: the run tag holding the worker's pid (what :meth:`WarmRunLauncher.terminate` signals)
PID_TAG = "flowopt/run_worker_pid"
#: the run tag saying whether the run got a spare that had finished its imports ("true") or not
WARM_TAG = "flowopt/run_worker_warm"
_READY = "ready"


class WarmRunLauncher(RunLauncher, ConfigurableClass):
    """Launches each run in its own fresh process, started ahead of time (module docstring).

    Args:
        inst_data: Dagster's config-class data (set when built from ``dagster.yaml``).
        preload_modules: modules the spare imports before it waits for a run (names, e.g.
            ``["torch", "flow_assets.definitions"]``); one that fails to import is reported on
            the worker's stderr and skipped, never fatal.
        spares: how many spares to keep (>= 1). Two launches close together (a round's history
            refresh and the next collection; a short data-plane run then the training round)
            each find one whose imports are done with 2; with 1 the second goes to a new worker
            that imports what its steps need.

    Raises:
        dagster_shared.check.CheckError: ``spares`` < 1 or not an int.
        dagster.DagsterInvariantViolationError: from ``launch_run`` when the run has no code origin.
    """

    def __init__(self, inst_data: ConfigurableClassData | None = None, preload_modules: Sequence[str] = (), spares: int = 1):
        self._inst_data = inst_data
        self.preload_modules = tuple(check.sequence_param(preload_modules, "preload_modules", of_type=str))
        self.spares = check.int_param(spares, "spares")
        check.invariant(self.spares >= 1, f"WarmRunLauncher: spares must be >= 1, got {spares}")
        self._lock = threading.Lock()
        self._spares: list[subprocess.Popen] = []
        self._workers: dict[str, subprocess.Popen] = {}
        super().__init__()

    @property
    def inst_data(self) -> ConfigurableClassData | None:
        return self._inst_data

    @classmethod
    def config_type(cls) -> dict:
        from dagster import Array, Field, Noneable

        return {
            "preload_modules": Field(Noneable(Array(str)), is_required=False, default_value=[]),
            "spares": Field(int, is_required=False, default_value=1),
        }

    @classmethod
    def from_config_value(cls, inst_data: ConfigurableClassData, config_value: Mapping[str, Any]) -> "WarmRunLauncher":
        return cls(inst_data=inst_data, preload_modules=config_value.get("preload_modules") or [], spares=config_value.get("spares", 1))

    def _start_worker(self, preload: Sequence[str]) -> subprocess.Popen:
        from dagster._serdes import serialize_value

        command = [sys.executable, "-m", "flow_assets.runtime.run_launcher", *preload]
        # own process group: terminating one run never signals the daemon
        worker = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, start_new_session=True)
        assert worker.stdin is not None
        # the instance first, so the worker opens its storage (~0.7 s) before a run needs it
        worker.stdin.write(serialize_value(self._instance.get_ref()) + "\n")
        worker.stdin.flush()
        return worker

    def _take_spare(self) -> subprocess.Popen:
        """The oldest spare whose imports are done; if none is, a new *lean* worker that
        preloads nothing (a run imports what its steps need, as under Dagster's default
        launcher: a burst of launches, e.g. nine landed log files, must not wait for nine copies
        of torch). The spares are topped up to ``spares`` either way."""
        with self._lock:
            self._spares = [w for w in self._spares if w.poll() is None]
            ready = [w for w in self._spares if _is_ready(w)]
            if ready:
                worker = ready[0]
                self._spares.remove(worker)
            else:
                worker = self._start_worker(())
            while len(self._spares) < self.spares:
                self._spares.append(self._start_worker(self.preload_modules))
        return worker

    def launch_run(self, context: LaunchRunContext) -> None:
        """Hand ``context``'s run to the spare worker and start the next spare.

        Raises:
            DagsterInvariantViolationError: the run has no code origin.
        """
        from dagster._core.errors import DagsterInvariantViolationError
        from dagster._grpc.types import ExecuteRunArgs
        from dagster._serdes import serialize_value

        run = context.dagster_run
        if run.job_code_origin is None:
            raise DagsterInvariantViolationError(f"run {run.run_id} has no code origin: WarmRunLauncher cannot load its job")
        worker = self._take_spare()
        warm = _is_ready(worker)
        args = ExecuteRunArgs(job_origin=run.job_code_origin, run_id=run.run_id, instance_ref=self._instance.get_ref(), set_exit_code_on_failure=True)
        self._instance.add_run_tags(run.run_id, {PID_TAG: str(worker.pid), WARM_TAG: str(warm).lower()})
        self._instance.report_engine_event(
            f"Handed to run worker pid {worker.pid} ({'a spare, imports done' if warm else 'a new worker: no spare had finished its imports'}).", run, cls=self.__class__
        )
        assert worker.stdin is not None
        worker.stdin.write(serialize_value(args) + "\n")
        worker.stdin.close()
        with self._lock:
            self._workers[run.run_id] = worker
        threading.Thread(target=self._watch, args=(run.run_id, worker), name=f"flowopt-run-{run.run_id[:8]}", daemon=True).start()

    def _watch(self, run_id: str, worker: subprocess.Popen) -> None:
        """Wait for ``worker``; if it died while its run was still going, fail the run (what
        Dagster's code server does for a run subprocess that died)."""
        assert worker.stdout is not None
        worker.stdout.read()  # the ready line, then EOF
        code = worker.wait()
        with self._lock:
            self._workers.pop(run_id, None)
        run = self._instance.get_run_by_id(run_id)
        if run is not None and not run.is_finished:
            self._instance.report_run_failed(run, f"run worker pid {worker.pid} exited with code {code} before the run finished")

    def terminate(self, run_id: str) -> bool:
        """Interrupt the run's worker (SIGINT: Dagster's ``capture_interrupts`` turns it into a
        clean interruption of the step); False if this launcher does not know a live worker."""
        import signal

        run = self._instance.get_run_by_id(run_id)
        if run is None:
            return False
        self._instance.report_run_canceling(run)
        with self._lock:
            worker = self._workers.get(run_id)
        pid = worker.pid if worker is not None else int(run.tags.get(PID_TAG, "0") or 0)
        if not pid:
            return False
        try:
            os.kill(pid, signal.SIGINT)
        except ProcessLookupError:
            return False
        return True

    @property
    def supports_check_run_worker_health(self) -> bool:
        return True

    def check_run_worker_health(self, run) -> CheckRunHealthResult:
        """RUNNING while the run's worker process exists, else NOT_FOUND / UNKNOWN."""
        pid = int(run.tags.get(PID_TAG, "0") or 0)
        if not pid:
            return CheckRunHealthResult(WorkerStatus.UNKNOWN, "no worker pid tag")
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return CheckRunHealthResult(WorkerStatus.NOT_FOUND, f"worker pid {pid} is gone")
        except PermissionError:
            pass
        return CheckRunHealthResult(WorkerStatus.RUNNING)

    def dispose(self) -> None:
        """Stop the spares (a worker with a run keeps running it)."""
        with self._lock:
            spares, self._spares = self._spares, []
        for spare in spares:
            if spare.poll() is None:
                spare.stdin.close()  # EOF: the spare exits without running anything
        for spare in spares:
            try:
                spare.wait(timeout=5)
            except subprocess.TimeoutExpired:
                spare.kill()


def _is_ready(worker: subprocess.Popen) -> bool:
    """Whether ``worker`` has printed its ready line (without blocking)."""
    import select

    assert worker.stdout is not None
    readable, _, _ = select.select([worker.stdout], [], [], 0)
    return bool(readable)


def _own_module_files() -> dict[str, float]:
    """``{path: mtime}`` of the imported modules outside the standard library and site-packages
    (the project's own code, the files a code change touches)."""
    skip = {Path(p).resolve() for key in ("stdlib", "platstdlib", "purelib", "platlib") if (p := sysconfig.get_paths().get(key))}
    files = {}
    for module in list(sys.modules.values()):
        path = getattr(module, "__file__", None)
        if not path or not path.endswith(".py"):
            continue
        resolved = Path(path).resolve()
        if any(resolved.is_relative_to(s) for s in skip):
            continue
        try:
            files[str(resolved)] = resolved.stat().st_mtime
        except OSError:
            continue
    return files


def worker_main(preload: Sequence[str]) -> None:
    """The spare worker. Reads its instance (a serialized ``InstanceRef``, one line) from stdin,
    imports ``preload``, opens the instance, prints the ready line, then waits for one
    :class:`ExecuteRunArgs` line and executes that run the way ``dagster api execute_run`` does;
    EOF before a run: exit 0. If the project's own code changed on disk since the imports, it
    execs a cold ``dagster api execute_run`` instead (module docstring)."""
    started = time.perf_counter()
    # stdout is the pipe the launcher waits on for the ready line; everything else the worker and
    # its run print goes where the daemon's stderr goes (the code server's run processes print there)
    ready = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    instance_line = sys.stdin.readline()
    if not instance_line.strip():
        return
    for name in preload:
        try:
            importlib.import_module(name)
        except Exception as exc:  # a spare without a preload is only slower, never wrong
            print(f"flowopt run worker: preloading {name} failed: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
    imported = _own_module_files()
    from dagster._cli.utils import get_instance_for_cli
    from dagster._core.instance import InstanceRef
    from dagster._serdes import deserialize_value

    with get_instance_for_cli(instance_ref=deserialize_value(instance_line.strip(), InstanceRef)) as instance:
        ready.write(f"{_READY} {time.perf_counter() - started:.2f}\n")
        ready.close()  # EOF for the launcher's watcher, which then waits for the exit
        line = sys.stdin.readline()
        if not line.strip():
            return
        changed = [p for p, m in imported.items() if not os.path.exists(p) or os.stat(p).st_mtime != m]
        if changed:
            print(f"flowopt run worker: {len(changed)} source file(s) changed since preloading ({changed[0]}, ...): running cold", file=sys.stderr, flush=True)
            os.execv(sys.executable, [sys.executable, "-m", "dagster", "api", "execute_run", line.strip()])
        code = _execute_run(line.strip(), instance)
    if code:
        sys.exit(code)


def _execute_run(serialized_args: str, instance) -> int:
    """What ``dagster api execute_run`` does with its argument (``dagster._cli.api``): execute the
    run in this process on ``instance`` (the one the args name, opened ahead); returns the exit code
    (non-zero: the run failed)."""
    from dagster._cli.api import _execute_run_command_body
    from dagster._grpc.types import ExecuteRunArgs
    from dagster._serdes import deserialize_value
    from dagster._utils.interrupts import capture_interrupts

    with capture_interrupts():
        args = deserialize_value(serialized_args, ExecuteRunArgs)
        return _execute_run_command_body(args.run_id, instance, lambda event: None, set_exit_code_on_failure=bool(args.set_exit_code_on_failure))

if __name__ == "__main__":
    worker_main(sys.argv[1:])
