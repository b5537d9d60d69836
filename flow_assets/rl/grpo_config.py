"""The GRPO loss's settings, apart from the loss (:mod:`~flow_assets.rl.grpo_loss`, torch) so the
code location can build the trainer's run config without importing torch."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

LossType = Literal["grpo", "bnpo", "dapo", "dr_grpo"]


@dataclass(frozen=True)
class GRPOLossConfig:
    """Settings of the GRPO surrogate.

    Attributes:
        eps_low: lower clip range: the ratio is clipped below at ``1 - eps_low`` (0.2 as in PPO,
            DeepSeekMath and TRL's ``epsilon``).
        eps_high: upper clip range: clipped above at ``1 + eps_high``; 0.2 by default, DAPO's
            "clip-higher" uses 0.28.
        beta: weight of the k3 KL penalty to the reference policy; 0 (the default, as in TRL since
            DAPO / Dr. GRPO showed it is not needed for verifiable rewards) skips the reference pass.
        loss_type: token aggregation, see :mod:`~flow_assets.rl.grpo_loss`; default ``"dapo"``.
        max_completion_length: the denominator's length for ``"dr_grpo"``; ``None`` uses the
            sequence dimension of the inputs (the longest completion of the batch, padded).
    """

    eps_low: float = 0.2
    eps_high: float = 0.2
    beta: float = 0.0
    loss_type: LossType = "dapo"
    max_completion_length: int | None = None
