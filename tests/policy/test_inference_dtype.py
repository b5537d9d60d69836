"""Serving a policy in bfloat16 for evaluation (``EvaluationConfig.dtype``), on the real tiny
model: the weights load in that precision, the log-probs the gateway records stay those of the
tokens it drew (close to a float32 teacher-forced pass, not equal to it), a greedy evaluation
through the gateway agrees with float32 on the trained calculator policy, and bad settings are
refused with a clear error."""

import shutil

import polars as pl
import pytest
import torch

from flow_assets.policy.lora import LoraAdapterConfig, add_lora_adapter
from flow_assets.policy.sampling import SamplingConfig, completion_logprobs
from flow_assets.policy.store import PolicyStore
from flow_assets.policy.tiny_model import TinyModelConfig, load_policy, save_tiny_policy
from flow_assets.rl.gate import GateConfig
from flow_assets.serving.gateway.engine import AdapterRef, PolicyEngine
from flow_assets.training.rounds import EvaluationConfig, evaluate_agents
from resources.registry import AdapterRegistry
from resources.tasks import TaskSourceResource


@pytest.fixture(scope="module")
def policy_dirs(tmp_path_factory):
    """A tiny base model and a LoRA adapter on it that changes its outputs."""
    root = tmp_path_factory.mktemp("dtype")
    base = save_tiny_policy(root / "base", TinyModelConfig(seed=5))
    model, _ = load_policy(base)
    model = add_lora_adapter(model, LoraAdapterConfig(rank=4, seed=2))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.3, generator=torch.Generator().manual_seed(11))
    model.save_pretrained(str(root / "adapter"))
    return base, root / "adapter"


def test_load_policy_takes_a_precision_and_refuses_one_that_is_not_floating_point(policy_dirs):
    base, _ = policy_dirs
    model, _ = load_policy(base, dtype="bfloat16")
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    model, _ = load_policy(base)
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    for bad in ("int8", "float33", "bool"):
        with pytest.raises(ValueError, match="floating-point torch dtype"):
            load_policy(base, dtype=bad)
    with pytest.raises(ValueError, match="transformers backend only"):
        PolicyEngine(base, backend="vllm", dtype="bfloat16")


def test_a_bfloat16_engine_records_the_logprobs_of_the_tokens_it_drew(policy_dirs):
    base, adapter = policy_dirs
    engine = PolicyEngine(base, dtype="bfloat16")
    prompts = [engine.tokenizer(text)["input_ids"] for text in ("abc=", "hello there=", "level=")]
    rollouts = engine.generate(str(adapter), prompts, SamplingConfig(num_samples=2, temperature=0.8, max_new_tokens=24, seed=3))
    # PEFT keeps the adapter's own weights in float32 (``autocast_adapter_dtype``); the base is bfloat16
    assert {p.dtype for n, p in engine.base.named_parameters() if "lora_" not in n} == {torch.bfloat16}
    assert all(r.error is None and len(r.completion_ids) == len(r.logprobs) > 0 for r in rollouts)

    # the same tokens teacher-forced by the float32 model: bfloat16 rounds the weights (8 mantissa
    # bits), so the recorded log-probs are close to these, and not equal to them
    reference, _ = load_policy(base)
    from flow_assets.policy.lora import load_lora_adapter

    reference = load_lora_adapter(reference, str(adapter))
    with torch.no_grad():
        want, mask = completion_logprobs(reference, [r.prompt_ids for r in rollouts], [r.completion_ids for r in rollouts],
                                         engine.tokenizer.pad_token_id, temperature=0.8)  # fmt: skip
    got = torch.zeros_like(want)
    for i, r in enumerate(rollouts):
        got[i, : len(r.logprobs)] = torch.tensor(r.logprobs)
    diff = ((got - want) * mask).abs()
    assert diff.max() < 0.25, f"bfloat16 log-probs differ from float32 teacher forcing by up to {diff.max():.3f}"
    assert diff.max() > 0, "the engine did not serve in bfloat16"


