"""`flowopt ingest` end to end: the console script, a real instance, a JSON summary on stdout."""

import json
import os
import subprocess
import sys
from pathlib import Path

from dagster import DagsterInstance

from flow_assets.logs.reader import parse_file
from flow_assets.core.partitions import log_batches
from resources.lake import TrajectoryLake
from tests.conftest import SHARED_DATA, TAU_BENCH, run_cli

FLOWOPT = str(Path(sys.executable).with_name("flowopt"))


def _ingest(tmp_path, *paths, extra=(), console_script=False):
    """``flowopt ingest``: in this process (the CLI's own ``main``), or through the installed
    console script as a user runs it (``console_script``; the first test does, once)."""
    args = ["ingest", *map(str, paths), "--landing", str(tmp_path / "landing"), "--lake", str(tmp_path / "lake"),
            "--home", str(tmp_path / "home"), *extra]  # fmt: skip
    if not console_script:
        return run_cli(args)
    done = subprocess.run([FLOWOPT, *args], capture_output=True, text=True, timeout=300)
    return done.returncode, done.stdout, done.stderr


def test_ingest_prints_a_summary_per_file_and_registers_partitions(tmp_path):
    # a canonical JSONL made from real tau2 trajectories, with one line broken on purpose
    tau2 = SHARED_DATA / "tau2-bench" / "button-claude-opus-4-6_distyl-ai_2026-03-04" / "airline.json"
    lines = [rec.trajectory.model_dump_json() for rec in parse_file(tau2).valid[:12]]
    lines[5] = lines[5].replace('"task_id"', '"task_idx"', 1)
    jsonl = tmp_path / "button.jsonl"
    jsonl.write_text("\n".join(lines) + "\n")
    rc, out, err = _ingest(tmp_path, TAU_BENCH, jsonl, console_script=True)
    assert rc == 0, err[-3000:]
    report = json.loads(out)
    by_file = {Path(f["file"]).name: f for f in report["files"]}
    tau = by_file[TAU_BENCH.name]
    assert tau["partition_key"].startswith("tau-bench.gpt-4o-airline.")
    assert (tau["trajectories"], tau["groups"], tau["quarantined"]) == (200, 50, 0)
    assert tau["steps"] == sum(len(r.trajectory.steps) for r in parse_file(TAU_BENCH).valid)
    assert tau["status"] == "ingested" and "message" not in tau
    assert 0 < tau["groups_with_signal"] <= 50
    # tau-bench: 84 of 200 succeed; the default shaping adds +0.1 per successful tool call
    assert tau["mean_outcome"] == 0.42 and tau["mean_shaped_reward"] > tau["mean_outcome"]
    broken = by_file["button.jsonl"]
    assert (broken["trajectories"], broken["quarantined"]) == (11, 1)
    instance = DagsterInstance.local_temp(str(tmp_path / "home"))
    assert sorted(instance.get_dynamic_partitions(log_batches.name)) == sorted(f["partition_key"] for f in report["files"])


def test_ingesting_the_same_bytes_twice_adds_no_batch_and_says_so(tmp_path):
    first = json.loads(_ingest(tmp_path, TAU_BENCH)[1])
    rc, out, err = _ingest(tmp_path, TAU_BENCH)
    assert rc == 4
    (row,) = json.loads(out)["files"]
    assert row["partition_key"] == first["files"][0]["partition_key"]
    assert row["status"] == "already_ingested" and row["partition_key"] in row["message"] and "--force" in row["message"]
    assert row["trajectories"] == 200  # the figures of the batch that holds these bytes
    assert "already ingested" in err and str(TAU_BENCH) in err
    instance = DagsterInstance.local_temp(str(tmp_path / "home"))
    assert len(instance.get_dynamic_partitions(log_batches.name)) == 1
    assert len(instance.get_runs()) == 1
    rc, out, _ = _ingest(tmp_path, TAU_BENCH, extra=("--force",))
    assert rc == 0 and json.loads(out)["files"][0]["trajectories"] == 200
    assert len(DagsterInstance.local_temp(str(tmp_path / "home")).get_runs()) == 2


def test_ingest_of_an_unreadable_file_fails_with_its_own_name(tmp_path):
    bad = tmp_path / "cut.json"
    bad.write_bytes(TAU_BENCH.read_bytes()[:4000])
    rc, out, err = _ingest(tmp_path, bad, TAU_BENCH)
    assert rc == 1
    files = {Path(f["file"]).name: f for f in json.loads(out)["files"]}
    assert files["cut.json"]["status"] == "failed"
    assert str(bad) in files["cut.json"]["message"] and "_batches" not in files["cut.json"]["message"]
    assert "flowopt schema" in files["cut.json"]["message"]
    assert files[TAU_BENCH.name]["trajectories"] == 200
    assert "Traceback" not in err and len(err.splitlines()) == 1  # one line for the one bad file


