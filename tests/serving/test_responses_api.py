"""The Responses API (``POST /v1/responses``) over real HTTP with the official ``openai`` client on
the real tiny calculator policy: it captures what the equivalent chat call captures."""

import asyncio
import json
from pathlib import Path

import httpx
import openai
import pytest

from flow_assets.logs.schema import Trajectory
from flow_assets.policy.store import PolicyStore
from flow_assets.serving.gateway.protocol import ChatCompletionRequest
from flow_assets.serving.gateway.responses_api import (
    RequestError,
    ResponsesRequest,
    chat_messages,
    chat_request,
    chat_tools,
    response_from_chat,
    stream_events,
)
from flow_assets.serving.gateway.serve import serve_policy
from flow_assets.tasks.calculator import CALCULATOR_TOOL, execute_tool_call

#: the calculator tool in the Responses API's flat shape
FLAT_TOOL = {"type": "function", **CALCULATOR_TOOL["function"], "strict": False}


@pytest.fixture(scope="module")
def server(calculator_policy_dir, tmp_path_factory):
    with serve_policy(PolicyStore(str(calculator_policy_dir)), tmp_path_factory.mktemp("responses_landing")) as running:
        yield running


def _landed(path: str) -> dict[str, Trajectory]:
    trajectories = [Trajectory.model_validate_json(line) for line in Path(path).read_text().splitlines()]
    return {t.trajectory_id: t for t in trajectories}


def _items_for_next_turn(output) -> list[dict]:
    """A response's output items as a client sends them back, and the results of its calls."""
    items = [item.model_dump(exclude_none=True) for item in output]
    for item in output:
        if item.type == "function_call":
            items.append({"type": "function_call_output", "call_id": item.call_id, "output": execute_tool_call(item.name, item.arguments)})
    return items


def test_a_responses_tool_loop_captures_what_the_chat_loop_captures_streamed_or_not(server):
    url = server.url
    httpx.post(f"{url}/rollouts", json=[{"rollout_id": r, "task_id": "calc", "batch": "resp"} for r in ("chat", "responses", "streamed")])
    settings = dict(model="policy", max_output_tokens=32, temperature=0.7)
    # the chat loop, as test_streaming runs it
    chat = openai.OpenAI(base_url=f"{url}/rollouts/chat/v1", api_key="x")
    messages = [{"role": "user", "content": "874*59"}]
    for seed in (1, 2):
        reply = chat.chat.completions.create(model="policy", messages=messages, tools=[CALCULATOR_TOOL], max_tokens=32, temperature=0.7, seed=seed)
        message = reply.choices[0].message.model_dump(exclude_none=True)
        messages.append(message)
        for call in message.get("tool_calls") or []:
            messages.append({"role": "tool", "tool_call_id": call["id"], "content": execute_tool_call(call["function"]["name"], call["function"]["arguments"])})
    # the same loop through the Responses API: the rollout named by X-Agent-ID, output items sent back
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", default_headers={"X-Agent-ID": "responses"})
    items: list[dict] = [{"role": "user", "content": "874*59"}]
    plain = []
    for seed in (1, 2):
        response = client.responses.create(input=items, tools=[FLAT_TOOL], include=["message.output_text.logprobs"], extra_body={"seed": seed}, **settings)
        plain.append(response)
        items += _items_for_next_turn(response.output)
    # and streamed (the rollout in the path), read by the client's own stream helper
    streaming = openai.OpenAI(base_url=f"{url}/rollouts/streamed/v1", api_key="x")
    items_streamed: list[dict] = [{"role": "user", "content": "874*59"}]
    streamed, events = [], []
    for seed in (1, 2):
        with streaming.responses.stream(input=items_streamed, tools=[FLAT_TOOL], extra_body={"seed": seed}, **settings) as stream:
            events.append(list(stream))
            final = stream.get_final_response()
        streamed.append(final)
        items_streamed += _items_for_next_turn(final.output)
    finished = {r: httpx.post(f"{url}/rollouts/{r}/finish", json={"score": 1.0}).json() for r in ("chat", "responses", "streamed")}
    landed = _landed(httpx.post(f"{url}/batches/resp/close").json()["path"])

    first, second = plain
    (call,) = first.output
    assert first.status == "completed" and call.type == "function_call" and call.name == "calculator" and call.id.startswith("fc_")
    assert json.loads(call.arguments) == {"expression": "874*59"} and call.call_id.startswith("call_")
    assert second.status == "completed" and [o.type for o in second.output] == ["message"] and second.output_text == messages[-1]["content"]
    assert {f["llm_calls"] for f in finished.values()} == {2} and {f["tool_calls"] for f in finished.values()} == {1}
    reference = landed["chat"]
    for rollout in ("responses", "streamed"):
        trajectory = landed[rollout]
        assert [s.kind for s in trajectory.steps] == ["tool", "observation", "answer"] == [s.kind for s in reference.steps]
        for a, b in zip(trajectory.steps, reference.steps):
            assert (a.prompt_token_ids, a.token_ids, a.logprobs, a.output) == (b.prompt_token_ids, b.token_ids, b.logprobs, b.output)
    # the function_call's call_id is the captured call id: the function_call_output sent back under it is its observation
    steps = landed["responses"].steps
    assert steps[0].input["tool_calls"][0]["id"] == call.call_id and steps[1].output == "51566"
    # the returned log-probs and usage are the captured ones
    assert [lp.logprob for lp in second.output[0].content[0].logprobs] == steps[2].logprobs
    assert (second.usage.input_tokens, second.usage.output_tokens) == (len(steps[2].prompt_token_ids), len(steps[2].token_ids))
    # streaming accumulates to the same output (items' ids apart) and announces it event by event
    for one, two in zip(plain, streamed):
        assert [(o.type, getattr(o, "name", None), getattr(o, "arguments", None)) for o in one.output] == [
            (o.type, getattr(o, "name", None), getattr(o, "arguments", None)) for o in two.output
        ]
        assert one.output_text == two.output_text and one.usage == two.usage
    for turn in events:
        assert [e.sequence_number for e in turn] == list(range(len(turn)))
        assert [e.type for e in turn[:2]] == ["response.created", "response.in_progress"] and turn[-1].type == "response.completed"
    kinds = [e.type for e in events[0]]
    assert kinds[2:] == ["response.output_item.added", "response.function_call_arguments.delta",
                         "response.function_call_arguments.done", "response.output_item.done", "response.completed"]  # fmt: skip
    deltas = [e.delta for e in events[1] if e.type == "response.output_text.delta"]
    assert len(deltas) > 1 and "".join(deltas) == streamed[1].output_text == second.output_text


