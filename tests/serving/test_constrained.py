"""tool_choice and response_format enforced by constrained decoding, over real HTTP with the
official ``openai`` client against the real gateway on the tiny models."""

import asyncio
import json
from pathlib import Path

import httpx
import jsonschema
import openai
import pytest

from flow_assets.logs.schema import Trajectory
from flow_assets.policy.store import PolicyStore
from flow_assets.serving.gateway.app import GatewayConfig
from flow_assets.serving.gateway.serve import serve_policy
from flow_assets.tasks.calculator import CALCULATOR_TOOL

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city over the next days.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "enum": ["Paris", "Rome", "Oslo"]}, "days": {"type": "integer", "minimum": 1, "maximum": 14}},
            "required": ["city", "days"],
            "additionalProperties": False,
        },
    },
}
TOOLS = [CALCULATOR_TOOL, WEATHER_TOOL]
PARAMETERS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
TRIP = {
    "type": "object",
    "properties": {
        "city": {"enum": ["Paris", "Rome", "Oslo"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 14},
        "direct": {"type": "boolean"},
    },
    "required": ["city", "days", "direct"],
    "additionalProperties": False,
}
RESPONSE_FORMAT = {"type": "json_schema", "json_schema": {"name": "trip", "schema": TRIP, "strict": True}}


@pytest.fixture(scope="module")
def fresh_server(fresh_policy_dir, tmp_path_factory):
    with serve_policy(PolicyStore(str(fresh_policy_dir)), tmp_path_factory.mktemp("landing")) as server:
        yield server


@pytest.fixture(scope="module")
def calculator_server(calculator_policy_dir, tmp_path_factory):
    with serve_policy(PolicyStore(str(calculator_policy_dir)), tmp_path_factory.mktemp("landing")) as server:
        yield server


async def _many(url: str, bodies: list[dict]) -> list:
    """The chat completions of ``bodies``, sent at once (they decode in one running batch)."""
    async with openai.AsyncOpenAI(base_url=url + "/v1", api_key="x") as client:
        return await asyncio.gather(*(client.chat.completions.create(**b) for b in bodies))


def _calls(choice) -> list[tuple[str, dict]]:
    return [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls or []]


def test_tool_choice_required_makes_every_sample_a_valid_call_of_an_offered_tool(calculator_server):
    prompts = ["874*59", "hello", "what is the weather", "12*(3+4)", "ok"]
    bodies = [
        {"model": "policy", "messages": [{"role": "user", "content": p}], "tools": TOOLS, "tool_choice": "required",
         "temperature": 1.0, "n": 10, "seed": seed, "max_tokens": 64}
        for seed, p in enumerate(prompts)
    ]  # fmt: skip
    choices = [c for r in asyncio.run(_many(calculator_server.url, bodies)) for c in r.choices]
    assert len(choices) == 50  # 5 requests x n=10, sampled at T = 1
    for choice in choices:
        calls = _calls(choice)
        assert choice.finish_reason == "tool_calls" and calls, choice.message.content
        assert choice.message.content is None  # the completion is the call(s), nothing else
        for name, arguments in calls:
            jsonschema.validate(arguments, PARAMETERS[name])
    # unconstrained, the same policy answers "hello" with text: the call was the constraint's doing
    plain = asyncio.run(_many(calculator_server.url, [{**bodies[1], "tool_choice": "auto"}]))[0]
    assert any(not c.message.tool_calls for c in plain.choices)


def test_a_named_tool_choice_calls_that_tool_streamed_or_not_and_the_turn_is_captured_as_constrained(fresh_server):
    url = fresh_server.url
    httpx.post(f"{url}/rollouts", json={"rollout_id": "named", "task_id": "t", "batch": "named"})
    client = openai.OpenAI(base_url=f"{url}/rollouts/named/v1", api_key="x")
    body = {"model": "policy", "messages": [{"role": "user", "content": "874*59"}], "tools": TOOLS, "seed": 5,
            "tool_choice": {"type": "function", "function": {"name": "get_weather"}}, "parallel_tool_calls": False,
            "temperature": 1.0, "max_tokens": 100, "logprobs": True}  # fmt: skip
    reply = client.chat.completions.create(**body, n=8)
    for choice in reply.choices:
        ((name, arguments),) = _calls(choice)
        assert name == "get_weather" and choice.finish_reason == "tool_calls"
        jsonschema.validate(arguments, PARAMETERS["get_weather"])
        logprobs = [t.logprob for t in choice.logprobs.content]
        # the prefix '@get_weather(' is the only text the grammar allows: each of its tokens had
        # probability 1 under the masked distribution, as did the end once the call was closed
        forced = len("@get_weather(")
        assert logprobs[:forced] == [0.0] * forced and logprobs[-1] == 0.0
        assert all(lp <= 0.0 for lp in logprobs) and any(lp < 0.0 for lp in logprobs)
    streamed = list(client.chat.completions.create(**body, stream=True))
    calls = [tc for c in streamed for tc in c.choices[0].delta.tool_calls or []] if streamed else []
    assert calls[0].function.name == "get_weather" and streamed[-1].choices[0].finish_reason == "tool_calls"
    assert json.loads(calls[1].function.arguments) == json.loads(reply.choices[0].message.tool_calls[0].function.arguments)
    httpx.post(f"{url}/rollouts/named/finish", json={"score": 1.0})
    path = httpx.post(f"{url}/batches/named/close").json()["path"]
    (trajectory,) = [Trajectory.model_validate_json(line) for line in Path(path).read_text().splitlines()]
    assert trajectory.metadata["constrained_turns"] == [{"turn": k, "constraint": "tool_choice:function"} for k in (0, 1)]
    assert trajectory.steps[0].kind == "tool" and trajectory.steps[0].tool == "get_weather"


def test_json_schema_makes_every_sample_valid_json_of_the_schema_and_leaves_unconstrained_rows_alone(fresh_server):
    url = fresh_server.url
    plain = {"model": "policy", "messages": [{"role": "user", "content": "ab"}], "seed": 11, "max_tokens": 40, "logprobs": True}
    alone = asyncio.run(_many(url, [plain]))[0]
    constrained = [
        {"model": "policy", "messages": [{"role": "user", "content": f"trip {k}"}], "response_format": RESPONSE_FORMAT,
         "temperature": 1.0, "n": 10, "seed": k, "max_tokens": 64}
        for k in range(5)
    ]  # fmt: skip
    together, *replies = asyncio.run(_many(url, [plain, *constrained]))
    choices = [c for r in replies for c in r.choices]
    assert len(choices) == 50
    for choice in choices:
        assert choice.finish_reason == "stop"
        jsonschema.validate(json.loads(choice.message.content), TRIP)
    # a seeded unconstrained call samples the same tokens whether or not constrained rows decode
    # beside it (its log-probs agree up to the float rounding of the batch's shape, as for any batch;
    # bit for bit in the same shape: the test below)
    (a,), (b,) = alone.choices, together.choices
    assert [t.token for t in a.logprobs.content] == [t.token for t in b.logprobs.content] and a.message.content == b.message.content
    assert [t.logprob for t in a.logprobs.content] == pytest.approx([t.logprob for t in b.logprobs.content], abs=1e-4)
    # any JSON object; a random model's strings may run to max_tokens, every completion that ended did so as an object
    objects = asyncio.run(_many(url, [{**constrained[0], "response_format": {"type": "json_object"}}]))[0].choices
    ended = [json.loads(c.message.content) for c in objects if c.finish_reason == "stop"]
    assert ended and all(isinstance(o, dict) for o in ended)


def test_a_constrained_row_leaves_the_unconstrained_rows_of_its_batch_bit_for_bit_as_they_were(fresh_policy_dir):
    """The decoder with one constrained row beside unconstrained ones, against the same batch with
    that row unconstrained and cut where the constrained one ended (so every step has the same
    shape): the unconstrained rows' tokens and log-probs are identical to the bit."""
    from flow_assets.policy.chat import render_prompt
    from flow_assets.policy.constrained import ConstraintCompiler
    from flow_assets.policy.decode import DecodeRow, RowDecoder, row_streams

    store = PolicyStore(str(fresh_policy_dir))
    model, tokenizer = store.load(str(store.adapter_dir("v0")))
    constraint = ConstraintCompiler(tokenizer, model.config.vocab_size, "compact").response_format(RESPONSE_FORMAT)
    prompts = [render_prompt(tokenizer, [{"role": "user", "content": c}])[1] for c in ("ab", "trip", "xyz")]

    def decode(matcher, cut: int = 60) -> list[DecodeRow]:
        streams = row_streams(3, 3)
        budget = constraint.budget() if matcher is not None else None
        rows = [DecodeRow(list(p), 1.0, 1.0, cut if k == 1 else 60, s, matcher=matcher if k == 1 else None,
                          budget=budget if k == 1 else None)
                for k, (p, s) in enumerate(zip(prompts, streams))]  # fmt: skip
        # no token ends a row (eos -1): the plain row 1 of the second run cannot end before the
        # step its constrained twin ended on, and rows 0 and 2 run to 60 in both
        decoder = RowDecoder(model, -1, tokenizer.pad_token_id)
        decoder.add(rows)
        while decoder.size:
            decoder.step()
        return rows

    constrained = decode(constraint.matcher())
    json_text = tokenizer.decode(constrained[1].tokens[:-1])
    jsonschema.validate(json.loads(json_text), TRIP)
    # the constrained row ended on the step that sampled its closing "}" (the end appended with it)
    assert constrained[1].finished and constrained[1].tokens[-1] == -1 and constrained[1].logprobs[-1] == 0.0
    plain = decode(None, cut=len(constrained[1].tokens) - 1)
    assert plain[1].tokens != constrained[1].tokens  # the constraint did change that row
    for k in (0, 2):
        assert (plain[k].tokens, plain[k].logprobs) == (constrained[k].tokens, constrained[k].logprobs)


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"response_format": {"type": "xml"}}, "response_format"),
        ({"response_format": {"type": "json_schema", "json_schema": {"schema": TRIP}}}, "response_format"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}},
         "response_format.json_schema.schema"),
        ({"tool_choice": "always"}, "tool_choice"),
        ({"tool_choice": "required"}, "tool_choice"),  # no tools offered
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "search"}}}, "tool_choice"),
        ({"tools": [{"type": "function", "function": {"name": "9lives"}}], "tool_choice": "required"}, "tool_choice"),
        ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "response_format"),
    ],
)  # fmt: skip
def test_what_cannot_be_enforced_is_a_400_naming_the_field(fresh_server, extra, param):
    client = openai.OpenAI(base_url=fresh_server.url + "/v1", api_key="x")
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "a"}], max_tokens=4, **extra)
    assert refused.value.param == param


