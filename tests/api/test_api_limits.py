"""The training API against the attacks of issue #25, in process and cheap: the real app served by
uvicorn on an ephemeral port of 127.0.0.1 (real HTTP, raw sockets where the attack needs them), a
real Dagster instance (SQLite) and a real lake. No webserver or daemon: a submitted round is
stored in the instance as a queued run (what the webserver's GraphQL does), a terminated one is
reported cancelled.

- exports write only into the API's export directory, never where a client says, never over a file;
- the 401 is decided from the headers (a 200 MB unauthenticated body is never read); body cap
  (413), body timeout (408), batch cap (-32600); ``/metrics`` and ``/openapi.json`` need the token;
- a job's ``reason`` names no file of the server;
- ``start_grpo`` (and ``resume``) refuse a batch whose blocking data checks failed, by the
  sensor's own decision.
"""

import json
import socket
import threading
import uuid

import httpx
import polars as pl
import pytest
from dagster import (
    AssetCheckResult,
    AssetCheckSpec,
    Config,
    DagsterRun,
    DagsterRunStatus,
    DynamicPartitionsDefinition,
    RunsFilter,
    MaterializeResult,
    asset,
    instance_for_test,
    job,
    materialize,
    op,
)

from flow_assets.api.jsonrpc import INVALID_PARAMS, INVALID_REQUEST, INVALID_STATE, UNAUTHORISED

TOKEN = "limits-token"
LIMITS = {"max_body_bytes": 64 * 1024, "body_timeout_s": 1.0, "max_batch": 5}
log_batches = DynamicPartitionsDefinition(name="log_batches")


class Checked(Config):
    finite: bool = True


@asset(name="advantages", partitions_def=log_batches, check_specs=[AssetCheckSpec("advantages_finite", asset="advantages", blocking=True)])
def advantages(config: Checked) -> MaterializeResult:
    """The ``advantages`` asset's materialisation and its blocking check, as the data plane
    records them (the real pipeline's are covered in test_data_plane)."""
    return MaterializeResult(check_results=[AssetCheckResult(check_name="advantages_finite", passed=config.finite)])


def materialise_advantages(instance, key: str, finite: bool) -> None:
    materialize([advantages], instance=instance, partition_key=key, raise_on_error=False,
                run_config={"ops": {"advantages": {"config": {"finite": finite}}}})  # fmt: skip


@pytest.fixture(scope="module")
def api(tmp_path_factory):
    import uvicorn

    from flow_assets.api.jobs import JobService
    from flow_assets.api.server import Limits, create_app, training_dispatcher
    from resources.lake import TrajectoryLake

    root = tmp_path_factory.mktemp("api_limits")
    lake = TrajectoryLake(root=str(root / "lake"))
    for key in ("good", "bad"):
        lake.write_partition("trajectories", key, pl.DataFrame({"trajectory_id": [f"{key}-{i}" for i in range(3)], "agent_id": ["a"] * 3,
                                                                "timestamp": ["2026-11-25T10:00:00+00:00"] * 3}))  # fmt: skip
    models = root / "models"
    models.mkdir()
    (models / "registry.json").write_text('{"versions": []}\n')
    (root / "home").mkdir()
    with instance_for_test(temp_dir=str(root / "home"), set_dagster_home=False) as instance:
        instance.add_dynamic_partitions("log_batches", ["good", "bad"])

        def submit(job_name, run_config, tags):  # what the webserver's GraphQL submission stores
            return instance.add_run(DagsterRun(job_name=job_name, run_id=str(uuid.uuid4()), run_config=run_config or {}, tags=tags,
                                               status=DagsterRunStatus.NOT_STARTED)).run_id  # fmt: skip

        def terminate(run_ids):
            for run_id in run_ids:
                instance.report_run_canceled(instance.get_run_by_id(run_id))

        partitions = lambda: set(instance.get_dynamic_partitions("log_batches"))  # noqa: E731
        service = JobService(instance, submit, terminate, partitions, lake=lake)
        exports = root / "exports"
        app = create_app(training_dispatcher(service, exports, LIMITS["max_batch"]), [TOKEN], service, exports, Limits(**LIMITS))
        server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning"))
        thread = threading.Thread(target=server.run, daemon=True)
        thread.start()
        while not server.started:
            thread.join(0.02)
            assert thread.is_alive(), "the API did not start"
        port = server.servers[0].sockets[0].getsockname()[1]
        try:
            yield {"url": f"http://127.0.0.1:{port}", "port": port, "root": root, "instance": instance, "exports": exports, "lake": lake}
        finally:
            server.should_exit = True
            thread.join(timeout=10)