def _sse(response: httpx.Response) -> list[tuple[str, dict]]:
    """``(event name, data)`` of each Server-Sent Event."""
    events, name = [], None
    for line in response.iter_lines():
        if line.startswith("event:"):
            name = line.removeprefix("event:").strip()
        elif line.startswith("data:"):
            events.append((name, json.loads(line.removeprefix("data:").strip())))
    return events


def test_a_response_cut_by_max_output_tokens_is_incomplete_and_streams_named_events(server):
    body = {"model": "policy", "input": "874*59", "instructions": "Answer.", "max_output_tokens": 2, "seed": 3}
    plain = httpx.post(f"{server.url}/v1/responses", json=body).json()
    with httpx.stream("POST", f"{server.url}/v1/responses", json={**body, "stream": True}) as stream:
        assert stream.headers["content-type"].startswith("text/event-stream") and stream.headers["x-flowopt-adapter-version"] == "v0"
        events = _sse(stream)
    assert plain["object"] == "response" and plain["id"].startswith("resp_") and plain["status"] == "incomplete"
    assert plain["incomplete_details"] == {"reason": "max_output_tokens"} and plain["usage"]["output_tokens"] == 2
    assert plain["instructions"] == "Answer." and plain["store"] is False
    # every event's `event:` name is its type; the last says incomplete, with the plain call's output
    assert all(name == data["type"] for name, data in events)
    assert events[-1][0] == "response.incomplete" and events[-1][1]["response"]["incomplete_details"] == {"reason": "max_output_tokens"}
    last = events[-1][1]["response"]
    assert [(o["type"], o["status"]) for o in last["output"]] == [(o["type"], o["status"]) for o in plain["output"]]
    assert last["usage"] == plain["usage"]


