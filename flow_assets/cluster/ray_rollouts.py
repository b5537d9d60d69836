"""Held-out evaluation fanned out over Ray rollout workers (#31, items 1-3, evaluation).

Each rollout worker is a Ray task that holds the policy and a gateway replica of its own
(:func:`~flow_assets.serving.gateway.serve.serve_policy` in the worker's process), and runs the
agents of its shard of the tasks against it, every policy and mode; the shards are the tasks taken
in turn (task ``i`` to worker ``i mod N``), so the agents' HTTP traffic is spread over the
replicas and each task is evaluated once::

    driver process         evaluate_on_ray(store, source, agent, agent_id, tasks, policies, config, workers=N)
      -> N Ray tasks        each: serve_policy(store, scratch, extra=policies) + run_rollouts(its shard)
      <- rows               EVAL_SCHEMA rows of every shard, in task order

**Faults**: a worker that dies (SIGKILL, a lost node) fails its Ray task, which Ray runs again
(``max_retries``) from its shard's start on any worker; a shard's rows come back only from an
attempt that finished, so no task is lost and none is counted twice. Held-out rollouts never land
(``land=False``), so a killed attempt leaves nothing behind.

Greedy decoding gives the same outcome per task on 1 or N workers as in process, up to float
differences of batch composition (a replica batches only its own shard's calls), which can flip
an argmax only where two tokens tie to within float rounding.

As for the update (:mod:`flow_assets.cluster.ray_training`), the driver is a process of its own:
``ray.init`` sets environment variables of the process that calls it.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

#: the driver's input and output files under its scratch directory
SPEC_FILE, ROWS_FILE = "ray_eval_spec.pkl", "ray_eval_rows.parquet"


def shards(n_tasks: int, workers: int) -> list[list[int]]:
    """Task indices of each worker: task ``i`` goes to worker ``i mod workers`` (every task once).

    Raises:
        ValueError: ``workers`` < 1.
    """
    if workers < 1:
        raise ValueError(f"workers must be >= 1, got {workers}")
    return [list(range(w, n_tasks, workers)) for w in range(workers)]


def _evaluate_shard(store, source, agent, agent_id: str, tasks: list, policies: dict, config, scratch: str, on_start=None) -> list[dict]:
    """One rollout worker: a gateway replica of its own and its shard's agents (every policy and
    mode); the rows of :func:`~flow_assets.serving.agents.evaluation.agents_rows`."""
    from flow_assets.serving.agents.evaluation import agents_rows
    from flow_assets.serving.gateway.serve import serve_policy

    if on_start is not None:
        on_start(tasks)
    with serve_policy(store, scratch, extra=policies) as server:
        return agents_rows(server.url, source.score, agent, agent_id, tasks, list(policies), config.temperatures, config.concurrency,
                           config.timeout_s)  # fmt: skip


def evaluate_on_ray(store, source, agent, agent_id: str, tasks: list, policies: dict, config, workers: int, scratch_dir: str | Path,
                    max_retries: int = 2, on_start=None):  # fmt: skip
    """Every policy's agents on ``tasks`` in each mode, over ``workers`` Ray rollout workers
    (module docstring), on the cluster this process is connected to
    (:func:`~flow_assets.cluster.ray_training.connect` first). Call it in a driver process of its
    own (:func:`run_eval_driver`).

    Args:
        policies: served name -> :class:`~flow_assets.serving.gateway.engine.AdapterRef` (paths
            every node can read).
        config: an :class:`~flow_assets.training.rounds.EvaluationConfig` (modes, temperatures,
            concurrency per worker, timeout).
        max_retries: attempts Ray makes again for a worker that died.
        on_start: called in each worker with its shard's tasks before it starts (pickled; e.g. a
            fault injected by a test).

    Returns:
        Rows of :data:`~flow_assets.rl.evaluation.EVAL_SCHEMA`, shards in task order per policy and mode.
    """
    import polars as pl
    import ray

    from flow_assets.rl.evaluation import EVAL_SCHEMA

    remote = ray.remote(num_cpus=1, max_retries=max_retries, retry_exceptions=False)(_evaluate_shard)
    parts = [
        remote.remote(store, source, agent, agent_id, [tasks[i] for i in shard], policies, config, str(Path(scratch_dir) / f"worker-{w}"), on_start)
        for w, shard in enumerate(shards(len(tasks), workers)) if shard
    ]  # fmt: skip
    rows = [row for part in ray.get(parts) for row in part]
    order = {t.task_id: i for i, t in enumerate(tasks)}
    frame = pl.DataFrame(rows, schema=EVAL_SCHEMA)
    return frame.with_columns(pl.col("task_id").replace_strict(order, return_dtype=pl.Int64).alias("_order")).sort("policy", "mode", "_order").drop("_order")


def run_eval_driver(store, source, agent, agent_id: str, tasks: list, policies: dict, config, workers: int, scratch_dir: str | Path,
                    address: str | None = None, max_retries: int = 2, on_start=None):  # fmt: skip
    """:func:`evaluate_on_ray` in a driver process of its own, connected to the cluster at
    ``address`` (``None``: a local one it starts and stops).

    Returns:
        The rows (a polars DataFrame of :data:`~flow_assets.rl.evaluation.EVAL_SCHEMA`).

    Raises:
        RuntimeError: the driver failed; the message holds the end of its output.
    """
    import polars as pl
    from ray import cloudpickle

    scratch = Path(scratch_dir)
    scratch.mkdir(parents=True, exist_ok=True)
    (scratch / ROWS_FILE).unlink(missing_ok=True)
    spec = scratch / SPEC_FILE
    spec.write_bytes(cloudpickle.dumps({"store": store, "source": source, "agent": agent, "agent_id": agent_id, "tasks": tasks,
                                        "policies": policies, "config": config, "workers": workers, "scratch_dir": str(scratch),
                                        "address": address, "max_retries": max_retries, "on_start": on_start}))  # fmt: skip
    done = subprocess.run([sys.executable, "-m", "flow_assets.cluster.ray_rollouts", str(spec)], capture_output=True, text=True)
    if done.returncode != 0 or not (scratch / ROWS_FILE).exists():
        raise RuntimeError(f"the Ray evaluation's driver failed (exit {done.returncode}):\n{(done.stdout + done.stderr)[-4000:]}")
    return pl.read_parquet(scratch / ROWS_FILE)


def _main(spec_path: str) -> None:
    from ray import cloudpickle

    from flow_assets.cluster.ray_training import connect

    spec = cloudpickle.loads(Path(spec_path).read_bytes())
    connect(spec.pop("address"))
    rows = evaluate_on_ray(**spec)
    rows.write_parquet(Path(spec["scratch_dir"]) / ROWS_FILE)


if __name__ == "__main__":
    _main(sys.argv[1])
