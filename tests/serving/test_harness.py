"""The agent harness against a real gateway: isolation of failing agents, concurrency and dynamic
batching, the ids training consumes, and the collection temperature reaching the trainer."""

import asyncio
from pathlib import Path

import pytest
import torch
from flow_assets.serving.agents.builtin import calculator_agent, one_turn_agent
from flow_assets.serving.agents.harness import AgentLoadError, HarnessConfig, load_agent, rollout_seed, run_rollouts
from flow_assets.definitions import build_definitions
from flow_assets.serving.gateway.app import GatewayConfig
from flow_assets.serving.gateway.serve import serve_policy
from flow_assets.runtime.local import execute_requests, tick_sensor
from flow_assets.logs.schema import Trajectory
from flow_assets.policy.rollouts import training_samples
from flow_assets.policy.sampling import completion_logprobs
from flow_assets.policy.store import PolicyStore
from flow_assets.policy.trainer import GRPOTrainerConfig, TrainingSample, train_grpo_round
from flow_assets.tasks.calculator import CalculatorSource
from flow_assets.tasks.sources import Task
from resources.lake import TrajectoryLake
from resources.tasks import TaskSourceResource

SOURCE = CalculatorSource()
TASKS = SOURCE.tasks("train")


def _task(task_id: str) -> Task:
    return Task(task_id, "q", "ref", "ab", "ref", "train", "test", "exact")


def _landed(path: Path) -> list[Trajectory]:
    return [Trajectory.model_validate_json(line) for line in path.read_text().splitlines()]


async def _troubled_agent(client, task):
    """Each task id names a way for an agent to fail (or not)."""
    if task.task_id == "never-calls":
        return "an answer without asking the model"
    response = await client.chat.completions.create(model="policy", messages=[{"role": "user", "content": task.prompt}])
    if task.task_id == "raises":
        raise KeyError("the agent's own bug")
    if task.task_id == "hangs":
        await asyncio.sleep(60)
    return response.choices[0].message.content


def test_failing_agents_land_as_error_rollouts_and_the_batch_goes_on(fresh_policy_dir, tmp_path):
    tasks = [_task(t) for t in ("raises", "hangs", "never-calls", "fine")]
    config = HarnessConfig(concurrency=4, timeout_s=8.0)
    with serve_policy(PolicyStore(str(fresh_policy_dir), max_new_tokens=4), tmp_path) as server:
        results = asyncio.run(
            run_rollouts(server.url, _troubled_agent, tasks, lambda t, a: 1.0, 1, agent_id="test", batch="b", source="s", config=config)
        )
    kinds = {r.task_id: (r.error or {}).get("kind") for r in results}
    assert kinds == {"raises": "agent_error", "hangs": "timeout", "never-calls": "no_llm_call", "fine": None}
    assert [r.success for r in results] == [False, False, False, True]
    landed = {t.task_id: t for t in _landed(tmp_path / "s" / "b.jsonl")}
    assert set(landed) == {"raises", "hangs", "never-calls", "fine"}  # nothing dropped
    assert "KeyError" in landed["raises"].metadata["error"]["message"]
    for task_id in ("raises", "hangs"):  # the turn each made before failing is kept, with its tokens
        assert len(landed[task_id].steps) == 1 and len(landed[task_id].steps[0].token_ids) == 4
        assert landed[task_id].outcome.score == 0.0
    assert landed["never-calls"].steps == [] and landed["fine"].outcome.success is True


async def _slow_agent(client, task):
    """One call, then 0.7 s of the agent's own work (under the gateway's 1 s idle timeout)."""
    response = await client.chat.completions.create(model="policy", messages=[{"role": "user", "content": task.prompt}])
    await asyncio.sleep(0.7)
    return response.choices[0].message.content


def test_rollouts_waiting_for_an_agent_slot_longer_than_the_idle_timeout_still_finish(fresh_policy_dir, tmp_path):
    """With one agent slot, the third rollout waits over 1.4 s for its turn; the gateway lands a
    rollout idle for 1 s. Registered only when its agent starts, none is idle while it waits,
    so every rollout finishes with its score (registered with the batch, the waiting ones were
    landed unfinished and their finish refused, failing the whole collection)."""
    tasks = [_task(f"t{i}") for i in range(3)]
    gateway = GatewayConfig(rollout_timeout_s=1.0, reap_every_s=0.1)
    with serve_policy(PolicyStore(str(fresh_policy_dir), max_new_tokens=2), tmp_path, config=gateway) as server:
        results = asyncio.run(
            run_rollouts(server.url, _slow_agent, tasks, lambda t, a: 1.0, 1, agent_id="test", batch="b", source="s",
                         config=HarnessConfig(concurrency=1, timeout_s=30.0))
        )  # fmt: skip
    assert [(r.error, r.success) for r in results] == [(None, True)] * 3
    landed = _landed(tmp_path / "s" / "b.jsonl")
    assert sorted(t.task_id for t in landed) == ["t0", "t1", "t2"]
    assert all(t.outcome.success for t in landed)


