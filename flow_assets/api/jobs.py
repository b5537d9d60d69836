"""Training jobs as Dagster runs: what ``training.*`` methods of ``flowopt api`` read and do.

A *job* is not a record of its own: it is the set of runs of ``training_round_job`` that carry
the tag ``flowopt/job = <job id>``, one per log batch, submitted through the Dagster webserver's
GraphQL API (so the instance's run coordinator queues them and its daemon launches them, one
round at a time in the ``training`` pool). Everything a caller sees comes from those runs:

==========  ===========================================================================
state       when (over each round's latest run: a resumed round has several)
==========  ===========================================================================
queued      no run has started (all queued / not started)
running     a run is starting or started, or some finished and others wait
paused      ``training.pause``: no run active and a round stopped or withdrawn by it
completed   every round's run succeeded, or was stopped by the gate (a blocked round)
failed      a run failed for another reason (an error, the budget: ``reason``)
cancelled   a run was cancelled (by ``training.cancel`` or in the UI)
==========  ===========================================================================

``rounds`` counts finished rounds and which were promoted or blocked (the gate's verdict is the
run tag ``flowopt/gate``). Budget: ``start_grpo`` refuses (-32003) when the agent has spent its
monthly budget (:mod:`flow_assets.training.budget`); each round checks it again when it starts
(``policy_checkpoint``) and fails with the run tag ``flowopt/job_failure = budget``, so a job
whose budget runs out stops at the next round boundary, state ``failed``, reason ``budget``.

Data checks: a batch whose blocking data checks failed (``advantages_finite``,
``records_conserved``) is never trained on, on this path as on the sensor's: ``start_grpo``
refuses it (-32602 naming the batch and the check) and ``resume`` refuses to resubmit a round on
one (-32004); both ask :func:`flow_assets.data_plane.checks.failed_data_checks`, the function
``training_round_sensor`` decides with.
"""

from __future__ import annotations

import json
import logging
import uuid
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any, Literal

from dagster import DagsterEventType, DagsterInstance, DagsterRunStatus, Failure, RunsFilter
from pydantic import BaseModel, Field

from flow_assets.api.jsonrpc import BUDGET_EXCEEDED, INVALID_PARAMS, INVALID_STATE, UNKNOWN_JOB, RpcError, scrub_paths
from flow_assets.data_plane.checks import failed_data_checks
from flow_assets.core.run_tags import (
    AGENT_TAG,
    ATTEMPT_TAG,
    BUDGET_TAG,
    FAILURE_TAG,
    GATE_TAG,
    JOB_TAG,
    KIND_TAG,
    PAUSED_TAG,
    ROUND_TAG,
    attempt,
    gate_blocked,
    pause_key,
    pause_requested,
)
from flow_assets.training.run_config import TRAINING_JOB, RoundSettings

log = logging.getLogger("flowopt.api")


def log_event(event: str, **fields: Any) -> None:
    """One structured log line on the ``flowopt.api`` logger: a JSON object with ``ts`` (UTC,
    ISO 8601, milliseconds), ``event`` and ``fields`` (``job_id``, ``run_id``, ...)."""
    log.info(json.dumps({"ts": datetime.now(timezone.utc).isoformat(timespec="milliseconds"), "event": event, **fields}, default=str))


def latest_per_round(runs: list) -> list:
    """The newest run of each round (a resumed round has several), in round order."""
    latest: dict[int, object] = {}
    for run in sorted(runs, key=lambda r: f"{attempt(r.tags):06d}"):
        latest[int(run.tags.get(ROUND_TAG, "0"))] = run
    return [latest[k] for k in sorted(latest)]


def round_status(run) -> DagsterRunStatus:
    """A round's status as its job counts it: a run that failed only because the gate's blocking
    check refused the candidate (:func:`~flow_assets.core.run_tags.gate_blocked`) finished its round
    as designed, so it counts as ``SUCCESS``; every other status is the run's own."""
    if run.status == DagsterRunStatus.FAILURE and gate_blocked(run.tags):
        return DagsterRunStatus.SUCCESS
    return run.status


