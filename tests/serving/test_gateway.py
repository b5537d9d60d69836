"""The policy gateway over real HTTP on 127.0.0.1, called with the official ``openai`` client, on
the real tiny model: capture, landing, batching, errors in OpenAI's shape."""

import asyncio
import json
import time
from pathlib import Path

import httpx
import openai
import pytest
import torch

from flow_assets.serving.gateway.app import GatewayConfig
from flow_assets.serving.gateway.serve import serve_policy
from flow_assets.logs.schema import Trajectory
from flow_assets.policy.chat import render_prompt
from flow_assets.policy.sampling import completion_logprobs
from flow_assets.policy.store import PolicyStore
from flow_assets.tasks.calculator import CALCULATOR_TOOL, execute_tool_call


def _landed(path: Path) -> list[Trajectory]:
    return [Trajectory.model_validate_json(line) for line in path.read_text().splitlines()]


def test_two_turn_tool_conversation_lands_as_one_trajectory_of_exactly_what_was_sampled(calculator_policy_dir, tmp_path):
    store = PolicyStore(str(calculator_policy_dir))
    messages = [{"role": "user", "content": "874*59"}]
    with serve_policy(store, tmp_path / "landing") as server:

        async def agent():
            client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="x", default_headers={"X-Agent-ID": "conv-1"})
            first = await client.chat.completions.create(
                model="policy", messages=messages, tools=[CALCULATOR_TOOL], max_tokens=32, temperature=0.7, seed=1, logprobs=True
            )
            call = first.choices[0].message.tool_calls[0]
            messages.append(first.choices[0].message.model_dump(exclude_none=True))
            messages.append({"role": "tool", "tool_call_id": call.id, "content": execute_tool_call(call.function.name, call.function.arguments)})
            second = await client.chat.completions.create(
                model="policy", messages=messages, tools=[CALCULATOR_TOOL], max_tokens=32, temperature=0.7, seed=2, logprobs=True
            )
            await client.close()
            return first, second

        first, second = asyncio.run(agent())
        done = httpx.post(f"{server.url}/rollouts/conv-1/finish", json={"task_id": "calculator-874*59", "score": 1.0}).json()
        landed = httpx.post(f"{server.url}/batches/{done['batch']}/close").json()["path"]
    (trajectory,) = _landed(Path(landed))
    assert first.choices[0].finish_reason == "tool_calls"
    assert json.loads(first.choices[0].message.tool_calls[0].function.arguments) == {"expression": "874*59"}
    turn1, observation, turn2 = trajectory.steps
    assert (turn1.kind, observation.kind, turn2.kind) == ("tool", "observation", "answer")
    assert observation.output == "51566" and observation.tool == "calculator" and observation.token_ids is None
    model, tokenizer = store.load(str(calculator_policy_dir / "adapters" / "v0"))
    for step, response, history in ((turn1, first, messages[:1]), (turn2, second, messages)):
        # the prompt ids are the chat template applied to what the agent sent, rendered once
        assert step.prompt_token_ids == render_prompt(tokenizer, history, [CALCULATOR_TOOL])[1]
        # the completion ids are what the client received: its text, token by token, with its log-probs
        content = response.choices[0].logprobs.content
        assert [tokenizer.decode([i]) for i in step.token_ids] == [c.token for c in content]
        assert step.logprobs == [c.logprob for c in content]
        assert (step.temperature, step.top_p) == (0.7, 1.0)
        # and they are the policy's own: teacher forcing at T = 0.7 gives the same log-probs
        logp, _ = completion_logprobs(model, [step.prompt_token_ids], [step.token_ids], tokenizer.pad_token_id, 0.7)
        assert torch.allclose(logp[0], torch.tensor(step.logprobs), atol=1e-4)
    assert turn2.output == second.choices[0].message.content == trajectory.final_answer
    assert trajectory.metadata["llm_calls"] == 2 and trajectory.metadata["tool_calls"] == 1
    assert trajectory.adapter_version == "v0" and trajectory.outcome.score == 1.0


