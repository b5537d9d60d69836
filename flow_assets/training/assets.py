"""Training rounds as Dagster assets: thin wrappers of :mod:`flow_assets.training.rounds`.

    base_policy                      (once)  tiny model + SFT warm start, or the user's model
    champion                         (external) the registry; one materialisation per change
    rollouts  (collect_rollouts_job)         the champion's agents work on train tasks through
                                             the gateway, G per task -> landing/
    [new_logs_sensor + log_batch_job]        interaction_logs -> trajectories -> rewards -> advantages
    training_round_job  (per batch, pool "training"):
        policy_checkpoint -> evaluation_report (+ blocking checks) -> promoted_adapter

Every run config is generated from the pure config of its component (:mod:`flow_assets.core.config`,
:mod:`flow_assets.training.run_config`), so defaults and descriptions live in one place; a round's run
config is built by :func:`flow_assets.training.run_config.round_run_config`.
"""

import json
import time
from pathlib import Path

import numpy as np
import polars as pl
from dagster import (
    AssetObservation,
    AssetCheckResult,
    AssetCheckSeverity,
    AssetCheckSpec,
    AssetExecutionContext,
    Config,
    Failure,
    MaterializeResult,
    PipesSubprocessClient,
    AssetSpec,
    MetadataValue,
    TableColumn,
    TableSchema,
    asset,
)
from pydantic import Field

from flow_assets.training.champion import CHAMPION, CHAMPION_DESCRIPTION, champion_materialization
from flow_assets.data_plane.checks import failed_data_checks
from flow_assets.data_plane.assets import advantages
from flow_assets.training.history import COLUMNS as HISTORY_COLUMNS
from flow_assets.training.history import history_chart, vega_lite_spec
from flow_assets.training.history import training_history as training_history_table
from flow_assets.core.metadata import preview_table
from flow_assets.core.partitions import log_batches
from flow_assets.core.run_tags import AGENT_TAG, BUDGET_TAG, FAILURE_TAG, GATE_DECISION_TAG, GATE_TAG, JOB_TAG, PAUSED_TAG, GateDecision, pause_requested
from flow_assets.training.tracking import flat_params
from flow_assets.rl.gate import verdict
from flow_assets.core.versions import TRAINING_OWNERS, code_version
from flow_assets.logs.landing import key_round
from flow_assets.training.run_config import CollectRunConfig, EvaluationRunConfig, SFTRunConfig, TinyModelRunConfig, TrainConfig
from flow_assets.training.rounds import (
    build_base_policy,
    register_identity_adapter,
    RoundError,
    collect_batch,
    evaluate_candidate,
    finite_metrics,
    promote_candidate,
    read_round_summary,
    train_candidate,
    warm_start_adapter,
)
from resources.loop import TrainingLoop
from resources.landing import LogLanding
from resources.lake import TrajectoryLake
from resources.policy import PolicyModel
from resources.registry import AdapterRegistry
from resources.tasks import TaskSourceResource
from resources.live_ab import LiveAB
from resources.tracking import ExperimentTracking

GROUP = "training"
#: StepMetrics fields exported per optimizer step (as ``train/<name>``)
TRACKED_STEP_METRICS = ("loss", "grad_norm", "clip_fraction", "mean_ratio", "kl", "num_tokens")
POOL = "training"  # dagster.yaml: pools default_limit 1, granularity run -> one round at a time

# -- base policy ----------------------------------------------------------------------------------
class BasePolicyConfig(Config):
    """The tiny demo model and its supervised warm start; with base_model_path set, the user's
    model as it is, and an optional warm-start LoRA adapter (``adapter_warm_start``)."""

    model: TinyModelRunConfig = Field(default_factory=TinyModelRunConfig, description="size and seed of the tiny model")
    sft: SFTRunConfig = Field(default_factory=SFTRunConfig, description="the supervised warm start")
    sft_demonstrations: int = Field(1000, description="train-split tasks whose demonstrations are the SFT data")
    adapter_warm_start: bool = Field(False, description=(
        "with base_model_path set: train a LoRA adapter by SFT (``sft``) on ``sft_demonstrations`` train tasks' "
        "demonstrations (a seeded sample spread over the split) and promote it as v1 over v0, the model as it is"))


