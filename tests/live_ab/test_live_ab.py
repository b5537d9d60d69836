"""Live A/B plumbing: the registry's challenger and the gateway's traffic split by session, over
real HTTP on the real tiny model."""

import shutil
from datetime import datetime, timezone
import time

import httpx
import numpy as np
import pytest

from flow_assets.serving.gateway.engine import in_challenger_share
from flow_assets.serving.gateway.serve import serve_policy
from flow_assets.logs.schema import Trajectory
from flow_assets.policy.store import PolicyStore
from resources.registry import AdapterRegistry, RegistryError


def _registry_with_v1(tmp_path) -> AdapterRegistry:
    registry = AdapterRegistry(root=str(tmp_path / "models"))
    for version in ("v0", "v1", "v2"):
        (tmp_path / "models" / version).mkdir(parents=True)
        # what PEFT writes: rollback and promotion refuse a directory without these
        (tmp_path / "models" / version / "adapter_config.json").write_text("{}")
        (tmp_path / "models" / version / "adapter_model.safetensors").write_bytes(b"weights")
    registry.promote("v0", str(tmp_path / "models" / "v0"), {}, by="test", reason="base", action="register")
    registry.promote("v1", str(tmp_path / "models" / "v1"), {}, by="test", reason="round 1")
    return registry


def test_a_challenger_is_promoted_or_withdrawn_with_its_evidence_and_survives_a_rebuild(tmp_path):
    registry = _registry_with_v1(tmp_path)
    assert registry.next_version() == "v2"
    registry.start_challenger("v2", str(tmp_path / "models" / "v2"), {"gain": 0.1}, 0.1, by="run x", reason="passed")
    assert registry.next_version() == "v3"  # a challenger's version is taken even before it wins
    with pytest.raises(RegistryError, match="already in live A/B"):
        registry.start_challenger("v3", "/nowhere", {}, 0.1, by="run y", reason="passed")
    assert registry.champion()["version"] == "v1" and registry.challenger()["champion"] == "v1"
    # the registry file is lost: the event files give back the champion and the open challenger
    registry.path.unlink()
    registry.rebuild()
    assert registry.champion()["version"] == "v1" and registry.challenger()["version"] == "v2"
    evidence = {"decision": "rollback", "p_value": 0.01, "n_champion": 900, "n_challenger": 100}
    assert registry.conclude_challenger("rollback", by="ab_monitor_sensor", reason="worse", evidence=evidence)["version"] == "v1"
    last = registry.load()["history"][-1]
    assert (last["action"], last["version"], last["previous"], last["by"]) == ("withdraw", "v2", "v1", "ab_monitor_sensor")
    assert last["metrics"]["live_ab"] == evidence and registry.challenger() is None
    # a withdrawn challenger is never a rollback target; the champion's predecessor still is
    assert registry.rollback(by="me")["version"] == "v0"
    with pytest.raises(RegistryError, match="no challenger"):
        registry.conclude_challenger("promote", by="x", reason="y")


def test_a_champion_changed_by_hand_voids_the_ab_verdict(tmp_path):
    registry = _registry_with_v1(tmp_path)
    registry.start_challenger("v2", str(tmp_path / "models" / "v2"), {}, 0.5, by="run", reason="passed")
    registry.rollback(by="me")  # the champion the challenger was tested against is gone
    with pytest.raises(RegistryError, match="not v1 that v2 was tested against"):
        registry.conclude_challenger("promote", by="ab_monitor_sensor", reason="better")
    assert registry.champion()["version"] == "v0"


def test_the_session_split_is_stable_uniform_and_new_for_each_challenger():
    sessions = [f"user-{i}" for i in range(20_000)]
    first = np.array([in_challenger_share(s, {"version": "v2", "share": 0.1}) for s in sessions])
    again = np.array([in_challenger_share(s, {"version": "v2", "share": 0.1}) for s in sessions])
    other = np.array([in_challenger_share(s, {"version": "v3", "share": 0.1}) for s in sessions])
    assert (first == again).all()
    assert abs(first.mean() - 0.1) < 4 * np.sqrt(0.1 * 0.9 / len(sessions))  # 4 standard errors
    assert abs((first & other).mean() - 0.01) < 0.005  # independent draws: 10% x 10%


