"""The flowopt code location: every asset, check, job, sensor and resource in one Definitions.

Its settings come from the environment over the project settings file ``.flowopt.toml`` of the
working directory, read once when the code location loads
(:func:`flow_assets.settings.process_settings`), so the same code serves the demo, CI and a
deployment: the lake, landing, models and workflow directories (``FLOWOPT_LAKE``,
``FLOWOPT_LANDING``, ``FLOWOPT_MODELS``, ``FLOWOPT_WORKFLOWS``), how long a landed file settles
(``FLOWOPT_SETTLE_SECONDS``), a user's own base model (``FLOWOPT_BASE_MODEL``), the loop
(``FLOWOPT_SELF_PLAY_ROUNDS``, ``FLOWOPT_RUN_CONFIG``), the sensors' interval
(``FLOWOPT_SENSOR_INTERVAL_SECONDS``), the trainable agent's task source (``FLOWOPT_TASKS``), the
judge, tracking and live A/B. ``docs/settings.md`` lists each with its default.
"""

from dagster import Definitions, EnvVar, in_process_executor

from flow_assets.training.adapter_evaluation import adapter_evaluation
from flow_assets.data_plane.assets import data_plane_assets, landed_logs
from flow_assets.jobs import (
    ab_test_job,
    adapter_evaluation_job,
    base_policy_job,
    collect_rollouts_job,
    log_batch_job,
    prompt_round_job,
    training_history_job,
    training_round_job,
    workflow_proposals_job,
)
from flow_assets.live_ab.assets import live_assets
from flow_assets.settings import JUDGE_API_KEY_VAR, REFLECTION_API_KEY_VAR, UPSTREAM_API_KEY_VAR, Settings, process_settings
from flow_assets.training.assets import training_assets
from flow_assets.training.prompt_assets import prompt_assets
from flow_assets.workflows.assets import workflow_assets
from resources.lake import TrajectoryLake
from resources.landing import LogLanding
from resources.loop import TrainingLoop
from resources.judge import JudgeEndpoint
from resources.live_ab import LiveAB
from resources.tracking import ExperimentTracking
from resources.policy import PolicyModel
from resources.registry import AdapterRegistry
from resources.tasks import TaskSourceResource
from resources.upstream import ReflectionEndpoint, UpstreamModel
from resources.workflows import WorkflowDirectory
from sensors.ab_monitor import ab_monitor_sensor
from sensors.new_logs import new_logs_sensor
from sensors.self_play import self_play_sensor
from sensors.training import training_history_sensor, training_round_sensor


def judge_from_settings(settings: Settings) -> JudgeEndpoint:
    """The scoring agent of ``settings`` (URL empty: no judge). The key stays an ``EnvVar`` that
    Dagster reads when the resource is used, so that it is never stored in config or shown in the
    UI; ``settings`` only says whether one is set."""
    key = EnvVar(JUDGE_API_KEY_VAR) if settings.judge_api_key else "unused"
    return JudgeEndpoint(
        base_url=settings.judge_url, model=settings.judge_model, api_key=key, mode=settings.judge_mode, cache_dir=settings.judge_cache,
    )  # fmt: skip


def upstream_from_settings(settings: Settings) -> UpstreamModel:
    """The upstream model of ``settings`` (URL empty: none, so no prompt rounds). The key, like
    the judge's, stays an ``EnvVar`` read when the resource is used, never stored or shown."""
    key = EnvVar(UPSTREAM_API_KEY_VAR) if settings.upstream_api_key else ""
    return UpstreamModel(base_url=settings.upstream_url, model=settings.upstream_model, api_key=key)


def reflection_from_settings(settings: Settings) -> ReflectionEndpoint:
    """The reflection model of ``settings`` (URL empty: none); the key an ``EnvVar`` as the judge's."""
    key = EnvVar(REFLECTION_API_KEY_VAR) if settings.reflection_api_key else ""
    return ReflectionEndpoint(base_url=settings.reflection_url, model=settings.reflection_model, api_key=key)


