"""Training rounds as Dagster runs on a real instance and a real tiny model.

One module-scoped world: base policy (small SFT), the tau-bench log, and rollout batches of the
trainable policy, all through the sensors. Each test then runs rounds with its own config.
"""

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import polars as pl
import pytest
from dagster import AssetCheckKey, AssetKey, AssetRecordsFilter, DagsterInstance, build_sensor_context, instance_for_test
from dagster._core.scheduler.instigation import InstigatorType, TickStatus

from flow_assets.definitions import build_definitions
from flow_assets.runtime.local import execute_requests, run_job, tick_sensor
from flow_assets.training.rounds import EvaluationResult, RoundSummary, read_evaluation, read_round_summary
from flow_assets.training.run_config import RoundSettings
from resources.lake import TrajectoryLake
from resources.registry import AdapterRegistry
from resources.tasks import TaskSourceResource
from resources.tracking import ExperimentTracking
from tests.conftest import TAU_BENCH

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[2]

BASE = {"ops": {"base_policy": {"config": {"sft": {"steps": 300}, "sft_demonstrations": 300}}}}
COLLECT = {"tasks_per_batch": 24, "group_size": 8}
EVAL = {"max_tasks": 120}
# a permissive gate, to exercise promotion itself (the default gate is "not worse")
OPEN_GATE = {"gate": {"min_gain": -1.0, "max_kl": 1e9}}


def failure(result) -> str:
    """Every error an in-process run recorded (step failures, a failed run, engine errors), for
    assertion messages: a round that fails only under load must say why in CI's log."""
    errors = []
    for event in result.all_events:
        data = event.event_specific_data
        error = getattr(data, "error", None)
        if error is not None:
            errors.append(f"{event.event_type_value} {event.step_key or ''}: {error.to_string()}")
        elif event.is_step_failure or event.is_run_failure:
            errors.append(f"{event.event_type_value} {event.step_key or ''}: {event.message}")
        elif event.event_type_value == "ASSET_CHECK_EVALUATION" and not data.passed:
            # the check's own reason and numbers: "a blocking check failed" alone says nothing
            meta = {k: getattr(v, "value", v) for k, v in data.metadata.items()}
            errors.append(f"check {data.check_name} failed: {data.description} {meta}")
    return "\n".join(errors) or "no error event recorded"


class World:
    def __init__(self, root: Path, instance: DagsterInstance):
        self.root, self.instance = root, instance
        self.models = root / "models"
        self.defs = build_definitions(
            str(root / "lake"), str(root / "landing"), models_root=str(self.models), tasks=TaskSourceResource(),
            tracking=ExperimentTracking(target=f"tensorboard:{root / 'tensorboard'}"),  # off by default; on here to test it
        )
        self.registry = AdapterRegistry(root=str(self.models))
        self.cursor = None

    def run(self, job: str, partition_key: str | None = None, run_config: dict | None = None):
        return run_job(self.defs, self.instance, job, partition_key, run_config)

    def land_and_process(self) -> list[str]:
        tick = execute_requests(self.defs, self.instance, "log_batch_job", tick_sensor(self.defs, self.instance, "new_logs_sensor"))
        assert not tick.failed, tick.failed
        return tick.succeeded

    def collect(self) -> str:
        result = self.run("collect_rollouts_job", run_config={"ops": {"rollouts": {"config": COLLECT}}})
        assert result.success, failure(result)
        (key,) = self.land_and_process()
        return key

    def training_requests(self) -> list[str]:
        tick = tick_sensor(self.defs, self.instance, "training_round_sensor", self.cursor)
        self.cursor = tick.cursor
        return [r.partition_key for r in tick.run_requests]

    def train(self, key: str, train: dict | None = None, evaluation: dict | None = None):
        config = RoundSettings(trainer=train or {}, evaluation={**EVAL, **(evaluation or {})}).run_config()
        return self.run("training_round_job", partition_key=key, run_config=config)

    def round_files(self, key: str) -> tuple[RoundSummary, EvaluationResult]:
        run_dir = self.models / "runs" / key
        return read_round_summary(run_dir), read_evaluation(run_dir)


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    root = tmp_path_factory.mktemp("training")
    (root / "home").mkdir()
    with instance_for_test(temp_dir=str(root / "home")) as instance:
        w = World(root, instance)
        (root / "landing" / "tau-bench").mkdir(parents=True)
        (root / "landing" / "tau-bench" / TAU_BENCH.name).write_bytes(TAU_BENCH.read_bytes())
        w.land_and_process()
        assert w.run("base_policy_job", run_config=BASE).success
        yield w