@asset(group_name=GROUP, kinds={"pytorch"}, owners=TRAINING_OWNERS, code_version=code_version("flow_assets.policy", "flow_assets.training.rounds"))
def base_policy(
    context: AssetExecutionContext,
    config: BasePolicyConfig,
    policy: PolicyModel,
    tasks: TaskSourceResource,
    registry: AdapterRegistry,
) -> MaterializeResult:
    """The base model every adapter sits on, and champion v0 (an identity LoRA adapter).

    Default: a tiny Llama-style model with a character tokenizer and a compact chat template,
    saved with save_pretrained and warm-started by SFT on the task source's demonstration
    conversations (one row per assistant turn, rendered with the chat template). With
    base_model_path set, the user's model is registered as it is (v0), and with
    adapter_warm_start a LoRA adapter SFT-trained on the demonstrations becomes champion v1.
    """
    started = time.perf_counter()
    store = policy.store()
    by = f"dagster run {context.run_id}"
    meta: dict = {}
    sft = None
    if policy.base_model_path is None:
        sft = build_base_policy(
            store, registry, tasks.source(), config.model.to_pure(), config.sft.to_pure(), config.sft_demonstrations, by
        )
        meta["parameters"] = sft.parameters
    else:
        register_identity_adapter(store, registry, by, "the user's base model")
        if config.adapter_warm_start:
            sft = warm_start_adapter(store, registry, tasks.source(), config.sft.to_pure(), config.sft_demonstrations, by)
            meta["adapter_parameters"] = sft.parameters
    if sft is not None:
        meta.update(
            sft_demonstrations=sft.demonstrations,
            sft_rows=sft.rows,
            sft_steps=sft.steps,
            sft_final_loss=MetadataValue.float(sft.final_loss),
            sft_seconds=MetadataValue.float(sft.seconds),
        )
    context.log_event(champion_materialization(registry.load()))
    champion_version = registry.champion()["version"]
    return MaterializeResult(metadata={**meta, "base_path": str(store.base_path), "champion": champion_version, "seconds": time.perf_counter() - started})


# -- champion and rollout collection --------------------------------------------------------------
champion = AssetSpec("champion", group_name=GROUP, deps=[base_policy], kinds={"json"}, description=CHAMPION_DESCRIPTION, owners=TRAINING_OWNERS)


@asset(group_name=GROUP, kinds={"pytorch"}, deps=[champion], owners=TRAINING_OWNERS,
       code_version=code_version("flow_assets.serving.agents", "flow_assets.serving.gateway", "flow_assets.policy", "flow_assets.training.rounds"))
def rollouts(
    context: AssetExecutionContext,
    config: CollectRunConfig,
    policy: PolicyModel,
    tasks: TaskSourceResource,
    registry: AdapterRegistry,
    landing: LogLanding,
    loop: TrainingLoop,
) -> MaterializeResult:
    """One batch of rollouts: the champion's agents work on train tasks through an in-process
    gateway (real HTTP, the official openai client), G per task; each rollout is scored by the
    verifier and the batch lands as canonical JSONL in the landing directory (.tmp, then rename),
    where new_logs_sensor makes it a log batch. Each materialisation is one batch; its metadata
    names the file and the champion that produced it. With FLOWOPT_ROLLOUT_WORKERS set, the
    agents run over that many Ray rollout workers, each a gateway replica, and the batch still
    lands as one file with each rollout once."""
    try:
        result = collect_batch(
            policy.store(), tasks.source(), tasks.agent_fn(), tasks.agent_id, registry, landing.directory, config.to_pure(),
            loop.rollout_workers, loop.ray_address or None,
        )
    except RoundError as exc:
        raise Failure(str(exc)) from exc
    context.log.info(
        f"{result.rollouts} rollouts of champion {result.champion}: success {result.success_rate:.3f}, "
        f"{result.mean_llm_calls:.2f} LLM calls each; landed {result.path}"
    )
    return MaterializeResult(
        metadata={
            "file": MetadataValue.path(result.path),
            "champion": result.champion,
            "rollouts": result.rollouts,
            "failed_rollouts": result.failed_rollouts,
            "success_rate": MetadataValue.float(round(result.success_rate, 4)),
            "mean_llm_calls": MetadataValue.float(round(result.mean_llm_calls, 3)),
            "mean_tool_calls": MetadataValue.float(round(result.mean_tool_calls, 3)),
            "generation_seconds": MetadataValue.float(round(result.seconds, 2)),
        }
    )


