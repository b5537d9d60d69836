"""Prompt policies: how one is applied to a request, its file and content hash, and its checks."""

import json

import pytest

from flow_assets.policy.prompt import PROMPT_POLICY_FILE, PromptPolicy, PromptPolicyError
from resources.registry import adapter_problem

TOOL = {"type": "function", "function": {"name": "calculator", "description": "old", "parameters": {"type": "object"}}}
DEMO = ({"role": "user", "content": "2+2"},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "c", "type": "function", "function": {"name": "calculator", "arguments": '{"expression": "2+2"}'}}]},
        {"role": "tool", "tool_call_id": "c", "content": "4"},
        {"role": "assistant", "content": "4"})  # fmt: skip
#: DEMO as applied: null fields left out
SENT = tuple({k: v for k, v in m.items() if v is not None} for m in DEMO)


def test_instructions_go_first_in_the_agents_system_message_and_demonstrations_follow_it():
    policy = PromptPolicy("Use the calculator.", (DEMO,), {"calculator": "evaluates arithmetic"})
    messages = [{"role": "system", "content": "You are a bot."}, {"role": "user", "content": "7*6"}]
    out, tools = policy.apply(messages, [TOOL])
    assert out == [{"role": "system", "content": "Use the calculator.\n\nYou are a bot."}, *SENT, {"role": "user", "content": "7*6"}]
    assert "content" not in out[2] and out[2]["tool_calls"] == DEMO[1]["tool_calls"]
    assert tools == [{"type": "function", "function": {"name": "calculator", "description": "evaluates arithmetic", "parameters": {"type": "object"}}}]
    assert messages[0]["content"] == "You are a bot." and TOOL["function"]["description"] == "old"  # inputs untouched


def test_without_a_system_message_the_instructions_become_one_and_an_empty_policy_changes_nothing():
    messages = [{"role": "user", "content": "7*6"}]
    out, tools = PromptPolicy("Be brief.", (DEMO,)).apply(messages, None)
    assert out == [{"role": "system", "content": "Be brief."}, *SENT, messages[0]] and tools is None
    assert PromptPolicy().apply(messages, [TOOL]) == (messages, [TOOL])
    parts = [{"role": "system", "content": [{"type": "text", "text": "own"}]}, messages[0]]
    assert PromptPolicy("first").apply(parts, None)[0][0]["content"] == [{"type": "text", "text": "first\n\n"}, {"type": "text", "text": "own"}]
    # demonstrations only: after the system message, before the question
    assert PromptPolicy("", (DEMO,)).apply(parts, None)[0] == [parts[0], *SENT, messages[0]]


def test_the_file_round_trips_with_a_content_hash_that_catches_hand_edits(tmp_path):
    policy = PromptPolicy("Use the calculator.", (DEMO,), {"calculator": "x"})
    directory = policy.save(tmp_path / "v1")
    assert PromptPolicy.load(directory) == policy and adapter_problem(directory) is None
    assert PromptPolicy("Use the calculator.", (DEMO,), {"calculator": "x"}).content_hash == policy.content_hash != PromptPolicy("other").content_hash
    data = json.loads((directory / PROMPT_POLICY_FILE).read_text())
    data["instructions"] = "edited"
    (directory / PROMPT_POLICY_FILE).write_text(json.dumps(data))
    with pytest.raises(PromptPolicyError, match="content_hash"):
        PromptPolicy.load(directory)
    assert "prompt policy cannot be read" in adapter_problem(directory)


@pytest.mark.parametrize(
    "data, field",
    [([], "expected a JSON object"), ({"instructions": 3}, "instructions"), ({"demonstrations": [[]]}, r"demonstrations\[0\]"),
     ({"demonstrations": [[{"role": "system", "content": "x"}]]}, r"demonstrations\[0\]\[0\].role"),
     ({"tool_descriptions": {"a": 1}}, "tool_descriptions"), ({"instruction": "typo"}, "unknown field 'instruction'")],
)  # fmt: skip
def test_a_bad_policy_file_names_its_field(tmp_path, data, field):
    (tmp_path / PROMPT_POLICY_FILE).write_text(json.dumps(data))
    with pytest.raises(PromptPolicyError, match=field) as error:
        PromptPolicy.load(tmp_path)
    assert str(tmp_path / PROMPT_POLICY_FILE) in str(error.value)
