"""`flowopt api` over real HTTP: JSON-RPC calls with bearer tokens, jobs submitted as Dagster runs
through a real dagster-webserver's GraphQL API and read back from the instance (no daemon runs
here, so submitted rounds stay queued until cancelled)."""

import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
import uvicorn

from flow_assets.api.jsonrpc import INVALID_PARAMS, INVALID_STATE, UNAUTHORISED, UNKNOWN_JOB
from tests.conftest import TAU_BENCH, run_cli

REPO = Path(__file__).resolve().parents[1]
TOKEN = "t0ken-for-tests"

pytestmark = pytest.mark.slow


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def api(tmp_path_factory):
    from flow_assets.api.server import create_app, deployment_service, training_dispatcher
    from flow_assets.local import local_instance

    root = tmp_path_factory.mktemp("api")
    home = root / "home"
    home.mkdir()
    shutil.copyfile(REPO / "dagster.yaml", home / "dagster.yaml")
    paths = {"FLOWOPT_LAKE": str(root / "lake"), "FLOWOPT_LANDING": str(root / "landing"), "FLOWOPT_MODELS": str(root / "models")}
    rc, out, err = run_cli(["ingest", TAU_BENCH, "--landing", paths["FLOWOPT_LANDING"], "--lake", paths["FLOWOPT_LAKE"], "--home", home])
    assert rc == 0, err
    web_port = _free_port()
    web = subprocess.Popen(
        [str(Path(sys.executable).with_name("dagster-webserver")), "-w", "workspace.yaml", "-h", "127.0.0.1", "-p", str(web_port)],
        cwd=REPO, env={**os.environ, "DAGSTER_HOME": str(home), **paths}, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        start_new_session=True,
    )  # fmt: skip
    instance = local_instance(str(home))
    service = deployment_service(instance, f"http://127.0.0.1:{web_port}")
    config = uvicorn.Config(create_app(training_dispatcher(service), [TOKEN, "other"], service), host="127.0.0.1", port=_free_port(), log_level="warning")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:  # the webserver has loaded the code location
            assert web.poll() is None, "dagster-webserver exited"
            try:
                if "training_round_job" in httpx.post(f"http://127.0.0.1:{web_port}/graphql", json={"query": "{ workspaceOrError { ... on Workspace { locationEntries { locationOrLoadError { ... on RepositoryLocation { repositories { jobs { name } } } } } } } }"}, timeout=10).text:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(1)
        while not server.started:
            time.sleep(0.05)
        key = instance.get_dynamic_partitions("log_batches")[0]
        yield f"http://127.0.0.1:{config.port}", key, instance
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        os.killpg(web.pid, signal.SIGTERM)
        web.wait(timeout=60)


def _rpc(url: str, method: str, params=None, token: str | None = TOKEN, ident=1):
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    body = {"jsonrpc": "2.0", "method": method, "params": params or {}, "id": ident}
    return httpx.post(url + "/rpc", json=body, headers=headers, timeout=60)


def test_a_call_without_a_valid_token_is_refused(api):
    url, _, _ = api
    for token in (None, "wrong", TOKEN + "x"):
        reply = _rpc(url, "training.list_jobs", token=token)
        assert reply.status_code == 401 and reply.json()["error"]["code"] == UNAUTHORISED
    assert _rpc(url, "training.list_jobs", token="other").status_code == 200  # any configured token
    assert httpx.get(url + "/health").json() == {"ok": True}


def test_a_job_is_queued_as_dagster_runs_read_back_listed_and_cancelled(api):
    url, key, instance = api
    bad = _rpc(url, "training.start_grpo", {"agent_id": "tau", "log_batches": [key, "no-such-batch"]}).json()["error"]
    assert bad["code"] == INVALID_PARAMS and bad["data"]["errors"][0]["field"] == "log_batches.1"
    missing = _rpc(url, "training.start_grpo", {"log_batches": [key]}).json()["error"]
    assert missing["code"] == INVALID_PARAMS and missing["data"]["errors"][0]["field"] == "agent_id"
    started = _rpc(url, "training.start_grpo", {"agent_id": "tau", "log_batches": [key, key]}).json()["result"]
    job = started["job_id"]
    assert started["state"] == "queued" and started["progress"] == {"rounds_done": 0, "rounds_planned": 2, "current_batch": None}
    runs = instance.get_runs()
    mine = [r for r in runs if r.tags.get("flowopt/job") == job]
    assert len(mine) == 2 and {r.job_name for r in mine} == {"training_round_job"} and {r.tags["dagster/partition"] for r in mine} == {key}
    # a batch request: status and listing in one HTTP call
    batch = httpx.post(url + "/rpc", headers={"Authorization": f"Bearer {TOKEN}"}, timeout=60, json=[
        {"jsonrpc": "2.0", "method": "training.get_status", "params": {"job_id": job}, "id": "s"},
        {"jsonrpc": "2.0", "method": "training.list_jobs", "params": {"state": "queued"}, "id": "l"},
        {"jsonrpc": "2.0", "method": "training.get_status", "params": {"job_id": "job-nope"}, "id": "u"},
    ]).json()  # fmt: skip
    by_id = {r["id"]: r for r in batch}
    assert [r["round"] for r in by_id["s"]["result"]["rounds"]] == [1, 2]
    assert job in {j["job_id"] for j in by_id["l"]["result"]["jobs"]}
    assert by_id["u"]["error"]["code"] == UNKNOWN_JOB
    cancelled = _rpc(url, "training.cancel", {"job_id": job}).json()["result"]
    assert cancelled["state"] == "cancelled" and {r["status"] for r in cancelled["rounds"]} == {"canceled"}
    again = _rpc(url, "training.cancel", {"job_id": job}).json()["error"]
    assert again["code"] == INVALID_STATE and "cancelled" in again["message"]
    metrics = httpx.get(url + "/metrics").text
    assert 'flowopt_api_requests_total{method="training.start_grpo",outcome="ok"}' in metrics
    assert 'flowopt_api_jobs{state="cancelled"}' in metrics and "flowopt_api_request_seconds_bucket" in metrics