def test_a_failed_ingest_runs_again_with_the_right_format(tmp_path):
    rc, out, _ = _ingest(tmp_path, TAU_BENCH, extra=("--format", "fireact"))
    assert rc == 1
    (row,) = json.loads(out)["files"]
    assert "expected a JSON object keyed by question id" in row["message"]
    assert str(TAU_BENCH) in row["message"]
    # the same bytes again, now detected: the batch that failed runs, it is not "already there"
    rc, out, err = _ingest(tmp_path, TAU_BENCH)
    assert rc == 0, err[-2000:]
    (row,) = json.loads(out)["files"]
    assert (row["status"], row["trajectories"]) == ("ingested", 200)


def test_a_file_whose_every_record_is_quarantined_is_not_a_success(tmp_path):
    # a pretty-printed JSON document read as JSONL: every line is a bad record
    rc, out, err = _ingest(tmp_path, TAU_BENCH, extra=("--format", "flat"))
    assert rc == 3
    (row,) = json.loads(out)["files"]
    assert row["status"] == "all_quarantined"
    assert row["trajectories"] == 0 and row["quarantined"] == sum(1 for line in TAU_BENCH.read_text().splitlines() if line.strip())
    assert f"every record ({row['quarantined']}) was quarantined" in row["message"]
    assert row["mean_outcome"] is None and row["groups"] == 0
    assert "all quarantined" in err


def test_ingest_takes_exactly_the_named_files_and_checks_them_all_first(tmp_path):
    landing = tmp_path / "landing"
    leftover = landing / "old" / "leftover.json"
    leftover.parent.mkdir(parents=True)
    leftover.write_bytes(TAU_BENCH.read_bytes())
    rc, _, err = _ingest(tmp_path, TAU_BENCH, tmp_path / "missing.jsonl")
    assert rc == 2
    assert "missing.jsonl: no such file" in err and "nothing was ingested" in err
    assert not (landing / "tau-bench").exists() and not (tmp_path / "home").exists()
    tau2 = SHARED_DATA / "tau2-bench" / "button-claude-opus-4-6_distyl-ai_2026-03-04" / "airline.json"
    rc, out, err = _ingest(tmp_path, tau2)
    assert rc == 0, err[-2000:]
    (row,) = json.loads(out)["files"]
    instance = DagsterInstance.local_temp(str(tmp_path / "home"))
    assert instance.get_dynamic_partitions(log_batches.name) == [row["partition_key"]]  # the leftover is not run


def test_a_directory_argument_ingests_its_log_files(tmp_path):
    logs = tmp_path / "my-agent"
    (logs / "day2").mkdir(parents=True)
    (logs / "a.json").write_bytes(TAU_BENCH.read_bytes())
    tau2 = SHARED_DATA / "tau2-bench" / "button-claude-opus-4-6_distyl-ai_2026-03-04" / "airline.json"
    (logs / "day2" / "b.json").write_bytes(tau2.read_bytes())
    (logs / "c.json.tmp").write_text("half written")
    rc, out, err = _ingest(tmp_path, logs)
    assert rc == 0, err[-2000:]
    rows = json.loads(out)["files"]
    assert [Path(r["file"]).name for r in rows] == ["a.json", "b.json"]
    assert all(r["source"] == "my-agent" for r in rows)
    assert (tmp_path / "landing" / "my-agent" / "day2" / "b.json").is_file()


def test_a_corrected_file_under_the_same_name_keeps_or_replaces_the_old_batch(tmp_path):
    tau2 = SHARED_DATA / "tau2-bench" / "button-claude-opus-4-6_distyl-ai_2026-03-04" / "airline.json"
    lines = [rec.trajectory.model_dump_json() for rec in parse_file(tau2).valid[:12]]
    log = tmp_path / "run.jsonl"
    log.write_text("\n".join(lines[:8]) + "\n")
    old = json.loads(_ingest(tmp_path, log)[1])["files"][0]["partition_key"]
    log.write_text("\n".join(lines) + "\n")  # the corrected file: the same ids and four more
    rc, out, _ = _ingest(tmp_path, log)
    (row,) = json.loads(out)["files"]
    second = row["partition_key"]
    assert rc == 0 and second != old
    assert old in row["message"] and "--replace" in row["message"]
    lake = TrajectoryLake(root=str(tmp_path / "lake"))
    assert lake.scan("trajectories").collect().height == 8 + 12
    log.write_text("\n".join(lines[1:]) + "\n")
    rc, out, _ = _ingest(tmp_path, log, extra=("--replace",))
    (row,) = json.loads(out)["files"]
    assert rc == 0 and sorted(row["replaced"]) == sorted([old, second])
    assert DagsterInstance.local_temp(str(tmp_path / "home")).get_dynamic_partitions(log_batches.name) == [row["partition_key"]]
    ids = lake.scan("trajectories").select("trajectory_id").collect()["trajectory_id"]
    assert ids.len() == 11 and ids.n_unique() == 11
    assert [m.key for m in lake.registered_batches()] == [row["partition_key"]]