def test_real_logs_stop_after_advantages(world):
    # the tau-bench batch was processed before any rollout: the training sensor declines it
    assert world.training_requests() == []
    assert world.instance.get_materialized_partitions(AssetKey("advantages"))
    assert not world.instance.get_materialized_partitions(AssetKey("policy_checkpoint"))


def test_collected_batch_lands_with_behaviour_logprobs_and_gets_its_round(world):
    key = world.collect()
    assert key.startswith("r0001.flowopt-spell_backward.v0-")
    assert world.training_requests() == [key]
    assert world.training_requests() == []  # decided once
    result = world.train(key, evaluation=OPEN_GATE)
    assert result.success, failure(result)
    summary, evaluation = world.round_files(key)
    assert summary.parent_version == "v0" and summary.final_step > 0
    assert all(map(lambda x: x == x and abs(x) < 1e6, summary.losses))
    report = evaluation.report
    for mode in ("greedy", "sampled"):
        assert report[mode]["n_tasks"] == EVAL["max_tasks"]
        for policy in ("candidate", "champion"):
            rate = report[mode][policy]["success_rate"]
            assert rate["ci_low"] <= rate["rate"] <= rate["ci_high"]
    # the permissive gate passed, so the candidate became v1, with who/why in the history
    champ = world.registry.champion()
    assert champ["version"] == "v1"
    last = world.registry.load()["history"][-1]
    assert last["action"] == "promote" and last["previous"] == "v0" and key in last["by"]
    keys = [AssetCheckKey(AssetKey("evaluation_report"), name) for name in ("gain", "finite_loss", "kl_bound")]
    executions = world.instance.event_log_storage.get_latest_asset_check_execution_by_key(keys)
    assert set(executions) == set(keys)
    # the experiment tracker got every optimizer step, the held-out result and the round's point
    from tests.training.test_tracking import scalars

    runs = world.root / "tensorboard" / "flowopt-spell_backward"
    series = scalars(runs / key)
    assert [step for step, _ in series["train/loss"]] == list(range(1, summary.final_step + 1))
    assert [v for _, v in series["train/loss"]] == pytest.approx(summary.losses, rel=1e-5)
    assert series["eval/sampled_candidate_success"] == [(summary.final_step, pytest.approx(report["sampled"]["candidate"]["success_rate"]["rate"]))]
    assert scalars(runs / "rounds")["round/promoted"] == [(1, 1.0)]


