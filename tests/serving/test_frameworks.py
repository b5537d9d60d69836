"""Real agent frameworks, in their default modes, over real HTTP against the gateway on the tiny
calculator policy: each runs its own tool loop inside the rollout helper, and exactly one
trajectory lands with the reward and the turns the gateway sampled.

- openai-agents: ``Agent(model="policy")`` through its ``OpenAIProvider``, whose default model is
  ``OpenAIResponsesModel`` (``POST /v1/responses``); ``Runner.run`` and ``Runner.run_streamed``.
- LangChain / LangGraph: ``langchain.agents.create_agent`` (LangGraph's ReAct agent; it replaces
  the deprecated ``langgraph.prebuilt.create_react_agent``) over ``ChatOpenAI``, streamed with
  ``stream_mode="messages"`` (Chat Completions, ``stream: true``).
- pydantic-ai: ``Agent("openai:policy").run_stream`` (the ``openai:`` prefix resolves to
  ``OpenAIResponsesModel``: Responses streaming). llama-index's ``FunctionAgent`` is not here:
  ``llama-index-llms-openai`` requires ``openai<3`` (docs/gateway.md, "Frameworks, as tested").

The tiny policy's chat template ignores tool specifications (``flow_assets/policy/chat.py``), so a
framework's tool schema costs no context; none of these frameworks sends a system prompt unless
given instructions, so the prompts are the 12 and 42 tokens (of 128) of the calculator conversation,
exactly as the template renders it without one (asserted).
"""

import asyncio
import json
from pathlib import Path

import httpx
import pytest
import torch

from flow_assets.logs.schema import Trajectory
from flow_assets.policy.chat import render_prompt
from flow_assets.policy.sampling import completion_logprobs
from flow_assets.policy.store import PolicyStore
from flow_assets.serving.client import rollout
from flow_assets.serving.gateway.app import GatewayConfig
from flow_assets.serving.gateway.serve import serve_policy
from flow_assets.tasks.calculator import CALCULATOR_TOOL
from flow_assets.tasks.calculator import calculator as evaluate

QUESTION = "874*59"
#: what the calculator policy writes for its call (compact syntax) before its end-of-turn token
CALL_TEXT = "@calculator(874*59)"
#: imposed by the rollout (``POST /rollouts`` ``temperature``), not by the framework: at 0.7 the
#: policy calls the tool with the question's expression every time (30 of 30 samples)
TEMPERATURE = 0.7


@pytest.fixture(scope="module")
def server(calculator_policy_dir, tmp_path_factory):
    # the default config caps a call that sets no max_tokens (no framework here sets one) as
    # `flowopt serve` does; the store's cap for its own rounds (8 tokens) cuts the tool call
    config = GatewayConfig()
    with serve_policy(PolicyStore(str(calculator_policy_dir)), tmp_path_factory.mktemp("frameworks_landing"), config=config) as running:
        yield running


@pytest.fixture(scope="module")
def policy(calculator_policy_dir):
    """The served champion (``v0``) and its tokenizer, to re-score the landed turns."""
    store = PolicyStore(str(calculator_policy_dir))
    return store.load(str(store.adapter_dir("v0")))


class Recorder:
    """What a framework sent: ``(path, JSON body)`` per HTTP request, read by an httpx event hook
    on the client the framework is given (the request itself goes out unchanged)."""

    def __init__(self):
        self.requests: list[tuple[str, dict]] = []

    def _record(self, request: httpx.Request) -> None:
        self.requests.append((request.url.path, json.loads(request.content)))

    def client(self) -> httpx.Client:
        """A sync client that records."""
        return httpx.Client(event_hooks={"request": [self._record]})

    def async_client(self) -> httpx.AsyncClient:
        """An async client that records."""

        async def record(request: httpx.Request) -> None:
            self._record(request)

        return httpx.AsyncClient(event_hooks={"request": [record]})


def calculator_tool(calls: list[str]):
    """The calculator as a plain Python function, the way frameworks take tools: its name,
    docstring and one ``expression: str`` parameter are :data:`CALCULATOR_TOOL`'s; every call
    appends the expression the framework parsed out of the model's call to ``calls``."""

    def calculator(expression: str) -> str:
        calls.append(expression)
        return evaluate(expression)

    calculator.__doc__ = CALCULATOR_TOOL["function"]["description"]
    return calculator


