"""``adapter_evaluation``: one registry version of the policy on the held-out split, on demand.

A round's ``evaluation_report`` compares a candidate with the champion it grew from; a person (or
``training.evaluate`` in the API) sometimes wants one version's own numbers instead: an old
champion before a rollback, a challenger, ``v0`` as a baseline. This asset answers that, one
partition per registry version (``adapter_versions``, added by whoever asks), on the same
held-out tasks, modes and temperatures the gate uses, so its numbers compare with the rounds'.
"""

from pathlib import Path

from dagster import AssetExecutionContext, Failure, MaterializeResult, MetadataValue, asset

from flow_assets.training.champion import CHAMPION
from flow_assets.serving.gateway.engine import AdapterRef
from flow_assets.core.config import dagster_config
from flow_assets.core.partitions import adapter_versions
from flow_assets.rl.gate import GateConfig
from flow_assets.training.rounds import EvaluationConfig, evaluate_version
from flow_assets.core.versions import TRAINING_OWNERS, code_version
from resources.lake import TrajectoryLake
from resources.policy import PolicyModel
from resources.registry import AdapterRegistry
from resources.tasks import TaskSourceResource


class AdapterEvaluationConfig(dagster_config(EvaluationConfig, "AdapterEvaluationFields", exclude=("gate",))):
    """What to evaluate on: the fields of :class:`~flow_assets.training.rounds.EvaluationConfig`
    (declared once there, so these numbers compare with the rounds'), without its gate: nothing is
    promoted here."""

    def to_pure(self) -> EvaluationConfig:
        """The evaluation's pure config; its gate reads the first mode (the gate is not applied).

        Raises:
            ValueError: an unknown mode, or a temperature the dataclass refuses.
        """
        values = {k: tuple(v) if isinstance(v, list) else v for k, v in self.model_dump().items()}
        modes = values.get("modes", ())
        return EvaluationConfig(**values, gate=GateConfig(metric=modes[0] if modes else "sampled"))


@asset(
    partitions_def=adapter_versions,
    group_name="training",
    kinds={"pytorch"},
    deps=[CHAMPION],
    owners=TRAINING_OWNERS,
    code_version=code_version("flow_assets.rl.evaluation", "flow_assets.rl.eval_stats", "flow_assets.serving.agents", "flow_assets.training.rounds"),
)
def adapter_evaluation(
    context: AssetExecutionContext,
    config: AdapterEvaluationConfig,
    lake: TrajectoryLake,
    policy: PolicyModel,
    registry: AdapterRegistry,
    tasks: TaskSourceResource,
) -> MaterializeResult:
    """One registry version's agents on the held-out tasks through the gateway: success rate
    (95% Wilson interval), mean reward, completion tokens, LLM and tool calls per rollout (95% t
    intervals) per mode; the rollouts in the lake table adapter_evaluations."""
    version = context.partition_key
    entry = registry.version(version)
    if entry is None:
        raise Failure(f"the registry at {registry.path} holds no version {version!r}")
    store = policy.store()
    try:
        pure = config.to_pure()
    except ValueError as exc:
        raise Failure(f"config: {exc}") from None
    rows, report, seconds = evaluate_version(
        store, tasks.source(), tasks.agent_fn(), tasks.agent_id, AdapterRef(version, entry["adapter_path"]), pure,
        Path(store.models_root) / "evaluations" / version,
    )  # fmt: skip
    lake.write_partition("adapter_evaluations", version, rows)
    numbers = {}
    for mode, summary in report.items():
        rate = summary["success_rate"]
        context.log.info(f"{version} {mode}: success {rate['rate']:.3f} [{rate['ci_low']:.3f}, {rate['ci_high']:.3f}] on {summary['n_tasks']} tasks")
        numbers |= {
            f"{mode}_success": MetadataValue.float(round(rate["rate"], 4)),
            f"{mode}_success_low": MetadataValue.float(round(rate["ci_low"], 4)),
            f"{mode}_success_high": MetadataValue.float(round(rate["ci_high"], 4)),
            f"{mode}_avg_reward": MetadataValue.float(round(summary["avg_reward"]["mean"], 4)),
        }
    return MaterializeResult(
        metadata={
            "version": version,
            "adapter": MetadataValue.path(entry["adapter_path"]),
            "agent_id": tasks.agent_id,
            "held_out_tasks": MetadataValue.int(max((s["n_tasks"] for s in report.values()), default=0)),
            **numbers,
            "report": MetadataValue.json(report),
            "generation_seconds": MetadataValue.float(round(seconds, 2)),
            "dagster/row_count": MetadataValue.int(rows.height),
        }
    )
