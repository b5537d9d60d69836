"""Offline next-action accuracy (flow_assets.rl.next_action) on a hand-made log, and the cluster
bootstrap that tests its paired difference, against hand computations."""

import pytest

from flow_assets.rl.eval_stats import paired_bootstrap
from flow_assets.rl.next_action import ANSWER, Action, action_breakdown, next_action_report, same_arguments, score_action


def test_arguments_compare_as_json_values():
    assert same_arguments('{"a": 1, "b": [1, 2]}', {"b": [1.0, 2], "a": 1.0})
    assert not same_arguments({"a": "1"}, {"a": 1})
    assert not same_arguments({"a": True}, {"a": 1})  # a bool is not the number 1
    assert not same_arguments({"a": [1, 2]}, {"a": [2, 1]})
    assert same_arguments("not json", "not json")


def test_a_tool_call_needs_its_name_then_its_arguments():
    logged = Action("search", {"query": "Arthur's Magazine"})
    assert score_action(Action("search", {"query": "Arthur's Magazine"}), logged) == (True, True)
    assert score_action(Action("search", {"query": "arthur's magazine"}), logged) == (True, False)
    assert score_action(Action("lookup", {"query": "Arthur's Magazine"}), logged) == (False, False)
    assert score_action(None, logged) == (False, False)
    # a text answer has no arguments: its name decides both measures
    assert score_action(Action(ANSWER, None), Action(ANSWER, None)) == (True, True)
    assert score_action(Action("search", {"query": "x"}), Action(ANSWER, None)) == (False, False)


def test_report_counts_by_hand():
    # trajectory t1: two turns, t2: one turn
    ids = ["t1", "t1", "t2"]
    logged = [Action("search", {"q": "a"}), Action(ANSWER), Action("book", {"id": 3})]
    candidate = [Action("search", {"q": "a"}), Action(ANSWER), Action("book", {"id": 4})]
    champion = [Action("search", {"q": "b"}), None, Action("cancel", {"id": 3})]
    report = next_action_report(ids, logged, candidate, champion, n_resamples=200)
    assert (report["n_turns"], report["n_trajectories"]) == (3, 2)
    assert report["candidate"]["name"]["correct"] == 3
    assert report["candidate"]["name_and_arguments"]["correct"] == 2
    assert report["champion"]["name"]["correct"] == 1
    assert report["champion"]["name_and_arguments"]["correct"] == 0
    assert report["difference"]["name"]["mean_diff"] == pytest.approx(2 / 3)
    assert report["difference"]["name_and_arguments"]["mean_diff"] == pytest.approx(2 / 3)
    assert report["difference"]["name"]["n_clusters"] == 2
    # what each did on the logged answer turn (1) and the logged tool turns (2)
    assert report["breakdown"]["champion"] == {
        "answer_turns": {"n": 1, "answered": 0, "called": 0, "unparsed": 1},
        "tool_turns": {"n": 2, "answered": 0, "called": 2, "unparsed": 0, "right_name": 1, "right_arguments": 0},
    }
    assert report["breakdown"]["candidate"]["tool_turns"] == {"n": 2, "answered": 0, "called": 2, "unparsed": 0, "right_name": 2, "right_arguments": 1}


def test_breakdown_separates_answering_from_calling():
    logged = [Action(ANSWER), Action(ANSWER), Action("search", {"q": "a"})]
    always_text = action_breakdown(logged, [Action(ANSWER)] * 3)
    assert always_text["answer_turns"]["answered"] == 2 and always_text["tool_turns"]["answered"] == 1
    assert always_text["tool_turns"]["right_name"] == 0
    with pytest.raises(ValueError, match="2 predicted"):
        action_breakdown(logged, [None, None])


def test_report_refuses_unpaired_inputs():
    with pytest.raises(ValueError, match="equal"):
        next_action_report(["t"], [Action(ANSWER)], [], [None])


def test_cluster_bootstrap_resamples_whole_trajectories():
    # t1 has three turns the candidate wins, t2 one turn with no difference. Observed mean 3/4.
    # Resampling the two trajectories gives {t1,t1}: 1, {t1,t2} or {t2,t1}: 3/4, {t2,t2}: 0, so
    # P(d* <= 0) = 1/4; resampling the four turns independently gives (1/4)^4.
    diff_cand, diff_champ = [1, 1, 1, 0], [0, 0, 0, 0]
    clustered = paired_bootstrap(diff_cand, diff_champ, n_resamples=20_000, seed=3, clusters=["t1", "t1", "t1", "t2"])
    independent = paired_bootstrap(diff_cand, diff_champ, n_resamples=20_000, seed=3)
    assert clustered.mean_diff == independent.mean_diff == pytest.approx(0.75)
    assert clustered.prob_not_better == pytest.approx(0.25, abs=0.015)
    assert independent.prob_not_better == pytest.approx(0.25**4, abs=0.003)
    assert (clustered.ci_low, clustered.ci_high) == (0.0, 1.0)
    assert clustered.p_value == pytest.approx(0.5, abs=0.03)
    assert clustered.n_clusters == 2 and independent.n_clusters == 4


def test_cluster_labels_must_match_the_pairs():
    with pytest.raises(ValueError, match="labels"):
        paired_bootstrap([1, 0], [0, 0], clusters=["a"])
