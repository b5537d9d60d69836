"""``flowopt demo``: the real logs of ``../shared/data``, then two trainable agents in the loop,
end to end, as a Dagster deployment: the demo starts ``dagster-daemon`` (:mod:`flow_assets.runtime.deployment`)
and only watches; the daemon's sensors request every run, its queue launches them.

1. the real agent logs land; ``new_logs_sensor`` -> ``log_batch_job`` per file (they stop after
   ``advantages``: no trainable policy produced them);
2. ``spell_backward``, a one-turn agent: ``self_play_sensor`` -> ``base_policy_job`` (tiny model +
   SFT), then per round ``self_play_sensor`` -> ``collect_rollouts_job``, ``new_logs_sensor`` ->
   ``log_batch_job``, ``training_round_sensor`` -> ``training_round_job``,
   ``training_history_sensor`` -> ``training_history_job``; run configs from a file
   (``FLOWOPT_RUN_CONFIG``);
3. the calculator agent, multi-turn and tool-using, the same way with a daemon of its own (the
   code location's agent and models come from the environment), every rollout through the
   gateway over real HTTP with the official ``openai`` client; finally, in this process, the SFT
   base and the final champion on every held-out task;
4. a live A/B of the SFT base against the champion, decided by ``ab_monitor_sensor``;
5. ``workflow_proposals_job`` in this process, on everything in the lake: the workflow changes
   proposed for a person's review (``flowopt proposals list``).

State: the demo's own, under ``.demo/`` (``dagster_home``, ``lake``, ``landing``, ``models``,
``workflows``), or where ``DAGSTER_HOME`` / ``FLOWOPT_LAKE`` / ``FLOWOPT_LANDING`` /
``FLOWOPT_MODELS`` / ``FLOWOPT_WORKFLOWS`` point. The demo records where in the project settings
file ``.flowopt.toml`` of its working directory (:meth:`DemoState.record`), so ``flowopt
proposals``, ``serve``, ``promote``, ``api``, ``ingest``, ``make ui`` ... run from there find it
with no variable set. The demo starts from a clean state each time so its numbers are
reproducible, but it only clears directories it created itself (they carry a
``.flowopt-demo`` marker): anything else is deleted only with ``--reset``, and nothing is touched
before the inputs are found. Policies: the calculator agent's in ``models`` (what ``flowopt serve
--models .demo/models`` serves afterwards), spell_backward's in ``models/spell_backward``.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import polars as pl

from flow_assets.definitions import build_definitions
from flow_assets.serving.gateway.engine import AdapterRef
from flow_assets.serving.gateway.serve import serve_policy
from flow_assets.runtime.local import REPO_ROOT, execute_requests, local_instance, run_job, tick_sensor
from flow_assets.rl.evaluation import compare_policies
from flow_assets.training.rounds import EvaluationConfig, evaluate_agents, read_evaluation, read_round_summary
from flow_assets.settings import PROJECT_FILE, Settings, write_demo_file
from flow_assets.data_plane.summary import batch_summary, source_summary
from flow_assets.training.run_config import TRAINING_JOB, RoundSettings
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


#: the file that marks a directory as the demo's own state (safe to clear on the next run)
MARKER = ".flowopt-demo"
#: entries a directory may hold without counting as state: the marker, instance config and locks,
#: prepared model presets (inputs, not output)
_NOT_STATE = {MARKER, "dagster.yaml", ".flowopt-instance.lock", "presets"}


class DemoStateError(RuntimeError):
    """The demo would have to delete state it did not create (the message lists it)."""


@dataclass(frozen=True)
class DemoState:
    """Where the demo keeps its Dagster instance (``home``), lake, landing directory, models and
    workflow definitions: ``DAGSTER_HOME`` / ``FLOWOPT_LAKE`` / ``FLOWOPT_LANDING`` /
    ``FLOWOPT_MODELS`` / ``FLOWOPT_WORKFLOWS`` where set, else ``root/dagster_home``,
    ``root/lake``, ``root/landing``, ``root/models``, ``root/workflows`` (absolute paths).
    ``workflows`` ``None``: ``workflows`` beside ``models`` (a state built by hand)."""

    home: Path
    lake: Path
    landing: Path
    models: Path
    workflows: Path | None = None

    def __post_init__(self) -> None:
        if self.workflows is None:
            object.__setattr__(self, "workflows", self.models.parent / "workflows")

    @classmethod
    def from_settings(cls, settings: Settings, root: str | os.PathLike = ".demo") -> "DemoState":
        """The state of ``settings``: each of ``dagster_home``, ``lake``, ``landing``, ``models``,
        ``workflows`` where its variable is set, else its directory under ``root``. A project
        settings file is not asked: it is what the demo writes (:meth:`record`), and the state is
        where ``--state`` says."""
        base = Path(root)
        pick = lambda field, name: Path(getattr(settings, field) if settings.source(field) == "environment" else base / name).resolve()  # noqa: E731
        return cls(pick("dagster_home", "dagster_home"), pick("lake", "lake"), pick("landing", "landing"), pick("models", "models"),
                   pick("workflows", "workflows"))  # fmt: skip

    def directories(self) -> tuple[Path, ...]:
        return (self.home, self.lake, self.landing, self.models, self.workflows)

    def record(self, directory: str | os.PathLike = ".") -> Path | None:
        """Write the project settings file ``directory/.flowopt.toml`` naming these directories,
        so that every command run from ``directory`` finds this state without a variable
        (:func:`flow_assets.settings.write_demo_file`). Returns the file, or ``None`` when
        ``directory`` holds a settings file of a person's (left untouched)."""
        return write_demo_file(directory, {"dagster_home": self.home, "lake": self.lake, "landing": self.landing, "models": self.models,
                                           "workflows": self.workflows})  # fmt: skip

    def foreign(self) -> list[Path]:
        """Directories holding state without the demo's marker (someone else's data)."""
        return [d for d in self.directories() if d.is_dir() and not (d / MARKER).exists() and _state_entries(d)]

    def prepare(self, reset: bool = False) -> None:
        """Clear the demo's own state (and, with ``reset``, whatever is there), then mark every
        directory as the demo's.

        Raises:
            DemoStateError: a directory holds state the demo did not create and ``reset`` is false;
                nothing has been deleted then.
        """
        foreign = self.foreign()
        if foreign and not reset:
            listing = "; ".join(f"{d} ({len(_state_entries(d))} entries)" for d in foreign)
            raise DemoStateError(
                f"not the demo's state: {listing}. Pass --reset to delete it and start over, or point DAGSTER_HOME / "
                "FLOWOPT_LAKE / FLOWOPT_LANDING / FLOWOPT_MODELS / FLOWOPT_WORKFLOWS elsewhere (unset, the demo uses .demo/)"
            )
        for directory in self.directories():
            directory.mkdir(parents=True, exist_ok=True)
            for entry in _state_entries(directory):
                shutil.rmtree(entry) if entry.is_dir() and not entry.is_symlink() else entry.unlink()
            (directory / MARKER).write_text("state of `flowopt demo`: cleared by its next run\n")


