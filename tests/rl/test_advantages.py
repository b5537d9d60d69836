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
    out = group_advantages(_rewards({"t": [1, 0, 0, 0]}), AdvantageConfig(scale_rewards=False))
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


# -- a batch's groups: pooling, turn counts and the advantages of the batch ------------------------
from flow_assets.rl.advantages import pool_groups, pooled_advantages, turn_counts, with_turn_counts  # noqa: E402

REWARDS_SCHEMA = {"trajectory_id": pl.String, "task_id": pl.String, "reward": pl.Float64, "source": pl.String}


def _batch(rows: list[tuple[str, str, float | None]], source: str = "fleet") -> pl.DataFrame:
    return pl.DataFrame([(*r, source) for r in rows], schema=REWARDS_SCHEMA, orient="row")


def test_a_batch_is_grouped_by_task_with_unlabelled_rows_last_and_without_advantage():
    # t1: rewards 1, 0 (mean 0.5, sample std sqrt(0.5)); t2: a group of one; t3: all equal;
    # f: unlabelled (null reward), listed before the others but returned last
    own = _batch([("f", "t1", None), ("a", "t1", 1.0), ("b", "t1", 0.0), ("c", "t2", 0.5), ("d", "t3", 0.3), ("e", "t3", 0.3)])
    out = pooled_advantages(own, "b1", AdvantageConfig(eps=0.0))
    assert out["trajectory_id"].to_list() == ["a", "b", "c", "d", "e", "f"]
    assert out["group_key"].to_list() == ["t1", "t1", "t2", "t3", "t3", "t1"]
    assert out["advantage"].to_list()[:5] == pytest.approx([0.5 / math.sqrt(0.5), -0.5 / math.sqrt(0.5), 0.0, 0.0, 0.0])
    assert out["advantage"][5] is None and out["zero_variance"][5] is None
    assert out["zero_variance"].to_list()[:5] == [False, False, True, True, True]
    assert out["group_size"].to_list()[:5] == [2, 2, 1, 2, 2]  # the unlabelled f is not in t1's group
    assert out["group_std"][2] is None  # a group of one has no sample std
    assert "batch" not in out.columns and out.columns[:4] == own.columns
    unscaled = pooled_advantages(own, "b1", AdvantageConfig(scale_rewards=False))  # Dr. GRPO
    assert unscaled["advantage"].to_list()[:5] == pytest.approx([0.5, -0.5, 0.0, 0.0, 0.0])


def test_an_empty_batch_has_no_advantages_and_pools_nothing():
    own = _batch([])
    peers = _batch([("g", "t1", 1.0)]).with_columns(batch=pl.lit("b2"))
    for config, kwargs in ((AdvantageConfig(), {}), (AdvantageConfig(group_scope="source"), {"peers": peers})):
        out = pooled_advantages(own, "b1", config, **kwargs)
        assert out.height == 0 and {"group_key", "advantage", "zero_variance"} <= set(out.columns)
    assert pool_groups(own, "b1", peers).height == 0  # no source to match


def test_source_scope_pools_the_other_batches_of_the_same_source_only():
    own = _batch([("a", "t1", 1.0), ("b", "t1", 0.0)])
    peers = pl.concat([
        own.with_columns(batch=pl.lit("b1"), reward=pl.lit(5.0)),  # the batch itself, as stored: not pooled twice
        _batch([("g", "t1", 1.0), ("h", "t1", 1.0)]).with_columns(batch=pl.lit("b2")),
        _batch([("x", "t1", 0.0)], source="other").with_columns(batch=pl.lit("b3")),
    ])  # fmt: skip
    pool = pool_groups(own, "b1", peers.lazy())
    assert pool.select("trajectory_id", "batch").rows() == [("a", "b1"), ("b", "b1"), ("g", "b2"), ("h", "b2")]
    # t1 over the source: rewards 1, 0, 1, 1: mean 0.75, sample std sqrt((3 * 0.25^2 + 0.75^2) / 3) = 0.5
    out = pooled_advantages(own, "b1", AdvantageConfig(group_scope="source", eps=0.0), peers=peers)
    assert out["trajectory_id"].to_list() == ["a", "b"]
    assert out["advantage"].to_list() == pytest.approx([0.25 / 0.5, -0.75 / 0.5])
    assert out["group_size"].to_list() == [4, 4]
    alone = pooled_advantages(own, "b1", AdvantageConfig(eps=0.0), peers=peers)  # batch scope ignores peers
    assert alone["group_size"].to_list() == [2, 2]
    with pytest.raises(ValueError, match="peers"):
        pooled_advantages(own, "b1", AdvantageConfig(group_scope="source"))


def test_turn_counts_leave_out_observations_and_other_batches():
    steps = pl.DataFrame({
        "batch": ["b1"] * 4 + ["b9"] * 3,
        "trajectory_id": ["a", "a", "a", "b", "a", "a", "a"],
        "kind": ["tool", "observation", "answer", "answer", "tool", "tool", "tool"],
    })  # fmt: skip
    counts = turn_counts(steps.lazy()).sort("batch", "trajectory_id")
    assert counts.rows() == [("b1", "a", 2), ("b1", "b", 1), ("b9", "a", 3)]
    own = _batch([("a", "t1", 1.0), ("b", "t1", 0.0), ("c", "t1", 0.0)])
    pool = with_turn_counts(own.with_columns(batch=pl.lit("b1")), steps)
    assert pool["n_turns"].to_list() == [2, 1, 0]  # c has no step: no turn, no row
    # turn rows [1, 1, 0] (c has none): mean 2/3, sample std sqrt((2 * (1/3)^2 + (2/3)^2) / 2) = sqrt(1/3)
    out = pooled_advantages(own, "b1", AdvantageConfig(normalise_over="turn", eps=0.0), steps=steps)
    std = math.sqrt(1 / 3)
    assert out["advantage"].to_list() == pytest.approx([(1 / 3) / std, -(2 / 3) / std, -(2 / 3) / std])
    assert out["n_turns"].to_list() == [2, 1, 0] and out["group_size"].to_list() == [3, 3, 3]
    with pytest.raises(ValueError, match="steps"):
        pooled_advantages(own, "b1", AdvantageConfig(normalise_over="turn"))
