"""The GRPO loss's settings, apart from the loss (:mod:`~flow_assets.rl.grpo_loss`, torch) so the
code location can build the trainer's run config without importing torch.

Field names are TRL's ``GRPOConfig`` names for the same settings (``epsilon``, ``epsilon_high``,
``beta``, ``loss_type``, ``max_completion_length``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar, Literal

LossType = Literal["grpo", "bnpo", "dapo", "dr_grpo"]


@dataclass(frozen=True)
class GRPOLossConfig:
    """Settings of the GRPO surrogate; each field's description is its ``metadata["description"]``
    (:mod:`flow_assets.core.config`)."""

    #: old field name -> new one; a saved run config with an old name is refused, naming the new one
    RENAMED: ClassVar[dict[str, str]] = {"eps_low": "epsilon", "eps_high": "epsilon_high"}

    epsilon: float = field(default=0.2, metadata={"description": (
        "lower clip range: the ratio is clipped below at 1 - epsilon (0.2 as in PPO, DeepSeekMath and TRL's epsilon)")})
    epsilon_high: float = field(default=0.2, metadata={"description": (
        "upper clip range: clipped above at 1 + epsilon_high; 0.2 by default, DAPO's \"clip-higher\" uses 0.28 (TRL's epsilon_high)")})
    beta: float = field(default=0.0, metadata={"description": (
        "weight of the k3 KL penalty to the reference policy; 0 (the default, as in TRL since DAPO / Dr. GRPO showed it "
        "is not needed for verifiable rewards) skips the reference pass")})
    loss_type: LossType = field(default="dapo", metadata={"description": (
        "token aggregation (grpo, bnpo, dapo, dr_grpo; see flow_assets.rl.grpo_loss); default dapo")})
    max_completion_length: int | None = field(default=None, metadata={"description": (
        "the denominator's length for dr_grpo; null uses the sequence dimension of the inputs (the longest completion "
        "of the batch, padded)")})
