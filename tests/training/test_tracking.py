"""Exporting training metrics to TensorBoard and MLflow through their own libraries, read back
with their own readers; off by default."""

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from flow_assets.training.tracking import MLflowTracker, NullTracker, TensorBoardTracker, TrackingError, flat_params, open_tracker


def scalars(log_dir) -> dict[str, list[tuple[int, float]]]:
    """Every scalar series in a TensorBoard run directory: tag -> [(step, value)]."""
    acc = EventAccumulator(str(log_dir))
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def test_off_by_default_and_a_bad_target_is_refused_with_the_accepted_forms():
    assert isinstance(open_tracker("", "flowopt:calculator", "r0001"), NullTracker)
    for bad in ("wandb:proj", "tensorboard:", "mlflow", "/tmp/x"):
        with pytest.raises(TrackingError, match="'tensorboard:<dir>' or 'mlflow:<tracking uri>'"):
            open_tracker(bad, "flowopt:calculator", "r0001")


def test_tensorboard_gets_every_step_and_skips_non_finite_values(tmp_path):
    tracker = open_tracker(f"tensorboard:{tmp_path}", "flowopt:calculator", "r0001.flowopt-calculator.v0-x.abc")
    assert isinstance(tracker, TensorBoardTracker)
    tracker.log_params(flat_params({"trainer": {"learning_rate": 0.001, "loss": {"epsilon": 0.2}}}))
    for step in (1, 2, 3):
        tracker.log_metrics({"train/loss": 1.0 / step, "train/kl": float("nan") if step == 2 else 0.01 * step}, step=step)
    tracker.close()
    series = scalars(tmp_path / "flowopt-calculator" / "r0001.flowopt-calculator.v0-x.abc")
    assert series["train/loss"] == [(1, 1.0), (2, 0.5), (3, pytest.approx(1 / 3))]
    assert [s for s, _ in series["train/kl"]] == [1, 3]


def test_mlflow_continues_the_rounds_run_by_name(tmp_path):
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    first = open_tracker(f"mlflow:{uri}", "flowopt:calculator", "r0001")
    first.log_params({"trainer.learning_rate": 0.001})
    first.log_metrics({"train/loss": 0.7}, step=1)
    first.close()
    again = open_tracker(f"mlflow:{uri}", "flowopt:calculator", "r0001")  # the evaluation, later
    assert isinstance(again, MLflowTracker) and again.run_id == first.run_id
    again.log_params({"trainer.learning_rate": 0.001})  # logged before with the same value: fine
    again.log_metrics({"eval/gain": 0.1, "eval/mcnemar_p": float("inf")}, step=4)
    again.close()
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=uri)
    run = client.get_run(first.run_id)
    assert run.data.params == {"trainer.learning_rate": "0.001"} and run.info.status == "FINISHED"
    assert [(m.step, m.value) for m in client.get_metric_history(first.run_id, "eval/gain")] == [(4, 0.1)]
    assert "eval/mcnemar_p" not in run.data.metrics


def test_flat_params_dots_nested_keys():
    assert flat_params({"a": {"b": 1, "c": {"d": "x"}}, "e": None}) == {"a.b": 1, "a.c.d": "x", "e": None}