def test_the_dynamic_batcher_refuses_constraints_with_a_400(fresh_policy_dir, tmp_path):
    with serve_policy(PolicyStore(str(fresh_policy_dir)), tmp_path, config=GatewayConfig(continuous=False)) as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="x")
        with pytest.raises(openai.BadRequestError) as refused:
            client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "a"}], response_format={"type": "json_object"})
        assert refused.value.param == "response_format" and "not enforced" in refused.value.message
        # unconstrained calls are served as ever
        assert client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "a"}], max_tokens=4).choices


@pytest.mark.parametrize("fmt", ["compact", "hermes"])
def test_random_walks_through_either_call_grammar_parse_as_valid_calls(fmt):
    """The grammar of each call syntax, walked by drawing uniformly among the tokens its mask
    allows (a policy that knows nothing), only yields text the gateway's parser reads as valid
    calls: the hermes syntax has no tiny model to serve it."""
    import numpy as np

    from flow_assets.policy.constrained import ConstraintCompiler, allowed_tokens
    from flow_assets.policy.tokenizer import build_char_tokenizer
    from flow_assets.policy.tool_calls import parse_tool_calls

    tokenizer = build_char_tokenizer()
    no_arguments = {"type": "function", "function": {"name": "now", "parameters": {"type": "object", "properties": {}, "additionalProperties": False}}}
    tools = [WEATHER_TOOL, no_arguments]
    constraint = ConstraintCompiler(tokenizer, len(tokenizer), fmt).tool_choice("required", tools)
    rng = np.random.default_rng(0)
    seen = set()
    for _ in range(20):
        matcher, ids = constraint.matcher(), []
        while not matcher.is_stopped():
            allowed = np.flatnonzero(allowed_tokens([matcher], len(tokenizer))[0])
            token = int(rng.choice(allowed))
            if token == tokenizer.eos_token_id:
                break
            assert matcher.consume_token(token)
            ids.append(token)
        text = tokenizer.decode(ids, skip_special_tokens=True)
        parsed = parse_tool_calls(text, fmt, tools)
        assert parsed.error is None and parsed.tool_calls and parsed.content is None, text
        for call in parsed.tool_calls:
            seen.add(call.name)
            if call.name == "get_weather":
                jsonschema.validate(json.loads(call.arguments), PARAMETERS["get_weather"])
    assert seen == {"get_weather", "now"}


