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
