"""A training round through Dagster, its wall time split into generation, training, evaluation,
other work inside the assets, and Dagster's own overhead.

In a fresh child process (own ``DAGSTER_HOME``, lake, landing directory and models directory, all
temporary): ``base_policy_job`` (tiny model + SFT warm start), then rounds exactly as
``flowopt demo`` runs them (:func:`flow_assets.demo.in_process.run_round`): ``collect_rollouts_job`` ->
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

The same rounds a second time the way ``flowopt demo`` runs them, launched by a real
``dagster-daemon`` (:func:`flow_assets.demo.phases.run_phase`: ``self_play_sensor`` ->
``collect_rollouts_job``, ``new_logs_sensor`` -> ``log_batch_job``, ``training_round_sensor`` ->
``training_round_job``; each run in a process of its own, from ``dagster.yaml``'s run launcher),
with the same split: here ``dagster_overhead`` also holds the sensor ticks' waits, the queue and
each run's process start. The *orchestration share* is ``other_asset_work + dagster_overhead``
over the round's wall time (everything but the agents, training and evaluation). A round's wall
time under the daemon runs from the end of the previous round's ``training_round_job`` to the end
of its own; the history refresh after a round runs beside the next round's collection and is not
counted.
"""

from __future__ import annotations

import shutil
import tempfile
import time
from pathlib import Path

from benchmarks.common import run_child, summarize

# held-out tasks per evaluation (candidate and champion, each mode); the quick run (the test
# suite's) needs the split, not a precise success rate
FULL = {"rounds": 5, "sft_steps": 150, "tasks_per_batch": 64, "evaluation_tasks": 200}
QUICK = {"rounds": 1, "sft_steps": 10, "tasks_per_batch": 8, "evaluation_tasks": 48}
PARTS = ("collection_generation", "training", "evaluation", "other_asset_work", "dagster_overhead")


def round_child(work: str, rounds: int, sft_steps: int, tasks_per_batch: int, evaluation_tasks: int, threads: int) -> dict:
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
    from flow_assets.demo.in_process import run_round
    from flow_assets.runtime.local import local_instance, run_job
    from flow_assets.training.rounds import read_evaluation
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
            eval_config={"max_tasks": evaluation_tasks},
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


def daemon_child(work: str, rounds: int, sft_steps: int, tasks_per_batch: int, evaluation_tasks: int, threads: int) -> dict:
    """Child process: the same base policy and rounds as :func:`round_child`, launched by a real
    ``dagster-daemon`` (module docstring). ``threads`` is unused: the runs are the daemon's processes.

    Returns:
        ``base_policy_seconds`` and ``rounds`` as :func:`round_child` returns them.

    Raises:
        DeploymentError: the daemon died or stalled; RuntimeError: a run failed.
    """
    from dagster import RunsFilter

    from benchmarks.common import dagster_step_seconds, quiet_libraries
    from flow_assets.demo.state import DemoState
    from flow_assets.demo.phases import Phase, run_phase
    from flow_assets.runtime.local import local_instance
    from flow_assets.training.rounds import read_evaluation
    from resources.lake import TrajectoryLake

    quiet_libraries()
    root = Path(work)
    state = DemoState(root / "dagster_home", root / "lake", root / "landing", root / "models")
    state.prepare()
    instance = local_instance(state.home)
    phase = Phase(
        "spell_backward", "reasoning_gym", state.models, rounds, {"sft": {"steps": sft_steps}},
        {"tasks_per_batch": tasks_per_batch, "group_size": 8, "seed": 0}, None, {"max_tasks": evaluation_tasks},
    )  # fmt: skip
    out = run_phase(state, instance, TrajectoryLake(root=str(state.lake)), phase, timeout=600)
    records = instance.get_run_records(RunsFilter())
    lines = []
    for line in out["lines"]:
        finished = next(r for r in records if r.dagster_run.run_id == line["run_id"]).end_time
        start = finished - line["seconds"]
        # the round's runs: created after the previous round ended, up to its training run; the
        # previous round's history refresh runs beside this collection and is left out
        runs = [r.dagster_run for r in records if start <= r.create_timestamp.timestamp() <= finished and r.dagster_run.job_name != "training_history_job"]
        steps = {f"{r.job_name}.{key}": sec for r in runs for key, sec in dagster_step_seconds(instance, r.run_id).items()}
        evaluation = read_evaluation(state.models / "runs" / line["batch"]).generation_seconds
        collection = line["generation_seconds"] - evaluation
        inside = sum(steps.values())
        lines.append({
            "round": line["round"], "promoted": line["promoted"], "wall": line["seconds"],
            "collection_generation": collection, "training": line["training_seconds"], "evaluation": evaluation,
            "other_asset_work": inside - collection - line["training_seconds"] - evaluation,
            "dagster_overhead": line["seconds"] - inside, "step_seconds": steps,
        })  # fmt: skip
    return {"base_policy_seconds": out["base_seconds"], "rounds": lines}