def test_eight_concurrent_agents_share_batched_generation(fresh_policy_dir, tmp_path):
    config = GatewayConfig(max_wait_ms=50, default_max_tokens=6)
    with serve_policy(PolicyStore(str(fresh_policy_dir), max_new_tokens=6), tmp_path, config=config) as server:
        results = asyncio.run(
            run_rollouts(server.url, one_turn_agent, TASKS[:1], SOURCE.score, 8, agent_id="a", batch="g", source="s")
        )
        batcher = server.gateway.batcher
        batches, rows = batcher.batches, batcher.rows
    assert len({r.rollout_id for r in results}) == 8 and all(r.error is None for r in results)
    landed = _landed(tmp_path / "s" / "g.jsonl")
    assert sorted(t.trajectory_id for t in landed) == sorted(f"g/{TASKS[0].task_id}/{g}" for g in range(8))
    assert rows == 8 and batches <= 2  # the 8 calls were generated together, not one by one


def test_training_consumes_exactly_the_ids_the_gateway_rendered_and_sampled(calculator_policy_dir, tmp_path, dagster_instance):
    landing, lake_root = tmp_path / "landing", tmp_path / "lake"
    with serve_policy(PolicyStore(str(calculator_policy_dir)), landing) as server:
        asyncio.run(
            run_rollouts(server.url, calculator_agent, TASKS[:4], SOURCE.score, 4, agent_id="flowopt:calculator",
                         batch="rollouts-0000", source="flowopt-calculator", config=HarnessConfig(temperature=0.8))
        )  # fmt: skip
    (path,) = landing.rglob("*.jsonl")
    turns = [  # training_samples orders the turns by trajectory id and step, not as they landed
        (s.prompt_token_ids, s.token_ids, s.logprobs, s.temperature)
        for t in sorted(_landed(path), key=lambda t: t.trajectory_id)
        for s in t.steps
        if s.token_ids is not None
    ]
    assert len(turns) > 16  # the agents called their tool: more than one turn per rollout
    defs = build_definitions(str(lake_root), str(landing), models_root=str(calculator_policy_dir), tasks=TaskSourceResource(kind="calculator"))
    tick = execute_requests(defs, dagster_instance, "log_batch_job", tick_sensor(defs, dagster_instance, "new_logs_sensor"))
    assert not tick.failed and len(tick.succeeded) == 1
    key = tick.succeeded[0]
    lake = TrajectoryLake(root=str(lake_root))
    samples = training_samples(
        lake.read_partition("steps", key), lake.read_partition("step_advantages", key),
        lake.read_partition("trajectories", key), "flowopt:calculator",
    )  # fmt: skip
    assert [(s.prompt_ids, s.completion_ids, s.behaviour_logprobs, s.temperature) for s in samples] == turns


def _sampled(path: Path) -> dict[str, list[list[int]]]:
    """Each landed trajectory's sampled ids, turn by turn, by trajectory id."""
    return {t.trajectory_id: [s.token_ids for s in t.steps if s.token_ids is not None] for t in _landed(path)}


def test_a_seeded_collection_samples_the_same_rollouts_whatever_the_order_of_calls(calculator_policy_dir, tmp_path):
    """Seeded, the same tool-using agents on the same tasks sample the same completions turn by
    turn, whether 16 agents run at once or 3 (other batches, another order of calls), each
    rollout its own (a group's samples differ); another seed samples others."""
    store = PolicyStore(str(calculator_policy_dir))
    landed = {}
    # each gateway's own seed differs too: it seeds only calls that bring no seed
    for name, concurrency, seed, gateway_seed in (("wide", 16, 5, 0), ("narrow", 3, 5, 1), ("other", 16, 6, 0)):
        with serve_policy(store, tmp_path / name, config=GatewayConfig(seed=gateway_seed)) as server:
            results = asyncio.run(
                run_rollouts(server.url, calculator_agent, TASKS[:4], SOURCE.score, 4, agent_id="a", batch="b", source="s",
                             config=HarnessConfig(concurrency=concurrency, seed=seed))
            )  # fmt: skip
        assert all(r.error is None for r in results)
        landed[name] = _sampled(tmp_path / name / "s" / "b.jsonl")
        assert {t.metadata["seed"] for t in _landed(tmp_path / name / "s" / "b.jsonl")} == {
            rollout_seed(seed, "b", task.task_id, g) for task in TASKS[:4] for g in range(4)
        }
    assert len(landed["wide"]) == 16 and sum(len(turns) for turns in landed["wide"].values()) > 16  # tools were called
    assert landed["narrow"] == landed["wide"]
    assert landed["other"] != landed["wide"]
    groups = {task.task_id: {str(landed["wide"][f"b/{task.task_id}/{g}"]) for g in range(4)} for task in TASKS[:4]}
    assert any(len(samples) > 1 for samples in groups.values())  # the same seed for a whole group: one rollout each


