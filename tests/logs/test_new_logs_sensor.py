"""new_logs_sensor: idempotent across ticks and restarts, content-addressed, never reads .tmp."""

import json
import os
import shutil
import time

from dagster import RunRequest, SensorResult, build_sensor_context

from flow_assets.definitions import build_definitions
from flow_assets.runtime.local import TickOutcome, execute_requests, run_job
from flow_assets.core.partitions import log_batches
from resources.lake import TrajectoryLake
from resources.landing import LogLanding
from sensors.new_logs import new_logs_sensor

from tests.conftest import SHARED_DATA, TAU_BENCH

FIREACT = sorted((SHARED_DATA / "fireact").glob("*.json"))[0]


def _tick(defs, instance, cursor=None) -> SensorResult:
    with build_sensor_context(instance=instance, cursor=cursor, resources=defs.resources, sensor_name="new_logs_sensor") as ctx:
        result = new_logs_sensor(ctx)
    for request in result.dynamic_partitions_requests or []:
        instance.add_dynamic_partitions(request.partitions_def_name, list(request.partition_keys))
    return result


def _setup(tmp_path):
    landing, lake = tmp_path / "landing", tmp_path / "lake"
    (landing / "tau-bench").mkdir(parents=True)
    (landing / "fireact").mkdir()
    shutil.copyfile(TAU_BENCH, landing / "tau-bench" / TAU_BENCH.name)
    shutil.copyfile(FIREACT, landing / "fireact" / FIREACT.name)
    return landing, lake, build_definitions(str(lake), str(landing))


def test_first_tick_adds_one_partition_and_one_run_per_file(tmp_path, dagster_instance):
    landing, lake, defs = _setup(tmp_path)
    result = _tick(defs, dagster_instance)
    keys = sorted(r.partition_key for r in result.run_requests)
    assert len(keys) == 2
    assert sorted(result.dynamic_partitions_requests[0].partition_keys) == keys
    assert [r.run_key for r in sorted(result.run_requests, key=lambda r: r.partition_key)] == keys
    assert sorted(dagster_instance.get_dynamic_partitions(log_batches.name)) == keys
    # each batch has its manifest; the tick copies nothing (the batch's run does)
    lake_res = TrajectoryLake(root=str(lake))
    manifests = {m.key: m for m in lake_res.registered_batches()}
    assert sorted(manifests) == keys
    assert {m.source for m in manifests.values()} == {"tau-bench", "fireact"}
    assert not any(lake_res.batch_snapshot(k).exists() for k in keys)


def test_second_tick_requests_nothing(tmp_path, dagster_instance):
    _, _, defs = _setup(tmp_path)
    first = _tick(defs, dagster_instance)
    second = _tick(defs, dagster_instance, first.cursor)
    assert not second.run_requests
    assert not second.dynamic_partitions_requests
    assert second.skip_reason is not None


def test_restart_with_saved_cursor_or_lost_cursor_requests_nothing(tmp_path, dagster_instance):
    _, _, defs = _setup(tmp_path)
    saved = _tick(defs, dagster_instance).cursor
    # a new process: fresh definitions, the cursor as the daemon stored it
    restarted = build_definitions(*(str(tmp_path / d) for d in ("lake", "landing")))
    assert not _tick(restarted, dagster_instance, saved).run_requests
    # even without a cursor the instance's partitions keep it idempotent
    assert not _tick(restarted, dagster_instance, None).run_requests


def _rewrite(target, elements: int) -> None:
    tmp = target.with_name(target.name + ".tmp")
    tmp.write_text(json.dumps(json.loads(TAU_BENCH.read_bytes())[:elements]))
    os.replace(tmp, target)


