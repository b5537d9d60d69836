"""The data plane on a Dagster instance stored in a real PostgreSQL server (dagster-postgres).

Uses the PostgreSQL on 127.0.0.1:5432 (trust auth) with a database created for this test and
dropped afterwards; skipped with a clear reason where no server answers.
"""

import shutil

import psycopg2
import pytest
from dagster import AssetKey, instance_for_test

from flow_assets.definitions import build_definitions
from flow_assets.runtime.local import execute_requests, tick_sensor
from flow_assets.core.partitions import log_batches
from resources.lake import TrajectoryLake
from tests.conftest import PG_HOST as HOST, PG_PORT as PORT, PG_USER as USER, TAU_BENCH, postgres_database


@pytest.fixture
def postgres_db():
    with postgres_database() as db:
        yield db


def test_sensor_runs_and_partitions_live_in_postgres(tmp_path, postgres_db):
    storage = {"postgres": {"postgres_db": postgres_db}}
    landing, lake_root = tmp_path / "landing", tmp_path / "lake"
    (landing / "tau-bench").mkdir(parents=True)
    shutil.copyfile(TAU_BENCH, landing / "tau-bench" / TAU_BENCH.name)
    (tmp_path / "home").mkdir()
    with instance_for_test(temp_dir=str(tmp_path / "home"), overrides={"storage": storage}) as instance:
        assert type(instance.run_storage).__name__ == "PostgresRunStorage"
        defs = build_definitions(str(lake_root), str(landing))
        tick = execute_requests(defs, instance, "log_batch_job", tick_sensor(defs, instance, "new_logs_sensor"))
        (key,) = tick.succeeded
        assert instance.get_dynamic_partitions(log_batches.name) == [key]
        assert instance.get_materialized_partitions(AssetKey("advantages")) == {key}
        assert TrajectoryLake(root=str(lake_root)).read_partition("trajectories", key).height == 200
    # the rows are in the server, not in a local file: a new connection sees them
    with psycopg2.connect(host=HOST, port=PORT, user=USER, dbname=postgres_db["db_name"]) as conn, conn.cursor() as cur:
        cur.execute("select count(*) from runs")
        assert cur.fetchone()[0] == 1
        cur.execute("select partition from dynamic_partitions")
        assert [r[0] for r in cur.fetchall()] == [key]


def test_concurrent_ingests_on_a_new_postgres_instance(tmp_path, postgres_db):
    import json
    import subprocess
    import sys
    from pathlib import Path

    import yaml
    from dagster import DagsterInstance, RunsFilter

    from tests.conftest import SHARED_DATA

    home = tmp_path / "home"
    home.mkdir()
    (home / "dagster.yaml").write_text(yaml.safe_dump({"storage": {"postgres": {"postgres_db": postgres_db}}, "telemetry": {"enabled": False}}))
    tau2 = sorted((SHARED_DATA / "tau2-bench").rglob("*.json"))[0]
    flowopt = str(Path(sys.executable).with_name("flowopt"))
    cmds = [[flowopt, "ingest", str(f), "--landing", str(tmp_path / "landing"), "--lake", str(tmp_path / "lake"), "--home", str(home)]
            for f in (TAU_BENCH, TAU_BENCH, tau2)]  # fmt: skip
    procs = [subprocess.Popen(c, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for c in cmds]
    outs = [p.communicate(timeout=900) for p in procs]
    codes = [p.returncode for p in procs]
    assert codes[2] == 0 and sorted(codes[:2]) in ([0, 0], [0, 4]), [e[-2000:] for _, e in outs]
    rows = [json.loads(out)["files"][0] for out, _ in outs]
    assert rows[0]["trajectories"] == rows[1]["trajectories"] == 200 and rows[2]["trajectories"] > 0
    instance = DagsterInstance.from_config(str(home))
    assert type(instance.run_storage).__name__ == "PostgresRunStorage"
    same = instance.get_runs(RunsFilter(job_name="log_batch_job", tags={"dagster/partition": rows[0]["partition_key"]}))
    assert [r.status.value for r in same] == ["SUCCESS"]  # the same bytes ran once
    instance.dispose()