# -- training round -------------------------------------------------------------------------------
def _check_job_budget(context: AssetExecutionContext, lake: TrajectoryLake) -> None:
    """A round of an API job (run tags ``flowopt/job``, ``flowopt/job_budget_usd``) starts only
    while its agent's spend this month is under the job's budget; otherwise the run fails with the
    tag ``flowopt/job_failure = budget`` and the job stops at this round boundary."""
    from flow_assets.training.budget import lake_spend

    tags = context.run.tags
    if JOB_TAG not in tags or BUDGET_TAG not in tags:
        return
    budget, spent = float(tags[BUDGET_TAG]), lake_spend(lake, tags.get(AGENT_TAG, ""))
    context.log.info(f"job {tags[JOB_TAG]}: {spent.agent_id} spent USD {spent.total_usd:.4f} of {budget:.2f} in {spent.month}")
    if spent.total_usd >= budget:
        context.instance.add_run_tags(context.run_id, {FAILURE_TAG: "budget"})
        raise Failure(
            f"budget: {spent.agent_id} spent USD {spent.total_usd:.4f} of its {budget:.2f} in {spent.month}; the job stops before this round",
            metadata={"spent_usd": spent.total_usd, "budget_usd": budget, "prompt_tokens": spent.prompt_tokens, "completion_tokens": spent.completion_tokens},
        )


@asset(partitions_def=log_batches, group_name=GROUP, kinds={"pytorch"}, deps=[advantages, champion], pool=POOL,
       owners=TRAINING_OWNERS, code_version=code_version("flow_assets.rl.grpo_loss", "flow_assets.rl.grpo_config", "flow_assets.policy", "flow_assets.training.rounds"))
