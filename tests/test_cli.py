"""`flowopt ingest` end to end: the console script, a real instance, a JSON summary on stdout."""

import json
import subprocess
import sys
from pathlib import Path

from dagster import DagsterInstance

from flow_assets.logs.reader import parse_file
from flow_assets.partitions import log_batches
from tests.conftest import SHARED_DATA, TAU_BENCH

FLOWOPT = str(Path(sys.executable).with_name("flowopt"))


def _ingest(tmp_path, *paths, extra=()):
    cmd = [FLOWOPT, "ingest", *map(str, paths), "--landing", str(tmp_path / "landing"), "--lake", str(tmp_path / "lake"),
           "--home", str(tmp_path / "home"), *extra]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    return done.returncode, done.stdout, done.stderr


def test_ingest_prints_a_summary_per_file_and_registers_partitions(tmp_path):
    # a canonical JSONL made from real tau2 trajectories, with one line broken on purpose
    tau2 = SHARED_DATA / "tau2-bench" / "button-claude-opus-4-6_distyl-ai_2026-03-04" / "airline.json"
    lines = [rec.trajectory.model_dump_json() for rec in parse_file(tau2).valid[:12]]
    lines[5] = lines[5].replace('"task_id"', '"task_idx"', 1)
    jsonl = tmp_path / "button.jsonl"
    jsonl.write_text("\n".join(lines) + "\n")
    rc, out, err = _ingest(tmp_path, TAU_BENCH, jsonl)
    assert rc == 0, err[-3000:]
    report = json.loads(out)
    by_file = {Path(f["file"]).name: f for f in report["files"]}
    tau = by_file[TAU_BENCH.name]
    assert tau["partition_key"].startswith("tau-bench.gpt-4o-airline.")
    assert (tau["trajectories"], tau["groups"], tau["quarantined"]) == (200, 50, 0)
    assert tau["steps"] == sum(len(r.trajectory.steps) for r in parse_file(TAU_BENCH).valid)
    assert 0 < tau["groups_nonzero_advantage"] <= 50
    assert isinstance(tau["mean_reward"], float)
    broken = by_file["button.jsonl"]
    assert (broken["trajectories"], broken["quarantined"]) == (11, 1)
    instance = DagsterInstance.local_temp(str(tmp_path / "home"))
    assert sorted(instance.get_dynamic_partitions(log_batches.name)) == sorted(f["partition_key"] for f in report["files"])


def test_ingesting_the_same_bytes_twice_adds_no_batch(tmp_path):
    first = json.loads(_ingest(tmp_path, TAU_BENCH)[1])
    rc, out, _ = _ingest(tmp_path, TAU_BENCH)
    assert rc == 0
    second = json.loads(out)
    assert second["files"][0]["partition_key"] == first["files"][0]["partition_key"]
    assert second["files"][0]["trajectories"] == 200
    instance = DagsterInstance.local_temp(str(tmp_path / "home"))
    assert len(instance.get_dynamic_partitions(log_batches.name)) == 1
    assert len(instance.get_runs()) == 1


def test_ingest_of_an_unreadable_file_fails_with_its_name(tmp_path):
    bad = tmp_path / "cut.json"
    bad.write_bytes(TAU_BENCH.read_bytes()[:4000])
    rc, out, _ = _ingest(tmp_path, bad, TAU_BENCH)
    assert rc == 1
    files = {Path(f["file"]).name: f for f in json.loads(out)["files"]}
    assert "cut.json" in files["cut.json"]["error"]
    assert files[TAU_BENCH.name]["trajectories"] == 200


def test_wrong_explicit_format_fails_that_file_with_a_clear_error(tmp_path):
    rc, out, _ = _ingest(tmp_path, TAU_BENCH, extra=("--format", "fireact"))
    assert rc == 1
    (row,) = json.loads(out)["files"]
    assert "expected a JSON object keyed by question id" in row["error"]
    assert TAU_BENCH.name in row["error"]


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
