"""Optional export of training metrics to an experiment tracker (off by default).

Dagster's asset metadata and the ``training_history`` asset are the record; a team that reads
training in TensorBoard or MLflow can also get it there. The target is one string
(``FLOWOPT_TRACKING``):

- ``""`` (default): off, nothing is imported.
- ``tensorboard:<dir>``: event files under ``<dir>/<experiment>/<run>`` through
  ``torch.utils.tensorboard`` (needs the ``tensorboard`` package).
- ``mlflow:<tracking uri>``: e.g. ``mlflow:sqlite:///mlflow.db`` or ``mlflow:http://host:5000``
  through the ``mlflow`` client (``mlflow-skinny`` suffices).

Weights & Biases is not wired in: its ``wandb sync`` reads TensorBoard event directories, so the
``tensorboard`` target reaches it without a third client here.

What is logged, per training round (one tracker run named after the round's partition key):
the trainer's config as params, every optimizer step's ``train/*`` metrics at its step number,
and the held-out ``eval/*`` results at the round's last step. Across rounds, a run named
``rounds`` gets ``round/*`` metrics at step = round number, so candidate vs champion success
reads as one curve.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol

TRACKERS = ("tensorboard", "mlflow")


class TrackingError(ValueError):
    """A tracking target that cannot be used (unknown kind, missing library), with the fix."""


class Tracker(Protocol):
    """One tracker run: metrics at integer steps, params once."""

    def log_params(self, params: Mapping[str, Any]) -> None: ...

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None: ...

    def close(self) -> None: ...


class NullTracker:
    """Tracking off: every call does nothing."""

    def log_params(self, params: Mapping[str, Any]) -> None:
        """Nothing."""

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        """Nothing."""

    def close(self) -> None:
        """Nothing."""


class TensorBoardTracker:
    """Event files under ``<root>/<experiment>/<run_name>`` (``torch.utils.tensorboard``).

    Params are written once as a Markdown table under the text tag ``params`` (TensorBoard's
    hparams view wants final metrics up front, which a round only has at its end).

    Raises:
        TrackingError: the ``tensorboard`` package is not installed.
    """

    def __init__(self, root: str | Path, experiment: str, run_name: str):
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as exc:  # torch raises ImportError naming tensorboard
            raise TrackingError("FLOWOPT_TRACKING=tensorboard:... needs the tensorboard package (pip install 'flowopt[tracking]')") from exc
        self.log_dir = Path(root) / experiment / run_name
        self._writer = SummaryWriter(log_dir=str(self.log_dir))

    def log_params(self, params: Mapping[str, Any]) -> None:
        """Write ``params`` as a two-column Markdown table (text tag ``params``)."""
        rows = "\n".join(f"| {k} | {v} |" for k, v in sorted(params.items()))
        self._writer.add_text("params", "| param | value |\n|---|---|\n" + rows)

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        """One scalar per metric at ``step``; NaN and infinities are skipped."""
        for name, value in metrics.items():
            if value == value and abs(value) != float("inf"):
                self._writer.add_scalar(name, float(value), global_step=step)

    def close(self) -> None:
        """Flush and close the event file."""
        self._writer.close()


class MLflowTracker:
    """An MLflow run named ``run_name`` in experiment ``experiment`` at ``tracking_uri``; a run of
    that name that exists already is continued (the evaluation logs into the round's run that the
    training step opened), so each round is one MLflow run.

    Raises:
        TrackingError: the ``mlflow`` package is not installed.
    """

    def __init__(self, tracking_uri: str, experiment: str, run_name: str):
        try:
            from mlflow.tracking import MlflowClient
        except ImportError as exc:
            raise TrackingError("FLOWOPT_TRACKING=mlflow:... needs the mlflow package (pip install 'flowopt[tracking]')") from exc
        self._client = MlflowClient(tracking_uri=tracking_uri)
        found = self._client.get_experiment_by_name(experiment)
        experiment_id = found.experiment_id if found else self._client.create_experiment(experiment)
        runs = self._client.search_runs([experiment_id], filter_string=f"tags.`mlflow.runName` = '{run_name}'", max_results=1)
        self.run_id = runs[0].info.run_id if runs else self._client.create_run(experiment_id, run_name=run_name).info.run_id
        if runs:
            self._client.update_run(self.run_id, status="RUNNING")

    def log_params(self, params: Mapping[str, Any]) -> None:
        """Log ``params`` (values as strings, cut at MLflow's 6000 characters); a param already
        logged with the same value is fine, another value raises MLflow's error."""
        from mlflow.entities import Param

        have = self._client.get_run(self.run_id).data.params
        new = [Param(k, str(v)[:6000]) for k, v in sorted(params.items()) if k not in have]
        if new:
            self._client.log_batch(self.run_id, params=new)

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        """One metric value per name at ``step`` (NaN and infinities skipped)."""
        import time

        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        values = [Metric(k, float(v), now, step) for k, v in metrics.items() if v == v and abs(v) != float("inf")]
        if values:
            self._client.log_batch(self.run_id, metrics=values)

    def close(self) -> None:
        """Mark the run finished."""
        self._client.set_terminated(self.run_id)


def open_tracker(target: str, experiment: str, run_name: str) -> Tracker:
    """The tracker run for ``target`` (see the module docstring); :class:`NullTracker` when
    ``target`` is empty.

    Args:
        target: ``""``, ``tensorboard:<dir>`` or ``mlflow:<tracking uri>``.
        experiment: the experiment (the agent id, e.g. ``flowopt:calculator``; ``:`` becomes ``-``
            in a directory name).
        run_name: the run (a round's partition key, or ``rounds``).

    Raises:
        TrackingError: an unknown kind, an empty location, or the kind's library not installed.
    """
    if not target:
        return NullTracker()
    kind, sep, where = target.partition(":")
    if not sep or kind not in TRACKERS or not where:
        raise TrackingError(f"FLOWOPT_TRACKING={target!r}: expected '' (off), 'tensorboard:<dir>' or 'mlflow:<tracking uri>'")
    if kind == "tensorboard":
        return TensorBoardTracker(where, experiment.replace(":", "-"), run_name)
    return MLflowTracker(where, experiment, run_name)


def flat_params(config: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """``config`` with nested mappings flattened to dotted keys (``{"a": {"b": 1}}`` ->
    ``{"a.b": 1}``), the form trackers store params in."""
    out: dict[str, Any] = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            out |= flat_params(value, name + ".")
        else:
            out[name] = value
    return out
