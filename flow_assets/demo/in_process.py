"""Training rounds driven from this process (no daemon): what ``flowopt demo-real`` and the
``training_round`` benchmark run: each round's jobs executed in order on a local instance, one
printed line per round, and the base against the final champion on every held-out task."""

from __future__ import annotations

import time
from pathlib import Path

import polars as pl

from flow_assets.serving.gateway.engine import AdapterRef
from flow_assets.runtime.local import execute_requests, run_job, tick_sensor
from flow_assets.rl.evaluation import compare_policies
from flow_assets.training.rounds import EvaluationConfig, evaluate_agents, read_evaluation, read_round_summary
from flow_assets.training.run_config import TRAINING_JOB, RoundSettings
from resources.registry import AdapterRegistry
from flow_assets.demo.state import instance_cursor, save_cursor


def _print_table(frame: pl.DataFrame) -> None:
    cols = frame.columns
    rows = [[str(v) for v in row] for row in frame.iter_rows()]
    widths = [max(len(c), *(len(r[i]) for r in rows)) if rows else len(c) for i, c in enumerate(cols)]
    print("  ".join(c.ljust(w) for c, w in zip(cols, widths)))
    for r in rows:
        print("  ".join(v.ljust(w) for v, w in zip(r, widths)))


def _collect_metadata(instance, run_id: str) -> dict:
    """The metadata of the ``rollouts`` materialisation of run ``run_id`` (empty if none)."""
    from dagster import AssetKey, DagsterEventType

    records = instance.get_records_for_run(run_id, of_type=DagsterEventType.ASSET_MATERIALIZATION).records
    for record in records:
        materialization = record.event_log_entry.asset_materialization
        if materialization is not None and materialization.asset_key == AssetKey("rollouts"):
            return {k: v.value for k, v in materialization.metadata.items()}
    return {}


def _line(index: int, key: str, champion: str, promoted: bool, summary, evaluation, collect_meta: dict, total: float) -> dict:
    """A round's line for the demo's table and report (``total``: the round's seconds)."""
    holder = "candidate" if promoted else "champion"
    report = evaluation.report
    generation = float(collect_meta.get("generation_seconds", 0.0)) + evaluation.generation_seconds
    return {
        "round": index,
        "batch": key,
        "champion": champion,
        "promoted": promoted,
        "gate": {r.name: {"passed": r.passed, "reason": r.reason} for r in evaluation.gate},
        "greedy_success": report["greedy"][holder]["success_rate"]["rate"] if "greedy" in report else None,
        "sampled_success": report["sampled"][holder]["success_rate"]["rate"] if "sampled" in report else None,
        "base_greedy_success": report["greedy"]["champion"]["success_rate"]["rate"] if index == 1 and "greedy" in report else None,
        "base_sampled_success": report["sampled"]["champion"]["success_rate"]["rate"] if index == 1 and "sampled" in report else None,
        "mean_reward": summary.reward_mean,
        "collect_success_rate": collect_meta.get("success_rate"),
        "mean_llm_calls": collect_meta.get("mean_llm_calls"),
        "mean_tool_calls": collect_meta.get("mean_tool_calls"),
        "seconds": round(total, 2),
        "generation_seconds": round(generation, 2),
        "training_seconds": round(summary.training_seconds, 2),
        "other_seconds": round(total - generation - summary.training_seconds, 2),
    }


def run_round(defs, instance, models_root: Path, round_index: int, collect_config: dict, train_config: dict | None = None,
              eval_config: dict | None = None) -> dict:  # fmt: skip
    """One training round as Dagster runs: collect -> (sensor) data plane -> (sensor) training.

    Returns the round's line: champion after the round, held-out success (greedy / sampled) of the
    champion, mean reward of the batch, LLM and tool calls per collected rollout, and seconds
    split into generation (the agents' work through the gateway, collection and evaluation),
    training and the rest (Dagster runs, sensor ticks, model loading, lake I/O).
    ``train_config`` / ``eval_config`` hold fields of ``policy_checkpoint`` / ``evaluation_report``;
    :class:`~flow_assets.training.run_config.RoundSettings` validates them and builds the run config.
    """
    started = time.perf_counter()
    collected = run_job(defs, instance, "collect_rollouts_job", run_config={"ops": {"rollouts": {"config": collect_config}}})
    if not collected.success:
        raise RuntimeError(f"round {round_index}: collection failed")
    collect_meta = _collect_metadata(instance, collected.run_id)
    tick = execute_requests(defs, instance, "log_batch_job", tick_sensor(defs, instance, "new_logs_sensor"))
    if tick.failed or len(tick.succeeded) != 1:
        raise RuntimeError(f"round {round_index}: data plane of {collect_meta.get('file')} failed: {tick.failed}")
    key = tick.succeeded[0]
    train_tick = tick_sensor(defs, instance, "training_round_sensor", instance_cursor(instance))
    save_cursor(instance, train_tick.cursor)
    if [r.partition_key for r in train_tick.run_requests] != [key]:
        raise RuntimeError(f"round {round_index}: training sensor did not request batch {key}")
    run_config = RoundSettings(trainer=train_config or {}, evaluation=eval_config or {}).run_config()
    run_job(defs, instance, TRAINING_JOB, partition_key=key, run_config=run_config)
    run_job(defs, instance, "training_history_job")  # what training_history_sensor asks for after each round
    run_dir = models_root / "runs" / key
    summary, evaluation = read_round_summary(run_dir), read_evaluation(run_dir)
    champion = AdapterRegistry(root=str(models_root)).champion()["version"]
    promoted = champion != summary.parent_version
    return _line(round_index, key, champion, promoted, summary, evaluation, collect_meta, time.perf_counter() - started)


