"""Reward components on hand-made trajectories, and custom reward functions."""

import polars as pl
import pytest

from flow_assets.logs.schema import Trajectory
from flow_assets.rl.rewards import RewardConfig, RewardFunctionError, custom_rewards, load_reward_fn, reward_table


def _trajectory(tid: str, agent: str, steps: list[tuple[str, str]], success=None, score=None, answer="x") -> Trajectory:
    return Trajectory.model_validate(
        {
            "trajectory_id": tid,
            "task_id": "t1",
            "agent_id": agent,
            "query": "q",
            "steps": [{"index": i, "kind": k, "status": s} for i, (k, s) in enumerate(steps)],
            "final_answer": answer,
            "outcome": {"success": success, "score": score},
        }
    )


def _tables(trajs: list[Trajectory]) -> tuple[pl.DataFrame, pl.DataFrame]:
    from flow_assets.logs.tables import trajectory_tables

    return trajectory_tables([t.model_dump_json() for t in trajs], "test")


TRAJS = [
    # 2 ok tools + 1 failed tool + 1 verify + answer = 5 steps; success, no score
    _trajectory("a", "react:x", [("plan", "ok"), ("tool", "ok"), ("tool", "error"), ("tool", "ok"), ("verify", "ok")], success=True),
    # score wins over success: 0.4
    _trajectory("b", "react:x", [("answer", "ok")], success=False, score=0.4),
    _trajectory("c", "other", [], success=False, answer=""),
]


def test_seed_formula_components_by_hand():
    traj, steps = _tables(TRAJS)
    out = reward_table(traj, steps, RewardConfig())
    a, b, c = out.to_dicts()
    assert (a["r_outcome"], a["r_tool_success"], a["r_verify"], a["r_step_penalty"]) == pytest.approx((1.0, 0.2, 0.05, -0.05))
    assert a["reward"] == pytest.approx(1.0 + 0.2 + 0.05 - 0.05)
    assert b["r_outcome"] == pytest.approx(0.4) and b["reward"] == pytest.approx(0.4 - 0.01)
    assert c["reward"] == 0.0 and c["r_step_penalty"] == 0.0


def test_weights_are_configurable():
    traj, steps = _tables(TRAJS)
    out = reward_table(traj, steps, RewardConfig(outcome=2.0, tool_success=1.0, verify=0.0, step_penalty=0.0))
    assert out["reward"].to_list() == pytest.approx([2.0 + 2.0, 0.8, 0.0])


def test_outcome_only_is_the_logged_outcome():
    traj, steps = _tables(TRAJS)
    out = reward_table(traj, steps, RewardConfig.outcome_only())
    assert out["reward"].to_list() == pytest.approx([1.0, 0.4, 0.0])


def test_custom_reward_functions_apply_by_agent_type():
    cfg = RewardConfig(custom={"react": ("flow_assets.rl.reward_fns:tool_error_penalty",), "*": ("flow_assets.rl.reward_fns:answered",)})
    custom = custom_rewards(TRAJS, cfg)
    # a: one failed tool (-0.1) + answered (1); b: answered; c: not react, empty answer
    assert custom == pytest.approx({"a": 0.9, "b": 1.0, "c": 0.0})
    traj, steps = _tables(TRAJS)
    out = reward_table(traj, steps, cfg, custom)
    assert out["r_custom"].to_list() == pytest.approx([0.9, 1.0, 0.0])
    assert out["reward"][0] == pytest.approx(1.0 + 0.2 + 0.05 - 0.05 + 0.9)


def test_bad_custom_reward_paths_name_the_function():
    with pytest.raises(RewardFunctionError, match="no_colon"):
        load_reward_fn("no_colon")
    with pytest.raises(RewardFunctionError, match="does_not_exist"):
        load_reward_fn("flow_assets.rl.reward_fns:does_not_exist")


