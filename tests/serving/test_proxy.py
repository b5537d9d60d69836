"""Proxy mode (``flowopt serve --upstream``) over real HTTP: a flowopt gateway forwarding to another
model server and capturing its answers as text. The upstream here is flowopt's own gateway in plain
serving mode on the tiny calculator policy (no other OpenAI-compatible server can be built on this
machine), behind a bearer token that plays the hosted API's key."""

import asyncio
import json
import logging
import time
from pathlib import Path

import httpx
import openai
import pytest
from transformers import AutoTokenizer

from flow_assets.logs.schema import Trajectory
from flow_assets.policy.chat import render_prompt
from flow_assets.policy.prompt import PromptPolicy
from flow_assets.policy.store import PolicyStore
from flow_assets.serving.gateway.app import Gateway
from flow_assets.serving.gateway.engine import AdapterResolver, in_challenger_share
from flow_assets.serving.gateway.serve import make_gateway
from flow_assets.serving.gateway.server import GatewayServer
from flow_assets.settings import Settings
from flow_assets.serving.gateway.upstream import REDACTED, StreamedChoice, Upstream, UpstreamClient, fold_chunks, forwarded_body
from flow_assets.tasks.calculator import CALCULATOR_TOOL, execute_tool_call
from resources.registry import AdapterRegistry
from tests.conftest import run_cli
from tests.serving.test_streaming import LONG, leave_while_decoding

KEY = "sk-upstream-7f3a9c1e"  # the upstream's API key: it must never leave the proxy's memory


@pytest.fixture(scope="module")
def upstream_server(calculator_policy_dir, tmp_path_factory):
    landing = tmp_path_factory.mktemp("upstream-landing")
    with GatewayServer(make_gateway(PolicyStore(str(calculator_policy_dir)), landing), tokens=[KEY]) as server:
        yield server


def _proxy(upstream_url: str, tmp_path: Path, key: str | None = KEY, model: str | None = "policy") -> GatewayServer:
    gateway = Gateway(None, AdapterResolver(tmp_path / "models" / "registry.json"), tmp_path / "landing",
                      upstream=Upstream(upstream_url, model, key, timeout_s=60))  # fmt: skip
    return GatewayServer(gateway)


def _landed(path: str) -> list[Trajectory]:
    return [Trajectory.model_validate_json(line) for line in Path(path).read_text().splitlines()]


def _files_text(root: Path) -> str:
    return "".join(p.read_text(errors="replace") for p in root.rglob("*") if p.is_file())


def test_a_proxied_tool_conversation_is_the_upstreams_answer_and_lands_as_text(upstream_server, tmp_path, caplog):
    caplog.set_level(logging.DEBUG)
    direct = openai.OpenAI(base_url=upstream_server.url + "/v1", api_key=KEY)
    messages = [{"role": "user", "content": "874*59"}]
    with _proxy(upstream_server.url + "/v1", tmp_path) as proxy:
        client = openai.OpenAI(base_url=proxy.url + "/v1", api_key="agent-key", default_headers={"X-Agent-ID": "conv-1"})
        first = client.chat.completions.create(model="my-agent", messages=messages, tools=[CALCULATOR_TOOL], max_tokens=32, temperature=0.7, seed=1)
        same = direct.chat.completions.create(model="policy", messages=messages, tools=[CALCULATOR_TOOL], max_tokens=32, temperature=0.7, seed=1)
        call = first.choices[0].message.tool_calls[0]
        messages.append(first.choices[0].message.model_dump(exclude_none=True))
        messages.append({"role": "tool", "tool_call_id": call.id, "content": execute_tool_call(call.function.name, call.function.arguments)})
        second = client.chat.completions.create(model="my-agent", messages=messages, tools=[CALCULATOR_TOOL], max_tokens=32, temperature=0.7, seed=2)
        done = httpx.post(f"{proxy.url}/rollouts/conv-1/finish", json={"task_id": "calculator-874*59", "score": 1.0}).json()
        landed = httpx.post(f"{proxy.url}/batches/{done['batch']}/close").json()["path"]
        health = httpx.get(f"{proxy.url}/health").text
        metrics = httpx.get(f"{proxy.url}/metrics").text
    # forwarded as asked, under the upstream's model name: the same seeded sample as a direct call
    assert first.choices[0].finish_reason == "tool_calls" and call.function.name == "calculator"
    assert first.choices[0].message.content == same.choices[0].message.content
    assert [c.function.model_dump() for c in first.choices[0].message.tool_calls] == [c.function.model_dump() for c in same.choices[0].message.tool_calls]
    assert first.usage.prompt_tokens == same.usage.prompt_tokens > 0
    (trajectory,) = _landed(landed)
    turn1, observation, turn2 = trajectory.steps
    assert (turn1.kind, observation.kind, turn2.kind) == ("tool", "observation", "answer")
    assert turn1.input == {"tool_calls": [{"id": call.id, "name": "calculator", "arguments": json.loads(call.function.arguments)}]}
    assert observation.output == messages[-1]["content"]
    assert turn2.output == second.choices[0].message.content == trajectory.final_answer
    # text only: no ids, no log-probs; the usage the upstream reported
    assert all(s.token_ids is None and s.logprobs is None and s.prompt_token_ids is None for s in trajectory.steps)
    assert trajectory.metadata["capture"] == "text" and trajectory.metadata["upstream_models"] == ["policy"]
    assert trajectory.metadata["prompt_tokens"] == first.usage.prompt_tokens + second.usage.prompt_tokens
    assert trajectory.metadata["completion_tokens"] == first.usage.completion_tokens + second.usage.completion_tokens
    assert (turn1.temperature, trajectory.adapter_version) == (0.7, "upstream")
    # the key is nowhere: not in the landing, not in what the proxy says, not in any log record
    assert KEY not in _files_text(tmp_path) + health + metrics + caplog.text