def print_rounds_header() -> None:
    """Print the header of the per-round table that :func:`print_round` fills (stdout)."""
    print(
        f"{'round':>5}  {'champion':>8}  {'greedy':>6}  {'sampled':>7}  {'reward':>6}  {'calls':>5}  {'seconds':>7}  "
        "(agents / train / other)  gate"
    )


def _rate(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def print_round(line: dict, progress: str) -> None:
    """Print one round's line (a :func:`run_round` result: success rates, mean reward, seconds split
    into agents / train / other, the gate's verdict) followed by ``[progress]``."""
    calls = line["mean_llm_calls"]
    print(
        f"{line['round']:>5}  {line['champion']:>8}  {_rate(line['greedy_success']):>6}  {_rate(line['sampled_success']):>7}  "
        f"{line['mean_reward']:>6.3f}  {'-' if calls is None else f'{calls:.2f}':>5}  {line['seconds']:>7.1f}  "
        f"({line['generation_seconds']:.1f} / {line['training_seconds']:.1f} / {line['other_seconds']:.1f})  "
        + ("promoted" if line["promoted"] else "blocked: " + ", ".join(n for n, g in line["gate"].items() if not g["passed"]))
        + f"  [{progress}]",
        flush=True,
    )


def run_rounds(defs, instance, models_root: Path, rounds: int, base_config: dict | None, collect: dict,
               train: dict | None, evaluation: dict | None) -> tuple[list[dict], float]:  # fmt: skip
    """``base_policy`` then ``rounds`` training rounds; returns the rounds' lines and the base's seconds."""
    t0 = time.perf_counter()
    base_run = {"ops": {"base_policy": {"config": base_config}}} if base_config else None
    if not run_job(defs, instance, "base_policy_job", run_config=base_run).success:
        raise RuntimeError("base_policy failed")
    base_seconds = time.perf_counter() - t0
    print(f"base policy ready in {base_seconds:.1f} s\n")
    print_rounds_header()
    lines = []
    for k in range(1, rounds + 1):
        lines.append(run_round(defs, instance, models_root, k, collect, train, evaluation))
        spent = sum(line["seconds"] for line in lines)
        print_round(lines[-1], f"{k}/{rounds}, ETA {spent / k * (rounds - k):.0f} s")
    return lines, base_seconds


#: the seed of the final base-vs-champion check: the rounds' gates evaluate with seed 0
#: (:class:`EvaluationConfig`'s default) and chose the champion on the same random numbers for the
#: held-out tasks they share with the check; the check draws others, so the choice does not
#: flatter the figure it reports
FINAL_EVAL_SEED = 1


def base_vs_final(defs, models_root: Path, tasks: list, scratch: Path, config: EvaluationConfig | None = None) -> dict:
    """The base (v0) and the final champion as agents on ``tasks``, greedy and sampled (at
    ``config``'s temperature; default :class:`EvaluationConfig` with seed :data:`FINAL_EVAL_SEED`);
    :func:`compare_policies`' report (candidate = final champion). Both sample a task with the
    same seed (common random numbers)."""
    policy, source_resource = defs.resources["policy"], defs.resources["tasks"]
    source = source_resource.source()
    champion = AdapterRegistry(root=str(models_root)).champion()
    policies = {
        "champion": AdapterRef("v0", str(policy.adapter_dir("v0"))),
        "candidate": AdapterRef(champion["version"], champion["adapter_path"]),
    }
    rows, _ = evaluate_agents(
        policy.store(), source, source_resource.agent_fn(), source_resource.agent_id, tasks, policies,
        config or EvaluationConfig(seed=FINAL_EVAL_SEED), scratch,
    )
    return compare_policies(rows)


def held_out_summary(check: dict) -> dict:
    return {
        mode: {
            "n_tasks": check[mode]["n_tasks"],
            "base": check[mode]["champion"]["success_rate"],
            "final": check[mode]["candidate"]["success_rate"],
            "gain": check[mode]["gain"],
            "mcnemar_p": check[mode]["mcnemar"]["p_value"],
        }
        for mode in check
    }
