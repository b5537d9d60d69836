"""Group-normalised advantages and per-step credit, on groups computed by hand."""

import math

import polars as pl
import pytest

from flow_assets.rl.advantages import AdvantageConfig, group_advantages
from flow_assets.rl.credit import CreditConfig, step_advantages


def _rewards(groups: dict[str, list[float]]) -> pl.DataFrame:
    rows = [(g, r) for g, rs in groups.items() for r in rs]
    return pl.DataFrame(rows, schema={"group_key": pl.String, "reward": pl.Float64}, orient="row")


def test_grpo_advantage_matches_hand_computation():
    # rewards 1,0,0,0: mean 0.25; sample std sqrt((0.75^2 + 3 * 0.25^2) / 3) = 0.5
    out = group_advantages(_rewards({"t": [1, 0, 0, 0]}), AdvantageConfig(eps=1e-4))
    assert out["group_mean"].to_list() == [0.25] * 4
    assert out["group_std"][0] == pytest.approx(0.5)
    assert out["advantage"].to_list() == pytest.approx([0.75 / 0.5001, -0.25 / 0.5001, -0.25 / 0.5001, -0.25 / 0.5001])
    assert not out["zero_variance"].any()


def test_dr_grpo_does_not_scale_by_std():
    out = group_advantages(_rewards({"t": [1, 0, 0, 0]}), AdvantageConfig(scale_by_std=False))
    assert out["advantage"].to_list() == pytest.approx([0.75, -0.25, -0.25, -0.25])


def test_groups_are_normalised_separately_and_order_is_kept():
    out = group_advantages(_rewards({"a": [2, 0], "b": [10, 20, 30]}), AdvantageConfig(eps=0.0))
    # a: mean 1, std sqrt(2); b: mean 20, std 10
    assert out["advantage"].to_list() == pytest.approx([1 / math.sqrt(2), -1 / math.sqrt(2), -1.0, 0.0, 1.0])
    assert out["group_size"].to_list() == [2, 2, 3, 3, 3]


def test_zero_variance_group_gets_exactly_zero_advantage():
    out = group_advantages(_rewards({"same": [1, 1, 1], "mixed": [1, 0]}), AdvantageConfig())
    same = out.filter(pl.col("group_key") == "same")
    assert same["zero_variance"].all()
    assert same["advantage"].to_list() == [0.0, 0.0, 0.0]
    assert not out.filter(pl.col("group_key") == "mixed")["zero_variance"].any()


def test_single_member_group_is_flagged_and_gets_no_advantage():
    out = group_advantages(_rewards({"alone": [0.7], "pair": [0.0, 1.0]}), AdvantageConfig())
    alone = out.filter(pl.col("group_key") == "alone")
    assert alone["zero_variance"][0] is True
    assert alone["advantage"][0] == 0.0
    assert alone["group_std"][0] is None


def test_non_finite_reward_is_refused():
    with pytest.raises(ValueError, match="finite"):
        group_advantages(_rewards({"t": [1.0, float("nan")]}), AdvantageConfig())


def test_unknown_group_scope_is_refused():
    with pytest.raises(ValueError, match="group_scope"):
        AdvantageConfig(group_scope="galaxy")


def _steps(n: int) -> pl.DataFrame:
    return pl.DataFrame({"trajectory_id": ["x"] * n, "index": list(range(n)), "kind": ["message"] * n})


def test_broadcast_credit_gives_every_step_the_trajectory_advantage():
    out = step_advantages(_steps(3), pl.DataFrame({"trajectory_id": ["x"], "advantage": [-0.8]}), CreditConfig())
    assert out["advantage"].to_list() == [-0.8, -0.8, -0.8]


def test_discounted_credit_decays_towards_the_first_step():
    # gamma^(n-i-1) with n=4, gamma=0.5: 0.125, 0.25, 0.5, 1
    out = step_advantages(
        _steps(4), pl.DataFrame({"trajectory_id": ["x"], "advantage": [2.0]}), CreditConfig("discounted", 0.5)
    )
    assert out["advantage"].to_list() == pytest.approx([0.25, 0.5, 1.0, 2.0])


def test_discounted_credit_is_per_trajectory():
    steps = pl.DataFrame({"trajectory_id": ["a", "a", "b"], "index": [0, 1, 0], "kind": ["tool", "answer", "answer"]})
    adv = pl.DataFrame({"trajectory_id": ["a", "b"], "advantage": [1.0, 1.0]})
    out = step_advantages(steps, adv, CreditConfig("discounted", 0.9))
    assert out["advantage"].to_list() == pytest.approx([0.9, 1.0, 1.0])


def test_discounted_credit_counts_turns_not_tool_results():
    # a gateway rollout: turn (tool call), observation, turn (tool call), observation, turn (answer)
    kinds = ["tool", "observation", "tool", "observation", "answer"]
    steps = pl.DataFrame({"trajectory_id": ["a"] * 5, "index": list(range(5)), "kind": kinds})
    out = step_advantages(steps, pl.DataFrame({"trajectory_id": ["a"], "advantage": [1.0]}), CreditConfig("discounted", 0.5))
    # each step is discounted by the turns after it: turns get 0.25, 0.5, 1 (observations, which
    # carry no tokens, the weight of the turn that follows them)
    assert out["advantage"].to_list() == pytest.approx([0.25, 0.25, 0.5, 0.5, 1.0])


def test_gamma_outside_unit_interval_is_refused():
    with pytest.raises(ValueError, match="gamma"):
        CreditConfig("discounted", 0.0)


def test_turn_normalisation_weighs_rollouts_by_their_turns():
    # one task, three rollouts: rewards 1, 0, 0 with 1, 3 and 2 turns. Over turn rows (AgentFlow)
    # the rows are [1, 0, 0, 0, 0, 0]: mean 1/6, sample std sqrt(1/6); over rollouts (Agent
    # Lightning v1.0) [1, 0, 0]: mean 1/3, std sqrt(1/3)
    frame = pl.DataFrame({"group_key": ["t"] * 3, "reward": [1.0, 0.0, 0.0], "n_turns": [1, 3, 2]})
    turn = group_advantages(frame, AdvantageConfig(normalise_over="turn", eps=0.0))
    rollout = group_advantages(frame, AdvantageConfig(eps=0.0))
    mean, std = 1 / 6, (1 / 6) ** 0.5
    assert turn["advantage"].to_list() == pytest.approx([(1 - mean) / std, -mean / std, -mean / std])
    assert turn["group_size"].to_list() == [6, 6, 6]
    assert rollout["advantage"].to_list() == pytest.approx([(1 - 1 / 3) / (1 / 3) ** 0.5, -(1 / 3) / (1 / 3) ** 0.5, -(1 / 3) / (1 / 3) ** 0.5])


def test_turn_normalisation_leaves_out_rollouts_without_a_turn():
    # the rollout that never called the model has no row: the group is the two others, equal: no signal
    frame = pl.DataFrame({"group_key": ["t"] * 3, "reward": [0.0, 0.5, 0.5], "n_turns": [0, 2, 1]})
    out = group_advantages(frame, AdvantageConfig(normalise_over="turn"))
    assert out["zero_variance"].to_list() == [True] * 3 and out["advantage"].to_list() == [0.0] * 3
    with pytest.raises(ValueError, match="n_turns"):
        group_advantages(frame.drop("n_turns"), AdvantageConfig(normalise_over="turn"))