def test_a_proxied_stream_relays_the_upstreams_chunks_and_captures_the_whole_answer(upstream_server, tmp_path):
    direct = openai.OpenAI(base_url=upstream_server.url + "/v1", api_key=KEY)
    ask = dict(model="my-agent", messages=[{"role": "user", "content": "12+30"}], max_tokens=24, temperature=1.0, seed=5)
    whole = direct.chat.completions.create(**ask | {"model": "policy"})
    with _proxy(upstream_server.url + "/v1", tmp_path) as proxy:
        client = openai.OpenAI(base_url=proxy.url + "/v1", api_key="x", default_headers={"X-Agent-ID": "s-1"})
        chunks = list(client.chat.completions.create(**ask, stream=True))
        with_usage = list(client.chat.completions.create(**ask, stream=True, stream_options={"include_usage": True},
                                                         extra_headers={"X-Agent-ID": "s-2"}))  # fmt: skip
        for rollout in ("s-1", "s-2"):
            done = httpx.post(f"{proxy.url}/rollouts/{rollout}/finish", json={"task_id": "t", "score": 0.0}).json()
        landed = httpx.post(f"{proxy.url}/batches/{done['batch']}/close").json()["path"]
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content and len([c for c in chunks if c.choices]) > 2  # streamed, not one piece
    assert chunks[-1].choices[0].finish_reason == whole.choices[0].finish_reason
    assert all(c.usage is None for c in chunks)  # not asked for: the upstream's usage chunk is not passed on
    assert with_usage[-1].usage.completion_tokens == whole.usage.completion_tokens
    by_id = {t.trajectory_id: t for t in _landed(landed)}
    for rollout in ("s-1", "s-2"):
        (step,) = by_id[rollout].steps
        assert step.output == whole.choices[0].message.content and step.token_ids is None
        assert by_id[rollout].metadata["completion_tokens"] == whole.usage.completion_tokens


def test_upstream_errors_reach_the_agent_in_openai_shape_without_the_key(upstream_server, tmp_path, caplog):
    caplog.set_level(logging.DEBUG)
    wrong = "sk-wrong-0d9e"
    with _proxy(upstream_server.url + "/v1", tmp_path / "a", key=wrong) as proxy:
        client = openai.OpenAI(base_url=proxy.url + "/v1", api_key="x")
        with pytest.raises(openai.AuthenticationError) as refused:
            client.chat.completions.create(model="m", messages=[{"role": "user", "content": "1+1"}], max_tokens=4)
    with _proxy("http://127.0.0.1:9/v1", tmp_path / "b") as proxy:  # nothing listens on the discard port
        client = openai.OpenAI(base_url=proxy.url + "/v1", api_key="x", max_retries=0)
        with pytest.raises(openai.APIStatusError) as unreachable:
            client.chat.completions.create(model="m", messages=[{"role": "user", "content": "1+1"}], max_tokens=4)
    assert refused.value.status_code == 401 and wrong not in str(refused.value.body)
    assert unreachable.value.status_code == 502 and "could not be reached" in unreachable.value.body["message"]
    assert wrong not in caplog.text and KEY not in caplog.text + _files_text(tmp_path)