EVALUATION_JOB = "adapter_evaluation_job"

_QUEUED = {DagsterRunStatus.QUEUED, DagsterRunStatus.NOT_STARTED}
_ACTIVE = {DagsterRunStatus.STARTING, DagsterRunStatus.STARTED, DagsterRunStatus.CANCELING}
_FINISHED = {DagsterRunStatus.SUCCESS, DagsterRunStatus.FAILURE, DagsterRunStatus.CANCELED}


class StartGrpoParams(BaseModel):
    """``training.start_grpo``: train ``agent_id``'s policy on ``log_batches`` (partition keys, in
    order, one round each), with the round's settings ``config`` (``{"trainer": {...},
    "evaluation": {...}}``, :class:`~flow_assets.training.run_config.RoundSettings`; defaults where left out)."""

    agent_id: str = Field(min_length=1, max_length=200)
    log_batches: list[str] = Field(min_length=1, max_length=1000)
    config: RoundSettings = Field(default_factory=RoundSettings)
    budget_usd: float | None = Field(None, gt=0, description="the agent's monthly budget for this job (default FLOWOPT_MONTHLY_BUDGET_USD, 100)")


class EvaluateParams(BaseModel):
    """``training.evaluate``: registry ``version`` of the policy on the first ``max_tasks``
    held-out tasks in ``modes`` (defaults: the asset's, 500 tasks, greedy and sampled)."""

    version: str = Field(pattern=r"^v[0-9]+$", max_length=20)
    max_tasks: int | None = Field(None, ge=1, le=100_000)
    modes: list[Literal["greedy", "sampled"]] | None = Field(None, min_length=1, max_length=2)


class JobParams(BaseModel):
    """A method that names one job."""

    job_id: str = Field(min_length=1, max_length=100)


class ListJobsParams(BaseModel):
    """``training.list_jobs``: the newest ``limit`` jobs, optionally only those in ``state``."""

    state: str | None = Field(None, pattern="^(queued|running|paused|completed|failed|cancelled)$")
    limit: int = Field(100, ge=1, le=1000)


def job_state(statuses: list[DagsterRunStatus], paused: bool = False) -> str:
    """The job state of its rounds' latest runs' statuses (table in the module docstring);
    ``paused``: a latest run carries the paused tag."""
    if any(s in _ACTIVE for s in statuses):
        return "running"
    if paused:
        return "paused"
    if any(s == DagsterRunStatus.CANCELED for s in statuses):
        return "cancelled"
    if any(s == DagsterRunStatus.FAILURE for s in statuses):
        return "failed"
    if statuses and all(s == DagsterRunStatus.SUCCESS for s in statuses):
        return "completed"
    if all(s in _QUEUED for s in statuses):
        return "queued"
    return "running"