def rpc(api, method: str, params=None, token: str | None = TOKEN):
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    return httpx.post(api["url"] + "/rpc", json={"jsonrpc": "2.0", "method": method, "params": params or {}, "id": 1}, headers=headers, timeout=30)


def raw_exchange(port: int, head: str, body: bytes = b"", wait_s: float = 10.0) -> bytes:
    """Send ``head`` (request line and headers) and ``body`` on a raw connection and return what
    the server answers before it closes the connection (or ``wait_s`` of silence: a server
    waiting for the rest of a body raises ``socket.timeout`` here)."""
    with socket.create_connection(("127.0.0.1", port), timeout=wait_s) as conn:
        conn.sendall(head.replace("\n", "\r\n").encode() + b"\r\n" + body)
        answer = b""
        while chunk := conn.recv(65536):
            answer += chunk
        return answer


def test_an_export_goes_only_to_the_api_directory_and_a_client_path_is_refused(api):
    registry = api["root"] / "models" / "registry.json"
    before = registry.read_bytes()
    by_name = rpc(api, "training.export_trajectories", {"batches": ["good"], "path": str(registry)}).json()["error"]
    assert by_name["code"] == INVALID_PARAMS and [e["field"] for e in by_name["data"]["errors"]] == ["path"]
    by_position = rpc(api, "training.export_trajectories", [["good"], None, None, "jsonl", str(registry)]).json()["error"]
    assert by_position["code"] == INVALID_PARAMS and [e["field"] for e in by_position["data"]["errors"]] == ["path"]
    assert registry.read_bytes() == before  # the attack overwrote it with Parquet
    out = rpc(api, "training.export_trajectories", {"batches": ["good"], "format": "jsonl"}).json()["result"]
    assert out["rows"] == 3 and "path" not in out and out["url"] == f"/exports/{out['name']}"
    assert [p.name for p in api["exports"].iterdir()] == [out["name"]]  # no temporary left behind
    download = httpx.get(api["url"] + out["url"], headers={"Authorization": f"Bearer {TOKEN}"})
    assert sorted(json.loads(line)["trajectory_id"] for line in download.text.splitlines()) == ["good-0", "good-1", "good-2"]
    assert str(api["root"]) not in json.dumps(out)


def test_an_export_never_replaces_an_existing_file(api, monkeypatch):
    from flow_assets.api import export
    from flow_assets.api.export import ExportParams, export_trajectories

    fixed = uuid.UUID("00000000-0000-4000-8000-0000000000aa")
    monkeypatch.setattr(export.uuid, "uuid4", lambda: fixed)  # every name it draws is taken
    taken = api["exports"] / f"trajectories-{fixed.hex[:12]}.parquet"
    taken.write_bytes(b"somebody's file")
    with pytest.raises(FileExistsError):
        export_trajectories(api["lake"], ExportParams(batches=["good"]), api["exports"])
    assert taken.read_bytes() == b"somebody's file" and not list(api["exports"].glob(".*"))
    taken.unlink()