def test_worse_candidate_is_blocked_and_champion_unchanged(world):
    before = world.registry.champion()
    key = world.collect()
    assert world.training_requests() == [key]
    # trained AGAINST its advantages, hard: the candidate must get worse and be refused
    result = world.train(key, train={"negate_advantages": True, "learning_rate": 0.02, "num_iterations": 4})
    assert not result.success
    summary, evaluation = world.round_files(key)
    assert summary.negate_advantages is True
    gate = {r.name: r for r in evaluation.gate}
    assert gate["gain"].passed is False
    assert evaluation.report["sampled"]["gain"] < 0
    assert world.registry.champion() == before
    mats = world.instance.fetch_materializations(AssetKey("promoted_adapter"), limit=100).records
    assert key not in {r.partition_key for r in mats}
    # the UI says why, in numbers: the verdict on the report, the gain check's metadata
    report = world.instance.fetch_materializations(
        AssetRecordsFilter(asset_key=AssetKey("evaluation_report"), asset_partitions=[key]), limit=1
    ).records[0]
    assert report.asset_materialization.metadata["verdict"].value.startswith(f"keep {before['version']} (blocked: gain -")
    # the run list says it too (the run is failed by the blocking check), and the champion's page
    run = world.instance.get_run_by_id(report.run_id)
    assert run.tags["flowopt/gate"] == report.asset_materialization.metadata["verdict"].value[:200]
    assert run.tags["flowopt/gate_decision"] == "keep"  # the decision for code, apart from the sentence
    from dagster import DagsterRunStatus

    from flow_assets.api.jobs import round_status

    # a job counts the round as done (blocked), not failed
    assert run.status == DagsterRunStatus.FAILURE and round_status(run) == DagsterRunStatus.SUCCESS
    kept = world.instance.fetch_observations(AssetKey("champion"), limit=1).records[0]
    assert kept.run_id == report.run_id and kept.event_log_entry.asset_observation.description.startswith(f"keep {before['version']} (blocked")
    assert kept.event_log_entry.asset_observation.metadata["candidate_batch"].value == key
    check = world.instance.event_log_storage.get_latest_asset_check_execution_by_key(
        [AssetCheckKey(AssetKey("evaluation_report"), "gain")]
    )[AssetCheckKey(AssetKey("evaluation_report"), "gain")]
    numbers = check.event.dagster_event.event_specific_data.metadata
    assert numbers["gain"].value == pytest.approx(evaluation.report["sampled"]["gain"], abs=1e-6)
    assert numbers["gain"].value < 0 and numbers["min_gain"].value == 0.0 and numbers["champion"].value == before["version"]


def test_training_history_has_one_row_per_round_and_refreshes_after_each(world):
    # two rounds finished above (one promoted, one blocked): the sensor asks for one refresh
    assert len(tick_sensor(world.defs, world.instance, "training_history_sensor").run_requests) == 1
    assert world.run("training_history_job").success
    assert tick_sensor(world.defs, world.instance, "training_history_sensor").run_requests == []  # now current
    record = world.instance.fetch_materializations(AssetKey("training_history"), limit=1).records[0]
    meta = record.asset_materialization.metadata
    assert meta["dagster/row_count"].value == 2
    rows = [r.data for r in meta["history"].value.records]
    first, second = rows
    assert (first["round"], first["champion_before"], first["champion_after"], first["promoted"]) == (1, "v0", "v1", True)
    assert (second["champion_before"], second["champion_after"], second["promoted"]) == ("v1", "v1", False)
    assert second["verdict"].startswith("keep v1 (blocked: gain -")
    _, evaluation = world.round_files(second["batch"])
    sampled = evaluation.report["sampled"]
    # the UI table shows 4 decimals
    assert second["candidate_success"] == pytest.approx(sampled["candidate"]["success_rate"]["rate"], abs=5e-5)
    assert second["gain"] == pytest.approx(sampled["gain"], abs=5e-5) and 0 <= second["clip_fraction"] <= 1
    # the chart has both policies of both rounds, and the latest numbers are plottable metadata
    chart = meta["chart"].value
    assert chart.count("cand.") == 2 and "promoted v1" in chart and "kept" in chart
    assert meta["round"].value == 2 and meta["champion"].value == "v1" and meta["promotions"].value == 1
    assert len(meta["vega_lite"].value["data"]["values"]) == 4


