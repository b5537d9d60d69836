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
    assert local.height == 24 and 0 < local["success"].sum() < 24  # a policy that solves some, so the comparison means something

    # the worker holding the first task SIGKILLs itself once, at the start of its shard: Ray runs
    # that shard again; every task still has exactly one row, with the in-process greedy outcome.
    # The other worker's shard runs undisturbed, so this one run checks both. (A second, unkilled
    # run before it cost a driver and two Ray workers: this test's call took 19.6 s with it, 11.8 s
    # without, 2026-11-29; the suite is CPU-bound. test_ray_training compares its killed run alone too.)
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


def test_collection_on_two_rollout_workers_lands_every_rollout_once_when_a_worker_is_killed_mid_collection(cluster, calculator_policy_dir, tmp_path):
    """A round's collection on two workers, unkilled, is in test_ray_training's pipeline round
    (``collect_rollouts_job`` on the cluster: one batch file, every rollout once, the scratch
    gone); a run of its own here cost a driver and two Ray workers loading the policy."""
    import threading
    import time

    from flow_assets.cluster.ray_rollouts import run_collect_driver
    from flow_assets.logs.schema import Trajectory
    from flow_assets.serving.agents.harness import HarnessConfig
    from flow_assets.serving.gateway.app import GatewayConfig

    tasks = TaskSourceResource(kind="calculator")
    source, agent = tasks.source(), tasks.agent_fn()
    store = PolicyStore(str(calculator_policy_dir))
    landing = tmp_path / "landing"

    # the worker holding the first task SIGKILLs itself once, after its gateway has landed 3
    # rollouts of its shard: Ray runs the shard again, which keeps those and runs only the rest
    chosen, group = source.tasks("train")[:8], 3
    marker = tmp_path / "landed-before-the-kill"

    def kill_after_three(shard, shard_dir) -> None:
        if marker.exists() or chosen[0].task_id not in {t.task_id for t in shard}:
            return

        def watch() -> None:
            while True:
                for journal in shard_dir.glob("*/*.jsonl.tmp"):
                    complete = [line for line in journal.read_bytes().splitlines(keepends=True) if line.endswith(b"\n")]
                    if len(complete) >= 3:
                        marker.write_bytes(b"".join(complete))
                        os.kill(os.getpid(), signal.SIGKILL)
                time.sleep(0.02)

        threading.Thread(target=watch, daemon=True).start()

    harness = HarnessConfig(concurrency=4, timeout_s=120.0, model="policy", temperature=1.0, land=True)
    landed = run_collect_driver(store, source, agent, tasks.agent_id, chosen, group, "r0002-killed", "flowopt-calculator", harness,
                                GatewayConfig(default_max_tokens=store.max_new_tokens, seed=1), 2, landing, address=cluster,
                                on_start=kill_after_three)  # fmt: skip
    assert marker.exists(), "the fault was not injected"
    lines = landed.path.read_bytes().splitlines(keepends=True)
    before_kill = marker.read_bytes().splitlines(keepends=True)
    assert len(before_kill) >= 3 and all(line in lines for line in before_kill)  # finished before the kill: landed as they were
    complete = [line for line in lines if line.endswith(b"}\n")]  # a torn line (if the kill hit a write) lands too, to be quarantined
    keys = [(r.task_id, r.metadata["sample_index"]) for r in map(Trajectory.model_validate_json, complete)]
    assert len(keys) == len(set(keys)) == landed.rollouts == len(chosen) * group  # every rollout once: none lost, none twice
    assert len(lines) == landed.rollouts + landed.torn_lines
