"""A training round launched by hand (the UI's Materialize, ``dagster job execute``) refuses a
batch whose blocking data checks failed, as the sensor and the training API do."""

from dagster import AssetCheckResult, AssetCheckSpec, Config, MaterializeResult, asset, materialize

from flow_assets.definitions import build_definitions
from flow_assets.runtime.local import failure_messages, run_job
from flow_assets.core.partitions import log_batches


class Checked(Config):
    finite: bool = True


@asset(name="advantages", partitions_def=log_batches, check_specs=[AssetCheckSpec("advantages_finite", asset="advantages", blocking=True)])
def recorded_advantages(config: Checked) -> MaterializeResult:
    """The ``advantages`` materialisation and its blocking check as the data plane records them
    (NaN advantages through the real pipeline are covered in test_data_plane)."""
    return MaterializeResult(check_results=[AssetCheckResult(check_name="advantages_finite", passed=config.finite)])


def test_a_round_launched_by_hand_refuses_a_batch_that_failed_its_blocking_checks(dagster_instance, tmp_path):
    instance = dagster_instance
    instance.add_dynamic_partitions("log_batches", ["bad"])
    materialize([recorded_advantages], instance=instance, partition_key="bad", raise_on_error=False,
                run_config={"ops": {"advantages": {"config": {"finite": False}}}})  # fmt: skip
    defs = build_definitions(str(tmp_path / "lake"), str(tmp_path / "landing"), models_root=str(tmp_path / "models"), settle_seconds=0)
    result = run_job(defs, instance, "training_round_job", "bad")
    assert not result.success
    errors, _ = failure_messages(result)
    assert any("'bad'" in e and "advantages_finite" in e and "not trained" in e for e in errors), errors
    assert not (tmp_path / "models").exists() or not any((tmp_path / "models").rglob("adapter_model.safetensors"))
