"""The demo's deployment path on a real `dagster-daemon`: its sensors build the base policy, run a
training round end to end (blocked by the gate here, to see a refusal go through the loop) and
refresh the history; every run is launched by a sensor, a daemon started afterwards launches
nothing, and the Dagster UI shows all of it to a headless browser."""

import time

import pytest
from dagster import AssetKey, DagsterRunStatus

from flow_assets.demo.state import DemoState

from flow_assets.demo.phases import Phase, phase_env, run_phase
from flow_assets.runtime.deployment import Daemon
from flow_assets.runtime.local import local_instance
from flow_assets.runtime.run_launcher import PID_TAG
from flow_assets.demo.ui_tour import find_chromium, tour
from resources.lake import TrajectoryLake

pytestmark = pytest.mark.slow

#: the deployment's sensor loop time, seconds (the demo's: 5)
LOOP_SECONDS = 60
# a KL bound no trained candidate meets: the round's gate must refuse it
PHASE = dict(
    title="spell_backward", kind="reasoning_gym", rounds=1,
    base={"sft": {"steps": 40}, "sft_demonstrations": 200},
    collect={"tasks_per_batch": 8, "group_size": 4},
    train=None,
    evaluation={"max_tasks": 24, "modes": ["sampled"], "gate": {"min_gain": -1.0, "max_kl": 0.0}},
)  # fmt: skip


@pytest.fixture(scope="module")
def deployment(tmp_path_factory):
    root = tmp_path_factory.mktemp("deployment")
    state = DemoState(root / "home", root / "lake", root / "landing", root / "models")
    state.prepare()
    instance = local_instance(state.home)
    phase = Phase(models=state.models, **PHASE)
    # a sensor loop far longer than the round: every hop must come from the daemon's run watch
    out = run_phase(state, instance, TrajectoryLake(root=str(state.lake)), phase, timeout=300, env={"FLOWOPT_SENSOR_LOOP_SECONDS": str(LOOP_SECONDS)})
    return state, instance, phase, out


def test_every_run_is_launched_by_a_sensor_and_a_blocked_round_ends_the_loop(deployment):
    state, instance, phase, out = deployment
    (line,) = out["lines"]
    assert line["champion"] == "v0" and not line["promoted"]
    assert line["verdict"].startswith("keep v0 (blocked: KL ") and line["mean_llm_calls"] == 1.0
    runs = {r.job_name: r for r in instance.get_runs()}
    assert {name: r.tags.get("dagster/sensor_name") for name, r in runs.items()} == {
        "base_policy_job": "self_play_sensor",
        "collect_rollouts_job": "self_play_sensor",
        "log_batch_job": "new_logs_sensor",
        "training_round_job": "training_round_sensor",
        "training_history_job": "training_history_sensor",
    }
    # the daemon launched each run through WarmRunLauncher (dagster.yaml), in a process of its own
    pids = [r.tags.get(PID_TAG) for r in runs.values()]
    assert None not in pids and len(set(pids)) == len(pids)
    # the blocked round is the one failed run; the history was refreshed after it all the same
    assert {n: r.status for n, r in runs.items() if r.status != DagsterRunStatus.SUCCESS} == {"training_round_job": DagsterRunStatus.FAILURE}
    assert runs["training_round_job"].tags["flowopt/gate"] == line["verdict"][:200]  # why, in the run list
    history = instance.get_latest_materialization_event(AssetKey("training_history"))
    assert history.asset_materialization.metadata["dagster/row_count"].value == 1
    # the run config came from the file the sensors read
    assert runs["training_round_job"].run_config["ops"]["evaluation_report"]["config"]["max_tasks"] == 24


def test_each_run_starts_right_after_the_run_it_waits_for_not_at_the_next_sensor_loop(deployment):
    """Dagster's sensor loop sleeps its loop time (here 60 s) between iterations, and its run
    queue its dequeue interval: ``flowopt daemon``'s run watch wakes both when a run finishes or
    is queued. So each run of the round (the collection after the base policy, the data plane
    after the collection, the round after the data plane, the history after the round) is created
    and started within seconds of the end of the run it waits for, not up to 60 s later."""
    state, instance, phase, _ = deployment
    assert phase_env(state, phase, state.home / "x.json")["FLOWOPT_SENSOR_LOOP_SECONDS"] == "5"
    records = sorted(instance.get_run_records(), key=lambda r: r.create_timestamp)
    assert [r.dagster_run.job_name for r in records] == ["base_policy_job", "collect_rollouts_job", "log_batch_job", "training_round_job", "training_history_job"]
    hops = {}
    for before, after in zip(records, records[1:]):
        created = after.create_timestamp.timestamp() - before.end_time
        started = after.start_time - before.end_time
        hops[after.dagster_run.job_name] = (round(created, 2), round(started, 2))
        assert 0 <= created <= started
    assert all(started < 15.0 for _, started in hops.values()), hops


