"""The data plane on a real Dagster instance and the real tau-bench log, through the sensor path."""

import json
import shutil

import polars as pl
import pytest
from dagster import AssetKey

from flow_assets.definitions import build_definitions
from flow_assets.runtime.local import execute_requests, tick_sensor
from flow_assets.data_plane.summary import batch_summary
from resources.lake import TrajectoryLake
from tests.conftest import TAU_BENCH

OUTCOME_ONLY = {"ops": {"rewards": {"config": {"tool_success": 0.0, "verify": 0.0, "step_penalty": 0.0}}}}
TABLES = ("interaction_logs", "quarantine", "trajectories", "steps", "rewards", "advantages", "step_advantages")


@pytest.fixture
def ingested(tmp_path, dagster_instance):
    landing, lake_root = tmp_path / "landing", tmp_path / "lake"
    (landing / "tau-bench").mkdir(parents=True)
    (landing / "broken").mkdir()
    shutil.copyfile(TAU_BENCH, landing / "tau-bench" / TAU_BENCH.name)
    # a truncated JSON document cannot be read at all: only its own partition may fail
    (landing / "broken" / "cut.json").write_bytes(TAU_BENCH.read_bytes()[:5000])
    defs = build_definitions(str(lake_root), str(landing))
    tick = execute_requests(defs, dagster_instance, "log_batch_job", tick_sensor(defs, dagster_instance, "new_logs_sensor"), OUTCOME_ONLY)
    tau_key = next(k for k in tick.added_partitions if k.startswith("tau-bench."))
    return defs, dagster_instance, TrajectoryLake(root=str(lake_root)), tick, tau_key


def test_tau_bench_batch_has_its_known_groups_and_outcomes(ingested):
    _, _, lake, tick, key = ingested
    assert key in tick.succeeded
    traj = lake.read_partition("trajectories", key)
    assert traj.height == 200
    assert traj["task_id"].n_unique() == 50
    assert traj["outcome_success"].sum() == 84
    adv = lake.read_partition("advantages", key)
    groups = adv.group_by("group_key").agg(pl.len().alias("n"), pl.col("zero_variance").first())
    assert groups["n"].to_list() == [4] * 50
    assert (~groups["zero_variance"]).sum() == 26
    # every trajectory in a mixed group has a non-zero advantage, and they sum to ~0 per group
    mixed = adv.filter(~pl.col("zero_variance"))
    assert mixed.height == 26 * 4 and (mixed["advantage"] != 0).all()
    assert mixed.group_by("group_key").agg(pl.col("advantage").sum())["advantage"].abs().max() < 1e-9
    row = batch_summary(lake, [key]).to_dicts()[0]
    assert (row["trajectories"], row["groups"], row["groups_with_signal"], row["quarantined"]) == (200, 50, 26, 0)
    assert row["mean_outcome"] == row["mean_shaped_reward"] == pytest.approx(84 / 200)


def test_unreadable_file_fails_only_its_own_partition_and_names_the_file(ingested):
    _, instance, lake, tick, key = ingested
    broken = [k for k in tick.added_partitions if k.startswith("broken.")]
    assert len(broken) == 1 and broken[0] in tick.failed
    assert "cut.json" in tick.failed[broken[0]]
    assert key in tick.succeeded
    assert broken[0] not in lake.batches("trajectories")


def test_materialisations_and_checks_are_recorded_in_the_instance(ingested):
    _, instance, _, _, key = ingested
    for asset in ("interaction_logs", "trajectories", "rewards", "advantages"):
        event = instance.get_latest_materialization_event(AssetKey(asset))
        assert event is not None
    mat = instance.fetch_materializations(AssetKey("advantages"), limit=10).records
    assert key in {r.partition_key for r in mat}
    meta = next(r for r in mat if r.partition_key == key).asset_materialization.metadata
    assert meta["groups_with_signal"].value == 26
    assert meta["zero_variance_share"].value == pytest.approx(24 / 50)


def test_rematerialising_a_partition_gives_the_same_bytes(ingested):
    defs, instance, lake, _, key = ingested
    before = {t: lake.partition_path(t, key).read_bytes() for t in TABLES}
    result = defs.resolve_job_def("log_batch_job").execute_in_process(instance=instance, partition_key=key, run_config=OUTCOME_ONLY)
    assert result.success
    after = {t: lake.partition_path(t, key).read_bytes() for t in TABLES}
    assert after == before