def test_the_messages_api_is_proxied_and_captured_like_chat(upstream_server, tmp_path):
    body = {"model": "claude-agent", "max_tokens": 16, "temperature": 0.7, "messages": [{"role": "user", "content": "9*9"}]}
    with _proxy(upstream_server.url + "/v1", tmp_path) as proxy:
        message = httpx.post(f"{proxy.url}/v1/messages", json=body, headers={"X-Agent-ID": "m-1"}).json()
        done = httpx.post(f"{proxy.url}/rollouts/m-1/finish", json={"task_id": "t", "score": 1.0}).json()
        landed = httpx.post(f"{proxy.url}/batches/{done['batch']}/close").json()["path"]
    (trajectory,) = _landed(landed)
    text = "".join(b.get("text", "") for b in message["content"] if b["type"] == "text")
    assert message["type"] == "message" and trajectory.steps[-1].output == text
    assert message["usage"]["output_tokens"] == trajectory.metadata["completion_tokens"] > 0


def test_the_forwarded_body_and_the_stream_fold():
    upstream = Upstream("http://h/v1/", model="gpt-x", api_key="k")
    tool = {"type": "function", "function": {"name": "calc", "description": "overridden"}}
    body = forwarded_body({"model": "a", "messages": [], "stream": True, "temperature": 0.2, "tools": []}, "gpt-x", [{"role": "user", "content": "q"}],
                          [tool], 1.0, None)  # fmt: skip
    assert body == {"model": "gpt-x", "messages": [{"role": "user", "content": "q"}], "stream": True, "temperature": 1.0, "tools": [tool],
                    "stream_options": {"include_usage": True}}  # fmt: skip
    assert forwarded_body({"model": "a", "messages": [], "top_p": 0.5}, "a", [], None, None, 0.9) == {"model": "a", "messages": [], "top_p": 0.9}
    assert upstream.base_url == "http://h/v1" and "k" not in repr(upstream) and upstream.redact("bad key k!") == f"bad {REDACTED}ey {REDACTED}!"
    assert Settings.from_environ({"FLOWOPT_UPSTREAM_API_KEY": "sk-9"}).upstream_api_key == "sk-9"
    assert "sk-9" not in repr(Settings.from_environ({"FLOWOPT_UPSTREAM_API_KEY": "sk-9"}))
    with pytest.raises(ValueError, match="http"):
        Upstream("h:8080")
    chunks = [
        {"choices": [{"index": 0, "delta": {"role": "assistant", "content": "Let"}}]},
        {"choices": [{"index": 0, "delta": {"content": " me", "tool_calls": [{"index": 0, "id": "c1", "function": {"name": "calc", "arguments": ""}}]}}]},
        {"choices": [{"index": 0, "delta": {"tool_calls": [{"index": 0, "function": {"arguments": '{"x":'}}]}}]},
        {"choices": [{"index": 0, "delta": {"tool_calls": [{"index": 1, "id": "c2", "function": {"name": "calc", "arguments": "{}"}}]}}]},
        {"choices": [{"index": 0, "delta": {"tool_calls": [{"index": 0, "function": {"arguments": "1}"}}]}, "finish_reason": "tool_calls"}]},
        {"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 4}},
    ]
    choices, usage = fold_chunks(chunks)
    assert usage == {"prompt_tokens": 3, "completion_tokens": 4} and choices[0].finish_reason == "tool_calls"
    assert choices[0].message() == {"role": "assistant", "content": "Let me", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "calc", "arguments": '{"x":1}'}},
        {"id": "c2", "type": "function", "function": {"name": "calc", "arguments": "{}"}}]}  # fmt: skip
    assert StreamedChoice().message() == {"role": "assistant", "content": None}


def test_an_upstream_error_body_that_echoes_the_key_is_redacted():
    async def failure():
        client = UpstreamClient(Upstream("http://h/v1", api_key="sk-echo"))
        return client._failure(401, '{"error": {"message": "Incorrect API key provided: sk-echo"}}')

    error = asyncio.run(failure())
    assert error.status == 401 and error.body["error"]["message"] == f"Incorrect API key provided: {REDACTED}"