def test_the_gateway_serves_policy_from_both_sides_by_session_and_records_which(fresh_policy_dir, tmp_path):
    root = tmp_path / "policy"
    shutil.copytree(fresh_policy_dir, root)
    registry = AdapterRegistry(root=str(root))
    champion = registry.champion()
    registry.start_challenger("v1", champion["adapter_path"], {}, 0.3, by="test", reason="split")
    sessions = [f"s{i}" for i in range(60)]
    served: dict[str, set[str]] = {s: set() for s in sessions}
    with serve_policy(PolicyStore(str(root)), tmp_path / "landing") as server, httpx.Client(base_url=server.url, timeout=60) as client:
        assert "challenger" in [m["id"] for m in client.get("/v1/models").json()["data"]]
        for turn in range(2):
            for s in sessions:
                r = client.post("/v1/chat/completions", headers={"X-Session-ID": s},
                                json={"model": "policy", "messages": [{"role": "user", "content": "1+1"}], "max_tokens": 2})  # fmt: skip
                assert r.status_code == 200, r.text
                served[s].add(r.headers["X-Flowopt-Adapter-Version"])
        by_user = client.post("/v1/chat/completions", json={"model": "policy", "user": "s1", "messages": [{"role": "user", "content": "a"}], "max_tokens": 2})
        anonymous = client.post("/v1/chat/completions", json={"model": "policy", "messages": [{"role": "user", "content": "a"}], "max_tokens": 2})
        # a captured rollout is its own session: every turn on one side, and the trajectory says which
        assert client.post("/rollouts", json={"rollout_id": "r-7", "task_id": "t", "batch": "live-0001"}).status_code == 200
        for _ in range(2):
            client.post("/rollouts/r-7/v1/chat/completions", json={"model": "policy", "messages": [{"role": "user", "content": "2+2"}], "max_tokens": 2})
        client.post("/rollouts/r-7/finish", json={"outcome": {"success": True}})
        client.post("/batches/live-0001/close")
    assert all(len(v) == 1 for v in served.values())  # sticky: both turns of a session on one side
    expected = {s: "v1" if in_challenger_share(s, {"version": "v1", "share": 0.3}) else "v0" for s in sessions}
    assert {s: v.pop() for s, v in served.items()} == expected
    assert 5 <= sum(v == "v1" for v in expected.values()) <= 30
    assert by_user.headers["X-Flowopt-Adapter-Version"] == expected["s1"]
    assert anonymous.headers["X-Flowopt-Adapter-Version"] == "v0"  # no session key: never split
    (landed,) = (tmp_path / "landing").rglob("live-0001*.jsonl")
    (trajectory,) = [Trajectory.model_validate_json(line) for line in landed.read_text().splitlines()]
    side = "v1" if in_challenger_share("r-7", {"version": "v1", "share": 0.3}) else "v0"
    assert trajectory.adapter_version == side


def _damaged_adapter(store: PolicyStore, target) -> str:
    """A LoRA adapter whose B matrices are random (a trained adapter gone wrong): the agent's
    calls and answers break, so its success drops far below the identity adapter's."""
    import torch

    from flow_assets.policy.lora import save_lora_adapter

    base, _ = store.load()
    model = store.new_adapter(base)
    with torch.no_grad(), torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(0.0, 0.2)
    save_lora_adapter(model, target)
    return str(target)