def test_rematerialising_with_other_config_replaces_exactly_that_partition(ingested):
    defs, instance, lake, _, key = ingested
    before = lake.read_partition("rewards", key)
    result = defs.resolve_job_def("log_batch_job").execute_in_process(instance=instance, partition_key=key)
    assert result.success
    after = lake.read_partition("rewards", key)
    assert after.height == before.height == 200
    assert not after["r_tool_success"].equals(before["r_tool_success"])  # shaped terms now on
    assert lake.scan("rewards").collect().height == 200  # replaced, not appended


def test_a_batch_streamed_in_many_small_chunks_gives_the_same_tables(tmp_path, monkeypatch):
    """The data plane streams a batch chunk by chunk, and may validate the chunks and build the
    trajectories and steps rows in worker processes; neither chunk boundaries nor workers may
    change a row."""
    import orjson
    import pyarrow.parquet as pq
    from dagster import instance_for_test

    from flow_assets.logs import tables
    from flow_assets.logs.reader import parse_file

    lines = [v.trajectory.model_dump_json().encode() for v in parse_file(TAU_BENCH).valid]
    lines[3] = b'{"trajectory_id": "broken'  # truncated JSON
    lines[50] = lines[10]  # a duplicate trajectory id
    lines.insert(120, orjson.dumps({**orjson.loads(lines[0]), "trajectory_id": "x", "steps": "none"}))
    body = b"\n".join(lines) + b"\n"

    def run(name: str, parse_workers: int = 1) -> tuple[TrajectoryLake, str]:
        landing, lake_root = tmp_path / name / "landing", tmp_path / name / "lake"
        (landing / "fleet").mkdir(parents=True)
        (landing / "fleet" / "runs.jsonl").write_bytes(body)
        defs = build_definitions(str(lake_root), str(landing))
        (tmp_path / name / "home").mkdir()
        with instance_for_test(temp_dir=str(tmp_path / name / "home")) as instance:  # each run its own instance
            (key,) = [r.partition_key for r in tick_sensor(defs, instance, "new_logs_sensor").run_requests]
            config = {"ops": {"interaction_logs": {"config": {"parse_workers": parse_workers}},
                              "trajectories": {"config": {"table_workers": parse_workers}}}}  # fmt: skip
            result = defs.resolve_job_def("log_batch_job").execute_in_process(
                instance=instance, partition_key=key, run_config=config
            )
            assert result.success
            workers = result.asset_materializations_for_node("interaction_logs")[0].metadata["parse_workers"]
            table_workers = result.asset_materializations_for_node("trajectories")[0].metadata["table_workers"]
            assert workers.value == table_workers.value == parse_workers
        return TrajectoryLake(root=str(lake_root)), key

    whole, key = run("whole")
    monkeypatch.setattr(tables, "CHUNK_RECORDS", 7)
    monkeypatch.setattr(tables, "CHUNK_BYTES", 20_000)
    chunked, chunked_key = run("chunked")
    workers, workers_key = run("workers", parse_workers=2)
    assert chunked_key == workers_key == key
    for other in (chunked, workers):
        for table in TABLES:
            # ``file`` is the snapshot's path, which holds its lake's root: compare its name only
            a, b = (lake.read_partition(table, key) for lake in (other, whole))
            if "file" in a.columns:
                a, b = (f.with_columns(pl.col("file").str.split("/").list.last()) for f in (a, b))
            assert a.equals(b), table
    assert pq.ParquetFile(chunked.partition_path("steps", key)).num_row_groups > 20  # it did stream
    quarantine = whole.read_partition("quarantine", key)
    assert sorted(quarantine["line"].to_list()) == [4, 51, 121]
    assert whole.read_partition("interaction_logs", key)["record"].to_list() == list(range(198))


def huge_reward(trajectory) -> float:
    """A custom reward at the edge of float64 (finite, but two of them overflow a sum)."""
    return 1.7e308 if trajectory.outcome.success else -1.7e308


def own_tau_bench(tmp_path):
    """Definitions whose trainable agent (``flowopt:jsonl``) logged the real tau-bench flows:
    they land in ``tmp_path/landing`` as that agent's batch."""
    from flow_assets.logs.reader import parse_file
    from resources.tasks import TaskSourceResource

    landing = tmp_path / "landing" / "mine"
    landing.mkdir(parents=True)
    rows = [r.trajectory.model_copy(update={"agent_id": "flowopt:jsonl"}).model_dump_json() for r in parse_file(TAU_BENCH).valid]
    (landing / "rollouts.jsonl").write_text("\n".join(rows) + "\n")
    tasks = TaskSourceResource(kind="jsonl", path=str(tmp_path / "tasks.jsonl"))
    return build_definitions(str(tmp_path / "lake"), str(tmp_path / "landing"), tasks=tasks)