@pytest.mark.parametrize(
    "change, param",
    [
        ({"previous_response_id": "resp_123"}, "previous_response_id"),
        ({"background": True}, "background"),
        ({"tools": [{"type": "web_search"}]}, "tools.0.type"),
        ({"input": [{"type": "reasoning", "id": "rs_1", "summary": []}]}, "input.0.type"),
        ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "https://x/y.png"}]}]}, "input.0.content.0.type"),
        ({"input": [{"type": "function_call_output", "output": "1"}]}, "input.0.call_id"),
        ({"temperature": 3}, "temperature"),
        ({"tool_choice": {"type": "file_search"}}, "tool_choice"),
    ],
)
def test_refused_fields_are_400s_naming_the_field(server, change, param):
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0)
    with pytest.raises(openai.BadRequestError) as refused:
        client.responses.create(**{"model": "policy", "input": "874*59", **change})
    assert refused.value.param == param and refused.value.body["param"] == param
    assert param.split(".")[0] in refused.value.message


def test_input_items_translate_to_chat_messages():
    items = [
        {"role": "developer", "content": "be brief"},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "874*59"}, {"type": "input_text", "text": "?"}]},
        {"type": "function_call", "call_id": "c1", "name": "calculator", "arguments": '{"expression": "874*59"}'},
        {"type": "function_call", "call_id": "c2", "name": "calculator", "arguments": '{"expression": "1+1"}'},
        {"type": "function_call_output", "call_id": "c1", "output": "51566"},
        {"type": "function_call_output", "call_id": "c2", "output": [{"type": "input_text", "text": "2"}]},
        {"type": "message", "id": "msg_1", "status": "completed", "role": "assistant", "content": [{"type": "output_text", "text": "Let me check.", "annotations": []}]},
        {"type": "function_call", "id": "fc_1", "call_id": "c3", "name": "calculator", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c3", "output": "0"},
    ]
    call = lambda i, e: {"id": f"c{i}", "type": "function", "function": {"name": "calculator", "arguments": e}}  # noqa: E731
    assert chat_messages(items, "You are a calculator.") == [
        {"role": "system", "content": "You are a calculator."},
        {"role": "developer", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "874*59"}, {"type": "text", "text": "?"}]},
        # consecutive function_call items are one assistant turn with two calls
        {"role": "assistant", "tool_calls": [call(1, '{"expression": "874*59"}'), call(2, '{"expression": "1+1"}')]},
        {"role": "tool", "tool_call_id": "c1", "content": "51566"},
        {"role": "tool", "tool_call_id": "c2", "content": "2"},
        # a call right after an assistant message joins it: the chat path answered both as one message
        {"role": "assistant", "content": [{"type": "text", "text": "Let me check."}], "tool_calls": [call(3, "{}")]},
        {"role": "tool", "tool_call_id": "c3", "content": "0"},
    ]
    assert chat_messages("hi") == [{"role": "user", "content": "hi"}]
    for bad, param in (([], "input"), ([{"type": "item_reference", "id": "x"}], "input.0.type"), ([{"role": "tool", "content": "1"}], "input.0.role")):
        with pytest.raises(RequestError) as refused:
            chat_messages(bad)
        assert refused.value.param == param


def test_a_request_translates_to_the_chat_request_and_a_completion_back_to_a_response():
    req = ResponsesRequest.model_validate({
        "model": "policy", "input": "874*59", "tools": [FLAT_TOOL], "tool_choice": {"type": "function", "name": "calculator"},
        "max_output_tokens": 7, "temperature": 0.5, "top_p": 0.9, "seed": 4, "stream": True, "user": "u",
        "text": {"format": {"type": "json_schema", "name": "answer", "schema": {"type": "object"}, "strict": True}},
        "store": True, "parallel_tool_calls": False, "reasoning": {"effort": "low"}, "metadata": {"k": "v"},
    })  # fmt: skip
    chat = chat_request(req)
    assert isinstance(chat, ChatCompletionRequest) and chat.max_tokens == 7 and chat.seed == 4 and chat.user == "u"
    assert [t.model_dump(exclude_none=True) for t in chat.tools] == [CALCULATOR_TOOL] == chat_tools([FLAT_TOOL])
    assert chat.tool_choice == {"type": "function", "function": {"name": "calculator"}}
    assert chat.response_format == {"type": "json_schema", "json_schema": {"name": "answer", "schema": {"type": "object"}, "strict": True}}
    assert chat.stream and chat.stream_options.include_usage and not chat.logprobs
    with pytest.raises(RequestError) as refused:
        chat_request(req.model_copy(update={"truncation": "auto"}))
    assert refused.value.param == "truncation"
    completion = {
        "id": "chatcmpl-1", "object": "chat.completion", "created": 5, "model": "policy",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "51566",
                     "tool_calls": [{"id": "call_1", "type": "function", "function": {"name": "calculator", "arguments": "{}"}}]},
                     "logprobs": None, "finish_reason": "length"}],
        "usage": {"prompt_tokens": 3, "completion_tokens": 7, "total_tokens": 10},
    }  # fmt: skip
    response = openai.types.responses.Response.model_validate(response_from_chat(req, completion))
    assert response.status == "incomplete" and response.incomplete_details.reason == "max_output_tokens"
    assert [o.type for o in response.output] == ["message", "function_call"] and response.output_text == "51566"
    assert response.output[1].call_id == "call_1" and response.usage.total_tokens == 10 and response.metadata == {"k": "v"}
    assert response.text.format.type == "json_schema" and response.tools[0].name == "calculator"


