"""The live A/B decision rule (flow_assets.live_ab.stats): the mSPRT formula against hand
computations, its always-valid properties, and seeded simulations of the acceptance criterion:
a challenger truly +10 points better is promoted, -10 points worse rolled back, each within the
stated number of samples; with no difference, at most 5% of 200 experiments checked after every
batch end in a wrong decision, while a fixed-alpha z-test checked as often does clearly worse."""

import math
import warnings

import numpy as np
import pytest

from flow_assets.live_ab.stats import (
    EXPECTED_MAX_SAMPLES_10PT,
    EXPECTED_MAX_SAMPLES_10PT_SHARE_10,
    TAU2_10PT,
    ABConfig,
    ab_decision,
    confidence_radius,
    constrained_variance,
    mixture_log_lr,
    sequential_path,
    simulate,
    simulate_stream,
    tau2_for_effect,
)

CONFIG = ABConfig()
BATCH = 50  # arrivals per batch, both arms together: one look after each
N_NULL = 200


def _null_streams(p: float, share: float, seed: int, n: int = N_NULL, cap: int = CONFIG.max_samples_per_arm):
    rng = np.random.default_rng(seed)
    return [simulate_stream(p, p, rng, share=share, max_samples_per_arm=cap, batch_size=BATCH) for _ in range(n)]


@pytest.fixture(scope="module")
def null_streams():
    """200 experiments with no difference (both arms at 50%), even split, to the default cap."""
    return _null_streams(0.5, 0.5, seed=20240611)


def _naive_z_wrong(champion, challenger, checkpoints, min_samples=CONFIG.min_samples_per_arm) -> bool:
    """A fixed-alpha two-sided pooled z-test (|z| >= 1.96) checked at every batch: did it ever fire?"""
    na, nb = checkpoints[:, 0], checkpoints[:, 1]
    sa = np.concatenate([[0], np.cumsum(champion)])[na]
    sb = np.concatenate([[0], np.cumsum(challenger)])[nb]
    keep = np.minimum(na, nb) >= min_samples
    na, nb, sa, sb = na[keep], nb[keep], sa[keep], sb[keep]
    pooled = (sa + sb) / (na + nb)
    se = np.sqrt(pooled * (1 - pooled) * (1 / na + 1 / nb))
    with np.errstate(divide="ignore", invalid="ignore"):
        z = np.where(se > 0, (sb / nb - sa / na) / se, 0.0)
    return bool(np.any(np.abs(z) >= 1.959963984540054))


# ---------------------------------------------------------------- the formula


def test_statistic_matches_hand_computation():
    # champion 2/4, challenger 3/4: diff 0.25; pooled smoothed rate (2 + 3 + 1) / (8 + 2) = 0.6,
    # so v = 0.6 * 0.4 * (1/4 + 1/4) = 0.12; tau2 = 0.01
    config = ABConfig(tau2=0.01, min_samples_per_arm=4)
    path = sequential_path([1, 0, 0, 1], [1, 1, 1, 0], config, checkpoints=[[4, 4]])
    hand = 0.5 * math.log(0.12 / 0.13) + 0.01 * 0.25**2 / (2 * 0.12 * 0.13)
    assert path.diff[-1] == pytest.approx(0.25)
    assert path.var[-1] == pytest.approx(0.12)
    assert path.log_lambda[-1] == pytest.approx(hand, abs=1e-12)
    assert hand == pytest.approx(-0.019989, abs=1e-6)
    # the paper's two-stream form for equal arms: V = 2 sigma2, n = 4 pairs
    V, n, tau2 = 2 * 0.24, 4, 0.01
    paper = math.log(math.sqrt(V / (V + n * tau2)) * math.exp(n**2 * tau2 * 0.25**2 / (2 * V * (V + n * tau2))))
    assert path.log_lambda[-1] == pytest.approx(paper, abs=1e-12)
    assert path.p_value[-1] == 1.0  # Lambda < 1: no evidence yet


