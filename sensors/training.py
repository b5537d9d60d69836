"""``training_round_sensor``: every batch of the trainable policy's rollouts gets its round.

A batch qualifies when its ``advantages`` partition is materialised and its trajectories include
flows of an agent that trains the policy: the task source's ``agent_id`` (its rollouts captured by
the gateway, or its own text logs), or an agent of the training loop's ``sources``
(``FLOWOPT_TRAINING_SOURCES``, e.g. another model's flows, trained by advantage-weighted
likelihood), and the
blocking data checks of the run that produced it passed (a batch with non-finite advantages
never reaches training). Batches
served while a live A/B ran (:func:`flow_assets.live_ab.evidence.ab_windows`) are the experiment's evidence
and are not trained on. Batches
of other agents (e.g. the tau-bench or FireAct logs, unless a source names them) stop after ``advantages``. A batch
whose trainable trajectories all have advantage 0 (every group's rollouts got the same reward) gets no
LoRA round: it would make no optimizer step (:func:`trainable_signal`); the sensor logs why, and looks at
the batch again once its ``advantages`` are materialised anew (re-scored with other rewards). Rounds run one at
a time (pool ``training``), so each starts from the champion the previous round left.

The champion's kind and the round schedule decide the round's kind (one change per round, so
the gate compares one change; ``docs/training.md``, "Prompt-policy rounds";
:func:`flow_assets.policy.prompt.next_round_kind`): a prompt policy alone (an agent on a model
flowopt does not host, behind ``flowopt serve --upstream``) gets ``prompt_round_job`` when an
upstream model is configured (``FLOWOPT_UPSTREAM_URL``), and no round otherwise; a hosted policy
(a LoRA adapter, with or without a prompt policy) gets the kind ``FLOWOPT_ROUND_SCHEDULE`` names
for its turn (``adapter``, the default: ``training_round_job`` every time; ``prompt,adapter``:
a prompt round, then a LoRA round under the prompt it found, and again), the turn counted over
the instance's rounds of both kinds.

The instance, not only the cursor, says what is done: a batch that already has a run of
``training_round_job`` (launched by this sensor, by ``flowopt demo`` or by hand) is never requested
again, so a daemon started on an instance where rounds ran without it requests nothing already
done. The one exception is a round whose process died (tagged by :mod:`flow_assets.runtime.recovery`):
it is requested once more, and resumes from its latest checkpoint.
"""

import json

import polars as pl
from dagster import (
    AssetKey,
    AssetRecordsFilter,
    DagsterRunStatus,
    RunsFilter,
    DagsterInstance,
    DefaultSensorStatus,
    RunRequest,
    SensorEvaluationContext,
    SensorResult,
    SkipReason,
    sensor,
)

from flow_assets.data_plane.checks import DATA_CHECKS, failed_data_checks  # noqa: F401 (re-exported: the sensor's decision, shared with the API)
from flow_assets.jobs import prompt_round_job, training_history_job, training_round_job
from flow_assets.policy.prompt import next_round_kind, policy_kind
from flow_assets.live_ab.evidence import ab_windows, served_during_ab
from flow_assets.runtime.recovery import PARTITION_NAME_TAG, batches_to_rerun
from resources.lake import TrajectoryLake
from resources.loop import TrainingLoop
from resources.registry import AdapterRegistry
from resources.tasks import TaskSourceResource
from resources.upstream import UpstreamModel
from sensors.settings import sensor_interval


def trained_batches(instance: DagsterInstance) -> set[str]:
    """Partition keys that have a run of ``training_round_job`` or ``prompt_round_job`` in
    ``instance``, whatever its status or who launched it."""
    runs = [r for job in (training_round_job, prompt_round_job) for r in instance.get_runs(RunsFilter(job_name=job.name))]
    return {run.tags[PARTITION_NAME_TAG] for run in runs if PARTITION_NAME_TAG in run.tags}


def trainable_signal(advantages: pl.DataFrame, mine: pl.DataFrame) -> str | None:
    """Why a LoRA round on this batch would have nothing to learn from, or None when it has.

    A GRPO group whose rollouts all got the same reward has advantage 0 for each of them
    (Shao et al. 2024, eq. 3: the reward minus the group mean), and so do all their steps
    (:func:`flow_assets.rl.credit.step_advantages` scales the trajectory's advantage); the
    training loop drops such rows (``dropped_zero_advantage``). When every labelled trajectory of
    the trainable agents has advantage 0, a round would make no optimizer step and its blocking
    ``finite_loss`` check would fail the run: the sensor declines the batch instead and says why.

    Args:
        advantages: the batch's ``advantages`` partition (``trajectory_id``, ``group_key``,
            ``advantage``; null for unlabelled trajectories).
        mine: the batch's ``trajectories`` rows of the agents that train the policy
            (``trajectory_id``).
    """
    rows = advantages.join(mine.select("trajectory_id"), on="trajectory_id", how="semi").filter(pl.col("advantage").is_not_null())
    if rows.filter(pl.col("advantage") != 0).height:
        return None
    if not rows.height:
        return (f"no labelled trajectory of the trainable agents ({mine.height} without an outcome), so no group has an "
                "advantage and a round would have nothing to train on")  # fmt: skip
    groups = rows["group_key"].n_unique()
    return (f"no group with a varied reward: all {rows.height} labelled trajectories of the trainable agents "
            f"({groups} groups) have advantage 0, so a round would have nothing to train on")  # fmt: skip


