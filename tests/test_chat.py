"""Chat templates to token ids, demonstrations to training rows, and tool calls parsed back."""

import json

import pytest

from flow_assets.policy.chat import conversation_rows, render_prompt, template_messages
from flow_assets.policy.tokenizer import build_char_tokenizer
from flow_assets.policy.tool_calls import parse_tool_calls
from flow_assets.tasks.calculator import CALCULATOR_TOOL, CalculatorSource

TOK = build_char_tokenizer()
LOOKUP = {"type": "function", "function": {"name": "lookup", "parameters": {"type": "object", "properties": {"key": {}, "field": {}}}}}


def test_compact_template_renders_a_tool_conversation_in_few_characters():
    source = CalculatorSource()
    task = source.tasks("train")[0]
    text, ids = render_prompt(TOK, source.demonstration(task), source.tools, add_generation_prompt=False)
    result = task.reference
    assert text == f"<bos>U:{task.prompt}\nA:@calculator({task.prompt})<eos>T:{result}\nA:{result}<eos>"
    assert ids[0] == TOK.bos_token_id and ids.count(TOK.eos_token_id) == 2
    assert len(ids) == len(text) - 2 * len("<eos>") - len("<bos>") + 3  # one id per character, specials whole


def test_demonstration_rows_are_the_cuts_the_gateway_samples_at():
    source = CalculatorSource()
    conversation = source.demonstration(source.tasks("train")[3])
    (p1, c1), (p2, c2) = conversation_rows(TOK, conversation, source.tools)
    # each prompt is what the gateway renders for that call; each completion ends with <eos>
    assert p1 == render_prompt(TOK, conversation[:1], source.tools)[1]
    assert p2 == render_prompt(TOK, conversation[:3], source.tools)[1]
    assert c1[-1] == c2[-1] == TOK.eos_token_id
    assert p2[: len(p1) + len(c1)] == p1 + c1  # turn 2's prompt holds turn 1 as it was sampled
    with pytest.raises(ValueError, match="assistant"):
        conversation_rows(TOK, conversation[:1])


def test_openai_arguments_become_a_mapping_for_templates():
    sent = [{"role": "assistant", "content": None,
             "tool_calls": [{"id": "c", "type": "function", "function": {"name": "lookup", "arguments": '{"key": "a", "field": 2}'}}]},
            {"role": "user", "content": [{"type": "text", "text": "x"}, {"type": "text", "text": "y"}]}]  # fmt: skip
    out = template_messages(sent)
    assert out[0]["tool_calls"][0]["function"]["arguments"] == {"key": "a", "field": 2}
    assert out[1]["content"] == "xy" and sent[0]["tool_calls"][0]["function"]["arguments"] == '{"key": "a", "field": 2}'


@pytest.mark.parametrize(
    "text, content, calls",
    [
        ("@calculator(874*59)", None, [("calculator", {"expression": "874*59"})]),
        ("let me see @calculator(1+2)", "let me see ", [("calculator", {"expression": "1+2"})]),
        ('@lookup({"key": "a", "field": 2})@calculator(3)', None, [("lookup", {"key": "a", "field": 2}), ("calculator", {"expression": "3"})]),
        ("@weather(paris)", "@weather(paris)", []),  # a tool that was not offered: plain text
        ("@calculator(1+2", "@calculator(1+2", []),  # unfinished
        ('@lookup({"key": )', '@lookup({"key": )', []),  # malformed JSON
        ("51566", "51566", []),
    ],
)
def test_compact_tool_calls_parse_back_to_openai_calls(text, content, calls):
    parsed = parse_tool_calls(text, "compact", [CALCULATOR_TOOL, LOOKUP])
    assert parsed.content == content
    assert [(c.name, json.loads(c.arguments)) for c in parsed.tool_calls] == calls


def test_a_rendered_call_parses_back_to_the_same_call():
    args = {"expression": "12*(3+4)"}
    message = {"role": "assistant", "content": None,
               "tool_calls": [{"id": "c", "type": "function", "function": {"name": "calculator", "arguments": json.dumps(args)}}]}  # fmt: skip
    prompt, _ = render_prompt(TOK, [{"role": "user", "content": "q"}], [CALCULATOR_TOOL])
    full, _ = render_prompt(TOK, [{"role": "user", "content": "q"}, message], [CALCULATOR_TOOL], add_generation_prompt=False)
    completion = full[len(prompt) :].removesuffix("<eos>")
    (call,) = parse_tool_calls(completion, "compact", [CALCULATOR_TOOL]).tool_calls
    assert json.loads(call.arguments) == args


def test_hermes_tool_calls():
    text = 'Checking.\n<tool_call>\n{"name": "calculator", "arguments": {"expression": "2*3"}}\n</tool_call>'
    parsed = parse_tool_calls(text, "hermes", [CALCULATOR_TOOL])
    assert parsed.content == "Checking." and json.loads(parsed.tool_calls[0].arguments) == {"expression": "2*3"}
    assert parse_tool_calls("<tool_call>{oops}</tool_call>", "hermes", [CALCULATOR_TOOL]).tool_calls == ()
    assert parse_tool_calls("@calculator(1)", "compact", None).tool_calls == ()  # no tools offered
    with pytest.raises(ValueError, match="format"):
        parse_tool_calls("x", "xml", [CALCULATOR_TOOL])


def test_arguments_that_would_not_parse_back_bare_are_rendered_as_json():
    for value in ("(1+2", 7):
        message = {"role": "assistant", "content": None,
                   "tool_calls": [{"id": "c", "type": "function", "function": {"name": "calculator", "arguments": json.dumps({"expression": value})}}]}  # fmt: skip
        text, _ = render_prompt(TOK, [message], None, add_generation_prompt=False)
        (call,) = parse_tool_calls(text.removeprefix("<bos>A:").removesuffix("<eos>"), "compact", [CALCULATOR_TOOL]).tool_calls
        assert json.loads(call.arguments) == {"expression": value}
