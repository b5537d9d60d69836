"""The tiny policy: tokenizer and model through from_pretrained, sampler log-probs, LoRA round trip."""

import string

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM, AutoTokenizer

from flow_assets.policy.lora import LoraAdapterConfig, add_lora_adapter, load_lora_adapter, save_lora_adapter
from flow_assets.policy.sampling import SamplingConfig, completion_logprobs, sample_rollouts
from flow_assets.policy.sft import SFTConfig, sft_train
from flow_assets.policy.tiny_model import TinyModelConfig, build_tiny_model, load_policy, save_tiny_policy
from flow_assets.policy.tokenizer import build_char_tokenizer, save_char_tokenizer

SMALL = TinyModelConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, max_position_embeddings=32)
PROMPTS = ["abc=", "hello=", "x=", "level="]  # different lengths: exercises left padding


@pytest.fixture(scope="module")
def policy_dir(tmp_path_factory):
    return save_tiny_policy(tmp_path_factory.mktemp("policy"), SMALL)


@pytest.fixture(scope="module")
def policy(policy_dir):
    return load_policy(policy_dir)


def test_tokenizer_round_trips_text_through_auto_tokenizer(tmp_path):
    save_char_tokenizer(tmp_path)
    tok = AutoTokenizer.from_pretrained(tmp_path)
    text = string.printable.replace("\x0b", "").replace("\x0c", "").replace("\r", "") + " a  . ,b\n"
    ids = tok(text)["input_ids"]
    assert ids[0] == tok.bos_token_id and len(ids) == len(text) + 1  # one token per character
    assert tok.decode(ids, skip_special_tokens=True) == text
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id, tok.unk_token_id) == (0, 1, 2, 3)
    assert tok("é", add_special_tokens=False)["input_ids"] == [tok.unk_token_id]


def test_tiny_model_loads_through_auto_model_and_is_deterministic(policy_dir):
    loaded = AutoModelForCausalLM.from_pretrained(policy_dir).eval()
    rebuilt = build_tiny_model(SMALL, build_char_tokenizer())
    ids = torch.tensor([[1, 40, 41, 42, 33]])
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, rebuilt(ids).logits)
    assert loaded.config.num_hidden_layers == 1 and loaded.config.vocab_size == 101


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_sampler_logprobs_equal_fresh_forward_pass(policy, temperature):
    model, tok = policy
    rollouts = sample_rollouts(model, tok, PROMPTS, SamplingConfig(num_samples=3, temperature=temperature, max_new_tokens=6, seed=3))
    assert len(rollouts) == 12 and all(r.error is None for r in rollouts)
    for r in rollouts:
        # one unpadded forward pass over prompt + completion, log-softmax of logits / T
        ids = torch.tensor([r.prompt_ids + r.completion_ids])
        with torch.no_grad():
            logits = model(ids).logits[0, len(r.prompt_ids) - 1 : -1]  # [completion, vocab]
        expected = F.log_softmax(logits / temperature, dim=-1).gather(-1, torch.tensor(r.completion_ids)[:, None])[:, 0]
        assert torch.allclose(torch.tensor(r.logprobs), expected, atol=1e-4)
    # the trainer's batched teacher-forced pass agrees too
    with torch.no_grad():
        logp, mask = completion_logprobs(model, [r.prompt_ids for r in rollouts], [r.completion_ids for r in rollouts], tok.pad_token_id, temperature)
    for i, r in enumerate(rollouts):
        n = len(r.completion_ids)
        assert torch.allclose(logp[i, :n], torch.tensor(r.logprobs), atol=1e-4)
        assert mask[i].sum() == n


def test_sampling_is_seeded_and_leaves_global_rng_alone(policy):
    model, tok = policy
    torch.manual_seed(123)
    before = torch.get_rng_state()
    a = sample_rollouts(model, tok, PROMPTS, SamplingConfig(num_samples=4, seed=5))
    assert torch.equal(torch.get_rng_state(), before)
    assert a == sample_rollouts(model, tok, PROMPTS, SamplingConfig(num_samples=4, seed=5))
    assert a != sample_rollouts(model, tok, PROMPTS, SamplingConfig(num_samples=4, seed=6))


def test_greedy_is_deterministic_and_takes_the_argmax(policy):
    model, tok = policy
    cfg = SamplingConfig(num_samples=1, temperature=0.0, max_new_tokens=5)
    a = sample_rollouts(model, tok, PROMPTS, cfg)
    assert a == sample_rollouts(model, tok, PROMPTS, cfg)
    for r in a:
        with torch.no_grad():
            logits = model(torch.tensor([r.prompt_ids])).logits[0, -1]
        assert r.completion_ids[0] == int(logits.argmax())
        assert r.logprobs[0] == pytest.approx(float(F.log_softmax(logits, -1).max()), abs=1e-4)


