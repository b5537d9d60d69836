"""Capture: a rollout's turns as one canonical trajectory (pure, no server)."""

from flow_assets.serving.gateway.capture import Choice, OpenRollout, RolloutSettings, Turn, build_trajectory
from flow_assets.logs.schema import Outcome

CALL = {"id": "call_1", "type": "function", "function": {"name": "calculator", "arguments": '{"expression": "347-43"}'}}


def _turn(messages, choice):
    return Turn(messages, [1, 2, 3], [choice], "policy", "v0", 0.5, 1.0, 12.0)


def test_a_turn_whose_call_did_not_parse_is_an_error_step_with_its_reason_in_the_metadata():
    user = [{"role": "user", "content": "A shop had 347 apples and sold 43. How many are left?"}]
    bad_text = '<tool_call>{"name": "calculator", "arguments": {"expression": 347-43}}</tool_call>'
    bad = Choice([5, 6], [-0.1, -0.2], bad_text, bad_text, [], "stop", "<tool_call> 1 is not JSON: Expecting value")
    good = Choice([7, 8], [-0.3, -0.4], "", None, [CALL], "tool_calls")
    answer = Choice([9], [-0.5], "304", "304", [], "stop")
    after_bad = [*user, {"role": "assistant", "content": bad_text}, {"role": "user", "content": "Please use the tool."}]
    after_good = [*after_bad, {"role": "assistant", "content": None, "tool_calls": [CALL]}, {"role": "tool", "tool_call_id": "call_1", "content": "304"}]
    rollout = OpenRollout("r1", RolloutSettings(task_id="t"), [_turn(user, bad), _turn(after_bad, good), _turn(after_good, answer)])
    trajectory = build_trajectory(rollout, Outcome(success=True, score=1.0))
    kinds = [(s.kind, s.status) for s in trajectory.steps]
    assert kinds == [("message", "error"), ("tool", "ok"), ("observation", "ok"), ("answer", "ok")]
    assert trajectory.metadata["tool_call_errors"] == [{"turn": 0, "reason": "<tool_call> 1 is not JSON: Expecting value"}]
    assert trajectory.steps[0].token_ids == [5, 6]  # still a training row: the outcome judges it
    clean = OpenRollout("r2", RolloutSettings(task_id="t"), [_turn(after_bad, good), _turn(after_good, answer)])
    assert "tool_call_errors" not in build_trajectory(clean, Outcome(success=True, score=1.0)).metadata


def test_a_rollout_is_not_reaped_while_one_of_its_calls_is_being_served():
    from flow_assets.serving.gateway.capture import RolloutRecorder

    now = [0.0]
    recorder = RolloutRecorder(timeout_s=1.0, clock=lambda: now[0])
    recorder.open(RolloutSettings(task_id="t"), "slow")
    recorder.settings("slow", calling=True)  # a generation starts ...
    now[0] = 50.0  # ... and takes far longer than the timeout
    assert recorder.reap() == [] and recorder.open_count == 1
    recorder.record("slow", _turn([{"role": "user", "content": "q"}], Choice([1], [-0.1], "a", "a", [], "stop")))
    recorder.call_ended("slow")
    now[0] = 50.5
    assert recorder.reap() == []  # idle only since the call ended
    now[0] = 52.0
    ((trajectory, _),) = recorder.reap()
    assert trajectory.outcome is None and trajectory.metadata["unfinished"]["reason"] == "not_finished" and len(trajectory.steps) == 1
    # a rollout that never made a call has nothing to score: an error, not unlabelled
    recorder.open(RolloutSettings(task_id="t"), "silent")
    now[0] = 60.0
    ((empty, _),) = recorder.reap()
    assert empty.metadata["error"]["kind"] == "no_llm_call" and empty.outcome.score == 0.0
