"""Captured turns back into training samples (flow_assets.policy.rollouts.training_samples): a
turn sampled under a constraint keeps its ids and advantage but not its masked log-probs."""

import orjson
import polars as pl

from flow_assets.policy.rollouts import constrained_steps, training_samples


def _tables(metadata: dict):
    # two LLM calls with an observation between them, as the gateway lands a tool loop
    steps = pl.DataFrame({
        "trajectory_id": ["t", "t", "t", "u"],
        "index": [0, 1, 2, 0],
        "prompt_token_ids": [[1, 2], None, [1, 2, 3, 4], [5]],
        "token_ids": [[3], None, [5, 6], [7]],
        "logprobs": [[-0.5], None, [0.0, -0.1], [-0.2]],
        "temperature": [1.0, None, 1.0, 0.7],
    })  # fmt: skip
    trajectories = pl.DataFrame({
        "trajectory_id": ["t", "u"], "task_id": ["a", "b"], "agent_id": ["me", "me"],
        "metadata": [orjson.dumps(metadata).decode(), "{}"],
    })  # fmt: skip
    advantages = pl.DataFrame({"trajectory_id": ["t", "t", "u"], "index": [0, 2, 0], "advantage": [1.0, 1.0, -1.0]})
    return steps, advantages, trajectories


def test_a_constrained_turn_trains_without_its_masked_logprobs_and_the_others_keep_theirs():
    steps, advantages, trajectories = _tables({"constrained_turns": [{"turn": 1, "constraint": "tool_choice:required"}]})
    assert constrained_steps(steps, trajectories) == {("t", 2)}  # the second LLM call is step 2
    samples = training_samples(steps, advantages, trajectories, "me")
    assert [(s.completion_ids, s.behaviour_logprobs, s.advantage) for s in samples] == [
        ([3], [-0.5], 1.0), ([5, 6], None, 1.0), ([7], [-0.2], -1.0),
    ]
    # without the marker every turn keeps the log-probs it was sampled with
    unmarked = training_samples(*_tables({}), "me")
    assert [s.behaviour_logprobs for s in unmarked] == [[-0.5], [0.0, -0.1], [-0.2]]


def test_samples_come_in_trajectory_and_step_order_whatever_order_the_rollouts_landed_in():
    """The table's order is the order the rollouts finished in (timing); the samples, and so the
    update's minibatches, do not depend on it."""
    steps, advantages, trajectories = _tables({})
    landed = [
        training_samples(steps[list(order)], advantages.reverse(), trajectories.reverse(), "me")
        for order in ([0, 1, 2, 3], [3, 2, 1, 0], [3, 0, 2, 1])
    ]
    assert [[(s.completion_ids, s.advantage) for s in samples] for samples in landed] == [[([3], 1.0), ([5, 6], 1.0), ([7], -1.0)]] * 3