def _rewarded(r, answer: str) -> float:
    """The verifier's reward (exact match, as ``CalculatorSource.score``), given to the helper."""
    score = float(answer.strip() == evaluate(QUESTION))
    r.reward(score=score, final_answer=answer)
    return score


def _assert_landed_as_sampled(server, r, score: float, calls: list[str], answer: str, policy) -> Trajectory:
    """One trajectory landed for the rollout, with the reward, and its turns are what the gateway
    sampled and the framework received."""
    assert calls == [QUESTION] and answer  # the framework ran the tool with the arguments it parsed, then answered
    assert r.landed["trajectory_id"] == r.rollout_id and r.landed["llm_calls"] == 2 and r.landed["tool_calls"] == 1
    lines = Path(httpx.post(f"{server.url}/batches/{r.landed['batch']}/close").json()["path"]).read_text().splitlines()
    (trajectory,) = map(Trajectory.model_validate_json, lines)  # the batch is this rollout's own: one trajectory
    assert trajectory.trajectory_id == r.rollout_id and trajectory.outcome.score == score and trajectory.final_answer == answer
    call, observation, final = trajectory.steps
    assert (call.kind, observation.kind, final.kind) == ("tool", "observation", "answer") and observation.output == evaluate(QUESTION)
    model, tokenizer = policy
    # the sampled ids decode to what the framework got: the call it ran, then the text it returned
    assert tokenizer.decode(call.token_ids, skip_special_tokens=True) == CALL_TEXT and call.token_ids[-1] == tokenizer.eos_token_id
    assert tokenizer.decode(final.token_ids, skip_special_tokens=True) == answer
    # the second prompt begins with the first turn exactly as sampled: the framework sent the
    # call back, and its rendering is the sampled ids (nothing re-tokenised differently)
    assert final.prompt_token_ids[: len(call.prompt_token_ids) + len(call.token_ids)] == call.prompt_token_ids + call.token_ids
    # and the prompts are the bare calculator conversation: no system prompt came with the request
    (sampled,) = call.input["tool_calls"]
    sent = {"id": sampled["id"], "type": "function", "function": {"name": "calculator", "arguments": json.dumps({"expression": QUESTION})}}
    conversation = [
        {"role": "user", "content": QUESTION},
        {"role": "assistant", "content": None, "tool_calls": [sent]},
        {"role": "tool", "tool_call_id": sent["id"], "content": evaluate(QUESTION)},
    ]
    assert render_prompt(tokenizer, conversation[:1], [CALCULATOR_TOOL])[1] == call.prompt_token_ids
    assert render_prompt(tokenizer, conversation, [CALCULATOR_TOOL])[1] == final.prompt_token_ids
    # the recorded log-probs are the policy's for those ids at the rollout's temperature
    for step in (call, final):
        assert step.temperature == TEMPERATURE and len(step.logprobs) == len(step.token_ids)
        with torch.no_grad():
            logp, _ = completion_logprobs(model, [step.prompt_token_ids], [step.token_ids], tokenizer.pad_token_id, step.temperature)
        assert torch.allclose(logp[0], torch.tensor(step.logprobs), atol=1e-4)
    return trajectory


