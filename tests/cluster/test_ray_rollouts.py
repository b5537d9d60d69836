"""Held-out evaluation over Ray rollout workers (#31), on the real local Ray cluster of this folder:
each worker a gateway replica with its shard of the agents; greedy outcomes as in process; a
worker SIGKILLed mid-evaluation retried by Ray with no task lost or counted twice."""

import os
import signal

import polars as pl
import pytest

from flow_assets.policy.store import PolicyStore
from flow_assets.rl.gate import GateConfig
from flow_assets.serving.gateway.engine import AdapterRef
from flow_assets.training.rounds import EvaluationConfig, evaluate_agents
from resources.registry import AdapterRegistry
from resources.tasks import TaskSourceResource

pytest.importorskip("ray")  # the test extra installs it: CI never skips

pytestmark = pytest.mark.slow


def _outcomes(rows: pl.DataFrame) -> list[tuple]:
    return sorted(rows.select("policy", "mode", "task_id", "success", "reward", "completion").rows())


def test_two_rollout_workers_give_the_in_process_greedy_outcomes_and_a_killed_worker_is_retried(cluster, calculator_policy_dir, tmp_path):
    from flow_assets.cluster.ray_rollouts import run_eval_driver, shards

    assert shards(5, 2) == [[0, 2, 4], [1, 3]] and shards(1, 3) == [[0], [], []]
    tasks = TaskSourceResource(kind="calculator")
    source, agent = tasks.source(), tasks.agent_fn()
    held_out = source.tasks("held_out")[:24]
    champion = AdapterRegistry(root=str(calculator_policy_dir)).champion()
    policies = {"champion": AdapterRef(champion["version"], champion["adapter_path"])}
    config = EvaluationConfig(max_tasks=24, modes=("greedy",), concurrency=8, gate=GateConfig(metric="greedy"))
    store = PolicyStore(str(calculator_policy_dir))
    local, _ = evaluate_agents(store, source, agent, tasks.agent_id, held_out, policies, config, tmp_path / "local")
    on_ray = run_eval_driver(store, source, agent, tasks.agent_id, held_out, policies, config, 2, tmp_path / "ray", address=cluster)
    assert on_ray.height == local.height == 24 and on_ray["task_id"].n_unique() == 24
    assert _outcomes(on_ray) == _outcomes(local)
    assert 0 < local["success"].sum() < 24  # a policy that solves some, so the comparison means something

    # the worker holding the first task SIGKILLs itself once, at the start of its shard: Ray runs
    # that shard again; every task still has exactly one row, with the same greedy outcome
    marker, first = tmp_path / "killed-once", held_out[0].task_id

    def kill_once(shard) -> None:
        if first in {t.task_id for t in shard} and not marker.exists():
            marker.write_text(str(os.getpid()))
            os.kill(os.getpid(), signal.SIGKILL)

    retried = run_eval_driver(store, source, agent, tasks.agent_id, held_out, policies, config, 2, tmp_path / "killed", address=cluster,
                              on_start=kill_once)  # fmt: skip
    assert marker.exists(), "the fault was not injected"
    assert retried.height == 24 and retried["task_id"].n_unique() == 24
    assert _outcomes(retried) == _outcomes(local)
