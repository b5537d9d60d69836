"""Reflective rewriting (GEPA, the ``gepa`` package) of a prompt policy's instructions: the agent
on the tiny calculator policy behind the proxy, the reflection model SmolLM2-135M-Instruct served
by llama-cpp-python's server (a model server not written here), over real HTTP."""

import json

import pytest

from flow_assets.logs.schema import Outcome, Step, Trajectory
from flow_assets.policy.prompt import PromptPolicy
from flow_assets.policy.store import PolicyStore
from flow_assets.serving.gateway.serve import make_gateway
from flow_assets.serving.gateway.server import GatewayServer
from flow_assets.serving.gateway.upstream import Upstream
from flow_assets.training.prompt_reflection import ReflectionModel, flow_transcript, reflect_instructions, reflective_record
from flow_assets.training.prompt_rounds import PromptRoundError, landed_flows, proxy_scores
from resources.tasks import TaskSourceResource
from tests.llama_cpp_server import llama_cpp_server

pytestmark = pytest.mark.slow
KEY, REFLECTION_KEY = "sk-upstream-gepa-55d1", "sk-reflect-8c0e2a"


def test_a_flow_becomes_the_feedback_the_reflection_model_reads():
    flow = Trajectory(
        trajectory_id="t", task_id="calculator-3*4", agent_id="a", query="What is 3*4?",
        steps=[Step(index=0, kind="tool", input={"tool_calls": [{"id": "c", "name": "calculator", "arguments": {"expression": "3*4"}}]}),
               Step(index=1, kind="observation", output="12"), Step(index=2, kind="answer", output="13")],
        final_answer="13", outcome=Outcome(success=False, score=0.0), metadata={"error": {"kind": "x", "message": "cut at 48 tokens"}},
    )  # fmt: skip
    assert flow_transcript(flow) == 'called calculator({"expression": "3*4"})\ntool result: 12\nanswer: 13\nerror: cut at 48 tokens'
    task = TaskSourceResource(kind="calculator").source().tasks("train")[0]
    record = reflective_record(task, flow, 0.0, False)
    assert record["Inputs"] == task.query and record["Feedback"] == f"Reward 0.00. The answer is wrong; the expected answer is {task.reference}."
    assert reflective_record(task, None, 1.0, True)["Generated Outputs"] == "(no flow was recorded)"
    with pytest.raises(ValueError, match="http"):
        ReflectionModel("localhost:1", "m")


def test_gepa_rewrites_the_instructions_from_the_failures_through_the_proxy(calculator_policy_dir, tmp_path):
    source = TaskSourceResource(kind="calculator")
    tasks = source.source().tasks("train")
    train, val = tasks[:8], tasks[8:14]
    with (
        GatewayServer(make_gateway(PolicyStore(str(calculator_policy_dir)), tmp_path / "upstream-landing"), tokens=[KEY]) as upstream,
        llama_cpp_server(tmp_path / "llama.log", REFLECTION_KEY) as reflection_url,
    ):  # fmt: skip
        proxy_to = Upstream(upstream.url + "/v1", "policy", KEY, timeout_s=120)

        def run(policy, batch, where):
            rows, usage = proxy_scores(proxy_to, tmp_path / "models" / "registry.json", {"gepa": policy}, batch, source.source().score,
                                       source.agent_fn(), source.agent_id, {"sampled": 0.7}, 16, where)  # fmt: skip
            return rows, usage, landed_flows(where / "flows")

        wrong = ReflectionModel(reflection_url, "smollm2", "sk-wrong")
        with pytest.raises(PromptRoundError, match="answered 401") as refused:
            wrong("Say hi.")
        assert "sk-wrong" not in str(refused.value)
        reflection = ReflectionModel(reflection_url, "smollm2", REFLECTION_KEY, max_tokens=96, temperature=0.7)
        seed = PromptPolicy(instructions="", tool_descriptions={"calculator": "Evaluates an arithmetic expression."})
        result = reflect_instructions(seed, train, val, run, reflection, max_metric_calls=30, minibatch_size=4, scratch=tmp_path / "gepa")
    # GEPA scored the seed on the validation tasks first, then asked the reflection model for new
    # instructions from our feedback on a minibatch, and tried each proposal
    assert reflection.calls >= 1 and reflection.calls == len(reflection.replies) and reflection.prompt_tokens > 0
    assert result.instructions[0] == "" and result.val_scores[0] >= 0.0 and len(result.val_scores) == len(result.instructions)
    scratch_evals = sorted((tmp_path / "gepa").iterdir())
    first = landed_flows(scratch_evals[0] / "flows")
    assert len(first) == len(val) and {f.task_id for f in first} == {t.task_id for t in val}  # the seed on the validation tasks
    assert len(scratch_evals) >= 3  # seed on val, seed on a minibatch, at least one proposal on the same minibatch
    for text in result.instructions[1:]:  # an accepted proposal is what the reflection model wrote, extracted from its reply
        assert any(text.strip() and text.strip() in reply for reply in reflection.replies), text
    assert result.metric_calls <= 30 + 4 and result.usage.prompt_tokens > 0 and result.usage.trajectories >= len(val) + 8
    # the winner keeps the seed's other fields; with no gain on the validation tasks it is the seed
    assert result.policy.tool_descriptions == seed.tool_descriptions
    if not result.improved:
        assert result.policy == seed
    else:
        best = result.val_scores.index(max(result.val_scores))
        assert result.val_scores[best] > result.val_scores[0] and result.policy.instructions == result.instructions[best]
    json.dumps(result.val_scores)  # plain floats, as the asset's metadata needs
