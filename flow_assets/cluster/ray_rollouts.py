"""Collection and held-out evaluation fanned out over Ray rollout workers (#31, items 1-3).

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

**Collection** (:func:`collect_on_ray`) lands what it runs, so a retried shard must not run again
what its killed attempt finished. Each worker's gateway replica lands its shard into a directory of
its own, ``<landing>/.ray-collect/<batch>/shard-<w>/`` (hidden: neither the sensor nor a gateway's
recovery looks there), through the gateway's usual journal: every finished rollout is one line,
appended and flushed before its agent hears back. A retried shard starts a replica on the same
directory, whose start-up recovery lands the killed attempt's open file as it is
(:meth:`~flow_assets.serving.gateway.landing.BatchLander.recover`); the shard then runs only the
``(task, sample)`` pairs no complete line holds. A finished rollout is thus kept, an unfinished one
(its agent never heard its finish) runs again, and none lands twice. When every shard is done the
driver writes the shards' lines into one file, ``<landing>/<source>/<batch>.jsonl`` (a hidden name,
then one rename: the sensor sees the whole batch or nothing); GRPO groups within a batch, so all G
rollouts of a task are on one worker and in one file. A line torn by the kill lands as well, as the
gateway's own recovery lands it, and the data plane quarantines it with its reason.

As for the update (:mod:`flow_assets.cluster.ray_training`), the driver is a process of its own:
``ray.init`` sets environment variables of the process that calls it.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

#: the driver's input and output files under its scratch directory
SPEC_FILE, ROWS_FILE, LANDED_FILE = "ray_eval_spec.pkl", "ray_eval_rows.parquet", "ray_collect_landed.json"
#: the hidden folder under the landing directory where the collection's shards land first
SCRATCH = ".ray-collect"


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
    with serve_policy(store, scratch, extra=policies, dtype=config.dtype) as server:
        return agents_rows(server.url, source.score, agent, agent_id, tasks, list(policies), config.temperatures, config.concurrency,
                           config.timeout_s, config.seed)  # fmt: skip


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


@dataclass(frozen=True)
class LandedBatch:
    """A batch the Ray collection landed (:func:`merge_shards`).

    Attributes:
        path: ``<landing>/<source>/<batch>.jsonl``.
        rollouts: complete records in it, one per ``(task, sample)``; ``torn_lines``: lines a
            killed worker left half-written (landed; the data plane quarantines them).
        failed_rollouts: records with ``metadata.error``; success_rate: share with
            ``outcome.success`` true, over ``rollouts``.
        mean_llm_calls / mean_tool_calls: per record.
    """

    path: Path
    rollouts: int
    torn_lines: int
    failed_rollouts: int
    success_rate: float
    mean_llm_calls: float
    mean_tool_calls: float


def shard_lines(shard_dir: Path, source: str, batch: str) -> Iterator[tuple[tuple[str, int] | None, dict | None, bytes]]:
    """Every line of ``batch``'s landed files in one shard's directory (``<batch>.jsonl`` and, after
    a recovery, ``<batch>-<k>.jsonl``), as ``((task_id, sample_index), record, line)``, key and
    record ``None`` for a line that is not a complete record (torn by a kill)."""
    folder = shard_dir / source
    if not folder.is_dir():
        return
    names = sorted(p for p in folder.iterdir() if p.name == f"{batch}.jsonl" or (p.name.startswith(f"{batch}-") and p.name.endswith(".jsonl")))
    for path in names:
        for line in path.read_bytes().splitlines(keepends=True):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
                key = (record["task_id"], int(record["metadata"]["sample_index"]))
            except (ValueError, KeyError, TypeError):
                key, record = None, None
            yield key, record, line if line.endswith(b"\n") else line + b"\n"


def _collect_shard(store, source, agent, agent_id: str, tasks: list, group_size: int, batch: str, folder: str, harness, gateway_config,
                   shard_dir: str, on_start=None) -> int:  # fmt: skip
    """One rollout worker of a collection: a gateway replica landing into ``shard_dir``, the
    shard's rollouts that no earlier attempt finished. Returns how many it ran."""
    import asyncio

    from flow_assets.serving.agents.harness import run_rollouts
    from flow_assets.serving.gateway.serve import serve_policy

    if on_start is not None:
        on_start(tasks, Path(shard_dir))
    with serve_policy(store, shard_dir, config=gateway_config) as server:  # its start lands a killed attempt's open file
        done = {key for key, _, _ in shard_lines(Path(shard_dir), folder, batch) if key is not None}
        results = asyncio.run(run_rollouts(server.url, agent, tasks, source.score, group_size, agent_id=agent_id, batch=batch,
                                           source=folder, config=harness, skip=done))  # fmt: skip
    return len(results)


