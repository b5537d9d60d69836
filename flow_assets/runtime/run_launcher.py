"""A run launcher whose run processes are started ahead of time, with the heavy imports done.

Dagster's default launcher asks the code server for each run, and the code server spawns a fresh
interpreter that imports Dagster, the code location and, inside the steps, torch / transformers /
peft: on this project's 2-core machine that is 2-4 s of every run before its first step, paid 4
times per training round (collect, data plane, round, history). :class:`WarmRunLauncher` keeps one
*spare* worker: a fresh interpreter (started with ``subprocess``, never forked, so the daemon's
threads do not matter) that has already imported ``preload_modules`` and waits on its stdin.
Launching a run hands the spare the run's :class:`ExecuteRunArgs` (what ``dagster api
execute_run`` takes) and starts the next spare (``spare_delay_seconds`` later, so that its imports
do not compete with the start of the run just handed over), so the import cost is paid while the
previous run works, not on the critical path. When no spare has finished its imports (a burst of
launches), the run goes to a new worker that preloads nothing and imports what its steps need, as
under the default launcher: forked from the fork server when there is one (below), else a fresh
interpreter. Every run still gets a process of its own that nothing ran in before: the isolation
of the default launcher is kept.

Fork server (``fork_server_modules``): importing torch, transformers and peft took ~4 s of CPU per
spare, four spares a round on two cores, beside the run they waited behind. With a fork server
those imports happen once: one process (started at the first launch) imports the listed modules and
then forks every spare from itself, so a spare costs a fork plus what ``preload_modules`` adds (the
project's code location, ~1.5 s, and building its repository: :func:`build_repositories`). The
fork server holds only modules that start no thread of their own at import (torch, transformers,
peft, numpy, Dagster: no polars, which starts its allocator's threads on import, so not
``flow_assets.definitions``); after its imports it checks its own threads
and, if any but the main one and BLAS's (which re-creates its pool after a fork) exist, refuses to
fork: the launcher then starts spares as fresh interpreters, as without it. A run tagged
``flowopt/loads_models: "true"`` (:data:`LOADS_MODELS_TAG`: the jobs that train or sample a model)
whose launch finds the fork server still importing (the first launch starts it) waits for it, up
to ``fork_server_wait_seconds``, and then gets a forked worker: a fresh interpreter would have
imported Dagster, the code location, torch and transformers a second time beside the server (7-11
s of CPU each; 13 such workers in one ``make test``). Other runs (the data plane's) do not wait: a
fresh interpreter that imports no model library started the demo's burst of nine landed log files
sooner (29-30 s against 34-42 s for all nine). A forked spare starts
a session of its own, reseeds numpy's global generator (Python's ``random`` reseeds itself at
fork) and exits through the interpreter's normal shutdown, like a fresh one. Its exit status
reaches the launcher through the fork server, which reaps it.

Stale code: a spare that imported the project's own modules (anything outside the standard library
and site-packages) before they changed on disk would run old code; just before executing, the
worker compares those files' modification times with the ones it imported and, if any changed,
replaces itself (``os.execv``) with a cold ``python -m dagster api execute_run``.

Configured in ``dagster.yaml``::

    run_launcher:
      module: flow_assets.runtime.run_launcher
      class: WarmRunLauncher
      config:
        fork_server_modules: [torch, transformers, peft]
        preload_modules: [flow_assets.definitions]
        spare_delay_seconds: 2
        fork_server_wait_seconds: 60

Nothing is started until the first launch, so processes that only load the instance (the
webserver, ``dagster definitions validate``, tests) pay nothing.
"""

from __future__ import annotations

import gc
import importlib
import os
import select
import socket
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
#: a job's run tag (value ``"true"``) saying that its steps import torch / transformers: its launch
#: waits for a fork server still importing them rather than import them again (module docstring)
LOADS_MODELS_TAG = "flowopt/loads_models"
_READY = "ready"


