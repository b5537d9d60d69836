"""``flowopt demo``: the real logs of ``../shared/data`` through the sensor path, then two trainable
agents in the loop, end to end.

1. the real agent logs through ``new_logs_sensor`` and the data plane (they stop after
   ``advantages``: no trainable policy produced them);
2. ``spell_backward``, a one-turn agent: base policy (tiny model + SFT), then training rounds;
3. the calculator agent, multi-turn and tool-using: base policy, then training rounds, every
   rollout through the gateway over real HTTP with the official ``openai`` client; finally the
   SFT base and the final champion on every held-out task.

Every run lands in the local instance (``.dagster_home``), so ``make ui`` shows them afterwards.
The demo starts from a clean lake, landing directory, models and instance storage each time so its
numbers are reproducible. Policies: the calculator agent's in ``.models`` (what ``flowopt serve
--models .models`` serves afterwards), spell_backward's in ``.models/spell_backward``.
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import polars as pl

from flow_assets.definitions import build_definitions
from flow_assets.gateway.engine import AdapterRef
from flow_assets.local import REPO_ROOT, execute_requests, local_instance, run_job, tick_sensor
from flow_assets.rl.evaluation import compare_policies
from flow_assets.rounds import EvaluationConfig, evaluate_agents, read_evaluation, read_round_summary
from flow_assets.summary import batch_summary, source_summary
from resources.lake import TrajectoryLake
from resources.registry import AdapterRegistry
from resources.tasks import TaskSourceResource

SHARED_DATA = REPO_ROOT.parent / "shared" / "data"
_INSTANCE_STORAGE = ("storage", "history", "schedules", "logs", ".logs_queue", ".telemetry")
_TRAINING_CURSOR = "flowopt/training_round_sensor"

#: spell_backward: a short warm start (with the chat template, the default 150 SFT steps already
#: solve ~97% of held-out words greedily, leaving GRPO nothing to do), then rounds of the
#: champion's one-turn agents on 128 train words, 8 each
SPELL_BASE = {"sft": {"steps": 50}}
SPELL_COLLECT = {"tasks_per_batch": 128, "group_size": 8}
SPELL_EVAL = {"max_tasks": 200}
#: calculator rounds: 64 train tasks, 8 agents each, two LLM calls per agent when it uses its tool
AGENT_COLLECT = {"tasks_per_batch": 64, "group_size": 8}
AGENT_EVAL = {"max_tasks": 150, "modes": ["sampled"]}  # the gate's metric only: half the agents' work
AGENT_BASE = {"sft_demonstrations": 1000, "sft": {"steps": 200}}
AGENT_TRAIN = {"learning_rate": 2e-3}


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
    # prepared model presets (models/presets) are inputs, not demo output: they stay
    kept = models.iterdir() if models.is_dir() else ()
    for path in (lake, landing, *(p for p in kept if p.name != "presets"), *(home / name for name in _INSTANCE_STORAGE)):
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


def instance_cursor(instance) -> str | None:
    """The training sensor's cursor as this demo left it (kept in the instance's key-value store)."""
    return instance.run_storage.get_cursor_values({_TRAINING_CURSOR}).get(_TRAINING_CURSOR)


def save_cursor(instance, cursor: str | None) -> None:
    """Remember the training sensor's cursor between in-process ticks."""
    if cursor is not None:
        instance.run_storage.set_cursor_values({_TRAINING_CURSOR: cursor})


def _collect_metadata(instance, run_id: str) -> dict:
    from dagster import DagsterEventType

    records = instance.get_records_for_run(run_id, of_type=DagsterEventType.STEP_OUTPUT).records
    for record in records:
        meta = record.event_log_entry.dagster_event.event_specific_data.metadata
        if "generation_seconds" in meta:
            return {k: v.value for k, v in meta.items()}
    return {}


