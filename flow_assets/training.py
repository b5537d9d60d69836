"""Training rounds as Dagster assets: thin wrappers of :mod:`flow_assets.rounds`.

    base_policy                      (once)  tiny model + SFT warm start, or the user's model
    collect_rollouts_job             (op)    the champion's agents work on train tasks through
                                             the gateway, G per task -> landing/
    [new_logs_sensor + log_batch_job]        interaction_logs -> trajectories -> rewards -> advantages
    training_round_job  (per batch, pool "training"):
        policy_checkpoint -> evaluation_report (+ blocking checks) -> promoted_adapter

Every run config is generated from the pure config of its component (:mod:`flow_assets.config`),
so defaults and descriptions live in one place.
"""

import time

import numpy as np
import polars as pl
from dagster import (
    AssetCheckResult,
    AssetCheckSeverity,
    AssetCheckSpec,
    AssetExecutionContext,
    Config,
    Failure,
    MaterializeResult,
    MetadataValue,
    OpExecutionContext,
    asset,
    job,
    op,
)
from pydantic import Field

from flow_assets.config import dagster_config
from flow_assets.data_plane import advantages
from flow_assets.metadata import preview_table
from flow_assets.partitions import log_batches
from flow_assets.policy.sft import SFTConfig
from flow_assets.policy.tiny_model import TinyModelConfig
from flow_assets.policy.trainer import GRPOTrainerConfig
from flow_assets.rounds import (
    CollectConfig,
    build_base_policy,
    register_identity_adapter,
    EvaluationConfig,
    RoundError,
    collect_batch,
    evaluate_candidate,
    finite_metrics,
    promote_candidate,
    read_round_summary,
    train_candidate,
)
from resources.landing import LogLanding
from resources.lake import TrajectoryLake
from resources.policy import PolicyModel
from resources.registry import AdapterRegistry
from resources.tasks import TaskSourceResource

GROUP = "training"
POOL = "training"  # dagster.yaml: pools default_limit 1, granularity run -> one round at a time

TinyModelRunConfig = dagster_config(TinyModelConfig, "TinyModelRunConfig")
SFTRunConfig = dagster_config(SFTConfig, "SFTRunConfig")
CollectRunConfig = dagster_config(CollectConfig, "CollectRunConfig")
TrainerRunConfig = dagster_config(GRPOTrainerConfig, "TrainerRunConfig", exclude=("output_dir",))
EvaluationRunConfig = dagster_config(EvaluationConfig, "EvaluationRunConfig")


# -- base policy ----------------------------------------------------------------------------------
class BasePolicyConfig(Config):
    """The tiny demo model and its supervised warm start (ignored when base_model_path is set)."""

    model: TinyModelRunConfig = Field(default_factory=TinyModelRunConfig, description="size and seed of the tiny model")
    sft: SFTRunConfig = Field(default_factory=SFTRunConfig, description="the supervised warm start")
    sft_demonstrations: int = Field(1000, description="train-split tasks whose demonstrations are the SFT data")


@asset(group_name=GROUP, kinds={"pytorch"})
def base_policy(
    context: AssetExecutionContext,
    config: BasePolicyConfig,
    policy: PolicyModel,
    tasks: TaskSourceResource,
    registry: AdapterRegistry,
) -> MaterializeResult:
    """The base model every adapter sits on, and champion ``v0`` (an identity LoRA adapter).

    Default: a tiny Llama-style model with a character tokenizer and a compact chat template,
    saved with ``save_pretrained`` and warm-started by SFT on the task source's demonstration
    conversations (one row per assistant turn, rendered with the chat template). With
    ``base_model_path`` set, the user's model is registered as it is.
    """
    started = time.perf_counter()
    store = policy.store()
    by = f"dagster run {context.run_id}"
    meta: dict = {}
    if policy.base_model_path is None:
        base = build_base_policy(
            store, registry, tasks.source(), config.model.to_pure(), config.sft.to_pure(), config.sft_demonstrations, by
        )
        meta.update(
            sft_demonstrations=base.demonstrations,
            sft_rows=base.rows,
            sft_steps=base.steps,
            sft_final_loss=MetadataValue.float(base.final_loss),
            sft_seconds=MetadataValue.float(base.seconds),
            parameters=base.parameters,
        )
    else:
        register_identity_adapter(store, registry, by, "the user's base model")
    return MaterializeResult(metadata={**meta, "base_path": str(store.base_path), "champion": "v0", "seconds": time.perf_counter() - started})