def policy_checkpoint(
    context: AssetExecutionContext,
    config: TrainConfig,
    lake: TrajectoryLake,
    policy: PolicyModel,
    tasks: TaskSourceResource,
    registry: AdapterRegistry,
    tracking: ExperimentTracking,
    loop: TrainingLoop,
) -> MaterializeResult:
    """A candidate LoRA adapter: the champion trained on this batch's turn rows, with the clipped
    GRPO surrogate (the policy's own turns: captured, or its text logs re-rendered) or, for a batch
    of another model's flows named in FLOWOPT_TRAINING_SOURCES, advantage-weighted likelihood.
    Checkpoints every N steps; a re-run after a kill resumes from the latest. Each step is logged
    to the run log and, when set, to the experiment tracker."""
    # the trainer (torch) loads with the run that trains, not with the code location
    from flow_assets.policy.trainer import TrainingPaused

    key = context.partition_key
    # the sensor and the API refuse such a batch; a round launched from the UI or the CLI must too
    if failed := failed_data_checks(context.instance, key):
        raise Failure(f"batch {key!r} failed its blocking data checks {failed}: not trained (fix its logs and re-materialise advantages)")
    _check_job_budget(context, lake)
    tables = {t: lake.read_partition(t, key) for t in ("steps", "step_advantages", "trajectories", "advantages", "interaction_logs")}
    trainer = config.to_pure()
    tracker = tracking.open(tasks.agent_id, key)
    tracker.log_params(flat_params({"trainer": trainer.to_dict(), "negate_advantages": config.negate_advantages}))

    job = context.run.tags.get(JOB_TAG)

    def log_step(m) -> None:
        context.log.info(
            f"step {m.step}: loss {m.loss:.4f}, grad norm {m.grad_norm:.3f}, clip fraction {m.clip_fraction:.3f}, "
            f"mean ratio {m.mean_ratio:.4f}, KL {m.kl:.4g}, {m.num_samples} samples / {m.num_tokens} tokens"
        )
        tracker.log_metrics({f"train/{name}": getattr(m, name) for name in TRACKED_STEP_METRICS}, step=m.step)
        if job and pause_requested(context.instance, job):  # training.pause: stop after this step
            raise TrainingPaused(f"job {job} paused by training.pause")

    try:
        summary, steps = train_candidate(
            policy.store(), registry, key, tables, tasks.agent_id, trainer, config.negate_advantages, config.kl_samples, log_step,
            sources=loop.update_rules(tasks.agent_id), workers=loop.training_workers, ray_address=loop.ray_address or None,
            # the Ray driver's process through Dagster Pipes: its per-step lines appear in this run's log as they come
            launch=lambda command: PipesSubprocessClient().run(command=[*command, "--pipes"], context=context),
        )
    except RoundError as exc:
        raise Failure(str(exc)) from exc
    except TrainingPaused as pause:
        context.instance.add_run_tags(context.run_id, {PAUSED_TAG: f"after step {pause.step}"})
        raise Failure(
            f"paused after step {pause.step} (checkpoint {pause.checkpoint}); training.resume continues from it",
            metadata={"step": pause.step, "checkpoint": MetadataValue.path(pause.checkpoint)},
        ) from None
    finally:
        tracker.close()
    frame = pl.DataFrame([vars(s) for s in steps]) if steps else pl.DataFrame()
    lake.write_partition("training_steps", key, frame)
    last = steps[-1] if steps else None
    return MaterializeResult(
        metadata={
            "parent_champion": summary.parent_version,
            "candidate_adapter": summary.candidate_adapter,
            "steps": summary.final_step,
            "resumed_from_step": summary.resumed_from if summary.resumed_from is not None else -1,
            "samples": summary.num_samples,
            "dropped_zero_advantage": summary.dropped_zero_advantage,
            "loss": MetadataValue.float(last.loss if last else float("nan")),
            "grad_norm": MetadataValue.float(last.grad_norm if last else float("nan")),
            "clip_fraction": MetadataValue.float(float(np.mean([s.clip_fraction for s in steps])) if last else 0.0),
            "mean_ratio_first_step": MetadataValue.float(steps[0].mean_ratio if steps else float("nan")),
            "kl_to_behaviour": MetadataValue.float(summary.kl_to_behaviour),
            "reward_mean": MetadataValue.float(summary.reward_mean),
            "reward_std": MetadataValue.float(summary.reward_std),
            "zero_variance_share": MetadataValue.float(summary.zero_variance_share),
            "training_seconds": MetadataValue.float(summary.training_seconds),
            "steps_preview": preview_table(frame, n=10) if last else MetadataValue.text("no training step"),
        }
    )


GATE_CHECKS = {
    "gain": (
        "The candidate's held-out success rate (the gate's metric, sampled by default) minus the "
        "champion's on the same tasks is at least min_gain (default 0: not worse), and significant "
        "by McNemar's exact test when require_significance is set. Metadata: gain, min_gain, "
        "mcnemar_p, both success rates, held-out tasks."
    ),
    "finite_loss": "Every training step's loss and gradient norm were finite. Metadata: steps, non-finite steps.",
    "kl_bound": (
        "The round's mean KL of the candidate to the behaviour policy (nats per token) is at most "
        "max_kl. Metadata: mean_kl, max_kl."
    ),
}