def run_round(defs, instance, models_root: Path, round_index: int, collect_config: dict, train_config: dict | None = None,
              eval_config: dict | None = None) -> dict:  # fmt: skip
    """One training round as Dagster runs: collect -> (sensor) data plane -> (sensor) training.

    Returns the round's line: champion after the round, held-out success (greedy / sampled) of the
    champion, mean reward of the batch, LLM and tool calls per collected rollout, and seconds
    split into generation (the agents' work through the gateway, collection and evaluation),
    training and the rest (Dagster runs, sensor ticks, model loading, lake I/O).
    """
    started = time.perf_counter()
    collected = run_job(defs, instance, "collect_rollouts_job", run_config={"ops": {"collect_rollouts": {"config": collect_config}}})
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
    run_config = {"ops": {"policy_checkpoint": {"config": train_config or {}}, "evaluation_report": {"config": eval_config or {}}}}
    run_job(defs, instance, "training_round_job", partition_key=key, run_config=run_config)
    run_dir = models_root / "runs" / key
    summary, evaluation = read_round_summary(run_dir), read_evaluation(run_dir)
    champion = AdapterRegistry(root=str(models_root)).champion()["version"]
    promoted = champion != summary.parent_version
    holder = "candidate" if promoted else "champion"
    report = evaluation.report
    generation = float(collect_meta.get("generation_seconds", 0.0)) + evaluation.generation_seconds
    total = time.perf_counter() - started
    return {
        "round": round_index,
        "batch": key,
        "champion": champion,
        "promoted": promoted,
        "gate": {r.name: {"passed": r.passed, "reason": r.reason} for r in evaluation.gate},
        "greedy_success": report["greedy"][holder]["success_rate"]["rate"] if "greedy" in report else None,
        "sampled_success": report["sampled"][holder]["success_rate"]["rate"],
        "base_greedy_success": report["greedy"]["champion"]["success_rate"]["rate"] if round_index == 1 and "greedy" in report else None,
        "base_sampled_success": report["sampled"]["champion"]["success_rate"]["rate"] if round_index == 1 else None,
        "mean_reward": summary.reward_mean,
        "collect_success_rate": collect_meta.get("success_rate"),
        "mean_llm_calls": collect_meta.get("mean_llm_calls"),
        "mean_tool_calls": collect_meta.get("mean_tool_calls"),
        "seconds": round(total, 2),
        "generation_seconds": round(generation, 2),
        "training_seconds": round(summary.training_seconds, 2),
        "other_seconds": round(total - generation - summary.training_seconds, 2),
    }


def _print_rounds_header() -> None:
    print(
        f"{'round':>5}  {'champion':>8}  {'greedy':>6}  {'sampled':>7}  {'reward':>6}  {'calls':>5}  {'seconds':>7}  "
        "(agents / train / other)  gate"
    )


