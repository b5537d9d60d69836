"""`flowopt api` over real HTTP: JSON-RPC calls with bearer tokens, jobs submitted as Dagster runs
through a real dagster-webserver's GraphQL API and read back from the instance (no daemon runs
here, so submitted rounds stay queued until cancelled)."""

import json
import os
import shutil
from datetime import datetime, timezone
from pathlib import Path

import httpx
import pytest

from flow_assets.api.jsonrpc import INVALID_PARAMS, INVALID_STATE, UNAUTHORISED, UNKNOWN_JOB
from tests.conftest import TAU_BENCH, run_cli

REPO = Path(__file__).resolve().parents[2]
TOKEN = "t0ken-for-tests"

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def api(tmp_path_factory):
    from flow_assets.api.local import local_api

    root = tmp_path_factory.mktemp("api")
    home = root / "home"
    home.mkdir()
    shutil.copyfile(REPO / "dagster.yaml", home / "dagster.yaml")
    paths = {"FLOWOPT_LAKE": str(root / "lake"), "FLOWOPT_LANDING": str(root / "landing"), "FLOWOPT_MODELS": str(root / "models")}
    # an agent whose steps the gateway served (token ids): 3 trajectories of 200 prompt / 20 completion tokens
    served = root / "adder.jsonl"
    served.write_text("".join(json.dumps({
        "trajectory_id": f"adder-{i}", "task_id": f"t{i}", "agent_id": "adder", "query": "1+1", "final_answer": "2",
        "timestamp": datetime.now(timezone.utc).isoformat(), "outcome": {"success": True},
        "steps": [{"index": 0, "kind": "answer", "output": "2", "prompt_token_ids": [5] * 200, "token_ids": [6] * 20, "logprobs": [-0.1] * 20}],
    }) + "\n" for i in range(3)))  # fmt: skip
    rc, out, err = run_cli(["ingest", TAU_BENCH, served, "--landing", paths["FLOWOPT_LANDING"], "--lake", paths["FLOWOPT_LAKE"], "--home", home])
    assert rc == 0, err
    prices = {"FLOWOPT_POLICY_INPUT_USD_PER_MTOK": "500", "FLOWOPT_POLICY_OUTPUT_USD_PER_MTOK": "2000"}
    saved = {k: os.environ.get(k) for k in [*prices, "FLOWOPT_TEST_API_LAKE", "FLOWOPT_TEST_API_LANDING"]}
    os.environ.update({**prices, "FLOWOPT_TEST_API_LAKE": paths["FLOWOPT_LAKE"], "FLOWOPT_TEST_API_LANDING": paths["FLOWOPT_LANDING"]})
    try:
        with local_api(home, paths, [TOKEN, "other"], root / "exports") as deployment:
            key = next(k for k in deployment.instance.get_dynamic_partitions("log_batches") if k.startswith("tau-bench"))
            yield deployment.api_url, key, deployment.instance
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


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
    # the framing errors over HTTP, authorised: never a trace, each its code
    headers = {"Authorization": f"Bearer {TOKEN}"}
    parse = httpx.post(url + "/rpc", content=b'{"jsonrpc": "2.0", "method"', headers=headers).json()
    assert parse["error"]["code"] == -32700 and parse["id"] is None
    invalid = httpx.post(url + "/rpc", json={"jsonrpc": "1.0", "method": "training.list_jobs", "id": 7}, headers=headers).json()
    assert invalid["error"]["code"] == -32600
    unknown = _rpc(url, "training.start_ppo").json()["error"]
    assert unknown["code"] == -32601 and "training.start_ppo" in unknown["message"]
    assert all("Traceback" not in json.dumps(r) for r in (parse, invalid, unknown))


