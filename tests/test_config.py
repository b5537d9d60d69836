"""Run configs generated from the pure configs: same fields, defaults, choices and docs."""

import dataclasses

import pytest
from dagster import DagsterInvalidConfigError, job, op

from flow_assets.config import dagster_config, field_docs
from flow_assets.policy.trainer import GRPOTrainerConfig
from flow_assets.rl.gate import GateConfig
from flow_assets.rl.rewards import RewardConfig
from flow_assets.rounds import EvaluationConfig
from flow_assets.training import TrainConfig


def test_generated_config_mirrors_the_dataclass():
    generated = dagster_config(GRPOTrainerConfig, exclude=("output_dir",))
    names = [f.name for f in dataclasses.fields(GRPOTrainerConfig) if f.name != "output_dir"]
    assert list(generated.model_fields) == names
    assert generated().to_pure(output_dir="x") == GRPOTrainerConfig(output_dir="x")
    assert generated.model_fields["learning_rate"].description.startswith("AdamW learning rate")
    # documented pairs ("a / b: ...") and nested configs are carried too
    assert field_docs(GRPOTrainerConfig)["loss"].startswith("the GRPO surrogate")
    assert generated(loss={"loss_type": "grpo"}).to_pure(output_dir="").loss.loss_type == "grpo"
    rewards = dagster_config(RewardConfig)(custom={"agent": ["m:f"]}).to_pure()
    assert rewards.custom == {"agent": ("m:f",)}


def test_a_run_config_outside_a_literal_is_refused_by_dagster():
    @op
    def read(config: TrainConfig) -> str:
        return config.to_pure(output_dir="").loss.loss_type

    @job
    def one():
        read()

    result = one.execute_in_process(run_config={"ops": {"read": {"config": {"loss": {"loss_type": "bnpo"}}}}})
    assert result.output_for_node("read") == "bnpo"
    with pytest.raises(DagsterInvalidConfigError, match="loss_type"):
        one.execute_in_process(run_config={"ops": {"read": {"config": {"loss": {"loss_type": "best"}}}}})


def test_nested_gate_config_round_trips():
    evaluation = dagster_config(EvaluationConfig)(gate={"metric": "greedy", "min_gain": 0.05}).to_pure()
    assert evaluation.gate == GateConfig(metric="greedy", min_gain=0.05) and evaluation.max_tasks == 500
    assert dagster_config(EvaluationConfig)(modes=["sampled"]).to_pure().modes == ("sampled",)


def test_evaluation_modes_are_checked():
    with pytest.raises(ValueError, match="modes"):
        dagster_config(EvaluationConfig)(modes=["lukewarm"]).to_pure()
    with pytest.raises(ValueError, match="metric"):
        EvaluationConfig(modes=("greedy",))