def test_models_are_the_registry_and_unknown_names_get_openai_404(fresh_policy_dir, tmp_path):
    with serve_policy(PolicyStore(str(fresh_policy_dir)), tmp_path) as server:

        async def calls():
            client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="x")
            models = [m.id for m in (await client.models.list()).data]
            with pytest.raises(openai.NotFoundError) as missing:
                await client.chat.completions.create(model="v9", messages=[{"role": "user", "content": "a"}])
            version = await client.chat.completions.create(model="v0", messages=[{"role": "user", "content": "a"}], max_tokens=3)
            await client.close()
            return models, missing.value, version

        models, missing, version = asyncio.run(calls())
    assert models == ["policy", "champion", "v0"]
    assert missing.body["code"] == "model_not_found" and missing.body["param"] == "model" and "v9" in missing.body["message"]
    assert version.system_fingerprint == "v0"


def test_n_choices_stop_strings_and_the_path_prefix_rollout(fresh_policy_dir, tmp_path):
    with serve_policy(PolicyStore(str(fresh_policy_dir)), tmp_path) as server, httpx.Client(base_url=server.url) as client:
        body = {"model": "policy", "messages": [{"role": "user", "content": "ab"}], "max_tokens": 12, "seed": 4}
        many = client.post("/rollouts/by-path/v1/chat/completions", json={**body, "n": 3, "logprobs": True}).json()
        lengths = [len(c["logprobs"]["content"]) for c in many["choices"]]
        assert [c["index"] for c in many["choices"]] == [0, 1, 2] and many["usage"]["completion_tokens"] == sum(lengths)
        one_reply = client.post("/v1/chat/completions", json=body).json()
        one = one_reply["choices"][0]
        text = one["message"]["content"]
        stop = text[2:4]  # the same seeded sample is certain to produce it
        cut_reply = client.post("/v1/chat/completions", json={**body, "stop": [stop]}).json()
        cut = cut_reply["choices"][0]
        assert cut["finish_reason"] == "stop" and cut["message"]["content"] == text[: text.index(stop)]
        assert cut["stop_reason"] == stop and one["stop_reason"] is None  # vLLM's field: which stop string ended it
        done = client.post("/rollouts/by-path/finish", json={"task_id": "t", "success": False}).json()
        assert done["llm_calls"] == 1 and done["completion_tokens"] == lengths[0]  # the first choice is the turn
        # Prometheus: requests and latency per route template, and the tokens served
        metrics = client.get("/metrics").text
        assert 'flowopt_gateway_requests_total{route="/rollouts/{rollout_id}/v1/chat/completions",status="200"} 1.0' in metrics
        assert 'flowopt_gateway_requests_total{route="/v1/chat/completions",status="200"} 2.0' in metrics
        assert 'flowopt_gateway_request_seconds_count{route="/v1/chat/completions"} 2.0' in metrics
        value = {line.split()[0]: float(line.split()[1]) for line in metrics.splitlines() if line.startswith("flowopt_gateway_tokens_total")}
        replies = (many, one_reply, cut_reply)
        assert value['flowopt_gateway_tokens_total{adapter="v0",kind="completion"}'] == sum(r["usage"]["completion_tokens"] for r in replies)
        assert value['flowopt_gateway_tokens_total{adapter="v0",kind="prompt"}'] == sum(r["usage"]["prompt_tokens"] for r in replies)


