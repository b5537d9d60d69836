"""The training API's job lifecycle on a real deployment: an instance stored in the PostgreSQL
server (dagster-postgres), a dagster-webserver that takes the API's submissions over GraphQL, and
a dagster-daemon that launches the queued rounds, each in its own process. Every call goes over
HTTP with a bearer token. One module: a base policy and one collected batch (in process, on the
same instance), then the jobs:

- start -> queued -> running -> pause (after an optimizer step, checkpointed) -> paused -> resume
  (a second attempt continues from that checkpoint) -> completed;
- a queued job cancelled while the pool is busy;
- a job whose budget runs out while it waits: its round fails at the boundary, reason budget;
- a failed run (a round on a log with no trainable turns): failed, with the error as the reason.
"""

import json
import os
import shutil
import time
from datetime import datetime, timezone
from pathlib import Path

import httpx
import pytest
import yaml

from flow_assets.runtime.deployment import Daemon
from flow_assets.runtime.local import execute_requests, run_job, tick_sensor
from resources.lake import TrajectoryLake
from tests.conftest import TAU_BENCH, postgres_database, run_cli

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[2]
TOKEN = "lifecycle-token"
# prices that make the collected batch's served tokens cost cents (the budget case below)
PRICES = {"FLOWOPT_POLICY_INPUT_USD_PER_MTOK": "1000", "FLOWOPT_POLICY_OUTPUT_USD_PER_MTOK": "1000"}
BASE = {"ops": {"base_policy": {"config": {"sft": {"steps": 40}, "sft_demonstrations": 200}}}}
COLLECT = {"ops": {"rollouts": {"config": {"tasks_per_batch": 8, "group_size": 4}}}}
# several optimizer steps (so a pause lands mid-round) and a short, open-gated evaluation
ROUND = {
    "trainer": {"num_iterations": 4, "save_steps": 100},
    "evaluation": {"max_tasks": 16, "modes": ["sampled"], "gate": {"min_gain": -1.0, "max_kl": 1e9}},
}


@pytest.fixture(scope="module")
def deployment(tmp_path_factory):
    from flow_assets.api.local import local_api
    from flow_assets.definitions import build_definitions
    from resources.tasks import TaskSourceResource

    root = tmp_path_factory.mktemp("api_deployment")
    home = root / "home"
    home.mkdir()
    env = {
        "DAGSTER_HOME": str(home), "FLOWOPT_LAKE": str(root / "lake"), "FLOWOPT_LANDING": str(root / "landing"),
        "FLOWOPT_MODELS": str(root / "models"), "FLOWOPT_TASKS": "reasoning_gym", "FLOWOPT_SETTLE_SECONDS": "0",
        "FLOWOPT_SENSOR_INTERVAL_SECONDS": "1", **PRICES,
    }  # fmt: skip
    saved = {k: os.environ.get(k) for k in PRICES}
    os.environ.update(PRICES)  # the API's spend and the in-process runs price tokens alike
    with postgres_database() as db:
        config = yaml.safe_load((REPO / "dagster.yaml").read_text())
        config["storage"] = {"postgres": {"postgres_db": db}}
        (home / "dagster.yaml").write_text(yaml.safe_dump(config))
        from dagster import DagsterInstance

        instance = DagsterInstance.from_config(str(home))
        assert type(instance.run_storage).__name__ == "PostgresRunStorage"
        defs = build_definitions(env["FLOWOPT_LAKE"], env["FLOWOPT_LANDING"], models_root=env["FLOWOPT_MODELS"],
                                 tasks=TaskSourceResource(kind="reasoning_gym"), settle_seconds=0)  # fmt: skip
        assert run_job(defs, instance, "base_policy_job", run_config=BASE).success
        assert run_job(defs, instance, "collect_rollouts_job", run_config=COLLECT).success
        (landing := Path(env["FLOWOPT_LANDING"]) / "tau-bench").mkdir(parents=True)
        shutil.copyfile(TAU_BENCH, landing / TAU_BENCH.name)
        tick = execute_requests(defs, instance, "log_batch_job", tick_sensor(defs, instance, "new_logs_sensor"))
        assert not tick.failed and len(tick.succeeded) == 2, tick
        collected = next(k for k in tick.succeeded if k.startswith("r0001."))
        tau = next(k for k in tick.succeeded if k.startswith("tau-bench"))
        try:
            with local_api(home, env, [TOKEN], root / "exports") as api:
                yield api, env, instance, collected, tau
        finally:
            instance.dispose()
            for k, v in saved.items():
                os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)


def rpc(api, method: str, **params):
    reply = httpx.post(api.api_url + "/rpc", json={"jsonrpc": "2.0", "method": method, "params": params, "id": 1},
                       headers={"Authorization": f"Bearer {TOKEN}"}, timeout=60).json()  # fmt: skip
    if "error" in reply:
        raise AssertionError(f"{method}: {reply['error']}")
    return reply["result"]


