"""The pieces of ``flowopt demo-text`` that turn its runs into figures: which captured turns the
text path re-rendered to the same ids, and the paired comparison of two of three policies."""

from __future__ import annotations

import polars as pl
import pytest

from flow_assets.demo.text_compare import id_agreement, pair_report
from flow_assets.policy.configs import TrainingSample
from flow_assets.rl.evaluation import EVAL_SCHEMA

EOS = 2


def _sample(prompt: list[int], completion: list[int]) -> TrainingSample:
    return TrainingSample(prompt_ids=prompt, completion_ids=completion, advantage=1.0)


def test_id_agreement_counts_finished_turns_and_cut_turns_apart():
    captured = [_sample([1, 5], [7, EOS]), _sample([1, 6], [8, EOS]), _sample([1, 5, 7, EOS, 9], [3, 3]), _sample([1, 4], [4]),
                _sample([1, 3], [6, 6])]
    text = [_sample([1, 5], [7, EOS]), _sample([1, 6, 0], [8, EOS]), _sample([1, 5, 7, EOS, 9], [3, 3, EOS]), _sample([1, 3], [6, 6])]
    assert id_agreement(captured, text, EOS) == {
        "captured_rows": 5, "text_rows": 4, "finished": 2, "finished_equal": 1, "cut": 3, "cut_equal": 1, "cut_equal_but_eos": 1,
    }  # fmt: skip


def _rows(outcomes: dict[str, list[bool]], mode: str = "sampled") -> pl.DataFrame:
    return pl.DataFrame(
        [
            {"policy": policy, "mode": mode, "task_id": f"t{i}", "completion": "", "reward": float(ok), "success": ok,
             "completion_tokens": 1, "llm_calls": 1, "tool_calls": 0}
            for policy, column in outcomes.items()
            for i, ok in enumerate(column)
        ],  # fmt: skip
        schema=EVAL_SCHEMA,
    )


def test_pair_report_compares_the_two_named_policies_on_the_same_tasks():
    n = 40
    rows = _rows({"base": [False] * n, "captured": [i < 12 for i in range(n)], "text": [i < 10 for i in range(n)]})
    report = pair_report(rows, "text", "base")["sampled"]
    assert (report["text"], report["base"], report["n_tasks"]) == (10 / n, 0.0, n)
    assert report["gain"] == pytest.approx(10 / n)
    assert report["mcnemar_p"] == pytest.approx(2 * 0.5**10)  # 10 discordant pairs, all one way
    versus = pair_report(rows, "text", "captured")["sampled"]
    assert versus["gain"] == pytest.approx(-2 / n)
    assert versus["mcnemar_p"] == pytest.approx(0.5)  # 2 discordant pairs, both for captured: 2 * 0.5**2