def test_completions_stop_at_eos_after_sft_and_bad_prompt_fails_alone(tmp_path):
    model, tok = load_policy(save_tiny_policy(tmp_path, SMALL))
    demos = [("ab=", "ba"), ("abc=", "cba"), ("xy=", "yx"), ("pqr=", "rqp")]
    result = sft_train(model, tok, demos, SFTConfig(steps=60, learning_rate=1e-2, batch_size=4))
    assert result.losses[-1] < result.losses[0] / 3
    too_long = "z" * 40  # 41 tokens + 8 new > 32 positions
    rollouts = sample_rollouts(model, tok, ["ab=", too_long, "abc="], SamplingConfig(num_samples=2, temperature=0.0))
    assert [r.prompt_index for r in rollouts] == [0, 0, 1, 1, 2, 2]
    bad = [r for r in rollouts if r.prompt_index == 1]
    assert all(r.error and not r.completion_ids for r in bad)
    good = [r for r in rollouts if r.prompt_index != 1]
    assert all(r.error is None for r in good)
    assert [r.completion_text for r in good] == ["ba", "ba", "cba", "cba"]
    assert all(r.finished and r.completion_ids[-1] == tok.eos_token_id for r in good)
    assert all(len(r.logprobs) == len(r.completion_ids) for r in good)


def test_sft_micro_batches_take_the_same_step_as_one_pass(policy_dir):
    """Accumulated micro-batches (answers of different lengths) normalised by the step's answer
    tokens give the same parameters after two steps as one pass per step."""
    demos = [("ab=", "ba"), ("abcde=", "edcba"), ("xy=", "yx"), ("pqr=", "rqp"), ("k=", "k"), ("level=", "level")]
    params = []
    for micro in (0, 2, 4):
        model, tok = load_policy(policy_dir)
        sft_train(model, tok, demos, SFTConfig(steps=2, learning_rate=1e-2, batch_size=6, micro_batch_size=micro))
        params.append(torch.cat([p.detach().flatten() for p in model.parameters()]))
    assert not torch.equal(params[0], torch.cat([p.detach().flatten() for p in load_policy(policy_dir)[0].parameters()]))
    for other in params[1:]:
        torch.testing.assert_close(other, params[0], rtol=1e-4, atol=1e-5)
    # bfloat16 mixed precision: a different rounding of the same step, weights still float32
    model, tok = load_policy(policy_dir)
    sft_train(model, tok, demos, SFTConfig(steps=2, learning_rate=1e-2, batch_size=6, micro_batch_size=2, bf16=True))
    mixed = torch.cat([p.detach().flatten() for p in model.parameters()])
    assert mixed.dtype == torch.float32 and not torch.equal(mixed, params[0])
    torch.testing.assert_close(mixed, params[0], rtol=0.0, atol=3e-2)
    with pytest.raises(ValueError, match="micro_batch_size"):
        model, tok = load_policy(policy_dir)
        sft_train(model, tok, demos, SFTConfig(steps=1, micro_batch_size=-1))


def test_lora_adapter_save_load_round_trip(policy_dir, tmp_path):
    base, _ = load_policy(policy_dir)
    peft_model = add_lora_adapter(base, LoraAdapterConfig(rank=4, alpha=8))
    trainable = [n for n, p in peft_model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)
    with torch.no_grad():  # B starts at 0; make the adapter actually change the outputs
        for n, p in peft_model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.5)
    ids = torch.tensor([[1, 40, 41, 42, 33]])
    with torch.no_grad():
        adapted = peft_model(ids).logits
        with peft_model.disable_adapter():
            plain = peft_model(ids).logits
    assert not torch.allclose(adapted, plain)

    adapter_dir = save_lora_adapter(peft_model, tmp_path / "adapter")
    assert (adapter_dir / "adapter_model.safetensors").is_file()
    fresh_base, _ = load_policy(policy_dir)
    reloaded = load_lora_adapter(fresh_base, adapter_dir, trainable=True)
    with torch.no_grad():
        assert torch.allclose(reloaded(ids).logits, adapted, atol=1e-6)
    assert any(p.requires_grad for p in reloaded.parameters())
    frozen = load_lora_adapter(load_policy(policy_dir)[0], adapter_dir, trainable=False)
    assert not any(p.requires_grad for p in frozen.parameters())


def test_completion_logprobs_scores_each_row_at_its_own_temperature(policy):
    model, tok = policy
    prompts, completions = [[1, 40, 41], [1, 50], [1, 60, 61, 62]], [[42, 43], [51, 52, 53], [63]]
    mixed, mask = completion_logprobs(model, prompts, completions, tok.pad_token_id, [0.7, 1.0, 0.0])
    for i, t in enumerate((0.7, 1.0, 1.0)):  # 0 (greedy) is scored at 1
        alone, _ = completion_logprobs(model, [prompts[i]], [completions[i]], tok.pad_token_id, t)
        n = len(completions[i])
        assert torch.allclose(mixed[i, :n], alone[0, :n], atol=1e-6) and mask[i].sum() == n
    with pytest.raises(ValueError, match="temperature"):
        completion_logprobs(model, prompts, completions, tok.pad_token_id, [1.0, 1.0])
