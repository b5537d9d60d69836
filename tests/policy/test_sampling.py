"""Batched sampling as the gateway uses it: a shared prefix computed once, rows at their own
temperatures in one call, decoding in chunks that drop finished rows, the nucleus sampler."""

import math

import pytest
import torch
import torch.nn.functional as F

import flow_assets.policy.sampling as sampling
from flow_assets.policy.lora import LoraAdapterConfig, add_lora_adapter
from flow_assets.policy.sampling import RowSampler, SamplingConfig, completion_logprobs, sample_token_ids, shared_prefix_length
from flow_assets.policy.tiny_model import TinyModelConfig, load_policy, save_tiny_policy

PREFIX = "S:You are a careful agent. Answer briefly.\nU:"  # 47 characters: well above MIN_SHARED_PREFIX
QUESTIONS = ["abc=", "hello there=", "x=", "level=", "a much longer question than the rest="]


@pytest.fixture(scope="module")
def policy(tmp_path_factory):
    model, tok = load_policy(save_tiny_policy(tmp_path_factory.mktemp("policy"), TinyModelConfig(seed=3)))
    model = add_lora_adapter(model, LoraAdapterConfig(rank=4, seed=1))
    with torch.no_grad():  # a LoRA adapter that changes the outputs, as a trained one does
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.3, generator=torch.Generator().manual_seed(7))
    return model, tok


def _rows(tok):
    return [tok(PREFIX + q)["input_ids"] for q in QUESTIONS]


def test_shared_prefix_length_leaves_every_row_a_token_of_its_own():
    assert shared_prefix_length([[1, 2, 3], [1, 2, 3, 4], [1, 2, 5]]) == 2
    assert shared_prefix_length([[1, 2, 3], [1, 2, 3]]) == 2  # identical rows: the last token is fed
    assert shared_prefix_length([[7], [8, 9]]) == 0 and shared_prefix_length([]) == 0


def test_a_shared_prefix_computed_once_samples_and_scores_exactly_as_without_it(policy, monkeypatch):
    model, tok = policy
    rows = _rows(tok)
    assert shared_prefix_length(rows) >= sampling.MIN_SHARED_PREFIX
    config = SamplingConfig(num_samples=2, temperature=0.8, max_new_tokens=12, seed=4)
    shared = sample_token_ids(model, tok, rows, config)
    prompts, completions = [r.prompt_ids for r in shared], [r.completion_ids for r in shared]

    def scored():
        model.zero_grad()
        logp, mask = completion_logprobs(model, prompts, completions, tok.pad_token_id, 0.8)
        (logp * mask).sum().backward()
        return logp.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}

    logp_shared, grads_shared = scored()
    monkeypatch.setattr(sampling, "MIN_SHARED_PREFIX", 10**9)
    alone = sample_token_ids(model, tok, rows, config)
    logp_alone, grads_alone = scored()
    assert [r.completion_ids for r in shared] == [r.completion_ids for r in alone]
    for a, b in zip(shared, alone):
        assert max((abs(x - y) for x, y in zip(a.logprobs, b.logprobs)), default=0.0) < 1e-4
    assert torch.allclose(logp_shared, logp_alone, atol=1e-4)
    for name, grad in grads_alone.items():  # the prefix's gradient is the sum over rows, as without sharing
        assert float((grads_shared[name] - grad).norm() / grad.norm()) < 1e-4, name


def test_rows_at_different_temperatures_share_a_call_and_keep_their_own_log_probs(policy):
    model, tok = policy
    rows = _rows(tok)
    temperatures = [0.0, 0.7, 0.0, 1.3, 0.7]
    config = SamplingConfig(num_samples=1, max_new_tokens=10, seed=2)
    mixed = sample_token_ids(model, tok, rows, config, temperatures=temperatures)
    greedy = sample_token_ids(model, tok, rows, SamplingConfig(num_samples=1, temperature=0.0, max_new_tokens=10))
    for i, t in enumerate(temperatures):
        r = mixed[i]
        if t == 0:  # greedy rows are what a greedy-only call gives
            assert r.completion_ids == greedy[i].completion_ids and r.logprobs == pytest.approx(greedy[i].logprobs, abs=1e-5)
        with torch.no_grad():  # each row's log-probs: one forward pass at its own temperature (greedy: T = 1)
            logits = model(torch.tensor([r.prompt_ids + r.completion_ids])).logits[0, len(r.prompt_ids) - 1 : -1]
        expected = F.log_softmax(logits / (t or 1.0), dim=-1).gather(-1, torch.tensor(r.completion_ids)[:, None])[:, 0]
        assert torch.allclose(torch.tensor(r.logprobs), expected, atol=1e-4)


