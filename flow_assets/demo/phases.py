"""The demo's phases under ``dagster-daemon``: a phase's settings and environment, its rounds
watched as the daemon's sensors request them, the live A/B of base and champion decided by
``ab_monitor_sensor``, and the workflow proposals on everything in the lake."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

import polars as pl

from flow_assets.definitions import build_definitions
from flow_assets.serving.gateway.serve import serve_policy
from flow_assets.runtime.local import run_job
from flow_assets.training.rounds import read_evaluation, read_round_summary
from flow_assets.settings import Settings
from flow_assets.data_plane.summary import batch_summary, source_summary
from flow_assets.training.run_config import TRAINING_JOB, RoundSettings
from resources.lake import TrajectoryLake
from resources.registry import AdapterRegistry
from resources.tasks import TaskSourceResource
from flow_assets.demo.state import DemoState
from flow_assets.demo.in_process import _line, print_round, print_rounds_header, _print_table


def agent_batch_stats(lake: TrajectoryLake, keys: list[str]) -> dict:
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


def run_live_batches(instance, daemon, registry: AdapterRegistry, challenger: str, serve_batch, max_batches: int, timeout: float) -> tuple[dict, int]:
    """The live A/B's loop under ``daemon``: ``serve_batch(b)`` serves live batch ``b`` (landing it
    as batch ``ab-<b, 4 digits>`` of source ``live``), then the loop waits for ``ab_test_report`` on
    that batch (its partition ``live.ab-....``; a report on another batch, such as one ingested
    when the daemon started, is not it), prints its line, and stops once the report decided and
    ``ab_monitor_sensor`` carried the decision out, or after ``max_batches``; then waits for the
    runs in flight.

    Returns:
        The last report's metadata (``arms`` left out) and the number of batches served.

    Raises:
        DeploymentError: the daemon died, or a report or the registry change did not come within ``timeout`` s.
    """
    from dagster import AssetKey

    from flow_assets.runtime.deployment import runs_in_flight, wait_until

    def report_of(batch: str):
        for record in instance.fetch_materializations(AssetKey("ab_test_report"), limit=100).records:
            m = record.asset_materialization
            if (m.partition or "").startswith(f"live.{batch}.") and m.metadata.get("challenger") and m.metadata["challenger"].value == challenger:
                return record
        return None

    meta: dict = {}
    batches = 0
    for b in range(max_batches):
        serve_batch(b)
        batches += 1
        report = wait_until(lambda name=f"ab-{b:04d}": report_of(name), daemon, f"ab_test_report on live batch {b + 1}", timeout)
        meta = {k: v.value for k, v in report.asset_materialization.metadata.items() if k != "arms"}
        print(f"  batch {b + 1}: {meta['n_champion']} / {meta['n_challenger']} sessions (champion / challenger), success "
              f"{meta['champion_success']:.3f} / {meta['challenger_success']:.3f}, p = {meta['p_value']:.3g}: {meta['decision']}", flush=True)  # fmt: skip
        if meta["decision"] in ("promote", "rollback"):
            wait_until(lambda: registry.challenger() is None or None, daemon, "ab_monitor_sensor to act on the decision", timeout)
            break
    wait_until(lambda: runs_in_flight(instance) == 0 or None, daemon, "the live batches' runs", timeout)
    return meta, batches


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
        "FLOWOPT_SENSOR_INTERVAL_SECONDS": "1",
        # a round is three sensor hops in a row, each started by a run's end: the daemon's run watch
        # wakes the sensor loop then (FLOWOPT_RUN_WATCH_SECONDS, default 0.1 s). Between runs the
        # loop keeps Dagster's 5 s: five sensor ticks cost ~1-2 s of CPU of the daemon and code
        # server, and a 2 s loop spent most of a core on them beside the rounds (docs/benchmarks.md)
        "FLOWOPT_SENSOR_LOOP_SECONDS": "5",
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


def run_phase(state: DemoState, instance, lake: TrajectoryLake, phase: Phase, real_files: int = 0, timeout: float = 900.0,
              env: dict[str, str] | None = None) -> dict:
    """Run ``phase`` as a deployment: start the daemon with :func:`phase_env`, let its sensors
    build the base policy and run ``phase.rounds`` training rounds (``self_play_sensor`` ->
    ``collect_rollouts_job``, ``new_logs_sensor`` -> ``log_batch_job``, ``training_round_sensor``
    -> ``training_round_job``, ``training_history_sensor`` -> ``training_history_job``), print a
    line per round as it finishes, wait for every run to end, stop the daemon.

    ``real_files`` > 0: the landing directory also holds that many real log files; the phase
    first waits for their batches and prints the per-source table. ``env``: variables for the
    daemon over :func:`phase_env`'s (the tests lengthen its sensor loop).

    Returns:
        ``{"lines", "base_seconds", "data_plane"}`` (``data_plane``: per-batch and per-source
        tables and seconds, or ``None``).

    Raises:
        DeploymentError: the daemon died, or nothing progressed for ``timeout`` seconds.
        RuntimeError: a real log batch, the base policy or a collection failed, or the self-play
            loop stopped asking for collections before ``phase.rounds`` rounds
            (:func:`sensors.self_play.gave_up`).
    """
    from dagster import AssetKey, DagsterRunStatus, RunsFilter

    from flow_assets.runtime.deployment import Daemon, finished_runs, runs_in_flight, wait_until
    from flow_assets.training.rounds import landing_source
    from flow_assets.logs.landing import key_component, key_source
    from flow_assets.core.run_tags import SELF_PLAY_AGENT_TAG as AGENT_TAG
    from sensors.self_play import gave_up, loop_state
    from sensors.training import no_signal_reason

    agent_id = TaskSourceResource(kind=phase.kind).agent_id
    source = key_component(landing_source(agent_id))
    config_path = state.home / f"run-config.{phase.kind}.json"
    config_path.write_text(json.dumps(phase.run_config(), indent=2) + "\n")
    started = time.perf_counter()
    out: dict = {"lines": [], "base_seconds": None, "data_plane": None}
    with Daemon({**phase_env(state, phase, config_path), **(env or {})}, state.home / "daemon.log") as daemon:
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
        print_rounds_header()
        since = record.end_time or time.time()
        for k in range(1, phase.rounds + 1):
            def round_done(k=k):
                runs = [r for r in finished_runs(instance, "training_round_job") if key_source(r.tags.get("dagster/partition", "")) == source]
                if len(runs) >= k:
                    return runs[k - 1]
                # a self-play loop that stopped asking (flat batches, failed collections) brings no round: fail now, not at the
                # timeout. It can only have stopped while no run is in flight; that one query spares the lake reads of each poll.
                if runs_in_flight(instance):
                    return None
                state = loop_state(instance, agent_id, lambda key: no_signal_reason(lake, key, [agent_id]) is not None)
                stopped = None if state.in_flight or state.pending else gave_up(state, agent_id)
                if stopped is not None:
                    raise RuntimeError(f"self-play stopped before round {k} of {agent_id}: {stopped}")
                return None

            run = wait_until(round_done, daemon, f"round {k} of {agent_id}", timeout)
            line = _round_line(instance, lake, phase, run, k, since)
            since = _end_time(instance, run.run_id)
            out["lines"].append(line)
            spent = sum(x["seconds"] for x in out["lines"])
            print_round(line, f"{k}/{phase.rounds}, ETA {spent / k * (phase.rounds - k):.0f} s")
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
    from flow_assets.serving.agents.harness import HarnessConfig, run_rollouts_sync
    from flow_assets.runtime.deployment import Daemon
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

    def serve_batch(b: int) -> None:
        chosen = [live_tasks[(b * AB_SESSIONS_PER_BATCH + i) % len(live_tasks)] for i in range(AB_SESSIONS_PER_BATCH)]
        with serve_policy(PolicyStore(str(phase.models)), state.landing) as server:
            run_rollouts_sync(server.url, agent, chosen, source.score, 1, agent_id=tasks.agent_id, batch=f"ab-{b:04d}",
                              source="live", config=HarnessConfig(model="policy", land=True))  # fmt: skip

    with Daemon(phase_env(state, phase, config_path), state.home / "daemon.log") as daemon:
        meta, batches = run_live_batches(instance, daemon, registry, challenger, serve_batch, AB_MAX_BATCHES, timeout)
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