def test_serve_upstream_refuses_a_bad_url_and_a_model_before_serving(tmp_path):
    code, _, err = run_cli(["serve", "--upstream", "localhost:8080", "--models", str(tmp_path / "m")])
    assert code == 2 and "--upstream" in err and "http://" in err
    code, _, err = run_cli(["serve", "--upstream", "http://127.0.0.1:8080/v1", "--preset", "smollm2-135m-instruct", "--models", str(tmp_path / "m")])
    assert code == 2 and "no --preset" in err
    assert not (tmp_path / "m").exists()


DEMO = ({"role": "user", "content": "2+2"},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "c0", "type": "function", "function": {"name": "calculator", "arguments": '{"expression": "2+2"}'}}]},
        {"role": "tool", "tool_call_id": "c0", "content": "4"},
        {"role": "assistant", "content": "4"})  # fmt: skip


def test_a_prompt_policy_reaches_the_upstream_exactly_as_documented(upstream_server, calculator_policy_dir, tmp_path):
    registry = AdapterRegistry(root=str(tmp_path / "models"))
    policy = PromptPolicy("Use the calculator.", (DEMO,), {"calculator": "evaluates one arithmetic expression"})
    registry.promote("v1", str(policy.save(tmp_path / "models" / "prompts" / "v1")), {}, by="test", reason="first", action="register")
    messages = [{"role": "system", "content": "You are a bot."}, {"role": "user", "content": "7*6"}]
    # the upstream captures what it was sent under rollout "up-1" (its key names the rollout)
    with _proxy(upstream_server.url + "/v1", tmp_path, key=f"{KEY}:up-1") as proxy:
        reply = httpx.post(f"{proxy.url}/v1/chat/completions", headers={"X-Agent-ID": "agent-1"}, json={
            "model": "policy", "messages": messages, "tools": [CALCULATOR_TOOL], "max_tokens": 8, "seed": 3})  # fmt: skip
        batch = httpx.post(f"{proxy.url}/rollouts/agent-1/finish", json={"task_id": "t", "score": 1.0}).json()["batch"]
        landed = httpx.post(f"{proxy.url}/batches/{batch}/close").json()["path"]
    auth = {"Authorization": f"Bearer {KEY}"}
    done = httpx.post(f"{upstream_server.url}/rollouts/up-1/finish", json={"task_id": "t", "score": 1.0}, headers=auth).json()
    upstream_landed = httpx.post(f"{upstream_server.url}/batches/{done['batch']}/close", headers=auth).json()["path"]
    assert reply.status_code == 200 and reply.headers["X-Flowopt-Adapter-Version"] == "v1"
    sent = [{"role": "system", "content": "Use the calculator.\n\nYou are a bot."}, *DEMO, messages[1]]
    tool = {**CALCULATOR_TOOL, "function": {**CALCULATOR_TOOL["function"], "description": "evaluates one arithmetic expression"}}
    tokenizer = AutoTokenizer.from_pretrained(str(calculator_policy_dir / "base"))
    (upstream_step,) = [s for s in _landed(upstream_landed)[0].steps if s.prompt_token_ids]
    assert upstream_step.prompt_token_ids == render_prompt(tokenizer, sent, [tool])[1]
    # the proxy's own capture keeps the agent's messages, under the prompt version that served them
    (trajectory,) = _landed(landed)
    assert trajectory.adapter_version == "v1" and trajectory.query == "7*6"


def test_a_prompt_version_is_ab_tested_promoted_and_rolled_back_like_an_adapter(upstream_server, tmp_path):
    registry = AdapterRegistry(root=str(tmp_path / "models"))
    paths = {v: str(PromptPolicy(f"instructions {v}").save(tmp_path / "models" / "prompts" / v)) for v in ("v1", "v2", "v3")}
    registry.promote("v1", paths["v1"], {}, by="test", reason="first", action="register")
    ask = {"model": "policy", "messages": [{"role": "user", "content": "1+1"}], "max_tokens": 2}

    def served(proxy, session: str) -> str:
        response = httpx.post(f"{proxy.url}/v1/chat/completions", json=ask, headers={"X-Session-ID": session})
        assert response.status_code == 200, response.text
        return response.headers["X-Flowopt-Adapter-Version"]

    with _proxy(upstream_server.url + "/v1", tmp_path) as proxy:
        challenger = registry.start_challenger("v2", paths["v2"], {}, share=0.5, by="test", reason="a/b")
        sessions = [f"s{i}" for i in range(12)]
        assert [served(proxy, s) for s in sessions] == ["v2" if in_challenger_share(s, challenger) else "v1" for s in sessions]
        assert {"v1", "v2"} == {served(proxy, s) for s in sessions}
        registry.conclude_challenger("rollback", by="test", reason="worse")
        assert {served(proxy, s) for s in sessions} == {"v1"}
        registry.promote("v3", paths["v3"], {}, by="test", reason="better")
        assert served(proxy, "s0") == "v3"
        code, _, err = run_cli(["rollback", "--models", str(tmp_path / "models"), "--reason", "test"])
        assert code == 0, err
        assert served(proxy, "s0") == "v1"
        # a LoRA adapter cannot be applied to an upstream model: a clear 400, not a failure upstream
        (tmp_path / "lora").mkdir()
        registry.promote("v4", str(tmp_path / "lora"), {}, by="test", reason="adapter")
        refused = httpx.post(f"{proxy.url}/v1/chat/completions", json=ask)
    assert refused.status_code == 400 and "v4 is not a prompt policy" in refused.json()["error"]["message"]