# -- rollout collection ---------------------------------------------------------------------------
@op
def collect_rollouts(
    context: OpExecutionContext,
    config: CollectRunConfig,
    policy: PolicyModel,
    tasks: TaskSourceResource,
    registry: AdapterRegistry,
    landing: LogLanding,
) -> str:
    """The champion's agents work on a batch of train tasks through an in-process gateway (real
    HTTP, the official ``openai`` client), G per task; each rollout is scored by the verifier and
    the batch lands as canonical JSONL in the landing directory (``.tmp`` then rename), where
    ``new_logs_sensor`` picks it up. Returns the landed file's path."""
    try:
        result = collect_batch(
            policy.store(), tasks.source(), tasks.agent_fn(), tasks.agent_id, registry, landing.directory, config.to_pure()
        )
    except RoundError as exc:
        raise Failure(str(exc)) from exc
    context.add_output_metadata(
        {
            "file": result.path,
            "champion": result.champion,
            "rollouts": result.rollouts,
            "failed_rollouts": result.failed_rollouts,
            "success_rate": MetadataValue.float(result.success_rate),
            "mean_llm_calls": MetadataValue.float(result.mean_llm_calls),
            "mean_tool_calls": MetadataValue.float(result.mean_tool_calls),
            "generation_seconds": MetadataValue.float(result.seconds),
        }
    )
    return result.path


@job(description="The champion's agents work on a batch of train tasks; the batch lands for new_logs_sensor.")
def collect_rollouts_job():
    """Collect one batch of rollouts."""
    collect_rollouts()


# -- training round -------------------------------------------------------------------------------
class TrainConfig(TrainerRunConfig):
    """GRPO round settings (the trainer's, stored with every checkpoint), and a test switch."""

    negate_advantages: bool = Field(False, description="train AGAINST the advantages (tests the gate)")
    kl_samples: int | None = Field(256, description="turn rows the gate's KL to the behaviour policy is estimated on (null: all)")


@asset(partitions_def=log_batches, group_name=GROUP, kinds={"pytorch"}, deps=[advantages], pool=POOL)
def policy_checkpoint(
    context: AssetExecutionContext,
    config: TrainConfig,
    lake: TrajectoryLake,
    policy: PolicyModel,
    tasks: TaskSourceResource,
    registry: AdapterRegistry,
) -> MaterializeResult:
    """A candidate LoRA adapter: the champion trained on this batch's turn rows with the clipped
    GRPO surrogate. Checkpoints every N steps; a re-run after a kill resumes from the latest."""
    key = context.partition_key
    tables = {t: lake.read_partition(t, key) for t in ("steps", "step_advantages", "trajectories", "advantages")}
    trainer = config.to_pure(output_dir="")
    try:
        summary, steps = train_candidate(
            policy.store(), registry, key, tables, tasks.agent_id, trainer, config.negate_advantages, config.kl_samples
        )
    except RoundError as exc:
        raise Failure(str(exc)) from exc
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


GATE_CHECKS = ("gain", "finite_loss", "kl_bound")


@asset(
    partitions_def=log_batches,
    group_name=GROUP,
    kinds={"pytorch"},
    deps=[policy_checkpoint],
    pool=POOL,
    check_specs=[AssetCheckSpec(name, asset="evaluation_report", blocking=True) for name in GATE_CHECKS],
)
def evaluation_report(
    context: AssetExecutionContext,
    config: EvaluationRunConfig,
    lake: TrajectoryLake,
    policy: PolicyModel,
    tasks: TaskSourceResource,
) -> MaterializeResult:
    """Candidate vs champion agents on the same held-out tasks through the gateway, greedy and
    sampled: success rate, mean reward, tokens, LLM and tool calls with 95% intervals, McNemar and
    paired bootstrap; the gate's blocking checks (gain, finite loss, KL bound) decide whether
    promotion may run."""
    key = context.partition_key
    store = policy.store()
    summary = read_round_summary(store.round_dir(key))
    rows, result = evaluate_candidate(store, tasks.source(), tasks.agent_fn(), tasks.agent_id, summary, config.to_pure())
    lake.write_partition("evaluations", key, rows)
    report, metric = result.report, result.gate_config.metric
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
            "report": MetadataValue.json(report),
            "generation_seconds": MetadataValue.float(result.generation_seconds),
        },
        check_results=[
            AssetCheckResult(check_name=r.name, passed=r.passed, severity=AssetCheckSeverity.ERROR, description=r.reason)
            for r in result.gate
        ],
    )


@asset(partitions_def=log_batches, group_name=GROUP, deps=[evaluation_report], pool=POOL)
def promoted_adapter(context: AssetExecutionContext, policy: PolicyModel, registry: AdapterRegistry) -> MaterializeResult:
    """The candidate becomes the champion: re-checks the gate on the stored results, refuses a
    candidate trained from a champion that has since changed, then writes the registry
    atomically (version, adapter, metrics, who promoted it and why)."""
    key = context.partition_key
    try:
        promotion = promote_candidate(policy.store(), registry, key, by=f"dagster run {context.run_id} (partition {key})")
    except RoundError as exc:
        raise Failure(str(exc)) from exc
    return MaterializeResult(
        metadata={
            "champion": promotion.version,
            "previous": promotion.previous,
            "adapter": promotion.adapter_path,
            "reason": promotion.reason,
            **finite_metrics(promotion.metrics),
        }
    )


training_assets = [base_policy, policy_checkpoint, evaluation_report, promoted_adapter]
