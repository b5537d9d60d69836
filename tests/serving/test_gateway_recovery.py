"""A gateway killed with SIGKILL loses none of its open batch (issue #25): the next gateway to
start on the landing directory lands every finished rollout exactly once, and a torn last line
reaches the data plane's quarantine with its reason. Real `flowopt serve` process, real SIGKILL."""

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

from flow_assets.serving.gateway.landing import BatchLander
from flow_assets.serving.gateway.serve import serve_policy
from flow_assets.logs.reader import parse_file
from flow_assets.logs.schema import Outcome, Trajectory
from flow_assets.policy.store import PolicyStore

FLOWOPT = str(Path(sys.executable).with_name("flowopt"))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_healthy(url: str, process: subprocess.Popen, headers: dict) -> None:
    deadline = time.monotonic() + 180
    while True:
        try:
            if httpx.get(url + "/health", headers=headers).status_code == 200:
                return
        except httpx.TransportError:
            pass
        assert process.poll() is None, process.stdout.read()
        assert time.monotonic() < deadline, "flowopt serve did not start"
        time.sleep(0.2)


def _landed(landing: Path):
    """Valid trajectory ids and quarantined records of every landed file, read by the data plane's reader."""
    ids, quarantined = [], []
    for path in sorted(landing.rglob("*.jsonl")):
        parsed = parse_file(path)
        ids += [v.trajectory.trajectory_id for v in parsed.valid]
        quarantined += parsed.quarantined
    return ids, quarantined


def test_sigkill_mid_batch_then_restart_lands_every_finished_rollout_exactly_once(fresh_policy_dir, tmp_path):
    landing, port = tmp_path / "landing", _free_port()
    url, auth = f"http://127.0.0.1:{port}", {"Authorization": "Bearer tok"}
    server = subprocess.Popen(
        [FLOWOPT, "serve", "--models", str(fresh_policy_dir), "--landing", str(landing), "--port", str(port), "--max-tokens", "2"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
        env={**os.environ, "FLOWOPT_GATEWAY_TOKENS": "tok"},  # the child's environment only
    )  # fmt: skip
    finished = []
    try:
        _wait_healthy(url, server, auth)
        with httpx.Client(base_url=url, headers=auth, timeout=120) as client:
            assert httpx.get(url + "/metrics").status_code == 401  # the tokens of the environment are asked for
            specs = [{"rollout_id": f"b1-{i}", "task_id": f"t{i % 5}", "batch": "b1", "source": "s"} for i in range(24)]
            specs += [{"rollout_id": f"b0-{i}", "task_id": "t", "batch": "b0", "source": "s"} for i in range(3)]
            specs += [{"rollout_id": f"roll-{i}", "task_id": "t"} for i in range(6)]  # the rolling batch
            specs += [{"rollout_id": "never-finished", "task_id": "t", "batch": "b1", "source": "s"}]
            assert len(client.post("/rollouts", json=specs).json()["ids"]) == len(specs)
            for spec in specs[:-1]:
                rid = spec["rollout_id"]
                if rid in ("b1-0", "roll-0"):  # two with a model call; the rest finish without one
                    chat = {"model": "policy", "messages": [{"role": "user", "content": "hi"}]}
                    assert client.post(f"/rollouts/{rid}/v1/chat/completions", json=chat).status_code == 200
                assert client.post(f"/rollouts/{rid}/finish", json={"success": True, "score": 1.0}).status_code == 200
                finished.append(rid)
            assert client.post("/batches/b0/close").json()["trajectories"] == 3  # landed before the kill: not twice
    finally:
        os.killpg(server.pid, signal.SIGKILL)
        server.communicate(timeout=60)
    open_files = sorted(p.relative_to(landing).as_posix() for p in landing.rglob("*.jsonl.tmp"))
    assert open_files[-1] == "s/b1.jsonl.tmp" and len(open_files) == 2  # b1 and the rolling batch were open
    # as if the kill had landed inside a write: a torn last line
    with open(landing / "s" / "b1.jsonl.tmp", "ab") as fh:
        fh.write(b'{"trajectory_id": "torn", "task_id": "t", "ste')

    with serve_policy(PolicyStore(str(fresh_policy_dir)), landing) as restarted:
        recovered = httpx.get(restarted.url + "/health").json()["recovered_batches"]
        assert sorted(r["batch"] for r in recovered)[-1] == "s/b1.jsonl"
        assert sum(r["rollouts"] for r in recovered) == 24 + 6 and sum(r["torn_bytes"] for r in recovered) > 0
        # the batch goes on after the restart: its later rollouts land beside, nothing overwritten
        httpx.post(restarted.url + "/rollouts", json={"rollout_id": "after", "task_id": "t", "batch": "b1", "source": "s"})
        httpx.post(restarted.url + "/rollouts/after/finish", json={"success": False})
    assert not list(landing.rglob("*.tmp")) and not list(landing.rglob(".*"))
    ids, quarantined = _landed(landing)
    assert sorted(ids) == sorted(finished + ["after"])  # every finished rollout, exactly once
    (torn,) = quarantined
    assert torn.reason.startswith("invalid JSON") and torn.raw == b'{"trajectory_id": "torn", "task_id": "t", "ste'


def _trajectory(tid: str) -> Trajectory:
    return Trajectory(trajectory_id=tid, task_id="t", agent_id="a", query="q", steps=[], outcome=Outcome(success=True, score=1.0))


def test_a_live_gateways_open_batch_is_never_taken_for_an_orphan(tmp_path):
    live = BatchLander(tmp_path)
    live.add(_trajectory("x1"), "b", "s")
    other = BatchLander(tmp_path)  # a second gateway starting on the same landing directory
    assert other.recover() == [] and (tmp_path / "s" / "b.jsonl.tmp").exists()
    live.add(_trajectory("x2"), "b", "s")
    assert [t.trajectory_id for t in map(Trajectory.model_validate_json, live.close("b").read_text().splitlines())] == ["x1", "x2"]
    # a dead gateway's leftovers: an unlocked batch file, an empty one, a hidden half-opened one
    (tmp_path / "s" / "dead.jsonl.tmp").write_text(_trajectory("d1").model_dump_json() + "\n")
    (tmp_path / "s" / "empty.jsonl.tmp").write_text("")
    (tmp_path / "s" / ".z.jsonl.tmp.123-abc.opening").write_text("")
    (tmp_path / "s" / "dead.jsonl").write_text("")  # a landed file of that name is never overwritten
    (found,) = other.recover()
    assert (found.path.name, found.rollouts, found.torn_bytes) == ("dead-1.jsonl", 1, 0)
    assert sorted(p.name for p in (tmp_path / "s").iterdir()) == ["b.jsonl", "dead-1.jsonl", "dead.jsonl"]