def test_rewritten_file_becomes_a_new_batch(tmp_path, dagster_instance):
    landing, lake, defs = _setup(tmp_path)
    first = _tick(defs, dagster_instance)
    old_key = next(r.partition_key for r in first.run_requests if r.partition_key.startswith("tau-bench"))
    assert run_job(defs, dagster_instance, "log_batch_job", old_key).success  # its run copies the bytes
    _rewrite(landing / "tau-bench" / TAU_BENCH.name, 10)
    second = _tick(defs, dagster_instance, first.cursor)
    assert len(second.run_requests) == 1
    new_key = second.run_requests[0].partition_key
    assert new_key != old_key and new_key.startswith("tau-bench.")
    assert run_job(defs, dagster_instance, "log_batch_job", new_key).success
    # the old batch still has its original bytes, and re-materialises from them
    lake_res = TrajectoryLake(root=str(lake))
    assert lake_res.batch_snapshot(old_key).read_bytes() == TAU_BENCH.read_bytes()
    assert len(json.loads(lake_res.batch_snapshot(new_key).read_bytes())) == 10
    assert run_job(defs, dagster_instance, "log_batch_job", old_key).success
    assert lake_res.read_partition("trajectories", old_key).height == 200


def test_a_file_rewritten_before_its_run_fails_that_run_naming_it(tmp_path, dagster_instance):
    landing, lake, defs = _setup(tmp_path)
    first = _tick(defs, dagster_instance)
    old_key = next(r.partition_key for r in first.run_requests if r.partition_key.startswith("tau-bench"))
    target = landing / "tau-bench" / TAU_BENCH.name
    _rewrite(target, 10)
    tick = execute_requests(defs, dagster_instance, "log_batch_job", TickOutcome(cursor=None, run_requests=[RunRequest(partition_key=old_key)]))
    assert str(target) in tick.failed[old_key] and "changed since it was registered" in tick.failed[old_key]
    # the new bytes are the next tick's batch
    (request,) = _tick(defs, dagster_instance, first.cursor).run_requests
    assert run_job(defs, dagster_instance, "log_batch_job", request.partition_key).success


def test_a_tick_stops_hashing_when_its_budget_is_spent(tmp_path, dagster_instance):
    landing, lake, _ = _setup(tmp_path)
    (landing / "tau-bench" / "copy.json").write_bytes(TAU_BENCH.read_bytes())
    defs = build_definitions(str(lake), str(landing))
    budget = {**defs.resources, "landing": LogLanding(directory=str(landing), tick_budget_seconds=0.0, settle_seconds=0)}
    cursor, per_tick = None, []
    for _ in range(4):
        with build_sensor_context(instance=dagster_instance, cursor=cursor, resources=budget, sensor_name="new_logs_sensor") as ctx:
            result = new_logs_sensor(ctx)
        for request in result.dynamic_partitions_requests or []:
            dagster_instance.add_dynamic_partitions(request.partitions_def_name, list(request.partition_keys))
        cursor = result.cursor
        per_tick.append(len(result.run_requests or []))
    assert per_tick == [1, 1, 1, 0]  # one file per tick at a zero budget, none lost
    assert len(json.loads(cursor)) == 3


def test_tmp_file_is_never_read_until_renamed(tmp_path, dagster_instance):
    landing, _, defs = _setup(tmp_path)
    first = _tick(defs, dagster_instance)
    partial = landing / "tau-bench" / "more.json.tmp"
    partial.write_bytes(TAU_BENCH.read_bytes()[:1000])  # half-written: not valid JSON yet
    (landing / "tau-bench" / ".hidden.json").write_bytes(b"{")
    assert not _tick(defs, dagster_instance, first.cursor).run_requests
    partial.write_text(json.dumps(json.loads(TAU_BENCH.read_bytes())[:3]))
    os.replace(partial, landing / "tau-bench" / "more.json")
    after = _tick(defs, dagster_instance, first.cursor)
    assert [r.partition_key.split(".")[1] for r in after.run_requests] == ["more"]


