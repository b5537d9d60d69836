"""Run configs generated from the pure configs: same fields, defaults, choices and docs; renamed
fields refused naming the new one; one builder of a round's run config."""

import dataclasses
import json
import re
import subprocess
from pathlib import Path

import pytest
from dagster import DagsterInvalidConfigError, job, op

from flow_assets.core.config import PureConfig, dagster_config, run_config_values
from flow_assets.policy.configs import GRPOTrainerConfig
from flow_assets.rl.advantages import AdvantageConfig
from flow_assets.rl.grpo_config import GRPOLossConfig
from flow_assets.rl.gate import GateConfig
from flow_assets.rl.rewards import RewardConfig
from flow_assets.training.rounds import EvaluationConfig
from flow_assets.training.run_config import EvaluationRunConfig, RoundSettings, TrainConfig, round_run_config, round_settings


def test_generated_config_mirrors_the_dataclass():
    generated = dagster_config(GRPOTrainerConfig, exclude=("output_dir",))
    names = [f.name for f in dataclasses.fields(GRPOTrainerConfig) if f.name != "output_dir"]
    assert list(generated.model_fields) == names and issubclass(generated, PureConfig)
    # an excluded field gets the dataclass's default: to_pure takes no arguments
    assert generated().to_pure() == GRPOTrainerConfig()
    assert generated.model_fields["learning_rate"].description.startswith("AdamW learning rate")
    # descriptions come from the fields' metadata, nested configs included
    assert generated.model_fields["loss"].description.startswith("the GRPO surrogate")
    nested = generated.model_fields["loss"].annotation
    assert nested.model_fields["epsilon_high"].description == dataclasses.fields(GRPOLossConfig)[1].metadata["description"]
    assert generated(loss={"loss_type": "grpo"}).to_pure().loss.loss_type == "grpo"
    rewards = dagster_config(RewardConfig)(custom={"agent": ["m:f"]}).to_pure()
    assert rewards.custom == {"agent": ("m:f",)}


def test_a_run_config_outside_a_literal_is_refused_by_dagster():
    @op
    def read(config: TrainConfig) -> str:
        return config.to_pure().loss.loss_type

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


def test_a_field_without_a_description_is_refused():
    @dataclasses.dataclass(frozen=True)
    class Undocumented:
        size: int = 1

    with pytest.raises(TypeError, match="size"):
        dagster_config(Undocumented)


@pytest.mark.parametrize(
    ("config", "values", "new"),
    [
        (TrainConfig, {"num_epochs": 2}, "num_iterations"),
        (TrainConfig, {"checkpoint_every": 10}, "save_steps"),
        (TrainConfig, {"loss": {"eps_low": 0.1, "eps_high": 0.28}}, "loss.epsilon_high"),
        (dagster_config(AdvantageConfig), {"scale_by_std": False}, "scale_rewards"),
    ],
)
def test_a_renamed_field_is_refused_naming_the_new_one(config, values, new):
    with pytest.raises(ValueError, match=re.escape(f"-> {new}")):
        config(**values)


def test_a_renamed_field_in_a_run_config_fails_the_run_naming_the_new_one():
    @op
    def read(config: TrainConfig) -> int:
        return config.to_pure().num_iterations

    @job
    def one():
        read()

    assert one.execute_in_process(run_config={"ops": {"read": {"config": {"num_iterations": 3}}}}).output_for_node("read") == 3
    with pytest.raises(DagsterInvalidConfigError, match="num_epochs"):
        one.execute_in_process(run_config={"ops": {"read": {"config": {"num_epochs": 3}}}})


def test_run_config_values_name_only_what_differs_from_the_defaults():
    assert run_config_values(GRPOTrainerConfig()) == {}
    changed = GRPOTrainerConfig(learning_rate=2e-3, loss=GRPOLossConfig(epsilon_high=0.28))
    assert run_config_values(changed) == {"learning_rate": 2e-3, "loss": {"epsilon_high": 0.28}}
    assert run_config_values(EvaluationConfig(modes=("sampled",))) == {"modes": ["sampled"]}
    assert run_config_values(RewardConfig(custom={"a": ("m:f",)})) == {"custom": {"a": ["m:f"]}}
    with pytest.raises(ValueError, match="output_dir"):
        run_config_values(GRPOTrainerConfig(output_dir="elsewhere"), exclude=("output_dir",))


