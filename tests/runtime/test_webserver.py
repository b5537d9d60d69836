"""The Dagster UI starts headless on the repo's workspace, loads the code location, and stops."""

import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

from flow_assets.runtime.local import stop_process_group

REPO = Path(__file__).resolve().parents[2]
QUERY = """{ workspaceOrError { ... on Workspace { locationEntries { name
  locationOrLoadError { __typename ... on RepositoryLocation { repositories { name
    jobs { name } sensors { name } assetNodes { assetKey { path } } } } ... on PythonError { message } } } } } }"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_webserver_starts_loads_the_code_location_and_stops(tmp_path):
    home = tmp_path / "home"
    home.mkdir()
    shutil.copyfile(REPO / "dagster.yaml", home / "dagster.yaml")
    port = _free_port()
    env = {**os.environ, "DAGSTER_HOME": str(home), "FLOWOPT_LAKE": str(tmp_path / "lake"), "FLOWOPT_LANDING": str(tmp_path / "landing")}
    exe = Path(sys.executable).with_name("dagster-webserver")
    proc = subprocess.Popen(
        [str(exe), "-w", "workspace.yaml", "-h", "127.0.0.1", "-p", str(port)],
        cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 120
        data = None
        while time.monotonic() < deadline:
            assert proc.poll() is None, proc.stdout.read().decode(errors="replace")[-3000:]
            try:
                reply = httpx.post(f"http://127.0.0.1:{port}/graphql", json={"query": QUERY}, timeout=10)
                entries = reply.json()["data"]["workspaceOrError"]["locationEntries"]
                if entries and entries[0]["locationOrLoadError"] is not None:
                    data = entries
                    break
            except (httpx.HTTPError, KeyError, TypeError, ValueError):
                pass
            time.sleep(1)
        assert data is not None, "webserver did not answer within 120 s"
        location = data[0]["locationOrLoadError"]
        assert data[0]["name"] == "flowopt"
        assert location["__typename"] == "RepositoryLocation", location
        repo = location["repositories"][0]
        assert "log_batch_job" in {j["name"] for j in repo["jobs"]}
        assert "new_logs_sensor" in {s["name"] for s in repo["sensors"]}
        assets = {a["assetKey"]["path"][-1] for a in repo["assetNodes"]}
        assert {"interaction_logs", "trajectories", "rewards", "advantages"} <= assets
    finally:
        stop_process_group(proc, 30)