MALFORMED = [
    (b"{not json", 400, None, "invalid_json"),
    (json.dumps({"model": "policy", "messages": [{"role": "user", "content": "a"}], "temperature": "hot"}), 400, "temperature", None),
    (json.dumps({"model": "policy", "messages": []}), 400, "messages", None),
    (json.dumps({"model": "policy", "messages": [{"role": "wizard", "content": "a"}]}), 400, "messages.0.role", None),
    (json.dumps({"model": "policy", "messages": [{"role": "user", "content": "a"}], "n": 0}), 400, "n", None),
    (json.dumps({"model": "policy", "messages": [{"role": "user", "content": "a"}], "stream": "sometimes"}), 400, "stream", None),
    (json.dumps({"model": "policy", "messages": [{"role": "user", "content": "a" * 200}]}), 400, "messages", "context_length_exceeded"),
    (json.dumps({"model": "policy", "messages": [{"role": "user", "content": "a"}], "max_tokens": 500}), 400, "messages", "context_length_exceeded"),
    (json.dumps({"messages": [{"role": "user", "content": "a"}]}), 400, "model", None),
]


def test_malformed_requests_get_4xx_in_openai_error_shape(fresh_policy_dir, tmp_path):
    with serve_policy(PolicyStore(str(fresh_policy_dir)), tmp_path) as server, httpx.Client(base_url=server.url) as client:
        for content, status, param, code in MALFORMED:
            response = client.post("/v1/chat/completions", content=content, headers={"content-type": "application/json"})
            error = response.json()["error"]
            assert (response.status_code, error["param"], error["code"]) == (status, param, code), content
            assert error["type"] == "invalid_request_error" and error["message"] and "Traceback" not in response.text
        unknown = client.post("/rollouts/nobody/finish", json={"success": True})
        assert unknown.status_code == 404 and unknown.json()["error"]["code"] == "rollout_not_found"
        client.post("/rollouts", json={"rollout_id": "r1", "task_id": "t"})
        assert client.post("/rollouts/r1/finish", json={}).status_code == 400  # no outcome
        assert client.post("/rollouts", json={"rollout_id": "r1"}).status_code == 400  # taken
        assert client.post("/rollouts", json={"batch": "../escape"}).status_code == 400
        assert client.get("/no/such/route").json()["error"]["type"] == "invalid_request_error"


def test_a_rollout_never_finished_lands_unlabelled_after_its_timeout(fresh_policy_dir, tmp_path):
    config = GatewayConfig(rollout_timeout_s=0.3, reap_every_s=0.1, batch_flush_seconds=0.2, default_max_tokens=4)
    with serve_policy(PolicyStore(str(fresh_policy_dir)), tmp_path / "landing", config=config) as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", default_headers={"X-Agent-ID": "orphan"})
        client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "hi"}])
        deadline = time.monotonic() + 20
        while not list((tmp_path / "landing" / "gateway").glob("*.jsonl")) and time.monotonic() < deadline:
            time.sleep(0.1)
        # a call for the landed rollout is refused, not silently recorded nowhere
        with pytest.raises(openai.ConflictError):
            client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "hi"}])
    (path,) = (tmp_path / "landing" / "gateway").glob("*.jsonl")
    (trajectory,) = _landed(path)
    # no reward came: stored for a judge to score, not a failure
    assert trajectory.trajectory_id == "orphan" and trajectory.outcome is None and "error" not in trajectory.metadata
    assert trajectory.metadata["unfinished"]["reason"] == "not_finished"
    assert len(trajectory.steps) == 1 and len(trajectory.steps[0].token_ids) == 4  # the turn it made is kept


def test_stopping_the_gateway_lands_open_rollouts_and_batches(fresh_policy_dir, tmp_path):
    with serve_policy(PolicyStore(str(fresh_policy_dir)), tmp_path, config=GatewayConfig(default_max_tokens=3)) as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", default_headers={"X-Agent-ID": "open"})
        client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "hi"}])
        httpx.post(f"{server.url}/rollouts", json={"rollout_id": "done", "task_id": "t", "batch": "b1"})
        httpx.post(f"{server.url}/rollouts/done/v1/chat/completions", json={"model": "policy", "messages": [{"role": "user", "content": "x"}]})
        httpx.post(f"{server.url}/rollouts/done/finish", json={"success": True})
        assert not list(tmp_path.rglob("*.jsonl"))  # still open: only .tmp files so far
    landed = {p.name: _landed(p) for p in tmp_path.rglob("*.jsonl")}
    assert [t.trajectory_id for t in landed["b1.jsonl"]] == ["done"]
    (rolling,) = [v for k, v in landed.items() if k.startswith("gateway-")]
    assert rolling[0].metadata["error"]["kind"] == "not_finished"