def wait_for(api, daemon: Daemon, job: str, states: set[str], timeout: float = 180.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        status = rpc(api, "training.get_status", job_id=job)
        if status["state"] in states:
            return status
        assert daemon.alive(), daemon.log_tail()
        assert time.monotonic() < deadline, f"{job} still {status['state']} after {timeout:.0f} s: {status}\n{daemon.log_tail()}"
        time.sleep(0.25)


def test_a_job_pauses_after_a_step_resumes_from_its_checkpoint_and_completes_beside_a_cancel_a_budget_stop_and_a_failure(deployment):
    from flow_assets.training.rounds import read_round_summary

    api, env, instance, collected, tau = deployment
    agent = TrajectoryLake(root=env["FLOWOPT_LAKE"]).read_partition("trajectories", collected)["agent_id"][0]
    # submitted before the daemon starts (so training_round_sensor finds the batch taken):
    started = rpc(api, "training.start_grpo", agent_id=agent, log_batches=[collected], config=ROUND)
    job = started["job_id"]
    assert started["state"] == "queued" and started["spend"]["total_usd"] > 0  # what the gateway served
    cancelled = rpc(api, "training.start_grpo", agent_id=agent, log_batches=[tau], config=ROUND)["job_id"]
    assert rpc(api, "training.cancel", job_id=cancelled)["state"] == "cancelled"
    # a job of another agent, paused while queued; its agent's spend then passes its budget
    budgeted = rpc(api, "training.start_grpo", agent_id="billing-agent", log_batches=[collected], budget_usd=0.5)["job_id"]
    assert rpc(api, "training.pause", job_id=budgeted)["state"] == "paused"
    served = Path(env["DAGSTER_HOME"]).parent / "served.jsonl"
    served.write_text("".join(json.dumps({
        "trajectory_id": f"served-{i}", "task_id": f"s{i}", "agent_id": "billing-agent", "query": "q", "final_answer": "a",
        "timestamp": datetime.now(timezone.utc).isoformat(), "outcome": {"success": True},
        "steps": [{"index": 0, "kind": "answer", "output": "a", "prompt_token_ids": [5] * 500, "token_ids": [6] * 500, "logprobs": [-0.1] * 500}],
    }) + "\n" for i in range(4)))  # fmt: skip
    rc, _, err = run_cli(["ingest", served, "--landing", env["FLOWOPT_LANDING"], "--lake", env["FLOWOPT_LAKE"], "--home", env["DAGSTER_HOME"]])
    assert rc == 0, err
    assert rpc(api, "training.get_status", job_id=budgeted)["spend"]["total_usd"] == pytest.approx(4.0)  # 4000 tokens at USD 1000/M
    with Daemon(env, Path(env["DAGSTER_HOME"]) / "daemon.log") as daemon:
        wait_for(api, daemon, job, {"running"})
        # the run process is still loading the code location: the request is read after step 1
        paused = rpc(api, "training.pause", job_id=job)
        assert paused["pause_requested"] and paused["state"] in ("running", "paused")
        paused = wait_for(api, daemon, job, {"paused", "completed", "failed"})
        assert paused["state"] == "paused", paused
        assert paused["reason"] is None  # paused, not failed
        (first,) = paused["rounds"]
        step = int(first["paused"].removeprefix("after step "))
        assert (Path(env["FLOWOPT_MODELS"]) / "runs" / collected / "checkpoints" / f"checkpoint-{step}").is_dir()
        # the budget job resumed: its round starts, finds the budget spent and stops the job
        rpc(api, "training.resume", job_id=budgeted)
        stopped = wait_for(api, daemon, budgeted, {"failed", "completed"})
        assert (stopped["state"], stopped["reason"]) == ("failed", "budget"), stopped
        resumed = rpc(api, "training.resume", job_id=job)
        assert not resumed["pause_requested"] and resumed["rounds"][0]["attempt"] == 2
        done = wait_for(api, daemon, job, {"completed", "failed", "paused"}, timeout=300)
        assert done["state"] == "completed" and done["progress"]["rounds_done"] == 1, done
        summary = read_round_summary(Path(env["FLOWOPT_MODELS"]) / "runs" / collected)
        assert summary.resumed_from == step and summary.final_step > step
        # a round on a log the policy did not write: nothing to train on, a failed run
        failing = rpc(api, "training.start_grpo", agent_id=agent, log_batches=[tau])["job_id"]
        failed = wait_for(api, daemon, failing, {"failed", "completed"})
        assert failed["state"] == "failed" and failed["reason"].startswith(f"error: batch {tau} has no trainable turn of"), failed["reason"]
    listed = {j["job_id"]: j["state"] for j in rpc(api, "training.list_jobs")["jobs"]}
    assert {k: listed[k] for k in (job, cancelled, budgeted, failing)} == {job: "completed", cancelled: "cancelled", budgeted: "failed", failing: "failed"}
    # the runs behind it all are in the PostgreSQL server; the daemon launched the ones that ran
    runs = {r.run_id: r for r in instance.get_runs() if r.job_name == "training_round_job"}
    ran = [r for r in runs.values() if r.status.value in ("SUCCESS", "FAILURE")]
    assert ran and all(r.tags["flowopt/job"] in (job, budgeted, failing) for r in ran)
    metrics = httpx.get(api.api_url + "/metrics", headers={"Authorization": f"Bearer {TOKEN}"}).text
    assert 'flowopt_api_jobs{state="completed"} 1.0' in metrics and 'flowopt_api_jobs{state="cancelled"}' in metrics
