"""Chat Completions streaming and the rollout id as the API key, over real HTTP with the official
``openai`` client on the real tiny model."""

import asyncio
import contextlib
import json
import time
from pathlib import Path

import httpx
import openai
import pytest

from flow_assets.logs.schema import Trajectory
from flow_assets.policy.store import PolicyStore
from flow_assets.serving.gateway.guard import check_key
from flow_assets.serving.gateway.serve import make_gateway, serve_policy
from flow_assets.serving.gateway.server import GatewayServer
from flow_assets.serving.gateway.streaming import ChoiceText, sendable
from flow_assets.tasks.calculator import CALCULATOR_TOOL, execute_tool_call


def _landed(path: str) -> dict[str, Trajectory]:
    trajectories = [Trajectory.model_validate_json(line) for line in Path(path).read_text().splitlines()]
    return {t.trajectory_id: t for t in trajectories}


#: a call that decodes for a while on CPU: the fresh tiny policy's greedy completion runs to max_tokens
LONG = {"n": 64, "temperature": 0.0, "max_tokens": 110}


def leave_while_decoding(batcher, send) -> int:
    """Runs ``send()`` (a coroutine function: an agent's call) and cancels it, which closes its
    connection, once ``batcher`` (the serving gateway's) has decoded a step since: the agent leaves
    mid-generation whatever the machine's load. Fixed client timeouts did not: on an idle machine
    the call could finish first, and under load the timeout fired before a proxy had passed the
    call on (a fresh clone's CI, 2026-12-06). Returns the decoding steps run by the time it left.

    Raises:
        AssertionError: the call finished before a step was seen.
    """

    async def leave() -> int:
        steps = batcher.steps
        call = asyncio.ensure_future(send())
        while batcher.steps == steps and not call.done():
            await asyncio.sleep(0.002)
        assert not call.done(), "the LONG call finished before the agent could leave it"
        call.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await call
        return batcher.steps - steps

    return asyncio.run(leave())


def _cancelled(url: str) -> float:
    """Generations the gateway cancelled because their client went away."""
    lines = httpx.get(f"{url}/metrics").text.splitlines()
    return sum(float(line.split()[1]) for line in lines if line.startswith("flowopt_gateway_cancelled_total"))


def _completion_tokens(url: str) -> float:
    """The gateway's completion-token counter: it moves when a call's turn is recorded."""
    lines = httpx.get(f"{url}/metrics").text.splitlines()
    return sum(float(line.split()[1]) for line in lines if line.startswith("flowopt_gateway_tokens_total") and 'kind="completion"' in line)


def test_a_streamed_call_sends_text_token_by_token_and_captures_the_same_turn_as_a_plain_one(fresh_policy_dir, tmp_path):
    body = {"model": "policy", "messages": [{"role": "user", "content": "ab"}], "max_tokens": 24, "seed": 7, "logprobs": True}
    with serve_policy(PolicyStore(str(fresh_policy_dir)), tmp_path) as server:
        httpx.post(f"{server.url}/rollouts", json=[{"rollout_id": r, "task_id": "t", "batch": "b"} for r in ("plain", "streamed", "cut")])
        plain = openai.OpenAI(base_url=server.url + "/rollouts/plain/v1", api_key="x").chat.completions.create(**body)
        client = openai.OpenAI(base_url=server.url + "/rollouts/streamed/v1", api_key="x")
        chunks = list(client.chat.completions.create(**body, stream=True, stream_options={"include_usage": True}))
        text = plain.choices[0].message.content
        stop = text[5:7]  # the seeded sample is certain to produce it
        cut_client = openai.OpenAI(base_url=server.url + "/rollouts/cut/v1", api_key="x")
        cut = list(cut_client.chat.completions.create(**body, stop=[stop], stream=True))
        for rollout in ("plain", "streamed", "cut"):
            httpx.post(f"{server.url}/rollouts/{rollout}/finish", json={"score": 1.0})
        landed = _landed(httpx.post(f"{server.url}/batches/b/close").json()["path"])
    assert {c.object for c in chunks} == {"chat.completion.chunk"} and {c.system_fingerprint for c in chunks} == {"v0"}
    assert chunks[0].choices[0].delta.role == "assistant"
    *deltas, usage = chunks
    contents = [c.choices[0].delta.content for c in deltas if c.choices[0].delta.content]
    # true streaming: the text came in many pieces, and together they are the plain call's text
    assert len(contents) > len(text) // 2 and "".join(contents) == text
    streamed_logprobs = [t for c in deltas if c.choices[0].logprobs for t in c.choices[0].logprobs.content]
    assert [(t.token, t.logprob) for t in streamed_logprobs] == [(t.token, t.logprob) for t in plain.choices[0].logprobs.content]
    assert [c.choices[0].finish_reason for c in deltas][-1] == plain.choices[0].finish_reason
    assert all(c.choices[0].finish_reason is None for c in deltas[:-1])
    # include_usage: every chunk says usage null, the last one (no choices) carries it
    assert all(c.usage is None for c in deltas) and usage.choices == [] and usage.usage == plain.usage
    one, two = landed["plain"].steps[0], landed["streamed"].steps[0]
    assert (two.prompt_token_ids, two.token_ids, two.logprobs, two.output) == (one.prompt_token_ids, one.token_ids, one.logprobs, one.output)
    # a stop string cuts the stream where it cuts the plain call; the text before it is never sent
    cut_text = "".join(c.choices[0].delta.content or "" for c in cut)
    assert cut_text == text[: text.index(stop)] and cut[-1].choices[0].finish_reason == "stop"
    assert landed["cut"].steps[0].output == cut_text and stop not in cut_text