def test_decoding_in_chunks_gives_what_one_pass_gives(policy, monkeypatch):
    model, tok = policy
    rows = _rows(tok)
    config = SamplingConfig(num_samples=3, temperature=0.0, max_new_tokens=20)
    monkeypatch.setattr(sampling, "DECODE_CHUNK", 3)
    chunked = sample_token_ids(model, tok, rows, config)
    monkeypatch.setattr(sampling, "DECODE_CHUNK", 1000)
    whole = sample_token_ids(model, tok, rows, config)
    assert [r.completion_ids for r in chunked] == [r.completion_ids for r in whole]
    for a, b in zip(chunked, whole):
        assert a.finished == b.finished and a.logprobs == pytest.approx(b.logprobs, abs=1e-4)
        if a.finished:
            assert a.completion_ids.count(tok.eos_token_id) == 1 and a.completion_ids[-1] == tok.eos_token_id


def test_row_sampler_draws_from_each_rows_tempered_nucleus():
    scores = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]] * 3))  # [rows, vocab]
    generator = torch.Generator().manual_seed(0)
    sampler = RowSampler(torch.tensor([1.0, 0.0, 1.0]), torch.tensor([0.7, 1.0, 1.0]), generator)
    counts = torch.zeros(3, 4)
    for _ in range(4000):
        out = sampler(None, scores.clone())
        assert torch.isfinite(out).sum() == 3  # exactly one finite score per row: the drawn token
        counts[torch.arange(3), out.argmax(dim=-1)] += 1
    assert counts[0, 2:].sum() == 0  # top_p 0.7 keeps the two tokens that reach it
    assert abs(counts[0, 0] / 4000 - 0.5 / 0.8) < 0.03
    assert counts[1, 0] == 4000  # T = 0: argmax
    assert torch.allclose(counts[2] / 4000, torch.tensor([0.5, 0.3, 0.15, 0.05]), atol=0.03)
    assert math.isclose(float(counts.sum()), 12000)


def _gqa_policy(root):
    """The tiny model with grouped-query attention (8 query heads sharing 2 key/value heads), as SmolLM2 has."""
    from flow_assets.policy.tiny_model import build_tiny_model
    from flow_assets.policy.tokenizer import CharTokenizerConfig, build_char_tokenizer

    tok = build_char_tokenizer(CharTokenizerConfig(model_max_length=256))
    model = build_tiny_model(TinyModelConfig(seed=5), tok)
    model.config.num_key_value_heads = 2
    model = type(model)(model.config)  # rebuilt: k/v projections now have 2 heads
    model.save_pretrained(str(root))
    tok.save_pretrained(str(root))
    return root


def test_a_grouped_query_model_gets_copy_free_attention_with_the_same_log_probs(tmp_path):
    from transformers import AutoModelForCausalLM

    from flow_assets.policy.attention import SDPA_GQA

    directory = _gqa_policy(tmp_path / "gqa")
    model, tok = load_policy(directory)
    assert model.config._attn_implementation == SDPA_GQA
    reference = AutoModelForCausalLM.from_pretrained(str(directory), attn_implementation="eager").eval()
    rows = _rows(tok)
    rollouts = sample_token_ids(model, tok, rows, SamplingConfig(num_samples=2, temperature=1.0, max_new_tokens=8, seed=1))
    prompts, completions = [r.prompt_ids for r in rollouts], [r.completion_ids for r in rollouts]
    with torch.no_grad():
        ours, mask = completion_logprobs(model, prompts, completions, tok.pad_token_id, 1.0)
        eager, _ = completion_logprobs(reference, prompts, completions, tok.pad_token_id, 1.0)
    assert mask.sum() > 0 and torch.allclose(ours, eager, atol=1e-5)
    sampled = torch.tensor([lp for r in rollouts for lp in r.logprobs])
    assert torch.allclose(sampled, ours[mask.bool()], atol=1e-4)  # behaviour log-probs agree with scoring
    plain, _ = load_policy(save_tiny_policy(tmp_path / "mha", TinyModelConfig(seed=3)))
    assert plain.config._attn_implementation != SDPA_GQA  # without grouped heads: transformers' default


def test_sampling_in_threads_leaves_the_process_environment_alone(tmp_path):
    """A demo crashed when httpx iterated ``os.environ`` while sampling set and deleted an
    attention variable in another thread. Sampling now changes no process-wide state at all:
    a reader walking the environment throughout sees it unchanged."""
    import os
    import threading

    model, tok = load_policy(_gqa_policy(tmp_path / "gqa"))
    before, errors = dict(os.environ), []

    def sampler(seed):
        try:
            for _ in range(3):
                sample_token_ids(model, tok, _rows(tok), SamplingConfig(num_samples=2, max_new_tokens=6, seed=seed))
        except Exception as exc:
            errors.append(exc)

    threads = [threading.Thread(target=sampler, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    walks = 0
    while any(t.is_alive() for t in threads) or walks == 0:
        try:
            assert {k: os.environ[k] for k in os.environ} == before  # httpx's proxy lookup does this walk
        except (KeyError, AssertionError) as exc:
            errors.append(exc)
            break
        walks += 1
    for t in threads:
        t.join()
    assert errors == [] and walks > 0
