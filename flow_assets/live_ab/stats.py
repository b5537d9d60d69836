"""Live A/B decision between the champion adapter (A) and a challenger (B) on binary outcomes,
valid however often it is checked (continuous monitoring).

The test is the mixture sequential probability ratio test (mSPRT) with a normal mixing
distribution, as in Johari, Koomen, Pekelis & Walsh, "Always Valid Inference: Continuous
Monitoring of A/B Tests", Operations Research 70(3), 2022 (arXiv:1512.04922), written out for
the difference of two success rates. Only numpy is used.

Model and statistic
-------------------
Outcomes are 0/1 (1 = success). After ``n_A`` champion and ``n_B`` challenger outcomes let
``theta_hat = mean_B - mean_A`` (the estimated gain, a fraction; 0.10 = "+10 points", points being
percentage points) and ``v = sigma2_A / n_A + sigma2_B / n_B`` its variance (``sigma2 (1/n_A +
1/n_B)`` when the rates are equal). By the central limit theorem
``theta_hat`` is approximately ``N(theta, v)`` (the normal approximation to Bernoulli outcomes), and
for any fixed, outcome-independent order of arrivals the sequence of ``theta_hat`` has the
"canonical joint distribution" of group-sequential analysis: ``Cov(theta_hat_j, theta_hat_k) =
v_k`` for an earlier look ``j`` and a later look ``k``, so the score ``S = theta_hat / v`` is a
Brownian motion with drift ``theta`` in information time ``I = 1/v``, whatever the arm sizes. The
likelihood ratio of ``theta`` against ``theta0`` is ``exp((theta - theta0) S' - (theta - theta0)^2 I
/ 2)`` with ``S' = (theta_hat - theta0) / v``; mixing ``theta ~ N(theta0, tau2)`` and integrating
gives the closed form used here::

    Lambda(theta0) = sqrt(v / (v + tau2)) * exp( tau2 * (theta_hat - theta0)^2 / (2 v (v + tau2)) )

With equal arms ``n_A = n_B = n`` and ``V = 2 sigma2`` this is exactly the paper's two-stream
normal mSPRT (the pairs ``W_i = Y_i - X_i ~ N(theta, 2 sigma2)`` fed to its one-stream normal
statistic): ``sqrt(V / (V + n tau2)) * exp(n^2 tau2 (theta_hat - theta0)^2 / (2 V (V + n tau2)))``.
The unequal-arm form above is my derivation from the same Gaussian mixture (the paper pairs the
samples; it does not state this form); it reduces to the paper's when the arms are equal, and it
is a nonnegative martingale under ``theta = theta0`` in the Gaussian model, so Ville's inequality
gives ``P(sup_k Lambda_k >= 1/alpha) <= alpha``. (No equation numbers are cited: the formulas
are re-derived here from the mixture, not transcribed from the paper.)

Approximations (binary data): the normal approximation above, and a plug-in ``v``, recomputed
at every look. Each null ``theta0`` gets the variance that null implies: the Bernoulli variance
``p_A (1 - p_A) / n_A + p_B (1 - p_B) / n_B`` at the maximum-likelihood rates constrained to
``p_B - p_A = theta0`` (Farrington & Manning, Statistics in Medicine 9, 1990, the closed-form root
of a cubic; Miettinen & Nurminen 1985 use the same constrained variance for their interval). For
the decision's null ``theta0 = 0`` that is the pooled Bernoulli variance ``p (1 - p) (1/n_A +
1/n_B)``, ``p`` the pooled success rate. The counts are smoothed by half a success and half a
failure per arm (one of each in all, Laplace's rule: ``p = (s_A + s_B + 1) / (n_A + n_B + 2)`` at
``theta0 = 0``) so the variance is never 0: all successes or all failures on both arms would
otherwise divide by zero; smoothed, such a look has ``theta_hat = 0`` and carries no evidence.
Why constrained rather than the unpooled ``X(1-X) + Y(1-Y)`` plug-in of the KDD 2017 companion
paper (Johari, Koomen, Pekelis & Walsh, "Peeking at A/B tests"): at an uneven split the small
arm's own variance estimate is noisy and tied to its rate, which in simulation (2000 runs, 10%
share, both arms at 5% success) pushed false rollbacks to 6.3%; pooling holds them at 0.6%. And
why not pooled for every ``theta0``: at an uneven split with a real gain, the pooled rate is
mostly the champion's, and the confidence sequence covered a 10 -> 20% gain at all looks in only
85% of runs; constrained, it covers it in 95% or more. Both approximations are checked by
simulation in ``tests/live_ab/test_stats.py``.

Always-valid p-value and confidence sequence
--------------------------------------------
``p_n = min(1, 1 / max_{k <= n} Lambda_k(0))`` (a running minimum over looks: Johari et al.'s
always-valid p-value, the smallest alpha at which the mSPRT would have rejected by look ``n``).
The confidence sequence inverts the same family of tests (Johari et al.'s always-valid confidence
interval): ``CI_n = {theta0 : p_n(theta0) > alpha}``, the running intersection over looks of
the per-look sets ``{theta0 : Lambda_k(theta0) < 1/alpha}``. Solving ``Lambda < 1/alpha`` for
the distance ``|theta_hat_k - theta0|`` gives the radius::

    r(v)^2 = 2 v (v + tau2) / tau2 * ( log(1/alpha) + log((v + tau2) / v) / 2 )

so a look's set is ``{theta0 : |theta_hat_k - theta0| < r(v_k(theta0))}``; because ``v`` depends
on ``theta0`` (above), each end is found by bisection (32 halvings of ``[theta_hat - r_max,
theta_hat]`` and ``[theta_hat, theta_hat + r_max]``, ``r_max = r((1/n_A + 1/n_B) / 4)`` the
radius at the largest possible Bernoulli variance, clipped to ``[-1, 1]`` where a difference of
two rates lives). ``p_n <= alpha`` exactly when 0 is outside ``CI_n``.

Decision
--------
Looks count only once both arms hold ``min_samples_per_arm`` outcomes. At the first look where

- ``theta_hat > margin`` and ``Lambda(margin) >= 1/alpha`` (the confidence sequence lies above
  ``margin``; with the default margin 0 this is "p <= alpha and theta_hat > 0"): **promote**;
- ``theta_hat < 0`` and ``Lambda(0) >= 1/alpha`` ("p <= alpha and theta_hat < 0"; the confidence
  sequence lies below 0): **rollback**;
- otherwise **continue**, until both arms hold ``max_samples_per_arm`` outcomes (the smaller arm
  reaches the cap: at a 10% share that is the challenger's, the champion then having about nine
  times as many): **inconclusive**; the test ends, the challenger is withdrawn and the champion
  kept (``sensors/ab_monitor.py`` maps it to a rollback of the challenger).

The decision is the first one taken: outcomes after it (or after the cap) are ignored, as they
would be live, where the sensor acts on the first report that decides.

Alpha is split between the two directions by symmetry rather than by two separate tests: the
mixture is symmetric about 0, so under ``theta = 0`` the crossing of ``1/alpha`` happens with
``theta_hat > 0`` or ``theta_hat < 0`` with equal probability, at most ``alpha / 2`` each, and
for ``theta < 0`` the promote region ``{S_k >= b(I_k)}`` is crossed less often still (shifting
the Brownian path down can only delay an upward crossing), so ``P(promote | theta <= 0) <=
alpha / 2`` and ``P(rollback | theta >= 0) <= alpha / 2``: total ``alpha`` (default 0.05) for any
wrong decision when there is no difference (the same argument at ``theta0 = margin`` bounds
``P(promote | theta <= margin)`` by ``alpha / 2``). These are the Gaussian model's guarantees; for
Bernoulli outcomes they hold approximately, and the simulations below measure them.

Choice of ``tau2``
------------------
Johari et al. match the mixing distribution to the effects one expects to see (in their
deployment, to the distribution of effects in past experiments). Here the effect of interest is
a point value ``delta`` (10 points). For a look with variance ``v`` the boundary ``r`` above is
smallest when ``x = tau2 / v`` solves ``x = 2 log(1/alpha) + log(1 + x)``, and then ``r^2 = v (1
+ x)``; an estimate equal to ``delta`` therefore crosses soonest (at the largest ``v``, i.e. the
fewest samples) with ``tau2 = delta^2 x / (1 + x)``. At alpha = 0.05: ``x = 8.21`` and ``tau2 =
0.891 delta^2 = 0.00891`` for ``delta = 0.10`` (``tau = 9.4`` points), independent of the base rate
and of the traffic split (:func:`tau2_for_effect`).

Which looks: pairing the two arms' prefixes
-------------------------------------------
The statistic is evaluated at a sequence of looks ``(n_A, n_B)``, nondecreasing in both. With
``checkpoints`` (the cumulative counts at each batch boundary, as a live monitor sees them) those
are the looks. Without, the two arrays (each in arrival order, their interleaving unknown) are
merged proportionally, as a constant traffic split would interleave them: the ``i``-th champion
outcome sits at ``i / n_A`` and the ``j``-th challenger outcome at ``j / n_B`` of the way through,
and every prefix of that merged stream is a look. The path depends on the counts only, not on
the outcomes, so within one call the guarantee holds as for any fixed path; but calls on a growing
stream rebuild it from slightly different proportions each time, so the looks of successive calls
do not all lie on one path, which costs a little (measured below). Pass ``checkpoints`` where the
batch boundaries are known.

Measured
--------
Seeded simulations (:func:`simulate`: Bernoulli arrivals, a look after every batch of 50, default
config, 2000 runs per case):

- samples to a decision on a true +-10-point difference: see :data:`EXPECTED_MAX_SAMPLES_10PT`
  (even split) and :data:`EXPECTED_MAX_SAMPLES_10PT_SHARE_10` (10% share); all 16 000 such runs
  decided, every one in the right direction.
- no difference, monitored after every batch up to the 5000 cap: wrong decisions (promote or
  rollback) in 2.2% of runs at 50% success, 2.7% at 20%, 1.1% at 5% (even split); 3.4%, 4.2%,
  3.1% at a 10% share. Per direction the even split stays under alpha / 2; at a 10% share and low
  rates false promotions reach 2.8% (the small arm's right-skewed rate, which the normal
  approximation ignores) against 1.4% false rollbacks.
- a fixed-alpha z-test (``|z| >= 1.96``) on the same runs, checked as often: 42% wrong at 50%
  success and 43% at 20% (even split), 48% and 49% at a 10% share.
- the confidence sequence, run to the cap without stopping, held the true difference at every
  look in 96.0-98.5% of runs with no difference and 96.3-98.0% with +-10 points (including 10 ->
  20% at a 10% share, where a pooled variance for every ``theta0`` gave 85%).
- looks without ``checkpoints`` (cap 1000, no difference, 50% success, even split, batches of 40;
  2000 runs): wrong decisions 1.5% with the batch boundaries as looks, 2.3% for one call
  on the whole stream (every merged prefix a look), 2.9% calling after every batch as the live
  monitor does; at a 10% share and 20% success (batches of 100, 1000 runs) 2.3%, 3.1%, 3.5%.
  At the default 5000 cap, 10% share, 20% success (400 runs, batches of 1000 arrivals): 1.5%,
  4.8%, 5.0%: a look at every merged prefix is continuous monitoring in earnest, and the early
  looks on a small, skewed challenger arm are where the normal approximation is weakest. Hence:
  pass ``checkpoints`` (the real batch boundaries) where the caller knows them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import numpy as np

Decision = Literal["promote", "rollback", "continue", "inconclusive"]


def tau2_for_effect(effect: float, alpha: float = 0.05) -> float:
    """The mixing variance ``tau2`` under which a gain estimated at exactly ``effect`` crosses the
    mSPRT boundary at the fewest samples (module docstring, "Choice of tau2").

    Args:
        effect: the effect size of interest, a fraction (0.10 = 10 points), nonzero and finite.
        alpha: the test's level, in (0, 1).

    Returns:
        ``effect^2 * x / (1 + x)`` where ``x`` solves ``x = 2 log(1/alpha) + log(1 + x)``
        (fixed-point iteration; the map is a contraction, its slope ``1/(1+x)`` being below 1).

    Raises:
        ValueError: ``effect`` zero or not finite, or ``alpha`` outside (0, 1).
    """
    if not math.isfinite(effect) or effect == 0:
        raise ValueError(f"effect must be a nonzero finite fraction, got {effect!r}")
    if not 0 < alpha < 1:
        raise ValueError(f"alpha must be in (0, 1), got {alpha!r}")
    x = 2 * math.log(1 / alpha)
    for _ in range(100):
        x_next = 2 * math.log(1 / alpha) + math.log1p(x)
        if abs(x_next - x) < 1e-12:
            break
        x = x_next
    return effect * effect * x / (1 + x)


TAU2_10PT = tau2_for_effect(0.10, 0.05)
"""Default mixing variance: tuned to a 10-point effect at alpha = 0.05 (about 0.00891)."""

EXPECTED_MAX_SAMPLES_10PT = 1500
"""Outcomes per arm (the larger arm) within which a true 10-point gain or loss is decided, even
split, default :class:`ABConfig`, a look every 50 arrivals. Measured (2000 seeded runs per case,
``simulate``): 50% -> 60% promoted in 100% of runs, per arm at the decision median 421, p95 1007,
p99 1329; 60% -> 50% rolled back: median 416, p95 1017, p99 1415; 20% -> 30%: median 328, p95
767, p99 986; 30% -> 20%: median 329, p95 797, p99 1042. Rates near 50% are the slowest (the
largest Bernoulli variance); there 99.5% (50 -> 60%) and 99.4% (60 -> 50%) of runs decided
within the bound, so it holds, with margin, for 95% of experiments at any base rate.
The prediction from the boundary alone (an estimate exactly at 10 points crosses when ``v =
0.01 / 9.21``) is 456 per arm at 50% -> 60%, close to the median."""

EXPECTED_MAX_SAMPLES_10PT_SHARE_10 = 800
"""Challenger outcomes within which a true 10-point gain or loss is decided at the live 10% share
(the champion then has about nine times as many), default :class:`ABConfig`, a look every 50
arrivals. Measured (2000 seeded runs per case): 50% -> 60%: challenger median 225, p95 547, p99 738
(champion median 2016, p95 4951); 60% -> 50%: 204 / 553 / 752 (champion 1847 / 4982); 20% -> 30%:
146 / 402 / 559; 30% -> 20%: 187 / 455 / 609; within the bound: 99.4% (50 -> 60%) and 99.3%
(60 -> 50%) of runs. An uneven split needs fewer challenger outcomes
(``v = sigma2 / (n_B (1 - share))``, 0.56 times the even split's per arm) but 2.8 times the
total traffic."""


@dataclass(frozen=True)
class ABConfig:
    """Settings of the live A/B decision (module docstring for the method).

    Attributes:
        alpha: total error rate of a wrong decision (promote or rollback) when the arms do not
            differ, split alpha/2 per direction; in (0, 1). Also sets the confidence sequence's
            level, ``1 - alpha``.
        tau2: variance of the normal mixing distribution, in squared fractions (0.01 = a
            10-point standard deviation); > 0. Default :data:`TAU2_10PT`.
        min_samples_per_arm: no look counts before both arms hold this many outcomes; >= 1.
        max_samples_per_arm: once both arms hold this many (the smaller arm reaches it) the test
            ends ``inconclusive``; >= ``min_samples_per_arm``.
        margin: promote only when the confidence sequence lies above this gain (a fraction, 0.02 =
            2 points; a practical minimum effect); in [0, 1). Rollback is unaffected (it needs
            the challenger worse than the champion).

    Raises:
        ValueError: any attribute outside its range.
    """

    alpha: float = 0.05
    tau2: float = TAU2_10PT
    min_samples_per_arm: int = 20
    max_samples_per_arm: int = 5000
    margin: float = 0.0

    def __post_init__(self) -> None:
        if not (isinstance(self.alpha, (int, float)) and 0 < self.alpha < 1):
            raise ValueError(f"alpha must be in (0, 1), got {self.alpha!r}")
        if not (isinstance(self.tau2, (int, float)) and math.isfinite(self.tau2) and self.tau2 > 0):
            raise ValueError(f"tau2 must be a positive finite number, got {self.tau2!r}")
        for name in ("min_samples_per_arm", "max_samples_per_arm"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if self.max_samples_per_arm < self.min_samples_per_arm:
            raise ValueError(
                f"max_samples_per_arm ({self.max_samples_per_arm}) must be >= min_samples_per_arm ({self.min_samples_per_arm})"
            )
        if not (isinstance(self.margin, (int, float)) and 0 <= self.margin < 1):
            raise ValueError(f"margin must be in [0, 1), got {self.margin!r}")


def mixture_log_lr(diff, var, tau2: float, theta0: float = 0.0) -> np.ndarray:
    """``log Lambda``: the normal-mixture likelihood ratio of the gain against ``theta0``.

    ``log Lambda = log(v / (v + tau2)) / 2 + tau2 (diff - theta0)^2 / (2 v (v + tau2))``, the
    closed form of ``integral N(diff; theta, v) / N(diff; theta0, v) dN(theta; theta0, tau2)``
    (module docstring; the paper's two-stream normal mSPRT when the arms are equal).

    Args:
        diff: estimated gains ``mean_B - mean_A``, fractions, shape ``[k]`` (or scalar).
        var: their plug-in variances ``v`` under the null ``theta0`` (:func:`constrained_variance`),
            shape ``[k]``, all > 0.
        tau2: mixing variance, > 0.
        theta0: the null gain, a fraction.

    Returns:
        ``[k]`` float array of ``log Lambda``.

    Raises:
        ValueError: a variance not > 0, or ``tau2`` not > 0.
    """
    diff, var = np.asarray(diff, dtype=float), np.asarray(var, dtype=float)
    if np.any(~(var > 0)) or not tau2 > 0:
        raise ValueError("variances and tau2 must be > 0")
    return 0.5 * np.log(var / (var + tau2)) + tau2 * (diff - theta0) ** 2 / (2 * var * (var + tau2))


def confidence_radius(var, tau2: float, alpha: float) -> np.ndarray:
    """Half-width ``r`` of the mSPRT's confidence set at one look: ``{theta0 : |diff - theta0| <
    r}`` is where ``Lambda(theta0) < 1/alpha`` (Johari et al.'s confidence sequence, inverting the
    test).

    ``r^2 = 2 v (v + tau2) / tau2 * (log(1/alpha) + log((v + tau2) / v) / 2)``.

    Args:
        var: variances ``v`` of the gain estimate, shape ``[k]``, all > 0.
        tau2: mixing variance, > 0.
        alpha: level, in (0, 1).

    Returns:
        ``[k]`` float array of radii, fractions.

    Raises:
        ValueError: a variance not > 0, ``tau2`` not > 0 or ``alpha`` outside (0, 1).
    """
    var = np.asarray(var, dtype=float)
    if np.any(~(var > 0)) or not tau2 > 0:
        raise ValueError("variances and tau2 must be > 0")
    if not 0 < alpha < 1:
        raise ValueError(f"alpha must be in (0, 1), got {alpha!r}")
    return _radius(var, tau2, math.log(1 / alpha))


def constrained_variance(n_champion, success_champion, n_challenger, success_challenger, theta0=0.0) -> np.ndarray:
    """Plug-in variance of the gain estimate under the null ``p_B - p_A = theta0``.

    ``v = p_A (1 - p_A) / n_A + p_B (1 - p_B) / n_B`` at the rates maximising the binomial
    likelihood subject to ``p_B - p_A = theta0`` (Farrington & Manning 1990's closed-form root of
    the score's cubic), on counts smoothed by half a success and half a failure per arm so that
    ``v > 0`` always. At ``theta0 = 0`` it is the pooled ``p (1 - p) (1/n_A + 1/n_B)`` with ``p =
    (s_A + s_B + 1) / (n_A + n_B + 2)``.

    Args:
        n_champion, success_champion, n_challenger, success_challenger: counts, shape ``[k]`` (or
            scalars, broadcast), ``n >= 1`` and ``0 <= s <= n``.
        theta0: null gain(s) in (-1, 1), a fraction, scalar or ``[k]``.

    Returns:
        ``[k]`` float array of variances (fractions squared), all > 0.

    Raises:
        ValueError: a count < 1, successes outside ``[0, n]``, or ``|theta0| >= 1``.
    """
    na, sa = np.asarray(n_champion, dtype=float), np.asarray(success_champion, dtype=float)
    nb, sb = np.asarray(n_challenger, dtype=float), np.asarray(success_challenger, dtype=float)
    d = np.asarray(theta0, dtype=float)
    if np.any(~(na >= 1)) or np.any(~(nb >= 1)) or np.any((sa < 0) | (sa > na)) or np.any((sb < 0) | (sb > nb)):
        raise ValueError("counts must have n >= 1 and 0 <= successes <= n")
    if np.any(~(np.abs(d) < 1)):
        raise ValueError("theta0 must lie in (-1, 1)")
    return _constrained_variance(*_smoothed(na, sa, nb, sb), d)


def _smoothed(na, sa, nb, sb) -> tuple[np.ndarray, ...]:
    """The theta0-free parts of Farrington & Manning's cubic: ``(p1, p2, ratio, n_A, n_B)``, with
    arm 1 = challenger, arm 2 = champion, counts smoothed by half a success and half a failure."""
    na, nb = np.asarray(na, dtype=float), np.asarray(nb, dtype=float)
    return (np.asarray(sb, dtype=float) + 0.5) / (nb + 1.0), (np.asarray(sa, dtype=float) + 0.5) / (na + 1.0), (na + 1.0) / (nb + 1.0), na, nb


def _constrained_variance(p1, p2, ratio, na, nb, d) -> np.ndarray:
    """:func:`constrained_variance` on :func:`_smoothed` parts, unchecked (the bisection's inner loop).

    The constrained MLE solves the score equation, a cubic in ``p1`` whose root in the feasible
    range is given in trigonometric form (Farrington & Manning 1990, with ``d = p1 - p2``)."""
    a = 1.0 + ratio
    b = -(1.0 + ratio + p1 + ratio * p2 + d * (ratio + 2.0))
    c = d * d + d * (2.0 * p1 + ratio + 1.0) + p1 + ratio * p2
    e = -p1 * d * (1.0 + d)
    a3 = 3.0 * a
    v = (b / a3) ** 3 - b * c / (6.0 * a * a) + e / (2.0 * a)
    # sign(0) would be 0 and turn the root into NaN; either sign gives the same root when v == 0
    u = np.where(v < 0, -1.0, 1.0) * np.sqrt(np.maximum((b / a3) ** 2 - c / a3, 0.0))
    with np.errstate(divide="ignore", invalid="ignore"):
        w = (math.pi + np.arccos(np.clip(v / (u * u * u), -1.0, 1.0))) / 3.0
    q1 = np.clip(2.0 * u * np.cos(w) - b / a3, 0.0, 1.0)
    q2 = np.clip(q1 - d, 0.0, 1.0)
    # rates pinned at 0 or 1 by |theta0| near 1 give v near 0: a null the data reject outright
    return np.maximum(q1 * (1.0 - q1) / nb + q2 * (1.0 - q2) / na, 1e-300)


def _radius(var, tau2: float, log_inv_alpha: float) -> np.ndarray:
    """:func:`confidence_radius`, unchecked."""
    return np.sqrt(2.0 * var * (var + tau2) / tau2 * (log_inv_alpha + 0.5 * np.log1p(tau2 / var)))


def _confidence_ends(diff, na, sa, nb, sb, tau2: float, alpha: float, iterations: int = 32) -> tuple[np.ndarray, np.ndarray]:
    """Per-look ``{theta0 : |diff - theta0| < r(v(theta0))}`` as ``(low [k], high [k])``, by
    bisection on both sides of ``diff`` (module docstring); each end to within ``2^-iterations``
    of the bracket, under 1e-9 here."""
    log_inv_alpha = math.log(1 / alpha)
    # r grows with v and v <= (1/n_A + 1/n_B) / 4, so every theta0 farther than r_max is rejected
    r_max = _radius(0.25 * (1.0 / na + 1.0 / nb), tau2, log_inv_alpha)
    centre = np.concatenate([diff, diff])
    reject = np.concatenate([np.maximum(diff - r_max, -1.0), np.minimum(diff + r_max, 1.0)])
    accept = centre.copy()
    parts = _smoothed(*(np.concatenate([x, x]) for x in (na, sa, nb, sb)))
    for _ in range(iterations):
        mid = 0.5 * (reject + accept)
        rejected = np.abs(centre - mid) >= _radius(_constrained_variance(*parts, mid), tau2, log_inv_alpha)
        reject = np.where(rejected, mid, reject)
        accept = np.where(rejected, accept, mid)
    return reject[: len(diff)], reject[len(diff) :]


def _outcomes(x, name: str) -> np.ndarray:
    """``x`` as an ``[n]`` int64 array of 0/1, or ValueError naming the first bad index."""
    a = np.asarray(x)
    if a.ndim != 1:
        raise ValueError(f"{name} must be a 1-D array of 0/1 outcomes, got shape {a.shape}")
    if a.dtype.kind not in "biufO":
        raise ValueError(f"{name} must hold numbers 0/1, got dtype {a.dtype}")
    if a.dtype.kind == "b":
        return a.astype(np.int64)
    # NaN and None compare unequal to both, so they are caught here too
    ok = np.array([v == 0 or v == 1 for v in a], dtype=bool) if a.dtype.kind == "O" else (a == 0) | (a == 1)
    if not ok.all():
        i = int(np.flatnonzero(~ok)[0])
        value = a[i].item() if isinstance(a[i], np.generic) else a[i]
        raise ValueError(f"{name}[{i}] = {value!r} is not a 0/1 outcome")
    return a.astype(np.int64)


def _looks(n_a: int, n_b: int, checkpoints) -> tuple[np.ndarray, np.ndarray]:
    """The looks ``(n_A[k], n_B[k])``, ``[k]`` int64 each, nondecreasing, ending at ``(n_a, n_b)``."""
    if checkpoints is None:
        if n_a == 0 or n_b == 0:
            return np.array([n_a], dtype=np.int64), np.array([n_b], dtype=np.int64)
        # proportional merge on integer keys (i/n_a vs j/n_b scaled by n_a*n_b): exact, no float ties
        keys = np.concatenate([np.arange(1, n_a + 1, dtype=np.int64) * n_b, np.arange(1, n_b + 1, dtype=np.int64) * n_a])
        is_b = np.concatenate([np.zeros(n_a, dtype=np.int64), np.ones(n_b, dtype=np.int64)])
        cb = np.cumsum(is_b[np.argsort(keys, kind="stable")])
        return np.arange(1, n_a + n_b + 1, dtype=np.int64) - cb, cb
    c = np.asarray(checkpoints)
    if c.size == 0:
        c = np.zeros((0, 2), dtype=np.int64)
    if c.ndim != 2 or c.shape[1] != 2:
        raise ValueError(f"checkpoints must have shape [k, 2] (n_champion, n_challenger), got {c.shape}")
    if c.dtype.kind not in "iu" and not (c.dtype.kind == "f" and np.all(c == np.round(c))):
        raise ValueError("checkpoints must hold integer counts")
    c = c.astype(np.int64)
    if np.any(c < 0) or np.any(c[:, 0] > n_a) or np.any(c[:, 1] > n_b):
        raise ValueError(f"checkpoints must lie within (0, 0) .. ({n_a}, {n_b})")
    if np.any(np.diff(c, axis=0) < 0):
        i = int(np.flatnonzero(np.any(np.diff(c, axis=0) < 0, axis=1))[0]) + 1
        raise ValueError(f"checkpoints must be nondecreasing in both columns; row {i} goes back")
    if len(c) == 0 or c[-1, 0] != n_a or c[-1, 1] != n_b:
        c = np.vstack([c, [[n_a, n_b]]])
    return c[:, 0].copy(), c[:, 1].copy()


@dataclass(frozen=True)
class ABPath:
    """The test at every look, ``[k]`` arrays (``k`` looks, in order; the path ends at the
    ``max_samples_per_arm`` cap if the data go past it).

    Attributes:
        n_champion, n_challenger: outcomes seen per arm at each look (int64).
        success_champion, success_challenger: successes per arm at each look (int64).
        diff: ``mean_B - mean_A``, fractions (NaN while an arm is empty).
        var: plug-in variance ``v`` of ``diff`` under "no difference" (the smoothed pooled
            variance, :func:`constrained_variance` at 0; NaN while an arm is empty).
        active: the look counts (both arms hold ``min_samples_per_arm``; bool).
        log_lambda: ``log Lambda_k(0)`` at each look (NaN where not active).
        p_value: always-valid p-value, running minimum over active looks (1 before any).
        ci_low, ci_high: always-valid ``1 - alpha`` confidence sequence for the gain, fractions:
            running intersection over active looks (each end to within 1e-9), within ``[-1,
            1]``; ``(-1, 1)`` before the first active look.
        promote_at, rollback_at: index of the first look that decides so, or -1.
        capped: the last look reached the cap (both arms at ``max_samples_per_arm``).
    """

    n_champion: np.ndarray
    n_challenger: np.ndarray
    success_champion: np.ndarray
    success_challenger: np.ndarray
    diff: np.ndarray
    var: np.ndarray
    active: np.ndarray
    log_lambda: np.ndarray
    p_value: np.ndarray
    ci_low: np.ndarray
    ci_high: np.ndarray
    promote_at: int
    rollback_at: int
    capped: bool


def sequential_path(champion, challenger, config: ABConfig | None = None, checkpoints=None, *, stop_at_decision: bool = False) -> ABPath:
    """The mSPRT statistic, always-valid p-value and confidence sequence at every look.

    Args:
        champion: ``[n_A]`` outcomes of the champion (A) in arrival order, 0/1 (1 = success); any
            numeric or bool dtype.
        challenger: ``[n_B]`` outcomes of the challenger (B) in arrival order.
        config: :class:`ABConfig` (defaults if None).
        checkpoints: optional ``[k, 2]`` cumulative ``(n_champion, n_challenger)`` counts at each
            look (batch boundaries), nondecreasing in both columns, within the data; the full data
            ``(n_A, n_B)`` is appended as the last look if missing. None: every prefix of the
            proportional merge of the two streams (module docstring, "Which looks").
        stop_at_decision: end the path at the first look that decides (as the live test stops);
            otherwise it runs on (to see, say, whether the confidence sequence ever misses).

    Returns:
        :class:`ABPath`, ending at the first look where both arms reach
        ``config.max_samples_per_arm``, or earlier at the decision with ``stop_at_decision``.

    Raises:
        ValueError: an outcome not 0/1 (naming the array and index), arrays not 1-D, or bad
            ``checkpoints``.
    """
    config = config or ABConfig()
    a, b = _outcomes(champion, "champion"), _outcomes(challenger, "challenger")
    na, nb = _looks(len(a), len(b), checkpoints)
    capped_at = np.flatnonzero(np.minimum(na, nb) >= config.max_samples_per_arm)
    if len(capped_at):
        na, nb = na[: capped_at[0] + 1], nb[: capped_at[0] + 1]
    sa = np.concatenate([[0], np.cumsum(a)])[na]
    sb = np.concatenate([[0], np.cumsum(b)])[nb]
    k = len(na)
    active = (na >= config.min_samples_per_arm) & (nb >= config.min_samples_per_arm)
    diff, var, log_lambda = np.full(k, np.nan), np.full(k, np.nan), np.full(k, np.nan)
    seen = (na > 0) & (nb > 0)
    diff[seen] = sb[seen] / nb[seen] - sa[seen] / na[seen]
    var[seen] = constrained_variance(na[seen], sa[seen], nb[seen], sb[seen], 0.0)
    log_lambda[active] = mixture_log_lr(diff[active], var[active], config.tau2)
    threshold = math.log(1 / config.alpha)
    promote_hit = active & (diff > config.margin)
    if config.margin > 0:
        on = np.flatnonzero(promote_hit)
        v_margin = constrained_variance(na[on], sa[on], nb[on], sb[on], config.margin)
        promote_hit[on] = mixture_log_lr(diff[on], v_margin, config.tau2, config.margin) >= threshold
    else:
        promote_hit &= log_lambda >= threshold
    rollback_hit = active & (diff < 0) & (log_lambda >= threshold)
    promote, rollback = np.flatnonzero(promote_hit), np.flatnonzero(rollback_hit)
    promote_at = int(promote[0]) if len(promote) else -1
    rollback_at = int(rollback[0]) if len(rollback) else -1
    hits = [i for i in (promote_at, rollback_at) if i >= 0]
    capped = bool(len(capped_at))
    if stop_at_decision and hits:
        k, capped = min(hits) + 1, False
        na, nb, sa, sb, diff, var, log_lambda, active = (x[:k] for x in (na, nb, sa, sb, diff, var, log_lambda, active))
    low, high = np.full(k, -1.0), np.full(k, 1.0)
    on = np.flatnonzero(active)
    if len(on):
        low[on], high[on] = _confidence_ends(diff[on], na[on], sa[on], nb[on], sb[on], config.tau2, config.alpha)
    best = np.maximum.accumulate(np.where(active, log_lambda, -np.inf))
    p_value = np.minimum(1.0, np.exp(-best))
    ci_low = np.maximum.accumulate(low)
    ci_high = np.minimum.accumulate(high)
    return ABPath(
        n_champion=na,
        n_challenger=nb,
        success_champion=sa,
        success_challenger=sb,
        diff=diff,
        var=var,
        active=active,
        log_lambda=log_lambda,
        p_value=p_value,
        ci_low=ci_low,
        ci_high=ci_high,
        promote_at=promote_at,
        rollback_at=rollback_at,
        capped=capped,
    )


@dataclass(frozen=True)
class ABDecision:
    """The live A/B decision and the numbers behind it, as of the look that decided (or the cap,
    or the last look while the test continues).

    Attributes:
        decision: ``"promote"`` (challenger better, by more than ``margin``), ``"rollback"``
            (challenger worse), ``"continue"`` (undecided, keep collecting), ``"inconclusive"``
            (undecided at the sample cap: the challenger is withdrawn and the champion kept).
        n_champion, n_challenger: outcomes per arm at that look.
        success_champion, success_challenger: successes per arm at that look.
        diff: ``mean_B - mean_A`` at that look, a fraction (NaN if an arm is empty).
        diff_interval: always-valid ``1 - alpha`` confidence sequence for the gain, ``(low, high)``
            fractions within ``[-1, 1]`` (``(-1, 1)`` before ``min_samples_per_arm``).
        p_value: always-valid p-value for "no difference" (running minimum; 1 before any look).
        statistic: ``log Lambda(0)`` at that look (NaN before ``min_samples_per_arm``).
        reason: one human sentence, gains in points (percentage points).
    """

    decision: Decision
    n_champion: int
    n_challenger: int
    success_champion: int
    success_challenger: int
    diff: float
    diff_interval: tuple[float, float]
    p_value: float
    statistic: float
    reason: str


def _points(x: float) -> str:
    # a first crossing has its CI end just past 0; "+0.0" would read as touching it
    return f"{100 * x:+.1f}" if abs(100 * x) >= 0.05 or x == 0 else f"{100 * x:+.2g}"


def ab_decision(champion, challenger, config: ABConfig | None = None, checkpoints=None) -> ABDecision:
    """Promote, roll back, continue or give up on the challenger, by the always-valid mSPRT.

    Meant to be called after every batch on all outcomes so far: the error guarantee (module
    docstring) holds however often it is called, up to the normal approximation; each call
    re-derives the whole history, so it needs no state between calls. With ``checkpoints`` the
    looks are the real batch boundaries; without, every prefix of the proportional merge is a
    look, which is stricter monitoring than any real one and costs some accuracy at small,
    uneven arms (module docstring, "Measured").

    Args:
        champion: ``[n_A]`` champion outcomes in arrival order, 0/1 (1 = success).
        challenger: ``[n_B]`` challenger outcomes in arrival order, 0/1.
        config: :class:`ABConfig` (defaults if None).
        checkpoints: optional ``[k, 2]`` cumulative ``(n_champion, n_challenger)`` at each look
            (see :func:`sequential_path`); None: every prefix of the proportional merge.

    Returns:
        :class:`ABDecision` at the first look that decides, else at the cap (inconclusive), else at
        the last look (continue).

    Raises:
        ValueError: an outcome not 0/1 (the message names the array and the index), arrays not
            1-D, or bad ``checkpoints``.
    """
    config = config or ABConfig()
    path = sequential_path(champion, challenger, config, checkpoints, stop_at_decision=True)
    hits = [i for i in (path.promote_at, path.rollback_at) if i >= 0]
    k = len(path.n_champion) - 1
    if hits:
        decision: Decision = "promote" if k == path.promote_at else "rollback"
    else:
        decision = "inconclusive" if path.capped else "continue"
    na, nb = int(path.n_champion[k]), int(path.n_challenger[k])
    diff, low, high, p = float(path.diff[k]), float(path.ci_low[k]), float(path.ci_high[k]), float(path.p_value[k])
    level = f"{100 * (1 - config.alpha):g}%"
    counts = f"{na} champion / {nb} challenger outcomes"
    if not path.active[k]:
        reason = f"waiting for {config.min_samples_per_arm} outcomes per arm ({counts}): continue"
    else:
        evidence = f"challenger {_points(diff)} points ({level} always-valid CI {_points(low)} to {_points(high)}), p = {p:.3g}"
        if decision == "promote":
            beyond = f", above the {_points(config.margin)}-point margin" if config.margin > 0 else ""
            reason = f"{evidence} <= {config.alpha:g}{beyond} after {counts}: promote"
        elif decision == "rollback":
            reason = f"{evidence} <= {config.alpha:g} after {counts}: roll back"
        elif decision == "inconclusive":
            reason = f"{evidence}, undecided at the cap of {config.max_samples_per_arm} per arm: inconclusive, challenger withdrawn, champion kept"
        elif p <= config.alpha:
            reason = f"{evidence} <= {config.alpha:g} but the CI is not above the {_points(config.margin)}-point margin after {counts}: continue"
        else:
            reason = f"{evidence} > {config.alpha:g} after {counts}: continue"
    return ABDecision(
        decision=decision,
        n_champion=na,
        n_challenger=nb,
        success_champion=int(path.success_champion[k]),
        success_challenger=int(path.success_challenger[k]),
        diff=diff,
        diff_interval=(low, high),
        p_value=p,
        statistic=float(path.log_lambda[k]),
        reason=reason,
    )


def simulate_stream(
    p_champion: float,
    p_challenger: float,
    rng: np.random.Generator,
    *,
    share: float = 0.5,
    max_samples_per_arm: int = 5000,
    batch_size: int = 50,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Simulated live traffic: each arrival goes to the challenger with probability ``share`` and
    succeeds with its arm's rate, until both arms hold ``max_samples_per_arm`` outcomes.

    Args:
        p_champion, p_challenger: true success rates, in [0, 1].
        rng: numpy ``Generator`` (seed it for reproducibility).
        share: the challenger's share of arrivals, in (0, 1).
        max_samples_per_arm: the stream stops at the arrival that brings the smaller arm to this.
        batch_size: arrivals (both arms together) per batch; a look after each batch, >= 1.

    Returns:
        ``(champion [n_A], challenger [n_B], checkpoints [k, 2])``: int8 outcomes in arrival
        order and the cumulative ``(n_champion, n_challenger)`` after each batch, the last one
        at the end of the stream.

    Raises:
        ValueError: a rate outside [0, 1], ``share`` outside (0, 1), or a count < 1.
    """
    for name, p in (("p_champion", p_champion), ("p_challenger", p_challenger)):
        if not 0 <= p <= 1:
            raise ValueError(f"{name} must be in [0, 1], got {p!r}")
    if not 0 < share < 1:
        raise ValueError(f"share must be in (0, 1), got {share!r}")
    if max_samples_per_arm < 1 or batch_size < 1:
        raise ValueError("max_samples_per_arm and batch_size must be >= 1")
    # enough arrivals for the smaller arm to reach the cap with overwhelming probability; extend if not
    total = int(max_samples_per_arm / min(share, 1 - share) * 1.1) + 200
    routed = rng.random(total) < share
    while min(routed.sum(), (~routed).sum()) < max_samples_per_arm:
        routed = np.concatenate([routed, rng.random(total) < share])
    cb = np.cumsum(routed)
    ca = np.arange(1, len(routed) + 1) - cb
    end = int(np.flatnonzero(np.minimum(ca, cb) >= max_samples_per_arm)[0]) + 1
    ends = np.unique(np.append(np.arange(batch_size, end, batch_size), end)) - 1
    checkpoints = np.stack([ca[ends], cb[ends]], axis=1)
    champion = (rng.random(int(ca[end - 1])) < p_champion).astype(np.int8)
    challenger = (rng.random(int(cb[end - 1])) < p_challenger).astype(np.int8)
    return champion, challenger, checkpoints


def simulate(
    p_champion: float,
    p_challenger: float,
    config: ABConfig | None,
    rng: np.random.Generator,
    *,
    share: float = 0.5,
    batch_size: int = 50,
) -> ABDecision:
    """One simulated live A/B test, checked after every batch until it decides or hits the cap.

    Args:
        p_champion, p_challenger: true success rates, in [0, 1].
        config: :class:`ABConfig` (defaults if None); its cap ends the stream.
        rng: numpy ``Generator``.
        share: the challenger's share of arrivals, in (0, 1) (live default elsewhere: 0.1).
        batch_size: arrivals per batch (both arms together); one look per batch.

    Returns:
        :class:`ABDecision` at the batch that decided (its ``n_champion`` / ``n_challenger`` are
        the samples used), or at the cap (``inconclusive``).

    Raises:
        ValueError: as :func:`simulate_stream`.
    """
    config = config or ABConfig()
    champion, challenger, checkpoints = simulate_stream(
        p_champion, p_challenger, rng, share=share, max_samples_per_arm=config.max_samples_per_arm, batch_size=batch_size
    )
    return ab_decision(champion, challenger, config, checkpoints)