def test_a_batch_with_non_finite_advantages_never_reaches_training(tmp_path, dagster_instance):
    """Finite rewards of ±1.7e308 (a custom reward function) overflow the turn-weighted group
    mean (``normalise_over="turn"``: reward × turns), so the advantages are NaN; the blocking check fails the run, and the training sensor declines the
    batch although it holds the trainable agent's trajectories."""
    from flow_assets.runtime.local import run_job
    from sensors.training import failed_data_checks

    defs = own_tau_bench(tmp_path)
    overflow = {"ops": {"rewards": {"config": {"custom": {"*": ["tests.data_plane.test_assets:huge_reward"]}}},
                        "advantages": {"config": {"normalise_over": "turn"}}}}  # fmt: skip
    tick = execute_requests(defs, dagster_instance, "log_batch_job", tick_sensor(defs, dagster_instance, "new_logs_sensor"), overflow)
    (key,) = tick.added_partitions
    assert key in tick.failed and "advantages_finite" in tick.failed[key]
    assert failed_data_checks(dagster_instance, key) == ["advantages_finite"]
    assert tick_sensor(defs, dagster_instance, "training_round_sensor").run_requests == []
    # the same batch with the default rewards passes the check and is offered for training
    assert run_job(defs, dagster_instance, "log_batch_job", key).success
    assert failed_data_checks(dagster_instance, key) == []
    assert [r.partition_key for r in tick_sensor(defs, dagster_instance, "training_round_sensor").run_requests] == [key]


def constant_reward(trajectory) -> float:
    """A custom reward that gives every trajectory the same value (with the other terms weighted 0,
    no group has a varied reward)."""
    return 1.0


def test_a_batch_with_no_group_of_varied_reward_gets_no_training_round(tmp_path, dagster_instance):
    """The trainable agent's real tau-bench flows under a reward that is the same for every
    trajectory: every advantage is 0, so a round could make no optimizer step and the training
    sensor declines the batch, saying why; with the default rewards (49 of 50 groups vary) the
    same batch is offered."""
    from flow_assets.runtime.local import run_job
    from sensors.training import trainable_signal

    defs = own_tau_bench(tmp_path)
    flat = {"ops": {"rewards": {"config": {"outcome": 0.0, "tool_success": 0.0, "verify": 0.0, "step_penalty": 0.0,
                                           "custom": {"*": ["tests.data_plane.test_assets:constant_reward"]}}}}}
    tick = execute_requests(defs, dagster_instance, "log_batch_job", tick_sensor(defs, dagster_instance, "new_logs_sensor"), flat)
    (key,) = tick.added_partitions
    assert not tick.failed
    lake = TrajectoryLake(root=str(tmp_path / "lake"))
    mine = lake.read_partition("trajectories", key)
    reason = trainable_signal(lake.read_partition("advantages", key), mine)
    assert reason is not None and f"all {mine.height} labelled trajectories" in reason
    declined = tick_sensor(defs, dagster_instance, "training_round_sensor")
    assert declined.run_requests == []
    again = tick_sensor(defs, dagster_instance, "training_round_sensor", declined.cursor)
    assert again.run_requests == [] and again.cursor == declined.cursor  # the same advantages: still declined
    # re-scored with the default rewards: the sensor, keeping its cursor, sees the new advantages and offers the batch
    assert run_job(defs, dagster_instance, "log_batch_job", key).success
    assert trainable_signal(lake.read_partition("advantages", key), mine) is None
    offered = tick_sensor(defs, dagster_instance, "training_round_sensor", again.cursor)
    assert [r.partition_key for r in offered.run_requests] == [key]
    assert tick_sensor(defs, dagster_instance, "training_round_sensor", offered.cursor).run_requests == []  # requested once


def test_a_batch_of_trainable_flows_without_outcomes_is_declined_as_unlabelled():
    """Unlabelled trajectories (no outcome, advantage null) are no signal either, and the reason
    says so rather than counting zero labelled trajectories; one labelled non-zero advantage among
    them is enough to train."""
    from sensors.training import trainable_signal

    mine = pl.DataFrame({"trajectory_id": ["a", "b", "c"]})
    unlabelled = pl.DataFrame({"trajectory_id": ["a", "b", "c"], "group_key": ["g", "g", "h"], "advantage": [None, None, None]},
                              schema={"trajectory_id": pl.Utf8, "group_key": pl.Utf8, "advantage": pl.Float64})  # fmt: skip
    reason = trainable_signal(unlabelled, mine)
    assert reason is not None and "no labelled trajectory" in reason and "(3 without an outcome)" in reason
    one = unlabelled.with_columns(pl.when(pl.col("trajectory_id") == "c").then(0.5).otherwise(None).alias("advantage"))
    assert trainable_signal(one, mine) is None
    assert trainable_signal(one, mine.filter(pl.col("trajectory_id") != "c")) is not None