def test_a_call_the_prompt_version_makes_fail_is_that_versions_failure_in_the_trajectory(upstream_server, tmp_path):
    """A prompt too long for the upstream's context: every call of the rollout is refused (400),
    yet the trajectory names the version that caused it, so a live A/B counts the failure."""
    registry = AdapterRegistry(root=str(tmp_path / "models"))
    long_demo = ({"role": "user", "content": "1+1 " * 200}, {"role": "assistant", "content": "2"})
    registry.promote("v1", str(PromptPolicy(demonstrations=(long_demo,)).save(tmp_path / "models" / "prompts" / "v1")), {}, by="test",
                     reason="too long", action="register")  # fmt: skip
    with _proxy(upstream_server.url + "/v1", tmp_path) as proxy:
        client = openai.OpenAI(base_url=proxy.url + "/v1", api_key="x", max_retries=0, default_headers={"X-Agent-ID": "f-1"})
        with pytest.raises(openai.BadRequestError) as refused:
            client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "3*4"}], max_tokens=8)
        done = httpx.post(f"{proxy.url}/rollouts/f-1/finish", json={"task_id": "t", "error": "BadRequestError 400"}).json()
        landed = httpx.post(f"{proxy.url}/batches/{done['batch']}/close").json()["path"]
    assert refused.value.response.headers["X-Flowopt-Adapter-Version"] == "v1"
    (trajectory,) = _landed(landed)
    assert trajectory.adapter_version == "v1" and trajectory.steps == [] and trajectory.outcome.score == 0.0
    (failure,) = trajectory.metadata["failed_calls"]
    assert failure["version"] == "v1" and failure["status"] == 400 and "maximum context length" in failure["message"]


def test_an_agent_that_leaves_a_plain_call_cancels_the_upstreams_generation(fresh_policy_dir, tmp_path):
    """The proxy closes its upstream call when its agent goes away mid-generation, so the upstream
    (here a flowopt gateway, which counts such cancellations) stops generating for nobody.

    The agent leaves once the upstream is decoding its call, not after a fixed timeout: under load
    a timeout fired before the proxy's call had reached the upstream (the proxy counted its agent
    leaving, the upstream had nothing to cancel; a fresh clone's CI, 2026-12-06)."""

    def cancelled(url: str) -> float:
        metrics = httpx.get(f"{url}/metrics", headers={"Authorization": f"Bearer {KEY}"}).text
        return sum(float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines() if line.startswith('flowopt_gateway_cancelled_total{mode="plain"}'))

    # the fresh tiny policy's 64 greedy completions run to max_tokens (tests/serving/test_streaming.py)
    with GatewayServer(make_gateway(PolicyStore(str(fresh_policy_dir)), tmp_path / "upstream"), tokens=[KEY]) as upstream:
        with _proxy(upstream.url + "/v1", tmp_path) as proxy:

            async def call() -> None:
                async with openai.AsyncOpenAI(base_url=proxy.url + "/v1", api_key="x", max_retries=0, timeout=120) as agent:
                    await agent.chat.completions.create(model="m", messages=[{"role": "user", "content": "ab"}], **LONG)

            left_at_step = leave_while_decoding(upstream.gateway.batcher, call)
            deadline = time.monotonic() + 60
            while cancelled(upstream.url) == 0 and time.monotonic() < deadline:
                time.sleep(0.05)
            assert cancelled(proxy.url) == 1  # the proxy saw its agent leave
            # and the upstream stopped generating
            assert cancelled(upstream.url) == 1, f"the agent left at the upstream's decoding step {left_at_step}"
