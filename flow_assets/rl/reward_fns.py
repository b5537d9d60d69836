"""Example custom reward functions (``RewardConfig.custom``), usable as they are.

Signature of every custom reward function: ``fn(trajectory: Trajectory) -> float``; it gets the
validated canonical trajectory and returns one finite number (unitless) added to the reward as
the ``r_custom`` component. Reference one as ``"flow_assets.rl.reward_fns:tool_error_penalty"``.
"""

from __future__ import annotations

from flow_assets.logs.schema import Trajectory


def tool_error_penalty(trajectory: Trajectory) -> float:
    """-0.1 per tool step whose status is ``error`` (discourages calls that fail)."""
    return -0.1 * sum(1 for s in trajectory.steps if s.kind == "tool" and s.status == "error")


def answered(trajectory: Trajectory) -> float:
    """1.0 when the trajectory ends with a non-empty final answer, else 0.0."""
    return 1.0 if (trajectory.final_answer or "").strip() else 0.0