def test_a_job_is_queued_as_dagster_runs_read_back_listed_and_cancelled(api, caplog):
    import logging

    caplog.set_level(logging.INFO, logger="flowopt.api")
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
    # one JSON line per event, naming the job and, for runs, the run
    events = [json.loads(r.getMessage()) for r in caplog.records if r.name == "flowopt.api"]
    submitted = {e["run_id"] for e in events if e["event"] == "run_submitted" and e["job_id"] == job}
    terminated = {e["run_id"] for e in events if e["event"] == "run_terminated" and e["job_id"] == job}
    assert submitted == terminated == {r.run_id for r in mine}
    assert {"rpc"} <= {e["event"] for e in events} and all(e["ts"].endswith("+00:00") for e in events)
    assert any(e["event"] == "rpc" and e["method"] == "training.cancel" and e["job_id"] == job for e in events)
    again = _rpc(url, "training.cancel", {"job_id": job}).json()["error"]
    assert again["code"] == INVALID_STATE and "cancelled" in again["message"]
    assert httpx.get(url + "/metrics").status_code == 401  # per-agent spend: the token's business
    metrics = httpx.get(url + "/metrics", headers={"Authorization": f"Bearer {TOKEN}"}).text
    assert 'flowopt_api_requests_total{method="training.start_grpo",outcome="ok"}' in metrics
    assert 'flowopt_api_jobs{state="cancelled"}' in metrics and "flowopt_api_request_seconds_bucket" in metrics
    # training.evaluate names a registry version; this deployment's registry holds none
    unknown = _rpc(url, "training.evaluate", {"version": "v0"}).json()["error"]
    assert unknown["code"] == INVALID_PARAMS and unknown["data"]["errors"][0]["field"] == "version" and "v0" in unknown["message"]
    malformed = _rpc(url, "training.evaluate", {"version": "latest", "modes": ["beam"]}).json()["error"]
    assert malformed["code"] == INVALID_PARAMS and {e["field"] for e in malformed["data"]["errors"]} == {"version", "modes.0"}


def test_spend_counts_served_tokens_and_judge_cost_per_agent_and_month():
    import polars as pl

    from flow_assets.training.budget import Prices, agent_spend, month_of

    now = month_of()
    trajectories = pl.LazyFrame({"trajectory_id": ["a", "b", "c", "d"], "agent_id": ["x", "x", "x", "y"],
                                 "timestamp": ["2026-01-05T10:00:00+00:00", f"{now}-01T00:00:00+00:00", None, f"{now}-02T00:00:00+00:00"]})  # fmt: skip
    steps = pl.LazyFrame({"trajectory_id": ["a", "b", "b", "c", "d"], "prompt_token_ids": [[1] * 10, [1] * 100, None, [1] * 7, [1] * 1000],
                          "token_ids": [[2] * 5, [2] * 20, [2] * 3, None, [2] * 9]})  # fmt: skip
    rewards = pl.LazyFrame({"trajectory_id": ["a", "b", "c", "d"], "judge_cost_usd": [1.0, 0.25, None, 9.0]})
    prices = Prices(policy_input_usd_per_mtok=2.0, policy_output_usd_per_mtok=10.0)
    spent = agent_spend(trajectories, steps, rewards, "x", now, prices)
    # b and c (no timestamp: counted now); a is another month, d another agent
    assert (spent.prompt_tokens, spent.completion_tokens) == (107, 23)
    assert spent.judge_usd == 0.25 and spent.total_usd == pytest.approx(0.25 + (107 * 2 + 23 * 10) / 1e6)
    assert agent_spend(trajectories, steps, rewards, "x", "2026-01", prices).prompt_tokens == 10
    old = agent_spend(trajectories, steps, rewards.select("trajectory_id"), "x", now, prices)  # a lake from before judge costs
    assert old.judge_usd == 0.0
    # text captures (proxy mode: no token ids) count the upstream's usage from their metadata, and
    # a prompt round's own calls count from round_usage, this month's only
    import json

    meta = [json.dumps({"capture": "text", "prompt_tokens": 40, "completion_tokens": 4}), None, json.dumps({"prompt_tokens": 999}), None]
    texts = trajectories.with_columns(metadata=pl.Series(meta))
    rounds = pl.LazyFrame({"agent_id": ["x", "x", "y"], "step": ["search", "gate", "search"], "timestamp": [f"{now}-03T00:00:00Z", "2026-01-01T00:00:00Z",
                           f"{now}-03T00:00:00Z"], "prompt_tokens": [500, 7000, 1], "completion_tokens": [50, 700, 1]})  # fmt: skip
    with_text = agent_spend(texts, steps, rewards, "x", "2026-01", prices, rounds)
    assert (with_text.prompt_tokens, with_text.completion_tokens) == (40 + 7000, 4 + 700)  # a's steps' ids replaced by its usage
    this_month = agent_spend(texts, steps, rewards, "x", now, prices, rounds)
    assert (this_month.prompt_tokens, this_month.completion_tokens) == (107 + 500, 23 + 50)  # c's metadata is not a text capture