def test_symbolic_links_in_the_landing_directory_are_never_followed(tmp_path, dagster_instance):
    landing, lake, defs = _setup(tmp_path)
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    shutil.copyfile(TAU_BENCH, outside / "private.json")
    (landing / "tau-bench" / "linked.json").symlink_to(outside / "private.json")
    (landing / "linked-dir").symlink_to(outside, target_is_directory=True)
    result = _tick(defs, dagster_instance)
    assert len(result.run_requests) == 2  # the two real files only
    manifests = TrajectoryLake(root=str(lake)).registered_batches()
    assert not any("elsewhere" in m.original_path or "linked" in m.original_path for m in manifests)


def test_a_file_written_in_place_waits_until_it_has_settled(tmp_path, dagster_instance):
    landing, lake = tmp_path / "landing", tmp_path / "lake"
    (landing / "mine").mkdir(parents=True)
    defs = build_definitions(str(lake), str(landing), settle_seconds=60)
    records = json.loads(TAU_BENCH.read_bytes())
    target = landing / "mine" / "runs.json"
    target.write_text(json.dumps(records[:100])[:-1])  # half-written in place, no .tmp
    first = _tick(defs, dagster_instance)
    assert not first.run_requests and "left for a later tick" in first.skip_reason.skip_message
    target.write_text(json.dumps(records[:150]))  # the writer finishes
    assert not _tick(defs, dagster_instance, first.cursor).run_requests  # modified just now: still waits
    settled = time.time() - 61
    os.utime(target, (settled, settled))
    (request,) = _tick(defs, dagster_instance, first.cursor).run_requests
    assert run_job(defs, dagster_instance, "log_batch_job", request.partition_key).success
    assert TrajectoryLake(root=str(lake)).read_partition("trajectories", request.partition_key).height == 150


def test_a_rewrite_that_keeps_size_and_mtime_is_still_a_new_batch(tmp_path, dagster_instance):
    landing, _, defs = _setup(tmp_path)
    first = _tick(defs, dagster_instance)
    target = landing / "tau-bench" / TAU_BENCH.name
    before = target.stat()
    data = target.read_bytes().replace(b'"reward": 0.0', b'"reward": 1.0', 1)  # same length
    assert len(data) == before.st_size
    target.write_bytes(data)
    os.utime(target, ns=(before.st_atime_ns, before.st_mtime_ns))  # size and mtime as before
    (request,) = _tick(defs, dagster_instance, first.cursor).run_requests
    assert request.partition_key.startswith("tau-bench.") and request.partition_key not in [r.partition_key for r in first.run_requests]


def test_a_file_removed_between_listing_and_hashing_is_skipped_and_the_tick_goes_on(tmp_path, dagster_instance, monkeypatch):
    import sensors.new_logs as module

    landing, lake, defs = _setup(tmp_path)
    listed = module.list_landed

    def list_then_remove(directory, *rest):
        files = listed(directory, *rest)
        (landing / "tau-bench" / TAU_BENCH.name).unlink()  # a writer removes it while the tick runs
        return files

    monkeypatch.setattr(module, "list_landed", list_then_remove)
    result = _tick(defs, dagster_instance)
    (request,) = result.run_requests  # the FireAct file still became its batch
    assert request.partition_key.startswith("fireact.")
    assert TAU_BENCH.name not in (result.cursor or "")  # the vanished file is not remembered: a new file of that name is read


def test_a_hard_link_into_the_landing_directory_is_refused_and_its_file_left_untouched(tmp_path, dagster_instance):
    landing, lake, defs = _setup(tmp_path)
    outside = tmp_path / "elsewhere" / "secret.json"
    outside.parent.mkdir()
    shutil.copyfile(TAU_BENCH, outside)
    before = outside.read_bytes()
    os.link(outside, landing / "tau-bench" / "linked.json")  # the old sensor read it as a log
    with build_sensor_context(instance=dagster_instance, resources=defs.resources, sensor_name="new_logs_sensor") as ctx:
        result = new_logs_sensor(ctx)
    assert len(result.run_requests) == 2  # the two real files only
    manifests = TrajectoryLake(root=str(lake)).registered_batches()
    assert not any("linked" in m.original_path for m in manifests)
    assert outside.read_bytes() == before and (landing / "tau-bench" / "linked.json").exists() and outside.stat().st_nlink == 2
    refused: list = []
    from flow_assets.logs.landing import list_landed

    list_landed(landing, refused)
    assert [(p.name, "hard link" in why) for p, why in refused] == [("linked.json", True)]


