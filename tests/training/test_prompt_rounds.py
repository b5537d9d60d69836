"""Prompt-policy rounds as Dagster runs (#30): an agent on a model flowopt does not host (the
upstream here: flowopt's gateway in plain serving mode on the tiny calculator policy, behind a
key), its flows captured as text by the proxy, ingested by the real sensors, and a prompt round
requested by ``training_round_sensor`` because the champion is a prompt policy."""

import asyncio
import json
from math import comb
from pathlib import Path

import polars as pl
import pytest
from dagster import AssetCheckKey, AssetKey, instance_for_test

from flow_assets.definitions import build_definitions
from flow_assets.logs.schema import Trajectory
from flow_assets.policy.prompt import PromptPolicy
from flow_assets.policy.store import PolicyStore
from flow_assets.runtime.local import execute_requests, run_job, tick_sensor
from flow_assets.serving.agents.harness import HarnessConfig, run_rollouts
from flow_assets.serving.gateway.app import Gateway
from flow_assets.serving.gateway.engine import AdapterResolver
from flow_assets.serving.gateway.serve import make_gateway
from flow_assets.serving.gateway.server import GatewayServer
from flow_assets.serving.gateway.upstream import Upstream
from flow_assets.training.budget import Prices, lake_spend
from flow_assets.training.prompt_rounds import PromptRoundSettings, Usage, check_token_budget, gate_report, landed_usage, search_tasks_for
from resources.lake import TrajectoryLake
from resources.registry import AdapterRegistry
from resources.tasks import TaskSourceResource
from resources.upstream import ReflectionEndpoint, UpstreamModel
from tests.llama_cpp_server import llama_cpp_server
from tests.training.test_assets import failure

pytestmark = pytest.mark.slow
KEY = "sk-upstream-prompt-round-41c2"
ROUND = {"k": 2, "num_candidates": 2, "search_tasks": 12, "heldout_tasks": 40, "temperature": 0.7, "concurrency": 32,
         "reflection_calls": 20, "reflection_minibatch": 4}
REFLECTION_KEY = "sk-reflect-prompt-round-0b7e"


@pytest.fixture(scope="module")
def upstream_server(calculator_policy_dir, tmp_path_factory):
    landing = tmp_path_factory.mktemp("upstream-landing")
    with GatewayServer(make_gateway(PolicyStore(str(calculator_policy_dir)), landing), tokens=[KEY]) as server:
        yield server


def _flows(directory: Path) -> list[Trajectory]:
    return [Trajectory.model_validate_json(line) for p in sorted(directory.rglob("*.jsonl")) for line in p.read_text().splitlines()]


def _everything_text(root: Path) -> str:
    """Every file under ``root`` as text, Parquet files as their rows (their pages are compressed)."""
    parts = []
    for p in sorted(root.rglob("*")):
        if p.is_file():
            parts.append(pl.read_parquet(p).write_ndjson() if p.suffix == ".parquet" else p.read_text(errors="replace"))
    return "".join(parts)


def _gate_check(instance):
    found = instance.event_log_storage.get_latest_asset_check_execution_by_key([AssetCheckKey(AssetKey("prompt_evaluation"), "prompt_gate")])
    return next(iter(found.values())).evaluation


def _mcnemar_exact(rows: pl.DataFrame) -> float:
    """McNemar's exact p by hand: two-sided binomial on the discordant pairs."""
    wide = rows.pivot(on="policy", index="task_id", values="success")
    b = wide.filter(pl.col("candidate") & ~pl.col("champion")).height
    c = wide.filter(~pl.col("candidate") & pl.col("champion")).height
    n = b + c
    return 1.0 if n == 0 else min(1.0, 2 * sum(comb(n, i) for i in range(min(b, c) + 1)) / 2**n)


@pytest.fixture(scope="module")
def reflection_server(tmp_path_factory):
    with llama_cpp_server(tmp_path_factory.mktemp("llama") / "server.log", REFLECTION_KEY) as url:
        yield url


