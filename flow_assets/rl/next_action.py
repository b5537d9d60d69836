"""Offline evaluation for flows no environment can replay: next-action accuracy on held-out turns.

A logged trajectory of a held-out task is a sequence of decisions taken in a known context. For
each assistant turn of a held-out *successful* trajectory, the policy under test is given the
context the logged agent had and asked for its next action, greedily; the action it takes is
compared with the one logged:

- **name**: the tool called (exact string), or :data:`ANSWER` for a turn that answers in text;
- **name and arguments**: the name, and for a tool call the arguments equal as JSON values
  (``{"a": 1}`` equals ``{"a": 1.0}`` and key order does not matter; ``"1"`` is not ``1``). A text
  answer has no arguments: it counts on this measure when its name does, since the logged answer's
  correctness is already the log's own success and free text has no exact reference.

This is FR-6's ``tool_accuracy``. Candidate and champion are scored on the same turns, so the two
are paired; the turns of one trajectory are not independent, so the paired difference is tested
with the cluster bootstrap over trajectories (:func:`flow_assets.rl.eval_stats.paired_bootstrap`
with ``clusters``). Only successful trajectories are references: imitating a failed flow's action
is not evidence of a better policy.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from flow_assets.rl.eval_stats import paired_bootstrap, wilson_interval

#: the name of a turn that answers in text (no tool call)
ANSWER = "answer"


@dataclass(frozen=True)
class Action:
    """One decision: a tool call (``name`` = the tool, ``arguments`` = its JSON arguments) or a text
    answer (``name`` = :data:`ANSWER`, ``arguments`` = ``None``)."""

    name: str
    arguments: Any = None


def _canonical(value: Any) -> Any:
    """``value`` with numbers compared by value (``1 == 1.0``) and bools kept apart from numbers;
    strings holding JSON are not decoded (``"1"`` is a string)."""
    if isinstance(value, bool):
        return ("bool", value)  # True == 1.0 in Python; in JSON they are different values
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, (int, float)):
        if isinstance(value, float) and not math.isfinite(value):
            return repr(value)
        return float(value)
    if isinstance(value, dict):
        return {str(k): _canonical(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_canonical(v) for v in value]
    return value


def parse_arguments(arguments: Any) -> Any:
    """A tool call's arguments as a JSON value: a JSON string is decoded (OpenAI's wire form), a
    string that is not JSON is kept as the string, anything else is returned as it is."""
    if isinstance(arguments, str):
        try:
            return json.loads(arguments)
        except ValueError:
            return arguments
    return arguments


def same_arguments(predicted: Any, logged: Any) -> bool:
    """Whether two tool calls' arguments are equal as JSON values (see the module docstring)."""
    return _canonical(parse_arguments(predicted)) == _canonical(parse_arguments(logged))


def score_action(predicted: Action | None, logged: Action) -> tuple[bool, bool]:
    """``(name_ok, name_and_arguments_ok)`` of one predicted action against the logged one; a
    missing prediction (``None``: the policy produced nothing parseable) scores ``(False, False)``."""
    if predicted is None or predicted.name != logged.name:
        return False, False
    if logged.name == ANSWER:
        return True, True
    return True, same_arguments(predicted.arguments, logged.arguments)


@dataclass(frozen=True)
class Accuracy:
    """An accuracy over turns with its 95% Wilson interval (Wilson 1927)."""

    rate: float
    ci_low: float
    ci_high: float
    correct: int
    n: int


def accuracy(hits: Sequence[bool]) -> Accuracy:
    """The share of ``hits`` that are true, with its Wilson interval.

    Raises:
        ValueError: ``hits`` is empty.
    """
    if not hits:
        raise ValueError("no turns to score")
    correct = int(sum(bool(h) for h in hits))
    low, high = wilson_interval(correct, len(hits))
    return Accuracy(rate=correct / len(hits), ci_low=low, ci_high=high, correct=correct, n=len(hits))