def _translated(req: ResponsesRequest, chunks: list) -> list[dict]:
    """The Responses events :func:`stream_events` makes of chat ``data`` texts (dicts as JSON)."""

    async def source():
        for c in chunks:
            yield c if isinstance(c, str) else json.dumps(c)

    async def collect():
        return [json.loads(e.data) async for e in stream_events(req, source())]

    return asyncio.run(collect())


def test_a_chat_stream_translates_to_events_that_close_the_message_before_the_calls_and_end_failed_on_an_error():
    req = ResponsesRequest(model="policy", input="874*59", include=["message.output_text.logprobs"])
    lp = lambda *ps: {"content": [{"token": "t", "logprob": p, "bytes": [116], "top_logprobs": []} for p in ps]}  # noqa: E731
    head = {"id": "chatcmpl-1", "created": 5, "model": "policy", "object": "chat.completion.chunk"}
    role = {**head, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}]}
    text = {**head, "choices": [{"index": 0, "delta": {"content": "ok"}, "logprobs": lp(-0.5), "finish_reason": None}]}
    start = {"index": 0, "id": "call_9", "type": "function", "function": {"name": "calculator", "arguments": ""}}
    call = [{**head, "choices": [{"index": 0, "delta": {"tool_calls": [start]}, "logprobs": None, "finish_reason": None}]},
            {**head, "choices": [{"index": 0, "delta": {"tool_calls": [{"index": 0, "function": {"arguments": "{}"}}]}, "logprobs": None,
                                  "finish_reason": None}]}]  # fmt: skip
    end = {**head, "choices": [{"index": 0, "delta": {}, "logprobs": lp(-0.25, -0.125), "finish_reason": "tool_calls"}]}
    usage = {**head, "choices": [], "usage": {"prompt_tokens": 4, "completion_tokens": 3, "total_tokens": 7}}
    events = _translated(req, [role, text, *call, end, usage, "[DONE]"])
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert [e["type"] for e in events] == [
        "response.created", "response.in_progress", "response.output_item.added", "response.content_part.added",
        "response.output_text.delta", "response.output_text.done", "response.content_part.done", "response.output_item.done",
        "response.output_item.added", "response.function_call_arguments.delta", "response.function_call_arguments.done",
        "response.output_item.done", "response.completed",
    ]  # fmt: skip
    # the finish chunk's log-probs (the call's tokens, eos) complete the message's list
    assert [x["logprob"] for x in events[5]["logprobs"]] == [-0.5, -0.25, -0.125] and events[5]["text"] == "ok"
    assert events[8]["output_index"] == 1 and events[8]["item"]["arguments"] == "" and events[11]["item"]["arguments"] == "{}"
    final = openai.types.responses.Response.model_validate(events[-1]["response"])
    assert [o.type for o in final.output] == ["message", "function_call"] and final.output[1].call_id == "call_9"
    assert final.usage.total_tokens == 7 and final.output[0].id == events[2]["item"]["id"]
    error = {"error": {"message": "rollout r finished", "type": "invalid_request_error", "param": "X-Agent-ID", "code": "rollout_finished"}}
    failed = _translated(req, [role, text, error])
    assert [e["type"] for e in failed][-2:] == ["response.output_text.delta", "response.failed"]
    assert failed[-1]["response"]["status"] == "failed" and failed[-1]["response"]["error"]["code"] == "invalid_prompt"
    assert failed[-1]["response"]["error"]["message"] == "rollout r finished"