def test_a_batch_of_text_flows_under_a_prompt_champion_gets_a_gated_prompt_round(upstream_server, reflection_server, tmp_path):
    models, landing = tmp_path / "models", tmp_path / "landing"
    registry = AdapterRegistry(root=str(models))
    registry.promote("v0", str(PromptPolicy().save(models / "prompts" / "v0")), {}, by="test", reason="the agent's prompt", action="register")
    upstream = UpstreamModel(base_url=upstream_server.url + "/v1", model="policy", api_key=KEY)
    tasks = TaskSourceResource(kind="calculator")
    reflection = ReflectionEndpoint(base_url=reflection_server, model="smollm2", api_key=REFLECTION_KEY, max_tokens=96)
    defs = build_definitions(str(tmp_path / "lake"), str(landing), models_root=str(models), tasks=tasks, settle_seconds=0, upstream=upstream,
                             reflection=reflection)  # fmt: skip
    source = tasks.source()
    # the agent's own traffic through the proxy: text flows, no token ids
    proxy = Gateway(None, AdapterResolver(registry.path), landing, upstream=Upstream(upstream.base_url, "policy", KEY, timeout_s=60))
    with GatewayServer(proxy) as server:
        asyncio.run(run_rollouts(server.url, tasks.agent_fn(), source.tasks("train")[:16], source.score, 2, agent_id=tasks.agent_id,
                                 batch="prompt-0001", config=HarnessConfig(32, 600.0, "policy", 1.0)))  # fmt: skip
    batch_flows = _flows(landing)
    assert len(batch_flows) == 32 and all(f.metadata["capture"] == "text" for f in batch_flows)
    (tmp_path / "dagster_home").mkdir()
    with instance_for_test(temp_dir=str(tmp_path / "dagster_home")) as instance:
        tick = execute_requests(defs, instance, "log_batch_job", tick_sensor(defs, instance, "new_logs_sensor"))
        (key,) = tick.succeeded
        # the champion is a prompt policy: the same sensor asks for a prompt round, not a LoRA round
        requested = tick_sensor(defs, instance, "training_round_sensor")
        assert [(r.job_name, r.partition_key) for r in requested.run_requests] == [("prompt_round_job", key)]
        result = run_job(defs, instance, "prompt_round_job", key, {"ops": {name: {"config": ROUND} for name in ("prompt_candidate", "prompt_evaluation")}})
        candidate = instance.get_latest_materialization_event(AssetKey("prompt_candidate")).asset_materialization.metadata
        work = models / "prompt_rounds" / key
        search = json.loads((work / "search.json").read_text())
        solved = {f.task_id for f in batch_flows if f.outcome and f.outcome.score >= 1.0}
        assert candidate["flows"].value == 32 and candidate["demonstrations"].value == len(solved) > 0
        assert len(search["mean_rewards"]) == candidate["candidates"].value == 3 and len(search["search_task_ids"]) == 12
        assert not set(search["search_task_ids"]) & {f.task_id for f in batch_flows}  # never the batch's own tasks
        # what the round spent upstream is what its own flows report, and the month's budget counts it
        lake = TrajectoryLake(root=str(tmp_path / "lake"))
        usage = lake.read_partition("round_usage", key)
        search_usage = landed_usage(work / "search")
        assert usage.filter(pl.col("step") == "search")["prompt_tokens"].item() == search_usage.prompt_tokens > 0
        assert search_usage.trajectories == 3 * 12
        spent = lake_spend(lake, tasks.agent_id, prices=Prices(1.0, 2.0))
        batch_tokens = sum(f.metadata["prompt_tokens"] for f in batch_flows), sum(f.metadata["completion_tokens"] for f in batch_flows)
        assert spent.prompt_tokens == batch_tokens[0] + int(usage["prompt_tokens"].sum()) and batch_tokens[0] > 0
        assert spent.completion_tokens == batch_tokens[1] + int(usage["completion_tokens"].sum())
        assert spent.total_usd == pytest.approx((spent.prompt_tokens + 2 * spent.completion_tokens) / 1e6)
        # GEPA rewrote the few-shot winner's instructions with the reflection model (SmolLM2 behind
        # llama.cpp's server), on the same search tasks; what it spent is in round_usage too
        reflected = search["reflection"]
        assert candidate["reflection_model_calls"].value == reflected["reflection_calls"] >= 1
        assert reflected["metric_calls"] <= 20 + 4 and reflected["instructions"][0] == "" and len(reflected["val_scores"]) == len(reflected["instructions"])
        assert usage["step"].to_list() == ["search", "reflection", "reflection_model"]
        assert usage.filter(pl.col("step") == "reflection")["prompt_tokens"].item() == landed_usage(work / "reflection").prompt_tokens > 0
        assert usage.filter(pl.col("step") == "reflection_model")["trajectories"].item() == reflected["reflection_calls"]
        # the tiny policy's 128-token context holds no drawn demonstration (its candidates' calls
        # end in 400s and score 0), nor SmolLM2's long instructions, so the champion prompt wins
        # the search: no gate is run
        gate = _gate_check(instance)
        assert search["best"] == 0 and search["mean_rewards"][0] > max(search["mean_rewards"][1:])
        assert search["best_is_champion"] == (not reflected["improved"])
        if search["best_is_champion"]:
            assert not gate.passed and not result.success and registry.champion()["version"] == "v0"
            assert "no candidate beat" in json.loads((work / "gate.json").read_text())["reason"]
        # the gate itself, on a search outcome made by hand: a champion prompt gone wrong (a
        # demonstration that answers without the calculator) against the bare prompt
        refusal = ({"role": "user", "content": "12*7"}, {"role": "assistant", "content": "I cannot compute that."})
        registry.promote("v1", str(PromptPolicy(demonstrations=(refusal,)).save(models / "prompts" / "v1")), {}, by="test", reason="a bad prompt")
        bare = PromptPolicy()
        (work / "search.json").write_text(json.dumps(search | {"champion": "v1", "best": 1, "best_is_champion": False, "candidate_path": str(bare.save(work / "candidate")),
                                                             "content_hash": bare.content_hash, "usage": {"prompt_tokens": 0, "completion_tokens": 0}}))  # fmt: skip
        gated = defs.get_job_def("prompt_round_job").execute_in_process(
            run_config={"ops": {"prompt_evaluation": {"config": ROUND}}}, instance=instance, partition_key=key, raise_on_error=False,
            asset_selection=[AssetKey("prompt_evaluation"), AssetKey("promoted_prompt")],
        )  # fmt: skip
        report = json.loads((work / "gate.json").read_text())
        rows = lake.read_partition("prompt_evaluations", key)
        assert rows.height == 2 * 40 and set(rows["policy"]) == {"champion", "candidate"}
        gain = rows.filter(pl.col("policy") == "candidate")["success"].mean() - rows.filter(pl.col("policy") == "champion")["success"].mean()
        assert report["gain"] == pytest.approx(gain) and gain > 0.2
        assert report["mcnemar_p"] == pytest.approx(_mcnemar_exact(rows)) and report["mcnemar_p"] < 0.05
        assert gated.success and _gate_check(instance).passed, failure(gated)
        champ = registry.champion()
        assert champ["version"] == "v2" and PromptPolicy.load(champ["adapter_path"]).content_hash == bare.content_hash
        assert champ["adapter_path"] == str(models / "prompts" / "v2") and champ["metrics"]["heldout"]["gain"] == pytest.approx(gain)
        gate_usage = lake.read_partition("round_usage", key).filter(pl.col("step") == "gate")
        assert gate_usage["prompt_tokens"].item() == landed_usage(work / "gate").prompt_tokens > 0
        # a round over its token budget stops before the gate and promotes nothing
        before = registry.champion()["version"]
        capped = run_job(defs, instance, "prompt_round_job", key,
                         {"ops": {n: {"config": ROUND | {"max_round_tokens": 1}} for n in ("prompt_candidate", "prompt_evaluation")}})  # fmt: skip
        assert not capped.success and "budget is 1" in failure(capped) and registry.champion()["version"] == before
    # neither key is anywhere the round wrote: landing, lake (its tables read back, Parquet being
    # compressed), models, registry, the instance's runs and event log (SQLite, plain text)
    written = _everything_text(tmp_path)
    assert "prompt_round_job" in written and batch_flows[0].trajectory_id in written  # the scan reads what it should
    assert KEY not in written and REFLECTION_KEY not in written