@asset(
    partitions_def=log_batches,
    group_name=GROUP,
    kinds={"pytorch"},
    deps=[policy_checkpoint],
    pool=POOL,
    owners=TRAINING_OWNERS,
    code_version=code_version("flow_assets.rl.evaluation", "flow_assets.rl.eval_stats", "flow_assets.rl.gate", "flow_assets.serving.agents",
                              "flow_assets.serving.gateway", "flow_assets.policy", "flow_assets.training.rounds"),
    check_specs=[
        AssetCheckSpec(name, asset="evaluation_report", blocking=True, description=text) for name, text in GATE_CHECKS.items()
    ],
)
def evaluation_report(
    context: AssetExecutionContext,
    config: EvaluationRunConfig,
    lake: TrajectoryLake,
    policy: PolicyModel,
    tasks: TaskSourceResource,
    tracking: ExperimentTracking,
    loop: TrainingLoop,
) -> MaterializeResult:
    """Candidate vs champion agents on the same held-out tasks through the gateway, greedy and
    sampled: success rate, mean reward, tokens, LLM and tool calls with 95% intervals, McNemar and
    paired bootstrap; the gate's blocking checks (gain, finite loss, KL bound) decide whether
    promotion may run. With FLOWOPT_ROLLOUT_WORKERS set, the agents run over that many Ray
    rollout workers, each a gateway replica."""
    key = context.partition_key
    store = policy.store()
    summary = read_round_summary(store.round_dir(key))
    rows, result = evaluate_candidate(store, tasks.source(), tasks.agent_fn(), tasks.agent_id, summary, config.to_pure(),
                                      loop.rollout_workers, loop.ray_address or None)  # fmt: skip
    lake.write_partition("evaluations", key, rows)
    report, metric = result.report, result.gate_config.metric
    decision = verdict(summary.parent_version, result.gate)
    # the run list shows tags: a blocked round's run is failed by its blocking check (Dagster's
    # design), and this tag says why in the list itself; the champion's page records the decision
    blocked = [r for r in result.gate if not r.passed]
    context.instance.add_run_tags(context.run_id, {GATE_TAG: decision[:200], GATE_DECISION_TAG: GateDecision.of(bool(blocked)).value})
    _track_evaluation(context, tracking, tasks.agent_id, summary.final_step, report, metric, not blocked)
    if blocked:
        context.log.warning(f"gate: {decision}")
        context.log_event(
            AssetObservation(
                asset_key=CHAMPION,
                description=decision,
                metadata={"version": summary.parent_version, "action": "kept", "candidate_batch": key,
                          "blocked_by": ", ".join(r.name for r in blocked), "verdict": decision},
            )
        )  # fmt: skip
    flat = {
        f"{mode}_{name}_success": MetadataValue.float(report[mode][name]["success_rate"]["rate"])
        for mode in report for name in ("candidate", "champion")
    }  # fmt: skip
    return MaterializeResult(
        metadata={
            **flat,
            "held_out_tasks": report[metric]["n_tasks"] if metric in report else 0,
            "gain": MetadataValue.float(report[metric]["gain"] if metric in report else float("nan")),
            "mcnemar_p": MetadataValue.float(report[metric]["mcnemar"]["p_value"] if metric in report else float("nan")),
            "verdict": decision,
            "report": MetadataValue.json(report),
            "generation_seconds": MetadataValue.float(result.generation_seconds),
        },
        check_results=[
            AssetCheckResult(
                check_name=r.name,
                passed=r.passed,
                severity=AssetCheckSeverity.ERROR,
                description=r.reason,
                metadata={**_check_numbers(r.metadata), "champion": summary.parent_version, "reason": r.reason},
            )
            for r in result.gate
        ],
    )


def _track_evaluation(context, tracking: ExperimentTracking, agent_id: str, last_step: int, report: dict, metric: str, promote: bool) -> None:
    # the round's own run gets the held-out results at its last step; the "rounds" run one point
    # per round (the round number from a rollout batch's key, else the evaluations so far + 1)
    key = context.partition_key
    numbers = {f"eval/{mode}_{name}_success": report[mode][name]["success_rate"]["rate"] for mode in report for name in ("candidate", "champion")}
    if metric in report:
        numbers |= {"eval/gain": report[metric]["gain"], "eval/mcnemar_p": report[metric]["mcnemar"]["p_value"]}
    tracker = tracking.open(agent_id, key)
    try:
        tracker.log_metrics(numbers, step=last_step)
    finally:
        tracker.close()
    done = context.instance.get_materialized_partitions(context.assets_def.key) - {key}
    number = key_round(key) or len(done) + 1
    rounds = tracking.open(agent_id, "rounds")
    try:
        rounds.log_metrics({k.replace("eval/", "round/"): v for k, v in numbers.items()} | {"round/promoted": float(promote)}, step=number)
    finally:
        rounds.close()


def _check_numbers(numbers: dict) -> dict:
    # ints stay ints; floats typed so the check's Plots tab draws them; NaN (no evaluation) skipped
    out = {}
    for name, value in numbers.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        if isinstance(value, int):
            out[name] = MetadataValue.int(value)
        elif value == value:
            out[name] = MetadataValue.float(round(value, 6))
    return out


@asset(partitions_def=log_batches, group_name=GROUP, deps=[evaluation_report], pool=POOL, owners=TRAINING_OWNERS,
       code_version=code_version("flow_assets.rl.gate", "flow_assets.training.rounds", "resources.registry"))