def test_a_champion_promoted_mid_call_serves_the_next_calls_while_the_call_in_flight_ends_on_the_old_weights(tmp_path):
    from concurrent.futures import ThreadPoolExecutor
    import shutil

    from safetensors.torch import load_file, save_file

    from resources.registry import AdapterRegistry
    from tests.conftest import make_policy_dir

    root = make_policy_dir(tmp_path / "policy")
    v0, v1 = root / "adapters" / "v0", root / "adapters" / "v1"
    shutil.copytree(v0, v1)
    weights = load_file(str(v1 / "adapter_model.safetensors"))
    generator = torch.Generator().manual_seed(3)
    save_file({k: torch.randn(w.shape, generator=generator) * 0.3 if "lora_B" in k else w for k, w in weights.items()},
              str(v1 / "adapter_model.safetensors"))  # fmt: skip
    store = PolicyStore(str(root))
    # 64 greedy rows of 110 tokens: seconds of decoding, long enough to promote during it
    body = {"model": "policy", "messages": [{"role": "user", "content": "ab"}], "temperature": 0.0}
    with serve_policy(store, tmp_path / "landing") as server, ThreadPoolExecutor(1) as pool:
        url = server.url
        httpx.post(f"{url}/rollouts", json=[{"rollout_id": r, "task_id": "t", "batch": "b"} for r in ("old", "new")])
        old = pool.submit(httpx.post, f"{url}/rollouts/old/v1/chat/completions", json={**body, "n": 64, "max_tokens": 110}, timeout=120)
        deadline = time.monotonic() + 60
        while httpx.get(f"{url}/health").json()["generated_sequences"] < 64 and time.monotonic() < deadline:
            time.sleep(0.01)
        AdapterRegistry(root=str(root)).promote("v1", str(v1), {}, by="test", reason="promoted mid-call")
        new = httpx.post(f"{url}/rollouts/new/v1/chat/completions", json={**body, "max_tokens": 8}, timeout=120)
        old = old.result()
        assert old.status_code == new.status_code == 200  # nothing dropped: the new call waited for the old batch
        for r in ("old", "new"):
            httpx.post(f"{url}/rollouts/{r}/finish", json={"score": 1.0})
        landed = {t.trajectory_id: t for t in _landed(Path(httpx.post(f"{url}/batches/b/close").json()["path"]))}
    assert (old.headers["X-Flowopt-Adapter-Version"], new.headers["X-Flowopt-Adapter-Version"]) == ("v0", "v1")
    assert (landed["old"].adapter_version, landed["new"].adapter_version) == ("v0", "v1")
    # each turn's log-probs are its own version's (teacher forcing), so the ratio a round computes is honest
    for name, version in (("old", v0), ("new", v1)):
        model, tokenizer = store.load(str(version))
        (step,) = landed[name].steps
        logp, _ = completion_logprobs(model, [step.prompt_token_ids], [step.token_ids], tokenizer.pad_token_id, 1.0)
        assert torch.allclose(logp[0], torch.tensor(step.logprobs), atol=1e-4)
    other, _ = store.load(str(v0))
    step = landed["new"].steps[0]
    logp, _ = completion_logprobs(other, [step.prompt_token_ids], [step.token_ids], tokenizer.pad_token_id, 1.0)
    assert not torch.allclose(logp[0], torch.tensor(step.logprobs), atol=1e-2)  # the versions differ