def test_start_refuses_a_spent_budget_and_a_round_stops_a_job_whose_budget_ran_out(api, tmp_path):
    from flow_assets.training.budget import lake_spend
    from flow_assets.api.jobs import JobParams, JobService
    from flow_assets.api.jsonrpc import BUDGET_EXCEEDED
    from flow_assets.definitions import build_definitions
    from resources.lake import TrajectoryLake

    url, key, instance = api
    lake = TrajectoryLake(root=os.environ["FLOWOPT_TEST_API_LAKE"])
    spent = lake_spend(lake, "adder")
    assert spent.prompt_tokens == 600 and spent.completion_tokens == 60 and spent.total_usd == pytest.approx((600 * 500 + 60 * 2000) / 1e6)
    from flow_assets.training.budget import CachedSpend, prices_of

    cached = CachedSpend(lake, prices_of())
    first = cached("adder")
    assert first == spent and cached("adder") is first  # the lake did not change: no new scan
    trajectories = lake.read_partition("trajectories", key)
    lake.write_partition("trajectories", key, trajectories)  # replaced (same rows): the answer is recomputed
    assert cached("adder") is not first and cached("adder") == first
    refused = _rpc(url, "training.start_grpo", {"agent_id": "adder", "log_batches": [key], "budget_usd": 0.3}).json()["error"]
    assert refused["code"] == BUDGET_EXCEEDED and refused["data"]["spend"]["total_usd"] == pytest.approx(0.42)
    started = _rpc(url, "training.start_grpo", {"agent_id": "adder", "log_batches": [key], "budget_usd": 0.5}).json()["result"]
    assert started["budget_usd"] == 0.5 and started["spend"]["total_usd"] == pytest.approx(0.42)
    _rpc(url, "training.cancel", {"job_id": started["job_id"]})
    assert 'flowopt_budget_spent_usd{agent="adder"} 0.42' in httpx.get(url + "/metrics", headers={"Authorization": f"Bearer {TOKEN}"}).text
    # the round boundary: a queued round of a job whose budget is spent by the time it starts fails
    # before training, and the job reads failed / budget
    defs = build_definitions(lake.root, os.environ["FLOWOPT_TEST_API_LANDING"], models_root=str(tmp_path / "models"), settle_seconds=0)
    tags = {"flowopt/job": "job-budget", "flowopt/job_agent": "adder", "flowopt/job_round": "1", "flowopt/job_budget_usd": "0.4"}
    result = defs.resolve_job_def("training_round_job").execute_in_process(partition_key=key, instance=instance, tags=tags, raise_on_error=False)
    assert not result.success
    status = JobService(instance, None, None, lambda: set(), spend=lambda a: lake_spend(lake, a)).get_status(JobParams(job_id="job-budget"))
    assert status["state"] == "failed" and status["reason"] == "budget"


def test_trajectories_are_exported_by_batch_and_time_as_parquet_or_jsonl_and_downloaded(api, tmp_path):
    import polars as pl

    url, key, _ = api
    out = _rpc(url, "training.export_trajectories", {"batches": [key], "format": "parquet"}).json()["result"]
    assert out["rows"] == 200 and out["batches"] == [key] and out["url"].startswith("/exports/")
    download = httpx.get(url + out["url"], headers={"Authorization": f"Bearer {TOKEN}"})
    assert download.status_code == 200 and httpx.get(url + out["url"]).status_code == 401
    (tmp_path / "t.parquet").write_bytes(download.content)
    table = pl.read_parquet(tmp_path / "t.parquet")
    assert table.height == 200 and table["trajectory_id"].n_unique() == 200
    assert {"reward", "advantage", "record_json", "task_id", "agent_id"} <= set(table.columns) and table["record_json"].null_count() == 0
    # every batch, since the start of today (UTC): only the served trajectories are recent
    today = datetime.now(timezone.utc).strftime("%Y-%m-%dT00:00:00Z")
    recent = _rpc(url, "training.export_trajectories", {"since": today, "format": "jsonl"}).json()["result"]
    assert recent["rows"] == 3 and recent["name"].endswith(".jsonl") and "path" not in recent
    lines = httpx.get(url + recent["url"], headers={"Authorization": f"Bearer {TOKEN}"}).text.splitlines()
    assert sorted(json.loads(line)["trajectory_id"] for line in lines) == ["adder-0", "adder-1", "adder-2"]
    # where the file goes is the API's choice alone (a client path once overwrote the registry)
    refused = _rpc(url, "training.export_trajectories", {"since": today, "path": str(tmp_path / "x.parquet")}).json()["error"]
    assert refused["code"] == INVALID_PARAMS and refused["data"]["errors"][0]["field"] == "path" and not (tmp_path / "x.parquet").exists()
    bad = _rpc(url, "training.export_trajectories", {"batches": ["nope"]}).json()["error"]
    assert bad["code"] == INVALID_PARAMS and bad["data"]["errors"][0]["field"] == "batches.0"
    naive = _rpc(url, "training.export_trajectories", {"since": "2026-01-01T00:00:00"}).json()["error"]
    assert naive["code"] == INVALID_PARAMS and naive["data"]["errors"][0]["field"] == "since"
