"""A local Dagster deployment driven by its daemon, as ``flowopt demo`` runs it.

:class:`Daemon` runs ``dagster-daemon run`` on the repository's workspace with a given
environment (``DAGSTER_HOME``, ``FLOWOPT_*``): its sensors tick, the runs they request are
queued, launched in their own processes and tagged with the sensor's name, and their cursors live
in the instance. The demo only watches the instance (:func:`finished_runs`, :func:`wait_until`)
and prints what the runs did.
"""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from dagster import DagsterInstance, DagsterRunStatus, RunsFilter

from flow_assets.runtime.local import REPO_ROOT, stop_process_group
from flow_assets.settings import child_environ

T = TypeVar("T")
FINISHED = [DagsterRunStatus.SUCCESS, DagsterRunStatus.FAILURE, DagsterRunStatus.CANCELED]


class DeploymentError(RuntimeError):
    """The daemon died, or the loop made no progress in time (the message has the daemon's log tail)."""


class Daemon:
    """``flowopt daemon run -w workspace.yaml`` (``dagster-daemon`` whose sensor loop
    ``FLOWOPT_SENSOR_LOOP_SECONDS`` in ``env`` sets: :mod:`flow_assets.runtime.daemon`) in its own process group, with
    ``env`` added to this process's environment; its output goes to ``log_path``. A context
    manager: stopped (SIGTERM to its group, then SIGKILL after ``stop_timeout`` seconds) on exit."""

    def __init__(self, env: dict[str, str], log_path: Path, stop_timeout: float = 60.0):
        self.env, self.log_path, self.stop_timeout = env, Path(log_path), stop_timeout
        self.process: subprocess.Popen | None = None

    def __enter__(self) -> "Daemon":
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = self.log_path.open("ab")
        self.process = subprocess.Popen(
            [sys.executable, "-m", "flow_assets.cli", "daemon", "run", "-w", str(REPO_ROOT / "workspace.yaml")],
            cwd=REPO_ROOT, env=child_environ(self.env), stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
        log.close()
        return self

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def log_tail(self, chars: int = 4000) -> str:
        """The last ``chars`` characters of the daemon's output."""
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    def __exit__(self, *exc) -> None:
        if self.process is None:
            return
        stop_process_group(self.process, self.stop_timeout)


def finished_runs(instance: DagsterInstance, job_name: str) -> list:
    """Runs of ``job_name`` that have finished (succeeded, failed or were cancelled), oldest first."""
    return list(reversed(instance.get_runs(RunsFilter(job_name=job_name, statuses=FINISHED))))


def runs_in_flight(instance: DagsterInstance) -> int:
    """Runs queued, starting or running on ``instance``."""
    unfinished = [DagsterRunStatus.QUEUED, DagsterRunStatus.NOT_STARTED, DagsterRunStatus.STARTING, DagsterRunStatus.STARTED]
    return len(instance.get_runs(RunsFilter(statuses=unfinished)))


def wait_until(
    condition: Callable[[], T | None], daemon: Daemon, what: str, timeout: float, poll: float = 1.0
) -> T:
    """Poll ``condition`` every ``poll`` seconds until it returns something truthy, and return it.

    Raises:
        DeploymentError: the daemon exited, or ``timeout`` seconds passed (``what`` says what was
            awaited; the daemon's log tail is included).
    """
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if not daemon.alive():
            raise DeploymentError(f"the Dagster daemon exited while waiting for {what}:\n{daemon.log_tail()}")
        if time.monotonic() > deadline:
            raise DeploymentError(f"no {what} after {timeout:.0f} s (daemon log: {daemon.log_path}):\n{daemon.log_tail()}")
        time.sleep(poll)