def test_custom_reward_returning_nan_is_an_error_naming_the_trajectory(monkeypatch):
    import flow_assets.rl.reward_fns as fns

    monkeypatch.setattr(fns, "nan_reward", lambda t: float("nan"), raising=False)
    cfg = RewardConfig(custom={"*": ("flow_assets.rl.reward_fns:nan_reward",)})
    with pytest.raises(RewardFunctionError, match="'a'.*finite"):
        custom_rewards(TRAJS, cfg)


# -- a batch in chunks ----------------------------------------------------------------------------
from flow_assets.rl.rewards import GroupChunk, chunked_custom_rewards, group_chunks, trajectory_groups  # noqa: E402

BOTH = RewardConfig(custom={"react": ("flow_assets.rl.reward_fns:tool_error_penalty",), "*": ("flow_assets.rl.reward_fns:answered",)})


def test_custom_rewards_in_chunks_are_scored_one_chunk_at_a_time_and_equal_the_whole_batch():
    records = [t.model_dump_json() for t in TRAJS]

    def chunks():
        yield records[:2]
        yield []  # an empty chunk is allowed
        yield records[2:]
        raise AssertionError("read past the batch")

    def first_then_fail():
        yield records[:1]
        raise AssertionError("the second chunk was read before the first was scored")

    assert next(chunked_custom_rewards(first_then_fail(), BOTH)) == pytest.approx({"a": 0.9})
    parts = chunked_custom_rewards(chunks(), BOTH)
    assert [next(parts), next(parts), next(parts)] == [pytest.approx({"a": 0.9, "b": 1.0}), {}, pytest.approx({"c": 0.0})]
    assert {k: v for p in chunked_custom_rewards([records[:1], records[1:]], BOTH) for k, v in p.items()} == custom_rewards(TRAJS, BOTH)
    assert list(chunked_custom_rewards([records], RewardConfig())) == [{}]  # no function applies to anyone


def test_a_failing_custom_reward_in_a_later_chunk_names_its_trajectory(monkeypatch):
    import flow_assets.rl.reward_fns as fns

    monkeypatch.setattr(fns, "fails_on_c", lambda t: 1 / 0 if t.trajectory_id == "c" else 1.0, raising=False)
    parts = chunked_custom_rewards([[TRAJS[0].model_dump_json()], [TRAJS[2].model_dump_json()]],
                                   RewardConfig(custom={"*": ("flow_assets.rl.reward_fns:fails_on_c",)}))  # fmt: skip
    assert next(parts) == {"a": 1.0}
    with pytest.raises(RewardFunctionError, match="fails_on_c.*'c'.*ZeroDivisionError"):
        next(parts)


def test_group_chunks_keep_groups_whole_in_the_order_of_their_first_record():
    # interleaved like tau-bench's trials: a b a c b c d
    records = pl.DataFrame({"record": range(7), "task_id": list("abacbcd")}, schema={"record": pl.UInt32, "task_id": pl.String})
    assert group_chunks(records, 4) == [GroupChunk(("a", "b"), 4, 0, 4), GroupChunk(("c", "d"), 3, 3, 6)]
    assert group_chunks(records.lazy(), 100) == [GroupChunk(("a", "b", "c", "d"), 7, 0, 6)]
    # a group larger than the bound is a chunk of its own, never split
    assert group_chunks(records, 1) == [
        GroupChunk(("a",), 2, 0, 2), GroupChunk(("b",), 2, 1, 4), GroupChunk(("c",), 2, 3, 5), GroupChunk(("d",), 1, 6, 6)
    ]  # fmt: skip
    assert group_chunks(records.clear(), 4) == []
    with pytest.raises(ValueError, match="max_trajectories"):
        group_chunks(records, 0)


def test_trajectory_groups_are_in_first_record_order():
    other = _trajectory("d", "react:x", [], success=True).model_copy(update={"task_id": "t0"})
    groups = trajectory_groups([t.model_dump_json() for t in (TRAJS[0], other, *TRAJS[1:])])
    assert list(groups) == ["t1", "t0"]
    assert [t.trajectory_id for t in groups["t1"]] == ["a", "b", "c"] and [t.trajectory_id for t in groups["t0"]] == ["d"]
    assert trajectory_groups([]) == {}