@pytest.mark.parametrize("fmt", ["compact", "hermes"])
def test_a_forced_call_admits_only_the_declared_arguments(fmt):
    """An object schema that does not say otherwise is closed (``additionalProperties: false``,
    as OpenAI's strict mode): a forced call can end after its declared keys but cannot add one."""
    from flow_assets.policy.constrained import ConstraintCompiler
    from flow_assets.policy.tokenizer import build_char_tokenizer

    tokenizer = build_char_tokenizer()
    open_schema = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": open_schema}}
    constraint = ConstraintCompiler(tokenizer, len(tokenizer), fmt).tool_choice("required", [tool], parallel=False)
    wrap = ("@get_weather(", ")") if fmt == "compact" else ('<tool_call>{"name": "get_weather", "arguments": ', "}</tool_call>")

    def accepted(arguments: str) -> bool:
        matcher = constraint.matcher()
        ids = tokenizer(wrap[0] + arguments + wrap[1], add_special_tokens=False)["input_ids"]
        return all(matcher.consume_token(i) for i in ids) and matcher.is_accepting()

    assert accepted('{"city": "Oslo"}')
    assert not accepted('{"city": "Oslo", "units": "metric"}')


NOTE_TOOL = {
    "type": "function",
    "function": {"name": "note", "parameters": {"type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]}},
}
NAMED = {"type": "function", "function": {"name": "note"}}
TITLE = {"type": "object", "properties": {"title": {"type": "string"}, "year": {"type": "integer"}}, "required": ["title", "year"]}


@pytest.mark.parametrize("kind", ["compact", "hermes", "json_schema"])
def test_the_budget_makes_every_constrained_row_complete_within_max_tokens(fresh_policy_dir, kind):
    """The random tiny model under a grammar with a free string (a named call's one string
    argument in either call syntax, a JSON object with a string field) and ``max_tokens`` two
    tokens above the shortest completion the budget knows: without the budget most rows are cut
    inside the string; with it every row ends with its grammar complete (a valid call / valid
    JSON), on eight seeds. Forced closing tokens have log-prob 0, every log-prob is <= 0."""
    from flow_assets.policy.chat import render_prompt
    from flow_assets.policy.constrained import ConstraintCompiler
    from flow_assets.policy.decode import DecodeRow, RowDecoder, row_streams
    from flow_assets.policy.tool_calls import parse_tool_calls

    store = PolicyStore(str(fresh_policy_dir))
    model, tokenizer = store.load(str(store.adapter_dir("v0")))
    compiler = ConstraintCompiler(tokenizer, model.config.vocab_size, "hermes" if kind == "hermes" else "compact")
    if kind == "json_schema":
        constraint = compiler.response_format({"type": "json_schema", "json_schema": {"name": "t", "schema": TITLE}})
    else:
        constraint = compiler.tool_choice(NAMED, [NOTE_TOOL], parallel=False)
    prompt = render_prompt(tokenizer, [{"role": "user", "content": "write it"}])[1]
    max_tokens = constraint.start.need + 2

    def valid(row: DecodeRow) -> bool:
        text = tokenizer.decode([t for t in row.tokens if t != tokenizer.eos_token_id], skip_special_tokens=True)
        if kind == "json_schema":
            try:
                jsonschema.validate(json.loads(text), TITLE)
            except (ValueError, jsonschema.ValidationError):  # cut JSON does not parse
                return False
            return True
        parsed = parse_tool_calls(text, kind, [NOTE_TOOL])
        if parsed.error or parsed.content or [c.name for c in parsed.tool_calls] != ["note"]:
            return False
        jsonschema.validate(json.loads(parsed.tool_calls[0].arguments), NOTE_TOOL["function"]["parameters"])
        return True

    def decode(budgeted: bool) -> list[DecodeRow]:
        rows = [DecodeRow(list(prompt), 1.0, 1.0, max_tokens, s, matcher=constraint.matcher(), budget=constraint.budget() if budgeted else None)
                for s in row_streams(29, 8)]  # fmt: skip
        decoder = RowDecoder(model, tokenizer.eos_token_id, tokenizer.pad_token_id)
        decoder.add(rows)
        while decoder.size:
            decoder.step()
        return rows

    without = decode(False)
    assert sum(valid(r) for r in without) <= 4  # the case the budget is for: most rows cut
    rows = decode(True)
    for r in rows:
        assert r.finished and r.error is None and len(r.tokens) <= max_tokens and valid(r), tokenizer.decode(r.tokens)
        assert all(lp <= 0.0 for lp in r.logprobs)
    # the rows that reached their last allowed token were closed by forced tokens (probability 1)
    assert any(len(r.tokens) == max_tokens and r.logprobs[-2:] == [0.0, 0.0] for r in rows)


def test_over_http_a_call_near_max_tokens_is_closed_in_time_and_one_that_cannot_fit_is_cut(fresh_server):
    """A named call whose shortest form (``@note(x)``, 8 tokens) leaves the random tiny model 4
    tokens of argument: every one of 5 seeds x n = 10 is a valid call ending with
    ``tool_calls``; below the shortest form no call fits and the choice ends with ``length``, as
    without the budget. json_schema likewise."""
    base = {"model": "policy", "messages": [{"role": "user", "content": "note"}], "temperature": 1.0, "n": 10}
    calls = [{**base, "tools": [NOTE_TOOL], "tool_choice": NAMED, "parallel_tool_calls": False, "seed": k, "max_tokens": 12} for k in range(5)]
    titles = [{**base, "response_format": {"type": "json_schema", "json_schema": {"name": "t", "schema": TITLE}}, "seed": k,
               "max_tokens": 28} for k in range(5)]  # fmt: skip
    replies = asyncio.run(_many(fresh_server.url, calls + titles))
    for reply in replies[:5]:
        for choice in reply.choices:
            ((name, arguments),) = _calls(choice)
            assert name == "note" and choice.finish_reason == "tool_calls" and isinstance(arguments["text"], str)
    for reply in replies[5:]:
        for choice in reply.choices:
            assert choice.finish_reason == "stop"
            jsonschema.validate(json.loads(choice.message.content), TITLE)
    (short,) = asyncio.run(_many(fresh_server.url, [{**calls[0], "max_tokens": 7}]))
    assert {c.finish_reason for c in short.choices} == {"length"} and all(not c.message.tool_calls for c in short.choices)
