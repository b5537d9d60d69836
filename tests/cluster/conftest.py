"""The real local Ray cluster the tests of this folder run on."""

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def cluster(tmp_path_factory):
    """A real local Ray cluster started as a deployment starts one (``ray start --head``): the
    head's GCS and raylet and its worker processes, 2 CPUs, no dashboard; its address. Started
    with ``--block`` and stopped by SIGTERM to that command, so only this cluster stops (``ray
    stop`` would stop every cluster on the machine, e.g. another test's)."""
    ray_cli = str(Path(sys.executable).with_name("ray"))
    port = _free_port()
    temp = tmp_path_factory.mktemp("ray")
    log = temp / "ray-start.log"
    with log.open("w") as out:
        head = subprocess.Popen([ray_cli, "start", "--head", f"--port={port}", "--num-cpus=2", "--include-dashboard=false",
                                 "--disable-usage-stats", f"--temp-dir={temp}", "--block"], stdout=out, stderr=subprocess.STDOUT,
                                # a throwaway cluster on 127.0.0.1: no token (Ray 2.60 asks drivers for one by default),
                                # and no drain on SIGTERM: with an actor still alive the head waits out the drain's
                                # 30 s default before it stops anything (32 s measured, 2.4 s without)
                                env={**os.environ, "RAY_AUTH_MODE": "disabled", "RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S": "0"})  # fmt: skip
    try:
        deadline = time.monotonic() + 180
        while "Ray runtime started" not in log.read_text():
            assert head.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.5)
        yield f"127.0.0.1:{port}"
    finally:
        head.terminate()  # the head stops its own processes (SIGTERM, then SIGKILL after 1 s each)
        head.wait(timeout=120)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