def test_round_run_config_round_trips_through_the_assets_configs():
    trainer = GRPOTrainerConfig(num_iterations=3, micro_batch_size=16, loss=GRPOLossConfig(epsilon_high=0.28, loss_type="dr_grpo"))
    evaluation = EvaluationConfig(max_tasks=24, modes=("sampled",), gate=GateConfig(min_gain=-1.0, max_kl=1e9))
    run_config = round_run_config(trainer, evaluation, negate_advantages=True, kl_samples=None)
    assert run_config == {
        "ops": {
            "policy_checkpoint": {"config": {"num_iterations": 3, "micro_batch_size": 16, "loss": {"epsilon_high": 0.28, "loss_type": "dr_grpo"},
                                             "negate_advantages": True, "kl_samples": None}},
            "evaluation_report": {"config": {"max_tasks": 24, "modes": ["sampled"], "gate": {"min_gain": -1.0, "max_kl": 1e9}}},
        }
    }  # fmt: skip
    # what the assets read back is the same typed config: typed equality, no dumps compared
    ops = run_config["ops"]
    assert TrainConfig(**ops["policy_checkpoint"]["config"]).to_pure() == trainer
    assert EvaluationRunConfig(**ops["evaluation_report"]["config"]).to_pure() == evaluation
    settings = round_settings(run_config)
    assert settings.trainer.negate_advantages and settings.trainer.kl_samples is None
    assert settings.run_config() == run_config
    assert round_run_config() == {"ops": {"policy_checkpoint": {"config": {}}, "evaluation_report": {"config": {}}}}


def test_round_settings_refuse_what_the_round_would_refuse():
    with pytest.raises(ValueError, match="modes"):
        RoundSettings(evaluation={"modes": ["greedy"]})  # the gate's metric (sampled) is not evaluated
    with pytest.raises(ValueError, match=re.escape('send {"trainer"')):
        RoundSettings.model_validate({"ops": {"policy_checkpoint": {"config": {}}}})
    with pytest.raises(ValueError, match="unknown_field"):
        RoundSettings(trainer={"unknown_field": 1})
    with pytest.raises(ValueError, match="collect"):
        round_settings({"ops": {"collect": {"config": {}}}})


def test_the_trainer_config_reads_back_what_it_wrote():
    config = GRPOTrainerConfig(output_dir="x", num_iterations=2, loss=GRPOLossConfig(beta=0.04))
    assert GRPOTrainerConfig.from_dict(config.to_dict()) == config
    with pytest.raises(TypeError, match="num_epochs"):
        GRPOTrainerConfig.from_dict({**config.to_dict(), "num_epochs": 2})


REPO = Path(__file__).resolve().parents[2]


def test_a_rounds_run_config_is_written_only_by_round_run_config():
    """No hand-written ``{"ops": {"policy_checkpoint": ...}}`` (or evaluation_report) dict in the
    code, benchmarks or tests: they all build it with round_run_config / RoundSettings, whose
    module (and this test) are the only ones to spell it."""
    files = subprocess.run(["git", "ls-files", "*.py"], cwd=REPO, capture_output=True, text=True, check=True).stdout.split()
    pattern = re.compile(r"""["'](policy_checkpoint|evaluation_report)["']\s*:\s*\{\s*["']config["']""")
    offenders = [
        f"{name}:{n}" for name in files if name not in ("flow_assets/training/run_config.py", "tests/core/test_config.py")
        for n, line in enumerate((REPO / name).read_text().splitlines(), 1) if pattern.search(line)
    ]  # fmt: skip
    assert offenders == []


def test_the_sensors_run_config_file_is_read_through_the_builder(tmp_path):
    from resources.loop import TrainingLoop

    path = tmp_path / "run-config.json"
    collect = {"ops": {"rollouts": {"config": {"tasks_per_batch": 8}}}}
    saved = {"trainer": {"learning_rate": 2e-3}, "evaluation": {"max_tasks": 24}}
    path.write_text(json.dumps({"collect_rollouts_job": collect, "training_round_job": RoundSettings(**saved).run_config()}))
    loop = TrainingLoop(run_config_path=str(path))
    assert loop.run_config("collect_rollouts_job") == collect
    assert loop.run_config("training_round_job") == round_run_config(GRPOTrainerConfig(learning_rate=2e-3), EvaluationConfig(max_tasks=24))
    # a file saved before the renames: refused when read, naming the file, the job and the new field
    old = RoundSettings(trainer={"num_iterations": 2}).run_config()
    old["ops"]["policy_checkpoint"]["config"] = {"num_epochs": 2}
    path.write_text(json.dumps({"training_round_job": old}))
    with pytest.raises(ValueError, match=f"(?s){re.escape(str(path))}: training_round_job: .*num_epochs -> num_iterations"):
        loop.run_config("training_round_job")
