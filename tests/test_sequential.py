"""The live A/B's sequential test (mSPRT): the formula by hand, its always-valid properties, and
the simulations that say how it decides (seeded)."""

import math

import numpy as np
import pytest

from flow_assets.rl.sequential import (
    MAX_SAMPLES_10_POINTS,
    SequentialConfig,
    confidence_half_width,
    log_mixture_ratio,
    sequential_test,
    simulate,
)

CONFIG = SequentialConfig()


def test_the_statistic_matches_a_hand_computation():
    # 30 of 50 challenger successes vs 20 of 50: diff 0.2, pooled p 0.5, V = 0.25 * (2 / 50) = 0.01
    v, tau2, d = 0.01, 0.01, 0.2
    by_hand = 0.5 * math.log(v / (v + tau2)) + tau2 * d * d / (2 * v * (v + tau2))  # = -0.3466 + 1.0
    assert log_mixture_ratio(np.array([d]), np.array([v]), tau2)[0] == pytest.approx(by_hand)
    assert by_hand == pytest.approx(1.0 - 0.5 * math.log(2))
    arms = np.array([0] * 50 + [1] * 50)
    outcomes = np.array([1] * 20 + [0] * 30 + [1] * 30 + [0] * 20)
    result = sequential_test(arms, outcomes, SequentialConfig(min_samples_per_arm=20), looks=np.array([100]))  # one look, at the end
    assert result.diff == pytest.approx(0.2) and result.log_lambda == pytest.approx(by_hand)
    assert result.p_value == pytest.approx(math.exp(-by_hand)) and result.decision == "continue"  # 1/Lambda = 0.52
    half = confidence_half_width(v, tau2, 0.05)
    assert result.diff_interval == pytest.approx((0.2 - half, min(1.0, 0.2 + half)))
    # equal arms: the paper's two-stream form with V = 2 sigma^2 / n gives the same number
    n, sigma2 = 50, 0.25
    paper = 0.5 * math.log(2 * sigma2 / (2 * sigma2 + n * tau2)) + n * n * tau2 * d * d / (4 * sigma2 * (2 * sigma2 + n * tau2))
    assert paper == pytest.approx(by_hand)


def test_the_p_value_never_rises_and_the_decision_sticks():
    rng = np.random.default_rng(3)
    arms = (rng.random(3000) < 0.5).astype(int)
    outcomes = (rng.random(3000) < np.where(arms == 1, 0.65, 0.5)).astype(int)
    results = [sequential_test(arms[:n], outcomes[:n], CONFIG) for n in range(100, 3001, 100)]
    p = [r.p_value for r in results]
    assert all(b <= a + 1e-12 for a, b in zip(p, p[1:]))
    first = next(i for i, r in enumerate(results) if r.decision != "continue")
    assert results[first].decision == "promote"
    assert {r.decision for r in results[first:]} == {"promote"} and {r.decided_at for r in results[first:]} == {results[first].decided_at}


def test_no_decision_before_the_sample_floor_and_bad_input_is_named():
    arms, outcomes = np.array([0] * 19 + [1] * 19), np.array([0] * 19 + [1] * 19)  # as extreme as it gets
    result = sequential_test(arms, outcomes, SequentialConfig(min_samples_per_arm=20))
    assert result.decision == "continue" and result.p_value == 1.0 and "at least 20 per adapter" in result.reason
    with pytest.raises(ValueError, match=r"outcomes\[2\] = 2"):
        sequential_test(np.array([0, 1, 0]), np.array([0, 1, 2]))
    with pytest.raises(ValueError, match="differ in length"):
        sequential_test(np.array([0, 1]), np.array([1]))
    with pytest.raises(ValueError, match="alpha"):
        SequentialConfig(alpha=1.5)
    # all failures on both sides: zero variance, no evidence, no division by zero
    assert sequential_test(np.array([0, 1] * 100), np.zeros(200, dtype=int)).decision == "continue"


@pytest.mark.parametrize("share", [0.5, 0.1])
def test_ten_points_better_is_promoted_and_ten_worse_rolled_back_within_the_stated_samples(share):
    for p_challenger, expected in ((0.6, "promote"), (0.4, "rollback")):
        rng = np.random.default_rng(0)
        results = [simulate(0.5, p_challenger, CONFIG, rng, share) for _ in range(200)]
        correct = [r for r in results if r.decision == expected]
        assert len(correct) >= 190, (share, expected, len(correct))  # 95% power at least
        within = [r for r in correct if r.n_challenger <= MAX_SAMPLES_10_POINTS[share]]
        assert len(within) >= 0.95 * len(results), (share, expected, sorted(r.n_challenger for r in correct)[-12:])


@pytest.mark.parametrize("share", [0.5, 0.1])
def test_no_difference_gives_at_most_5_percent_wrong_decisions_though_checked_after_every_batch(share):
    rng = np.random.default_rng(0)
    results = [simulate(0.5, 0.5, CONFIG, rng, share) for _ in range(200)]
    wrong = sum(r.decision in ("promote", "rollback") for r in results)
    assert wrong <= 10, wrong
    assert all(r.decision in ("promote", "rollback", "inconclusive") for r in results)  # every experiment ends


def test_a_fixed_z_test_checked_after_every_batch_is_wrong_far_more_often():
    # the same null experiments, judged by a two-sided z-test at 0.05 after every batch of 100:
    # the reason the monitor needs an always-valid test
    rng = np.random.default_rng(0)
    naive_wrong = 0
    for _ in range(200):
        arms = (rng.random(10_000) < 0.5).astype(int)
        outcomes = (rng.random(10_000) < 0.5).astype(int)
        for n in range(100, 10_001, 100):
            a, y = arms[:n], outcomes[:n]
            na, nb = (a == 0).sum(), (a == 1).sum()
            pa, pb, pooled = y[a == 0].mean(), y[a == 1].mean(), y.mean()
            z = (pb - pa) / math.sqrt(pooled * (1 - pooled) * (1 / na + 1 / nb))
            if abs(z) > 1.959964:
                naive_wrong += 1
                break
    assert naive_wrong >= 40, naive_wrong  # >= 20% wrong, against <= 5% above