def promoted_adapter(context: AssetExecutionContext, policy: PolicyModel, registry: AdapterRegistry, live_ab: LiveAB) -> MaterializeResult:
    """The candidate becomes the champion: re-checks the gate on the stored results, refuses a
    candidate trained from a champion that has since changed, then writes the registry
    atomically (version, adapter, metrics, who promoted it and why). With live A/B on, it becomes
    the challenger instead, and ab_test_report decides on live traffic."""
    key = context.partition_key
    share = live_ab.share if live_ab.enabled else 0.0
    try:
        promotion = promote_candidate(policy.store(), registry, key, by=f"dagster run {context.run_id} (partition {key})", live_ab_share=share)
    except RoundError as exc:
        raise Failure(str(exc)) from exc
    if promotion.challenger:
        text = f"{promotion.version} enters live A/B against {promotion.previous} ({share:.0%} of sessions)"
        context.log.info(text)
        context.log_event(AssetObservation(asset_key=CHAMPION, description=text, metadata={"version": promotion.previous, "challenger": promotion.version, "share": share}))
    else:
        context.log_event(champion_materialization(registry.load()))
    return MaterializeResult(
        metadata={
            "champion": promotion.previous if promotion.challenger else promotion.version,
            "challenger": promotion.version if promotion.challenger else "",
            "previous": promotion.previous,
            "adapter": promotion.adapter_path,
            "reason": promotion.reason,
            **finite_metrics(promotion.metrics),
        }
    )


@asset(group_name=GROUP, deps=[promoted_adapter], kinds={"polars"}, owners=TRAINING_OWNERS, code_version=code_version("flow_assets.training.history"))
def training_history(
    context: AssetExecutionContext, policy: PolicyModel, registry: AdapterRegistry, lake: TrajectoryLake
) -> MaterializeResult:
    """One row per training round: batch, champion before and after, mean reward, loss, KL, clip
    fraction, candidate and champion held-out success with 95% intervals, gain, McNemar p and the
    gate's verdict. Metadata: the table, a text chart of success per round, the same chart as a
    Vega-Lite spec (also written beside the registry), and the latest round's numbers for the
    Plots tab. Refreshed by training_history_sensor after every finished round, promoted or not."""
    try:
        steps = lake.scan("training_steps").group_by("batch").agg(pl.col("clip_fraction").mean()).collect()
        clip = dict(steps.iter_rows())
    except FileNotFoundError:
        clip = {}
    history = training_history_table(policy.models_root, registry.load(), clip)
    spec = vega_lite_spec(history)
    spec_path = Path(policy.models_root) / "training_history.vl.json"
    spec_path.write_text(json.dumps(spec, indent=1))
    meta = {
        "dagster/row_count": MetadataValue.int(history.height),
        "dagster/column_schema": TableSchema(
            columns=[TableColumn(name, _TABLE_TYPES.get(history.schema[name], "string"), description=text) for name, text in HISTORY_COLUMNS.items()]
        ),
        "chart": MetadataValue.md(history_chart(history)),
        "history": preview_table(history.with_columns(pl.col(pl.Float64).round(4)), n=200),
        "vega_lite": MetadataValue.json(spec),
        "vega_lite_file": MetadataValue.path(str(spec_path)),
    }
    evaluated = history.filter(pl.col("candidate_success").is_not_null())
    if evaluated.height:
        last = evaluated.row(-1, named=True)
        after = last["candidate_success"] if last["promoted"] else last["champion_success"]
        meta.update(
            round=MetadataValue.int(last["round"]),
            champion=last["champion_after"],
            champion_success=MetadataValue.float(round(after, 4)),
            promotions=MetadataValue.int(int(history["promoted"].sum())),
        )
        context.log.info(f"{history.height} rounds; round {last['round']}: {last['verdict']}")
    return MaterializeResult(metadata=meta)


_TABLE_TYPES = {pl.Int64: "int", pl.Float64: "float", pl.Boolean: "bool", pl.Utf8: "string"}

training_assets = [base_policy, champion, rollouts, policy_checkpoint, evaluation_report, promoted_adapter, training_history]
