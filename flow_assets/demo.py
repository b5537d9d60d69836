"""``flowopt demo``: the real logs of ``../shared/data`` through the sensor path, end to end.

Every run lands in the local instance (``.dagster_home``), so ``make ui`` shows them afterwards.
The demo starts from a clean lake, landing directory and instance storage each time so its
numbers are reproducible.
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import polars as pl

from flow_assets.definitions import build_definitions
from flow_assets.local import REPO_ROOT, execute_requests, local_instance, run_job, tick_sensor
from flow_assets.policy.evaluate import evaluate_policy
from flow_assets.rl.evaluation import compare_policies
from flow_assets.summary import batch_summary, source_summary
from flow_assets.training import EvaluationConfig
from resources.lake import TrajectoryLake
from resources.registry import AdapterRegistry

SHARED_DATA = REPO_ROOT.parent / "shared" / "data"
_INSTANCE_STORAGE = ("storage", "history", "schedules", "logs", ".logs_queue", ".telemetry")


def land_shared_data(data_dir: Path, landing: Path) -> list[Path]:
    """Copy every ``*.json`` log of ``data_dir`` into ``landing/<source>/...`` the way a writer
    must (write ``.tmp``, then rename); the source is the top folder (tau-bench, tau2-bench,
    fireact). Returns the landed paths.

    Raises:
        FileNotFoundError: ``data_dir`` does not exist (the message names it).
    """
    if not data_dir.is_dir():
        raise FileNotFoundError(f"real agent logs not found at {data_dir}")
    landed = []
    for src in sorted(data_dir.rglob("*.json")):
        dest = landing / src.relative_to(data_dir)
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp = dest.with_name(dest.name + ".tmp")
        shutil.copyfile(src, tmp)
        tmp.rename(dest)
        landed.append(dest)
    return landed


def _reset(home: Path, lake: Path, landing: Path, models: Path) -> None:
    for path in (lake, landing, models, *(home / name for name in _INSTANCE_STORAGE)):
        if path.is_dir():
            shutil.rmtree(path)
        elif path.exists():
            path.unlink()


def _print_table(frame: pl.DataFrame) -> None:
    cols = frame.columns
    rows = [[str(v) for v in row] for row in frame.iter_rows()]
    widths = [max(len(c), *(len(r[i]) for r in rows)) if rows else len(c) for i, c in enumerate(cols)]
    print("  ".join(c.ljust(w) for c, w in zip(cols, widths)))
    for r in rows:
        print("  ".join(v.ljust(w) for v, w in zip(r, widths)))


def run_round(defs, instance, models_root: Path, round_index: int, collect_config: dict) -> dict:
    """One training round as Dagster runs: collect -> (sensor) data plane -> (sensor) training.

    Returns the round's line: champion after the round, held-out success (greedy / sampled) of the
    champion, mean reward of the batch, and seconds split into generation, training and Dagster
    overhead (everything else: run bookkeeping, sensor ticks, model loading, lake I/O).
    """
    started = time.perf_counter()
    collected = run_job(defs, instance, "collect_rollouts_job", run_config={"ops": {"collect_rollouts": {"config": collect_config}}})
    if not collected.success:
        raise RuntimeError(f"round {round_index}: collection failed")
    collect_meta = collected.output_for_node("collect_rollouts")
    tick = execute_requests(defs, instance, "log_batch_job", tick_sensor(defs, instance, "new_logs_sensor"))
    if tick.failed or len(tick.succeeded) != 1:
        raise RuntimeError(f"round {round_index}: data plane of {collect_meta} failed: {tick.failed}")
    key = tick.succeeded[0]
    train_tick = tick_sensor(defs, instance, "training_round_sensor", instance_cursor(instance))
    save_cursor(instance, train_tick.cursor)
    if [r.partition_key for r in train_tick.run_requests] != [key]:
        raise RuntimeError(f"round {round_index}: training sensor did not request batch {key}")
    run_job(defs, instance, "training_round_job", partition_key=key)
    run_dir = models_root / "runs" / key
    summary = json.loads((run_dir / "round.json").read_text())
    evaluation = json.loads((run_dir / "evaluation.json").read_text())
    registry = AdapterRegistry(root=str(models_root))
    champion = registry.champion()["version"]
    promoted = champion != summary["parent_version"]
    holder = "candidate" if promoted else "champion"
    report = evaluation["report"]
    collect_seconds = _collect_generation_seconds(instance, collected.run_id)
    generation = collect_seconds + evaluation["generation_seconds"]
    training = summary["training_seconds"]
    total = time.perf_counter() - started
    return {
        "round": round_index,
        "batch": key,
        "champion": champion,
        "promoted": promoted,
        "gate": evaluation["gate"],
        "greedy_success": report["greedy"][holder]["success_rate"]["rate"],
        "sampled_success": report["sampled"][holder]["success_rate"]["rate"],
        "base_greedy_success": report["greedy"]["champion"]["success_rate"]["rate"] if round_index == 1 else None,
        "base_sampled_success": report["sampled"]["champion"]["success_rate"]["rate"] if round_index == 1 else None,
        "mean_reward": summary["reward_mean"],
        "seconds": round(total, 2),
        "generation_seconds": round(generation, 2),
        "training_seconds": round(training, 2),
        "dagster_overhead_seconds": round(total - generation - training, 2),
    }


def _collect_generation_seconds(instance, run_id: str) -> float:
    from dagster import DagsterEventType

    records = instance.get_records_for_run(run_id, of_type=DagsterEventType.STEP_OUTPUT).records
    for record in records:
        meta = record.event_log_entry.dagster_event.event_specific_data.metadata
        if "generation_seconds" in meta:
            return float(meta["generation_seconds"].value)
    return 0.0


def instance_cursor(instance) -> str | None:
    """The training sensor's cursor as this demo left it (kept in the instance's key-value store)."""
    return instance.run_storage.get_cursor_values({"flowopt/training_round_sensor"}).get("flowopt/training_round_sensor")


def save_cursor(instance, cursor: str | None) -> None:
    """Remember the training sensor's cursor between in-process ticks."""
    if cursor is not None:
        instance.run_storage.set_cursor_values({"flowopt/training_round_sensor": cursor})