def test_without_an_upstream_a_prompt_champion_gets_no_round_and_a_lora_champion_its_usual_one(tmp_path):
    models = tmp_path / "models"
    registry = AdapterRegistry(root=str(models))
    registry.promote("v0", str(PromptPolicy().save(models / "prompts" / "v0")), {}, by="test", reason="a prompt", action="register")
    defs = build_definitions(str(tmp_path / "lake"), str(tmp_path / "landing"), models_root=str(models), tasks=TaskSourceResource(kind="calculator"), settle_seconds=0)
    lake = TrajectoryLake(root=str(tmp_path / "lake"))
    record = {"trajectory_id": "t1", "task_id": "calculator-1+1", "agent_id": TaskSourceResource(kind="calculator").agent_id, "query": "1+1",
              "steps": [{"index": 0, "kind": "answer", "output": "2"}], "final_answer": "2", "outcome": {"success": True, "score": 1.0}}  # fmt: skip
    # a second rollout of the task that failed: the group has a varied reward (something to train on)
    failed = {**record, "trajectory_id": "t2", "final_answer": "3", "steps": [{"index": 0, "kind": "answer", "output": "3"}],
              "outcome": {"success": False, "score": 0.0}}  # fmt: skip
    (tmp_path / "landing").mkdir()
    (tmp_path / "landing" / "b.jsonl").write_text(json.dumps(record) + "\n" + json.dumps(failed) + "\n")
    with instance_for_test() as instance:
        tick = execute_requests(defs, instance, "log_batch_job", tick_sensor(defs, instance, "new_logs_sensor"))
        assert tick.succeeded, tick.failed
        assert lake.read_partition("trajectories", tick.succeeded[0]).height == 2  # not quarantined
        assert tick_sensor(defs, instance, "training_round_sensor").run_requests == []
        # the same batch under a LoRA champion: a LoRA round (the cursor forgotten)
        registry.promote("v1", str(models / "adapters" / "v1"), {}, by="test", reason="an adapter", action="register")
        (requested,) = tick_sensor(defs, instance, "training_round_sensor").run_requests
        assert requested.job_name == "training_round_job"