@dataclass
class JobService:
    """The jobs of one Dagster deployment.

    Args:
        instance: the deployment's instance (runs are read from it).
        submit: ``submit(job_name, run_config, tags) -> run id`` (the GraphQL client's
            ``submit_job_execution`` in a deployment).
        terminate: ``terminate(run_ids)`` (the GraphQL client's ``terminate_runs``).
        partitions: ``() -> set of log batch keys`` that exist.
        spend: ``spend(agent_id) -> Spend`` this calendar month (:mod:`flow_assets.training.budget`).
        default_budget_usd: an agent's monthly budget when a job names none, USD.
        lake: the trajectory lake (exports read it).
        versions: ``versions(version) -> bool``, whether the adapter registry holds ``version``
            (``training.evaluate``); ``None``: every version is taken as known.
        add_version: ``add_version(version)`` adds the ``adapter_versions`` partition (the
            instance's ``add_dynamic_partitions`` in a deployment).
    """

    instance: DagsterInstance
    submit: Any
    terminate: Any
    partitions: Any
    spend: Any = None
    default_budget_usd: float = 100.0
    lake: Any = None
    versions: Any = None
    add_version: Any = None

    def _runs(self, job_id: str) -> list:
        """Every run of the job (all attempts), oldest first."""
        runs = self.instance.get_runs(RunsFilter(tags={JOB_TAG: job_id}))
        if not runs:
            raise RpcError(UNKNOWN_JOB, f"unknown job {job_id!r}")
        return list(reversed(runs))

    def _submit(self, job_name: str, run_config: dict | None, tags: dict[str, str]) -> str:
        run_id = self.submit(job_name, run_config, tags)
        log_event("run_submitted", job_id=tags[JOB_TAG], run_id=run_id, dagster_job=job_name, partition=tags.get("dagster/partition"),
                  round=tags.get(ROUND_TAG), attempt=tags.get(ATTEMPT_TAG, "1"))  # fmt: skip
        return run_id

    def _terminate(self, job_id: str, run_ids: list[str], why: str) -> None:
        self.terminate(run_ids)
        for run_id in run_ids:
            log_event("run_terminated", job_id=job_id, run_id=run_id, why=why)

    def _state(self, runs: list) -> str:
        latest = latest_per_round(runs)
        return job_state([round_status(r) for r in latest], any(PAUSED_TAG in r.tags for r in latest))

    def start_grpo(self, params: StartGrpoParams) -> dict[str, Any]:
        """Submit one training round per log batch; returns the job's status.

        Raises:
            RpcError(INVALID_PARAMS): a batch that is not a log batch partition, or one whose
                blocking data checks failed (named by index, with the failed checks).
            RpcError(BUDGET_EXCEEDED): the agent's monthly budget is spent.
        """
        known = self.partitions()
        for i, key in enumerate(params.log_batches):
            if key not in known:
                raise RpcError(INVALID_PARAMS, f"invalid params: log_batches.{i}: no log batch {key!r}", {"errors": [{"field": f"log_batches.{i}", "message": "unknown log batch"}]})
        for i, key in enumerate(params.log_batches):
            failed = failed_data_checks(self.instance, key)
            if failed:
                checks = ", ".join(failed)
                raise RpcError(INVALID_PARAMS, f"invalid params: log_batches.{i}: batch {key!r} failed the blocking data check(s) {checks}; it is not trained on",
                               {"errors": [{"field": f"log_batches.{i}", "message": f"failed blocking data check(s): {checks}", "batch": key, "checks": failed}]})  # fmt: skip
        budget = params.budget_usd or self.default_budget_usd
        if self.spend is not None:
            spent = self.spend(params.agent_id)
            if spent.total_usd >= budget:
                raise RpcError(BUDGET_EXCEEDED, f"budget exceeded: {params.agent_id!r} spent USD {spent.total_usd:.2f} of {budget:.2f} in {spent.month}",
                               {"spend": spent.as_dict(), "budget_usd": budget})  # fmt: skip
        job_id = "job-" + uuid.uuid4().hex[:12]
        run_config = params.config.run_config()
        for i, key in enumerate(params.log_batches, start=1):
            tags = {"dagster/partition": key, JOB_TAG: job_id, AGENT_TAG: params.agent_id, ROUND_TAG: str(i), BUDGET_TAG: repr(budget)}
            self._submit(TRAINING_JOB, run_config, tags)
        return self.get_status(JobParams(job_id=job_id))

    def get_status(self, params: JobParams) -> dict[str, Any]:
        """State, progress and per-round runs of a job.

        Raises:
            RpcError(UNKNOWN_JOB): no run carries that job id.
        """
        every = self._runs(params.job_id)
        runs = latest_per_round(every)
        finished = [r for r in runs if round_status(r) == DagsterRunStatus.SUCCESS]
        current = next((r for r in runs if r.status in _ACTIVE), None)
        agent = runs[0].tags.get(AGENT_TAG)
        # a round stopped by training.pause is not a failure: it waits for resume
        failure = next((self._failure(r) for r in runs if round_status(r) == DagsterRunStatus.FAILURE and PAUSED_TAG not in r.tags), None)
        kind = runs[0].tags.get(KIND_TAG, "grpo")
        return {
            "job_id": params.job_id,
            "kind": kind,
            "agent_id": agent,
            "state": self._state(every),
            "reason": failure,
            "pause_requested": pause_requested(self.instance, params.job_id),
            "budget_usd": float(runs[0].tags.get(BUDGET_TAG, self.default_budget_usd)),
            "spend": self.spend(agent).as_dict() if self.spend is not None and agent else None,
            "progress": {"rounds_done": len(finished), "rounds_planned": len(runs), "current_batch": current.tags.get("dagster/partition") if current else None},
            "rounds": [
                {"round": int(r.tags.get(ROUND_TAG, "0")), "batch": r.tags.get("dagster/partition"), "run_id": r.run_id,
                 "status": r.status.value.lower(), "gate": r.tags.get(GATE_TAG),
                 "blocked": gate_blocked(r.tags), "paused": r.tags.get(PAUSED_TAG),
                 "attempt": attempt(r.tags)}  # fmt: skip
                for r in runs
            ],
            "evaluation": self._evaluation(runs[0]) if kind == "evaluate" and runs[0].status == DagsterRunStatus.SUCCESS else None,
        }

    def _failure(self, run) -> str:
        """Why a failed round failed: its ``flowopt/job_failure`` tag (``budget``), else
        ``error: <the first step failure's message>``."""
        if FAILURE_TAG in run.tags:
            return run.tags[FAILURE_TAG]
        for record in self.instance.all_logs(run.run_id, of_type=DagsterEventType.STEP_FAILURE):
            error = record.dagster_event.step_failure_data.error
            # an exception in the asset arrives wrapped ("Error occurred while executing op ..."):
            # a Failure raised on purpose says why in its description, else the innermost cause does
            chain = []
            while error is not None:
                chain.append(error)
                error = error.cause
            chosen = next((e for e in chain if e.cls_name == Failure.__name__), chain[-1] if chain else None)
            if chosen is not None:
                message = chosen.message.strip().removeprefix(f"{Failure.__module__}.{Failure.__name__}: ")
                # the reason reaches clients: where the server keeps its files is not theirs to see
                return "error: " + scrub_paths(message.splitlines()[0] if message else "")[:300]
        return "error"

    def _evaluation(self, run) -> dict[str, Any] | None:
        """The report ``adapter_evaluation`` materialised in ``run`` (per mode: success rate with
        its interval, mean reward, calls), or ``None``."""
        for record in self.instance.all_logs(run.run_id, of_type=DagsterEventType.ASSET_MATERIALIZATION):
            metadata = record.dagster_event.event_specific_data.materialization.metadata
            if "report" in metadata:
                return {"version": metadata["version"].value, "report": metadata["report"].value}
        return None

    def list_jobs(self, params: ListJobsParams) -> list[dict[str, Any]]:
        """The newest jobs (by their first run), with their states."""
        records = [r for name in (TRAINING_JOB, EVALUATION_JOB) for r in self.instance.get_run_records(RunsFilter(job_name=name))]
        jobs: dict[str, list] = {}
        for run in (r.dagster_run for r in sorted(records, key=lambda r: r.create_timestamp, reverse=True)):  # newest first
            job = run.tags.get(JOB_TAG)
            if job:
                jobs.setdefault(job, []).append(run)
        out = []
        for job_id, mine in jobs.items():
            state = self._state(mine)
            if params.state in (None, state):
                out.append({"job_id": job_id, "kind": mine[0].tags.get(KIND_TAG, "grpo"), "agent_id": mine[0].tags.get(AGENT_TAG), "state": state,
                            "rounds_planned": len(latest_per_round(mine))})  # fmt: skip
            if len(out) >= params.limit:
                break
        return out

    def cancel(self, params: JobParams) -> dict[str, Any]:
        """Cancel every run of the job that has not finished (queued ones never start; a running
        round is terminated, its checkpoint kept).

        Raises:
            RpcError(UNKNOWN_JOB / INVALID_STATE): no such job, or it has already finished.
        """
        runs = self._runs(params.job_id)
        open_runs = [r.run_id for r in runs if r.status not in _FINISHED]
        if not open_runs:
            raise RpcError(INVALID_STATE, f"job {params.job_id!r} has finished ({self._state(runs)}); nothing to cancel")
        self._terminate(params.job_id, open_runs, "cancel")
        return self.get_status(params)

    def pause(self, params: JobParams) -> dict[str, Any]:
        """Pause a queued or running job: queued rounds are withdrawn (tagged paused); the running
        round finishes its current optimizer step, checkpoints it and stops (``policy_checkpoint``
        reads the request between steps); a round past training finishes normally.

        Raises:
            RpcError(UNKNOWN_JOB / INVALID_STATE): no such job, or it is not queued or running.
        """
        runs = self._runs(params.job_id)
        state = self._state(runs)
        if state not in ("queued", "running"):
            raise RpcError(INVALID_STATE, f"job {params.job_id!r} is {state}; only a queued or running job can be paused")
        self.instance.run_storage.set_cursor_values({pause_key(params.job_id): "requested"})
        log_event("pause_requested", job_id=params.job_id)
        queued = [r for r in latest_per_round(runs) if r.status in _QUEUED]
        for run in queued:
            self.instance.add_run_tags(run.run_id, {PAUSED_TAG: "before it started"})
        if queued:
            self._terminate(params.job_id, [r.run_id for r in queued], "pause")
        return self.get_status(params)

    def resume(self, params: JobParams) -> dict[str, Any]:
        """Resume a paused job: every round whose latest run did not succeed is submitted again
        (a new attempt, same tags); a round paused mid-training continues from its checkpoint.

        Raises:
            RpcError(UNKNOWN_JOB / INVALID_STATE): no such job, it is not paused, or a round to
                resubmit is on a batch whose blocking data checks failed (the job stays paused).
        """
        runs = self._runs(params.job_id)
        state = self._state(runs)
        if state != "paused":
            raise RpcError(INVALID_STATE, f"job {params.job_id!r} is {state}; only a paused job can be resumed")
        todo = [run for run in latest_per_round(runs) if run.status != DagsterRunStatus.SUCCESS]
        for run in todo:  # a batch re-materialised since start_grpo may have failed its checks
            key = run.tags.get("dagster/partition", "")
            failed = failed_data_checks(self.instance, key) if run.tags.get(KIND_TAG, "grpo") == "grpo" else []
            if failed:
                raise RpcError(INVALID_STATE, f"job {params.job_id!r}: round {run.tags.get(ROUND_TAG)} is on batch {key!r}, which failed the blocking data check(s) "
                               f"{', '.join(failed)}; it is not trained on (cancel the job)", {"batch": key, "checks": failed})  # fmt: skip
        self.instance.run_storage.set_cursor_values({pause_key(params.job_id): ""})
        for run in todo:
            keep = ("dagster/partition", JOB_TAG, AGENT_TAG, ROUND_TAG, BUDGET_TAG)
            tags = {k: run.tags[k] for k in keep if k in run.tags}
            tags[ATTEMPT_TAG] = str(attempt(run.tags) + 1)
            self._submit(TRAINING_JOB, run.run_config or None, tags)
        return self.get_status(params)

    def evaluate(self, params: EvaluateParams) -> dict[str, Any]:
        """Submit one run of ``adapter_evaluation_job`` for a registry version (its partition is
        added first); returns the job's status, whose ``evaluation`` holds the report once the
        run succeeded.

        Raises:
            RpcError(INVALID_PARAMS): the registry holds no such version (field ``version``).
        """
        if self.versions is not None and not self.versions(params.version):
            raise RpcError(INVALID_PARAMS, f"invalid params: version: the registry holds no version {params.version!r}",
                           {"errors": [{"field": "version", "message": "unknown registry version"}]})  # fmt: skip
        if self.add_version is not None:
            self.add_version(params.version)
        overrides = {k: v for k, v in (("max_tasks", params.max_tasks), ("modes", params.modes)) if v is not None}
        config = {"ops": {"adapter_evaluation": {"config": overrides}}} if overrides else None
        job_id = "job-" + uuid.uuid4().hex[:12]
        self._submit(EVALUATION_JOB, config, {"dagster/partition": params.version, JOB_TAG: job_id, KIND_TAG: "evaluate", ROUND_TAG: "1"})
        return self.get_status(JobParams(job_id=job_id))