def test_unequal_arms_form_reduces_to_paper_form():
    rng = np.random.default_rng(0)
    for _ in range(50):
        n, sigma2, tau2, diff = int(rng.integers(1, 5000)), rng.uniform(0.01, 0.25), rng.uniform(1e-4, 0.1), rng.uniform(-0.5, 0.5)
        V = 2 * sigma2
        paper = 0.5 * math.log(V / (V + n * tau2)) + n**2 * tau2 * diff**2 / (2 * V * (V + n * tau2))
        assert float(mixture_log_lr(diff, sigma2 * (1 / n + 1 / n), tau2)) == pytest.approx(paper, rel=1e-10, abs=1e-12)


def test_tau2_default_is_the_10_point_optimum():
    x = 2 * math.log(20) + math.log1p(8.2)
    assert TAU2_10PT == pytest.approx(0.01 * x / (1 + x), rel=1e-3) and TAU2_10PT == pytest.approx(0.00891, abs=1e-5)
    assert CONFIG.tau2 == TAU2_10PT
    # the defining property: at its v, no other tau2 gives a smaller boundary than the tuned one
    v = 0.01 / (1 + 8.2094)
    radius = lambda t2: float(confidence_radius(v, t2, 0.05))  # noqa: E731
    assert radius(TAU2_10PT) == pytest.approx(0.10, abs=1e-4)
    assert all(radius(TAU2_10PT) <= radius(TAU2_10PT * f) for f in (0.25, 0.5, 0.8, 1.25, 2, 4))
    with pytest.raises(ValueError):
        tau2_for_effect(0.0)


def test_constrained_variance_is_pooled_at_zero_and_the_constrained_mle_elsewhere():
    assert float(constrained_variance(10, 3, 10, 7, 0.0)) == pytest.approx(0.5 * 0.5 * (1 / 10 + 1 / 10))
    assert float(constrained_variance(40, 0, 40, 0, 0.0)) == pytest.approx((1 / 82) * (81 / 82) * (2 / 40))
    rng = np.random.default_rng(1)
    for _ in range(200):
        na, nb = rng.integers(1, 400, 2)
        sa, sb = rng.integers(0, na + 1), rng.integers(0, nb + 1)
        d = rng.uniform(-0.95, 0.95)
        # brute force: the constrained log-likelihood on a fine grid of the champion's rate
        grid = np.linspace(max(0, -d), min(1, 1 - d), 200001)[1:-1]
        loglik = (sa + 0.5) * np.log(grid) + (na - sa + 0.5) * np.log1p(-grid) + (sb + 0.5) * np.log(grid + d) + (nb - sb + 0.5) * np.log1p(-grid - d)
        qa = grid[np.argmax(loglik)]
        brute = qa * (1 - qa) / na + (qa + d) * (1 - qa - d) / nb
        assert float(constrained_variance(na, sa, nb, sb, d)) == pytest.approx(brute, rel=1e-3, abs=1e-9)


