"""A hosted version that is both a LoRA adapter and a prompt policy (#30, item 4), over real HTTP:
the hosting gateway applies the version's prompt exactly as the proxy does, the captured ids are
what the model saw, and a version that is a prompt alone is refused with the way to serve it."""

import httpx
import pytest
from transformers import AutoTokenizer

from flow_assets.logs.schema import Trajectory
from flow_assets.policy.chat import render_prompt
from flow_assets.policy.prompt import PROMPT_POLICY_FILE, PromptPolicy, PromptPolicyError, carry_prompt, hosted_version, next_round_kind, policy_kind
from flow_assets.policy.store import PolicyStore
from flow_assets.serving.gateway.engine import AdapterRef
from flow_assets.serving.gateway.serve import make_gateway
from flow_assets.serving.gateway.server import GatewayServer
from flow_assets.tasks.calculator import CALCULATOR_TOOL
from resources.registry import AdapterRegistry, adapter_problem

DEMO = ({"role": "user", "content": "2+2"},
        {"role": "assistant", "tool_calls": [{"id": "c0", "type": "function", "function": {"name": "calculator", "arguments": '{"expression": "2+2"}'}}]},
        {"role": "tool", "tool_call_id": "c0", "content": "4"},
        {"role": "assistant", "content": "4"})  # fmt: skip


def _call(server: GatewayServer, model: str, agent: str, messages: list[dict]) -> tuple[httpx.Response, Trajectory | None]:
    reply = httpx.post(f"{server.url}/v1/chat/completions", headers={"X-Agent-ID": agent}, timeout=60,
                       json={"model": model, "messages": messages, "tools": [CALCULATOR_TOOL], "max_tokens": 8, "seed": 3})  # fmt: skip
    done = httpx.post(f"{server.url}/rollouts/{agent}/finish", json={"task_id": "t", "score": 1.0}).json()
    path = httpx.post(f"{server.url}/batches/{done['batch']}/close").json()["path"]
    (trajectory,) = [Trajectory.model_validate_json(line) for line in open(path).read().splitlines()]
    return reply, trajectory


def test_a_hosted_adapter_under_a_prompt_policy_is_served_and_captured_as_the_model_saw_it(calculator_policy_dir, tmp_path):
    adapter = AdapterRegistry(root=str(calculator_policy_dir)).champion()["adapter_path"]
    policy = PromptPolicy("Use the calculator.", (DEMO,), {"calculator": "evaluates one arithmetic expression"})
    hosted, alone = hosted_version(adapter, policy, tmp_path / "v9"), policy.save(tmp_path / "v10")
    assert (policy_kind(hosted), policy_kind(alone), policy_kind(adapter)) == ("adapter+prompt", "prompt", "adapter")
    assert adapter_problem(hosted) is None and PromptPolicy.load(hosted).content_hash == policy.content_hash
    extra = {"prompted": AdapterRef("v9", str(hosted)), "plain": AdapterRef("v0", adapter), "alone": AdapterRef("v10", str(alone))}
    messages = [{"role": "system", "content": "You are a bot."}, {"role": "user", "content": "7*6"}]
    with GatewayServer(make_gateway(PolicyStore(str(calculator_policy_dir)), tmp_path / "landing", extra=extra)) as server:
        prompted, prompted_flow = _call(server, "prompted", "a-1", messages)
        plain, plain_flow = _call(server, "plain", "a-2", messages)
        refused = httpx.post(f"{server.url}/v1/chat/completions", json={"model": "alone", "messages": messages, "max_tokens": 4})
    tokenizer = AutoTokenizer.from_pretrained(str(calculator_policy_dir / "base"))
    # as documented (flow_assets.policy.prompt): instructions before the agent's system text, the
    # demonstration after it, the tool's description replaced; the ids are what the model saw
    sent = [{"role": "system", "content": "Use the calculator.\n\nYou are a bot."}, *DEMO, messages[1]]
    tool = {**CALCULATOR_TOOL, "function": {**CALCULATOR_TOOL["function"], "description": "evaluates one arithmetic expression"}}
    shown = render_prompt(tokenizer, sent, [tool])[1]
    assert prompted.status_code == 200 and prompted.headers["X-Flowopt-Adapter-Version"] == "v9"
    assert prompted_flow.steps[0].prompt_token_ids == shown and prompted.json()["usage"]["prompt_tokens"] == len(shown)
    # the same adapter without the prompt sees the agent's messages alone
    assert plain.status_code == 200 and plain_flow.steps[0].prompt_token_ids == render_prompt(tokenizer, messages, [CALCULATOR_TOOL])[1]
    assert len(shown) > len(plain_flow.steps[0].prompt_token_ids)
    # the trajectory keeps the agent's conversation, under the version that served it
    assert prompted_flow.adapter_version == "v9" and prompted_flow.query == "7*6"
    # a prompt policy without an adapter needs an upstream model: a clear 400 naming the way
    assert refused.status_code == 400 and refused.headers["X-Flowopt-Adapter-Version"] == "v10"
    assert "flowopt serve --upstream" in refused.json()["error"]["message"]


def test_policy_kinds_carry_and_the_round_schedule(tmp_path):
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text("{}")
    (adapter / "adapter_model.safetensors").write_bytes(b"weights")
    child = tmp_path / "child"
    child.mkdir()
    assert not carry_prompt(adapter, child) and not (child / PROMPT_POLICY_FILE).exists()
    both = hosted_version(adapter, PromptPolicy("be brief"), tmp_path / "both")
    assert (both / "adapter_model.safetensors").read_bytes() == b"weights" and policy_kind(both) == "adapter+prompt"
    assert carry_prompt(both, child) and PromptPolicy.load(child).instructions == "be brief"
    # a new prompt replaces the adapter's old one, never both in one directory
    again = hosted_version(both, PromptPolicy("be exact"), tmp_path / "again")
    assert PromptPolicy.load(again).instructions == "be exact" and sorted(p.name for p in again.iterdir()) == sorted(p.name for p in both.iterdir())
    # a hosted version is checked as an adapter and as a prompt policy
    (both / PROMPT_POLICY_FILE).write_text("{")
    assert "prompt policy cannot be read" in adapter_problem(both)
    with pytest.raises(PromptPolicyError):
        carry_prompt(both, child)
    (again / "adapter_model.safetensors").unlink()
    assert "has no adapter_model.safetensors" in adapter_problem(again)
    with pytest.raises(FileNotFoundError, match="not a LoRA adapter directory"):
        hosted_version(tmp_path / "child-of-nothing", PromptPolicy(), tmp_path / "x")
    # one change per round: a prompt alone always gets prompt rounds; a hosted policy cycles
    assert [next_round_kind("prompt", ("adapter",), n) for n in range(3)] == ["prompt"] * 3
    assert [next_round_kind("adapter", ("prompt", "adapter"), n) for n in range(4)] == ["prompt", "adapter", "prompt", "adapter"]
    assert [next_round_kind("adapter+prompt", ("adapter",), n) for n in range(2)] == ["adapter", "adapter"]
    with pytest.raises(ValueError, match="round schedule"):
        next_round_kind("adapter", ("weights",), 0)
    with pytest.raises(ValueError, match="round schedule"):
        next_round_kind("adapter", (), 0)
