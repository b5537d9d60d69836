"""The demo's deployment path on a real `dagster-daemon`: its sensors build the base policy, run a
training round end to end and refresh the history; every run is launched by a sensor, and a
daemon started afterwards launches nothing."""

import time

import pytest
from dagster import AssetKey, DagsterRunStatus

from flow_assets.demo import DemoState, Phase, phase_env, run_phase
from flow_assets.deployment import Daemon
from flow_assets.local import local_instance
from resources.lake import TrajectoryLake

pytestmark = pytest.mark.slow


def test_the_daemons_sensors_run_a_round_and_a_later_daemon_requests_nothing(tmp_path):
    state = DemoState(tmp_path / "home", tmp_path / "lake", tmp_path / "landing", tmp_path / "models")
    state.prepare()
    instance = local_instance(state.home)
    phase = Phase(
        "spell_backward", "reasoning_gym", state.models, rounds=1,
        base={"sft": {"steps": 40}, "sft_demonstrations": 200},
        collect={"tasks_per_batch": 8, "group_size": 4},
        train=None,
        evaluation={"max_tasks": 24, "modes": ["sampled"], "gate": {"min_gain": -1.0, "max_kl": 1e9}},
    )  # fmt: skip
    out = run_phase(state, instance, TrajectoryLake(root=str(state.lake)), phase, timeout=300)
    (line,) = out["lines"]
    assert line["champion"] == "v1" and line["promoted"] and line["mean_llm_calls"] == 1.0
    runs = {r.job_name: r for r in instance.get_runs()}
    assert set(runs) == {"base_policy_job", "collect_rollouts_job", "log_batch_job", "training_round_job", "training_history_job"}
    assert {r.status for r in instance.get_runs()} == {DagsterRunStatus.SUCCESS}
    sensors = {name: r.tags.get("dagster/sensor_name") for name, r in runs.items()}
    assert sensors == {
        "base_policy_job": "self_play_sensor",
        "collect_rollouts_job": "self_play_sensor",
        "log_batch_job": "new_logs_sensor",
        "training_round_job": "training_round_sensor",
        "training_history_job": "training_history_sensor",
    }
    # the run config came from the file the sensors read
    assert runs["training_round_job"].run_config["ops"]["evaluation_report"]["config"]["max_tasks"] == 24
    assert instance.get_latest_materialization_event(AssetKey("training_history")) is not None

    # the same deployment restarted (self-play still on, one round wanted): nothing to do
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