@pytest.mark.slow
def test_live_traffic_through_the_gateway_and_dagster_promotes_the_better_challenger(calculator_policy_dir, tmp_path):
    from dagster import AssetKey, instance_for_test

    from flow_assets.serving.agents.harness import HarnessConfig, run_rollouts_sync
    from flow_assets.definitions import build_definitions
    from flow_assets.runtime.local import execute_requests, tick_sensor
    from resources.live_ab import LiveAB
    from resources.tasks import TaskSourceResource

    root = tmp_path / "policy"
    shutil.copytree(calculator_policy_dir, root)
    store, registry = PolicyStore(str(root)), AdapterRegistry(root=str(root))
    good = registry.champion()
    # the champion is an adapter gone wrong; the challenger is the good one: live A/B must promote it
    registry.promote("v1", _damaged_adapter(store, root / "adapters" / "v1"), {}, by="test", reason="a bad champion")
    registry.start_challenger("v2", good["adapter_path"], {}, 0.5, by="test", reason="the good adapter, back on trial")
    tasks = TaskSourceResource(kind="calculator")  # the agent the policy was warm-started for
    source, agent = tasks.source(), tasks.agent_fn()
    train = source.tasks("train")
    defs = build_definitions(str(tmp_path / "lake"), str(tmp_path / "landing"), models_root=str(root), tasks=tasks, settle_seconds=0,
                             live_ab=LiveAB(enabled=True, share=0.5))  # fmt: skip
    decisions = []
    started = time.perf_counter()
    (tmp_path / "home").mkdir()
    with instance_for_test(temp_dir=str(tmp_path / "home")) as instance:
        for batch in range(6):
            chosen = train[batch * 40 : (batch + 1) * 40]
            with serve_policy(store, tmp_path / "landing") as server:
                results = run_rollouts_sync(server.url, agent, chosen, source.score, 1, agent_id=tasks.agent_id, batch=f"live-{batch:04d}",
                                            source="live", config=HarnessConfig(model="policy", land=True))  # fmt: skip
            assert len(results) == len(chosen)
            print(f"batch {batch}: {time.perf_counter() - started:.1f} s", flush=True)
            landed = execute_requests(defs, instance, "log_batch_job", tick_sensor(defs, instance, "new_logs_sensor"))
            assert landed.succeeded and not landed.failed
            request = tick_sensor(defs, instance, "ab_monitor_sensor")
            assert [r.partition_key for r in request.run_requests] == landed.succeeded
            execute_requests(defs, instance, "ab_test_job", request)
            report = instance.get_latest_materialization_event(AssetKey("ab_test_report")).asset_materialization.metadata
            decisions.append((report["decision"].value, report["n_champion"].value, report["n_challenger"].value))
            act = tick_sensor(defs, instance, "ab_monitor_sensor")
            assert not act.run_requests
            if registry.challenger() is None:
                break
        champion = instance.get_latest_materialization_event(AssetKey("champion")).asset_materialization
    assert decisions[-1][0] == "promote", decisions
    assert all(d[0] == "continue" for d in decisions[:-1]), decisions
    assert registry.champion()["version"] == "v2"
    last = registry.load()["history"][-1]
    assert last["action"] == "promote" and last["by"].startswith("ab_monitor_sensor (ab_test_report run ")
    evidence = last["metrics"]["live_ab"]
    assert evidence["decision"] == "promote" and evidence["challenger_success"] > evidence["champion_success"]
    assert evidence["p_value"] < 0.05 and evidence["n_champion"] == decisions[-1][1]
    assert champion.metadata["version"].value == "v2" and champion.metadata["by"].value == last["by"]


