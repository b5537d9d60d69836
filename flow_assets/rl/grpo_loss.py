"""The clipped GRPO surrogate loss, per token, with configurable aggregation and optional k3 KL.

GRPO (Shao et al. 2024, "DeepSeekMath", eq. 3) maximises, for every completion ``i`` of a group and
every token ``t`` of it, PPO's clipped objective (Schulman et al. 2017, "Proximal Policy
Optimization Algorithms", eq. 7) with the group-relative advantage ``A_i`` broadcast over tokens::

    ratio_{i,t} = pi_theta(o_{i,t} | q, o_{i,<t}) / pi_old(o_{i,t} | q, o_{i,<t})
                = exp(logp_new_{i,t} - logp_old_{i,t})
    L_{i,t}     = -min(ratio_{i,t} * A_i,  clip(ratio_{i,t}, 1 - epsilon, 1 + epsilon_high) * A_i)
                  + beta * KL_{i,t}

``logp_old`` are the behaviour log-probs logged when the completion was sampled. When they are
absent the completion is treated as sampled by the current parameters: ``logp_old =
logp_new.detach()``, so the ratio is exactly 1 and the loss's gradient is the plain policy
gradient ``-A_i * grad logp_new``.

The KL term to a frozen reference policy uses Schulman's k3 estimator (J. Schulman 2020,
"Approximating KL divergence"; DeepSeekMath eq. 4), unbiased for KL(pi_theta || pi_ref) and >= 0::

    KL_{i,t} = exp(ref_logp - logp_new) - (ref_logp - logp_new) - 1

Aggregation of ``L_{i,t}`` over tokens (``loss_type``, the same names and meanings as TRL's
``GRPOConfig.loss_type``), with ``m_{i,t}`` the completion mask::

    "grpo":     mean_i [ sum_t m L / sum_t m ]       (per-sequence mean, then mean over sequences)
    "bnpo":     sum_{i,t} m L / sum_{i,t} m          (mean over all tokens of the batch)
    "dapo":     same as "bnpo" here (TRL normalises by the tokens of the *global* batch across
                processes; this loss sees one process, so the two coincide)
    "dr_grpo":  sum_{i,t} m L / (batch * max_completion_length)   (Liu et al. 2025, "Dr. GRPO")

Default ``"dapo"`` (Yu et al. 2025, "DAPO", token-level policy-gradient loss): every token weighs
the same, so a long completion is not down-weighted per token relative to a short one, as it is
under "grpo" (which also biases towards longer wrong answers and shorter right ones).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from flow_assets.rl.grpo_config import GRPOLossConfig

@dataclass(frozen=True)
class GRPOLossOutput:
    """The loss and what a person wants to see about it (metrics are detached python floats).

    Attributes:
        loss: scalar tensor to call ``.backward()`` on.
        clip_low_fraction: fraction of tokens with ``A < 0`` and ``ratio < 1 - epsilon`` (clipped,
            no gradient), over all masked tokens.
        clip_high_fraction: fraction of tokens with ``A > 0`` and ``ratio > 1 + epsilon_high``.
        clip_fraction: their sum (the two sets are disjoint).
        mean_ratio: mean importance ratio over masked tokens.
        mean_kl: mean k3 KL over masked tokens; 0.0 when ``ref_logp`` is ``None``.
        num_tokens: number of masked (real completion) tokens.
    """

    loss: torch.Tensor
    clip_low_fraction: float
    clip_high_fraction: float
    clip_fraction: float
    mean_ratio: float
    mean_kl: float
    num_tokens: int


def k3_kl(logp_new: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """Per-token k3 estimate of KL(pi_new || pi_ref) (Schulman 2020): ``exp(d) - d - 1``, ``d = ref - new``.

    Args:
        logp_new: ``[batch, seq]`` log-probs of the sampled tokens under the trained policy.
        ref_logp: ``[batch, seq]`` log-probs of the same tokens under the reference policy.

    Returns:
        ``[batch, seq]`` non-negative estimates (nats).
    """
    d = ref_logp - logp_new
    return torch.exp(d) - d - 1.0


def grpo_loss(
    logp_new: torch.Tensor,
    logp_old: torch.Tensor | None,
    advantages: torch.Tensor,
    completion_mask: torch.Tensor,
    ref_logp: torch.Tensor | None = None,
    config: GRPOLossConfig | None = None,
) -> GRPOLossOutput:
    """Clipped GRPO surrogate (DeepSeekMath eq. 3 with PPO clip, eq. 7), aggregated per ``loss_type``.

    Args:
        logp_new: ``[batch, seq]`` log-probs of the completion tokens under the current parameters
            (with grad).
        logp_old: ``[batch, seq]`` behaviour log-probs logged at sampling time, or ``None`` (then
            ``logp_new.detach()``: ratio 1).
        advantages: ``[batch]`` one advantage per completion, broadcast over its tokens.
        completion_mask: ``[batch, seq]`` 1 on real completion tokens, 0 on padding.
        ref_logp: ``[batch, seq]`` reference-policy log-probs (no grad), needed when ``beta > 0``.
        config: clip ranges, KL weight, aggregation.

    Returns:
        :class:`GRPOLossOutput`. With no real token at all the loss is 0 (still differentiable).

    Raises:
        ValueError: on shape mismatches, an unknown ``loss_type``, or ``beta > 0`` without
            ``ref_logp``.
    """
    config = config or GRPOLossConfig()
    if logp_new.dim() != 2:
        raise ValueError(f"logp_new must be [batch, seq], got {tuple(logp_new.shape)}")
    batch, seq = logp_new.shape
    for name, t in (("logp_old", logp_old), ("completion_mask", completion_mask), ("ref_logp", ref_logp)):
        if t is not None and t.shape != logp_new.shape:
            raise ValueError(f"{name} has shape {tuple(t.shape)}, expected {(batch, seq)}")
    if advantages.shape != (batch,):
        raise ValueError(f"advantages has shape {tuple(advantages.shape)}, expected {(batch,)}")
    if config.beta > 0 and ref_logp is None:
        raise ValueError("beta > 0 needs ref_logp")

    mask = completion_mask.to(logp_new.dtype)  # [batch, seq]
    if logp_old is None:
        logp_old = logp_new.detach()
    adv = advantages.to(logp_new.dtype).unsqueeze(1)  # [batch, 1]

    ratio = torch.exp(logp_new - logp_old)  # [batch, seq]
    clipped_ratio = torch.clamp(ratio, 1.0 - config.epsilon, 1.0 + config.epsilon_high)
    per_token = -torch.min(ratio * adv, clipped_ratio * adv)  # [batch, seq]

    kl = None
    if ref_logp is not None:
        kl = k3_kl(logp_new, ref_logp.detach())  # [batch, seq]
        if config.beta > 0:
            per_token = per_token + config.beta * kl

    loss = aggregate_tokens(per_token, mask, config)

    with torch.no_grad():
        n = mask.sum()
        denom = n.clamp(min=1.0)
        low = ((ratio < 1.0 - config.epsilon) & (adv < 0)).to(mask.dtype)
        high = ((ratio > 1.0 + config.epsilon_high) & (adv > 0)).to(mask.dtype)
        clip_low = float((low * mask).sum() / denom)
        clip_high = float((high * mask).sum() / denom)
        mean_ratio = float((ratio * mask).sum() / denom)
        mean_kl = float((kl * mask).sum() / denom) if kl is not None else 0.0
    return GRPOLossOutput(
        loss=loss,
        clip_low_fraction=clip_low,
        clip_high_fraction=clip_high,
        clip_fraction=clip_low + clip_high,
        mean_ratio=mean_ratio,
        mean_kl=mean_kl,
        num_tokens=int(n.item()),
    )


def aggregate_tokens(per_token: torch.Tensor, mask: torch.Tensor, config: GRPOLossConfig) -> torch.Tensor:
    """Reduce ``per_token: [batch, seq]`` over ``mask: [batch, seq]`` to a scalar as
    ``config.loss_type`` says (TRL's aggregations: ``grpo`` per-sequence mean then batch mean;
    ``bnpo`` / ``dapo`` token mean; ``dr_grpo`` sum over ``batch * max_completion_length``, Liu et
    al. 2025). Shared by the GRPO surrogate and the advantage-weighted likelihood.

    Raises:
        ValueError: an unknown ``loss_type``.
    """
    batch, seq = per_token.shape
    masked = per_token * mask
    if config.loss_type == "grpo":
        per_sequence = masked.sum(dim=1) / mask.sum(dim=1).clamp(min=1.0)  # [batch]
        return per_sequence.mean()
    if config.loss_type in ("bnpo", "dapo"):
        return masked.sum() / mask.sum().clamp(min=1.0)
    if config.loss_type == "dr_grpo":
        length = config.max_completion_length or seq
        return masked.sum() / (batch * length)
    raise ValueError(f"unknown loss_type {config.loss_type!r}")