def action_breakdown(logged: Sequence[Action], predicted: Sequence[Action | None]) -> dict[str, dict[str, int]]:
    """What a policy did on the logged text-answer turns and on the logged tool-call turns: the
    counts behind its accuracy (a policy that answers in text everywhere is right on every answer
    turn and on no call; one that calls tools everywhere the reverse).

    Args:
        logged / predicted: ``[turns]`` the logged actions and the policy's (``None``: nothing
            parseable).

    Returns:
        ``{"answer_turns": {"n", "answered", "called", "unparsed"}, "tool_turns": {"n",
        "answered", "called", "unparsed", "right_name", "right_arguments"}}``, counts of turns.

    Raises:
        ValueError: the sequences differ in length.
    """
    if len(logged) != len(predicted):
        raise ValueError(f"{len(logged)} logged actions but {len(predicted)} predicted")
    out = {kind: {"n": 0, "answered": 0, "called": 0, "unparsed": 0} for kind in ("answer_turns", "tool_turns")}
    out["tool_turns"].update(right_name=0, right_arguments=0)
    for ref, pred in zip(logged, predicted):
        counts = out["answer_turns" if ref.name == ANSWER else "tool_turns"]
        counts["n"] += 1
        counts["unparsed" if pred is None else "answered" if pred.name == ANSWER else "called"] += 1
        if ref.name != ANSWER:
            name_ok, both_ok = score_action(pred, ref)
            counts["right_name"] += name_ok
            counts["right_arguments"] += both_ok
    return out


def next_action_report(
    trajectory_ids: Sequence[str],
    logged: Sequence[Action],
    candidate: Sequence[Action | None],
    champion: Sequence[Action | None],
    n_resamples: int = 10_000,
    seed: int = 0,
) -> dict[str, Any]:
    """Next-action accuracy of candidate and champion on the same held-out turns, and their paired
    difference clustered by trajectory.

    Args:
        trajectory_ids: ``[turns]`` the trajectory each turn belongs to (the bootstrap's clusters).
        logged: ``[turns]`` the logged actions (references).
        candidate / champion: ``[turns]`` each policy's greedy action in the same context, ``None``
            where it produced nothing parseable.

    Returns:
        ``{"n_turns", "n_trajectories", "candidate": {"name": Accuracy, "name_and_arguments":
        Accuracy}, "champion": {...}, "difference": {"name": PairedBootstrapResult,
        "name_and_arguments": ...}, "breakdown": {"candidate": ..., "champion": ...}}`` as plain
        dicts (JSON-ready); ``difference`` is candidate minus champion in accuracy points (a
        fraction); ``breakdown`` is :func:`action_breakdown` of each.

    Raises:
        ValueError: the sequences differ in length or are empty.
    """
    n = len(logged)
    if not n or not (len(trajectory_ids) == len(candidate) == len(champion) == n):
        raise ValueError(f"need equal, non-empty sequences; got {len(trajectory_ids)} ids, {n} logged, "
                         f"{len(candidate)} candidate and {len(champion)} champion actions")  # fmt: skip
    scores = {
        "candidate": [score_action(p, ref) for p, ref in zip(candidate, logged)],
        "champion": [score_action(p, ref) for p, ref in zip(champion, logged)],
    }
    report: dict[str, Any] = {"n_turns": n, "n_trajectories": len(set(trajectory_ids))}
    for policy, pairs in scores.items():
        report[policy] = {
            "name": asdict(accuracy([name for name, _ in pairs])),
            "name_and_arguments": asdict(accuracy([both for _, both in pairs])),
        }
    report["difference"] = {}
    for position, measure in enumerate(("name", "name_and_arguments")):
        cand = [float(pair[position]) for pair in scores["candidate"]]
        champ = [float(pair[position]) for pair in scores["champion"]]
        report["difference"][measure] = asdict(
            paired_bootstrap(cand, champ, n_resamples=n_resamples, seed=seed, clusters=list(trajectory_ids))
        )
    report["breakdown"] = {"candidate": action_breakdown(logged, candidate), "champion": action_breakdown(logged, champion)}
    return report
