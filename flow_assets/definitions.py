"""The flowopt code location: every asset, check, job, sensor and resource in one Definitions.

Paths come from the environment so the same code serves the demo, CI and a deployment:
``FLOWOPT_LAKE`` (default ``.lake``), ``FLOWOPT_LANDING`` (default ``.landing``) and
``FLOWOPT_MODELS`` (default ``.models``: base model, adapters, checkpoints, registry) and
``FLOWOPT_WORKFLOWS`` (default ``.workflows``: workflow definitions, proposals, review audit log),
relative to the working directory of the process that loads the code location; ``FLOWOPT_SETTLE_SECONDS``
(default 10) how long a landed file must stay unmodified before the sensor reads it; ``FLOWOPT_BASE_MODEL`` points
at a user's own model directory instead of the tiny demo model; ``FLOWOPT_SELF_PLAY_ROUNDS`` and
``FLOWOPT_RUN_CONFIG`` drive the loop (:class:`resources.loop.TrainingLoop`);
``FLOWOPT_SENSOR_INTERVAL_SECONDS`` (default 30) spaces every sensor's ticks. The trainable agent is the
built-in agent of ``FLOWOPT_TASKS`` (a task source kind: ``calculator``, the default,
``reasoning_gym`` for spell_backward, ``word_problems``) unless a ``tasks`` resource says otherwise.
"""

import os

from dagster import Definitions, EnvVar, in_process_executor

from flow_assets.adapter_evaluation import adapter_evaluation
from flow_assets.data_plane import data_plane_assets, landed_logs
from flow_assets.jobs import ab_test_job, adapter_evaluation_job, base_policy_job, collect_rollouts_job, log_batch_job, training_history_job, training_round_job, workflow_proposals_job
from flow_assets.live_traffic import live_assets
from flow_assets.training import training_assets
from flow_assets.workflow_assets import workflow_assets
from resources.lake import TrajectoryLake
from resources.landing import LogLanding
from resources.loop import TrainingLoop
from resources.judge import JudgeEndpoint
from resources.live_ab import LiveAB
from resources.tracking import ExperimentTracking
from resources.policy import PolicyModel
from resources.registry import AdapterRegistry
from resources.tasks import TaskSourceResource
from resources.workflows import WorkflowDirectory
from sensors.ab_monitor import ab_monitor_sensor
from sensors.new_logs import new_logs_sensor
from sensors.self_play import self_play_sensor
from sensors.training import training_history_sensor, training_round_sensor


def judge_from_env() -> JudgeEndpoint:
    """The scoring agent from ``FLOWOPT_JUDGE_URL`` (empty: no judge), ``FLOWOPT_JUDGE_MODEL``,
    ``FLOWOPT_JUDGE_MODE`` (``relative`` or ``absolute``), ``FLOWOPT_JUDGE_CACHE`` and the key
    ``FLOWOPT_JUDGE_API_KEY`` as an ``EnvVar`` (read when the resource is used, never stored in
    config)."""
    key = EnvVar("FLOWOPT_JUDGE_API_KEY") if os.environ.get("FLOWOPT_JUDGE_API_KEY") else "unused"
    return JudgeEndpoint(
        base_url=os.environ.get("FLOWOPT_JUDGE_URL", ""), model=os.environ.get("FLOWOPT_JUDGE_MODEL", ""), api_key=key,
        mode=os.environ.get("FLOWOPT_JUDGE_MODE", "relative"), cache_dir=os.environ.get("FLOWOPT_JUDGE_CACHE", ".judge-cache"),
    )  # fmt: skip