def next_round_is_adapter(instance: DagsterInstance, registry: AdapterRegistry, loop: TrainingLoop) -> bool:
    """Whether the next round this sensor requests is a LoRA round (the only kind that declines a
    batch with no varied reward; a prompt round learns from the lake's successful flows): the
    champion's kind and the round schedule at the instance's count of rounds, as in the sensor."""
    return next_round_kind(champion_kind(registry.champion()), loop.round_schedule, len(trained_batches(instance))) == "adapter"


def champion_kind(champ: dict | None) -> str:
    """``"prompt"`` or ``"adapter"``: the kind of policy the registry entry ``champ`` is (no champion
    yet: ``"adapter"``, the base model's identity adapter comes first)."""
    return policy_kind(champ["adapter_path"]) if champ is not None else "adapter"


def advantages_version(instance: DagsterInstance, key: str) -> int | None:
    """The storage id of the latest ``advantages`` materialisation of batch ``key`` (it grows with
    every new one), or None when there is none."""
    records = instance.fetch_materializations(AssetRecordsFilter(asset_key=AssetKey("advantages"), asset_partitions=[key]), limit=1).records
    return records[0].storage_id if records else None


def rematerialised(instance: DagsterInstance, declined: dict[str, int | None], page: int = 1000) -> set[str]:
    """The batches of ``declined`` (partition key -> the :func:`advantages_version` it was declined
    at, None if it had none) whose ``advantages`` were materialised again since.

    One query for all of them, however many there are: the declined partitions' ``advantages``
    records after the oldest recorded storage id, read in pages of ``page`` records (the sensor
    runs every few seconds, and declined batches stay in its cursor until they are re-scored)."""
    if not declined:
        return set()
    known = [version for version in declined.values() if version is not None]
    after = min(known) if len(known) == len(declined) else None
    changed: set[str] = set()
    cursor = None
    while True:
        result = instance.fetch_materializations(
            AssetRecordsFilter(asset_key=AssetKey("advantages"), asset_partitions=sorted(declined), after_storage_id=after),
            limit=page, cursor=cursor,
        )  # fmt: skip
        for record in result.records:
            key = record.partition_key
            if key in declined and (declined[key] is None or record.storage_id > declined[key]):
                changed.add(key)
        if not result.has_more:
            return changed
        cursor = result.cursor


def read_cursor(cursor: str | None) -> tuple[set[str], dict[str, int | None]]:
    """``training_round_sensor``'s cursor: the batches decided, and of them those declined for want
    of signal with the :func:`advantages_version` they were declined at (a cursor written before
    declines were recorded, a plain list, has none)."""
    data = json.loads(cursor) if cursor else []
    if isinstance(data, list):
        return set(data), {}
    return set(data["decided"]), dict(data["declined"])


def no_signal_reason(lake: TrajectoryLake, key: str, agents: list[str]) -> str | None:
    """:func:`trainable_signal` of batch ``key`` for ``agents`` (the trainable agents' ids), from
    its ``trajectories`` and ``advantages`` partitions; None when they are not both materialised.
    ``self_play_sensor`` asks it too, so that a declined batch does not stall the loop."""
    try:
        traj = lake.read_partition("trajectories", key)
        advantages = lake.read_partition("advantages", key)
    except FileNotFoundError:
        return None
    return trainable_signal(advantages, traj.filter(pl.col("agent_id").is_in(agents)))