def merge_shards(scratch: Path, shard_count: int, source: str, batch: str, landing_dir: str | Path) -> LandedBatch:
    """The shards' lines as one landed batch ``<landing>/<source>/<batch>.jsonl``: written under a
    hidden name, then renamed (the sensor never sees a part), then the shards' directories removed.

    Raises:
        FileExistsError: the batch has already landed (nothing is overwritten).
        RuntimeError: a ``(task, sample)`` in two shards' files (a rollout run twice).
    """
    target = Path(landing_dir) / source / f"{batch}.jsonl"
    if target.exists():
        raise FileExistsError(f"{target}: the batch has already landed")
    seen: set[tuple[str, int]] = set()
    records: list[dict] = []
    lines: list[bytes] = []
    torn = 0
    for w in range(shard_count):
        for key, record, line in shard_lines(scratch / f"shard-{w}", source, batch):
            if key is None:
                torn += 1
            elif key in seen:
                raise RuntimeError(f"{batch}: rollout {key} landed twice (shard {w})")
            else:
                seen.add(key)
                records.append(record)
            lines.append(line)
    target.parent.mkdir(parents=True, exist_ok=True)
    hidden = target.with_name(f".{batch}.merging")
    with hidden.open("wb") as out:
        out.writelines(lines)
        out.flush()
        os.fsync(out.fileno())
    os.rename(hidden, target)
    shutil.rmtree(scratch, ignore_errors=True)
    n = len(records)

    def mean(values) -> float:
        values = list(values)
        return float(sum(values) / len(values)) if values else 0.0

    return LandedBatch(
        target, n, torn,
        sum(bool(r.get("metadata", {}).get("error")) for r in records),
        mean(bool((r.get("outcome") or {}).get("success")) for r in records),
        mean(r.get("metadata", {}).get("llm_calls", 0) for r in records),
        mean(r.get("metadata", {}).get("tool_calls", 0) for r in records),
    )  # fmt: skip


def collect_on_ray(store, source, agent, agent_id: str, tasks: list, group_size: int, batch: str, folder: str, harness, gateway_config,
                   workers: int, landing_dir: str | Path, max_retries: int = 2, on_start=None) -> LandedBatch:  # fmt: skip
    """``group_size`` rollouts of each task over ``workers`` Ray rollout workers, landed as one
    batch with each rollout exactly once (module docstring), on the cluster this process is
    connected to. Call it in a driver process of its own (:func:`run_collect_driver`).

    Args:
        tasks: the batch's train tasks; task ``i`` goes to worker ``i mod workers`` with all its samples.
        batch / folder: the batch name and its landing sub-directory (``<landing>/<folder>/<batch>.jsonl``).
        harness / gateway_config: the :class:`~flow_assets.serving.agents.harness.HarnessConfig`
            (``land=True``) and :class:`~flow_assets.serving.gateway.config.GatewayConfig` of every
            replica (its seed the same on each: sampling is not reproducible across worker counts
            anyway, a replica batching only its own shard's calls).
        landing_dir: a directory every node can reach; the shards land under its hidden
            ``.ray-collect/<batch>/``.
        max_retries: attempts Ray makes again for a worker that died.
        on_start: called in each worker with its shard's tasks and directory before it starts.

    Raises:
        ray.exceptions.RayError: a shard failed more than ``max_retries`` times (the shards'
            landed lines stay under ``.ray-collect/<batch>/``, and a rerun keeps them).
    """
    import ray

    scratch = Path(landing_dir) / SCRATCH / batch
    parts = shards(len(tasks), workers)
    remote = ray.remote(num_cpus=1, max_retries=max_retries, retry_exceptions=False)(_collect_shard)
    refs = [
        remote.remote(store, source, agent, agent_id, [tasks[i] for i in shard], group_size, batch, folder, harness, gateway_config,
                      str(scratch / f"shard-{w}"), on_start)
        for w, shard in enumerate(parts) if shard
    ]  # fmt: skip
    ray.get(refs)
    return merge_shards(scratch, len(parts), folder, batch, landing_dir)


def run_collect_driver(store, source, agent, agent_id: str, tasks: list, group_size: int, batch: str, folder: str, harness, gateway_config,
                       workers: int, landing_dir: str | Path, address: str | None = None, max_retries: int = 2,
                       on_start=None) -> LandedBatch:  # fmt: skip
    """:func:`collect_on_ray` in a driver process of its own, connected to the cluster at
    ``address`` (``None``: a local one it starts and stops).

    Raises:
        RuntimeError: the driver failed; the message holds the end of its output.
    """
    from ray import cloudpickle

    scratch = Path(landing_dir) / SCRATCH / batch
    scratch.mkdir(parents=True, exist_ok=True)
    spec = scratch / SPEC_FILE
    spec.write_bytes(cloudpickle.dumps({"kind": "collect", "store": store, "source": source, "agent": agent, "agent_id": agent_id,
                                        "tasks": tasks, "group_size": group_size, "batch": batch, "folder": folder, "harness": harness,
                                        "gateway_config": gateway_config, "workers": workers, "landing_dir": str(landing_dir),
                                        "address": address, "max_retries": max_retries, "on_start": on_start}))  # fmt: skip
    result = Path(landing_dir) / SCRATCH / f"{batch}.{LANDED_FILE}"
    result.unlink(missing_ok=True)
    done = subprocess.run([sys.executable, "-m", "flow_assets.cluster.ray_rollouts", str(spec)], capture_output=True, text=True)
    if done.returncode != 0 or not result.exists():
        raise RuntimeError(f"the Ray collection's driver failed (exit {done.returncode}):\n{(done.stdout + done.stderr)[-4000:]}")
    fields = json.loads(result.read_text())
    result.unlink()
    return LandedBatch(**{**fields, "path": Path(fields["path"])})


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
    if spec.pop("kind", "evaluate") == "collect":
        landed = collect_on_ray(**spec)
        out = Path(spec["landing_dir"]) / SCRATCH / f"{spec['batch']}.{LANDED_FILE}"
        out.write_text(json.dumps({**landed.__dict__, "path": str(landed.path)}))
        return
    rows = evaluate_on_ray(**spec)
    rows.write_parquet(Path(spec["scratch_dir"]) / ROWS_FILE)


if __name__ == "__main__":
    _main(sys.argv[1])