def test_the_401_is_decided_from_the_headers_before_any_of_the_body_is_read(api):
    # 200 MB announced, 32 kB sent: the answer comes at once and the connection is closed (the
    # old API read the whole body first: this exchange waited for the rest)
    head = "POST /rpc HTTP/1.1\nHost: api\nContent-Type: application/json\nContent-Length: 209715200\n"
    answer = raw_exchange(api["port"], head, b"[" * 32 * 1024)
    assert answer.startswith(b"HTTP/1.1 401"), answer[:200]
    assert json.loads(answer.split(b"\r\n\r\n", 1)[1])["error"]["code"] == UNAUTHORISED
    # authorised, the same announced size is refused from the header too
    answer = raw_exchange(api["port"], head + f"Authorization: Bearer {TOKEN}\n", b"[" * 32 * 1024)
    assert answer.startswith(b"HTTP/1.1 413"), answer[:200]
    assert b"65536" in answer and json.loads(answer.split(b"\r\n\r\n", 1)[1])["error"]["code"] == INVALID_REQUEST


def test_a_chunked_body_over_the_cap_is_413_and_a_stalled_body_is_408(api):
    def chunks():
        for _ in range(5):
            yield b" " * 20_000  # 100 kB in chunks, no Content-Length

    over = httpx.post(api["url"] + "/rpc", content=chunks(), headers={"Authorization": f"Bearer {TOKEN}"}, timeout=30)
    assert over.status_code == 413 and over.json()["error"]["code"] == INVALID_REQUEST
    # 100 bytes announced, 10 sent, then silence: refused after body_timeout_s (1 s here)
    head = f"POST /rpc HTTP/1.1\nHost: api\nAuthorization: Bearer {TOKEN}\nContent-Length: 100\n"
    answer = raw_exchange(api["port"], head, b'{"jsonrpc"')
    assert answer.startswith(b"HTTP/1.1 408"), answer[:200]
    # the server is still serving
    assert rpc(api, "training.list_jobs").status_code == 200


def test_a_batch_over_the_cap_is_refused_whole_and_runs_nothing(api):
    instance = api["instance"]
    before = len(instance.get_runs())
    calls = [{"jsonrpc": "2.0", "method": "training.start_grpo", "params": {"agent_id": "a", "log_batches": ["good"]}, "id": i} for i in range(6)]
    reply = httpx.post(api["url"] + "/rpc", json=calls, headers={"Authorization": f"Bearer {TOKEN}"}, timeout=30).json()
    assert isinstance(reply, dict) and reply["error"]["code"] == INVALID_REQUEST and reply["error"]["data"] == {"calls": 6, "max_batch": 5}
    assert len(instance.get_runs()) == before


def test_metrics_and_the_schema_need_the_token_and_client_method_names_are_no_labels(api):
    for route in ("/metrics", "/openapi.json"):
        refused = httpx.get(api["url"] + route)
        assert refused.status_code == 401 and refused.json()["error"]["code"] == UNAUTHORISED, route
    assert httpx.get(api["url"] + "/docs").status_code == 404
    schema = httpx.get(api["url"] + "/openapi.json", headers={"Authorization": f"Bearer {TOKEN}"}).json()
    assert "/rpc" in schema["paths"]
    rpc(api, "training.made-up-" + uuid.uuid4().hex)
    metrics = httpx.get(api["url"] + "/metrics", headers={"Authorization": f"Bearer {TOKEN}"}).text
    assert 'method="(unknown)"' in metrics and "made-up" not in metrics


def test_a_failed_jobs_reason_names_no_file_of_the_server(api):
    from flow_assets.core.run_tags import AGENT_TAG, JOB_TAG, ROUND_TAG
    from resources.lake import TrajectoryLake

    lake_root = str(api["lake"].root)

    @op
    def read_missing_partition():
        TrajectoryLake(root=lake_root).read_partition("trajectories", "gone")  # FileNotFoundError naming the file

    @job
    def a_round():
        read_missing_partition()

    a_round.execute_in_process(instance=api["instance"], tags={JOB_TAG: "job-path", AGENT_TAG: "a", ROUND_TAG: "1"}, raise_on_error=False)
    status = rpc(api, "training.get_status", {"job_id": "job-path"}).json()["result"]
    assert status["state"] == "failed" and "lake table 'trajectories' has no partition 'gone'" in status["reason"]
    assert "<path>" in status["reason"] and str(api["root"]) not in json.dumps(status)


