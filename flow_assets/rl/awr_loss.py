"""Advantage-weighted likelihood: the update for flows another model wrote (GPT-4o's, a human's,
an older agent's), where no behaviour log-prob of the policy being trained exists.

For row ``i`` (one logged conversation, or one turn of it) with group advantage ``A_i`` and
per-token log-probs ``logp_{i,t}`` of the logged tokens under the trained policy::

    L_{i,t} = -w_i * logp_{i,t}  +  beta_kl * KL_{i,t}

with the weight ``w_i`` (``weighting``):

- ``"positive"``: filtered behaviour cloning. Rows with ``A_i > 0`` are kept, the others leave
  the loss; ``w_i = A_i`` (``positive_weight = "advantage"``: the seed's FR-3 as written,
  ``loss = -log_prob * advantage`` on positive advantages) or ``w_i = 1`` (``"one"``: plain
  filtered BC, the ``beta -> 0`` limit of AWR's weights up to their scale);
- ``"exp"``: AWR (Peng et al. 2019, "Advantage-Weighted Regression", arXiv:1910.00177,
  Algorithm 1's policy step: maximise ``E[log pi(a|s) * exp(A / beta)]``), every row kept,
  ``w_i = exp(A_i / awr_beta)``.

Every weight is clipped above at ``weight_clip`` (AWR clips its exponential weights, at 20 in its
experiments), so one outlier row cannot dominate a step. The weights are constants (the
advantages come from the data plane), so the gradient is ``-w_i * grad logp``: likelihood pushed
up on kept rows in proportion to their weight, never down (a negative advantage drops the row
under ``"positive"`` and gets a small positive weight under ``"exp"``).

The optional KL term to a frozen reference policy is Schulman's k3 estimator
(:func:`flow_assets.rl.grpo_loss.k3_kl`), on the kept rows' tokens. Tokens are aggregated over the
kept rows' masked tokens as the GRPO loss does (``loss_type``, TRL's names; see
:mod:`flow_assets.rl.grpo_loss`): under ``"grpo"`` and ``"dr_grpo"`` a dropped row still counts in
the number of rows, as a zero-advantage completion does in GRPO.

torch is imported by :func:`awr_loss` itself, so the code location can build a run config from
:class:`AWRLossConfig` without loading it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

from flow_assets.rl.grpo_config import LossType

if TYPE_CHECKING:
    import torch

Weighting = Literal["positive", "exp"]


@dataclass(frozen=True)
class AWRLossConfig:
    """Settings of the advantage-weighted likelihood; each field's description is its
    ``metadata["description"]`` (:mod:`flow_assets.core.config`).

    Raises:
        ValueError: an unknown ``weighting`` / ``positive_weight`` / ``loss_type``, or
            ``awr_beta``, ``weight_clip`` not > 0, ``beta_kl`` < 0.
    """

    weighting: Weighting = field(default="positive", metadata={"description": (
        "\"positive\": filtered behaviour cloning on rows with advantage > 0 (FR-3); \"exp\": AWR's exp(A / awr_beta) "
        "on every row (Peng et al. 2019)")})
    positive_weight: Literal["advantage", "one"] = field(default="advantage", metadata={"description": (
        "under \"positive\": weight a kept row by its advantage (FR-3: -log_prob * advantage) or by 1 (plain filtered BC)")})
    awr_beta: float = field(default=1.0, metadata={"description": (
        "AWR's temperature beta in exp(A / beta), in advantage units; smaller favours the best rows more sharply")})
    weight_clip: float = field(default=20.0, metadata={"description": (
        "upper bound of every row's weight (AWR clips its weights at 20)")})
    beta_kl: float = field(default=0.0, metadata={"description": (
        "weight of the k3 KL penalty to the reference policy on the kept tokens; 0 skips the reference pass")})
    loss_type: LossType = field(default="dapo", metadata={"description": (
        "token aggregation, as the GRPO loss's (grpo, bnpo, dapo, dr_grpo); default dapo: every kept token weighs the same")})
    max_completion_length: int | None = field(default=None, metadata={"description": (
        "the denominator's length for dr_grpo; null uses the sequence dimension of the inputs")})

    def __post_init__(self):
        if self.weighting not in ("positive", "exp"):
            raise ValueError(f"weighting must be 'positive' or 'exp', not {self.weighting!r}")
        if self.positive_weight not in ("advantage", "one"):
            raise ValueError(f"positive_weight must be 'advantage' or 'one', not {self.positive_weight!r}")
        if self.loss_type not in ("grpo", "bnpo", "dapo", "dr_grpo"):
            raise ValueError(f"unknown loss_type {self.loss_type!r}")
        for name in ("awr_beta", "weight_clip"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 0):
                raise ValueError(f"{name} must be a finite number > 0, not {value!r}")
        if not (math.isfinite(self.beta_kl) and self.beta_kl >= 0):
            raise ValueError(f"beta_kl must be a finite number >= 0, not {self.beta_kl!r}")


@dataclass(frozen=True)
class AWRLossOutput:
    """The loss and what a person wants to see about it (metrics are detached python floats).

    Attributes:
        loss: scalar tensor to call ``.backward()`` on.
        mean_weight: mean weight of the kept rows (0.0 when none is kept).
        kept_fraction: share of rows in the loss (weight > 0).
        clipped_fraction: share of kept rows whose weight was clipped at ``weight_clip``.
        mean_kl: mean k3 KL over the kept rows' masked tokens; 0.0 without ``ref_logp``.
        num_tokens: masked tokens of the kept rows.
    """

    loss: torch.Tensor
    mean_weight: float
    kept_fraction: float
    clipped_fraction: float
    mean_kl: float
    num_tokens: int


def awr_weights(advantages: torch.Tensor, config: AWRLossConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row weights (module docstring) and whether each was clipped.

    Args:
        advantages: ``[batch]`` finite advantages (no grad needed).

    Returns:
        ``(weights [batch], clipped [batch] bool)``; a dropped row has weight 0.

    Raises:
        ValueError: a non-finite advantage.
    """
    import torch

    if not bool(torch.isfinite(advantages).all()):
        raise ValueError("advantages must be finite")
    a = advantages.detach()
    if config.weighting == "exp":
        raw = torch.exp(a / config.awr_beta)
    elif config.positive_weight == "advantage":
        raw = torch.where(a > 0, a, torch.zeros_like(a))
    else:
        raw = (a > 0).to(a.dtype)
    clipped = raw > config.weight_clip
    return torch.clamp(raw, max=config.weight_clip), clipped


