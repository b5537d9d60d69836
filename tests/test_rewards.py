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
