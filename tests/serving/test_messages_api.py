"""Anthropic's Messages API on the gateway: the translation functions, and the real gateway over
HTTP with the official ``anthropic`` client on the tiny calculator policy."""

import asyncio
import json
from pathlib import Path

import httpx
import openai
import pytest
from pydantic import TypeAdapter

from flow_assets.logs.schema import Trajectory
from flow_assets.policy.store import PolicyStore
from flow_assets.serving.gateway.messages_api import RequestError, parse_request, stream_events, to_chat_request, to_message
from flow_assets.serving.gateway.serve import make_gateway
from flow_assets.serving.gateway.server import GatewayServer
from flow_assets.tasks.calculator import CALCULATOR_TOOL, execute_tool_call

anthropic = pytest.importorskip("anthropic")

TOOL = {
    "name": "calculator",
    "description": CALCULATOR_TOOL["function"]["description"],
    "input_schema": CALCULATOR_TOOL["function"]["parameters"],
}
TOKEN = "team"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


# ---- the translation functions ----


def test_a_messages_request_translates_to_the_chat_request_it_means():
    req = parse_request({
        "model": "policy", "max_tokens": 16, "temperature": 0.5, "top_p": 0.9, "top_k": 5, "stop_sequences": ["END"], "seed": 3,
        "system": [{"type": "text", "text": "be brief"}],
        "metadata": {"user_id": "session-7"},
        "tools": [TOOL], "tool_choice": {"type": "tool", "name": "calculator"},
        "messages": [
            {"role": "user", "content": "874*59"},
            {"role": "assistant", "content": [{"type": "text", "text": "I'll compute."},
                                              {"type": "tool_use", "id": "toolu_1", "name": "calculator", "input": {"expression": "874*59"}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": [{"type": "text", "text": "51566"}]},
                                         {"type": "tool_result", "tool_use_id": "toolu_2", "content": "bad", "is_error": True},
                                         {"type": "text", "text": "and now?"}]},
        ],
    })  # fmt: skip
    chat = to_chat_request(req).model_dump(exclude_none=True)
    assert chat["messages"] == [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "874*59"},
        {"role": "assistant", "content": "I'll compute.",
         "tool_calls": [{"id": "toolu_1", "type": "function", "function": {"name": "calculator", "arguments": '{"expression": "874*59"}'}}]},
        {"role": "tool", "tool_call_id": "toolu_1", "content": "51566"},
        {"role": "tool", "tool_call_id": "toolu_2", "content": "Error: bad"},
        {"role": "user", "content": "and now?"},
    ]  # fmt: skip
    assert chat["tools"] == [{"type": "function", "function": {"name": "calculator", "description": TOOL["description"], "parameters": TOOL["input_schema"]}}]
    assert chat["tool_choice"] == {"type": "function", "function": {"name": "calculator"}}
    assert (chat["max_tokens"], chat["temperature"], chat["top_p"], chat["stop"], chat["user"], chat["seed"]) == (16, 0.5, 0.9, ["END"], "session-7", 3)
    assert chat["stream"] is False and "stream_options" not in chat
    streamed = to_chat_request(parse_request({"model": "m", "max_tokens": 1, "stream": True, "messages": [{"role": "user", "content": "a"}]}))
    assert streamed.stream and streamed.stream_options.include_usage
    for choice, expected in (("auto", "auto"), ("any", "required"), ("none", "none")):
        body = {"model": "m", "max_tokens": 1, "tool_choice": {"type": choice}, "messages": [{"role": "user", "content": "a"}]}
        assert to_chat_request(parse_request(body)).tool_choice == expected