def test_a_streamed_tool_loop_sends_tool_call_deltas_and_lands_the_same_trajectory(calculator_policy_dir, tmp_path):
    with serve_policy(PolicyStore(str(calculator_policy_dir)), tmp_path) as server:
        httpx.post(f"{server.url}/rollouts", json=[{"rollout_id": r, "task_id": "calc", "batch": "b"} for r in ("plain", "streamed")])
        outputs = {}
        for rollout in ("plain", "streamed"):
            client = openai.OpenAI(base_url=f"{server.url}/rollouts/{rollout}/v1", api_key="x")
            messages = [{"role": "user", "content": "874*59"}]
            replies = []
            for seed in (1, 2):
                kwargs = dict(model="policy", messages=messages, tools=[CALCULATOR_TOOL], max_tokens=32, temperature=0.7, seed=seed)
                if rollout == "plain":
                    message = client.chat.completions.create(**kwargs).choices[0].message.model_dump(exclude_none=True)
                    reason = None
                else:
                    chunks = list(client.chat.completions.create(**kwargs, stream=True))
                    message, reason = _accumulate(chunks)
                replies.append((message, reason))
                messages.append(message)
                for call in message.get("tool_calls") or []:
                    result = execute_tool_call(call["function"]["name"], call["function"]["arguments"])
                    messages.append({"role": "tool", "tool_call_id": call["id"], "content": result})
            outputs[rollout] = replies
            httpx.post(f"{server.url}/rollouts/{rollout}/finish", json={"score": 1.0})
        landed = _landed(httpx.post(f"{server.url}/batches/b/close").json()["path"])
    (first, reason), (second, _) = outputs["streamed"]
    (plain_first, _), (plain_second, _) = outputs["plain"]
    assert reason == "tool_calls" and first.get("content") is None
    (call,) = first["tool_calls"]
    assert call["id"].startswith("call_") and call["function"]["name"] == "calculator"
    assert json.loads(call["function"]["arguments"]) == {"expression": "874*59"}
    assert call["function"] == plain_first["tool_calls"][0]["function"] and second["content"] == plain_second["content"]
    streamed, plain = landed["streamed"], landed["plain"]
    # the streamed call id is the captured one: the tool result sent back under it is matched
    assert [s.kind for s in streamed.steps] == ["tool", "observation", "answer"] == [s.kind for s in plain.steps]
    assert streamed.steps[0].input["tool_calls"][0]["id"] == call["id"] and streamed.steps[1].output == "51566"
    for a, b in zip(streamed.steps, plain.steps):
        assert (a.prompt_token_ids, a.token_ids, a.logprobs) == (b.prompt_token_ids, b.token_ids, b.logprobs)


def _accumulate(chunks) -> tuple[dict, str | None]:
    """A streamed reply as the assistant message a client builds from its deltas (the way the
    openai client's own stream helpers do: content concatenated, tool calls by index)."""
    content, calls, reason = "", {}, None
    for c in chunks:
        for choice in c.choices:
            delta = choice.delta
            content += delta.content or ""
            for tc in delta.tool_calls or []:
                entry = calls.setdefault(tc.index, {"id": None, "type": "function", "function": {"name": "", "arguments": ""}})
                entry["id"] = tc.id or entry["id"]
                if tc.function is not None:
                    entry["function"]["name"] += tc.function.name or ""
                    entry["function"]["arguments"] += tc.function.arguments or ""
            reason = choice.finish_reason or reason
    message: dict = {"role": "assistant", "content": content or None}
    if calls:
        message["tool_calls"] = [calls[k] for k in sorted(calls)]
    return {k: v for k, v in message.items() if v is not None}, reason


