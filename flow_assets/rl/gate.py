"""The promotion gate: may a candidate adapter replace the champion?

Three conditions, each a blocking asset check on ``evaluation_report`` and re-checked by
``promoted_adapter`` before it writes the registry:

- ``gain``: held-out success-rate gain (candidate - champion, absolute, in ``metric`` mode) is at
  least ``min_gain``; with ``require_significance`` the gain must also be significant
  (McNemar exact p < ``alpha``, and in the right direction). Default: not worse (gain >= 0),
  without significance, on purpose: a round's real gain is typically 1-3 points, which McNemar's
  test (alpha 0.05) detects with 5-8% power on 150 held-out tasks and 11-20% on 500 (simulated:
  sampled outcomes, tasks of mixed difficulty, base success 0.3), so requiring significance per
  round blocks most real improvements (the demo's calculator agent, 0.165 ->
  0.347 over 12 rounds, gains ~2 points a round). A "not worse" round is noise-sized at worst; the
  cumulative gain is tested on held-out tasks no gate saw (``flowopt demo``'s last line) and, live,
  by the A/B test. Set ``require_significance`` (and a larger ``max_tasks``) to demand evidence per
  round.
- ``finite_loss``: every training step's loss and gradient norm were finite.
- ``kl_bound``: the mean KL(policy || behaviour/reference) over the round's steps stayed at most
  ``max_kl`` (nats per token).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal


@dataclass(frozen=True)
class GateConfig:
    """The promotion gate's thresholds; each field's description is its ``metadata["description"]``."""

    metric: Literal["sampled", "greedy"] = field(default="sampled", metadata={"description": (
        "``\"sampled\"`` (at the evaluation's sampled temperature) or ``\"greedy\"`` held-out success.")})
    min_gain: float = field(default=0.0, metadata={"description": (
        "least absolute success-rate gain (0.0 = not worse).")})
    require_significance: bool = field(default=False, metadata={"description": "also require McNemar's p < ``alpha``."})
    alpha: float = field(default=0.05, metadata={"description": "significance level."})
    max_kl: float = field(default=0.5, metadata={"description": "bound on the round's mean KL, nats per token."})


@dataclass(frozen=True)
class GateResult:
    """One condition: ``passed``, a sentence for the UI saying why, and the numbers behind it
    (``metadata``: plain floats / ints, shown as the asset check's metadata and plotted by the UI)."""

    name: str
    passed: bool
    reason: str
    metadata: dict = field(default_factory=dict)


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
    numbers = {
        "gain": gain,
        "min_gain": config.min_gain,
        "mcnemar_p": p,
        "candidate_success": cand,
        "champion_success": champ,
        "held_out_tasks": mode["n_tasks"],
    }
    if config.require_significance:
        numbers["alpha"] = config.alpha
    return GateResult("gain", passed, reason, numbers)


def check_finite_loss(losses: list[float], grad_norms: list[float]) -> GateResult:
    """The ``finite_loss`` condition over a round's per-step losses and gradient norms."""
    bad = [i for i, (l, g) in enumerate(zip(losses, grad_norms)) if not (math.isfinite(l) and math.isfinite(g))]
    numbers = {"steps": len(losses), "non_finite_steps": len(bad)}
    if not losses:
        return GateResult("finite_loss", False, "the round made no training step", numbers)
    if bad:
        return GateResult("finite_loss", False, f"non-finite loss or grad norm at steps {bad[:10]}", numbers)
    return GateResult("finite_loss", True, f"{len(losses)} steps, all losses and grad norms finite", numbers)


def check_kl(mean_kl: float, config: GateConfig) -> GateResult:
    """The ``kl_bound`` condition on the round's mean KL (nats per token)."""
    passed = math.isfinite(mean_kl) and mean_kl <= config.max_kl
    return GateResult("kl_bound", passed, f"mean KL {mean_kl:.4g} nats/token (bound {config.max_kl})", {"mean_kl": mean_kl, "max_kl": config.max_kl})


def verdict(parent: str, results: tuple[GateResult, ...] | list[GateResult]) -> str:
    """One line for the UI: ``"promote: the candidate replaces v15"`` or ``"keep v15 (blocked:
    gain -0.002, p = 1)"``, naming each failed check by its numbers (or its reason)."""
    failed = [r for r in results if not r.passed]
    if not failed:
        return f"promote: the candidate replaces {parent}"
    parts = []
    for r in failed:
        m = r.metadata
        if r.name == "gain" and "gain" in m:
            parts.append(f"gain {m['gain']:+.3f} (min {m['min_gain']:+.3f}), McNemar p = {m['mcnemar_p']:.2g}")
        elif r.name == "kl_bound" and "mean_kl" in m:
            parts.append(f"KL {m['mean_kl']:.3g} > {m['max_kl']:g}")
        else:
            parts.append(f"{r.name}: {r.reason}")
    return f"keep {parent} (blocked: {'; '.join(parts)})"