@pytest.mark.parametrize(
    "change, param",
    [
        ({"messages": [{"role": "user", "content": [{"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AA=="}}]}]},
         "messages.0.content.0.type"),
        ({"messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t", "content": [{"type": "document", "source": {}}]}]}]},
         "messages.0.content.0.content.0.type"),
        ({"messages": [{"role": "user", "content": [{"type": "tool_use", "id": "t", "name": "x", "input": {}}]}]}, "messages.0.content.0.type"),
        ({"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "Sure"}]}, "messages.1.role"),
        ({"thinking": {"type": "enabled", "budget_tokens": 1024}}, "thinking.type"),
        ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "tools.0.type"),
        ({"tools": [{"name": "calculator"}]}, "tools.0.input_schema"),
        ({"mcp_servers": [{"type": "url", "url": "https://example.com", "name": "x"}]}, "mcp_servers"),
        ({"output_config": {"format": {"type": "json_schema", "schema": {"type": "object"}}}}, "output_config.format"),
        ({"max_tokens": None}, "max_tokens"),
        ({"temperature": 1.5}, "temperature"),
        ({"tool_choice": {"type": "tool"}}, "tool_choice"),
        ({"messages": [{"role": "user", "content": [{"type": "tool_use", "id": "t", "name": "x"}]}]}, "messages.0.content.0.type"),
        ({"messages": [{"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "x"}]}, {"role": "user", "content": "a"}]},
         "messages.0.content.0.input"),
    ],
)  # fmt: skip
def test_a_refused_or_malformed_request_names_its_field(change, param):
    body = {"model": "policy", "max_tokens": 8, "messages": [{"role": "user", "content": "a"}], **change}
    body = {k: v for k, v in body.items() if v is not None}
    with pytest.raises(RequestError) as caught:
        to_chat_request(parse_request(body))
    assert caught.value.param == param and str(caught.value).startswith(f"{param}: ")


def test_a_chat_completion_translates_to_a_message_the_client_parses():
    completion = {
        "id": "chatcmpl-abc", "model": "policy", "usage": {"prompt_tokens": 12, "completion_tokens": 5, "total_tokens": 17},
        "choices": [{"index": 0, "finish_reason": "tool_calls", "stop_reason": None, "message": {
            "role": "assistant", "content": "let me see",
            "tool_calls": [{"id": "call_9", "type": "function", "function": {"name": "calculator", "arguments": '{"expression": "2*3"}'}}]}}],
    }  # fmt: skip
    message = anthropic.types.Message.model_validate(to_message(completion))
    assert message.id == "msg_abc" and message.stop_reason == "tool_use" and message.stop_sequence is None
    assert [b.type for b in message.content] == ["text", "tool_use"] and message.content[0].text == "let me see"
    assert (message.content[1].id, message.content[1].name, message.content[1].input) == ("call_9", "calculator", {"expression": "2*3"})
    assert (message.usage.input_tokens, message.usage.output_tokens) == (12, 5)
    reasons = [({"finish_reason": "stop", "stop_reason": "END"}, ("stop_sequence", "END")), ({"finish_reason": "stop"}, ("end_turn", None)),
               ({"finish_reason": "length"}, ("max_tokens", None))]  # fmt: skip
    for choice, expected in reasons:
        out = to_message({**completion, "choices": [{**choice, "message": {"role": "assistant", "content": ""}}]})
        assert (out["stop_reason"], out["stop_sequence"]) == expected and out["content"] == []


def test_a_chat_chunk_stream_translates_to_anthropic_events_in_order():
    header = {"id": "chatcmpl-x", "model": "policy", "object": "chat.completion.chunk", "usage": None}
    chunks = [
        {**header, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]},
        {**header, "choices": [{"index": 0, "delta": {"content": "Hel"}, "finish_reason": None}]},
        {**header, "choices": [{"index": 0, "delta": {"content": "lo"}, "finish_reason": None}]},
        {**header, "choices": [{"index": 0, "delta": {"tool_calls": [{"index": 0, "id": "call_1", "type": "function", "function": {"name": "calculator", "arguments": ""}}]}}]},
        {**header, "choices": [{"index": 0, "delta": {"tool_calls": [{"index": 0, "function": {"arguments": '{"expression": "1+1"}'}}]}}]},
        {**header, "choices": [{"index": 0, "delta": {}, "finish_reason": "tool_calls", "stop_reason": None}]},
        {**header, "choices": [], "usage": {"prompt_tokens": 9, "completion_tokens": 4, "total_tokens": 13}},
    ]  # fmt: skip

    async def run(texts):
        async def source():
            for text in texts:
                yield text

        return [event async for event in stream_events(source(), input_tokens=9)]

    events = asyncio.run(run([json.dumps(c) for c in chunks] + ["[DONE]"]))
    parse = TypeAdapter(anthropic.types.RawMessageStreamEvent).validate_python
    parsed = [parse(json.loads(e.data)) for e in events]
    assert [e.event for e in events] == [p.type for p in parsed] == [
        "message_start", "content_block_start", "content_block_delta", "content_block_delta", "content_block_stop",
        "content_block_start", "content_block_delta", "content_block_stop", "message_delta", "message_stop",
    ]  # fmt: skip
    assert parsed[0].message.usage.input_tokens == 9 and parsed[0].message.id == "msg_x"
    assert [p.delta.text for p in parsed[2:4]] == ["Hel", "lo"] and parsed[5].content_block.id == "call_1"
    assert parsed[6].delta.partial_json == '{"expression": "1+1"}' and [p.index for p in parsed[5:8]] == [1, 1, 1]
    assert parsed[8].delta.stop_reason == "tool_use" and parsed[8].usage.output_tokens == 4
    failed = asyncio.run(run([json.dumps(chunks[0]), json.dumps({"error": {"message": "boom", "type": "server_error", "param": None}})]))
    assert [e.event for e in failed] == ["message_start", "error"]
    assert json.loads(failed[1].data) == {"type": "error", "error": {"type": "api_error", "message": "boom"}}


# ---- the real gateway over HTTP ----


@pytest.fixture(scope="module")
def server(calculator_policy_dir, tmp_path_factory):
    """One gateway with a bearer token for the module (the anthropic client sends it as x-api-key)."""
    store = PolicyStore(str(calculator_policy_dir))
    with GatewayServer(make_gateway(store, tmp_path_factory.mktemp("messages_landing")), tokens=[TOKEN]) as running:
        yield running


def _landed(path: str) -> dict[str, Trajectory]:
    trajectories = [Trajectory.model_validate_json(line) for line in Path(path).read_text().splitlines()]
    return {t.trajectory_id: t for t in trajectories}


def _tool_loop(call) -> tuple[list[dict], list]:
    """The calculator loop: ask, run each tool_use, send its tool_result, until the policy answers.
    ``call(request) -> Message``; returns the requests sent and the replies."""
    messages: list[dict] = [{"role": "user", "content": "874*59"}]
    requests, replies = [], []
    for _ in range(3):
        request = {"model": "policy", "max_tokens": 32, "temperature": 0.0, "tools": [TOOL], "messages": list(messages)}
        reply = call(request)
        requests.append(request)
        replies.append(reply)
        messages.append({"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in reply.content]})
        results = [{"type": "tool_result", "tool_use_id": b.id, "content": execute_tool_call(b.name, json.dumps(b.input))}
                   for b in reply.content if b.type == "tool_use"]  # fmt: skip
        if not results:
            break
        messages.append({"role": "user", "content": results})
    return requests, replies


def _kwargs(request: dict) -> dict:
    """A request body as the client's arguments: recent clients take ``temperature`` only in
    ``extra_body`` (the gateway honours it)."""
    return {**{k: v for k, v in request.items() if k != "temperature"}, "extra_body": {"temperature": request["temperature"]}}


def _streamed(client):
    def call(request):
        with client.messages.stream(**_kwargs(request)) as stream:
            return stream.get_final_message()

    return call


def test_a_tool_loop_over_messages_lands_the_trajectory_a_chat_loop_lands_streamed_or_not(server):
    rollouts = ("msg-plain", "msg-stream", "msg-chat")
    httpx.post(f"{server.url}/rollouts", headers=AUTH, json=[{"rollout_id": r, "task_id": "calc", "batch": "messages"} for r in rollouts])
    # the rollout named by the key (x-api-key "<token>:<rollout>"), and by the path prefix
    plain_client = anthropic.Anthropic(base_url=server.url, api_key=f"{TOKEN}:msg-plain")
    requests, plain = _tool_loop(lambda request: plain_client.messages.create(**_kwargs(request)))
    _, streamed = _tool_loop(_streamed(anthropic.Anthropic(base_url=f"{server.url}/rollouts/msg-stream", api_key=TOKEN)))
    # the same translated messages, sent as chat completions
    chat = openai.OpenAI(base_url=f"{server.url}/rollouts/msg-chat/v1", api_key=TOKEN)
    for request in requests:
        body = to_chat_request(parse_request(request)).model_dump(exclude_none=True)
        chat.chat.completions.create(**body)
    for rollout in rollouts:
        httpx.post(f"{server.url}/rollouts/{rollout}/finish", headers=AUTH, json={"score": 1.0})
    landed = _landed(httpx.post(f"{server.url}/batches/messages/close", headers=AUTH).json()["path"])

    first, last = plain[0], plain[-1]
    assert first.stop_reason == "tool_use" and last.stop_reason == "end_turn" and len(plain) == 2
    (call,) = [b for b in first.content if b.type == "tool_use"]
    assert call.name == "calculator" and call.input == {"expression": "874*59"}

    def shape(message):
        blocks = [(b.type, b.text) if b.type == "text" else (b.type, b.name, b.input) for b in message.content]
        return blocks, message.stop_reason, message.stop_sequence, message.usage.input_tokens, message.usage.output_tokens

    assert [shape(m) for m in streamed] == [shape(m) for m in plain]
    trajectory = landed["msg-plain"]
    assert [s.kind for s in trajectory.steps] == ["tool", "observation", "answer"]
    # the tool_use id is the captured call id: the tool_result sent back under it is matched
    assert trajectory.steps[0].input["tool_calls"][0]["id"] == call.id and trajectory.steps[1].output == "51566"
    assert first.usage.input_tokens == len(trajectory.steps[0].prompt_token_ids)
    assert first.usage.output_tokens == len(trajectory.steps[0].token_ids)
    assert [s.kind for s in landed["msg-stream"].steps] == ["tool", "observation", "answer"]
    # the chat rollout's calls got their own ids (the tool results name the Messages call's), so
    # its observations are not matched; the turns the policy sampled are compared
    turns = {r: [s for s in landed[r].steps if s.kind != "observation"] for r in rollouts}
    assert len(turns["msg-plain"]) == len(turns["msg-chat"]) == 2
    for other in ("msg-stream", "msg-chat"):
        for a, b in zip(turns["msg-plain"], turns[other], strict=True):
            assert (a.prompt_token_ids, a.token_ids, a.logprobs, a.output) == (b.prompt_token_ids, b.token_ids, b.logprobs, b.output)

    # a stop sequence ends the message where it ends the chat completion, streamed and not
    text = last.content[0].text
    stop = text[2:4]
    request = {"model": "policy", "max_tokens": 32, "temperature": 0.0, "tools": [TOOL], "messages": requests[-1]["messages"], "stop_sequences": [stop]}
    client = anthropic.Anthropic(base_url=server.url, api_key=TOKEN)
    for cut in (client.messages.create(**_kwargs(request)), _streamed(client)(request)):
        assert (cut.stop_reason, cut.stop_sequence, cut.content[0].text) == ("stop_sequence", stop, text[: text.index(stop)])


def test_the_stream_sends_anthropic_event_names(server):
    body = {"model": "policy", "max_tokens": 8, "stream": True, "messages": [{"role": "user", "content": "12+30"}]}
    with httpx.stream("POST", f"{server.url}/v1/messages", json=body, headers={"x-api-key": TOKEN, "anthropic-version": "2023-06-01"}) as response:
        lines = [line for line in response.iter_lines() if line.startswith("event: ")]
        assert response.headers["content-type"].startswith("text/event-stream")
    names = [line.removeprefix("event: ") for line in lines]
    assert names[:2] == ["message_start", "content_block_start"] and names[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(names[2:-3]) == {"content_block_delta"}


def test_refused_requests_are_anthropic_errors_naming_the_field(server):
    client = anthropic.Anthropic(base_url=server.url, api_key=TOKEN)
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}}
    with pytest.raises(anthropic.BadRequestError) as caught:
        client.messages.create(model="policy", max_tokens=8, messages=[{"role": "user", "content": [{"type": "text", "text": "what is it?"}, image]}])
    assert caught.value.status_code == 400
    error = caught.value.body
    assert error["type"] == "error" and error["error"]["type"] == "invalid_request_error"
    assert error["error"]["message"].startswith("messages.0.content.1.type: image blocks are not supported")
    with pytest.raises(anthropic.NotFoundError) as caught:
        client.messages.create(model="no-such-model", max_tokens=8, messages=[{"role": "user", "content": "a"}])
    assert caught.value.body["error"]["type"] == "not_found_error" and caught.value.body["error"]["message"].startswith("model: ")
    with pytest.raises(anthropic.AuthenticationError):
        anthropic.Anthropic(base_url=server.url, api_key="wrong").messages.create(model="policy", max_tokens=8, messages=[{"role": "user", "content": "a"}])
    # validation errors are Anthropic-shaped too (not the chat routes' OpenAI shape)
    missing = httpx.post(f"{server.url}/v1/messages", headers=AUTH, json={"model": "policy", "messages": [{"role": "user", "content": "a"}]})
    assert missing.status_code == 400 and missing.json()["error"]["message"].startswith("max_tokens: ")
    broken = httpx.post(f"{server.url}/v1/messages", headers={**AUTH, "content-type": "application/json"}, content=b"{not json")
    assert broken.status_code == 400 and broken.json() == {"type": "error", "error": {"type": "invalid_request_error", "message": "The request body is not valid JSON."}}