def test_a_single_trial_file_says_why_it_has_no_groups(tmp_path):
    single = SHARED_DATA / "tau2-bench" / "toolorchestra_nvidia_2025-12-02" / "toolorchestra_airline_gpt-5_1trial.json"
    rc, out, err = _ingest(tmp_path, single)
    assert rc == 0, err[-2000:]
    (row,) = json.loads(out)["files"]
    assert row["groups"] == row["trajectories"] > 0 and row["groups_with_signal"] == 0
    assert "group_scope=source" in row["hint"]


def test_ingest_uses_the_lake_and_landing_of_the_code_location_settings(tmp_path):
    env = {**os.environ, "FLOWOPT_LAKE": str(tmp_path / "env-lake"), "FLOWOPT_LANDING": str(tmp_path / "env-landing")}
    cwd = tmp_path / "elsewhere"
    cwd.mkdir()
    done = subprocess.run([FLOWOPT, "ingest", str(TAU_BENCH), "--home", str(tmp_path / "home")], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    assert json.loads(done.stdout)["lake"] == str(tmp_path / "env-lake")
    assert TrajectoryLake(root=str(tmp_path / "env-lake")).batches("trajectories")
    assert (tmp_path / "env-landing" / "tau-bench" / TAU_BENCH.name).is_file()
    assert not (cwd / ".lake").exists() and not (cwd / ".landing").exists()


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_serve_starts_the_gateway_alone_and_lands_what_it_captured_on_shutdown(fresh_policy_dir, tmp_path):
    import signal
    import time

    import httpx
    import openai

    from flow_assets.logs.schema import Trajectory

    port = _free_port()
    landing = tmp_path / "landing"
    server = subprocess.Popen(
        [FLOWOPT, "serve", "--models", str(fresh_policy_dir), "--landing", str(landing), "--port", str(port), "--max-tokens", "4"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health").status_code == 200:
                    break
            except httpx.TransportError:
                assert server.poll() is None and time.monotonic() < deadline, server.stdout.read() if server.poll() is not None else "timeout"
                time.sleep(0.2)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="-", default_headers={"X-Agent-ID": "mine-1"})
        reply = client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "hello"}])
        assert reply.system_fingerprint == "v0" and reply.usage.completion_tokens <= 4
        done = httpx.post(f"http://127.0.0.1:{port}/rollouts/mine-1/finish", json={"task_id": "t1", "agent_id": "mine", "success": False})
        assert done.json()["llm_calls"] == 1
    finally:
        server.send_signal(signal.SIGINT)
        out, _ = server.communicate(timeout=60)
    assert "flowopt gateway: http://127.0.0.1:" in out
    (path,) = (landing / "gateway").glob("*.jsonl")
    (trajectory,) = [Trajectory.model_validate_json(line) for line in path.read_text().splitlines()]
    assert (trajectory.trajectory_id, trajectory.agent_id, trajectory.task_id) == ("mine-1", "mine", "t1")


def test_serve_explains_a_missing_policy(tmp_path):
    done = subprocess.run([FLOWOPT, "serve", "--models", str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "no base model" in done.stderr


LAND_ONE = """
import sys
from pathlib import Path
from flow_assets.logs.ingest import IngestFile, land
land(IngestFile(Path(sys.argv[1]), "agent", "big.jsonl"), Path(sys.argv[2]))
"""


def test_a_copy_killed_midway_leaves_a_temporary_that_the_next_ingest_removes(tmp_path):
    import signal
    import time

    from flow_assets.logs.landing import remove_stale_temporaries

    landing = tmp_path / "landing"
    source = tmp_path / "source.jsonl"
    os.mkfifo(source)  # a source that never ends: the copy is still running when it is killed
    copier = subprocess.Popen([sys.executable, "-c", LAND_ONE, str(source), str(landing)], cwd=Path(__file__).parents[2])
    try:
        deadline = time.monotonic() + 120
        while not list((landing / "agent").glob(".*.tmp")) if (landing / "agent").is_dir() else True:
            assert copier.poll() is None and time.monotonic() < deadline, "the copy never started"
            time.sleep(0.02)
        (tmp,) = (landing / "agent").glob(".*.tmp")
        old = time.time() - 3600
        os.utime(tmp, (old, old))
        assert remove_stale_temporaries(landing) == [] and tmp.exists()  # a live copy holds its lock
        copier.send_signal(signal.SIGKILL)
        copier.wait()
    finally:
        copier.kill()
        copier.wait()
    foreign = landing / "agent" / ".writer.jsonl.tmp"  # another writer's temporary: never touched
    foreign.write_text("{}")
    os.utime(foreign, (old, old))
    small = tmp_path / "agent" / "small.jsonl"  # the next ingest, of any file
    small.parent.mkdir()
    small.write_text("".join(r.trajectory.model_dump_json() + "\n" for r in parse_file(TAU_BENCH).valid[:2]))
    rc, _, err = _ingest(tmp_path, small)
    assert rc == 0, err[-2000:]
    assert not tmp.exists() and foreign.exists()  # before: the dead copy's .tmp stayed for good
