"""A local deployment of the training API for tests, benchmarks and trying it out: a
``dagster-webserver`` subprocess on the repository's workspace and ``flowopt api`` served by
uvicorn from a background thread, both on free ports of 127.0.0.1."""

from __future__ import annotations

import contextlib
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx

from flow_assets.runtime.local import REPO_ROOT, stop_process_group
from flow_assets.settings import Settings, child_environ

_JOBS_QUERY = "{ workspaceOrError { ... on Workspace { locationEntries { locationOrLoadError { ... on RepositoryLocation { repositories { jobs { name } } } } } } } }"


def free_port() -> int:
    """A TCP port nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class LocalAPI:
    """URLs and handles of a running local deployment."""

    api_url: str
    dagster_url: str
    instance: object
    service: object


@contextlib.contextmanager
def local_api(home: Path, env: dict[str, str], tokens: list[str], export_dir: Path, startup_timeout_s: float = 180.0) -> Iterator[LocalAPI]:
    """Start the webserver (this process's environment + ``env`` + ``DAGSTER_HOME=home``) and the
    API, whose settings (lake, models, prices, budget) are read from that same environment; stop
    both on exit.

    Raises:
        RuntimeError: the webserver exited or did not load the code location within
            ``startup_timeout_s`` seconds.
    """
    import uvicorn

    from flow_assets.api.server import create_app, deployment_service, training_dispatcher
    from flow_assets.runtime.local import local_instance

    web_port = free_port()
    web_env = child_environ(env, DAGSTER_HOME=str(home))
    web = subprocess.Popen(
        [str(Path(sys.executable).with_name("dagster-webserver")), "-w", "workspace.yaml", "-h", "127.0.0.1", "-p", str(web_port)],
        cwd=REPO_ROOT, env=web_env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        start_new_session=True,
    )  # fmt: skip
    server = None
    thread = None
    try:
        deadline = time.monotonic() + startup_timeout_s
        while True:
            if web.poll() is not None:
                raise RuntimeError(f"dagster-webserver exited with {web.returncode}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"dagster-webserver did not load the code location in {startup_timeout_s:.0f} s")
            try:
                if "training_round_job" in httpx.post(f"http://127.0.0.1:{web_port}/graphql", json={"query": _JOBS_QUERY}, timeout=10).text:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        instance = local_instance(str(home))
        # the API in this process reads the settings the webserver's code location reads
        service = deployment_service(instance, f"http://127.0.0.1:{web_port}", settings=Settings.from_environ(web_env))
        app = create_app(training_dispatcher(service, export_dir), tokens, service, export_dir)
        config = uvicorn.Config(app, host="127.0.0.1", port=free_port(), log_level="warning")
        server = uvicorn.Server(config)
        thread = threading.Thread(target=server.run, daemon=True)
        thread.start()
        while not server.started:
            time.sleep(0.02)
        yield LocalAPI(f"http://127.0.0.1:{config.port}", f"http://127.0.0.1:{web_port}", instance, service)
    finally:
        if server is not None:
            server.should_exit = True
            thread.join(timeout=10)
        stop_process_group(web)
