"""The promotion gate and the candidate-vs-champion report it reads, on hand-made outcomes."""

import polars as pl
import pytest

from flow_assets.rl.evaluation import compare_policies
from flow_assets.rl.gate import GateConfig, check_finite_loss, check_gain, check_kl


def _rows(candidate: list[int], champion: list[int], mode: str = "sampled") -> pl.DataFrame:
    rows = []
    for policy, outcomes in (("candidate", candidate), ("champion", champion)):
        for i, ok in enumerate(outcomes):
            rows.append({"policy": policy, "mode": mode, "task_id": f"t{i:03d}", "success": bool(ok),
                         "reward": float(ok), "completion_tokens": 5, "llm_calls": 1, "tool_calls": 0})
    return pl.DataFrame(rows)


def test_report_pairs_the_same_tasks_and_counts_discordant_pairs():
    # candidate wins 6 tasks the champion lost, loses 1: gain (6 - 1) / 20
    cand = [1] * 6 + [0] + [1] * 5 + [0] * 8
    champ = [0] * 6 + [1] + [1] * 5 + [0] * 8
    report = compare_policies(_rows(cand, champ))
    assert set(report) == {"sampled"}
    s = report["sampled"]
    assert s["gain"] == pytest.approx(5 / 20)
    assert (s["mcnemar"]["candidate_only"], s["mcnemar"]["champion_only"]) == (6, 1)
    # two-sided exact binomial: 2 * P(X <= 1 | n=7, p=1/2) = 2 * 8/128
    assert s["mcnemar"]["p_value"] == pytest.approx(16 / 128)
    assert s["candidate"]["success_rate"]["successes"] == 11


def test_report_refuses_different_task_sets():
    rows = _rows([1, 0], [1, 0]).with_columns(
        task_id=pl.when(pl.col("policy") == "champion").then(pl.lit("other") + pl.col("task_id")).otherwise(pl.col("task_id"))
    )
    with pytest.raises(ValueError, match="different tasks"):
        compare_policies(rows)


def test_default_gate_is_not_worse():
    better = compare_policies(_rows([1, 1, 0, 0], [1, 0, 0, 0]))
    same = compare_policies(_rows([1, 0, 0, 1], [1, 0, 1, 0]))
    worse = compare_policies(_rows([0, 0, 0, 0], [1, 0, 0, 0]))
    assert check_gain(better, GateConfig()).passed
    assert check_gain(same, GateConfig()).passed
    result = check_gain(worse, GateConfig())
    assert not result.passed and "gain -0.250" in result.reason


def test_significance_and_min_gain_when_asked():
    small = compare_policies(_rows([1, 1, 0, 0] * 5, [1, 0, 0, 0] * 5))  # +0.25, 5 discordant pairs
    assert check_gain(small, GateConfig(min_gain=0.2)).passed
    assert not check_gain(small, GateConfig(min_gain=0.3)).passed
    strict = check_gain(small, GateConfig(require_significance=True, alpha=0.05))
    assert not strict.passed  # p = 2 / 32 = 0.0625
    assert check_gain(small, GateConfig(require_significance=True, alpha=0.1)).passed
    assert not check_gain(small, GateConfig(metric="greedy")).passed  # no greedy evaluation


def test_finite_loss_and_kl_bound():
    assert check_finite_loss([0.1, -0.2], [1.0, 0.5]).passed
    assert not check_finite_loss([0.1, float("nan")], [1.0, 0.5]).passed
    assert not check_finite_loss([0.1], [float("inf")]).passed
    assert not check_finite_loss([], []).passed
    assert check_kl(0.05, GateConfig(max_kl=0.1)).passed
    assert not check_kl(0.2, GateConfig(max_kl=0.1)).passed
    assert not check_kl(float("nan"), GateConfig()).passed


def test_gate_results_carry_their_numbers_and_a_verdict_names_the_failed_ones():
    from flow_assets.rl.gate import verdict

    worse = compare_policies(_rows([0, 0, 1, 0], [1, 0, 1, 0]))
    gain = check_gain(worse, GateConfig())
    assert gain.metadata["gain"] == pytest.approx(-0.25) and gain.metadata["min_gain"] == 0.0
    assert gain.metadata["mcnemar_p"] == pytest.approx(1.0) and gain.metadata["held_out_tasks"] == 4
    assert (gain.metadata["candidate_success"], gain.metadata["champion_success"]) == (0.25, 0.5)
    kl = check_kl(0.8, GateConfig(max_kl=0.5))
    finite = check_finite_loss([0.1, 0.2], [1.0, 1.0])
    assert finite.metadata == {"steps": 2, "non_finite_steps": 0}
    assert verdict("v15", (gain, finite, kl)) == "keep v15 (blocked: gain -0.250 (min +0.000), McNemar p = 1; KL 0.8 > 0.5)"
    assert verdict("v15", (check_gain(worse, GateConfig(min_gain=-1.0)), finite)) == "promote: the candidate replaces v15"