@pytest.mark.slow
def test_a_greedy_evaluation_in_bfloat16_agrees_with_float32_on_the_trained_calculator_policy(calculator_policy_dir, tmp_path):
    tasks = TaskSourceResource(kind="calculator")
    source, agent = tasks.source(), tasks.agent_fn()
    held_out = source.tasks("held_out")[:24]
    champion = AdapterRegistry(root=str(calculator_policy_dir)).champion()
    policies = {"champion": AdapterRef(champion["version"], champion["adapter_path"])}
    store = PolicyStore(str(calculator_policy_dir))
    rows = {}
    for dtype in ("float32", "bfloat16"):
        config = EvaluationConfig(max_tasks=24, modes=("greedy",), concurrency=8, gate=GateConfig(metric="greedy"), dtype=dtype)
        rows[dtype], _ = evaluate_agents(store, source, agent, tasks.agent_id, held_out, policies, config, tmp_path / dtype)
    joined = rows["float32"].join(rows["bfloat16"], on="task_id", suffix="_bf16")
    assert joined.height == 24
    assert 0 < rows["float32"]["success"].sum() < 24  # a policy that solves some, so agreement means something
    # greedy argmax can flip where two tokens' logits are within bfloat16's rounding; the outcome
    # of a tool-calling calculator answer seldom does
    agree = joined.filter(pl.col("success") == pl.col("success_bf16")).height
    assert agree >= 20, f"bfloat16 and float32 greedy outcomes agree on only {agree} of 24 tasks"
    with pytest.raises(ValueError):
        EvaluationConfig(dtype="float16", gate=GateConfig(metric="greedy"))  # not one of the offered precisions


@pytest.mark.parametrize("mask_kind", ["bool", "additive", "none"])
def test_a_bfloat16_decode_step_attends_as_float32_sdpa_does(mask_kind):
    """The bfloat16 one-token path of ``sdpa_attention_with_gqa`` (two matmuls, float32 softmax)
    against PyTorch's SDPA in float32 on the same (bfloat16-rounded) inputs, grouped heads
    included: 9 query heads over 3 key/value heads, left padding masked in some rows."""
    import torch.nn.functional as F

    from flow_assets.policy.attention import sdpa_attention_with_gqa

    g = torch.Generator().manual_seed(0)
    batch, heads, kv_heads, kv_len, dim = 5, 9, 3, 40, 16
    q = torch.randn(batch, heads, 1, dim, generator=g).bfloat16()
    k, v = (torch.randn(batch, kv_heads, kv_len, dim, generator=g).bfloat16() for _ in range(2))
    attends = torch.ones(batch, 1, 1, kv_len + 3, dtype=torch.bool)  # a mask wider than the keys is cut
    attends[1, ..., :7] = False
    attends[3, ..., :20] = False
    mask = {"bool": attends, "additive": torch.zeros(attends.shape).masked_fill(~attends, torch.finfo(torch.float32).min).bfloat16(),
            "none": None}[mask_kind]  # fmt: skip

    class Layer(torch.nn.Module):
        num_key_value_groups, is_causal = heads // kv_heads, True

    out, _ = sdpa_attention_with_gqa(Layer().eval(), q, k, v, mask, scaling=0.3)
    assert out.shape == (batch, 1, heads, dim) and out.dtype == torch.bfloat16
    want = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), scale=0.3, enable_gqa=True,
                                          attn_mask=None if mask is None else attends[..., :kv_len])  # fmt: skip
    assert torch.allclose(out.float(), want.transpose(1, 2), atol=2e-2), (out.float() - want.transpose(1, 2)).abs().max()


@pytest.mark.slow
def test_an_evaluation_of_two_adapters_runs_them_one_after_the_other_on_one_gateway(calculator_policy_dir, tmp_path):
    """agents_rows with two served names activates each adapter once (continuous batching within
    each), where serving both at once switched adapters, draining the running batch, again and again,
    and each name's rows are those it gets when evaluated alone."""
    from flow_assets.serving.agents.evaluation import agents_rows
    from flow_assets.serving.gateway.serve import serve_policy

    tasks = TaskSourceResource(kind="calculator")
    source, agent = tasks.source(), tasks.agent_fn()
    held_out = source.tasks("held_out")[:24]
    champion = AdapterRegistry(root=str(calculator_policy_dir)).champion()
    # a second adapter the batcher must switch to: the champion's, from another directory
    other = shutil.copytree(champion["adapter_path"], tmp_path / "other")
    store = PolicyStore(str(calculator_policy_dir))
    policies = {"champion": AdapterRef(champion["version"], champion["adapter_path"]), "other": AdapterRef("other", str(other))}
    with serve_policy(store, tmp_path / "both", extra=policies) as server:
        rows = agents_rows(server.url, source.score, agent, tasks.agent_id, held_out, list(policies), {"greedy": 0.0}, 8, 600.0)
        activations = server.gateway.batcher.activations
    assert [r["policy"] for r in rows] == ["champion"] * 24 + ["other"] * 24
    assert [r["success"] for r in rows[:24]] == [r["success"] for r in rows[24:]]  # the same weights
    assert activations == 2
    assert sum(r["llm_calls"] for r in rows) > 48  # the agents called more than once each: batches had to be refilled
