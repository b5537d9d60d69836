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
    recorder.begin_call("slow")  # a generation starts ...
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


def test_each_call_of_a_seeded_rollout_gets_the_next_seed_of_the_rollouts_stream():
    from flow_assets.policy.decode import row_streams
    from flow_assets.serving.gateway.capture import RolloutRecorder, call_seed

    recorder = RolloutRecorder(timeout_s=60.0)
    recorder.open(RolloutSettings(task_id="t", seed=-5), "seeded")
    seeds = [recorder.begin_call("seeded")[1] for _ in range(3)]
    # SplitMix64 outputs 1, 2, 3 of the seed taken modulo 2^64, cut to 63 bits (a valid OpenAI seed)
    assert seeds == [s >> 1 for s in row_streams(2**64 - 5, 3)] == [call_seed(-5, k) for k in range(3)]
    assert len(set(seeds)) == 3 and all(0 <= s < 2**63 for s in seeds)
    assert recorder.settings("seeded").seed == -5  # reading the settings starts no call
    assert recorder.begin_call("seeded")[1] == call_seed(-5, 3)
    recorder.open(RolloutSettings(task_id="t"), "unseeded")
    assert recorder.begin_call("unseeded")[1] is None and recorder.begin_call("never-opened")[1] is None
    rollout = OpenRollout("r", RolloutSettings(task_id="t", seed=9), [_turn([{"role": "user", "content": "q"}], Choice([1], [-0.1], "a", "a", [], "stop"))])
    assert build_trajectory(rollout, Outcome(success=True, score=1.0)).metadata["seed"] == 9