@pytest.mark.parametrize("mode", ["run", "run_streamed"])
def test_openai_agents_with_its_default_responses_model(server, policy, mode):
    agents = pytest.importorskip("agents")
    from openai import AsyncOpenAI

    recorder, calls = Recorder(), []

    async def episode(r) -> str:
        client = AsyncOpenAI(base_url=r.base_url, api_key=r.api_key, http_client=recorder.async_client())
        # no model class named: the provider's default (the Responses model) serves "policy"
        config = agents.RunConfig(model_provider=agents.OpenAIProvider(openai_client=client), tracing_disabled=True)
        agent = agents.Agent(name="calculator", model="policy", tools=[agents.function_tool(calculator_tool(calls))])
        if mode == "run":
            return (await agents.Runner.run(agent, QUESTION, run_config=config)).final_output
        streamed = agents.Runner.run_streamed(agent, QUESTION, run_config=config)
        deltas = [e.data.delta async for e in streamed.stream_events() if e.type == "raw_response_event" and e.data.type == "response.output_text.delta"]
        assert "".join(deltas) == streamed.final_output
        return streamed.final_output

    async def main():
        async with rollout(server.url, task_id=f"calculator-{QUESTION}", batch=f"openai-agents-{mode}", temperature=TEMPERATURE) as r:
            answer = await episode(r)
            return r, answer, _rewarded(r, answer)

    r, answer, score = asyncio.run(main())
    assert [path for path, _ in recorder.requests] == ["/v1/responses"] * 2
    assert {body.get("stream", False) for _, body in recorder.requests} == {mode == "run_streamed"}
    steps = _assert_landed_as_sampled(server, r, score, calls, answer, policy).steps
    # the function_call_output the SDK sent back answers the call id the gateway captured
    second = recorder.requests[1][1]["input"]
    assert [i["call_id"] for i in second if i.get("type") == "function_call_output"] == [steps[0].input["tool_calls"][0]["id"]]


def test_langgraph_react_agent_streaming_messages(server, policy):
    pytest.importorskip("langgraph")
    langchain_agents = pytest.importorskip("langchain.agents")
    from langchain_core.messages import AIMessageChunk, ToolMessage
    from langchain_openai import ChatOpenAI

    recorder, calls = Recorder(), []
    with rollout(server.url, task_id=f"calculator-{QUESTION}", batch="langgraph", temperature=TEMPERATURE) as r:
        llm = ChatOpenAI(model="policy", base_url=r.base_url, api_key=r.api_key, http_client=recorder.client())
        agent = langchain_agents.create_agent(llm, tools=[calculator_tool(calls)])
        messages = [message for message, _ in agent.stream({"messages": [("user", QUESTION)]}, stream_mode="messages")]
        (tool_message,) = [m for m in messages if isinstance(m, ToolMessage)]
        after = messages[messages.index(tool_message) + 1 :]
        pieces = [m.content for m in after if isinstance(m, AIMessageChunk) and m.content]
        answer = "".join(pieces)
        score = _rewarded(r, answer)
    assert [path for path, _ in recorder.requests] == ["/v1/chat/completions"] * 2
    assert all(body["stream"] for _, body in recorder.requests)
    # token by token: the answer came in several chunks; the tool call as a streamed call chunk
    assert len(pieces) > 1 and tool_message.content == evaluate(QUESTION)
    call_chunks = [m for m in messages[: messages.index(tool_message)] if isinstance(m, AIMessageChunk) and m.tool_call_chunks]
    assert [c["name"] for m in call_chunks for c in m.tool_call_chunks if c["name"]] == ["calculator"]
    steps = _assert_landed_as_sampled(server, r, score, calls, answer, policy).steps
    assert tool_message.tool_call_id == steps[0].input["tool_calls"][0]["id"]


def test_pydantic_ai_run_stream_on_its_default_openai_model(server, policy):
    pytest.importorskip("pydantic_ai")
    from openai import AsyncOpenAI
    from pydantic_ai import Agent
    from pydantic_ai.models import infer_model
    from pydantic_ai.providers.openai import OpenAIProvider

    recorder, calls = Recorder(), []

    async def main():
        async with rollout(server.url, task_id=f"calculator-{QUESTION}", batch="pydantic-ai", temperature=TEMPERATURE) as r:
            client = AsyncOpenAI(base_url=r.base_url, api_key=r.api_key, http_client=recorder.async_client())
            # "openai:policy" resolved as Agent("openai:policy") resolves it, with this gateway's provider
            model = infer_model("openai:policy", provider_factory=lambda _: OpenAIProvider(openai_client=client))
            agent = Agent(model, tools=[calculator_tool(calls)])
            async with agent.run_stream(QUESTION) as result:
                pieces = [p async for p in result.stream_text(delta=True)]
            answer = "".join(pieces)
            return r, answer, _rewarded(r, answer), type(model).__name__

    r, answer, score, model_class = asyncio.run(main())
    assert model_class == "OpenAIResponsesModel"
    assert [path for path, _ in recorder.requests] == ["/v1/responses"] * 2 and all(b["stream"] for _, b in recorder.requests)
    _assert_landed_as_sampled(server, r, score, calls, answer, policy)
