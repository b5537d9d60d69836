"""Demonstration selection for prompt policies: few-shot candidates bootstrapped from the
successful flows in the lake, chosen by random search on train tasks.

The search follows DSPy's ``BootstrapFewShotWithRandomSearch`` (Khattab et al. 2023, "DSPy:
Compiling Declarative Language Model Calls into Self-Improving Pipelines", section 3.3 and its
``teleprompt/random_search.py``): the demonstrations are successful traces of the program itself
(here: trajectories of the agent with a reward at or above a threshold, rebuilt as chat
conversations), candidate 0 is the starting prompt unchanged, and every further candidate is a
random draw of ``k`` demonstrations; each candidate is scored on the same train tasks and the best
mean reward wins (ties: the earlier candidate, so the starting prompt wins a tie). The winner is
then a *candidate* only: the gate compares it with the champion on the held-out split.

Pure functions (no gateway, no Dagster): the caller evaluates the candidates.
"""

from __future__ import annotations

import json
import random
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from flow_assets.logs.schema import Trajectory
from flow_assets.policy.logged_rows import trajectory_conversation
from flow_assets.policy.prompt import PromptPolicy


@dataclass(frozen=True)
class Demonstration:
    """One successful flow as a few-shot example.

    Attributes:
        task_id: the task it solved (one demonstration per task in a candidate; never a held-out task).
        messages: the conversation from its first user message to its final answer (chat-completions
            messages: ``user``, ``assistant`` with ``content`` or ``tool_calls``, ``tool``).
        score: its reward.
    """

    task_id: str
    messages: tuple[dict[str, Any], ...]
    score: float


def demonstration_pool(trajectories: Sequence[Trajectory], min_score: float = 1.0, held_out: Sequence[str] = (),
                       call_format: str = "hermes", max_turns: int | None = None) -> list[Demonstration]:  # fmt: skip
    """The successful trajectories as demonstrations, one per task (the first in order).

    Args:
        trajectories: canonical trajectories with outcomes (unscored ones are skipped).
        min_score: the least ``outcome.score`` that counts as a success.
        held_out: task ids that must never become demonstrations (the held-out split).
        call_format: the tool-call syntax of the captured text (:func:`trajectory_conversation`).
        max_turns: skip flows with more assistant turns than this (``None``: no cap).

    Returns:
        Demonstrations ordered by task id (so a seeded draw does not depend on arrival order).
    """
    excluded, pool = set(held_out), {}
    for t in trajectories:
        if t.outcome is None or t.outcome.score is None or t.outcome.score < min_score or t.task_id in excluded or t.task_id in pool:
            continue
        conversation = trajectory_conversation(t, call_format)
        messages = [_wire_message(m) for m in conversation.messages if m.get("role") in ("user", "assistant", "tool")]
        if not messages or messages[0].get("role") != "user" or messages[-1].get("role") != "assistant":
            continue
        if max_turns is not None and len(conversation.turns) > max_turns:
            continue
        pool[t.task_id] = Demonstration(t.task_id, tuple(messages), float(t.outcome.score))
    return [pool[k] for k in sorted(pool)]


def _wire_message(message: dict[str, Any]) -> dict[str, Any]:
    """A rebuilt message as an OpenAI-compatible server takes it: tool call arguments as JSON
    text, and no empty text beside tool calls."""
    out = dict(message)
    if out.get("tool_calls"):
        out["tool_calls"] = [
            {**c, "function": {**c["function"], "arguments": a if isinstance(a := c["function"].get("arguments", {}), str) else json.dumps(a)}}
            for c in out["tool_calls"]
        ]  # fmt: skip
        if not out.get("content"):
            out["content"] = None
    return out


def fewshot_candidates(base: PromptPolicy, pool: Sequence[Demonstration], k: int, num_candidates: int, seed: int = 0) -> list[PromptPolicy]:
    """Candidate 0 is ``base``; candidates 1..``num_candidates`` add ``k`` demonstrations drawn
    without replacement from ``pool`` (distinct draws; fewer candidates when the pool holds fewer
    distinct subsets), after the base's own demonstrations.

    Raises:
        ValueError: ``k < 1`` or ``num_candidates < 0``.
    """
    if k < 1 or num_candidates < 0:
        raise ValueError(f"need k >= 1 and num_candidates >= 0, got k={k}, num_candidates={num_candidates}")
    rng = random.Random(seed)
    candidates, seen = [base], set()
    k = min(k, len(pool))
    attempts = 0
    while k and len(candidates) <= num_candidates and attempts < 50 * (num_candidates + 1):
        attempts += 1
        picked = tuple(sorted(rng.sample(range(len(pool)), k)))
        if picked in seen:
            continue
        seen.add(picked)
        order = list(picked)
        rng.shuffle(order)  # DSPy shuffles its train set per candidate: the order is part of the draw
        demos = tuple(pool[i].messages for i in order)
        candidates.append(replace(base, demonstrations=base.demonstrations + demos))
    return candidates


def best_candidate(scores: Sequence[Sequence[float]]) -> int:
    """The index of the candidate with the highest mean reward (``scores[i]``: candidate ``i``'s
    rewards on the same train tasks); ties go to the lower index.

    Raises:
        ValueError: no candidate, or a candidate with no scores.
    """
    if not scores or any(len(s) == 0 for s in scores):
        raise ValueError("every candidate needs at least one score")
    means = [sum(s) / len(s) for s in scores]
    return max(range(len(means)), key=lambda i: (means[i], -i))