def untouched_held_out_check(defs, models_root: Path, gated_tasks: int) -> dict:
    """The SFT base (v0) vs the final champion on the held-out tasks that no gate has seen.

    Every round's gate evaluates on the first ``gated_tasks`` held-out tasks, so the gain measured
    there is also the set that selected the promotions; the rest of the held-out split gives an
    unbiased check. Returns :func:`compare_policies`' report (candidate = final champion).
    """
    policy, tasks = defs.resources["policy"], defs.resources["tasks"]
    source = tasks.source()
    fresh = source.tasks("held_out")[gated_tasks:]
    registry = AdapterRegistry(root=str(models_root))
    frames = []
    for name, adapter in (("champion", str(policy.adapter_dir("v0"))), ("candidate", registry.champion()["adapter_path"])):
        loaded = policy.load(adapter)
        frames.append(
            evaluate_policy(
                lambda prompts, cfg, loaded=loaded, adapter=adapter: policy.sample(prompts, cfg, adapter, loaded),
                fresh, source, name, policy.max_new_tokens,
            )
        )
    return compare_policies(pl.concat(frames))


def run_demo(
    home: Path = REPO_ROOT / ".dagster_home",
    lake_root: Path = REPO_ROOT / ".lake",
    landing_dir: Path = REPO_ROOT / ".landing",
    models_root: Path = REPO_ROOT / ".models",
    data_dir: Path = SHARED_DATA,
    report: Path = REPO_ROOT / "reports" / "demo-summary.json",
    rounds: int = 20,
    collect_config: dict | None = None,
) -> dict:
    """Run the demo and write ``report``; returns the report's content.

    1. the real logs of ``data_dir`` through the sensor path and the data plane (they stop after
       ``advantages``: no trainable policy produced them);
    2. ``base_policy`` (tiny model + SFT warm start), then ``rounds`` training rounds.

    Raises:
        RuntimeError: a batch of the real logs or a round failed (the message names it).
    """
    started = time.perf_counter()
    _reset(home, lake_root, landing_dir, models_root)
    instance = local_instance(home)
    defs = build_definitions(str(lake_root), str(landing_dir), models_root=str(models_root))
    land_shared_data(data_dir, landing_dir)
    tick = tick_sensor(defs, instance, "new_logs_sensor")
    execute_requests(defs, instance, "log_batch_job", tick)
    if tick.failed:
        raise RuntimeError(f"demo batches failed: {tick.failed}")
    lake = TrajectoryLake(root=str(lake_root))
    per_batch = batch_summary(lake, tick.succeeded)
    per_source = source_summary(lake, per_batch)
    data_plane_seconds = time.perf_counter() - started
    print(f"\nflowopt demo: {len(tick.succeeded)} log batches through the data plane in {data_plane_seconds:.1f} s\n")
    _print_table(per_source)
    # the real logs are decided once: they are not trainable, so they stop after advantages
    first = tick_sensor(defs, instance, "training_round_sensor")
    save_cursor(instance, first.cursor)
    if first.run_requests:
        raise RuntimeError("the real agent logs must not start a training round")

    print("\nbase policy: tiny Llama-style model, SFT warm start ...", flush=True)
    t0 = time.perf_counter()
    if not run_job(defs, instance, "base_policy_job").success:
        raise RuntimeError("base_policy failed")
    base_seconds = time.perf_counter() - t0
    print(f"base policy ready in {base_seconds:.1f} s\n")
    header = (
        f"{'round':>5}  {'champion':>8}  {'greedy':>6}  {'sampled':>7}  {'reward':>6}  {'seconds':>7}  "
        "(gen / train / dagster)  gate"
    )
    print(header)
    lines = []
    for k in range(1, rounds + 1):
        line = run_round(defs, instance, models_root, k, collect_config or {})
        lines.append(line)
        print(
            f"{k:>5}  {line['champion']:>8}  {line['greedy_success']:>6.3f}  {line['sampled_success']:>7.3f}  "
            f"{line['mean_reward']:>6.3f}  {line['seconds']:>7.1f}  ({line['generation_seconds']:.1f} / "
            f"{line['training_seconds']:.1f} / {line['dagster_overhead_seconds']:.1f})  "
            + ("promoted" if line["promoted"] else "blocked: " + ", ".join(n for n, g in line["gate"].items() if not g["passed"])),
            flush=True,
        )
    base_sampled = lines[0]["base_sampled_success"]
    base_greedy = lines[0]["base_greedy_success"]
    final = lines[-1]
    gain = final["sampled_success"] - base_sampled
    check = untouched_held_out_check(defs, models_root, EvaluationConfig().max_tasks)
    fresh = {
        mode: {
            "n_tasks": check[mode]["n_tasks"],
            "base": check[mode]["champion"]["success_rate"],
            "final": check[mode]["candidate"]["success_rate"],
            "gain": check[mode]["gain"],
            "mcnemar_p": check[mode]["mcnemar"]["p_value"],
        }
        for mode in check
    }
    seconds = time.perf_counter() - started
    print(
        f"\nSFT base held-out success: greedy {base_greedy:.3f}, sampled {base_sampled:.3f}; "
        f"final champion {final['champion']}: greedy {final['greedy_success']:.3f}, sampled {final['sampled_success']:.3f} "
        f"(gain {gain:+.3f} sampled, {final['greedy_success'] - base_greedy:+.3f} greedy); total {seconds:.0f} s"
    )
    unseen = fresh["sampled"]
    print(
        f"on {unseen['n_tasks']} held-out tasks no gate saw: sampled {unseen['base']['rate']:.3f} -> "
        f"{unseen['final']['rate']:.3f} (gain {unseen['gain']:+.3f}, McNemar p={unseen['mcnemar_p']:.2g}); greedy {fresh['greedy']['base']['rate']:.3f} -> "
        f"{fresh['greedy']['final']['rate']:.3f}"
    )
    content = {
        "data_plane": {
            "seconds": round(data_plane_seconds, 2),
            "batches": per_batch.to_dicts(),
            "sources": per_source.to_dicts(),
        },
        "training": {
            "base_policy_seconds": round(base_seconds, 2),
            "base_greedy_success": base_greedy,
            "base_sampled_success": base_sampled,
            "rounds": lines,
            "final_champion": final["champion"],
            "gain_sampled": gain,
            "gain_greedy": final["greedy_success"] - base_greedy,
            "untouched_held_out": fresh,
        },
        "seconds": round(seconds, 2),
        "dagster_home": str(home),
    }
    report.parent.mkdir(parents=True, exist_ok=True)
    report.write_text(json.dumps(content, indent=2) + "\n")
    print(f"\nwritten {report}; `make ui` shows the runs and materialisations")
    return content