async def _fixed_seed_agent(client, task):
    """An agent that asks for the same seed on every call."""
    response = await client.chat.completions.create(model="policy", messages=[{"role": "user", "content": task.prompt}], seed=7)
    return response.choices[0].message.content


def test_a_seeded_rollout_overrides_the_seed_the_agent_sends(fresh_policy_dir, tmp_path):
    """Unseeded rollouts honour the agent's own seed (8 identical samples of a task); a seeded
    harness imposes each rollout's seed, as it imposes the temperature (8 different ones)."""
    distinct = {}
    for seed in (None, 3):
        out = tmp_path / str(seed)
        with serve_policy(PolicyStore(str(fresh_policy_dir), max_new_tokens=8), out) as server:
            asyncio.run(
                run_rollouts(server.url, _fixed_seed_agent, TASKS[:1], SOURCE.score, 8, agent_id="a", batch="b", source="s",
                             config=HarnessConfig(seed=seed))
            )  # fmt: skip
        distinct[seed] = len({tuple(turns[0]) for turns in _sampled(out / "s" / "b.jsonl").values()})
    assert distinct == {None: 1, 3: 8}


def test_a_batch_collected_at_temperature_0_7_gives_ratio_1_before_the_first_update(calculator_policy_dir, tmp_path):
    store = PolicyStore(str(calculator_policy_dir))
    with serve_policy(store, tmp_path) as server:
        asyncio.run(
            run_rollouts(server.url, calculator_agent, TASKS[:8], SOURCE.score, 4, agent_id="a", batch="t07", source="s",
                         config=HarnessConfig(temperature=0.7))
        )  # fmt: skip
    samples = [
        TrainingSample(s.prompt_token_ids, s.token_ids, 1.0 if k % 2 else -1.0, s.logprobs, t.task_id, s.temperature)
        for k, t in enumerate(_landed(tmp_path / "s" / "t07.jsonl"))
        for s in t.steps
        if s.token_ids is not None
    ]
    assert {s.temperature for s in samples} == {0.7}

    def first_ratio(batch):
        model, _ = store.load(str(calculator_policy_dir / "adapters" / "v0"), trainable=True)
        config = GRPOTrainerConfig(output_dir=str(tmp_path / "ckpt" / str(id(batch))), minibatch_size=len(batch), max_steps=1)
        return train_grpo_round(model, batch, config).steps[0].mean_ratio

    assert first_ratio(samples) == pytest.approx(1.0, abs=1e-4)

    def largest_log_ratio(temperatures):
        model, tokenizer = store.load(str(calculator_policy_dir / "adapters" / "v0"))
        logp, mask = completion_logprobs(
            model, [s.prompt_ids for s in samples], [s.completion_ids for s in samples], tokenizer.pad_token_id, temperatures
        )
        old = torch.zeros_like(logp)
        for i, s in enumerate(samples):
            old[i, : len(s.behaviour_logprobs)] = torch.tensor(s.behaviour_logprobs)
        return float(((logp - old) * mask).abs().max())

    # every token's ratio is 1 at the collection temperature; scoring the new policy at T = 1, as
    # the trainer did before the fix, moves them far from it
    assert largest_log_ratio([s.temperature for s in samples]) < 1e-3
    assert largest_log_ratio([1.0] * len(samples)) > 0.1


def test_agents_are_loaded_by_path_and_checked():
    assert load_agent("flow_assets.serving.agents.builtin:calculator_agent") is calculator_agent
    with pytest.raises(AgentLoadError, match="async"):
        load_agent("flow_assets.tasks.calculator:execute_tool_call")
    with pytest.raises(AgentLoadError, match="module:function"):
        load_agent("no_colon")
    with pytest.raises(AgentLoadError, match="nowhere"):
        load_agent("nowhere.at.all:agent")
