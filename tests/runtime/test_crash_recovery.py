"""Crash recovery: a real ``flowopt ingest`` killed with SIGKILL while it writes the lake, then run
again, leaves exactly the batch's records, once; the dead run is marked failed and no temporary
file stays behind. Also: concurrent first ingests on a new instance, and the sensor re-running a
batch whose run died."""

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from dagster import DagsterInstance, DagsterRunStatus, RunsFilter

from benchmarks.data_plane import real_records, write_replicated
from flow_assets.definitions import build_definitions
from flow_assets.runtime.local import execute_requests, tick_sensor
from flow_assets.runtime.recovery import DIED_TAG
from resources.lake import TrajectoryLake
from tests.conftest import SHARED_DATA, TAU_BENCH

FLOWOPT = str(Path(sys.executable).with_name("flowopt"))


@pytest.fixture(scope="module")
def big_log(tmp_path_factory):
    """Canonical JSONL of the real logs replicated to 300k steps (~180 MB): its run writes long
    enough to be killed mid-table."""
    path = tmp_path_factory.mktemp("big") / "fleet.jsonl"
    written = write_replicated(real_records(SHARED_DATA), 300_000, path)
    return path, written["trajectories"]


def _cmd(tmp_path, *paths):
    return [FLOWOPT, "ingest", *map(str, paths), "--landing", str(tmp_path / "landing"), "--lake", str(tmp_path / "lake"),
            "--home", str(tmp_path / "home")]  # fmt: skip


def _kill_while_writing(tmp_path, path, table: str) -> None:
    proc = subprocess.Popen(_cmd(tmp_path, path), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    partition_dirs = tmp_path / "lake" / table
    deadline = time.monotonic() + 600
    while not any(partition_dirs.glob("batch=*/.data.*.parquet.tmp")):
        assert proc.poll() is None, f"ingest finished before {table} was seen being written"
        assert time.monotonic() < deadline
        time.sleep(0.005)
    proc.send_signal(signal.SIGKILL)
    proc.wait()


@pytest.mark.parametrize("table, rerun_by", [("interaction_logs", "ingest"), ("trajectories", "ingest"), ("trajectories", "sensor")])
def test_an_ingest_killed_mid_batch_runs_again_and_leaves_exactly_the_batch(tmp_path, big_log, table, rerun_by):
    path, n_trajectories = big_log
    _kill_while_writing(tmp_path, path, table)
    lake = TrajectoryLake(root=str(tmp_path / "lake"))
    assert list((tmp_path / "lake").rglob("*.tmp"))  # the dead writer's half file is there
    if rerun_by == "ingest":
        done = subprocess.run(_cmd(tmp_path, path), capture_output=True, text=True, timeout=900)
        assert done.returncode == 0, done.stderr[-3000:]
        (row,) = json.loads(done.stdout)["files"]
        assert row["status"] == "ingested" and row["trajectories"] == n_trajectories
        key = row["partition_key"]
        instance = DagsterInstance.local_temp(str(tmp_path / "home"))
    else:  # the deployment's way: the next sensor tick finds the dead run and requests its batch again
        instance = DagsterInstance.local_temp(str(tmp_path / "home"))
        defs = build_definitions(str(tmp_path / "lake"), str(tmp_path / "landing"))
        tick = tick_sensor(defs, instance, "new_logs_sensor")
        (request,) = tick.run_requests
        assert request.run_key.startswith(f"{request.partition_key}:after-")
        key = request.partition_key
        assert execute_requests(defs, instance, "log_batch_job", tick).succeeded == [key]
        # a later tick (cursor lost or not) asks for nothing more
        assert not tick_sensor(defs, instance, "new_logs_sensor", tick.cursor).run_requests
    ids = lake.read_partition("trajectories", key)["trajectory_id"]
    assert ids.len() == n_trajectories and ids.n_unique() == n_trajectories  # the batch, once
    steps = lake.read_partition("steps", key)
    assert steps.height == steps.select("trajectory_id", "index").unique().height
    assert not list((tmp_path / "lake").rglob("*.tmp"))
    runs = instance.get_runs(RunsFilter(job_name="log_batch_job"))
    assert sorted(r.status.value for r in runs) == ["FAILURE", "SUCCESS"]
    dead = next(r for r in runs if r.status == DagsterRunStatus.FAILURE)
    assert dead.tags.get(DIED_TAG) == "true"


def test_concurrent_first_ingests_share_one_new_instance(tmp_path):
    tau2 = sorted((SHARED_DATA / "tau2-bench").rglob("*.json"))[:2]
    same = [TAU_BENCH, TAU_BENCH, *tau2]
    procs = [subprocess.Popen(_cmd(tmp_path, f), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for f in same]
    outs = [p.communicate(timeout=900) for p in procs]
    codes = [p.returncode for p in procs]
    # the same bytes: ingested by one, waited for or found already ingested (4) by the other
    assert codes[2:] == [0, 0] and sorted(codes[:2]) in ([0, 0], [0, 4]), [e[-2000:] for _, e in outs]
    rows = [json.loads(out)["files"][0] for out, _ in outs]
    # every process reports its own file's figures, whichever of them ran the batch
    assert rows[0]["partition_key"] == rows[1]["partition_key"] and rows[0]["trajectories"] == rows[1]["trajectories"] == 200
    assert all(r["trajectories"] > 0 for r in rows)
    instance = DagsterInstance.local_temp(str(tmp_path / "home"))
    tau_runs = instance.get_runs(RunsFilter(job_name="log_batch_job", tags={"dagster/partition": rows[0]["partition_key"]}))
    assert [r.status for r in tau_runs] == [DagsterRunStatus.SUCCESS]  # the same bytes ran once
    lake = TrajectoryLake(root=str(tmp_path / "lake"))
    assert lake.read_partition("trajectories", rows[0]["partition_key"]).height == 200


POOL_OWNER = """
import sys, time
from flow_assets.logs.chunks import ordered_map
if __name__ == "__main__":
    for _ in ordered_map(time.sleep, [600.0] * 8, int(sys.argv[1])):  # workers busy, as in a long parse
        pass
"""


def test_a_parse_pool_dies_with_its_owner_killed_by_sigkill(tmp_path):
    import psutil

    script = tmp_path / "owner.py"
    script.write_text(POOL_OWNER)
    owner = subprocess.Popen([sys.executable, str(script), "2"], cwd=Path(__file__).parents[2])
    family: list = []
    try:
        deadline = time.monotonic() + 120
        while True:  # the fork server and its two workers share the fork server's command line
            family = psutil.Process(owner.pid).children(recursive=True)
            forked = [p for p in family if "forkserver" in " ".join(p.cmdline())]
            if len(forked) >= 3:
                break
            assert owner.poll() is None and time.monotonic() < deadline, "the pool never started"
            time.sleep(0.05)
        owner.send_signal(signal.SIGKILL)
        owner.wait()
        # before: the workers blocked on their queue for good (found alive 41 minutes later)
        _, alive = psutil.wait_procs(family, timeout=60)
        assert alive == [], [p.cmdline() for p in alive]
    finally:
        owner.kill()
        for p in family:  # left only when the test failed: the processes it started, by pid
            try:
                p.kill()
            except psutil.NoSuchProcess:
                pass