def test_the_training_sensors_cursor_of_an_earlier_version_still_reads():
    """A cursor written before declines were recorded (a plain list of decided batches) reads as
    those batches decided and none declined."""
    from sensors.training import read_cursor

    assert read_cursor(None) == (set(), {})
    assert read_cursor(json.dumps(["a", "b"])) == ({"a", "b"}, {})
    assert read_cursor(json.dumps({"decided": ["a", "b"], "declined": {"b": 17}})) == ({"a", "b"}, {"b": 17})


def test_declined_batches_rematerialised_are_found_in_one_paged_query(dagster_instance):
    """``rematerialised`` names exactly the declined batches whose ``advantages`` got a record after
    the one they were declined at (a batch declined before any record: after any), whatever other
    partitions were materialised meanwhile, across pages."""
    from dagster import AssetMaterialization

    from sensors.training import advantages_version, rematerialised

    def materialise(*keys):
        for key in keys:
            dagster_instance.report_runless_asset_event(AssetMaterialization(asset_key="advantages", partition=key))

    dagster_instance.add_dynamic_partitions("log_batches", ["a", "b", "c", "d", "e"])
    materialise("a", "b", "c")
    declined = {"a": advantages_version(dagster_instance, "a"), "b": advantages_version(dagster_instance, "b"), "e": None}
    assert declined["a"] < declined["b"]
    assert rematerialised(dagster_instance, {}) == set()
    assert rematerialised(dagster_instance, declined, page=2) == set()
    materialise("c", "d", "d", "c", "d")  # other batches only
    assert rematerialised(dagster_instance, declined, page=2) == set()
    materialise("b", "c", "d", "d")
    assert rematerialised(dagster_instance, declined, page=2) == {"b"}
    materialise("e")
    assert rematerialised(dagster_instance, declined, page=2) == {"b", "e"}
    assert rematerialised(dagster_instance, declined, page=1000) == {"b", "e"}
    materialise("a")
    assert rematerialised(dagster_instance, declined, page=1) == {"a", "b", "e"}