def test_start_grpo_and_resume_refuse_a_batch_whose_blocking_checks_failed_as_the_sensor_does(api):
    from flow_assets.data_plane.checks import failed_data_checks  # what training_round_sensor decides with

    instance = api["instance"]
    materialise_advantages(instance, "bad", finite=False)
    assert failed_data_checks(instance, "bad") == ["advantages_finite"]  # the sensor's decision
    before = len(instance.get_runs())
    refused = rpc(api, "training.start_grpo", {"agent_id": "a", "log_batches": ["good", "bad"]}).json()["error"]
    assert refused["code"] == INVALID_PARAMS and "'bad'" in refused["message"] and "advantages_finite" in refused["message"]
    (error,) = refused["data"]["errors"]
    assert error["field"] == "log_batches.1" and error["checks"] == ["advantages_finite"]
    assert len(instance.get_runs()) == before  # nothing submitted
    job = rpc(api, "training.start_grpo", {"agent_id": "a", "log_batches": ["good"]}).json()["result"]["job_id"]
    assert rpc(api, "training.pause", {"job_id": job}).json()["result"]["state"] == "paused"
    materialise_advantages(instance, "good", finite=False)  # re-materialised while the job waits: now it fails
    again = rpc(api, "training.resume", {"job_id": job}).json()["error"]
    assert again["code"] == INVALID_STATE and "'good'" in again["message"] and again["data"]["checks"] == ["advantages_finite"]
    status = rpc(api, "training.get_status", {"job_id": job}).json()["result"]
    assert status["state"] == "paused" and [r["attempt"] for r in status["rounds"]] == [1]  # nothing resubmitted


def test_start_grpo_takes_typed_round_settings_and_submits_the_builders_run_config(api):
    from flow_assets.policy.configs import GRPOTrainerConfig
    from flow_assets.rl.grpo_config import GRPOLossConfig
    from flow_assets.training.rounds import EvaluationConfig
    from flow_assets.training.run_config import round_run_config

    instance = api["instance"]
    instance.add_dynamic_partitions("log_batches", ["typed"])  # a batch no other test fails the checks of
    before = len(instance.get_runs())
    for config, field, text in [
        ({"trainer": {"num_epochs": 2}}, "config.trainer", "num_epochs -> num_iterations"),
        ({"trainer": {"learning_rte": 0.1}}, "config.trainer.learning_rte", "xtra"),
        ({"ops": {}}, "config", 'send {"trainer"'),
    ]:
        refused = rpc(api, "training.start_grpo", {"agent_id": "a", "log_batches": ["typed"], "config": config}).json()["error"]
        assert refused["code"] == INVALID_PARAMS, refused
        (error,) = refused["data"]["errors"]
        assert error["field"] == field and text in error["message"], error
    assert len(instance.get_runs()) == before  # nothing submitted
    config = {"trainer": {"num_iterations": 2, "loss": {"epsilon_high": 0.28}}, "evaluation": {"max_tasks": 16, "modes": ["sampled"]}}
    job = rpc(api, "training.start_grpo", {"agent_id": "a", "log_batches": ["typed"], "config": config}).json()["result"]["job_id"]
    (run,) = instance.get_runs(RunsFilter(tags={"flowopt/job": job}))
    expected = round_run_config(GRPOTrainerConfig(num_iterations=2, loss=GRPOLossConfig(epsilon_high=0.28)), EvaluationConfig(max_tasks=16, modes=("sampled",)))
    assert run.run_config == expected
    rpc(api, "training.cancel", {"job_id": job})