def test_confidence_interval_inverts_the_test():
    rng = np.random.default_rng(2)
    a, b, checkpoints = simulate_stream(0.3, 0.38, rng, share=0.2, max_samples_per_arm=600, batch_size=100)
    path = sequential_path(a, b, CONFIG, checkpoints)
    on = np.flatnonzero(path.active)
    for k in on[:: max(1, len(on) // 10)]:
        na, nb = path.n_champion[k], path.n_challenger[k]
        one = sequential_path(a[:na], b[:nb], CONFIG, [[na, nb]])  # look k alone: its own interval
        low, high = one.ci_low[-1], one.ci_high[-1]
        args = (na, path.success_champion[k], nb, path.success_challenger[k])
        for end in (low, high):
            if abs(end) < 1:  # an interior end: Lambda(end) sits on the 1/alpha boundary
                assert float(mixture_log_lr(path.diff[k], constrained_variance(*args, end), CONFIG.tau2, end)) == pytest.approx(math.log(20), abs=1e-6)
    # duality over the whole path: p <= alpha exactly when 0 is outside the confidence sequence
    outside = (path.ci_low > 0) | (path.ci_high < 0)
    assert np.array_equal(outside[path.active], path.p_value[path.active] <= CONFIG.alpha)


def test_p_value_non_increasing_and_confidence_sequence_nested():
    rng = np.random.default_rng(3)
    for pa, pb, share in ((0.5, 0.55, 0.5), (0.2, 0.2, 0.1), (0.7, 0.6, 0.3)):
        a, b, checkpoints = simulate_stream(pa, pb, rng, share=share, max_samples_per_arm=1500, batch_size=BATCH)
        for path in (sequential_path(a, b, CONFIG, checkpoints), sequential_path(a, b, CONFIG)):
            assert np.all(np.diff(path.p_value) <= 0)
            assert np.all(np.diff(path.ci_low) >= 0) and np.all(np.diff(path.ci_high) <= 0)
        # and as a live monitor sees it: one call per batch on everything so far
        p = []
        for j in range(0, len(checkpoints), 5):
            na, nb = checkpoints[j]
            p.append(ab_decision(a[:na], b[:nb], CONFIG, checkpoints[: j + 1]).p_value)
        assert all(x >= y for x, y in zip(p, p[1:]))


def test_default_looks_merge_the_streams_proportionally():
    a, b = np.ones(300, dtype=np.int8), np.zeros(100, dtype=np.int8)
    path = sequential_path(a, b, ABConfig(min_samples_per_arm=1, max_samples_per_arm=10_000))
    steps = np.diff(np.stack([path.n_champion, path.n_challenger]), axis=1)
    assert np.all(steps.sum(axis=0) == 1) and np.all(steps >= 0)  # one arrival per look
    assert (path.n_champion[-1], path.n_challenger[-1]) == (300, 100)
    assert np.all(np.abs(path.n_champion - 3 * path.n_challenger) <= 3)  # a 25% share, evenly spread


# ---------------------------------------------------------------- guards


def test_minimum_samples_per_arm_before_any_decision():
    champion, challenger = np.zeros(19, dtype=int), np.ones(19, dtype=int)
    waiting = ab_decision(champion, challenger)
    assert waiting.decision == "continue" and waiting.p_value == 1.0 and waiting.diff_interval == (-1.0, 1.0)
    assert "waiting for 20" in waiting.reason
    decided = ab_decision(np.zeros(20, dtype=int), np.ones(20, dtype=int))
    assert decided.decision == "promote" and (decided.n_champion, decided.n_challenger) == (20, 20)
    assert decided.diff_interval[0] > 0 and decided.p_value <= 0.05


@pytest.mark.parametrize("value", [0, 1])
def test_zero_variance_does_not_divide_by_zero(value):
    same = np.full(500, value, dtype=np.int8)
    with warnings.catch_warnings(), np.errstate(all="raise"):
        warnings.simplefilter("error")
        result = ab_decision(same, same)
        path = sequential_path(same, same, CONFIG)
    assert result.decision == "continue" and result.diff == 0.0 and result.p_value == 1.0
    assert math.isfinite(result.statistic) and result.diff_interval[0] < 0 < result.diff_interval[1]
    assert np.all(np.isfinite(path.log_lambda[path.active]))


def test_cap_ends_inconclusive_and_later_data_are_ignored():
    config = ABConfig(max_samples_per_arm=300)
    same = np.tile(np.array([1, 0], dtype=np.int8), 200)  # 400 outcomes, identical arms: no evidence ever
    result = ab_decision(same, same, config)
    assert result.decision == "inconclusive" and (result.n_champion, result.n_challenger) == (300, 300)
    assert "challenger withdrawn, champion kept" in result.reason
    # a flood of challenger successes after the cap changes nothing: the test has ended
    later = ab_decision(np.r_[same, np.zeros(2000, dtype=np.int8)], np.r_[same, np.ones(2000, dtype=np.int8)], config)
    assert later.decision == "inconclusive" and (later.n_champion, later.n_challenger) == (300, 300)
    # below the cap the same data only continue
    assert ab_decision(same[:250], same[:250], config).decision == "continue"


def test_first_decision_sticks():
    rng = np.random.default_rng(5)
    a, b, checkpoints = simulate_stream(0.3, 0.45, rng, share=0.5, max_samples_per_arm=5000, batch_size=BATCH)
    first = ab_decision(a, b, CONFIG, checkpoints)
    assert first.decision == "promote"
    # outcomes after the deciding batch (here: the challenger collapsing) do not undo it
    a2 = np.r_[a[: first.n_champion], np.ones(3000, dtype=np.int8)]
    b2 = np.r_[b[: first.n_challenger], np.zeros(3000, dtype=np.int8)]
    cps = np.r_[checkpoints[checkpoints[:, 0] <= first.n_champion], [[first.n_champion + 3000, first.n_challenger + 3000]]]
    again = ab_decision(a2, b2, CONFIG, cps)
    assert again.decision == "promote" and (again.n_champion, again.n_challenger) == (first.n_champion, first.n_challenger)


def test_margin_demands_a_practical_gain():
    rng = np.random.default_rng(6)
    plain, strict = ABConfig(), ABConfig(margin=0.05)
    a, b, checkpoints = simulate_stream(0.4, 0.47, rng, share=0.5, max_samples_per_arm=5000, batch_size=BATCH)
    first = ab_decision(a, b, plain, checkpoints)
    assert first.decision == "promote"
    held = ab_decision(a[: first.n_champion], b[: first.n_challenger], strict, checkpoints[checkpoints[:, 0] <= first.n_champion])
    assert held.decision == "continue" and held.p_value <= 0.05 and "margin" in held.reason
    results = [simulate(0.4, 0.6, strict, np.random.default_rng(s)) for s in range(20)]
    assert all(r.decision == "promote" and r.diff_interval[0] >= 0.05 - 1e-9 for r in results)


def test_input_validation():
    with pytest.raises(ValueError, match=r"challenger\[2\] = 2"):
        ab_decision([0, 1, 1], [1, 0, 2])
    with pytest.raises(ValueError, match=r"champion\[1\] = nan"):
        ab_decision([0.0, float("nan")], [1.0])
    with pytest.raises(ValueError, match=r"champion\[0\] = None"):
        ab_decision(np.array([None, 1], dtype=object), [1])
    with pytest.raises(ValueError, match="1-D"):
        ab_decision(np.zeros((2, 2)), [1])
    with pytest.raises(ValueError, match="dtype"):
        ab_decision(["1", "0"], [1])
    with pytest.raises(ValueError, match="nondecreasing"):
        ab_decision([0] * 30, [1] * 30, checkpoints=[[20, 20], [10, 25]])
    with pytest.raises(ValueError, match="within"):
        ab_decision([0] * 30, [1] * 30, checkpoints=[[40, 20]])
    with pytest.raises(ValueError, match=r"shape \[k, 2\]"):
        ab_decision([0] * 30, [1] * 30, checkpoints=[20, 20])
    for bad in (
        {"alpha": 0},
        {"alpha": 1.5},
        {"tau2": 0.0},
        {"tau2": float("inf")},
        {"min_samples_per_arm": 0},
        {"min_samples_per_arm": 2.5},
        {"min_samples_per_arm": 50, "max_samples_per_arm": 40},
        {"margin": -0.01},
        {"margin": 1.0},
    ):
        with pytest.raises(ValueError):
            ABConfig(**bad)
    with pytest.raises(ValueError):
        simulate_stream(1.2, 0.5, np.random.default_rng(0))
    with pytest.raises(ValueError):
        simulate_stream(0.5, 0.5, np.random.default_rng(0), share=1.0)
    assert ab_decision(np.array([True, False] * 15), np.array([1, 0] * 15, dtype=np.uint8)).n_champion == 30  # bool and unsigned accepted


# ---------------------------------------------------------------- the acceptance criterion


@pytest.mark.parametrize(
    ("p_champion", "p_challenger", "decision", "seed"),
    [(0.5, 0.6, "promote", 1050), (0.2, 0.3, "promote", 1020), (0.6, 0.5, "rollback", 2060), (0.3, 0.2, "rollback", 2030)],
)
def test_10_points_either_way_is_decided_within_bound(p_champion, p_challenger, decision, seed):
    rng = np.random.default_rng(seed)
    results = [simulate(p_champion, p_challenger, CONFIG, rng, batch_size=BATCH) for _ in range(200)]
    within = [r.decision == decision and max(r.n_champion, r.n_challenger) <= EXPECTED_MAX_SAMPLES_10PT for r in results]
    assert np.mean(within) >= 0.95, np.mean(within)
    wrong = {"promote": "rollback", "rollback": "promote"}[decision]
    assert not any(r.decision == wrong for r in results)


@pytest.mark.parametrize(("p_champion", "p_challenger", "decision"), [(0.5, 0.6, "promote"), (0.6, 0.5, "rollback")])
def test_10_points_at_the_live_10_percent_share(p_champion, p_challenger, decision):
    rng = np.random.default_rng(3000)
    results = [simulate(p_champion, p_challenger, CONFIG, rng, share=0.1, batch_size=BATCH) for _ in range(100)]
    within = [r.decision == decision and r.n_challenger <= EXPECTED_MAX_SAMPLES_10PT_SHARE_10 for r in results]
    assert np.mean(within) >= 0.95, np.mean(within)
    # the champion, on the other 90%, has seen about nine times as many
    assert np.median([r.n_champion / r.n_challenger for r in results]) == pytest.approx(9, rel=0.15)


def test_no_difference_wrong_decisions_at_most_5_percent_checked_every_batch(null_streams):
    decisions = [ab_decision(a, b, CONFIG, checkpoints).decision for a, b, checkpoints in null_streams]
    wrong = sum(d in ("promote", "rollback") for d in decisions)
    assert wrong <= 0.05 * N_NULL, wrong
    assert set(decisions) <= {"promote", "rollback", "inconclusive"}  # each ran to a decision or the cap
    assert all(len(c) >= 190 for _, _, c in null_streams)  # ~200 looks each: monitoring really was continuous


def test_naive_z_test_checked_every_batch_is_not_valid(null_streams):
    msprt = sum(ab_decision(a, b, CONFIG, c).decision in ("promote", "rollback") for a, b, c in null_streams)
    naive = sum(_naive_z_wrong(a, b, c) for a, b, c in null_streams)
    # the same 200 experiments: the fixed-alpha test, peeked at after every batch, errs far above 5%
    assert naive >= 0.2 * N_NULL and naive >= 4 * max(msprt, 1), (naive, msprt)


def test_no_difference_at_the_live_share():
    streams = _null_streams(0.2, 0.1, seed=77, cap=1000)
    wrong = sum(ab_decision(a, b, CONFIG, c).decision in ("promote", "rollback") for a, b, c in streams)
    assert wrong <= 0.05 * N_NULL, wrong


def test_confidence_sequence_covers_the_truth_at_all_times(null_streams):
    covered = [(lambda p: p.ci_low[-1] < 0 < p.ci_high[-1])(sequential_path(a, b, CONFIG, c)) for a, b, c in null_streams]
    assert np.mean(covered) >= 0.95, np.mean(covered)
    # and with a real gain at an uneven split, where the variance must follow each null (10 -> 20%)
    rng = np.random.default_rng(8)
    hits = []
    for _ in range(100):
        a, b, c = simulate_stream(0.1, 0.2, rng, share=0.1, max_samples_per_arm=500, batch_size=BATCH)
        path = sequential_path(a, b, CONFIG, c)
        hits.append(path.ci_low[-1] < 0.1 < path.ci_high[-1])
    assert np.mean(hits) >= 0.95, np.mean(hits)