def _rate(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def _print_round(line: dict) -> None:
    calls = line["mean_llm_calls"]
    print(
        f"{line['round']:>5}  {line['champion']:>8}  {_rate(line['greedy_success']):>6}  {line['sampled_success']:>7.3f}  "
        f"{line['mean_reward']:>6.3f}  {calls if calls is None else f'{calls:.2f}':>5}  {line['seconds']:>7.1f}  "
        f"({line['generation_seconds']:.1f} / {line['training_seconds']:.1f} / {line['other_seconds']:.1f})  "
        + ("promoted" if line["promoted"] else "blocked: " + ", ".join(n for n, g in line["gate"].items() if not g["passed"])),
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
    _print_rounds_header()
    lines = []
    for k in range(1, rounds + 1):
        lines.append(run_round(defs, instance, models_root, k, collect, train, evaluation))
        _print_round(lines[-1])
    return lines, base_seconds


def base_vs_final(defs, models_root: Path, tasks: list, scratch: Path, config: EvaluationConfig | None = None) -> dict:
    """The base (v0) and the final champion as agents on ``tasks``, greedy and sampled (at
    ``config``'s temperature); :func:`compare_policies`' report (candidate = final champion)."""
    policy, source_resource = defs.resources["policy"], defs.resources["tasks"]
    source = source_resource.source()
    champion = AdapterRegistry(root=str(models_root)).champion()
    policies = {
        "champion": AdapterRef("v0", str(policy.adapter_dir("v0"))),
        "candidate": AdapterRef(champion["version"], champion["adapter_path"]),
    }
    rows, _ = evaluate_agents(
        policy.store(), source, source_resource.agent_fn(), source_resource.agent_id, tasks, policies, config or EvaluationConfig(), scratch
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


def _agent_batch_stats(lake: TrajectoryLake, keys: list[str]) -> dict:
    """LLM calls and tool calls per collected trajectory of the agent's batches (from the lake)."""
    steps = lake.scan("steps").filter(pl.col("batch").is_in(keys))
    per = (
        steps.group_by("batch", "trajectory_id")
        .agg(llm_calls=pl.col("token_ids").is_not_null().sum(), tool_calls=(pl.col("kind") == "observation").sum())
        .collect()
    )
    return {
        "trajectories": per.height,
        "mean_llm_calls_per_trajectory": float(per["llm_calls"].mean()),
        "mean_tool_calls_per_trajectory": float(per["tool_calls"].mean()),
    }


def run_demo(
    home: Path = REPO_ROOT / ".dagster_home",
    lake_root: Path = REPO_ROOT / ".lake",
    landing_dir: Path = REPO_ROOT / ".landing",
    models_root: Path = REPO_ROOT / ".models",
    data_dir: Path = SHARED_DATA,
    report: Path = REPO_ROOT / "reports" / "demo-summary.json",
    rounds: int = 4,
    agent_rounds: int = 12,
) -> dict:
    """Run the demo and write ``report``; returns the report's content.

    Raises:
        RuntimeError: a batch of the real logs or a round failed (the message names it).
    """
    started = time.perf_counter()
    _reset(home, lake_root, landing_dir, models_root)
    instance = local_instance(home)
    lake = TrajectoryLake(root=str(lake_root))

    # 1. the real logs
    spell_models = models_root / "spell_backward"
    spell = build_definitions(str(lake_root), str(landing_dir), models_root=str(spell_models), tasks=TaskSourceResource(), settle_seconds=0)
    land_shared_data(data_dir, landing_dir)
    tick = tick_sensor(spell, instance, "new_logs_sensor")
    execute_requests(spell, instance, "log_batch_job", tick)
    if tick.failed:
        raise RuntimeError(f"demo batches failed: {tick.failed}")
    per_batch = batch_summary(lake, tick.succeeded)
    per_source = source_summary(lake, per_batch)
    data_plane_seconds = time.perf_counter() - started
    print(f"\nflowopt demo: {len(tick.succeeded)} log batches through the data plane in {data_plane_seconds:.1f} s\n")
    _print_table(per_source)
    first = tick_sensor(spell, instance, "training_round_sensor")
    save_cursor(instance, first.cursor)
    if first.run_requests:
        raise RuntimeError("the real agent logs must not start a training round")

    # 2. spell_backward, one-turn
    print("\nspell_backward (one-turn agent): tiny Llama-style model, SFT warm start ...", flush=True)
    t0 = time.perf_counter()
    lines, base_seconds = run_rounds(spell, instance, spell_models, rounds, SPELL_BASE, SPELL_COLLECT, None, SPELL_EVAL)
    spell_seconds = time.perf_counter() - t0
    base_sampled, base_greedy = lines[0]["base_sampled_success"], lines[0]["base_greedy_success"]
    final = lines[-1]
    source = spell.resources["tasks"].source()
    fresh = held_out_summary(base_vs_final(spell, spell_models, source.tasks("held_out")[SPELL_EVAL["max_tasks"] :], spell_models))
    print(
        f"\nspell_backward: SFT base held-out success greedy {base_greedy:.3f}, sampled {base_sampled:.3f}; final champion "
        f"{final['champion']}: greedy {final['greedy_success']:.3f}, sampled {final['sampled_success']:.3f}; on "
        f"{fresh['sampled']['n_tasks']} held-out tasks no gate saw: sampled {fresh['sampled']['base']['rate']:.3f} -> "
        f"{fresh['sampled']['final']['rate']:.3f} (McNemar p={fresh['sampled']['mcnemar_p']:.2g}); {spell_seconds:.0f} s"
    )

    # 3. the calculator agent, multi-turn with a tool, through the gateway
    print("\ncalculator agent (multi-turn, calls a calculator tool; every call through the gateway over HTTP) ...", flush=True)
    t0 = time.perf_counter()
    agent_defs = build_definitions(str(lake_root), str(landing_dir), models_root=str(models_root), tasks=TaskSourceResource(kind="calculator"), settle_seconds=0)
    agent_lines, agent_base_seconds = run_rounds(
        agent_defs, instance, models_root, agent_rounds, AGENT_BASE, AGENT_COLLECT, AGENT_TRAIN, AGENT_EVAL
    )
    agent_source = agent_defs.resources["tasks"].source()
    check = held_out_summary(base_vs_final(agent_defs, models_root, agent_source.tasks("held_out"), models_root))
    stats = _agent_batch_stats(lake, [line["batch"] for line in agent_lines])
    agent_seconds = time.perf_counter() - t0
    sampled = check["sampled"]
    print(
        f"\ncalculator agent on all {sampled['n_tasks']} held-out tasks: sampled success {sampled['base']['rate']:.3f} (SFT base) -> "
        f"{sampled['final']['rate']:.3f} ({agent_lines[-1]['champion']}), gain {sampled['gain']:+.3f} "
        f"(McNemar p={sampled['mcnemar_p']:.2g}); greedy {check['greedy']['base']['rate']:.3f} -> {check['greedy']['final']['rate']:.3f}; "
        f"{stats['mean_llm_calls_per_trajectory']:.2f} LLM calls and {stats['mean_tool_calls_per_trajectory']:.2f} tool calls "
        f"per collected trajectory; {agent_seconds:.0f} s"
    )
    seconds = time.perf_counter() - started
    content = {
        "data_plane": {
            "seconds": round(data_plane_seconds, 2),
            "batches": per_batch.to_dicts(),
            "sources": per_source.to_dicts(),
        },
        "training": {
            "agent_id": spell.resources["tasks"].agent_id,
            "base_policy_seconds": round(base_seconds, 2),
            "base_greedy_success": base_greedy,
            "base_sampled_success": base_sampled,
            "rounds": lines,
            "final_champion": final["champion"],
            "gain_sampled": final["sampled_success"] - base_sampled,
            "gain_greedy": final["greedy_success"] - base_greedy,
            "untouched_held_out": fresh,
            "seconds": round(spell_seconds, 2),
        },
        "agent": {
            "agent_id": agent_defs.resources["tasks"].agent_id,
            "base_success_sampled": sampled["base"]["rate"],
            "final_success_sampled": sampled["final"]["rate"],
            "base_success_greedy": check["greedy"]["base"]["rate"],
            "final_success_greedy": check["greedy"]["final"]["rate"],
            "held_out": check,
            "rounds": agent_lines,
            "final_champion": agent_lines[-1]["champion"],
            "base_policy_seconds": round(agent_base_seconds, 2),
            **stats,
            "seconds": round(agent_seconds, 2),
        },
        "seconds": round(seconds, 2),
        "dagster_home": str(home),
    }
    print(f"\ntotal {seconds:.0f} s")
    report.parent.mkdir(parents=True, exist_ok=True)
    report.write_text(json.dumps(content, indent=2) + "\n")
    print(f"written {report}; `make ui` shows the runs and materialisations; `flowopt serve --models {models_root.name}` serves the agent's champion")
    return content
