"""The flowopt code location: every asset, check, job, sensor and resource in one Definitions.

Paths come from the environment so the same code serves the demo, CI and a deployment:
``FLOWOPT_LAKE`` (default ``.lake``) and ``FLOWOPT_LANDING`` (default ``.landing``), relative to
the working directory of the process that loads the code location.
"""

import os

from dagster import Definitions

from flow_assets.data_plane import data_plane_assets
from flow_assets.jobs import log_batch_job
from resources.lake import TrajectoryLake
from resources.landing import LogLanding
from sensors.new_logs import new_logs_sensor


def build_resources(
    lake_root: str | None = None, landing_dir: str | None = None, formats: dict[str, str] | None = None
) -> dict:
    """The resources of the code location, with paths from arguments, else the environment.

    ``formats`` maps landing-relative globs to parser names (default: detect by content).
    """
    return {
        "lake": TrajectoryLake(root=lake_root or os.environ.get("FLOWOPT_LAKE", ".lake")),
        "landing": LogLanding(
            directory=landing_dir or os.environ.get("FLOWOPT_LANDING", ".landing"), formats=formats or {}
        ),
    }


def build_definitions(
    lake_root: str | None = None, landing_dir: str | None = None, formats: dict[str, str] | None = None
) -> Definitions:
    """The Definitions object; tests and the CLI pass explicit paths."""
    return Definitions(
        assets=[*data_plane_assets],
        jobs=[log_batch_job],
        sensors=[new_logs_sensor],
        resources=build_resources(lake_root, landing_dir, formats),
    )


defs = build_definitions()