def _state_entries(directory: Path) -> list[Path]:
    return sorted(p for p in directory.iterdir() if p.name not in _NOT_STATE)


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
        "sampled_success": report["sampled"][holder]["success_rate"]["rate"],
        "base_greedy_success": report["greedy"]["champion"]["success_rate"]["rate"] if index == 1 and "greedy" in report else None,
        "base_sampled_success": report["sampled"]["champion"]["success_rate"]["rate"] if index == 1 else None,
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


def _print_rounds_header() -> None:
    print(
        f"{'round':>5}  {'champion':>8}  {'greedy':>6}  {'sampled':>7}  {'reward':>6}  {'calls':>5}  {'seconds':>7}  "
        "(agents / train / other)  gate"
    )


def _rate(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def _print_round(line: dict, progress: str) -> None:
    calls = line["mean_llm_calls"]
    print(
        f"{line['round']:>5}  {line['champion']:>8}  {_rate(line['greedy_success']):>6}  {line['sampled_success']:>7.3f}  "
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
    _print_rounds_header()
    lines = []
    for k in range(1, rounds + 1):
        lines.append(run_round(defs, instance, models_root, k, collect, train, evaluation))
        spent = sum(line["seconds"] for line in lines)
        _print_round(lines[-1], f"{k}/{rounds}, ETA {spent / k * (rounds - k):.0f} s")
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


@dataclass(frozen=True)
class Phase:
    """One agent's part of the demo, run by the daemon: its task source ``kind``, models
    directory, the number of self-play rounds and the run configs the sensors launch with."""

    title: str
    kind: str
    models: Path
    rounds: int
    base: dict
    collect: dict
    train: dict | None
    evaluation: dict

    def run_config(self) -> dict:
        """``{job name: run config}``, the file ``FLOWOPT_RUN_CONFIG`` points the sensors at."""
        return {
            "base_policy_job": {"ops": {"base_policy": {"config": self.base}}},
            "collect_rollouts_job": {"ops": {"rollouts": {"config": self.collect}}},
            TRAINING_JOB: RoundSettings(trainer=self.train or {}, evaluation=self.evaluation).run_config(),
        }


def phase_env(state: DemoState, phase: Phase, run_config_path: Path) -> dict[str, str]:
    """The environment of the daemon (and so of its code server and runs) for ``phase``."""
    return {
        "DAGSTER_HOME": str(state.home),
        "FLOWOPT_LAKE": str(state.lake),
        "FLOWOPT_LANDING": str(state.landing),
        "FLOWOPT_MODELS": str(phase.models),
        "FLOWOPT_WORKFLOWS": str(state.workflows),
        "FLOWOPT_TASKS": phase.kind,
        "FLOWOPT_SETTLE_SECONDS": "0",  # the demo lands files by rename only
        "FLOWOPT_SENSOR_INTERVAL_SECONDS": "1",  # the daemon's loop still ticks every 5 s
        "FLOWOPT_SELF_PLAY_ROUNDS": str(phase.rounds),
        "FLOWOPT_RUN_CONFIG": str(run_config_path),
    }


def _end_time(instance, run_id: str) -> float:
    from dagster import RunsFilter

    record = instance.get_run_records(RunsFilter(run_ids=[run_id]), limit=1)[0]
    return record.end_time or time.time()


def _rollouts_metadata(instance, lake: TrajectoryLake, key: str) -> dict:
    """The metadata of the ``rollouts`` materialisation that landed batch ``key``'s file."""
    from dagster import AssetKey

    landed = str(Path(lake.batch_manifest(key).original_path).resolve())
    for record in instance.fetch_materializations(AssetKey("rollouts"), limit=1000).records:
        meta = {k: v.value for k, v in record.asset_materialization.metadata.items()}
        if str(Path(str(meta.get("file", ""))).resolve()) == landed:
            return meta
    return {}


def _round_line(instance, lake: TrajectoryLake, phase: Phase, run, index: int, since: float) -> dict:
    """The demo's line for a finished training run ``run`` (round ``index``; ``since``: when the
    previous round, or the base policy, finished, epoch seconds)."""
    from flow_assets.training.history import training_history

    key = run.tags["dagster/partition"]
    run_dir = phase.models / "runs" / key
    summary, evaluation = read_round_summary(run_dir), read_evaluation(run_dir)
    row = training_history(phase.models, AdapterRegistry(root=str(phase.models)).load()).filter(pl.col("batch") == key).row(0, named=True)
    collect_meta = _rollouts_metadata(instance, lake, key)
    line = _line(index, key, row["champion_after"], row["promoted"], summary, evaluation, collect_meta, _end_time(instance, run.run_id) - since)
    return {**line, "run_id": run.run_id, "verdict": row["verdict"]}


def run_phase(state: DemoState, instance, lake: TrajectoryLake, phase: Phase, real_files: int = 0, timeout: float = 900.0) -> dict:
    """Run ``phase`` as a deployment: start the daemon with :func:`phase_env`, let its sensors
    build the base policy and run ``phase.rounds`` training rounds (``self_play_sensor`` ->
    ``collect_rollouts_job``, ``new_logs_sensor`` -> ``log_batch_job``, ``training_round_sensor``
    -> ``training_round_job``, ``training_history_sensor`` -> ``training_history_job``), print a
    line per round as it finishes, wait for every run to end, stop the daemon.

    ``real_files`` > 0: the landing directory also holds that many real log files; the phase
    first waits for their batches and prints the per-source table.

    Returns:
        ``{"lines", "base_seconds", "data_plane"}`` (``data_plane``: per-batch and per-source
        tables and seconds, or ``None``).

    Raises:
        DeploymentError: the daemon died, or nothing progressed for ``timeout`` seconds.
        RuntimeError: a real log batch, the base policy or a collection failed.
    """
    from dagster import AssetKey, DagsterRunStatus, RunsFilter

    from flow_assets.runtime.deployment import Daemon, finished_runs, runs_in_flight, wait_until
    from flow_assets.training.rounds import landing_source
    from flow_assets.logs.landing import key_component, key_source
    from flow_assets.core.run_tags import SELF_PLAY_AGENT_TAG as AGENT_TAG

    agent_id = TaskSourceResource(kind=phase.kind).agent_id
    source = key_component(landing_source(agent_id))
    config_path = state.home / f"run-config.{phase.kind}.json"
    config_path.write_text(json.dumps(phase.run_config(), indent=2) + "\n")
    started = time.perf_counter()
    out: dict = {"lines": [], "base_seconds": None, "data_plane": None}
    with Daemon(phase_env(state, phase, config_path), state.home / "daemon.log") as daemon:
        print(f"  dagster-daemon started (pid {daemon.process.pid}, log {daemon.log_path}); its sensors drive the runs", flush=True)
        if real_files:
            def real_batches_done():
                runs = [r for r in finished_runs(instance, "log_batch_job") if not key_source(r.tags.get("dagster/partition", "")).startswith("flowopt-")]
                return runs if len(runs) >= real_files else None

            runs = wait_until(real_batches_done, daemon, "batches of the real logs", timeout)
            failed = [r.tags.get("dagster/partition") for r in runs if r.status != DagsterRunStatus.SUCCESS]
            if failed:
                raise RuntimeError(f"demo batches failed: {failed}")
            keys = sorted(r.tags["dagster/partition"] for r in runs)
            per_batch = batch_summary(lake, keys)
            seconds = time.perf_counter() - started
            out["data_plane"] = (per_batch, source_summary(lake, per_batch), seconds)
            print(f"\n{len(keys)} log batches through the data plane (new_logs_sensor -> log_batch_job) in {seconds:.1f} s\n")
            _print_table(out["data_plane"][1])
            print()

        def base_done():
            runs = [r for r in finished_runs(instance, "base_policy_job") if r.tags.get(AGENT_TAG) == agent_id]
            return runs[-1] if runs else None

        base = wait_until(base_done, daemon, f"base policy of {agent_id}", timeout)
        if base.status != DagsterRunStatus.SUCCESS:
            raise RuntimeError(f"base_policy failed (run {base.run_id})")
        record = instance.get_run_records(RunsFilter(run_ids=[base.run_id]), limit=1)[0]
        out["base_seconds"] = (record.end_time or 0) - (record.start_time or 0)
        print(f"base policy ready in {out['base_seconds']:.1f} s (run {base.run_id[:8]})\n", flush=True)
        _print_rounds_header()
        since = record.end_time or time.time()
        for k in range(1, phase.rounds + 1):
            def round_done(k=k):
                runs = [r for r in finished_runs(instance, "training_round_job") if key_source(r.tags.get("dagster/partition", "")) == source]
                return runs[k - 1] if len(runs) >= k else None

            run = wait_until(round_done, daemon, f"round {k} of {agent_id}", timeout)
            line = _round_line(instance, lake, phase, run, k, since)
            since = _end_time(instance, run.run_id)
            out["lines"].append(line)
            spent = sum(x["seconds"] for x in out["lines"])
            _print_round(line, f"{k}/{phase.rounds}, ETA {spent / k * (phase.rounds - k):.0f} s")
        def settled():
            # the history refresh after the last round has run (a daemon started later then has nothing to do)
            history = instance.get_latest_materialization_event(AssetKey("training_history"))
            return runs_in_flight(instance) == 0 and history is not None and history.timestamp >= since

        wait_until(settled, daemon, "the training history after the last round", timeout)
    return out


#: the demo's live A/B: sessions per batch of live traffic, the challenger's share, most batches
AB_SESSIONS_PER_BATCH = 96
AB_SHARE = 0.5
AB_MAX_BATCHES = 8


def run_ab_phase(state: DemoState, instance, lake: TrajectoryLake, phase: Phase, timeout: float = 600.0) -> dict:
    """The demo's live A/B, under the daemon: the SFT base adapter goes back on trial as the
    challenger against the trained champion (``AB_SHARE`` of sessions), the calculator agent serves
    live tasks (the held-out split: tasks training never saw) through the gateway with
    ``model="policy"``, a batch of ``AB_SESSIONS_PER_BATCH`` sessions at a time;
    ``new_logs_sensor`` ingests each batch, ``ab_monitor_sensor`` requests ``ab_test_report`` and
    carries out its decision in the registry. Stops at the decision or after ``AB_MAX_BATCHES``.

    Returns:
        the report's ``ab`` object: ``decision`` (``promote`` / ``rollback`` / ``continue`` when
        undecided), champion and challenger versions, samples and success per arm, the
        always-valid p-value, the registry's verdict line, batches and seconds.

    Raises:
        DeploymentError: the daemon died, or a batch's report did not come within ``timeout`` s.
    """
    from dagster import AssetKey

    from flow_assets.serving.agents.harness import HarnessConfig, run_rollouts_sync
    from flow_assets.runtime.deployment import Daemon, runs_in_flight, wait_until
    from flow_assets.policy.store import PolicyStore

    started = time.perf_counter()
    registry = AdapterRegistry(root=str(phase.models))
    base = next(e for e in registry.load()["history"] if e["action"] == "register")
    champion = registry.champion()["version"]
    challenger = registry.start_challenger(
        registry.next_version(), base["adapter_path"], {}, AB_SHARE, by="flowopt demo",
        reason=f"the SFT base ({base['version']}) back on trial against the trained champion: does live traffic agree with the gate?",
    )["version"]  # fmt: skip
    tasks = TaskSourceResource(kind=phase.kind)
    source, agent = tasks.source(), tasks.agent_fn()
    live_tasks = source.tasks("held_out")
    config_path = state.home / f"run-config.{phase.kind}.json"
    print(f"\nlive A/B: champion {champion} vs challenger {challenger} (the SFT base) on {AB_SHARE:.0%} of sessions; "
          f"{AB_SESSIONS_PER_BATCH} live sessions per batch, ab_monitor_sensor decides", flush=True)  # fmt: skip

    def reports() -> list:
        records = instance.fetch_materializations(AssetKey("ab_test_report"), limit=100).records
        return [r for r in records if r.asset_materialization.metadata.get("challenger") and r.asset_materialization.metadata["challenger"].value == challenger]

    meta: dict = {}
    batches = 0
    with Daemon(phase_env(state, phase, config_path), state.home / "daemon.log") as daemon:
        for b in range(AB_MAX_BATCHES):
            chosen = [live_tasks[(b * AB_SESSIONS_PER_BATCH + i) % len(live_tasks)] for i in range(AB_SESSIONS_PER_BATCH)]
            with serve_policy(PolicyStore(str(phase.models)), state.landing) as server:
                run_rollouts_sync(server.url, agent, chosen, source.score, 1, agent_id=tasks.agent_id, batch=f"ab-{b:04d}",
                                  source="live", config=HarnessConfig(model="policy", land=True))  # fmt: skip
            batches += 1
            report = wait_until(lambda n=b + 1: (lambda r: r[0] if len(r) >= n else None)(reports()), daemon, f"ab_test_report on live batch {b + 1}", timeout)
            meta = {k: v.value for k, v in report.asset_materialization.metadata.items() if k != "arms"}
            print(f"  batch {b + 1}: {meta['n_champion']} / {meta['n_challenger']} sessions (champion / challenger), success "
                  f"{meta['champion_success']:.3f} / {meta['challenger_success']:.3f}, p = {meta['p_value']:.3g}: {meta['decision']}", flush=True)  # fmt: skip
            if meta["decision"] in ("promote", "rollback"):
                wait_until(lambda: registry.challenger() is None or None, daemon, "ab_monitor_sensor to act on the decision", timeout)
                break
        wait_until(lambda: runs_in_flight(instance) == 0 or None, daemon, "the live batches' runs", timeout)
    last = registry.load()["history"][-1]
    verdict = f"{last['action']} {last['version']} by {last['by']}" if registry.challenger() is None else "still on trial"
    print(f"live A/B: {verdict}; champion {registry.champion()['version']} ({time.perf_counter() - started:.0f} s)", flush=True)
    return {
        "decision": meta.get("decision", "none"),
        "champion": champion,
        "challenger": challenger,
        "share": AB_SHARE,
        "samples": {"champion": meta.get("n_champion"), "challenger": meta.get("n_challenger")},
        "success": {"champion": meta.get("champion_success"), "challenger": meta.get("challenger_success")},
        "diff": meta.get("diff"),
        "p_value": meta.get("p_value"),
        "reason": meta.get("reason"),
        "registry": verdict,
        "champion_after": registry.champion()["version"],
        "batches": batches,
        "seconds": round(time.perf_counter() - started, 2),
    }


def run_workflow_proposals(state: DemoState, instance, settings: Settings) -> dict:
    """``workflow_proposals_job`` in this process, recorded on ``instance``, on every batch in
    ``state``'s lake; its proposals go to ``state.workflows`` for a person to review with
    ``flowopt proposals`` (none is applied). Prints one line per open proposal.

    Returns:
        the report's ``workflows`` object: ``run_id``, ``agents`` (``{agent: definition
        version}``), ``derived_definitions`` (agents whose definition was derived now), ``open``,
        ``proposals`` (``id``, ``agent_id``, ``rule``, ``step_id``, ``effect`` with its interval
        ``[low, high]``, ``n_trajectories``), ``directory`` and ``seconds``.

    Raises:
        RuntimeError: the run failed (the message names it).
    """
    from dagster import AssetKey

    from flow_assets.workflows.definition import WorkflowStore
    from flow_assets.workflows.review import ProposalBoard

    started = time.perf_counter()
    defs = build_definitions(str(state.lake), str(state.landing), models_root=str(state.models), workflows_root=str(state.workflows),
                             settle_seconds=0, settings=settings)  # fmt: skip
    result = run_job(defs, instance, "workflow_proposals_job")
    if not result.success:
        raise RuntimeError(f"workflow_proposals_job failed (run {result.run_id})")
    meta = instance.get_latest_materialization_event(AssetKey("workflow_proposals")).asset_materialization.metadata
    found = ProposalBoard(WorkflowStore(state.workflows)).find(status="open")
    proposals = [
        {"id": p.id, "agent_id": p.agent_id, "rule": p.rule, "step_id": p.step_id, "effect": p.evidence.effect,
         "interval": [p.evidence.effect_low, p.evidence.effect_high], "n_trajectories": p.evidence.n_trajectories}
        for p in found
    ]  # fmt: skip
    seconds = time.perf_counter() - started
    agents = meta["agents"].value
    print(f"\nworkflow proposals (workflow_proposals_job, run {result.run_id[:8]}): {len(agents)} agents' workflows, "
          f"{len(proposals)} open proposal(s) for review ({seconds:.1f} s); `flowopt proposals list` shows them", flush=True)  # fmt: skip
    for p in proposals:
        print(f"  {p['id']}  {p['agent_id']}  {p['rule']} {p['step_id']}  effect {p['effect']:+.3f} "
              f"[{p['interval'][0]:+.3f}, {p['interval'][1]:+.3f}]  n={p['n_trajectories']}")  # fmt: skip
    return {
        "run_id": result.run_id,
        "agents": agents,
        "derived_definitions": meta["derived_definitions"].value,
        "open": len(proposals),
        "proposals": proposals,
        "directory": str(state.workflows),
        "seconds": round(seconds, 2),
    }


def run_demo(
    state: DemoState | None = None,
    data_dir: Path = SHARED_DATA,
    report: Path = REPO_ROOT / "reports" / "demo-summary.json",
    rounds: int = 3,
    agent_rounds: int = 8,
    reset: bool = False,
    settings: Settings | None = None,
    settings_dir: str | os.PathLike = ".",
) -> dict:
    """Run the demo in ``state`` (default :meth:`DemoState.from_settings`) and write ``report``;
    returns the report's content. ``reset`` allows deleting state the demo did not create;
    ``settings`` are the environment's (default: read now) for what ``state`` and the demo's own
    choices leave open; ``settings_dir`` gets the project settings file naming ``state``
    (:meth:`DemoState.record`; one of a person's is left alone).

    Raises:
        FileNotFoundError: ``data_dir`` is missing (checked before anything is touched).
        DemoStateError: ``state`` holds someone else's data and ``reset`` is false.
        RuntimeError: a batch of the real logs or a round failed (the message names it).
    """
    started = time.perf_counter()
    settings = settings or Settings.load()
    state = state or DemoState.from_settings(settings)
    if not data_dir.is_dir():
        raise FileNotFoundError(f"real agent logs not found at {data_dir} (nothing was changed)")
    state.prepare(reset)
    home, lake_root, landing_dir, models_root = state.home, state.lake, state.landing, state.models
    print(f"flowopt demo: Dagster instance {home}, lake {lake_root}, models {models_root}", flush=True)
    # recorded before the first run, so that a demo stopped halfway can be looked at the same way
    recorded = state.record(settings_dir)
    print(f"  state recorded in {recorded}: commands run from {Path(settings_dir).resolve()} find it" if recorded else
          f"  {Path(settings_dir) / PROJECT_FILE} is not the demo's: left as it is; commands find the demo's state only "
          "with DAGSTER_HOME / FLOWOPT_* set", flush=True)  # fmt: skip
    instance = local_instance(home)
    lake = TrajectoryLake(root=str(lake_root))

    # 1 + 2. the real logs and spell_backward, one-turn: one daemon, its sensors drive every run
    spell_models = models_root / "spell_backward"
    landed = land_shared_data(data_dir, landing_dir)
    spell_phase = Phase("spell_backward", "reasoning_gym", spell_models, rounds, SPELL_BASE, SPELL_COLLECT, None, SPELL_EVAL)
    print(f"\n{len(landed)} real log files landed; spell_backward (one-turn agent): tiny Llama-style model, SFT warm start ...", flush=True)
    t0 = time.perf_counter()
    spell_out = run_phase(state, instance, lake, spell_phase, real_files=len(landed))
    per_batch, per_source, data_plane_seconds = spell_out["data_plane"]
    lines, base_seconds = spell_out["lines"], spell_out["base_seconds"]
    spell_seconds = time.perf_counter() - t0
    spell = build_definitions(str(lake_root), str(landing_dir), models_root=str(spell_models), tasks=TaskSourceResource(), settle_seconds=0, settings=settings)
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

    # 3. the calculator agent, multi-turn with a tool, through the gateway; a daemon of its own
    print("\ncalculator agent (multi-turn, calls a calculator tool; every call through the gateway over HTTP) ...", flush=True)
    t0 = time.perf_counter()
    agent_phase = Phase("calculator", "calculator", models_root, agent_rounds, AGENT_BASE, AGENT_COLLECT, AGENT_TRAIN, AGENT_EVAL)
    agent_out = run_phase(state, instance, lake, agent_phase)
    agent_lines, agent_base_seconds = agent_out["lines"], agent_out["base_seconds"]
    agent_defs = build_definitions(str(lake_root), str(landing_dir), models_root=str(models_root), tasks=TaskSourceResource(kind="calculator"), settle_seconds=0, settings=settings)
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
    ab = run_ab_phase(state, instance, lake, agent_phase)
    workflows = run_workflow_proposals(state, instance, settings)
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
        "ab": ab,
        "workflows": workflows,
        "seconds": round(seconds, 2),
        "dagster_home": str(home),
        "settings_file": str(recorded) if recorded else None,
    }
    print(f"\ntotal {seconds:.0f} s")
    report.parent.mkdir(parents=True, exist_ok=True)
    report.write_text(json.dumps(content, indent=2) + "\n")
    print(f"written {report}; from {Path(settings_dir).resolve()}: `make ui` shows the runs and materialisations, `flowopt serve` serves the "
          "agent's champion, `flowopt proposals list` the workflow proposals")  # fmt: skip
    return content