class WarmRunLauncher(RunLauncher, ConfigurableClass):
    """Launches each run in its own fresh process, started ahead of time (module docstring).

    Args:
        inst_data: Dagster's config-class data (set when built from ``dagster.yaml``).
        preload_modules: modules the spare imports before it waits for a run (names, e.g.
            ``["torch", "flow_assets.definitions"]``); one that fails to import is reported on
            the worker's stderr and skipped, never fatal.
        fork_server_modules: modules the fork server imports once before it forks each spare
            (module docstring); empty (the default): no fork server, each spare is a fresh
            interpreter.
        spares: how many spares to keep (>= 1). Two launches close together (a round's history
            refresh and the next collection; a short data-plane run then the training round)
            each find one whose imports are done with 2; with 1 the second goes to a new worker
            that imports what its steps need.
        spare_delay_seconds: seconds after a launch before the spare it used is replaced (>= 0;
            0, the default: at once). A new spare's fork and imports take 1-2 s of CPU; on a
            2-core machine, started at once they competed with the start of the run just handed
            over (docs/benchmarks.md).
        fork_server_wait_seconds: how long the launch of a run tagged :data:`LOADS_MODELS_TAG`
            that finds no spare ready waits for a fork server that is still importing (>= 0;
            default 60 s), before it starts the run's worker as a fresh interpreter instead
            (module docstring). Only the launches of the first seconds after the server's start
            wait, each at most this long.

    Raises:
        dagster_shared.check.CheckError: ``spares`` < 1 or not an int; ``spare_delay_seconds`` or
            ``fork_server_wait_seconds`` < 0.
        dagster.DagsterInvariantViolationError: from ``launch_run`` when the run has no code origin.
    """

    def __init__(
        self, inst_data: ConfigurableClassData | None = None, preload_modules: Sequence[str] = (), spares: int = 1, fork_server_modules: Sequence[str] = (),
        spare_delay_seconds: float = 0.0, fork_server_wait_seconds: float = 60.0,
    ):
        self._inst_data = inst_data
        self.preload_modules = tuple(check.sequence_param(preload_modules, "preload_modules", of_type=str))
        self.fork_server_modules = tuple(check.sequence_param(fork_server_modules, "fork_server_modules", of_type=str))
        self.spares = check.int_param(spares, "spares")
        check.invariant(self.spares >= 1, f"WarmRunLauncher: spares must be >= 1, got {spares}")
        self.spare_delay_seconds = float(check.numeric_param(spare_delay_seconds, "spare_delay_seconds"))
        check.invariant(self.spare_delay_seconds >= 0, f"WarmRunLauncher: spare_delay_seconds must be >= 0, got {spare_delay_seconds}")
        self.fork_server_wait_seconds = float(check.numeric_param(fork_server_wait_seconds, "fork_server_wait_seconds"))
        check.invariant(self.fork_server_wait_seconds >= 0, f"WarmRunLauncher: fork_server_wait_seconds must be >= 0, got {fork_server_wait_seconds}")
        self._lock = threading.Lock()
        self._spares: list = []  # subprocess.Popen or _ForkedWorker
        self._workers: dict = {}
        self._fork_server: _ForkServer | None = None
        self._top_up_timers: list[threading.Timer] = []
        self._disposed = False
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
            "fork_server_modules": Field(Noneable(Array(str)), is_required=False, default_value=[]),
            "spare_delay_seconds": Field(float, is_required=False, default_value=0.0),
            "fork_server_wait_seconds": Field(float, is_required=False, default_value=60.0),
        }

    @classmethod
    def from_config_value(cls, inst_data: ConfigurableClassData, config_value: Mapping[str, Any]) -> "WarmRunLauncher":
        return cls(
            inst_data=inst_data, preload_modules=config_value.get("preload_modules") or [], spares=config_value.get("spares", 1),
            fork_server_modules=config_value.get("fork_server_modules") or [], spare_delay_seconds=config_value.get("spare_delay_seconds", 0.0),
            fork_server_wait_seconds=config_value.get("fork_server_wait_seconds", 60.0),
        )  # fmt: skip

    def _start_worker(self, preload: Sequence[str]):
        """A new worker that will import ``preload``: forked by the fork server when it is up,
        else a fresh interpreter; the instance line is already written to it."""
        from dagster._serdes import serialize_value

        server = self._fork_server
        worker = server.spawn(preload) if server is not None and server.ready() else None
        if worker is None:
            command = [sys.executable, "-m", "flow_assets.runtime.run_launcher", *preload]
            # own process group: terminating one run never signals the daemon
            worker = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, start_new_session=True)
        assert worker.stdin is not None
        # the instance first, so the worker opens its storage (~0.7 s) before a run needs it
        worker.stdin.write(serialize_value(self._instance.get_ref()) + "\n")
        worker.stdin.flush()
        return worker

    def _take_spare(self, loads_models: bool = False) -> subprocess.Popen:
        """The oldest spare whose imports are done; if none is, a new *lean* worker that
        preloads nothing (a run imports what its steps need, as under Dagster's default
        launcher: a burst of launches, e.g. nine landed log files, must not wait for nine copies
        of torch). The spares are topped up to ``spares`` either way, ``spare_delay_seconds`` later.
        For a run that ``loads_models``, while the fork server is still importing, that new
        worker waits for it (up to ``fork_server_wait_seconds``) and is forked."""
        with self._lock:
            if self.fork_server_modules and self._fork_server is None:
                self._fork_server = _ForkServer(self.fork_server_modules, on_settled=self._top_up)
            server = self._fork_server
            spare_ready = any(w.poll() is None and _is_ready(w) for w in self._spares)
        if loads_models and server is not None and not spare_ready:
            # outside the lock: terminate() and the watchers must not wait behind the server's imports
            server.wait_settled(self.fork_server_wait_seconds)
        with self._lock:
            self._spares = [w for w in self._spares if w.poll() is None]
            ready = [w for w in self._spares if _is_ready(w)]
            if ready:
                worker = ready[0]
                self._spares.remove(worker)
            else:
                worker = self._start_worker(())
            if self.spare_delay_seconds > 0:
                self._top_up_timers = [t for t in self._top_up_timers if t.is_alive()]
                timer = threading.Timer(self.spare_delay_seconds, self._top_up)
                timer.daemon = True
                self._top_up_timers.append(timer)
                timer.start()
            else:
                self._top_up_locked()
        return worker

    def _top_up_locked(self) -> None:
        # while the fork server is still importing, no spare is started: it would pay the imports
        # the server is paying; the server's ready message tops them up (_top_up)
        if self._fork_server is not None and self._fork_server.starting():
            return
        while len(self._spares) < self.spares:
            self._spares.append(self._start_worker(self.preload_modules))

    def _top_up(self) -> None:
        with self._lock:
            if not self._disposed:
                self._top_up_locked()

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
        worker = self._take_spare(loads_models=run.tags.get(LOADS_MODELS_TAG) == "true")
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
        """Stop the spares and the fork server (a worker with a run keeps running it)."""
        with self._lock:
            self._disposed = True
            for timer in self._top_up_timers:
                timer.cancel()
            spares, self._spares = self._spares, []
            server, self._fork_server = self._fork_server, None
        for spare in spares:
            if spare.poll() is None:
                spare.stdin.close()  # EOF: the spare exits without running anything
        for spare in spares:
            try:
                spare.wait(timeout=5)
            except subprocess.TimeoutExpired:
                spare.kill()
        if server is not None:
            server.close()


