"""Demonstration selection: flows captured through the proxy become few-shot demonstrations of
the conversation the agent had, candidates are seeded draws, the best mean wins."""

import json

import pytest

from flow_assets.logs.schema import Outcome
from flow_assets.policy.prompt import PromptPolicy
from flow_assets.policy.prompt_search import best_candidate, demonstration_pool, fewshot_candidates
from flow_assets.serving.gateway.capture import Choice, OpenRollout, RolloutSettings, Turn, build_trajectory


def _proxied(task_id: str, question: str, expression: str, answer: str, score: float):
    """The trajectory the proxy lands for a two-call calculator conversation (text-only turns)."""
    user = {"role": "user", "content": question}
    call = {"id": f"call_{task_id}", "type": "function", "function": {"name": "calculator", "arguments": f'{{"expression": "{expression}"}}'}}
    first = Turn([user], [], [Choice([], [], "", None, [call], "tool_calls")], "policy", "v0", 1.0, 1.0, 5.0, upstream_model="m")
    history = [user, {"role": "assistant", "content": None, "tool_calls": [call]}, {"role": "tool", "tool_call_id": call["id"], "content": answer}]
    second = Turn(history, [], [Choice([], [], f"It is {answer}.", f"It is {answer}.", [], "stop")], "policy", "v0", 1.0, 1.0, 5.0, upstream_model="m")
    rollout = OpenRollout(task_id, RolloutSettings(task_id=task_id), [first, second])
    return build_trajectory(rollout, Outcome(success=score >= 1, score=score)), history + [{"role": "assistant", "content": f"It is {answer}."}]


def test_successful_proxied_flows_become_the_conversations_the_agent_had():
    good, conversation = _proxied("word-boxes-3-4", "A box holds 4 eggs. How many eggs are in 3 boxes?", "3*4", "12", 1.0)
    bad, _ = _proxied("word-bags-5-6", "Each bag has 6 marbles. How many in 5 bags?", "5+6", "11", 0.0)
    held, _ = _proxied("word-buses-2-9", "A bus has 9 seats. How many on 2 buses?", "2*9", "18", 1.0)
    again, _ = _proxied("word-boxes-3-4", "A box holds 4 eggs. How many eggs are in 3 boxes?", "3*4", "12", 1.0)
    pool = demonstration_pool([held, bad, good, again], held_out=["word-buses-2-9"])
    assert [d.task_id for d in pool] == ["word-boxes-3-4"]  # failures, held-out tasks and repeats are not demonstrations
    assert list(pool[0].messages) == conversation
    # as a prompt policy's demonstration, the conversation is applied before the agent's question
    # (its null fields left out, as the agent's own messages are forwarded)
    messages, _ = PromptPolicy("", (pool[0].messages,)).apply([{"role": "user", "content": "q"}], None)
    assert messages == [*({k: v for k, v in m.items() if v is not None} for m in conversation), {"role": "user", "content": "q"}]


def test_candidates_are_seeded_distinct_draws_after_the_base_and_ties_go_to_the_earlier():
    pool = [demonstration_pool([_proxied(f"t{i}", f"q{i}", f"{i}*2", str(2 * i), 1.0)[0]])[0] for i in range(5)]
    base = PromptPolicy("Use the calculator.")
    candidates = fewshot_candidates(base, pool, k=2, num_candidates=6, seed=1)
    assert candidates[0] == base and len(candidates) == 7
    assert all(c.instructions == base.instructions and len(c.demonstrations) == 2 for c in candidates[1:])
    assert len({frozenset(json.dumps(d, sort_keys=True) for d in c.demonstrations) for c in candidates[1:]}) == 6  # distinct subsets
    assert fewshot_candidates(base, pool, k=2, num_candidates=6, seed=1) == candidates  # seeded
    assert len(fewshot_candidates(base, pool[:2], k=2, num_candidates=6)) == 2  # one distinct pair exists
    assert best_candidate([[0.0, 1.0], [1.0, 1.0], [1.0, 1.0]]) == 1 and best_candidate([[0.5], [0.0]]) == 0
    with pytest.raises(ValueError):
        best_candidate([[1.0], []])
