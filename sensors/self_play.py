"""``self_play_sensor``: the training loop on the agent's own task source, driven by the daemon.

For a task source with a verifier (the built-in calculator agent, spell_backward, a JSONL task
file), the loop needs no logs from outside: the champion's agents work on train tasks (the
``rollouts`` asset), the batch lands, ``new_logs_sensor`` and ``training_round_sensor`` take it
from there, and when that round has finished the next batch is collected from the champion it
left. This sensor starts each step of that loop, one at a time:

1. no champion in the registry: request ``base_policy_job``;
2. a run is queued or running (but for the history refresh), or the agent's latest batch has not finished its
   round: wait;
3. fewer than ``TrainingLoop.self_play_rounds`` rounds done: request ``collect_rollouts_job``.

A batch in which no group got a varied reward gets no LoRA round (``training_round_sensor``
declines it: nothing to train on; a prompt round, where the schedule gives the batch one, still
runs) and does not count as one: the loop collects another batch from the same
champion, and stops asking after ``MAX_NO_SIGNAL_BATCHES`` such batches in a row.

Off by default (``self_play_rounds`` 0). Every decision reads the instance (runs, partitions), not
a cursor, so a daemon restarted mid-loop goes on where the loop was. Runs carry the tag
``flowopt/agent`` and the run config of :class:`~resources.loop.TrainingLoop`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from dagster import AssetKey, DagsterRunStatus, DefaultSensorStatus, RunRequest, RunsFilter, SensorEvaluationContext, SensorResult, SkipReason, sensor

from flow_assets.jobs import base_policy_job, collect_rollouts_job, log_batch_job, prompt_round_job, training_history_job, training_round_job
from flow_assets.runtime.recovery import PARTITION_NAME_TAG
from flow_assets.training.rounds import landing_source
from flow_assets.core.run_tags import SELF_PLAY_AGENT_TAG as AGENT_TAG
from resources.loop import TrainingLoop
from resources.lake import TrajectoryLake
from resources.registry import AdapterRegistry
from resources.tasks import TaskSourceResource
from flow_assets.logs.landing import key_component, key_source
from sensors.settings import sensor_interval
from sensors.training import failed_data_checks, next_round_is_adapter, no_signal_reason

IN_FLIGHT = [DagsterRunStatus.QUEUED, DagsterRunStatus.NOT_STARTED, DagsterRunStatus.STARTING, DagsterRunStatus.STARTED]
FINISHED = [DagsterRunStatus.SUCCESS, DagsterRunStatus.FAILURE, DagsterRunStatus.CANCELED]
#: collections in a row that may fail before the loop stops asking (a broken setup, not bad luck)
MAX_FAILED_COLLECTIONS = 3
#: batches in a row with no group of varied reward before the loop stops asking (the champion
#: solves every task, or fails every one: more rollouts of it teach nothing)
MAX_NO_SIGNAL_BATCHES = 3


@dataclass(frozen=True)
class LoopState:
    """Where the self-play loop of one agent stands, from the instance.

    Attributes:
        batches: the agent's log batches (partitions whose key starts with its landing source).
        rounds_done: batches whose training round finished (promoted, blocked or failed).
        pending: batches still on their way (data plane or round not finished, or a collected
            file not yet registered by ``new_logs_sensor``).
        in_flight: runs queued or running, but for ``training_history_job`` (bookkeeping the
            next round does not wait for).
        collections: runs of ``collect_rollouts_job`` for the agent; failed_in_a_row: how many of
            the latest ones failed.
        no_signal_in_a_row: how many of the latest batches got no round because no group had a
            varied reward (:func:`sensors.training.trainable_signal`).
    """

    batches: tuple[str, ...]
    rounds_done: int
    pending: tuple[str, ...]
    in_flight: int
    collections: int
    failed_in_a_row: int
    no_signal_in_a_row: int = 0


def loop_state(instance, agent_id: str, no_signal: Callable[[str], bool] | None = None) -> LoopState:
    """The :class:`LoopState` of ``agent_id`` on ``instance``; ``no_signal(key)``: whether a batch
    whose ``advantages`` are materialised has nothing to train on (no round will come)."""
    source = key_component(landing_source(agent_id))
    batches = tuple(k for k in instance.get_dynamic_partitions("log_batches") if key_source(k) == source)
    # a round of either kind (FLOWOPT_ROUND_SCHEDULE may give a turn to the prompt) ends a batch
    trained = {
        r.tags.get(PARTITION_NAME_TAG)
        for job in (training_round_job, prompt_round_job)
        for r in instance.get_runs(RunsFilter(job_name=job.name, statuses=FINISHED))
    }
    dead = {
        r.tags.get(PARTITION_NAME_TAG)
        for r in instance.get_runs(RunsFilter(job_name=log_batch_job.name, statuses=[DagsterRunStatus.FAILURE]))
    }
    pending, declined = [], set()
    scored = instance.get_materialized_partitions(AssetKey("advantages")) if no_signal is not None else set()
    for key in batches:
        if key in trained:
            continue
        if key in scored and no_signal(key):
            declined.add(key)
            continue
        if key in dead and not instance.get_runs(RunsFilter(job_name=log_batch_job.name, statuses=[DagsterRunStatus.SUCCESS], tags={PARTITION_NAME_TAG: key}), limit=1):
            continue  # its data plane failed: no round will come
        if failed_data_checks(instance, key):
            continue
        pending.append(key)
    collections = instance.get_runs(RunsFilter(job_name=collect_rollouts_job.name, tags={AGENT_TAG: agent_id}))
    succeeded = [r for r in collections if r.status == DagsterRunStatus.SUCCESS]
    failed_in_a_row = 0
    for run in collections:  # newest first
        if run.status != DagsterRunStatus.FAILURE:
            break
        failed_in_a_row += 1
    unregistered = max(0, len(succeeded) - len(batches))
    no_signal_in_a_row = 0
    for key in reversed(batches):  # dynamic partitions in the order they were added
        if key not in declined:
            break
        no_signal_in_a_row += 1
    # the history refresh after a round is bookkeeping (a table of the registry, under a second):
    # the next round need not wait for it, which saved a sensor tick and a launch per round
    in_flight = sum(1 for r in instance.get_runs(RunsFilter(statuses=IN_FLIGHT)) if r.job_name != training_history_job.name)
    return LoopState(
        batches=batches,
        rounds_done=sum(1 for k in batches if k in trained),
        pending=tuple(pending) + ("(landed, not yet registered)",) * unregistered,
        in_flight=in_flight,
        collections=len(collections),
        failed_in_a_row=failed_in_a_row,
        no_signal_in_a_row=no_signal_in_a_row,
    )


def gave_up(state: LoopState, agent: str) -> str | None:
    """Why the self-play loop of ``agent`` stopped asking for collections before its rounds were
    done (:data:`MAX_NO_SIGNAL_BATCHES` flat batches or :data:`MAX_FAILED_COLLECTIONS` failed
    collections in a row), or None while it goes on. ``flowopt demo`` asks it too, so that a loop
    that stopped fails the demo at once instead of at its timeout."""
    if state.no_signal_in_a_row >= MAX_NO_SIGNAL_BATCHES:
        return (f"the last {state.no_signal_in_a_row} batches of {agent} had no group with a varied reward; "
                "its rollouts teach nothing (see training_round_sensor's log)")  # fmt: skip
    if state.failed_in_a_row >= MAX_FAILED_COLLECTIONS:
        return f"the last {state.failed_in_a_row} collections of {agent} failed; see their runs"
    return None


@sensor(
    jobs=[base_policy_job, collect_rollouts_job],
    minimum_interval_seconds=sensor_interval(),
    default_status=DefaultSensorStatus.RUNNING,
    description=(
        "Self-play (off unless FLOWOPT_SELF_PLAY_ROUNDS is set): builds the base policy if there is no champion, then "
        "collects a batch of the champion's rollouts whenever the previous batch's training round has finished, until "
        "that many rounds are done. One step at a time; nothing while any run but training_history_job is queued or running."
    ),
)
def self_play_sensor(
    context: SensorEvaluationContext, loop: TrainingLoop, registry: AdapterRegistry, tasks: TaskSourceResource, lake: TrajectoryLake
):
    """One step of the self-play loop (module docstring)."""
    if loop.self_play_rounds <= 0:
        return SkipReason("self-play is off (TrainingLoop.self_play_rounds = 0)")
    agent = tasks.agent_id
    agents = list(loop.update_rules(agent))
    # a batch with nothing to train on gets no round only when its turn is a LoRA round
    declines = next_round_is_adapter(context.instance, registry, loop)
    state = loop_state(context.instance, agent, (lambda key: no_signal_reason(lake, key, agents) is not None) if declines else None)
    if state.in_flight:
        return SkipReason(f"{state.in_flight} run(s) queued or running")
    tags = {AGENT_TAG: agent}
    if registry.champion() is None:
        request = RunRequest(run_key=f"self-play:{agent}:base", job_name=base_policy_job.name, run_config=loop.run_config(base_policy_job.name), tags=tags)
        return SensorResult(run_requests=[request])
    if state.rounds_done >= loop.self_play_rounds:
        return SkipReason(f"done: {state.rounds_done} of {loop.self_play_rounds} rounds of {agent}")
    if state.pending:
        return SkipReason(f"waiting for the round of {state.pending[0]}")
    stopped = gave_up(state, agent)
    if stopped is not None:
        return SkipReason(stopped)
    request = RunRequest(
        run_key=f"self-play:{agent}:collect-{state.collections + 1}",
        job_name=collect_rollouts_job.name,
        run_config=loop.run_config(collect_rollouts_job.name),
        tags=tags,
    )
    context.log.info(f"round {state.rounds_done + 1} of {loop.self_play_rounds}: collecting a batch of {agent}'s rollouts")
    return SensorResult(run_requests=[request])
