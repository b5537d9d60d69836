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
import time
from pathlib import Path

from flow_assets.definitions import build_definitions
from flow_assets.runtime.local import REPO_ROOT, local_instance
from flow_assets.settings import PROJECT_FILE, Settings
from resources.lake import TrajectoryLake
from resources.tasks import TaskSourceResource
from flow_assets.demo.state import DemoState, SHARED_DATA, land_shared_data
from flow_assets.demo.in_process import base_vs_final, held_out_summary
from flow_assets.demo.phases import Phase, agent_batch_stats, run_ab_phase, run_phase, run_workflow_proposals


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
    stats = agent_batch_stats(lake, [line["batch"] for line in agent_lines])
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