def awr_loss(
    logp: torch.Tensor,
    mask: torch.Tensor,
    advantages: torch.Tensor,
    ref_logp: torch.Tensor | None = None,
    config: AWRLossConfig | None = None,
) -> AWRLossOutput:
    """Advantage-weighted negative log-likelihood of logged tokens (module docstring).

    Args:
        logp: ``[batch, seq]`` log-probs (natural log) of the logged tokens under the trained
            policy, with grad.
        mask: ``[batch, seq]`` 1 on tokens in the loss (the assistant tokens of a logged row),
            0 elsewhere.
        advantages: ``[batch]`` one advantage per row (its trajectory's group advantage).
        ref_logp: ``[batch, seq]`` reference-policy log-probs (no grad); needed when
            ``beta_kl > 0``, and used for the ``mean_kl`` metric whenever given.
        config: weighting, clip, KL weight, aggregation.

    Returns:
        :class:`AWRLossOutput`. With no kept token the loss is 0 (still differentiable).

    Raises:
        ValueError: shape mismatches, a non-finite advantage, or ``beta_kl > 0`` without ``ref_logp``.
    """
    from flow_assets.rl.grpo_config import GRPOLossConfig
    from flow_assets.rl.grpo_loss import aggregate_tokens, k3_kl

    config = config or AWRLossConfig()
    if logp.dim() != 2:
        raise ValueError(f"logp must be [batch, seq], got {tuple(logp.shape)}")
    batch, seq = logp.shape
    for name, t in (("mask", mask), ("ref_logp", ref_logp)):
        if t is not None and t.shape != logp.shape:
            raise ValueError(f"{name} has shape {tuple(t.shape)}, expected {(batch, seq)}")
    if advantages.shape != (batch,):
        raise ValueError(f"advantages has shape {tuple(advantages.shape)}, expected {(batch,)}")
    if config.beta_kl > 0 and ref_logp is None:
        raise ValueError("beta_kl > 0 needs ref_logp")

    weights, clipped = awr_weights(advantages, config)  # [batch]
    weights = weights.to(logp.dtype)
    kept = weights > 0  # [batch]
    kept_mask = mask.to(logp.dtype) * kept.to(logp.dtype).unsqueeze(1)  # [batch, seq]
    per_token = -weights.unsqueeze(1) * logp  # [batch, seq]
    kl = None
    if ref_logp is not None:
        kl = k3_kl(logp, ref_logp.detach())  # [batch, seq]
        if config.beta_kl > 0:
            per_token = per_token + config.beta_kl * kl
    loss = aggregate_tokens(per_token, kept_mask, GRPOLossConfig(loss_type=config.loss_type, max_completion_length=config.max_completion_length))

    n_kept = int(kept.sum())
    n_tokens = float(kept_mask.sum())
    return AWRLossOutput(
        loss=loss,
        mean_weight=float(weights[kept].mean()) if n_kept else 0.0,
        kept_fraction=n_kept / batch if batch else 0.0,
        clipped_fraction=float((clipped & kept).sum()) / n_kept if n_kept else 0.0,
        mean_kl=float((kl.detach() * kept_mask).sum()) / n_tokens if kl is not None and n_tokens else 0.0,
        num_tokens=int(n_tokens),
    )