def test_rollback_command_restores_the_previous_champion(world):
    assert world.registry.champion()["version"] == "v1"
    flowopt = str(Path(sys.executable).with_name("flowopt"))
    done = subprocess.run(
        [flowopt, "rollback", "--models", str(world.models), "--reason", "test", "--home", str(world.root / "home")],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == {"previous_champion": "v1", "champion": "v0", "adapter_path": str(world.models / "adapters" / "v0")}
    assert world.registry.champion()["version"] == "v0"
    assert world.registry.load()["history"][-1]["action"] == "rollback"
    # the `champion` asset's history is the registry's: registered v0, promoted v1, rolled back to v0
    events = world.instance.fetch_materializations(AssetKey("champion"), limit=10, ascending=True).records
    meta = [e.asset_materialization.metadata for e in events]
    assert [(m["action"].value, m["version"].value) for m in meta] == [("register", "v0"), ("promote", "v1"), ("rollback", "v0")]
    assert events[-1].run_id == "" and meta[-1]["reason"].value == "test" and "| v0 | rollback | v1 |" in meta[-1]["history"].value


def test_a_daemon_started_afterwards_requests_nothing_already_done(world):
    # the rounds above ran in process with this module's own cursor; a daemon starting now has no
    # cursor, and must not re-train the promoted batch nor the blocked one
    trained = {r.tags["dagster/partition"] for r in world.instance.get_runs() if r.job_name == "training_round_job"}
    assert len(trained) == 2
    assert tick_sensor(world.defs, world.instance, "training_round_sensor").run_requests == []
    assert tick_sensor(world.defs, world.instance, "new_logs_sensor").run_requests == []
    assert tick_sensor(world.defs, world.instance, "training_history_sensor").run_requests == []


def test_a_real_daemon_started_afterwards_launches_nothing(world):
    # `dagster-daemon run` on this instance and the repo's workspace, pointed at this world's lake,
    # landing, models and agent: every sensor ticks, and no run is launched
    home = world.root / "home"
    if not (home / "dagster.yaml").exists():
        shutil.copyfile(REPO / "dagster.yaml", home / "dagster.yaml")
    env = {
        **os.environ, "DAGSTER_HOME": str(home), "FLOWOPT_LAKE": str(world.root / "lake"), "FLOWOPT_LANDING": str(world.root / "landing"),
        "FLOWOPT_MODELS": str(world.models), "FLOWOPT_TASKS": "reasoning_gym", "FLOWOPT_SETTLE_SECONDS": "0",
    }  # fmt: skip
    runs_before = {r.run_id for r in world.instance.get_runs()}
    sensors = {"new_logs_sensor", "training_round_sensor", "training_history_sensor", "ab_monitor_sensor"}
    daemon = subprocess.Popen(
        [str(Path(sys.executable).with_name("dagster-daemon")), "run", "-w", "workspace.yaml"],
        cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True,
    )  # fmt: skip
    ticks: dict[str, list] = {}

    def evaluated(by_sensor: dict[str, list]) -> set[str]:
        return {name for name, found in by_sensor.items() if any(t.status == TickStatus.SKIPPED for t in found)}

    try:
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline and daemon.poll() is None:
            states = world.instance.all_instigator_state(instigator_type=InstigatorType.SENSOR)
            ticks = {s.instigator_name: world.instance.get_ticks(s.instigator_origin_id, s.selector_id) for s in states}
            if sensors <= evaluated(ticks):
                break
            time.sleep(2)
    finally:
        os.killpg(daemon.pid, signal.SIGTERM)
        output = daemon.communicate(timeout=60)[0].decode(errors="replace")
        with contextlib.suppress(ProcessLookupError):  # a code server left behind by the daemon
            os.killpg(daemon.pid, signal.SIGKILL)
    # every sensor evaluated fully at least once and decided there was nothing to do (a tick that
    # failed, e.g. on a busy SQLite file this test also reads, is retried by the daemon)
    assert sensors <= evaluated(ticks), (ticks, output[-3000:])
    assert not any(t.status == TickStatus.SUCCESS for name in sensors for t in ticks[name]), output[-3000:]
    assert {r.run_id for r in world.instance.get_runs()} == runs_before


def test_a_multi_turn_agent_round_trains_on_every_turn(calculator_policy_dir, tmp_path):
    # the warm-started calculator policy (base + v0 registered), its own lake, landing and instance
    models = tmp_path / "models"
    shutil.copytree(calculator_policy_dir, models)
    for path in (models / "registry.json",):
        path.write_text(path.read_text().replace(str(calculator_policy_dir), str(models)))
    defs = build_definitions(str(tmp_path / "lake"), str(tmp_path / "landing"), models_root=str(models), tasks=TaskSourceResource(kind="calculator"))
    (tmp_path / "home").mkdir()
    with instance_for_test(temp_dir=str(tmp_path / "home")) as instance:
        # 24 groups of 8: the warm-started policy solves most products and few sums, so 12 groups
        # of 4 had no group with a varied outcome (nothing to train) in about a third of the runs
        collect = {"ops": {"rollouts": {"config": {"tasks_per_batch": 24, "group_size": 8}}}}
        result = run_job(defs, instance, "collect_rollouts_job", run_config=collect)
        assert result.success, failure(result)
        tick = execute_requests(defs, instance, "log_batch_job", tick_sensor(defs, instance, "new_logs_sensor"))
        (key,) = tick.succeeded
        assert [r.partition_key for r in tick_sensor(defs, instance, "training_round_sensor").run_requests] == [key]
        config = RoundSettings(evaluation={"max_tasks": 24, **OPEN_GATE}).run_config()
        result = run_job(defs, instance, "training_round_job", key, config)
        assert result.success, failure(result)
    lake = TrajectoryLake(root=str(tmp_path / "lake"))
    steps, advantages = lake.read_partition("steps", key), lake.read_partition("step_advantages", key)
    turns = steps.join(advantages, on=["trajectory_id", "index"]).filter(pl.col("token_ids").is_not_null())
    trained = turns.filter(pl.col("advantage") != 0)
    summary, evaluation = read_round_summary(models / "runs" / key), read_evaluation(models / "runs" / key)
    # one training row per LLM turn of a rollout whose group had signal; tool results never trained
    assert summary.num_samples == trained.height and summary.dropped_zero_advantage == turns.height - trained.height
    assert turns.height > 48 and steps.filter(pl.col("kind") == "observation")["token_ids"].null_count() > 0
    report = evaluation.report["sampled"]["candidate"]
    assert report["avg_llm_calls"]["mean"] > 1.5 and report["avg_tool_calls"]["mean"] > 0.5
    assert AdapterRegistry(root=str(models)).champion()["version"] == "v1"


def test_self_play_builds_nothing_twice_waits_for_each_round_and_stops_at_its_count(world, tmp_path, monkeypatch):
    from resources.loop import TrainingLoop
    from sensors import self_play

    config = tmp_path / "run-config.json"
    config.write_text(json.dumps({"collect_rollouts_job": {"ops": {"rollouts": {"config": COLLECT}}}}))

    def tick(rounds: int, models=None, schedule=("adapter",)):
        defs = build_definitions(
            str(world.root / "lake"), str(world.root / "landing"), models_root=str(models or world.models),
            tasks=TaskSourceResource(), loop=TrainingLoop(self_play_rounds=rounds, run_config_path=str(config), round_schedule=list(schedule)),
        )  # fmt: skip
        with build_sensor_context(instance=world.instance, resources=defs.resources) as ctx:
            return defs.resolve_sensor_def("self_play_sensor")(ctx)

    assert "self-play is off" in tick(0).skip_message
    assert tick(2).skip_message == "done: 2 of 2 rounds of flowopt:spell_backward"  # the two rounds above
    (request,) = tick(3).run_requests
    assert request.job_name == "collect_rollouts_job" and request.run_config == {"ops": {"rollouts": {"config": COLLECT}}}
    assert request.tags == {"flowopt/agent": "flowopt:spell_backward"}
    (base,) = tick(3, models=tmp_path / "empty-models").run_requests  # no champion there yet
    assert base.job_name == "base_policy_job"
    # a collected batch whose round has not run yet: wait for it
    key = world.collect()
    assert tick(3).skip_message == f"waiting for the round of {key}"
    # the same batch re-scored so that every trajectory gets the same reward: no group varies, the
    # training sensor declines it (nothing to train on), and the loop collects another batch from
    # the same champion instead of waiting for a round that will not come; up to a limit
    flat = {"ops": {"rewards": {"config": {"outcome": 0.0, "tool_success": 0.0, "verify": 0.0, "step_penalty": 0.0,
                                           "custom": {"*": ["tests.data_plane.test_assets:constant_reward"]}}}}}  # fmt: skip
    assert world.run("log_batch_job", partition_key=key, run_config=flat).success
    assert key not in world.training_requests()
    (again,) = tick(3).run_requests
    assert again.job_name == "collect_rollouts_job"
    # when the batch's turn is a prompt round (which learns from the lake's successful flows, not
    # from advantages), it gets that round: the loop waits for it
    assert tick(3, schedule=("prompt",)).skip_message == f"waiting for the round of {key}"
    monkeypatch.setattr(self_play, "MAX_NO_SIGNAL_BATCHES", 1)
    assert tick(3).skip_message.startswith("the last 1 batches of flowopt:spell_backward had no group with a varied reward")
    # scored as before, the batch is the loop's again (later tests train on other batches)
    assert world.run("log_batch_job", partition_key=key).success
    assert tick(3).skip_message == f"waiting for the round of {key}"


def test_an_api_job_paused_mid_round_stops_after_a_step_and_resumes_from_its_checkpoint(world):
    """training.pause / resume on real runs: the round sees the request after its first optimizer
    step, checkpoints it and stops (the job reads paused); resume submits a second attempt, which
    continues from that checkpoint to the end (the job reads completed)."""
    from flow_assets.api.jobs import JobParams, JobService, StartGrpoParams
    from flow_assets.core.run_tags import JOB_TAG, pause_key
    from flow_assets.api.jsonrpc import INVALID_STATE, RpcError

    key = world.collect()
    assert key in world.training_requests()  # the sensor's round is not run (nor an earlier test's batch): the job's is
    attempts = []

    def submit(job_name, run_config, tags):
        if not attempts:  # the pause request arrives while the first attempt trains
            world.instance.run_storage.set_cursor_values({pause_key(tags[JOB_TAG]): "requested"})
        result = run_job(world.defs, world.instance, job_name, tags["dagster/partition"], run_config, tags=tags)
        attempts.append(result)
        return result.run_id

    service = JobService(world.instance, submit, lambda ids: None, lambda: {key})
    # three epochs: a round of several optimizer steps, so the pause after step 1 is mid-round
    # the gate refuses every candidate (KL bound 0): the champion stays, and a blocked round is a done round
    config = {"trainer": {"num_iterations": 3}, "evaluation": {**EVAL, "gate": {"min_gain": -1.0, "max_kl": 0.0}}}
    status = service.start_grpo(StartGrpoParams(agent_id="spell", log_batches=[key], config=config))
    job = JobParams(job_id=status["job_id"])
    assert status["state"] == "paused" and status["rounds"][0]["paused"] == "after step 1", status
    assert not attempts[0].success and (world.models / "runs" / key / "checkpoints" / "checkpoint-1").is_dir()
    resumed = service.resume(job)
    assert resumed["state"] == "completed" and resumed["rounds"][0]["attempt"] == 2 and not resumed["pause_requested"], resumed
    assert resumed["rounds"][0]["blocked"] and resumed["rounds"][0]["status"] == "failure" and resumed["progress"]["rounds_done"] == 1
    summary, _ = world.round_files(key)
    assert summary.resumed_from == 1 and summary.final_step > 1
    # another job on the same batch, from the same champion, with other settings is another
    # round: it starts afresh (it used to fail on the trainer's "saved config differs")
    again = service.start_grpo(StartGrpoParams(agent_id="spell", log_batches=[key], config={**config, "trainer": {"num_iterations": 1}}))
    assert again["state"] == "completed", again
    summary, _ = world.round_files(key)
    assert summary.resumed_from is None and summary.config["num_iterations"] == 1
    with pytest.raises(RpcError) as refused:
        service.pause(job)
    assert refused.value.code == INVALID_STATE


def test_training_evaluate_runs_one_version_on_the_held_out_tasks_the_gate_used(world):
    """training.evaluate on real runs: v0 greedy on the first 120 held-out tasks as an
    adapter_evaluation partition; greedy decoding is deterministic, so each task's outcome equals
    v0's as the champion side of the first round's evaluation on the same tasks."""
    from flow_assets.api.jobs import EvaluateParams, JobService, ListJobsParams
    from flow_assets.api.jsonrpc import INVALID_PARAMS, RpcError
    from flow_assets.core.partitions import adapter_versions

    first = next((k for k in sorted(world.instance.get_materialized_partitions(AssetKey("evaluation_report")))
                  if world.round_files(k)[0].parent_version == "v0"), None)  # fmt: skip
    if first is None:  # this test alone: one round from v0 first
        first = world.collect()
        assert world.train(first, evaluation=OPEN_GATE).success

    def submit(job_name, run_config, tags):
        result = run_job(world.defs, world.instance, job_name, tags["dagster/partition"], run_config, tags=tags)
        assert result.success, failure(result)
        return result.run_id

    service = JobService(
        world.instance, submit, lambda ids: None, lambda: set(),
        versions=lambda v: world.registry.version(v) is not None,
        add_version=lambda v: world.instance.add_dynamic_partitions(adapter_versions.name, [v]),
    )  # fmt: skip
    with pytest.raises(RpcError) as unknown:
        service.evaluate(EvaluateParams(version="v99"))
    assert unknown.value.code == INVALID_PARAMS and unknown.value.data["errors"][0]["field"] == "version"
    status = service.evaluate(EvaluateParams(version="v0", max_tasks=EVAL["max_tasks"], modes=["greedy"]))
    assert status["kind"] == "evaluate" and status["state"] == "completed", status
    report = status["evaluation"]["report"]
    assert set(report) == {"greedy"} and report["greedy"]["n_tasks"] == EVAL["max_tasks"]
    lake = TrajectoryLake(root=str(world.root / "lake"))
    mine = lake.read_partition("adapter_evaluations", "v0").sort("task_id")
    gate_side = lake.read_partition("evaluations", first).filter((pl.col("policy") == "champion") & (pl.col("mode") == "greedy")).sort("task_id")
    assert mine["task_id"].to_list() == gate_side["task_id"].to_list()
    assert mine["success"].to_list() == gate_side["success"].to_list()
    rate = report["greedy"]["success_rate"]
    assert rate["successes"] == sum(mine["success"].to_list()) and rate["ci_low"] <= rate["rate"] <= rate["ci_high"]
    listed = {j["job_id"]: j for j in service.list_jobs(ListJobsParams())}
    assert listed[status["job_id"]]["kind"] == "evaluate"


def test_the_agents_own_text_log_trains_on_the_turns_it_captured(world):
    """A text log of the policy's own agent (flat records with ``adapter_version``, no token ids),
    dropped into the landing directory, gets its round from the sensor; its turns, re-rendered with
    the chat template, are the ids the gateway captured for the same text, and their behaviour
    log-probs, recomputed by the logged version, are the sampler's."""
    from flow_assets.policy.rollouts import text_training_samples, training_samples
    from flow_assets.policy.store import PolicyStore
    from flow_assets.training.rounds import text_behaviour_logprobs

    lake, source = TrajectoryLake(root=str(world.root / "lake")), TaskSourceResource()
    champion = world.registry.champion()
    # a batch collected by a version that is not the champion now: its log-probs must come from that version
    version_of = {k: k.split(".")[2].rsplit("-", 1)[0] for k in world.instance.get_dynamic_partitions("log_batches") if k.startswith("r0")}
    captured_key, logged_version = min((k, v) for k, v in version_of.items() if v != champion["version"])
    trajectories = lake.read_partition("trajectories", captured_key).filter(pl.col("agent_id") == source.agent_id)
    steps = lake.read_partition("steps", captured_key)
    prompts = {t.task_id: t.prompt for t in source.source().tasks()}
    answers = dict(steps.filter(pl.col("index") == 0).select("trajectory_id", "output").iter_rows())
    records = [
        {"task_id": task, "input": prompts[task], "response": answers[tid], "score": score, "agent_id": source.agent_id,
         "adapter_version": logged_version, "interaction_id": f"text/{tid}"}
        for tid, task, score in trajectories.select("trajectory_id", "task_id", "outcome_score").iter_rows()
    ]  # fmt: skip
    landing = world.root / "landing" / "production"
    landing.mkdir(parents=True, exist_ok=True)
    (landing / "spell-agent.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    (key,) = world.land_and_process()
    assert world.training_requests() == [key]  # the agent's own flows train, token ids or not

    store = PolicyStore(str(world.models))
    model, tokenizer = store.load(champion["adapter_path"])
    text = text_training_samples(lake.read_partition("interaction_logs", key), lake.read_partition("step_advantages", key),
                                 [source.agent_id], tokenizer)  # fmt: skip
    assert text.trajectories == len(records) and text.turns == len(records) and not text.skipped
    assert text.assumed_temperature == len(records)  # the flat log says no temperature: T = 1, as collected
    rescored = text_behaviour_logprobs(store, world.registry, champion, model, tokenizer.pad_token_id, text)
    mine = {(tuple(s.prompt_ids), tuple(s.completion_ids)): s.behaviour_logprobs for s in rescored}
    original = training_samples(steps, lake.read_partition("step_advantages", captured_key), trajectories, source.agent_id)
    finished = [s for s in original if s.completion_ids and s.completion_ids[-1] == tokenizer.eos_token_id]
    assert len(finished) > len(original) // 2
    for sample in finished:  # a completion cut at max_new_tokens has no eos; re-rendered text ends its turn
        logprobs = mine[(tuple(sample.prompt_ids), tuple(sample.completion_ids))]
        assert logprobs == pytest.approx(sample.behaviour_logprobs, abs=2e-4)

    result = world.train(key, evaluation=OPEN_GATE)
    assert result.success, failure(result)
    summary, _ = world.round_files(key)
    assert (summary.turns_captured, summary.turns_text) == (0, len(records))
    assert summary.sources == ["production"] and summary.update_rule == "grpo"
    assert world.run("training_history_job").success
    record = world.instance.fetch_materializations(AssetKey("training_history"), limit=1).records[0]
    last = [r.data for r in record.asset_materialization.metadata["history"].value.records][-1]
    assert (last["batch"], last["source"], last["update_rule"], last["turns_text"]) == (key, "production", "grpo", len(records))


def test_another_models_flows_named_as_a_source_train_by_advantage_weighted_likelihood(world):
    """Flows of another agent (a teacher's right and wrong answers, text only) stop after
    ``advantages`` by default; named in the loop's ``sources`` with ``awr``, the sensor requests
    their round and it imitates the positive-advantage answers only."""
    from resources.loop import TrainingLoop

    source = TaskSourceResource()
    train = source.source().tasks("train")[:40]
    records = []
    for task in train:
        for name, answer, score in (("right", task.demonstration, 1.0), ("wrong", task.demonstration[::-1] + "x", 0.0)):
            records.append({"task_id": task.task_id, "input": task.prompt, "response": answer, "score": score,
                            "agent_id": "teacher", "interaction_id": f"teacher/{task.task_id}/{name}"})  # fmt: skip
    landing = world.root / "landing" / "teacher"
    landing.mkdir(parents=True, exist_ok=True)
    (landing / "teacher.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    (key,) = world.land_and_process()
    assert world.training_requests() == []  # not the policy's own agent, and no source names it

    defs = build_definitions(
        str(world.root / "lake"), str(world.root / "landing"), models_root=str(world.models), tasks=source,
        loop=TrainingLoop(sources={"teacher": "awr"}),
    )  # fmt: skip
    # a fresh cursor: batches decided before are asked for again if they never trained; ours is new
    assert key in [r.partition_key for r in tick_sensor(defs, world.instance, "training_round_sensor").run_requests]
    config = RoundSettings(trainer={"learning_rate": 2e-3}, evaluation={**EVAL, **OPEN_GATE}).run_config()
    result = run_job(defs, world.instance, "training_round_job", key, config)
    assert result.success, failure(result)
    summary, evaluation = world.round_files(key)
    assert summary.update_rule == "awr" and summary.sources == ["teacher"]
    assert (summary.turns_captured, summary.turns_text) == (0, len(records))
    # filtered behaviour cloning: the right answers (positive advantage) train, the wrong ones not
    assert (summary.num_samples, summary.dropped_zero_advantage) == (len(train), len(train))
    assert summary.config["update_rule"] == "awr"
    assert evaluation.report["sampled"]["n_tasks"] == EVAL["max_tasks"]