def _split(rounds: list[dict]) -> dict:
    """Per part of :data:`PARTS`: seconds over ``rounds`` (:func:`summarize`) and median share."""
    return {
        part: {**summarize([r[part] for r in rounds]), "share": summarize([r[part] / r["wall"] for r in rounds])["median"]}
        for part in PARTS
    }


def _orchestration_share(rounds: list[dict]) -> float:
    """Median over ``rounds`` of (other asset work + Dagster overhead) / wall time."""
    return summarize([(r["other_asset_work"] + r["dagster_overhead"]) / r["wall"] for r in rounds])["median"]


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
    results = {}
    for mode, target in (("in_process", "round_child"), ("daemon", "daemon_child")):
        work = Path(tempfile.mkdtemp(prefix=f"flowopt-bench-round-{mode}-"))
        try:
            results[mode] = run_child(f"benchmarks.training_round:{target}",
                                      {"work": str(work), "threads": torch.get_num_threads(), **settings}, timeout=900)
        finally:
            shutil.rmtree(work, ignore_errors=True)
    (result, peak), (daemon, _) = results["in_process"], results["daemon"]
    rounds = result["rounds"]
    wall = summarize([r["wall"] for r in rounds])
    split = _split(rounds)
    daemon_wall = summarize([r["wall"] for r in daemon["rounds"]])
    daemon_split = _split(daemon["rounds"])
    share, daemon_share = _orchestration_share(rounds), _orchestration_share(daemon["rounds"])
    headline = [
        {"figure": "round wall time, in process", "value": wall["median"], "unit": "s", "spread": [wall["min"], wall["max"]],
         "note": f"{len(rounds)} rounds, {sum(r['promoted'] for r in rounds)} promoted by the gate"},
        *({"figure": f"  {part.replace('_', ' ')}", "value": split[part]["median"], "unit": "s",
           "note": f"{100 * split[part]['share']:.0f}% of the round"} for part in PARTS),
        {"figure": "round wall time, launched by dagster-daemon (the demo's path)", "value": daemon_wall["median"], "unit": "s",
         "spread": [daemon_wall["min"], daemon_wall["max"]],
         "note": f"{len(daemon['rounds'])} rounds, {sum(r['promoted'] for r in daemon['rounds'])} promoted by the gate"},
        *({"figure": f"  {part.replace('_', ' ')} (daemon)", "value": daemon_split[part]["median"], "unit": "s",
           "note": f"{100 * daemon_split[part]['share']:.0f}% of the round"} for part in PARTS),
        {"figure": "orchestration share (other asset work + Dagster), in process / daemon (goal <= 25%)",
         "value": [round(100 * share, 1), round(100 * daemon_share, 1)], "unit": "%", "meets_goal": daemon_share <= 0.25},
    ]
    return {
        "what": "collect -> data plane -> GRPO round -> evaluation -> promotion, through Dagster (SQLite instance): "
                "in process, then launched by dagster-daemon as the demo runs it",
        "settings": {**settings, "group_size": 8, "torch_threads": torch.get_num_threads()},
        "base_policy_seconds": result["base_policy_seconds"],
        "rounds": rounds,
        "wall_seconds": wall,
        "split": split,
        "orchestration_share": share,
        "daemon": {"base_policy_seconds": daemon["base_policy_seconds"], "rounds": daemon["rounds"], "wall_seconds": daemon_wall,
                   "split": daemon_split, "orchestration_share": daemon_share},
        "peak_rss_mb": peak,
        "seconds": time.perf_counter() - started,
        "headline": headline,
    }