def _canonical_lines(n: int) -> list[bytes]:
    from flow_assets.logs.chunks import read_chunks

    with read_chunks(TAU_BENCH) as stream:
        return [r.encode() + b"\n" for chunk in stream for r in chunk.valid["record_json"].to_list()][:n]


def _early_batch(tmp_path, instance, head: bytes):
    """A landing whose file ``agent/runs.jsonl`` holds ``head`` (the start of a log) when the
    sensor first ticks: ``(defs, target file, the early batch's key, the tick)``."""
    landing = tmp_path / "landing"
    (landing / "agent").mkdir(parents=True)
    defs = build_definitions(str(tmp_path / "lake"), str(landing), settle_seconds=0)
    target = landing / "agent" / "runs.jsonl"
    target.write_bytes(head)
    first = _tick(defs, instance)
    (early,) = [r.partition_key for r in first.run_requests]
    return defs, target, early, first


def test_a_file_that_grows_after_its_writer_paused_past_the_settle_time_lands_each_record_once(tmp_path, dagster_instance):
    lake = tmp_path / "lake"
    lines = _canonical_lines(30)
    # the writer pauses mid-line, past the settle time
    defs, target, early, first = _early_batch(tmp_path, dagster_instance, b"".join(lines[:11]) + lines[11][:50])
    assert run_job(defs, dagster_instance, "log_batch_job", early).success
    with target.open("ab") as fh:  # ... and goes on: 19 more records and the rest of the torn one
        fh.write(lines[11][50:] + b"".join(lines[12:]))
    second = _tick(defs, dagster_instance, first.cursor)
    (whole,) = [r.partition_key for r in second.run_requests]
    assert run_job(defs, dagster_instance, "log_batch_job", whole).success
    lake_res = TrajectoryLake(root=str(lake))
    landed = [lake_res.read_partition("trajectories", k) for k in dagster_instance.get_dynamic_partitions(log_batches.name)]
    ids = [t for frame in landed for t in frame["trajectory_id"].to_list()]
    # before: both batches stayed, the first 11 records twice (the attack saw 19 duplicates)
    assert len(ids) == 30 and len(set(ids)) == 30
    assert dagster_instance.get_dynamic_partitions(log_batches.name) == [whole]
    assert [m.key for m in lake_res.registered_batches()] == [whole]


def test_a_grown_file_waits_while_the_run_of_its_early_batch_is_unfinished(tmp_path, dagster_instance):
    from dagster import DagsterRun, DagsterRunStatus

    lines = _canonical_lines(4)
    defs, target, early, first = _early_batch(tmp_path, dagster_instance, b"".join(lines[:2]))
    run = dagster_instance.add_run(DagsterRun(job_name="log_batch_job", run_id="0" * 36, tags={"dagster/partition": early},
                                              status=DagsterRunStatus.STARTED))  # fmt: skip
    with target.open("ab") as fh:
        fh.write(b"".join(lines[2:]))
    waiting = _tick(defs, dagster_instance, first.cursor)
    assert not waiting.run_requests and early in dagster_instance.get_dynamic_partitions(log_batches.name)
    dagster_instance.report_run_failed(run)
    (request,) = _tick(defs, dagster_instance, waiting.cursor).run_requests
    assert dagster_instance.get_dynamic_partitions(log_batches.name) == [request.partition_key]
