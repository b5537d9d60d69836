"""Statistics for the evaluation gate: intervals for one policy, paired tests for two.

- :func:`success_rate`: a binary success rate with the 95% Wilson score interval (Wilson 1927;
  Agresti & Coull 1998 recommend it over the Wald interval for small ``n`` and rates near 0 or 1).
- :func:`newcombe_interval`: a difference of two independent proportions with Newcombe's hybrid
  score interval (Newcombe 1998, method 10), built from the two Wilson intervals.
- :func:`mean_interval`: a mean with the 95% Student-t interval ``mean +- t_{0.975, n-1} * s / sqrt(n)``.
- :func:`mcnemar_exact`: McNemar's exact test for paired binary outcomes (candidate vs champion on the
  same tasks): a two-sided binomial test of the discordant pairs against ``p = 1/2``.
- :func:`paired_bootstrap`: percentile bootstrap of the mean paired difference (Efron & Tibshirani
  1993), with a seeded numpy ``Generator``; with ``clusters`` it resamples whole clusters (the
  turns of one trajectory stay together: Davison & Hinkley 1997, section 3.8, the cluster
  bootstrap), since the turns of one conversation are not independent.

Only the standard library and numpy are used (no scipy): the t quantile is found by bisection on
the exact Student-t CDF for integer degrees of freedom (Abramowitz & Stegun 1964, 26.7.3-26.7.4).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from fractions import Fraction
from typing import Sequence

import numpy as np

Z_95 = 1.959963984540054  # standard normal quantile at 0.975


@dataclass(frozen=True)
class SuccessRate:
    """A success rate and its 95% Wilson interval.

    Attributes:
        successes: number of successes ``k``.
        n: number of trials.
        rate: ``k / n``.
        ci_low, ci_high: Wilson score interval bounds, within ``[0, 1]``.
    """

    successes: int
    n: int
    rate: float
    ci_low: float
    ci_high: float


@dataclass(frozen=True)
class MeanInterval:
    """A sample mean and its 95% Student-t interval.

    Attributes:
        mean: sample mean.
        n: number of values.
        std: sample standard deviation (``ddof=1``; 0 for ``n == 1``).
        ci_low, ci_high: ``mean -+ t_{0.975, n-1} * std / sqrt(n)``; both equal ``mean`` when
            ``n == 1`` or ``std == 0`` (no spread to estimate).
    """

    mean: float
    n: int
    std: float
    ci_low: float
    ci_high: float


@dataclass(frozen=True)
class McNemarResult:
    """McNemar's exact test on paired binary outcomes.

    Attributes:
        candidate_only: ``b``, tasks the candidate solved and the champion did not.
        champion_only: ``c``, tasks the champion solved and the candidate did not.
        n_discordant: ``b + c``.
        p_value: two-sided exact p-value, ``min(1, 2 * P[X <= min(b, c)])`` with
            ``X ~ Binomial(b + c, 1/2)``; 1.0 when there are no discordant pairs.
    """

    candidate_only: int
    champion_only: int
    n_discordant: int
    p_value: float


@dataclass(frozen=True)
class PairedBootstrapResult:
    """Percentile bootstrap of ``mean(candidate - champion)`` over paired tasks.

    Attributes:
        mean_diff: observed mean difference.
        ci_low, ci_high: 2.5th and 97.5th percentiles of the resampled mean differences.
        prob_not_better: fraction of resamples with mean difference ``<= 0`` (a one-sided bootstrap
            p-value for "candidate better").
        n: number of pairs.
        n_resamples: bootstrap resamples drawn.
        seed: seed of the numpy ``Generator`` (same inputs + seed give the same numbers).
        n_clusters: clusters resampled (``n`` when each pair is its own cluster).
        p_value: two-sided bootstrap p-value of "no difference", ``min(1, 2 * min(P(d* <= 0),
            P(d* >= 0)))`` over the resampled mean differences ``d*`` (the percentile interval's
            test: it is below ``alpha`` exactly when the ``1 - alpha`` percentile interval
            excludes 0).
    """

    mean_diff: float
    ci_low: float
    ci_high: float
    prob_not_better: float
    n: int
    n_resamples: int
    seed: int
    n_clusters: int = 0
    p_value: float = 1.0


def wilson_interval(successes: int, n: int, z: float = Z_95) -> tuple[float, float]:
    """Wilson score interval for a binomial proportion (Wilson 1927, eq. from inverting the score test)::

        centre = (p + z^2 / (2n)) / (1 + z^2 / n)
        half   = z / (1 + z^2 / n) * sqrt(p (1 - p) / n + z^2 / (4 n^2))

    Raises:
        ValueError: if ``n <= 0`` or ``successes`` not in ``[0, n]``.
    """
    if n <= 0 or not 0 <= successes <= n:
        raise ValueError(f"need 0 <= successes <= n and n > 0, got {successes}/{n}")
    p = successes / n
    denom = 1.0 + z * z / n
    centre = (p + z * z / (2 * n)) / denom
    half = z / denom * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
    return max(0.0, centre - half), min(1.0, centre + half)


def newcombe_interval(successes_1: int, n_1: int, successes_2: int, n_2: int, z: float = Z_95) -> tuple[float, float]:
    """Hybrid score interval for ``p_1 - p_2``, two independent binomial proportions (Newcombe 1998,
    "Interval estimation for the difference between independent proportions", Stat. Med. 17, method 10).

    With ``p_i = successes_i / n_i`` and Wilson limits ``(l_i, u_i)`` at the same ``z``::

        low  = (p_1 - p_2) - sqrt((p_1 - l_1)^2 + (u_2 - p_2)^2)
        high = (p_1 - p_2) + sqrt((u_1 - p_1)^2 + (p_2 - l_2)^2)

    Unlike the Wald interval it stays inside ``[-1, 1]`` and keeps its coverage for small ``n`` and
    rates near 0 or 1. ``z`` sets the level (1.96: 95%; a larger one for a Bonferroni-corrected family).

    Raises:
        ValueError: if either ``n_i <= 0`` or ``successes_i`` is not in ``[0, n_i]``.
    """
    l_1, u_1 = wilson_interval(successes_1, n_1, z)  # raises on a bad count before any division
    l_2, u_2 = wilson_interval(successes_2, n_2, z)
    p_1, p_2 = successes_1 / n_1, successes_2 / n_2
    diff = p_1 - p_2
    return diff - math.sqrt((p_1 - l_1) ** 2 + (u_2 - p_2) ** 2), diff + math.sqrt((u_1 - p_1) ** 2 + (p_2 - l_2) ** 2)


def success_rate(outcomes: Sequence[bool | int | float]) -> SuccessRate:
    """Success rate of binary outcomes (truthy = success) with its 95% Wilson interval.

    Raises:
        ValueError: if ``outcomes`` is empty.
    """
    n = len(outcomes)
    if n == 0:
        raise ValueError("no outcomes")
    k = sum(1 for o in outcomes if o)
    low, high = wilson_interval(k, n)
    return SuccessRate(successes=k, n=n, rate=k / n, ci_low=low, ci_high=high)


def student_t_cdf(t: float, df: int) -> float:
    """CDF of Student's t with integer ``df >= 1`` (Abramowitz & Stegun 26.7.3 / 26.7.4, exact).

    With ``theta = atan(t / sqrt(df))``, ``A = P(|T| < |t|)`` is a finite series in ``cos(theta)``;
    the CDF is ``(1 + sign(t) A) / 2``.

    Raises:
        ValueError: if ``df < 1``.
    """
    if df < 1:
        raise ValueError(f"df must be >= 1, got {df}")
    theta = math.atan(abs(t) / math.sqrt(df))
    s, c = math.sin(theta), math.cos(theta)
    if df % 2 == 1:
        # A = 2/pi * (theta + sin * (cos + 2/3 cos^3 + ... + (2*4*..*(df-3))/(1*3*..*(df-2)) cos^(df-2)))
        total, term = 0.0, c
        if df > 1:
            total = term
            for k in range(3, df - 1, 2):  # term_k = term_{k-2} * (k-1)/k * cos^2
                term *= (k - 1) / k * c * c
                total += term
        a = 2.0 / math.pi * (theta + s * total)
    else:
        # A = sin * (1 + 1/2 cos^2 + (1*3)/(2*4) cos^4 + ... + (1*3*..*(df-3))/(2*4*..*(df-2)) cos^(df-2))
        total, term = 1.0, 1.0
        for k in range(2, df - 1, 2):  # term_k = term_{k-2} * (k-1)/k * cos^2
            term *= (k - 1) / k * c * c
            total += term
        a = s * total
    return 0.5 + math.copysign(0.5 * a, t)


def student_t_quantile(q: float, df: int) -> float:
    """Quantile of Student's t (inverse of :func:`student_t_cdf`) by bisection, to ~1e-12.

    Raises:
        ValueError: if ``q`` not in ``(0, 1)`` or ``df < 1``.
    """
    if not 0.0 < q < 1.0:
        raise ValueError(f"q must be in (0, 1), got {q}")
    if q < 0.5:
        return -student_t_quantile(1.0 - q, df)
    if df > 1000:
        # Cornish-Fisher expansion around the normal quantile (A&S 26.7.5); error < 1e-9 here
        z = _normal_quantile(q)
        return z + (z**3 + z) / (4 * df) + (5 * z**5 + 16 * z**3 + 3 * z) / (96 * df**2)
    low, high = 0.0, 1.0
    while student_t_cdf(high, df) < q:
        high *= 2.0
    for _ in range(200):
        mid = 0.5 * (low + high)
        if student_t_cdf(mid, df) < q:
            low = mid
        else:
            high = mid
        if high - low < 1e-12 * max(1.0, high):
            break
    return 0.5 * (low + high)


def _normal_quantile(q: float) -> float:
    from statistics import NormalDist

    return NormalDist().inv_cdf(q)


def mean_interval(values: Sequence[float]) -> MeanInterval:
    """Mean with the 95% Student-t interval (assumes roughly normal means; fine from ``n`` ~ 30 on).

    Raises:
        ValueError: if ``values`` is empty or contains a non-finite value.
    """
    x = np.asarray(values, dtype=float)
    if x.size == 0:
        raise ValueError("no values")
    if not np.all(np.isfinite(x)):
        raise ValueError("values must be finite")
    mean = float(x.mean())
    if x.size == 1:
        return MeanInterval(mean=mean, n=1, std=0.0, ci_low=mean, ci_high=mean)
    std = float(x.std(ddof=1))
    half = student_t_quantile(0.975, x.size - 1) * std / math.sqrt(x.size)
    return MeanInterval(mean=mean, n=int(x.size), std=std, ci_low=mean - half, ci_high=mean + half)


def mcnemar_exact(candidate: Sequence[bool | int], champion: Sequence[bool | int]) -> McNemarResult:
    """McNemar's exact test (McNemar 1947; exact binomial form) for paired binary outcomes.

    Under H0 (both policies succeed equally often), each discordant pair is candidate-only with
    probability 1/2, so ``b ~ Binomial(b + c, 1/2)``; the two-sided p-value doubles the smaller tail
    (computed with exact fractions, then capped at 1).

    Args:
        candidate: per task, did the candidate succeed.
        champion: per task (same order), did the champion succeed.

    Raises:
        ValueError: if the sequences differ in length.
    """
    if len(candidate) != len(champion):
        raise ValueError(f"paired outcomes differ in length: {len(candidate)} vs {len(champion)}")
    b = sum(1 for x, y in zip(candidate, champion) if x and not y)
    c = sum(1 for x, y in zip(candidate, champion) if y and not x)
    n = b + c
    if n == 0:
        return McNemarResult(candidate_only=b, champion_only=c, n_discordant=0, p_value=1.0)
    tail = sum(Fraction(math.comb(n, k), 2**n) for k in range(min(b, c) + 1))
    p = min(Fraction(1), 2 * tail)
    return McNemarResult(candidate_only=b, champion_only=c, n_discordant=n, p_value=float(p))


def paired_bootstrap(
    candidate: Sequence[float],
    champion: Sequence[float],
    n_resamples: int = 10_000,
    seed: int = 0,
    clusters: Sequence[object] | None = None,
) -> PairedBootstrapResult:
    """Percentile bootstrap of the mean paired difference ``candidate - champion``.

    Resamples the pairs with replacement (pairs stay together), ``n_resamples`` times. With
    ``clusters`` (one label per pair, e.g. the trajectory a turn belongs to), whole clusters are
    resampled instead and each resample's statistic is the mean over all the pairs it holds (a
    ratio estimator: a long trajectory weighs by its turns, as in the observed mean).

    Raises:
        ValueError: if the sequences differ in length, are empty, ``clusters`` has another length,
            or ``n_resamples < 1``.
    """
    x = np.asarray(candidate, dtype=float)
    y = np.asarray(champion, dtype=float)
    if x.shape != y.shape or x.ndim != 1 or x.size == 0:
        raise ValueError("candidate and champion must be non-empty 1-d sequences of equal length")
    if n_resamples < 1:
        raise ValueError("n_resamples must be >= 1")
    diff = x - y  # [n]
    rng = np.random.default_rng(seed)
    if clusters is None:
        idx = rng.integers(0, diff.size, size=(n_resamples, diff.size))  # [resamples, n]
        means = diff[idx].mean(axis=1)  # [resamples]
        n_clusters = int(diff.size)
    else:
        if len(clusters) != diff.size:
            raise ValueError(f"clusters has {len(clusters)} labels for {diff.size} pairs")
        _, label = np.unique(np.asarray([str(c) for c in clusters]), return_inverse=True)  # [n]
        n_clusters = int(label.max()) + 1
        sums = np.bincount(label, weights=diff, minlength=n_clusters)  # [clusters]
        sizes = np.bincount(label, minlength=n_clusters).astype(float)  # [clusters]
        picks = rng.integers(0, n_clusters, size=(n_resamples, n_clusters))  # [resamples, clusters]
        means = sums[picks].sum(axis=1) / sizes[picks].sum(axis=1)  # [resamples]
    low, high = np.percentile(means, [2.5, 97.5])
    not_better = float((means <= 0).mean())
    return PairedBootstrapResult(
        mean_diff=float(diff.mean()),
        ci_low=float(low),
        ci_high=float(high),
        prob_not_better=not_better,
        n=int(diff.size),
        n_resamples=n_resamples,
        seed=seed,
        n_clusters=n_clusters,
        p_value=min(1.0, 2.0 * min(not_better, float((means >= 0).mean()))),
    )