def build_resources(
    lake_root: str | None = None,
    landing_dir: str | None = None,
    formats: dict[str, str] | None = None,
    models_root: str | None = None,
    tasks: TaskSourceResource | None = None,
    base_model_path: str | None = None,
    settle_seconds: float | None = None,
    loop: TrainingLoop | None = None,
    tracking: ExperimentTracking | None = None,
    live_ab: LiveAB | None = None,
    judge: JudgeEndpoint | None = None,
    workflows_root: str | None = None,
) -> dict:
    """The resources of the code location, with paths from arguments, else the environment.

    ``formats`` maps landing-relative globs to parser names (default: detect by content);
    ``tasks`` is the trainable agent's task source (default: the built-in calculator agent);
    ``base_model_path`` a local model to train instead of the tiny one; ``settle_seconds`` 0 for a
    caller that lands files only by rename and ticks the sensor at once (the demos, tests);
    ``loop`` the self-play and run-config settings (default: ``FLOWOPT_SELF_PLAY_ROUNDS``,
    ``FLOWOPT_RUN_CONFIG``); ``tracking`` where training metrics are exported besides Dagster
    (default: ``FLOWOPT_TRACKING``, empty = off); ``live_ab`` whether a gated candidate enters
    live A/B as challenger (default: ``FLOWOPT_LIVE_AB`` off, ``FLOWOPT_LIVE_AB_SHARE`` 0.1);
    ``workflows_root`` the workflow directory (default: ``FLOWOPT_WORKFLOWS``, else ``.workflows``).
    """
    models = models_root or os.environ.get("FLOWOPT_MODELS", ".models")
    base = base_model_path or os.environ.get("FLOWOPT_BASE_MODEL") or None
    return {
        "policy": PolicyModel(models_root=models, base_model_path=base),
        "registry": AdapterRegistry(root=models),
        "tasks": tasks or TaskSourceResource(kind=os.environ.get("FLOWOPT_TASKS", "calculator")),
        "loop": loop
        or TrainingLoop(
            self_play_rounds=int(os.environ.get("FLOWOPT_SELF_PLAY_ROUNDS", "0")),
            run_config_path=os.environ.get("FLOWOPT_RUN_CONFIG") or None,
        ),
        "tracking": tracking or ExperimentTracking(target=os.environ.get("FLOWOPT_TRACKING", "")),
        "live_ab": live_ab or LiveAB(
            enabled=os.environ.get("FLOWOPT_LIVE_AB", "0").lower() in ("1", "true", "on", "yes"),
            share=float(os.environ.get("FLOWOPT_LIVE_AB_SHARE", "0.1")),
        ),
        "judge": judge or judge_from_env(),
        "lake": TrajectoryLake(root=lake_root or os.environ.get("FLOWOPT_LAKE", ".lake")),
        "workflows": WorkflowDirectory(root=workflows_root or os.environ.get("FLOWOPT_WORKFLOWS", ".workflows")),
        "landing": LogLanding(
            directory=landing_dir or os.environ.get("FLOWOPT_LANDING", ".landing"),
            formats=formats or {},
            settle_seconds=float(os.environ.get("FLOWOPT_SETTLE_SECONDS", 10.0)) if settle_seconds is None else settle_seconds,
        ),
    }


def build_definitions(
    lake_root: str | None = None,
    landing_dir: str | None = None,
    formats: dict[str, str] | None = None,
    models_root: str | None = None,
    tasks: TaskSourceResource | None = None,
    base_model_path: str | None = None,
    settle_seconds: float | None = None,
    loop: TrainingLoop | None = None,
    tracking: ExperimentTracking | None = None,
    live_ab: LiveAB | None = None,
    judge: JudgeEndpoint | None = None,
    workflows_root: str | None = None,
) -> Definitions:
    """The Definitions object; tests, the demos and the CLI pass explicit paths, task sources,
    base models and settle times (:func:`build_resources`)."""
    return Definitions(
        # every job here is a chain of steps: one process per run (not one per step, which costs
        # a fresh import of torch and the code location for each step)
        executor=in_process_executor,
        assets=[landed_logs, *data_plane_assets, *training_assets, *live_assets, adapter_evaluation, *workflow_assets],
        jobs=[log_batch_job, base_policy_job, collect_rollouts_job, training_round_job, training_history_job, ab_test_job, adapter_evaluation_job, workflow_proposals_job],
        sensors=[new_logs_sensor, training_round_sensor, training_history_sensor, self_play_sensor, ab_monitor_sensor],
        resources=build_resources(lake_root, landing_dir, formats, models_root, tasks, base_model_path, settle_seconds, loop, tracking, live_ab, judge, workflows_root),
    )


defs = build_definitions()
