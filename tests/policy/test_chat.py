"""Chat templates to token ids, demonstrations to training rows, and tool calls parsed back."""

import json

import pytest

from flow_assets.policy.chat import TOOL_PROMPT, ChatFormat, chat_format, conversation_rows, render_prompt, template_messages
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
    # a JSON string may hold the closing tag (SmolLM2 under tool_choice="required" wrote one): the
    # block is the JSON value, not the text up to the first </tool_call>
    inside = '<tool_call>{"name": "calculator", "arguments": {"expression": "1}}</tool_call>2"}}\n</tool_call> ok'
    parsed = parse_tool_calls(inside + inside, "hermes", [CALCULATOR_TOOL])
    assert parsed.error is None and parsed.content == "ok ok"
    assert [json.loads(c.arguments) for c in parsed.tool_calls] == [{"expression": "1}}</tool_call>2"}] * 2
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


def _tokenizer_with(template: str):
    tok = build_char_tokenizer()
    tok.chat_template = template
    return tok


#: SmolLM2's template, with the char tokenizer's specials: every message as role + content, tools ignored
CHATML_IGNORING_TOOLS = (
    "{% for message in messages %}{{ bos_token + message['role'] + '\\n' + message['content'] + eos_token + '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ bos_token + 'assistant\\n' }}{% endif %}"
)
#: a template that renders tools and calls itself, as Qwen's and Hermes' do
RENDERING_TOOLS = (
    "{% if tools %}{{ bos_token }}system\nTools:{% for t in tools %} {{ t.function.name }}{% endfor %}{{ eos_token }}{% endif %}"
    "{% for m in messages %}{{ bos_token + m.role + '\\n' }}{% if m.content %}{{ m.content }}{% endif %}"
    "{% for c in m.tool_calls or [] %}<tool_call>{{ {'name': c.function.name, 'arguments': c.function.arguments} | tojson }}</tool_call>{% endfor %}"
    "{{ eos_token }}{% endfor %}{% if add_generation_prompt %}{{ bos_token + 'assistant\\n' }}{% endif %}"
)


def test_chat_format_is_detected_from_what_the_template_renders():
    assert chat_format(TOK) == ChatFormat("compact", inject_tools=False)
    assert chat_format(_tokenizer_with(CHATML_IGNORING_TOOLS)) == ChatFormat("hermes", inject_tools=True)
    assert chat_format(_tokenizer_with(RENDERING_TOOLS)) == ChatFormat("hermes", inject_tools=False)


def test_tools_are_written_into_the_system_message_for_a_template_that_ignores_them():
    tok = _tokenizer_with(CHATML_IGNORING_TOOLS)
    conversation = CalculatorSource().demonstration(CalculatorSource().tasks("train")[0])
    text, _ = render_prompt(tok, conversation, [CALCULATOR_TOOL], add_generation_prompt=False)
    spec = json.dumps(CALCULATOR_TOOL["function"], ensure_ascii=False)
    call = json.dumps({"name": "calculator", "arguments": {"expression": conversation[0]["content"]}})
    assert text.startswith(f"<bos>system\n{TOOL_PROMPT}{spec}<eos>\n<bos>user\n{conversation[0]['content']}<eos>\n")
    assert f"<bos>assistant\n<tool_call>{call}</tool_call><eos>\n<bos>tool\n{conversation[2]['content']}<eos>\n" in text
    # the agent's own system message keeps its text, the tools follow it
    with_system = [{"role": "system", "content": "Be brief."}, *conversation]
    assert render_prompt(tok, with_system, [CALCULATOR_TOOL])[0].startswith(f"<bos>system\nBe brief.\n\n{TOOL_PROMPT}{spec}<eos>")
    # no tools offered: no specification, but calls already made are still written out
    assert TOOL_PROMPT not in render_prompt(tok, conversation, None)[0] and call in render_prompt(tok, conversation, None)[0]


def test_a_template_that_renders_tools_is_used_as_it_is():
    tok = _tokenizer_with(RENDERING_TOOLS)
    conversation = CalculatorSource().demonstration(CalculatorSource().tasks("train")[0])
    text, _ = render_prompt(tok, conversation[:2], [CALCULATOR_TOOL], add_generation_prompt=False)
    assert text.startswith("<bos>system\nTools: calculator<eos>") and TOOL_PROMPT not in text


def test_an_injected_call_parses_back_to_the_call_that_was_rendered():
    tok = _tokenizer_with(CHATML_IGNORING_TOOLS)
    args = {"expression": "12*(3+4)"}
    message = {"role": "assistant", "content": None,
               "tool_calls": [{"id": "c", "type": "function", "function": {"name": "calculator", "arguments": json.dumps(args)}}]}  # fmt: skip
    history = [{"role": "user", "content": "q"}]
    prompt, _ = render_prompt(tok, history, [CALCULATOR_TOOL])
    full, _ = render_prompt(tok, [*history, message], [CALCULATOR_TOOL], add_generation_prompt=False)
    completion = full[len(prompt) :].removesuffix("<eos>\n")
    parsed = parse_tool_calls(completion, "hermes", [CALCULATOR_TOOL])
    assert parsed.content is None and parsed.error is None
    assert [(c.name, json.loads(c.arguments)) for c in parsed.tool_calls] == [("calculator", args)]


def test_demonstration_rows_end_at_the_end_of_turn_token_not_what_the_template_writes_after_it():
    tok = _tokenizer_with(CHATML_IGNORING_TOOLS)
    source = CalculatorSource()
    conversation = source.demonstration(source.tasks("train")[0])
    (p1, c1), (p2, c2) = conversation_rows(tok, conversation, source.tools)
    assert c1[-1] == c2[-1] == tok.eos_token_id and tok.eos_token_id not in c1[:-1]
    # the newline after <eos> opens turn 2's prompt, which holds turn 1 exactly as sampled
    assert p2[: len(p1) + len(c1)] == p1 + c1


@pytest.mark.parametrize(
    "text, reason",
    [
        ('<tool_call>{"name": "calculator", "arguments": {"expression": 80*54}}</tool_call>', "is not JSON"),
        ('<tool_call>{"name": "weather", "arguments": {}}</tool_call>', "'weather', which was not offered"),
        ('<tool_call>{"name": "calculator", "arguments": [1]}</tool_call>', "not a JSON object"),
        ('<tool_call>{"name": "calculator", "arguments": {"expression": "1+2"}}', "not closed"),
        ("@calculator(1+2", None),  # compact syntax is not a hermes attempt
        ("51566", None),
    ],
)
def test_an_attempted_call_that_does_not_parse_is_text_with_its_reason(text, reason):
    parsed = parse_tool_calls(text, "hermes", [CALCULATOR_TOOL])
    assert parsed.content == text and parsed.tool_calls == ()
    assert (parsed.error is None) if reason is None else (reason in parsed.error)
    assert "not closed" in parse_tool_calls("@calculator(1+2", "compact", [CALCULATOR_TOOL]).error
