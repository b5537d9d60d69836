"""The promotion gate: may a candidate adapter replace the champion?

Three conditions, each a blocking asset check on ``evaluation_report`` and re-checked by
``promoted_adapter`` before it writes the registry:

- ``gain``: held-out success-rate gain (candidate - champion, absolute, in ``metric`` mode) is at
  least ``min_gain``; with ``require_significance`` the gain must also be significant
  (McNemar exact p < ``alpha``, and in the right direction). Default: not worse (gain >= 0).
- ``finite_loss``: every training step's loss and gradient norm were finite.
- ``kl_bound``: the mean KL(policy || behaviour/reference) over the round's steps stayed at most
  ``max_kl`` (nats per token).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal


@dataclass(frozen=True)
class GateConfig:
    """Attributes:
    metric: ``"sampled"`` (at the evaluation's sampled temperature) or ``"greedy"`` held-out success.
    min_gain: least absolute success-rate gain (0.0 = not worse).
    require_significance: also require McNemar's p < ``alpha``.
    alpha: significance level.
    max_kl: bound on the round's mean KL, nats per token.
    """

    metric: Literal["sampled", "greedy"] = "sampled"
    min_gain: float = 0.0
    require_significance: bool = False
    alpha: float = 0.05
    max_kl: float = 0.5


@dataclass(frozen=True)
class GateResult:
    """One condition: ``passed`` and a sentence for the UI saying why."""

    name: str
    passed: bool
    reason: str


def check_gain(report: dict, config: GateConfig) -> GateResult:
    """The ``gain`` condition on a :func:`~flow_assets.rl.evaluation.compare_policies` report."""
    if config.metric not in report:
        return GateResult("gain", False, f"no {config.metric!r} evaluation in the report")
    mode = report[config.metric]
    gain, p = mode["gain"], mode["mcnemar"]["p_value"]
    cand, champ = mode["candidate"]["success_rate"]["rate"], mode["champion"]["success_rate"]["rate"]
    passed = gain >= config.min_gain and (not config.require_significance or (p < config.alpha and gain > 0))
    reason = (
        f"{config.metric} held-out success {cand:.3f} vs champion {champ:.3f}: gain {gain:+.3f} "
        f"(min {config.min_gain:+.3f}), McNemar p={p:.3g}"
        + (f" (needs < {config.alpha})" if config.require_significance else "")
    )
    return GateResult("gain", passed, reason)


def check_finite_loss(losses: list[float], grad_norms: list[float]) -> GateResult:
    """The ``finite_loss`` condition over a round's per-step losses and gradient norms."""
    bad = [i for i, (l, g) in enumerate(zip(losses, grad_norms)) if not (math.isfinite(l) and math.isfinite(g))]
    if not losses:
        return GateResult("finite_loss", False, "the round made no training step")
    if bad:
        return GateResult("finite_loss", False, f"non-finite loss or grad norm at steps {bad[:10]}")
    return GateResult("finite_loss", True, f"{len(losses)} steps, all losses and grad norms finite")


def check_kl(mean_kl: float, config: GateConfig) -> GateResult:
    """The ``kl_bound`` condition on the round's mean KL (nats per token)."""
    passed = math.isfinite(mean_kl) and mean_kl <= config.max_kl
    return GateResult("kl_bound", passed, f"mean KL {mean_kl:.4g} nats/token (bound {config.max_kl})")