def test_a_person_can_end_the_ab_either_way_from_the_cli(tmp_path):
    import json
    import subprocess
    import sys
    from pathlib import Path

    from dagster import AssetKey, DagsterInstance

    flowopt = str(Path(sys.executable).with_name("flowopt"))
    registry = _registry_with_v1(tmp_path)
    models, home = str(tmp_path / "models"), str(tmp_path / "home")
    registry.start_challenger("v2", str(tmp_path / "models" / "v2"), {}, 0.1, by="run", reason="passed")
    done = subprocess.run([flowopt, "rollback", "--models", models, "--home", home, "--by", "alice", "--reason", "support tickets"],
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == {"previous_champion": "v1", "champion": "v1", "withdrawn_challenger": "v2",
                                       "adapter_path": str(tmp_path / "models" / "v1")}  # fmt: skip
    last = registry.load()["history"][-1]
    assert (last["action"], last["by"], last["reason"]) == ("withdraw", "alice", "support tickets")
    refused = subprocess.run([flowopt, "promote", "--models", models, "--home", home], capture_output=True, text=True, timeout=120)
    assert refused.returncode == 1 and "no challenger in live A/B" in refused.stderr and "Traceback" not in refused.stderr
    registry.start_challenger("v3", str(tmp_path / "models" / "v2"), {}, 0.1, by="run", reason="passed")
    done = subprocess.run([flowopt, "promote", "--models", models, "--home", home, "--by", "bob"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and json.loads(done.stdout)["champion"] == "v3", done.stderr
    champion = DagsterInstance.local_temp(home).get_latest_materialization_event(AssetKey("champion")).asset_materialization
    assert champion.metadata["version"].value == "v3" and champion.metadata["by"].value == "bob"


def test_traffic_served_during_a_live_ab_is_found_from_the_registry_history(tmp_path):
    import polars as pl

    from flow_assets.live_ab.evidence import ab_windows, served_during_ab

    registry = _registry_with_v1(tmp_path)
    registry.start_challenger("v2", str(tmp_path / "models" / "v2"), {}, 0.5, by="test", reason="trial")
    open_windows = ab_windows(registry.load()["history"])
    assert len(open_windows) == 1 and open_windows[0][1] == float("inf")
    start = open_windows[0][0]
    registry.conclude_challenger("rollback", by="test", reason="worse", evidence={})
    (window,) = ab_windows(registry.load()["history"])
    assert window[0] == start and start <= window[1] < float("inf")
    iso = lambda t: datetime.fromtimestamp(t, timezone.utc).isoformat()  # noqa: E731
    frame = pl.DataFrame({"timestamp": [iso(start - 60), iso(start + 1e-3), iso(window[1] + 60), None]})
    assert served_during_ab(frame, [window]) == 1  # before, during, after, no timestamp
    assert served_during_ab(frame, open_windows) == 2
    assert served_during_ab(frame, []) == 0


def test_a_prompt_policy_in_live_ab_behind_the_proxy_is_decided_by_the_sensors(calculator_policy_dir, tmp_path):
    """The same live A/B for prompt policies: the agent on a model the gateway does not host
    (the tiny policy served by a plain gateway upstream), the proxy applying the champion's or the
    challenger's prompt by session, its text-only flows through the data plane, the sensors deciding."""
    from dagster import AssetKey, instance_for_test

    from flow_assets.definitions import build_definitions
    from flow_assets.policy.prompt import PromptPolicy
    from flow_assets.runtime.local import execute_requests, tick_sensor
    from flow_assets.serving.agents.harness import HarnessConfig, run_rollouts_sync
    from flow_assets.serving.gateway.app import Gateway
    from flow_assets.serving.gateway.engine import AdapterResolver
    from flow_assets.serving.gateway.server import GatewayServer
    from flow_assets.serving.gateway.upstream import Upstream
    from resources.live_ab import LiveAB
    from resources.tasks import TaskSourceResource

    models = tmp_path / "models"
    registry = AdapterRegistry(root=str(models))
    # a prompt gone wrong: a demonstration that answers without the calculator (the tiny policy
    # copies it and stops calling the tool)
    refusal = ({"role": "user", "content": "12*7"}, {"role": "assistant", "content": "I cannot compute that."})
    bad = PromptPolicy(demonstrations=(refusal,)).save(models / "prompts" / "v1")
    registry.promote("v1", str(bad), {}, by="test", reason="a bad prompt", action="register")
    registry.start_challenger("v2", str(PromptPolicy().save(models / "prompts" / "v2")), {}, 0.5, by="test", reason="no instructions")
    tasks = TaskSourceResource(kind="calculator")
    source, agent, train = tasks.source(), tasks.agent_fn(), tasks.source().tasks("train")
    defs = build_definitions(str(tmp_path / "lake"), str(tmp_path / "landing"), models_root=str(models), tasks=tasks, settle_seconds=0,
                             live_ab=LiveAB(enabled=True, share=0.5))  # fmt: skip
    decisions = []
    (tmp_path / "home").mkdir()
    with instance_for_test(temp_dir=str(tmp_path / "home")) as instance, serve_policy(PolicyStore(str(calculator_policy_dir)), tmp_path / "up") as up:
        for batch in range(6):
            proxy = Gateway(None, AdapterResolver(models / "registry.json"), tmp_path / "landing", upstream=Upstream(up.url + "/v1", "policy"))
            with GatewayServer(proxy) as server:
                run_rollouts_sync(server.url, agent, train[batch * 40 : (batch + 1) * 40], source.score, 1, agent_id=tasks.agent_id,
                                  batch=f"live-{batch:04d}", source="live", config=HarnessConfig(model="policy", land=True))  # fmt: skip
            landed = execute_requests(defs, instance, "log_batch_job", tick_sensor(defs, instance, "new_logs_sensor"))
            assert landed.succeeded and not landed.failed
            execute_requests(defs, instance, "ab_test_job", tick_sensor(defs, instance, "ab_monitor_sensor"))
            report = instance.get_latest_materialization_event(AssetKey("ab_test_report")).asset_materialization.metadata
            decisions.append((report["decision"].value, report["n_champion"].value, report["n_challenger"].value))
            tick_sensor(defs, instance, "ab_monitor_sensor")  # carries the decision out
            if registry.challenger() is None:
                break
    assert decisions[-1][0] == "promote" and all(d[0] == "continue" for d in decisions[:-1]), decisions
    assert decisions[-1][1] > 0 and decisions[-1][2] > 0  # both prompts served traffic
    assert registry.champion()["version"] == "v2" and registry.champion()["adapter_path"] == str(models / "prompts" / "v2")
    last = registry.load()["history"][-1]
    assert last["action"] == "promote" and last["by"].startswith("ab_monitor_sensor")