def build_resources(
    settings: Settings,
    formats: dict[str, str] | None = None,
    tasks: TaskSourceResource | None = None,
    loop: TrainingLoop | None = None,
    tracking: ExperimentTracking | None = None,
    live_ab: LiveAB | None = None,
    judge: JudgeEndpoint | None = None,
    upstream: UpstreamModel | None = None,
    reflection: ReflectionEndpoint | None = None,
) -> dict:
    """The resources of the code location for ``settings``; a resource passed explicitly replaces
    the one ``settings`` describes.

    ``formats`` maps landing-relative globs to parser names (default: detect by content);
    ``tasks`` is the trainable agent's task source (default: the built-in agent of
    ``settings.tasks``); ``loop`` the self-play and run-config settings; ``tracking`` where
    training metrics are exported besides Dagster; ``live_ab`` whether a gated candidate enters
    live A/B as challenger; ``judge`` the scoring agent (:func:`judge_from_settings`);
    ``upstream`` the model server of the prompt rounds (:func:`upstream_from_settings`);
    ``reflection`` their reflection model (:func:`reflection_from_settings`).
    """
    return {
        "policy": PolicyModel(models_root=settings.models, base_model_path=settings.base_model),
        "registry": AdapterRegistry(root=settings.models),
        "tasks": tasks or TaskSourceResource(kind=settings.tasks, agent=settings.agent),
        "loop": loop or TrainingLoop(
            self_play_rounds=settings.self_play_rounds, run_config_path=settings.run_config, sources=dict(settings.training_sources),
            round_schedule=list(settings.round_schedule), training_workers=settings.training_workers,
            rollout_workers=settings.rollout_workers, ray_address=settings.ray_address,
        ),
        "tracking": tracking or ExperimentTracking(target=settings.tracking),
        "live_ab": live_ab or LiveAB(enabled=settings.live_ab, share=settings.live_ab_share),
        "judge": judge or judge_from_settings(settings),
        "upstream": upstream or upstream_from_settings(settings),
        "reflection": reflection or reflection_from_settings(settings),
        "lake": TrajectoryLake(root=settings.lake),
        "workflows": WorkflowDirectory(root=settings.workflows),
        "landing": LogLanding(directory=settings.landing, formats=formats or {}, settle_seconds=settings.settle_seconds),
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
    *,
    settings: Settings | None = None,
    upstream: UpstreamModel | None = None,
    reflection: ReflectionEndpoint | None = None,
) -> Definitions:
    """The Definitions object for ``settings`` (default: :meth:`Settings.load`, read now: the
    environment over the working directory's project settings file).

    Tests, the demos and the CLI override single settings with the keywords (``lake_root``,
    ``landing_dir``, ``models_root``, ``base_model_path``, ``settle_seconds``, ``workflows_root``;
    ``None``: as in ``settings``) and pass resources of their own (:func:`build_resources`).
    The sensors' interval is not among them: their decorators fixed it when ``sensors`` was
    imported, from :func:`flow_assets.settings.process_settings`.
    """
    settings = (settings or Settings.load()).replace(
        lake=lake_root, landing=landing_dir, models=models_root, base_model=base_model_path, settle_seconds=settle_seconds, workflows=workflows_root,
    )  # fmt: skip
    return Definitions(
        # every job here is a chain of steps: one process per run (not one per step, which costs
        # a fresh import of torch and the code location for each step)
        executor=in_process_executor,
        assets=[landed_logs, *data_plane_assets, *training_assets, *prompt_assets, *live_assets, adapter_evaluation, *workflow_assets],
        jobs=[log_batch_job, base_policy_job, collect_rollouts_job, training_round_job, prompt_round_job, training_history_job, ab_test_job, adapter_evaluation_job, workflow_proposals_job],
        sensors=[new_logs_sensor, training_round_sensor, training_history_sensor, self_play_sensor, ab_monitor_sensor],
        resources=build_resources(settings, formats, tasks, loop, tracking, live_ab, judge, upstream, reflection),
    )


defs = build_definitions(settings=process_settings())