def test_the_same_deployment_restarted_requests_nothing(deployment):
    state, instance, phase, _ = deployment
    before = {r.run_id for r in instance.get_runs()}
    config = state.home / "run-config.reasoning_gym.json"
    with Daemon(phase_env(state, phase, config), state.home / "daemon-2.log") as daemon:
        deadline = time.monotonic() + 120
        text = ""
        while time.monotonic() < deadline and daemon.alive():
            text = daemon.log_tail(100_000)
            if all(f"Sensor {name} skipped" in text for name in ("new_logs_sensor", "training_round_sensor", "training_history_sensor", "self_play_sensor")):
                break
            time.sleep(1)
    assert "done: 1 of 1 rounds" in text, text[-3000:]
    assert {r.run_id for r in instance.get_runs()} == before


@pytest.mark.skipif(find_chromium() is None, reason="needs a Chromium binary (apt-get install chromium)")
def test_the_ui_shows_sensor_runs_ticks_the_history_chart_and_the_blocked_rounds_reason(deployment, tmp_path):
    state, *_ = deployment
    env = {"DAGSTER_HOME": str(state.home), "FLOWOPT_LAKE": str(state.lake), "FLOWOPT_LANDING": str(state.landing), "FLOWOPT_MODELS": str(state.models)}
    result = tour(env, tmp_path)
    assert result.missing == [], result.found
    assert "KL" in result.found["a blocked round's reason"] and "bound 0.0" in result.found["a blocked round's reason"]
    assert len(result.screenshots) == 5 and all(p.stat().st_size > 10_000 for p in result.screenshots)


def test_a_slow_code_server_delays_runs_instead_of_failing_them(tmp_path):
    """A demo beside other work waited over Dagster's default 180 s for its code server and the
    runs being dequeued failed. The instance flowopt creates (from the repository's dagster.yaml)
    waits up to 600 s and requeues a run whose code location was unreachable."""
    instance = local_instance(tmp_path / "home")
    queue = instance.get_concurrency_config().run_queue_config
    assert instance.code_server_process_startup_timeout >= 600
    assert queue.max_user_code_failure_retries >= 3 and queue.max_concurrent_runs == 4
    assert instance.run_coordinator.dequeue_interval_seconds == 1  # a round's runs wait 0-1 s each, not 0-5 s


def test_a_text_log_of_the_agent_dropped_into_landing_is_trained_by_the_daemon(deployment):
    """The policy's own agent's flows logged as text (flat records naming the version that wrote
    them, no token ids), dropped into the landing directory of a running deployment: its sensors
    land, process and train the batch with no manual step, and training_history records where the
    flows came from and how they trained."""
    import json

    import polars as pl

    from resources.tasks import TaskSourceResource

    state, instance, phase, _ = deployment
    source = TaskSourceResource(kind=phase.kind)
    lake = TrajectoryLake(root=str(state.lake))
    (collected,) = [k for k in instance.get_dynamic_partitions("log_batches") if k.startswith("r0001.")]
    trajectories = lake.read_partition("trajectories", collected)
    answers = dict(lake.read_partition("steps", collected).filter(pl.col("index") == 0).select("trajectory_id", "output").iter_rows())
    prompts = {t.task_id: t.prompt for t in source.source().tasks()}
    records = [
        {"task_id": task, "input": prompts[task], "response": answers[tid], "score": score, "agent_id": source.agent_id,
         "adapter_version": "v0", "interaction_id": f"production/{tid}"}
        for tid, task, score in trajectories.select("trajectory_id", "task_id", "outcome_score").iter_rows()
    ]  # fmt: skip
    before = {r.run_id for r in instance.get_runs()}
    landing = state.landing / "production"
    landing.mkdir(parents=True, exist_ok=True)
    staged = landing / ".agent.jsonl.tmp"  # written whole, then renamed: the sensor never reads a partial file
    staged.write_text("".join(json.dumps(r) + "\n" for r in records))
    staged.rename(landing / "agent.jsonl")
    config = state.home / "run-config.reasoning_gym.json"
    with Daemon(phase_env(state, phase, config), state.home / "daemon-3.log") as daemon:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and daemon.alive():
            new = [r for r in instance.get_runs() if r.run_id not in before]
            history = [r for r in new if r.job_name == "training_history_job" and r.status == DagsterRunStatus.SUCCESS]
            if history and any(r.job_name == "training_round_job" and r.is_finished for r in new):
                break
            time.sleep(1)
        tail = daemon.log_tail(5000)
    new = {r.job_name: r for r in instance.get_runs() if r.run_id not in before}
    assert set(new) == {"log_batch_job", "training_round_job", "training_history_job"}, tail
    assert {r.tags.get("dagster/sensor_name") for r in new.values()} == {"new_logs_sensor", "training_round_sensor", "training_history_sensor"}
    key = new["training_round_job"].tags["dagster/partition"]
    assert key.startswith("production.")
    history = instance.get_latest_materialization_event(AssetKey("training_history")).asset_materialization.metadata
    rows = [r.data for r in history["history"].value.records]
    last = next(r for r in rows if r["batch"] == key)
    assert (last["source"], last["update_rule"], last["turns_captured"], last["turns_text"]) == ("production", "grpo", 0, len(records))