def test_a_client_that_leaves_mid_stream_leaves_an_undelivered_turn_that_is_not_a_step(fresh_policy_dir, tmp_path):
    body = {"model": "policy", "messages": [{"role": "user", "content": "ab"}]}
    with serve_policy(PolicyStore(str(fresh_policy_dir)), tmp_path) as server, httpx.Client(base_url=server.url) as client:
        client.post("/rollouts", json={"rollout_id": "left", "task_id": "t", "batch": "b"})
        kept = client.post("/rollouts/left/v1/chat/completions", json={**body, "max_tokens": 4}).json()
        before = _completion_tokens(server.url)
        # 64 greedy choices of 110 tokens (this model's greedy completion never ends early): seconds
        # of decoding on CPU, and the client leaves after the first chunk
        with client.stream("POST", "/rollouts/left/v1/chat/completions", json={**body, **LONG, "stream": True}) as stream:
            assert stream.status_code == 200 and stream.headers["content-type"].startswith("text/event-stream")
            first = next(stream.iter_lines())
            assert json.loads(first.removeprefix("data: "))["choices"][0]["delta"]["role"] == "assistant"
        deadline = time.monotonic() + 120
        while _completion_tokens(server.url) == before and time.monotonic() < deadline:
            time.sleep(0.1)  # the abandoned generation runs to its end, then its turn is recorded
        sampled = _completion_tokens(server.url) - before
        done = client.post("/rollouts/left/finish", json={"score": 1.0}).json()
        landed = _landed(client.post("/batches/b/close").json()["path"])
        cancelled = _cancelled(server.url)
    trajectory = landed["left"]
    assert done["llm_calls"] == 1 and [s.token_ids for s in trajectory.steps] == [trajectory.steps[0].token_ids]
    assert trajectory.steps[0].output == kept["choices"][0]["message"]["content"]
    (undelivered,) = trajectory.metadata["undelivered_turns"]
    assert undelivered["reason"] == "client_disconnected"
    # every choice's tokens counted, none trained; the generation was cancelled when the client
    # left (the batcher's own test shows a cancelled call ends at the next token)
    assert 64 <= undelivered["completion_tokens"] == sampled < 64 * 110 and cancelled == 1


def test_a_client_that_times_out_cancels_its_generation_and_its_retry_is_the_only_turn(fresh_policy_dir, tmp_path):
    body = {"model": "policy", "messages": [{"role": "user", "content": "ab"}]}
    with serve_policy(PolicyStore(str(fresh_policy_dir)), tmp_path) as server, httpx.Client(base_url=server.url) as client:
        # the client gives up mid-generation and closes its connection, as the openai client does
        # before it retries
        client.post("/rollouts", json={"rollout_id": (rid := "retried"), "task_id": "t", "batch": "b"})
        before = _completion_tokens(server.url)

        async def call() -> None:
            async with httpx.AsyncClient(base_url=server.url, timeout=120) as agent:
                await agent.post(f"/rollouts/{rid}/v1/chat/completions", json={**body, **LONG})

        leave_while_decoding(server.gateway.batcher, call)
        deadline = time.monotonic() + 60
        while _completion_tokens(server.url) == before and time.monotonic() < deadline:
            time.sleep(0.05)
        abandoned = _completion_tokens(server.url) - before
        retry = client.post(f"/rollouts/{rid}/v1/chat/completions", json={**body, "max_tokens": 4}).json()
        client.post(f"/rollouts/{rid}/finish", json={"score": 1.0})
        landed = _landed(client.post("/batches/b/close").json()["path"])
        cancelled = _cancelled(server.url)
    trajectory = landed[rid]
    # the retry is the turn; the abandoned one is listed, not trained
    assert [s.output for s in trajectory.steps] == [retry["choices"][0]["message"]["content"]]
    (undelivered,) = trajectory.metadata["undelivered_turns"]
    assert undelivered["reason"] == "client_disconnected" and undelivered["completion_tokens"] == abandoned
    assert 64 <= abandoned < 64 * 110 and cancelled == 1