class _ForkedWorker:
    """A worker forked by the fork server: what the launcher uses of a ``subprocess.Popen``
    (``pid``, ``stdin``, ``stdout``, ``poll``, ``wait``, ``kill``). Its exit status comes from
    the fork server, which is its parent and reaps it."""

    def __init__(self, server: "_ForkServer", pid: int, stdin, stdout):
        self.server, self.pid, self.stdin, self.stdout = server, pid, stdin, stdout

    def poll(self) -> int | None:
        return self.server.exit_code(self.pid)

    def wait(self, timeout: float | None = None) -> int:
        """The exit status, once the fork server reported it (-1 when the server died first and
        the process is gone: its status is lost).

        Raises:
            subprocess.TimeoutExpired: still running after ``timeout`` seconds.
        """
        code = self.server.wait_exit(self.pid, timeout)
        if code is None:
            raise subprocess.TimeoutExpired(f"run worker pid {self.pid}", timeout or 0.0)
        return code

    def kill(self) -> None:
        import signal

        try:
            os.kill(self.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


class _ForkServer:
    """The launcher's side of the fork server (module docstring): a process that imports
    ``modules`` and then forks a worker for each :meth:`spawn`, over a ``SOCK_SEQPACKET`` socket
    pair. Messages from the server: ``ready`` or ``unsafe <why>`` once, ``pid <token> <pid>`` per
    spawn, ``exit <pid> <status>`` per reaped worker. ``on_settled`` is called (on a thread of its
    own) once the server can fork, or will not (unsafe, or gone while starting)."""

    def __init__(self, modules: Sequence[str], on_settled):
        self._sock, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        command = [sys.executable, "-m", "flow_assets.runtime.run_launcher", "--fork-server", str(theirs.fileno()), *modules]
        self.process = subprocess.Popen(command, stdin=subprocess.DEVNULL, pass_fds=[theirs.fileno()], start_new_session=True)
        theirs.close()
        self._on_settled = on_settled
        self._state = "starting"  # -> ready | unsafe | gone
        self._cond = threading.Condition()
        self._pids: dict[int, int] = {}
        self._exits: dict[int, int] = {}
        self._send = threading.Lock()
        self._token = 0
        threading.Thread(target=self._read, name="flowopt-fork-server", daemon=True).start()

    def starting(self) -> bool:
        return self._state == "starting"

    def ready(self) -> bool:
        return self._state == "ready"

    def wait_settled(self, timeout: float) -> bool:
        """Block until the server is no longer starting (ready, unsafe or gone), at most
        ``timeout`` seconds; whether it settled."""
        with self._cond:
            return self._cond.wait_for(lambda: self._state != "starting", timeout=timeout)

    def _read(self) -> None:
        while True:
            try:
                message = self._sock.recv(256).decode()
            except OSError:
                message = ""
            kind, _, rest = message.partition(" ")
            with self._cond:
                settled = kind in ("", "ready", "unsafe") and self._state == "starting"
                if not message:
                    self._state = "gone"
                elif kind == "ready":
                    self._state = "ready"
                elif kind == "unsafe":
                    self._state = "unsafe"
                    print(f"flowopt run launcher: the fork server will not fork ({rest}); spares are fresh interpreters", file=sys.stderr, flush=True)
                elif kind == "pid":
                    token, pid = rest.split()
                    self._pids[int(token)] = int(pid)
                elif kind == "exit":
                    pid, code = rest.split()
                    self._exits[int(pid)] = int(code)
                self._cond.notify_all()
            if settled:  # after the state changed: it tops the spares up
                threading.Thread(target=self._on_settled, name="flowopt-spares", daemon=True).start()
            if not message:
                return

    def spawn(self, preload: Sequence[str]) -> _ForkedWorker | None:
        """A new forked worker that imports ``preload`` and then waits, as a fresh one would
        (:func:`worker_main`); None if the server did not answer within 10 s (gone or stuck)."""
        in_r, in_w = os.pipe()
        out_r, out_w = os.pipe()
        with self._send:
            self._token += 1
            token = self._token
            try:
                socket.send_fds(self._sock, [f"spawn {token} {' '.join(preload)}".encode()], [in_r, out_w])
            except OSError:
                token = None
        os.close(in_r)
        os.close(out_w)
        if token is None:
            os.close(in_w), os.close(out_r)
            return None
        with self._cond:
            self._cond.wait_for(lambda: token in self._pids or self._state == "gone", timeout=10.0)
            pid = self._pids.pop(token, None)
        if pid is None:
            os.close(in_w), os.close(out_r)
            return None
        return _ForkedWorker(self, pid, os.fdopen(in_w, "w"), os.fdopen(out_r, "r"))

    def exit_code(self, pid: int) -> int | None:
        with self._cond:
            if pid in self._exits:
                return self._exits[pid]
            return -1 if self._state == "gone" and not _alive(pid) else None

    def wait_exit(self, pid: int, timeout: float | None) -> int | None:
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            code = self.exit_code(pid)
            if code is not None:
                return code
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                return None
            with self._cond:
                # a dead server reports nothing more: look at the process itself every second
                self._cond.wait(timeout=1.0 if left is None else min(left, 1.0))

    def close(self) -> None:
        """EOF to the server: it exits (its workers with runs keep running)."""
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._sock.close()
        try:
            self.process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.process.kill()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True


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
    """The spare worker as a fresh interpreter: stdin and stdout are the launcher's pipes
    (:func:`spare_main`)."""
    # stdout is the pipe the launcher waits on for the ready line; everything else the worker and
    # its run print goes where the daemon's stderr goes (the code server's run processes print there)
    ready = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    code = spare_main(preload, sys.stdin, ready)
    if code:
        sys.exit(code)


def spare_main(preload: Sequence[str], commands, ready) -> int:
    """The spare worker. Reads its instance (a serialized ``InstanceRef``, one line) from
    ``commands``, imports ``preload``, opens the instance, writes the ready line to ``ready`` and
    closes it, then waits for one :class:`ExecuteRunArgs` line and executes that run the way
    ``dagster api execute_run`` does; EOF before a run: returns 0. If the project's own code
    changed on disk since it was imported (here or in the fork server), it execs a cold ``dagster
    api execute_run`` instead (module docstring).

    Returns:
        The exit status: non-zero when the run failed.
    """
    started = time.perf_counter()
    instance_line = commands.readline()
    if not instance_line.strip():
        return 0
    for name in preload:
        try:
            importlib.import_module(name)
        except Exception as exc:  # a spare without a preload is only slower, never wrong
            print(f"flowopt run worker: preloading {name} failed: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
    build_repositories(preload)
    imported = _own_module_files()
    from dagster._cli.utils import get_instance_for_cli
    from dagster._core.instance import InstanceRef
    from dagster._serdes import deserialize_value

    with get_instance_for_cli(instance_ref=deserialize_value(instance_line.strip(), InstanceRef)) as instance:
        # Python's full garbage collection walks every tracked object: with torch, transformers
        # and the code location imported, 0.34 s each time (measured in a spare), and a run met
        # it while it started and stepped. Frozen, what the spare imported is never walked again
        # (it lives as long as the process anyway); the run's own objects are collected as before
        gc.freeze()
        ready.write(f"{_READY} {time.perf_counter() - started:.2f}\n")
        ready.close()  # EOF for the launcher's watcher, which then waits for the exit
        line = commands.readline()
        if not line.strip():
            return 0
        changed = [p for p, m in imported.items() if not os.path.exists(p) or os.stat(p).st_mtime != m]
        if changed:
            print(f"flowopt run worker: {len(changed)} source file(s) changed since preloading ({changed[0]}, ...): running cold", file=sys.stderr, flush=True)
            sys.stdout.flush(), sys.stderr.flush()
            os.execv(sys.executable, [sys.executable, "-m", "dagster", "api", "execute_run", line.strip()])
        return _execute_run(line.strip(), instance)


def build_repositories(modules: Sequence[str]) -> list:
    """Build the repository of every ``dagster.Definitions`` held by a module-level name of the
    imported ``modules`` (Dagster caches it on the object). A run's worker loads its job from the
    code location's module, which is already imported here, and then builds that repository
    before the run's first event: 0.3-0.4 s of every run of this project's code location on the
    critical path (cProfile inside the daemon's run workers). Built here, while the spare waits,
    it costs the run nothing. A repository that fails to build is left to the run, which reports
    the error as Dagster does.

    Returns:
        The ``RepositoryDefinition`` objects built, in the order of ``modules``.
    """
    from dagster import Definitions

    built = []
    for name in modules:
        module = sys.modules.get(name)
        for value in list(vars(module).values()) if module is not None else ():
            if isinstance(value, Definitions):
                try:
                    built.append(value.get_repository_def())
                except Exception as exc:  # the run builds it again and fails with Dagster's own error
                    print(f"flowopt run worker: building the repository of {name} failed: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
    return built


def _fork_hazards() -> list[str]:
    """Why forking this process now would be unsafe: a Python thread besides the main one, or a
    native thread other than the interpreter's own (they are named like it: BLAS's pool, which
    re-creates itself in a forked child) such as polars' allocator threads; [] when it is safe."""
    hazards = [f"thread {t.name}" for t in threading.enumerate() if t is not threading.main_thread()]
    try:
        tasks = os.listdir("/proc/self/task")
        main = Path("/proc/self/comm").read_text().strip()
        hazards += [f"native thread {name}" for t in tasks if (name := Path(f"/proc/self/task/{t}/comm").read_text().strip()) != main]
    except OSError:
        pass
    return hazards


def fork_server_main(fd: int, modules: Sequence[str]) -> tuple[list[str], int, int] | None:
    """The fork server: import ``modules``, say ``ready`` (or ``unsafe``, :func:`_fork_hazards`)
    on the socket ``fd``, then fork a worker for each ``spawn`` message until EOF, reaping the
    workers and reporting their exit status (:class:`_ForkServer`).

    Returns:
        In the server, at EOF: None. In a forked worker: ``(preload, commands fd, ready fd)``
        for :func:`spare_main`, the worker having left the server's loop.
    """
    sock = socket.socket(fileno=fd)
    for name in modules:
        try:
            importlib.import_module(name)
        except Exception as exc:
            print(f"flowopt fork server: importing {name} failed: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
    hazards = _fork_hazards()
    # the imports are permanent in every worker: frozen before the fork, the collector of a worker
    # never walks them (nor writes to their pages, which the fork shares) (spare_main freezes its own)
    gc.freeze()
    if hazards:
        sock.send(f"unsafe {', '.join(hazards)}"[:250].encode())
        while sock.recv(256):
            pass
        return None
    sock.send(b"ready")
    children: set[int] = set()
    while True:
        readable, _, _ = select.select([sock], [], [], 0.2)
        try:
            for pid in list(children):
                done, status = os.waitpid(pid, os.WNOHANG)
                if done:
                    children.discard(pid)
                    sock.send(f"exit {pid} {os.waitstatus_to_exitcode(status)}".encode())
            if not readable:
                continue
            message, fds, _, _ = socket.recv_fds(sock, 4096, 2)
        except OSError:  # the launcher is gone (its process ended): so is the server; runs go on
            return None
        if not message:
            return None
        _, token, *preload = message.decode().split(" ")
        pid = os.fork()
        if pid == 0:
            sock.close()
            os.setsid()  # own process group: terminating one run never signals another
            if "numpy" in sys.modules:  # a fresh interpreter seeds it from the OS; Python's random reseeds itself at fork
                sys.modules["numpy"].random.seed()
            return [p for p in preload if p], fds[0], fds[1]
        for f in fds:
            os.close(f)
        children.add(pid)
        try:
            sock.send(f"pid {token} {pid}".encode())
        except OSError:
            return None


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
    if sys.argv[1:2] == ["--fork-server"]:
        forked = fork_server_main(int(sys.argv[2]), sys.argv[3:])
        if forked is not None:  # a worker: run as a spare, then exit as an interpreter does
            preload, commands, ready = forked
            os.dup2(2, 1)
            sys.exit(spare_main(preload, os.fdopen(commands, "r"), os.fdopen(ready, "w")))
    else:
        worker_main(sys.argv[1:])