def test_unlabelled_trajectories_are_stored_without_reward_and_stay_out_of_the_groups(tmp_path, dagster_instance):
    """Real tau-bench trajectories as canonical JSONL, the outcome removed from every odd task's
    trials (and one line given an empty outcome object): the unlabelled ones are kept, get no
    reward and no advantage, and the labelled ones get exactly the advantages they get alone."""
    import json

    from flow_assets.logs.reader import parse_file

    lines = [json.loads(r.trajectory.model_dump_json()) for r in parse_file(TAU_BENCH).valid]
    odd = lambda t: int(t["task_id"]) % 2 == 1  # noqa: E731
    mixed, labelled_only = [], []
    for t in lines:
        if odd(t):
            t = {k: v for k, v in t.items() if k != "outcome"}
        else:
            labelled_only.append(t)
        mixed.append(t)
    mixed.append({**mixed[0], "trajectory_id": "empty-outcome", "outcome": {}})
    for name, rows in (("mixed", mixed), ("labelled", labelled_only)):
        (tmp_path / "landing" / name).mkdir(parents=True)
        (tmp_path / "landing" / name / "runs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    defs = build_definitions(str(tmp_path / "lake"), str(tmp_path / "landing"))
    tick = execute_requests(defs, dagster_instance, "log_batch_job", tick_sensor(defs, dagster_instance, "new_logs_sensor"), OUTCOME_ONLY)
    assert not tick.failed
    lake = TrajectoryLake(root=str(tmp_path / "lake"))
    key = {k.split(".")[0]: k for k in tick.succeeded}
    n_unlabelled = sum(1 for t in lines if odd(t))
    assert 0 < n_unlabelled < len(lines)
    row = batch_summary(lake, [key["mixed"]]).to_dicts()[0]
    assert (row["trajectories"], row["unlabelled"], row["quarantined"]) == (len(lines), n_unlabelled, 1)
    quarantine = lake.read_partition("quarantine", key["mixed"])
    assert "outcome needs success or score" in quarantine["reason"][0]
    rewards = lake.read_partition("rewards", key["mixed"])
    unlabelled_ids = {t["trajectory_id"] for t in lines if odd(t)}
    assert rewards.filter(pl.col("trajectory_id").is_in(unlabelled_ids))["reward"].null_count() == n_unlabelled
    mixed_adv = lake.read_partition("advantages", key["mixed"])
    assert mixed_adv.filter(pl.col("trajectory_id").is_in(unlabelled_ids))["advantage"].null_count() == n_unlabelled
    alone = lake.read_partition("advantages", key["labelled"]).select("trajectory_id", "advantage").sort("trajectory_id")
    together = mixed_adv.filter(pl.col("advantage").is_not_null()).select("trajectory_id", "advantage").sort("trajectory_id")
    assert together.equals(alone)
    assert row["groups"] == batch_summary(lake, [key["labelled"]]).to_dicts()[0]["groups"]
    from flow_assets.logs.ingest import hint

    assert f"{n_unlabelled} of {len(lines)} trajectories carry no outcome" in hint(row)
    steps = lake.read_partition("step_advantages", key["mixed"])
    assert steps.filter(pl.col("trajectory_id").is_in(unlabelled_ids))["advantage"].null_count() > 0


def test_rewards_with_custom_functions_and_a_judge_stream_in_chunks_and_equal_the_whole_batch(tmp_path, dagster_instance, monkeypatch):
    """The rewards asset reads the batch in chunks of 7 records (custom rewards) and of whole
    groups (the judge: tau-bench's groups of 4 are one chunk each, their trials 50 records apart);
    its table equals the one computed from the whole batch at once. The judge listens on no port,
    so every group is dropped with the reason, as a real unreachable judge is."""
    import socket

    from flow_assets.logs import tables
    from flow_assets.judge.client import JudgeCache, judge_groups_sync, judgement_table
    from flow_assets.rl.rewards import RewardConfig, custom_rewards, reward_table, trajectory_groups
    from flow_assets.logs.schema import Trajectory
    from resources.judge import JudgeEndpoint

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    judge = JudgeEndpoint(base_url=f"http://127.0.0.1:{port}/v1", model="m", mode="relative", max_retries=0, timeout_s=5,
                          cache_dir=str(tmp_path / "cache"))  # fmt: skip
    (tmp_path / "landing" / "tau-bench").mkdir(parents=True)
    shutil.copyfile(TAU_BENCH, tmp_path / "landing" / "tau-bench" / TAU_BENCH.name)
    defs = build_definitions(str(tmp_path / "lake"), str(tmp_path / "landing"), judge=judge)
    custom = {"gpt-4o-airline": ["flow_assets.rl.reward_fns:tool_error_penalty"], "*": ["flow_assets.rl.reward_fns:answered"]}
    monkeypatch.setattr(tables, "CHUNK_RECORDS", 7)
    tick = execute_requests(defs, dagster_instance, "log_batch_job", tick_sensor(defs, dagster_instance, "new_logs_sensor"),
                            {"ops": {"rewards": {"config": {"custom": custom}}}})  # fmt: skip
    (key,) = tick.succeeded
    lake = TrajectoryLake(root=str(tmp_path / "lake"))
    streamed = lake.read_partition("rewards", key)

    records = lake.read_partition("interaction_logs", key)["record_json"].to_list()
    assert len(records) == 200 and lake.read_partition("trajectories", key)["task_id"].head(2).to_list() == ["0", "1"]
    cfg = RewardConfig(custom={k: tuple(v) for k, v in custom.items()})
    groups = trajectory_groups(records)
    verdicts = judge_groups_sync(groups, judge.settings(), judge.base_url, judge.api_key, JudgeCache(None))
    whole = reward_table(
        lake.read_partition("trajectories", key), lake.read_partition("steps", key), cfg,
        custom_rewards([Trajectory.model_validate_json(r) for r in records], cfg), judgement_table(verdicts, groups),
    ).with_columns(source=pl.lit("tau-bench"))  # fmt: skip
    assert streamed.equals(whole)
    assert streamed["r_custom"].n_unique() > 1 and streamed["reward"].null_count() == 200
    assert streamed["judge_error"].str.contains("APIConnectionError").all()
    meta = next(
        r.asset_materialization.metadata
        for r in dagster_instance.fetch_materializations(AssetKey("rewards"), limit=5).records
        if r.partition_key == key
    )
    assert (meta["judge_groups_dropped"].value, meta["judge_groups_scored"].value, meta["judge_requests"].value) == (50, 0, 0)
    assert lake.read_partition("advantages", key)["advantage"].null_count() == 200
