"""Run tags: the protocol between flowopt's runs, its sensors, the training API and the UI.

Dagster run tags are strings. Every tag flowopt writes or reads is named here once, and values
that other code decides on are typed (:class:`GateDecision`), so no reader parses a sentence
meant for people. The tags of a run's process (``flowopt/host``, ``flowopt/pid``...) stay with
:mod:`flow_assets.runtime.recovery` and the run launcher's with :mod:`flow_assets.runtime.run_launcher`, the only
modules that read them.
"""

from __future__ import annotations

from collections.abc import Mapping
from enum import Enum

from dagster import DagsterInstance

#: a training API job's id (``job-<12 hex>``), on each of its rounds' runs
JOB_TAG = "flowopt/job"
#: the agent a job trains (its ``agent_id``)
AGENT_TAG = "flowopt/job_agent"
#: the round of a job a run is (1-based, one per log batch)
ROUND_TAG = "flowopt/job_round"
#: the attempt of that round (``training.resume`` submits the next; absent = 1)
ATTEMPT_TAG = "flowopt/job_attempt"
#: the job's monthly budget in USD (``repr`` of a float)
BUDGET_TAG = "flowopt/job_budget_usd"
#: why a job's round failed when it was not the code (``budget``)
FAILURE_TAG = "flowopt/job_failure"
#: a paused round: ``before it started`` or ``after step <n>``
PAUSED_TAG = "flowopt/job_paused"
#: ``grpo`` (training.start_grpo) or ``evaluate`` (training.evaluate); absent = grpo
KIND_TAG = "flowopt/job_kind"
#: the gate's one-line verdict for people (the run list shows it): ``promote: ...`` / ``keep v15 (blocked: ...)``
GATE_TAG = "flowopt/gate"
#: the gate's decision for code: a :class:`GateDecision` value
GATE_DECISION_TAG = "flowopt/gate_decision"
#: the agent a self-play collection run collected for (sensors/self_play.py)
SELF_PLAY_AGENT_TAG = "flowopt/agent"
#: what launched a run outside the sensors (``flowopt ingest``)
LAUNCHED_BY_TAG = "flowopt/launched_by"


class GateDecision(str, Enum):
    """What the gate decided for a round's candidate (the ``flowopt/gate_decision`` tag)."""

    PROMOTE = "promote"
    KEEP = "keep"

    @classmethod
    def of(cls, blocked: bool) -> GateDecision:
        """``KEEP`` when any blocking check failed, else ``PROMOTE``."""
        return cls.KEEP if blocked else cls.PROMOTE


def gate_blocked(tags: Mapping[str, str]) -> bool:
    """Whether a round's run was blocked by the gate (its candidate kept out), from its tags.

    Runs recorded before the decision tag existed (2026-11-26) carry only the verdict for
    people; for them its ``keep `` prefix is the decision, as it was then.
    """
    decision = tags.get(GATE_DECISION_TAG)
    if decision is not None:
        return decision == GateDecision.KEEP.value
    return tags.get(GATE_TAG, "").startswith("keep ")


def attempt(tags: Mapping[str, str]) -> int:
    """A job round's attempt number (1 when the run carries none)."""
    return int(tags.get(ATTEMPT_TAG, "1"))


def pause_key(job_id: str) -> str:
    """The instance key-value entry that asks a job's running round to pause (``"requested"``)."""
    return f"flowopt/job/{job_id}/pause"


def pause_requested(instance: DagsterInstance, job_id: str) -> bool:
    """Whether ``training.pause`` asked ``job_id`` to pause (read by the training step loop)."""
    key = pause_key(job_id)
    return instance.run_storage.get_cursor_values({key}).get(key) == "requested"
