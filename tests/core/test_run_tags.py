"""The run-tag protocol (flow_assets/core/run_tags.py): a blocked round is a typed decision, not a sentence."""

from types import SimpleNamespace

from dagster import DagsterRunStatus

from flow_assets.api.jobs import round_status
from flow_assets.core.run_tags import GATE_DECISION_TAG, GATE_TAG, GateDecision, attempt, gate_blocked


def test_the_decision_tag_decides_whatever_the_sentence_says():
    # the sentence is for people and may change wording; code reads the decision
    assert gate_blocked({GATE_TAG: "promote: the candidate replaces v3", GATE_DECISION_TAG: "keep"})
    assert not gate_blocked({GATE_TAG: "keep v3 (blocked: ...)", GATE_DECISION_TAG: "promote"})
    assert GateDecision.of(blocked=True) is GateDecision.KEEP and GateDecision.of(blocked=False).value == "promote"


def test_runs_recorded_before_the_decision_tag_fall_back_to_the_verdict():
    assert gate_blocked({GATE_TAG: "keep v15 (blocked: gain -0.002, p = 1)"})
    assert not gate_blocked({GATE_TAG: "promote: the candidate replaces v15"}) and not gate_blocked({})


def test_a_blocked_round_counts_as_done_for_its_job_and_other_failures_do_not():
    blocked = SimpleNamespace(status=DagsterRunStatus.FAILURE, tags={GATE_DECISION_TAG: GateDecision.KEEP.value})
    crashed = SimpleNamespace(status=DagsterRunStatus.FAILURE, tags={GATE_DECISION_TAG: GateDecision.PROMOTE.value})
    assert round_status(blocked) == DagsterRunStatus.SUCCESS and round_status(crashed) == DagsterRunStatus.FAILURE


def test_attempt_defaults_to_one():
    assert attempt({}) == 1 and attempt({"flowopt/job_attempt": "3"}) == 3
