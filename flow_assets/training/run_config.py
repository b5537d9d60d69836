"""The training assets' run configs, and :func:`round_run_config`, the one builder of a training
round's Dagster run config.

A round's settings travel as typed objects until the last moment: the trainer's
:class:`~flow_assets.policy.configs.GRPOTrainerConfig` and the evaluation's
:class:`~flow_assets.training.rounds.EvaluationConfig` (pure dataclasses, the fields' one declaration) go
into :func:`round_run_config`, which writes the run config of ``training_round_job``::

    {"ops": {"policy_checkpoint": {"config": <trainer fields that differ from the defaults,
                                             negate_advantages, kl_samples>},
             "evaluation_report": {"config": <evaluation fields that differ from the defaults>}}}

and the assets read it back as :class:`TrainConfig` / :class:`EvaluationRunConfig`, whose
``to_pure()`` gives the same dataclasses (``round_config(round_run_config(t, e)) == (t, e)``).
The demo, the API (``training.start_grpo``), the sensors' run-config file
(:class:`resources.loop.TrainingLoop`), the benchmarks and the tests all build it here.

No torch here: the code location imports this module.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

from flow_assets.core.config import dagster_config, run_config_values
from flow_assets.policy.configs import GRPOTrainerConfig, SFTConfig, TinyModelConfig
from flow_assets.training.rounds import CollectConfig, EvaluationConfig

#: the training job and its two configured assets
TRAINING_JOB = "training_round_job"
TRAIN_OP = "policy_checkpoint"
EVALUATION_OP = "evaluation_report"
#: turn rows the gate's KL to the behaviour policy is estimated on, by default
KL_SAMPLES = 256

TinyModelRunConfig = dagster_config(TinyModelConfig, "TinyModelRunConfig")
SFTRunConfig = dagster_config(SFTConfig, "SFTRunConfig")
CollectRunConfig = dagster_config(CollectConfig, "CollectRunConfig")
# output_dir is the round's own (its directory under the models root), and the update rule follows
# from the batch's agents (the training loop's sources): neither is a run setting
TrainerRunConfig = dagster_config(GRPOTrainerConfig, "TrainerRunConfig", exclude=("output_dir", "update_rule"))
EvaluationRunConfig = dagster_config(EvaluationConfig, "EvaluationRunConfig")


class TrainConfig(TrainerRunConfig):
    """GRPO round settings (the trainer's, stored with every checkpoint), and a test switch."""

    negate_advantages: bool = Field(False, description="train AGAINST the advantages (tests the gate)")
    kl_samples: int | None = Field(KL_SAMPLES, description="turn rows the gate's KL to the behaviour policy is estimated on (null: all)")


def round_run_config(
    trainer: GRPOTrainerConfig | None = None,
    evaluation: EvaluationConfig | None = None,
    *,
    negate_advantages: bool = False,
    kl_samples: int | None = KL_SAMPLES,
) -> dict[str, Any]:
    """The run config of one ``training_round_job`` run (module docstring).

    Args:
        trainer: the GRPO round's settings (default: every default); its ``output_dir`` must be
            left at the default, as the round puts checkpoints in its own directory.
        evaluation: the held-out evaluation and gate (default: every default).
        negate_advantages: train against the advantages (a test that the gate blocks it).
        kl_samples: turn rows the gate's KL is estimated on (``None``: all).

    Returns:
        ``{"ops": {"policy_checkpoint": {"config": {...}}, "evaluation_report": {"config": {...}}}}``
        with only the values that differ from the defaults.

    Raises:
        ValueError: ``trainer.output_dir`` was set.
    """
    train = run_config_values(trainer or GRPOTrainerConfig(), exclude=("output_dir", "update_rule"))
    if negate_advantages:
        train["negate_advantages"] = True
    if kl_samples != KL_SAMPLES:
        train["kl_samples"] = kl_samples
    return {"ops": {TRAIN_OP: {"config": train}, EVALUATION_OP: {"config": run_config_values(evaluation or EvaluationConfig())}}}


class RoundSettings(BaseModel):
    """A training round's settings as a client sends them (``training.start_grpo``'s ``config``):
    ``trainer`` takes :class:`TrainConfig`'s fields, ``evaluation`` :class:`EvaluationRunConfig`'s;
    both validated here, so a wrong field is refused before any run is submitted.

    Raises (on construction):
        pydantic.ValidationError: an unknown or renamed field, a value of the wrong type, an
            evaluation the dataclass refuses (e.g. an unknown mode), or the old run-config shape
            ``{"ops": ...}``.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    trainer: TrainConfig = Field(default_factory=TrainConfig, description="policy_checkpoint's settings (the trainer's and the round's)")
    evaluation: EvaluationRunConfig = Field(default_factory=EvaluationRunConfig, description="evaluation_report's settings (held-out evaluation and gate)")

    @model_validator(mode="before")
    @classmethod
    def _refuse_run_config_shape(cls, data: Any) -> Any:
        if isinstance(data, Mapping) and "ops" in data:
            raise ValueError(
                'a Dagster run config {"ops": ...} is no longer accepted here: send {"trainer": {...}, "evaluation": {...}} '
                f"(the fields of {TRAIN_OP} and {EVALUATION_OP})"
            )
        return data

    @model_validator(mode="after")
    def _check_pure(self) -> RoundSettings:
        self.evaluation.to_pure()  # the dataclass's own checks (modes, the gate's metric)
        return self

    def run_config(self) -> dict[str, Any]:
        """These settings as :func:`round_run_config` writes them."""
        return round_run_config(
            self.trainer.to_pure(), self.evaluation.to_pure(), negate_advantages=self.trainer.negate_advantages, kl_samples=self.trainer.kl_samples
        )


def round_settings(run_config: Mapping[str, Any]) -> RoundSettings:
    """The settings in a ``training_round_job`` run config (the inverse of :func:`round_run_config`).

    Raises:
        ValueError: ops other than the two of the round, or settings :class:`RoundSettings` refuses
            (pydantic's ``ValidationError`` is a ``ValueError``).
    """
    ops = dict(run_config.get("ops") or {})
    if other := set(run_config) - {"ops"} or set(ops) - {TRAIN_OP, EVALUATION_OP}:
        raise ValueError(f"a {TRAINING_JOB} run config holds only ops.{TRAIN_OP} and ops.{EVALUATION_OP}; got {sorted(other)}")
    return RoundSettings(
        trainer=dict(ops.get(TRAIN_OP, {}).get("config") or {}), evaluation=dict(ops.get(EVALUATION_OP, {}).get("config") or {})
    )