@sensor(
    jobs=[training_round_job, prompt_round_job],
    minimum_interval_seconds=sensor_interval(),
    default_status=DefaultSensorStatus.RUNNING,
    description=(
        "Each log batch of the trainable agent's flows (captured rollouts or its text logs; or an agent of "
        "FLOWOPT_TRAINING_SOURCES) whose advantages are "
        "materialised and whose data checks passed gets one run of training_round_job, or of prompt_round_job "
        "while the champion is a prompt policy (with FLOWOPT_UPSTREAM_URL set) or FLOWOPT_ROUND_SCHEDULE gives a hosted "
        "policy's turn to its prompt. Batches of "
        "other agents stop after advantages, and so does a batch with no group of varied reward (nothing to train on); "
        "a batch that already has a training run is never "
        "requested again, and a batch served during a live A/B (the experiment's evidence) is not trained on."
    ),
)
def training_round_sensor(
    context: SensorEvaluationContext, lake: TrajectoryLake, tasks: TaskSourceResource, loop: TrainingLoop, registry: AdapterRegistry,
    upstream: UpstreamModel,
):
    """Requests one round per new batch of trainable flows: ``training_round_job``, or
    ``prompt_round_job`` while the champion is a prompt policy or the round schedule gives the
    turn to the prompt (cursor: the batches already decided, trainable or not)."""
    decided, declined = read_cursor(context.cursor)
    # a declined batch whose advantages were materialised again (other rewards) is looked at again
    for key in rematerialised(context.instance, declined):
        decided.discard(key)
        del declined[key]
    done = trained_batches(context.instance)
    decided |= done
    rounds_so_far = len(done)
    retries = batches_to_rerun(context.instance, training_round_job.name)
    ready = context.instance.get_materialized_partitions(AssetKey("advantages")) - decided
    run_config = loop.run_config(training_round_job.name)
    requests = [
        RunRequest(run_key=f"train:{key}:after-{run_id[:8]}", partition_key=key, run_config=run_config, job_name=training_round_job.name)
        for key, run_id in sorted(retries.items())
    ]
    skipped, no_signal = [], []
    windows = ab_windows(registry.load()["history"]) if ready else []
    champ = registry.champion() if ready else None
    kind = champion_kind(champ)
    rules = loop.update_rules(tasks.agent_id)
    for key in sorted(ready):
        failed = failed_data_checks(context.instance, key)
        if failed:
            decided.add(key)
            skipped.append(key)
            context.log.warning(f"batch {key}: data check(s) {', '.join(failed)} failed; no training round")
            continue
        traj = lake.read_partition("trajectories", key)
        mine = traj.filter(pl.col("agent_id").is_in(list(rules)))
        trainable = mine.height > 0
        decided.add(key)
        during_ab = served_during_ab(mine, windows)
        if during_ab:
            context.log.info(f"batch {key}: {during_ab} trajectories were served during a live A/B; not trained on")
            trainable = False
        if trainable and kind == "prompt" and not upstream.enabled:
            context.log.warning(f"batch {key}: champion {champ['version']} is a prompt policy and no upstream model is set "
                                "(FLOWOPT_UPSTREAM_URL): no round")  # fmt: skip
            trainable = False
        round_kind = next_round_kind(kind, loop.round_schedule, rounds_so_far) if trainable else None
        if round_kind == "adapter":
            signal = trainable_signal(lake.read_partition("advantages", key), mine)
            if signal is not None:
                context.log.info(f"batch {key}: {signal}; no training round (until its advantages are materialised again)")
                trainable, round_kind = False, None
                no_signal.append(key)
                declined[key] = advantages_version(context.instance, key)
        rounds_so_far += trainable
        if round_kind == "prompt":
            requests.append(RunRequest(run_key=f"prompt:{key}", partition_key=key, run_config=loop.run_config(prompt_round_job.name),
                                       job_name=prompt_round_job.name))  # fmt: skip
        elif trainable:
            requests.append(RunRequest(run_key=f"train:{key}", partition_key=key, run_config=run_config, job_name=training_round_job.name))
        else:
            skipped.append(key)
    cursor = json.dumps({"decided": sorted(decided), "declined": dict(sorted(declined.items()))})
    if not requests:
        reason = f"no new batch of {tasks.agent_id}" + (f"; {len(skipped)} other batches stop after advantages" if skipped else "")
        reason += f" ({len(no_signal)} of them: no group with a varied reward)" if no_signal else ""
        return SensorResult(skip_reason=SkipReason(reason), cursor=cursor)
    return SensorResult(run_requests=requests, cursor=cursor)


@sensor(
    job=training_history_job,
    minimum_interval_seconds=sensor_interval(),
    default_status=DefaultSensorStatus.RUNNING,
    description=(
        "When a run of training_round_job (promoted, blocked or failed) finished after "
        "training_history was last materialised, requests one run of training_history_job, so the history's "
        "table and chart include that round."
    ),
)
def training_history_sensor(context: SensorEvaluationContext):
    """Requests ``training_history_job`` when the latest finished training round ended after the
    latest ``training_history`` materialisation (the instance decides, not a cursor, so a daemon
    started on an instance where the history is current requests nothing; the run key is the
    round's run id)."""
    finished = context.instance.get_run_records(
        RunsFilter(job_name=training_round_job.name, statuses=[DagsterRunStatus.SUCCESS, DagsterRunStatus.FAILURE]), limit=1
    )
    if not finished:
        return SkipReason("no training round has finished yet")
    latest = finished[0]
    history = context.instance.get_latest_materialization_event(AssetKey("training_history"))
    if history is not None and latest.end_time is not None and history.timestamp >= latest.end_time:
        return SkipReason(f"training_history is newer than the latest round (run {latest.dagster_run.run_id[:8]})")
    return SensorResult(run_requests=[RunRequest(run_key=f"history:{latest.dagster_run.run_id}")])
