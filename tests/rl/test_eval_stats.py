"""Evaluation statistics against values computed by hand and textbook tables."""

import math

import pytest

from flow_assets.rl.eval_stats import (
    mcnemar_exact,
    mean_interval,
    newcombe_interval,
    paired_bootstrap,
    student_t_quantile,
    success_rate,
    wilson_interval,
)


def test_wilson_interval_zero_of_ten():
    # p = 0, n = 10, z^2 = 3.8414588:
    # centre = (z^2 / 20) / (1 + z^2 / 10) = 0.1920729 / 1.3841459 = 0.1387664
    # half   = z / 1.3841459 * sqrt(z^2 / 400) = 1.4160097 * 0.0979982 = 0.1387664
    low, high = wilson_interval(0, 10)
    assert low == 0.0
    assert high == pytest.approx(0.2775328, abs=1e-6)


def test_wilson_interval_half_and_asymmetric_case():
    # 5/10: centre 0.5, half = 1.4160097 * sqrt(0.025 + 0.0096036) = 1.4160097 * 0.1860206 = 0.2634069
    low, high = wilson_interval(5, 10)
    assert (low, high) == (pytest.approx(0.2365931, abs=1e-6), pytest.approx(0.7634069, abs=1e-6))
    # 8/10: centre = (0.8 + 0.1920729) / 1.3841459 = 0.7167402
    #       half = 1.4160097 * sqrt(0.016 + 0.0096036) = 1.4160097 * 0.1600114 = 0.2265777
    low, high = wilson_interval(8, 10)
    assert low == pytest.approx(0.4901625, abs=1e-6)
    assert high == pytest.approx(0.9433179, abs=1e-6)


def test_success_rate_counts_truthy_outcomes():
    r = success_rate([True, False, 1, 0, True, False, False, True, True, True])
    assert (r.successes, r.n, r.rate) == (6, 10, 0.6)
    assert r.ci_low < 0.6 < r.ci_high
    with pytest.raises(ValueError):
        success_rate([])


@pytest.mark.parametrize(
    "df, expected",  # two-sided 95% critical values from any t table
    [(1, 12.7062), (2, 4.3027), (4, 2.7764), (9, 2.2622), (10, 2.2281), (29, 2.0452), (30, 2.0423), (120, 1.9799), (5000, 1.9604)],
)
def test_student_t_quantile_matches_tables(df, expected):
    assert student_t_quantile(0.975, df) == pytest.approx(expected, abs=1e-4)
    assert student_t_quantile(0.025, df) == pytest.approx(-expected, abs=1e-4)


def test_mean_interval_t_by_hand():
    # [1..5]: mean 3, s = sqrt(2.5) = 1.5811388, half = 2.7764451 * 1.5811388 / sqrt(5) = 1.9632432
    r = mean_interval([1, 2, 3, 4, 5])
    assert r.mean == 3.0 and r.n == 5
    assert r.std == pytest.approx(math.sqrt(2.5))
    assert (r.ci_low, r.ci_high) == (pytest.approx(1.0367568, abs=1e-6), pytest.approx(4.9632432, abs=1e-6))
    single = mean_interval([0.7])
    assert (single.ci_low, single.ci_high) == (0.7, 0.7)


def test_mcnemar_exact_p_values_by_hand():
    # b = 10, c = 5: P(X <= 5 | n = 15) = (1 + 15 + 105 + 455 + 1365 + 3003) / 2^15 = 4944 / 32768
    cand = [1] * 10 + [0] * 5 + [1] * 7 + [0] * 3  # 7 concordant successes, 3 concordant failures
    champ = [0] * 10 + [1] * 5 + [1] * 7 + [0] * 3
    r = mcnemar_exact(cand, champ)
    assert (r.candidate_only, r.champion_only, r.n_discordant) == (10, 5, 15)
    assert r.p_value == pytest.approx(2 * 4944 / 32768)
    # b = 6, c = 0: p = 2 * (1/2)^6 = 0.03125 (smallest p with 6 discordant pairs)
    assert mcnemar_exact([1] * 6, [0] * 6).p_value == pytest.approx(0.03125)
    # b = c: the doubled tail exceeds 1 and is capped
    assert mcnemar_exact([1, 0], [0, 1]).p_value == 1.0
    # no discordant pairs: no evidence either way
    assert mcnemar_exact([1, 0, 1], [1, 0, 1]).p_value == 1.0
    with pytest.raises(ValueError):
        mcnemar_exact([1], [1, 0])


def test_paired_bootstrap_is_seeded_and_brackets_the_mean():
    cand = [1, 0, 1, 1, 1, 0, 1, 1, 0, 1]
    champ = [0, 0, 1, 0, 1, 0, 0, 1, 0, 1]
    a = paired_bootstrap(cand, champ, n_resamples=2000, seed=7)
    b = paired_bootstrap(cand, champ, n_resamples=2000, seed=7)
    assert a == b
    assert a.mean_diff == pytest.approx(0.3)
    assert a.ci_low <= 0.3 <= a.ci_high
    # differences are 0 or 1 with mean 0.3: a resampled mean <= 0 needs all 10 draws to be 0
    # (probability 0.7^10 = 0.028)
    assert a.prob_not_better == pytest.approx(0.7**10, abs=0.015)
    same = paired_bootstrap(cand, cand, n_resamples=100)
    assert (same.mean_diff, same.ci_low, same.ci_high, same.prob_not_better) == (0.0, 0.0, 0.0, 1.0)


@pytest.mark.parametrize(
    ("counts", "expected"),
    [
        # Newcombe (1998), Table II, method 10 (hybrid score), examples (a), (b), (c), (d), (g), (h)
        ((56, 70, 48, 80), (0.0524, 0.3339)),
        ((9, 10, 3, 10), (0.1705, 0.8090)),
        ((6, 7, 2, 7), (0.0582, 0.8062)),
        ((5, 56, 0, 29), (-0.0381, 0.1926)),
        ((0, 10, 0, 20), (-0.1611, 0.2775)),
        ((10, 10, 0, 20), (0.6791, 1.0)),
    ],
)
def test_newcombe_interval_matches_the_published_table(counts, expected):
    low, high = newcombe_interval(*counts)
    assert (low, high) == (pytest.approx(expected[0], abs=1e-4), pytest.approx(expected[1], abs=1e-4))


def test_newcombe_interval_refuses_an_empty_arm():
    with pytest.raises(ValueError):
        newcombe_interval(0, 0, 3, 10)
