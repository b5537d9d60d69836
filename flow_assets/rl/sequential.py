"""An A/B test of two adapters on live traffic that stays valid however often it is checked.

A fixed-sample test (a z-test at alpha = 0.05) checked after every batch and stopped at the first
"significant" result has a false-decision rate far above 5%: each look is another chance. The
mixture sequential probability ratio test (mSPRT) has no such problem: its p-value is *always
valid*, P(there is some n with p_n <= alpha | H0) <= alpha, so the monitor may look after every
batch and stop whenever it likes.

Source: Johari, Koomen, Pekelis & Walsh, "Always Valid Inference: Continuous Monitoring of A/B
Tests", Operations Research 70(3), 2022 (arXiv:1512.04922): the mSPRT of Section 3 (the
likelihood ratio of the data under theta, averaged over a mixing distribution H = N(0, tau^2),
against theta = 0; a nonnegative martingale under H0, so Ville's inequality bounds the chance it
ever reaches 1/alpha), with the normal, two-stream form of Section 4. Written with the estimate
of the difference and its variance, which covers unequal arms (the challenger gets 10% of
traffic):

    theta_hat = mean_B - mean_A,       V = sigma^2 (1/n_A + 1/n_B)
    Lambda    = sqrt(V / (V + tau^2)) * exp( tau^2 theta_hat^2 / (2 V (V + tau^2)) )

For n_A = n_B = n this is the paper's two-stream statistic with V = 2 sigma^2 / n. Choices and
approximations, stated:

- Outcomes are Bernoulli (1 = success); the statistic uses the normal approximation with the
  *pooled* plug-in variance sigma^2 = p(1 - p) (p over both arms, the H0 estimate), as
  practical deployments of the mSPRT do; validity is then asymptotic, which is why no decision
  is made before ``min_samples_per_arm`` per arm. The simulation tests measure the actual error.
- tau^2 = 0.01 (tau = 10 points): the paper recommends a mixing variance on the scale of the
  effects one expects; adapter changes worth acting on are a few to ~10 points of success.
- Two-sided: H0 is theta = 0; when the test rejects, the sign of theta_hat says promote (B
  better) or rollback (B worse). The total chance of any wrong decision under H0 is <= alpha.
- ``p_n = min(1, 1 / max_{k <= n} Lambda_k)`` over the looks made so far (paper, Sec. 3.2), and
  the always-valid confidence interval inverts the same statistic at theta_0 (Sec. 3.3):
  ``|theta_hat - theta_0| < sqrt(2 V (V + tau^2) / tau^2 * (log(1/alpha) + log((V + tau^2)/V) / 2))``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import numpy as np

Decision = Literal["promote", "rollback", "continue", "inconclusive"]

#: challenger samples within which a 10-point difference (50% vs 60% or 40% success) is decided
#: correctly in at least 95% of experiments, by the challenger's share of traffic, at the default
#: config and one look per 100 sessions. Measured over 200 seeded simulations each
#: (tests/test_sequential.py): at 50% share, median 469 (better) / 429 (worse), p95 998 / 1003,
#: max 1481 / 2101; at 10% share, median 234 / 225, p95 612 / 550 (the champion's side then has
#: ~9 times as many: median ~2000).
MAX_SAMPLES_10_POINTS = {0.5: 1500, 0.1: 1000}


@dataclass(frozen=True)
class SequentialConfig:
    """The live A/B test's settings.

    Attributes:
        alpha: the bound on the chance of any wrong decision when the adapters are equal.
        tau2: the mixing variance tau^2 (success-rate units squared; 0.01 = effects of ~10 points).
        min_samples_per_arm: labelled outcomes each adapter needs before any decision.
        max_samples_per_arm: once the *smaller* arm has this many, an undecided test ends
            ``inconclusive`` (the caller withdraws the challenger and keeps the champion).
    """

    alpha: float = 0.05
    tau2: float = 0.01
    min_samples_per_arm: int = 20
    max_samples_per_arm: int = 5000

    def __post_init__(self):
        if not 0.0 < self.alpha < 1.0:
            raise ValueError(f"alpha must be in (0, 1), got {self.alpha}")
        if not self.tau2 > 0.0:
            raise ValueError(f"tau2 must be > 0, got {self.tau2}")
        if not 1 <= self.min_samples_per_arm < self.max_samples_per_arm:
            raise ValueError(f"need 1 <= min_samples_per_arm < max_samples_per_arm, got {self.min_samples_per_arm}, {self.max_samples_per_arm}")


@dataclass(frozen=True)
class SequentialResult:
    """The test's state after the outcomes seen so far.

    Attributes:
        decision: ``promote`` / ``rollback`` (the test rejected theta = 0; the sign says which),
            ``continue`` (keep collecting), ``inconclusive`` (the sample cap was reached).
        n_champion / n_challenger: outcomes per arm; ``success_champion`` / ``success_challenger``
            their success rates (NaN for an empty arm).
        diff: challenger - champion success rate (points / 100).
        diff_interval: the always-valid (1 - alpha) interval of ``diff`` at this look.
        p_value: the always-valid p-value (running over every look).
        log_lambda: log of the mixture likelihood ratio at this look.
        decided_at: the index (into the input stream, 0-based) of the observation whose look
            decided, or ``None``; outcomes after it do not change a decision.
        reason: one sentence for the UI and the registry.
    """

    decision: Decision
    n_champion: int
    n_challenger: int
    success_champion: float
    success_challenger: float
    diff: float
    diff_interval: tuple[float, float]
    p_value: float
    log_lambda: float
    decided_at: int | None
    reason: str


def log_mixture_ratio(diff: np.ndarray, variance: np.ndarray, tau2: float) -> np.ndarray:
    """``log Lambda`` of the normal mSPRT (module docstring) for estimates ``diff`` with
    variances ``variance`` (same shape, any); a zero variance gives 0 (no evidence)."""
    v = np.asarray(variance, dtype=float)
    d = np.asarray(diff, dtype=float)
    safe = np.where(v > 0, v, 1.0)
    out = 0.5 * np.log(safe / (safe + tau2)) + tau2 * d * d / (2.0 * safe * (safe + tau2))
    return np.where(v > 0, out, 0.0)


def confidence_half_width(variance: float, tau2: float, alpha: float) -> float:
    """Half-width of the always-valid interval for the difference at variance ``variance``
    (module docstring); ``inf`` at zero variance."""
    if variance <= 0:
        return math.inf
    return math.sqrt(2.0 * variance * (variance + tau2) / tau2 * (math.log(1.0 / alpha) + 0.5 * math.log((variance + tau2) / variance)))


def _validate(name: str, values: np.ndarray) -> np.ndarray:
    a = np.asarray(values)
    if a.ndim != 1:
        raise ValueError(f"{name} must be one-dimensional, got shape {a.shape}")
    bad = np.flatnonzero((a != 0) & (a != 1))
    if bad.size:
        raise ValueError(f"{name}[{bad[0]}] = {a[bad[0]].item()!r}: outcomes and arms must be 0 or 1")
    return a.astype(np.int64)


def sequential_test(
    arms: np.ndarray, outcomes: np.ndarray, config: SequentialConfig | None = None, looks: np.ndarray | None = None
) -> SequentialResult:
    """Run the mSPRT over a stream of live outcomes.

    Args:
        arms: ``[n]`` 0 = served by the champion, 1 = by the challenger, in arrival order.
        outcomes: ``[n]`` 1 = success, 0 = failure, aligned with ``arms``.
        config: alpha, tau^2 and the sample floor and cap.
        looks: ``[k]`` the stream lengths at which the test was looked at (the monitor looks
            once per log batch: the number of outcomes seen at each report), increasing, each in
            ``1..n``; the last look is always at ``n``. ``None``: after every observation (the
            most looks, the hardest case for the error bound). The p-value's running maximum
            and the decision are over these looks only: a look nobody made cannot stop the test.

    Returns:
        The :class:`SequentialResult` at the first look that decided (its numbers as of that
        look), else at the last observation.

    Raises:
        ValueError: arrays of different lengths, not one-dimensional, or holding anything but 0/1
            (the message gives the first bad index).
    """
    config = config or SequentialConfig()
    arm = _validate("arms", arms)
    y = _validate("outcomes", outcomes)
    if arm.shape != y.shape:
        raise ValueError(f"arms and outcomes differ in length: {arm.size} vs {y.size}")
    n_b = np.cumsum(arm)
    n_a = np.arange(1, arm.size + 1) - n_b
    s_b = np.cumsum(y * arm)
    s_a = np.cumsum(y) - s_b
    with np.errstate(divide="ignore", invalid="ignore"):
        diff = np.where((n_a > 0) & (n_b > 0), s_b / np.maximum(n_b, 1) - s_a / np.maximum(n_a, 1), 0.0)
        pooled = (s_a + s_b) / np.maximum(n_a + n_b, 1)
        variance = np.where((n_a > 0) & (n_b > 0), pooled * (1 - pooled) * (1.0 / np.maximum(n_a, 1) + 1.0 / np.maximum(n_b, 1)), 0.0)
    look = np.ones(arm.size, dtype=bool)
    if looks is not None:
        index = np.asarray(looks, dtype=np.int64) - 1
        if index.size and (index.min() < 0 or index.max() >= arm.size or np.any(np.diff(index) <= 0)):
            raise ValueError(f"looks must be increasing stream lengths in 1..{arm.size}, got {list(looks)[:10]}")
        look[:] = False
        look[index] = True
        look[-1:] = True
    eligible = look & (n_a >= config.min_samples_per_arm) & (n_b >= config.min_samples_per_arm)
    log_lam = np.where(eligible, log_mixture_ratio(diff, variance, config.tau2), -np.inf)
    threshold = math.log(1.0 / config.alpha)
    crossed = np.flatnonzero(log_lam >= threshold)
    capped = np.flatnonzero(look & (np.minimum(n_a, n_b) >= config.max_samples_per_arm))
    stop = None
    decision: Decision = "continue"
    if crossed.size and (not capped.size or crossed[0] <= capped[0]):
        stop = int(crossed[0])
        decision = "promote" if diff[stop] > 0 else "rollback"
    elif capped.size:
        stop, decision = int(capped[0]), "inconclusive"
    at = stop if stop is not None else arm.size - 1
    if arm.size == 0:
        return SequentialResult("continue", 0, 0, math.nan, math.nan, 0.0, (-1.0, 1.0), 1.0, 0.0, None, "no live outcomes yet")
    running_max = float(np.max(log_lam[: at + 1]))
    p_value = 1.0 if running_max == -np.inf else min(1.0, math.exp(-running_max))
    na, nb = int(n_a[at]), int(n_b[at])
    rate_a = s_a[at] / na if na else math.nan
    rate_b = s_b[at] / nb if nb else math.nan
    half = confidence_half_width(float(variance[at]), config.tau2, config.alpha)
    interval = (max(-1.0, float(diff[at]) - half), min(1.0, float(diff[at]) + half))
    level = f"{1 - config.alpha:.0%}"
    numbers = (
        f"challenger {rate_b:.3f} (n={nb}) vs champion {rate_a:.3f} (n={na}): {100 * diff[at]:+.1f} points, "
        f"{level} always-valid interval {100 * interval[0]:+.1f} to {100 * interval[1]:+.1f}, p = {p_value:.3g}"
    )
    if decision in ("promote", "rollback"):
        reason = f"{numbers} < {config.alpha:g}: {decision}"
    elif decision == "inconclusive":
        reason = f"{numbers}; no decision within {config.max_samples_per_arm} per arm: withdraw the challenger, keep the champion"
    elif min(na, nb) < config.min_samples_per_arm:
        reason = f"{numbers}; collecting (at least {config.min_samples_per_arm} per adapter before any decision)"
    else:
        reason = f"{numbers} >= {config.alpha:g}: keep collecting"
    return SequentialResult(decision, na, nb, rate_a, rate_b, float(diff[at]), interval, p_value, float(log_lam[at]) if eligible[at] else 0.0, stop, reason)


def simulate(
    p_champion: float, p_challenger: float, config: SequentialConfig, rng: np.random.Generator, share: float = 0.5, batch_size: int | None = 100
) -> SequentialResult:
    """One simulated live A/B: sessions served by the challenger with probability ``share``,
    outcomes Bernoulli(p of the adapter that served them), the test looked at after every batch
    of ``batch_size`` sessions (what ``ab_monitor_sensor`` does; ``None``: after every session),
    until it decides or the smaller arm reaches the cap.

    Returns:
        The decision and the counts at the look that made it.

    Raises:
        ValueError: probabilities outside [0, 1] or share outside (0, 1).
    """
    if not (0 <= p_champion <= 1 and 0 <= p_challenger <= 1 and 0 < share < 1):
        raise ValueError(f"need probabilities in [0, 1] and share in (0, 1), got {p_champion}, {p_challenger}, {share}")
    n = int(math.ceil(config.max_samples_per_arm / min(share, 1 - share) * 1.3))  # the smaller arm reaches the cap
    arms = (rng.random(n) < share).astype(np.int64)
    outcomes = (rng.random(n) < np.where(arms == 1, p_challenger, p_champion)).astype(np.int64)
    looks = None if batch_size is None else np.arange(batch_size, n + 1, batch_size)
    return sequential_test(arms, outcomes, config, looks)