def test_the_rollout_id_may_come_as_the_api_key(fresh_policy_dir, tmp_path):
    body = {"model": "policy", "messages": [{"role": "user", "content": "ab"}], "max_tokens": 3}
    store = PolicyStore(str(fresh_policy_dir))
    with serve_policy(store, tmp_path / "open") as server:
        httpx.post(f"{server.url}/rollouts", json={"rollout_id": "by-key", "task_id": "t", "batch": "b"})
        openai.OpenAI(base_url=server.url + "/v1", api_key="by-key").chat.completions.create(**body)
        list(openai.OpenAI(base_url=server.url + "/v1", api_key="by-key").chat.completions.create(**body, stream=True))
        # a key that names no rollout (the usual dummy) is an ordinary key: nothing is captured
        openai.OpenAI(base_url=server.url + "/v1", api_key="sk-dummy").chat.completions.create(**body)
        assert httpx.get(f"{server.url}/health").json()["open_rollouts"] == 1
        assert httpx.post(f"{server.url}/rollouts/by-key/finish", json={"score": 1.0}).json()["llm_calls"] == 2
        with pytest.raises(openai.ConflictError):  # the key names a finished rollout
            openai.OpenAI(base_url=server.url + "/v1", api_key="by-key", max_retries=0).chat.completions.create(**body)
    with GatewayServer(make_gateway(store, tmp_path / "auth"), tokens=["team-a", "team-b"]) as server:
        good = openai.OpenAI(base_url=server.url + "/v1", api_key="team-b:auth-1")
        good.chat.completions.create(**body)
        # the header still wins over the key
        good.chat.completions.create(**body, extra_headers={"X-Agent-ID": "by-header"})
        openai.OpenAI(base_url=server.url + "/v1", api_key="team-a").chat.completions.create(**body)  # a token alone: no rollout
        for key in ("team-c:auth-1", "team-b:", "auth-1"):
            with pytest.raises(openai.AuthenticationError):
                openai.OpenAI(base_url=server.url + "/v1", api_key=key, max_retries=0).chat.completions.create(**body)
        finished = {r: httpx.post(f"{server.url}/rollouts/{r}/finish", json={"score": 1.0}, headers={"Authorization": "Bearer team-a"}).json()
                    for r in ("auth-1", "by-header")}  # fmt: skip
        assert httpx.get(f"{server.url}/health").json()["open_rollouts"] == 0
    assert finished["auth-1"]["llm_calls"] == 1 and finished["by-header"]["llm_calls"] == 1


def test_check_key_reads_token_and_rollout_and_nothing_else():
    tokens = ["a", "a:b", "tok"]
    assert check_key("tok", tokens) == (True, None)
    assert check_key("tok:r-1", tokens) == (True, "r-1")
    assert check_key("tok:r:1", tokens) == (True, "r:1")  # the rollout id may hold ':'
    assert check_key("a:b:c", tokens) == (True, "c")  # the longest token that prefixes the key
    assert check_key("a:b", tokens) == (True, None)  # a token itself
    for bad in ("tok:", "to", "tokx:r", "", None, "r-1"):
        assert check_key(bad, tokens) == (False, None), bad
    assert check_key("r-1", []) == (True, "r-1") and check_key(None, []) == (True, None)


def test_sendable_holds_back_what_may_still_change():
    assert sendable("hello wor", ["world"], None) == 5  # "wor" may become the stop; the space waits too
    assert sendable("hello wox", ["world"], None) == 9
    assert sendable("say world again", ["world"], None) == 3
    assert sendable("total @calc", None, "compact") == 5  # may be a call's start
    assert sendable("mail a@b.c then", None, "compact") == 15  # cannot be one any more
    assert sendable("x @calculator(1+2)", None, "compact") == 1
    assert sendable("ok <tool_", None, "hermes") == 2 and sendable("ok <tool_call>{", None, "hermes") == 2
    assert sendable(" ok", None, "hermes") == 0 and sendable(" ok", None, None) == 3


def test_choice_text_releases_text_and_tokens_in_order(fresh_policy_dir):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(PolicyStore(str(fresh_policy_dir)).base_path))
    ids = tokenizer("12*3 is 36", add_special_tokens=False)["input_ids"]
    stream = ChoiceText(lambda x: tokenizer.decode(x, skip_special_tokens=True), ["36"], None)
    pieces = [stream.push([i]) for i in ids]
    text = "".join(p[0] for p in pieces)
    assert text == "12*3 is"  # " 36" never goes out: "3" may begin the stop, then the stop itself
    # each piece releases the tokens whose text it completes: "3" waits (it may begin "36"), then
    # goes with the space after it; that space waits for "i" (trailing whitespace is held)
    assert [(a, b) for _, a, b in pieces if b > a] == [(0, 1), (1, 2), (2, 3), (3, 4), (4, 6), (6, 7)]
    delta, first, end, consistent = stream.rest("12*3 is ", 10)
    assert (delta, first, end, consistent) == (" ", 7, 10, True)
