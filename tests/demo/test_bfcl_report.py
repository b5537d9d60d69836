"""The BFCL demo's per-category report (a pure function over evaluation rows), checked by hand."""

import polars as pl
import pytest

from flow_assets.demo.bfcl import per_category
from flow_assets.rl.evaluation import EVAL_SCHEMA


def _rows(outcomes: dict[str, tuple[bool, bool]]) -> pl.DataFrame:
    """``task -> (champion success, candidate success)``, greedy mode."""
    rows = []
    for task, (champ, cand) in outcomes.items():
        for policy, ok in (("champion", champ), ("candidate", cand)):
            rows.append({"policy": policy, "mode": "greedy", "task_id": task, "completion": "", "reward": float(ok),
                         "success": ok, "completion_tokens": 1, "llm_calls": 1, "tool_calls": 0})  # fmt: skip
    return pl.DataFrame(rows, schema=EVAL_SCHEMA)


def test_per_category_splits_the_paired_comparison():
    outcomes = {f"s{i}": (False, i < 8) for i in range(10)}  # simple: 0/10 -> 8/10
    outcomes |= {f"r{i}": (True, i < 2) for i in range(4)}  # irrelevance: 4/4 -> 2/4
    category = {t: ("simple_python" if t.startswith("s") else "irrelevance") for t in outcomes}
    table = per_category(_rows(outcomes), category)
    assert list(table) == ["overall", "irrelevance", "simple_python"]
    simple, irrelevance, overall = table["simple_python"]["greedy"], table["irrelevance"]["greedy"], table["overall"]["greedy"]
    assert (simple["n_tasks"], simple["base"]["successes"], simple["final"]["successes"]) == (10, 0, 8)
    assert simple["gain"] == pytest.approx(0.8) and simple["mcnemar_p"] == pytest.approx(2 * 0.5**8)
    assert irrelevance["gain"] == pytest.approx(-0.5) and irrelevance["mcnemar_p"] == pytest.approx(0.5)
    assert overall["n_tasks"] == 14 and overall["gain"] == pytest.approx((10 - 4) / 14)
    low, high = overall["gain_ci"]
    assert low < overall["gain"] < high
    with pytest.raises(KeyError):
        per_category(_rows({"x": (True, True)}), category)
