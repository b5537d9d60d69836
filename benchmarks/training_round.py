"""A training round through Dagster, its wall time split into generation, training, evaluation,
other work inside the assets, and Dagster's own overhead.

In a fresh child process (own ``DAGSTER_HOME``, lake, landing directory and models directory, all
temporary): ``base_policy_job`` (tiny model + SFT warm start), then rounds exactly as
``flowopt demo`` runs them (:func:`flow_assets.demo.run_round`): ``collect_rollouts_job`` ->
``new_logs_sensor`` tick -> ``log_batch_job`` -> ``training_round_sensor`` tick ->
``training_round_job`` (``policy_checkpoint`` -> ``evaluation_report`` -> ``promoted_adapter``).

The split of one round's wall time (seconds):

- ``collection_generation``: the champion's one-turn agents working through the in-process
  gateway over HTTP (``collect_rollouts``' own timer: gateway start, HTTP, sampling, capture);
- ``training``: the GRPO round (``policy_checkpoint``'s trainer timer);
- ``evaluation``: candidate and champion agents on the held-out tasks (``evaluation.json``);
- ``other_asset_work``: the rest of the time spent inside Dagster steps (the data plane on the
  batch, model loading, checkpoint and lake writes, verifier scoring, the gate, promotion);
- ``dagster_overhead``: wall time outside any step (run launch and teardown, event log writes,
  sensor ticks and their file hashing/snapshots).

Each round is one repeat (the champion changes between rounds, the work per round does not).
"""

from __future__ import annotations

import shutil
import tempfile
import time
from pathlib import Path

from benchmarks.common import run_child, summarize

FULL = {"rounds": 5, "sft_steps": 150, "tasks_per_batch": 64}
QUICK = {"rounds": 1, "sft_steps": 10, "tasks_per_batch": 8}
EVALUATION_TASKS = 200
PARTS = ("collection_generation", "training", "evaluation", "other_asset_work", "dagster_overhead")


def round_child(work: str, rounds: int, sft_steps: int, tasks_per_batch: int, threads: int) -> dict:
    """Child process: base policy, then ``rounds`` rounds; the split of each (module docstring).

    Returns:
        ``base_policy_seconds`` and ``rounds`` (per round: ``wall`` and the :data:`PARTS`, seconds,
        plus ``promoted`` and the step seconds of every run of the round).

    Raises:
        RuntimeError: the base policy or a round failed.
    """
    from benchmarks.common import dagster_step_seconds, quiet_libraries, set_torch_threads

    set_torch_threads(threads)
    quiet_libraries()
    from flow_assets.definitions import build_definitions
    from flow_assets.demo import run_round
    from flow_assets.local import local_instance, run_job
    from flow_assets.rounds import read_evaluation
    from resources.tasks import TaskSourceResource

    root = Path(work)
    models = root / "models"
    instance = local_instance(root / "dagster_home")
    defs = build_definitions(str(root / "lake"), str(root / "landing"), models_root=str(models), tasks=TaskSourceResource(), settle_seconds=0)
    started = time.perf_counter()
    base = run_job(
        defs, instance, "base_policy_job", run_config={"ops": {"base_policy": {"config": {"sft": {"steps": sft_steps}}}}}
    )
    if not base.success:
        raise RuntimeError("base_policy_job failed")
    base_seconds = time.perf_counter() - started
    lines = []
    for k in range(1, rounds + 1):
        before = {r.run_id for r in instance.get_runs()}
        started = time.perf_counter()
        line = run_round(
            defs, instance, models, k, {"tasks_per_batch": tasks_per_batch, "group_size": 8, "seed": 0},
            eval_config={"max_tasks": EVALUATION_TASKS},
        )
        wall = time.perf_counter() - started
        runs = [r for r in instance.get_runs() if r.run_id not in before]
        steps = {f"{r.job_name}.{key}": s for r in runs for key, s in dagster_step_seconds(instance, r.run_id).items()}
        evaluation = read_evaluation(models / "runs" / line["batch"]).generation_seconds
        collection = line["generation_seconds"] - evaluation
        inside = sum(steps.values())
        lines.append({
            "round": k,
            "promoted": line["promoted"],
            "wall": wall,
            "collection_generation": collection,
            "training": line["training_seconds"],
            "evaluation": evaluation,
            "other_asset_work": inside - collection - line["training_seconds"] - evaluation,
            "dagster_overhead": wall - inside,
            "step_seconds": steps,
        })
    return {"base_policy_seconds": base_seconds, "rounds": lines}


def run(quick: bool = False) -> dict:
    """The training-round benchmark (module docstring).

    Returns:
        ``settings``, ``base_policy_seconds``, ``rounds`` (raw), ``split`` (per part: seconds with
        spread over rounds, and its median share of the wall time), ``peak_rss_mb`` of the child,
        ``headline``.
    """
    import torch

    settings = QUICK if quick else FULL
    started = time.perf_counter()
    work = Path(tempfile.mkdtemp(prefix="flowopt-bench-round-"))
    try:
        result, peak = run_child("benchmarks.training_round:round_child",
                                 {"work": str(work), "threads": torch.get_num_threads(), **settings}, timeout=900)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    rounds = result["rounds"]
    wall = summarize([r["wall"] for r in rounds])
    split = {
        part: {**summarize([r[part] for r in rounds]), "share": summarize([r[part] / r["wall"] for r in rounds])["median"]}
        for part in PARTS
    }
    headline = [
        {"figure": "round wall time", "value": wall["median"], "unit": "s", "spread": [wall["min"], wall["max"]],
         "note": f"{len(rounds)} rounds, {sum(r['promoted'] for r in rounds)} promoted by the gate"},
        *({"figure": f"  {part.replace('_', ' ')}", "value": split[part]["median"], "unit": "s",
           "note": f"{100 * split[part]['share']:.0f}% of the round"} for part in PARTS),
    ]
    return {
        "what": "collect -> data plane -> GRPO round -> evaluation -> promotion, through Dagster (in process, SQLite instance)",
        "settings": {**settings, "group_size": 8, "evaluation_tasks": EVALUATION_TASKS, "torch_threads": torch.get_num_threads()},
        "base_policy_seconds": result["base_policy_seconds"],
        "rounds": rounds,
        "wall_seconds": wall,
        "split": split,
        "peak_rss_mb": peak,
        "seconds": time.perf_counter() - started,
        "headline": headline,
    }