def test_round_pieces_search_tasks_budget_and_gate():
    from flow_assets.tasks.sources import Task

    train = [Task(f"t{i}", f"q{i}", str(i), f"q{i}", str(i), "train", "test", "exact") for i in range(10)]
    drawn = search_tasks_for(train, {"t0", "t1"}, 5, seed=3)
    assert len(drawn) == 5 and not {t.task_id for t in drawn} & {"t0", "t1"} and drawn == search_tasks_for(train, {"t1", "t0"}, 5, seed=3)
    with pytest.raises(Exception, match="fewer than the 9"):
        search_tasks_for(train, {"t0", "t1"}, 9, seed=0)
    check_token_budget(Usage(3, 3), PromptRoundSettings(max_round_tokens=7), "search")
    with pytest.raises(Exception, match="spent 7 upstream tokens by the end of its gate"):
        check_token_budget(Usage(3, 4), PromptRoundSettings(max_round_tokens=7), "gate")
    ids = [f"h{i}" for i in range(30)]
    # 12 tasks only the candidate solves, 2 only the champion: exact p = 2 * P(X <= 2 | n = 14)
    cand = [True] * 12 + [False] * 2 + [True] * 6 + [False] * 10
    champ = [False] * 12 + [True] * 2 + [True] * 6 + [False] * 10
    rows = pl.DataFrame({"policy": ["candidate"] * 30 + ["champion"] * 30, "mode": ["sampled"] * 60, "task_id": ids * 2,
                         "completion": [""] * 60, "reward": [float(x) for x in cand + champ], "success": cand + champ,
                         "completion_tokens": [1] * 60, "llm_calls": [1] * 60, "tool_calls": [0] * 60})  # fmt: skip
    from flow_assets.rl.evaluation import EVAL_SCHEMA

    report = gate_report(rows.cast(EVAL_SCHEMA).select(list(EVAL_SCHEMA)), 0.05, candidate_is_champion=False)
    assert report["mcnemar_p"] == pytest.approx(2 * (1 + 14 + 91) / 2**14) and report["gain"] == pytest.approx(10 / 30) and report["passed"]
    assert not gate_report(rows.cast(EVAL_SCHEMA).select(list(EVAL_SCHEMA)), 0.05, candidate_is_champion=True)["passed"]
    # a call the model server failed (unreachable, timed out) is a task lost by the server, not
    # by the prompt: the same significant gain blocks, and says why
    failed = gate_report(rows.cast(EVAL_SCHEMA).select(list(EVAL_SCHEMA)), 0.05, candidate_is_champion=False, failures={"champion": 2, "candidate": 0})
    assert not failed["passed"] and failed["server_failures"] == {"champion": 2} and "server failed 2 calls" in failed["reason"]
    assert failed["gain"] == pytest.approx(10 / 30)


def test_server_failures_count_the_calls_the_model_server_failed_per_version(tmp_path):
    from flow_assets.training.prompt_rounds import server_failures

    lines = [
        {"adapter_version": "candidate", "metadata": {"failed_calls": [{"version": "candidate", "status": 504, "message": "PoolTimeout"},
                                                                       {"version": "candidate", "status": 400, "message": "too long"}]}},
        {"adapter_version": "champion", "metadata": {"failed_calls": [{"version": "champion", "status": 502, "message": "refused"}]}},
        {"adapter_version": "champion", "metadata": {}},
    ]  # fmt: skip
    (tmp_path / "flows" / "round").mkdir(parents=True)
    (tmp_path / "flows" / "round" / "b.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    # a 400 is the prompt's own doing (too long for the context): it stays the prompt's failure
    assert server_failures(tmp_path) == {"candidate": 1, "champion": 1}
    assert server_failures(tmp_path / "nothing") == {}
