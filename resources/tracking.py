"""The experiment tracker the training assets export to (off by default)."""

from __future__ import annotations

from dagster import ConfigurableResource
from pydantic import Field

from flow_assets.training.tracking import Tracker, open_tracker


class ExperimentTracking(ConfigurableResource):
    """Where training metrics are exported besides Dagster (``FLOWOPT_TRACKING``).

    Attributes:
        target: ``""`` (off, the default), ``tensorboard:<dir>`` or ``mlflow:<tracking uri>``;
            see :mod:`flow_assets.training.tracking` for what is logged.
    """

    target: str = Field("", description="'' (off), 'tensorboard:<dir>' or 'mlflow:<tracking uri>'")

    def open(self, experiment: str, run_name: str) -> Tracker:
        """A tracker run (see :func:`flow_assets.training.tracking.open_tracker`).

        Raises:
            TrackingError: the target is malformed or its library is not installed.
        """
        return open_tracker(self.target, experiment, run_name)
