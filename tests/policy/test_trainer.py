"""A GRPO training round on the tiny model: direction, zero advantages, resume after SIGKILL, retention."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from flow_assets.policy.lora import LoraAdapterConfig, add_lora_adapter
from flow_assets.policy.sampling import SamplingConfig, completion_logprobs, sample_rollouts
from flow_assets.policy.tiny_model import TinyModelConfig, build_tiny_model
from flow_assets.policy.tokenizer import build_char_tokenizer
from flow_assets.policy.trainer import GRPORoundTrainer, GRPOTrainerConfig, TrainingSample, train_grpo_round
from flow_assets.rl.grpo_loss import grpo_loss

ROOT = Path(__file__).resolve().parents[2]
SMALL = TinyModelConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, max_position_embeddings=32)


def _policy():
    tok = build_char_tokenizer()
    return add_lora_adapter(build_tiny_model(SMALL, tok), LoraAdapterConfig(rank=4, alpha=8)), tok


def _mean_logprob(model, samples):
    with torch.no_grad():
        logp, mask = completion_logprobs(model, [s.prompt_ids for s in samples], [s.completion_ids for s in samples], 0)
    return float((logp * mask).sum() / mask.sum())


def _synthetic_samples() -> list[TrainingSample]:
    """Fixed samples (no sampling, so every process builds exactly the same ones)."""
    rng = np.random.default_rng(0)
    samples = []
    for i in range(24):
        prompt = [1] + rng.integers(4, 100, size=3).tolist()
        completion = rng.integers(4, 100, size=int(rng.integers(2, 6))).tolist() + [2]
        behaviour = None if i % 2 else [-4.6] * len(completion)
        samples.append(TrainingSample(prompt, completion, float(rng.choice([-1.0, 1.0])), behaviour, f"t{i // 4}"))
    return samples


def _resume_round(out_dir: str, max_steps: int = 12):
    """The round the SIGKILL test runs: same model, samples and config in every process."""
    model, _ = _policy()
    config = GRPOTrainerConfig(
        output_dir=out_dir, learning_rate=1e-2, num_iterations=100, minibatch_size=8, max_steps=max_steps, save_steps=2, seed=3
    )
    return model, _synthetic_samples(), config


def _run_killable_round(out_dir: str) -> None:  # executed in the child process
    torch.set_num_threads(1)
    model, samples, config = _resume_round(out_dir)
    train_grpo_round(model, samples, config, on_step=lambda m: time.sleep(0.25))


def test_round_moves_policy_in_the_direction_of_the_advantages(tmp_path):
    model, tok = _policy()
    rollouts = sample_rollouts(model, tok, ["abc=", "hello=", "xyz="], SamplingConfig(num_samples=8, max_new_tokens=5, seed=0))
    samples = [
        TrainingSample(r.prompt_ids, r.completion_ids, 1.0 if r.sample_index % 2 == 0 else -1.0, r.logprobs)
        for r in rollouts
    ]
    positive = [s for s in samples if s.advantage > 0]
    negative = [s for s in samples if s.advantage < 0]
    before = _mean_logprob(model, positive), _mean_logprob(model, negative)
    result = train_grpo_round(
        model, samples, GRPOTrainerConfig(output_dir=str(tmp_path), learning_rate=1e-2, num_iterations=4, minibatch_size=8, save_steps=100)
    )
    after = _mean_logprob(model, positive), _mean_logprob(model, negative)
    assert result.final_step == 12 and len(result.steps) == 12
    assert after[0] > before[0] + 0.05
    assert after[1] < before[1] - 0.05
    assert all(np.isfinite(s.loss) and s.grad_norm > 0 for s in result.steps)
    assert result.steps[0].mean_ratio == pytest.approx(1.0, abs=1e-4)  # behaviour log-probs = current policy
    assert result.latest_checkpoint == str(tmp_path / "checkpoint-12")


def test_zero_variance_group_gets_no_gradient(tmp_path):
    model, _ = _policy()
    samples = [TrainingSample(s.prompt_ids, s.completion_ids, 0.0, s.behaviour_logprobs) for s in _synthetic_samples()]
    # the loss itself: zero advantages give an exactly zero gradient on every adapter weight
    logp, mask = completion_logprobs(model, [s.prompt_ids for s in samples], [s.completion_ids for s in samples], 0)
    grpo_loss(logp, None, torch.zeros(len(samples)), mask).loss.backward()
    grads = [p.grad for p in model.parameters() if p.requires_grad]
    assert all(g is None or torch.count_nonzero(g) == 0 for g in grads)
    model.zero_grad(set_to_none=True)
    # the trainer: such samples are dropped up front, so the adapter does not move
    before = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    mixed = samples + [TrainingSample([1, 40], [41, 2], 1.0), TrainingSample([1, 40], [42, 2], -1.0)]
    trainer = GRPORoundTrainer(model, samples, GRPOTrainerConfig(output_dir=str(tmp_path / "a")))
    result = trainer.train()
    assert (result.final_step, result.num_samples, result.num_dropped_zero_advantage) == (0, 0, 24)
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters() if p.requires_grad)
    assert GRPORoundTrainer(model, mixed, GRPOTrainerConfig(output_dir=str(tmp_path / "b"))).num_dropped == 24


def test_resume_after_sigkill_continues_step_counter_and_optimizer_state(tmp_path):
    out = tmp_path / "round"
    code = f"from tests.policy.test_trainer import _run_killable_round; _run_killable_round({str(out)!r})"
    child = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        deadline = time.time() + 120
        while not (out / "checkpoint-2").is_dir():
            assert child.poll() is None, child.stdout.read().decode()
            assert time.time() < deadline, "no checkpoint within 120 s"
            time.sleep(0.02)
        os.kill(child.pid, signal.SIGKILL)
    finally:
        child.wait()
    assert child.returncode == -signal.SIGKILL
    kept = sorted(int(p.name.split("-")[1]) for p in out.glob("checkpoint-*"))
    latest = max(kept)
    assert latest < 12, "the child finished before it was killed"
    assert all((out / f"checkpoint-{s}" / "trainer_state.json").is_file() for s in kept)  # no half checkpoint
    (out / ".tmp-checkpoint-99-1").mkdir()  # what a kill in the middle of a write leaves behind

    model, samples, config = _resume_round(str(out))
    trainer = GRPORoundTrainer(model, samples, config)
    assert trainer.resume_from_latest() == latest
    assert trainer.step == latest and not (out / ".tmp-checkpoint-99-1").exists()
    saved = torch.load(out / f"checkpoint-{latest}" / "optimizer.pt", weights_only=True)
    restored = trainer.optimizer.state_dict()
    assert saved["state"].keys() == restored["state"].keys() and len(saved["state"]) > 0
    for k in saved["state"]:
        assert torch.equal(saved["state"][k]["exp_avg"], restored["state"][k]["exp_avg"])
        assert torch.equal(saved["state"][k]["exp_avg_sq"], restored["state"][k]["exp_avg_sq"])
        assert float(saved["state"][k]["step"]) == float(restored["state"][k]["step"]) == latest
    adapter = load_file(str(out / f"checkpoint-{latest}" / "adapter" / "adapter_model.safetensors"))
    params = dict(model.named_parameters())
    for name, tensor in adapter.items():
        match = [p for n, p in params.items() if n.replace(".default", "") == name]
        assert len(match) == 1 and torch.equal(match[0].detach(), tensor)

    result = trainer.train()
    assert result.resumed_from == latest and result.final_step == 12
    assert [m.step for m in result.steps] == list(range(1, 13))

    # the resumed round ends where an uninterrupted one does
    reference, samples, config = _resume_round(str(tmp_path / "uninterrupted"))
    train_grpo_round(reference, samples, config)
    for (n, a), (_, b) in zip(model.named_parameters(), reference.named_parameters()):
        if a.requires_grad:
            assert torch.allclose(a, b, atol=1e-5), n


def test_resume_refuses_a_different_round(tmp_path):
    model, samples, config = _resume_round(str(tmp_path), max_steps=2)
    train_grpo_round(model, samples, config)
    other = GRPORoundTrainer(model, samples[:-1], config)
    with pytest.raises(ValueError, match="other samples"):
        other.resume_from_latest()


def test_keeps_best_k_checkpoints_and_always_the_latest(tmp_path):
    model, _ = _policy()
    config = GRPOTrainerConfig(
        output_dir=str(tmp_path), learning_rate=1e-2, num_iterations=3, minibatch_size=8, save_steps=1, keep_best=2
    )
    result = train_grpo_round(model, _synthetic_samples(), config)
    assert result.final_step == 9
    losses = {m.step: m.loss for m in result.steps}  # save_steps=1: the metric is that step's loss
    best_two = sorted(losses, key=losses.get)[:2]
    kept = sorted(int(p.name.split("-")[1]) for p in tmp_path.glob("checkpoint-*"))
    assert kept == sorted(set(best_two) | {9})
    state = json.loads((tmp_path / "checkpoint-9" / "trainer_state.json").read_text())
    assert state["step"] == 9 and len(state["metrics"]) == 9
    assert json.loads((tmp_path / "checkpoint-9" / "config.json").read_text())["keep_best"] == 2
    assert {p.name for p in (tmp_path / "checkpoint-9").iterdir()} >= {"adapter", "optimizer.pt", "rng_state.pt", "trainer_state.json", "config.json"}


@pytest.mark.parametrize("loss_type", ["dapo", "grpo", "dr_grpo"])
def test_micro_batches_accumulate_exactly_the_minibatch_gradient(loss_type, tmp_path):
    from flow_assets.rl.grpo_loss import GRPOLossConfig

    samples = [  # completions of different lengths, half with behaviour log-probs off the policy
        TrainingSample(s.prompt_ids, s.completion_ids + [7] * (i % 5), s.advantage,
                       None if s.behaviour_logprobs is None else [-4.0] * (len(s.completion_ids) + i % 5), s.task_id, (0.7, 1.0)[i % 2])
        for i, s in enumerate(_synthetic_samples())
    ]  # fmt: skip
    after = {}
    for micro in (None, 5):
        model, _ = _policy()
        with torch.no_grad():  # B != 0, so that A gets a gradient too
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.normal_(0, 0.05, generator=torch.Generator().manual_seed(1))
        config = GRPOTrainerConfig(output_dir=str(tmp_path / str(micro)), minibatch_size=24, micro_batch_size=micro,
                                   loss=GRPOLossConfig(loss_type=loss_type), learning_rate=1e-2)  # fmt: skip
        trainer = GRPORoundTrainer(model, samples, config)
        metrics = trainer._train_step(1)
        after[micro] = (metrics, [p.detach().clone() for p in trainer.params])
    (whole, params_whole), (split, params_split) = after[None], after[5]
    assert split.loss == pytest.approx(whole.loss, rel=1e-5) and split.grad_norm == pytest.approx(whole.grad_norm, rel=1e-4)
    assert split.mean_ratio == pytest.approx(whole.mean_ratio, rel=1e-5) and split.num_tokens == whole.num_tokens
    # after one AdamW step: an element's update is about lr * g / (|g| + eps), so where |g| is
    # near eps (1e-8) float rounding of the summation order moves it by a fraction of lr; 1e-3 *
    # lr bounds that, while a missing or mis-weighted micro-batch turns the sign of many
    # elements' gradients (a change of lr or more); a uniform scale error, invisible to Adam's
    # first step, is caught by the grad_norm assertion above
    assert all(torch.allclose(a, b, atol=1e-3 * config.learning_rate) for a, b in zip(params_whole, params_split))


def test_a_pause_after_a_step_checkpoints_it_and_resume_ends_where_an_uninterrupted_round_does(tmp_path):
    from flow_assets.policy.trainer import TrainingPaused

    out = tmp_path / "round"
    model, samples, config = _resume_round(str(out), max_steps=7)  # save_steps=2: step 3 has none of its own

    def pause_at_3(m):
        if m.step == 3:
            raise TrainingPaused("paused by the API")

    with pytest.raises(TrainingPaused) as info:
        train_grpo_round(model, samples, config, on_step=pause_at_3)
    assert info.value.step == 3 and info.value.checkpoint == str(out / "checkpoint-3")
    assert (out / "checkpoint-3" / "trainer_state.json").is_file()
    model, samples, config = _resume_round(str(out), max_steps=7)
    trainer = GRPORoundTrainer(model, samples, config)
    assert trainer.resume_from_latest() == 3
    result = trainer.train()
    assert result.final_step == 7 and [m.step for m in result.steps] == list(range(1, 8))
    reference, samples, config = _resume_round(str(tmp_path / "uninterrupted"), max_steps=7)
    train_grpo_round(reference, samples, config)
    for (n, a), (_, b) in zip(model.named_parameters(), reference.named_parameters()):
        if a.requires_grad:
            assert torch.allclose(a, b, atol=1e-5), n


def test_awr_round_raises_the_likelihood_of_positive_rows_and_leaves_the_others_out(tmp_path):
    """Filtered behaviour cloning (update rule "awr", weighting "positive"): rows with a positive
    advantage are imitated (their likelihood rises), the others are left out of the round, and the
    step's loss is the hand-computed -sum(A * logp) / tokens at the first step."""
    from flow_assets.rl.awr_loss import AWRLossConfig

    model, tok = _policy()
    rollouts = sample_rollouts(model, tok, ["abc=", "hello=", "xyz="], SamplingConfig(num_samples=8, max_new_tokens=5, seed=1))
    # no behaviour log-probs: another model wrote these
    samples = [TrainingSample(r.prompt_ids, r.completion_ids, 0.5 if r.sample_index % 2 == 0 else -1.0) for r in rollouts]
    positive = [s for s in samples if s.advantage > 0]
    with torch.no_grad():
        logp, mask = completion_logprobs(model, [s.prompt_ids for s in positive], [s.completion_ids for s in positive], 0)
    expected_first_loss = float(-(0.5 * logp * mask).sum() / mask.sum())  # dapo: every kept token weighs the same
    before = _mean_logprob(model, positive)
    config = GRPOTrainerConfig(
        output_dir=str(tmp_path), learning_rate=1e-2, num_iterations=4, minibatch_size=len(positive), save_steps=100,
        update_rule="awr", awr=AWRLossConfig(weighting="positive", positive_weight="advantage"),
    )  # fmt: skip
    trainer = GRPORoundTrainer(model, samples, config)
    assert (len(trainer.samples), trainer.num_dropped) == (len(positive), len(samples) - len(positive))
    result = trainer.train()
    assert result.steps[0].loss == pytest.approx(expected_first_loss, rel=1e-4)
    assert result.steps[0].mean_weight == pytest.approx(0.5) and result.steps[0].mean_ratio == 1.0
    assert result.steps[0].clip_fraction == 0.0
    assert _mean_logprob(model, positive) > before + 0.05


def _policy_with_moved_adapter():
    """The tiny policy with its LoRA B matrices drawn (seeded) away from 0, so the adapter changes
    the outputs and gradients reach A as well as B."""
    model, _ = _policy()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05, generator=torch.Generator().manual_seed(1))
    return model


def test_bf16_awr_step_is_the_float32_step_rounded_and_grpo_refuses_it(tmp_path):
    """bf16 under the "awr" rule: the same step as float32 up to bfloat16's rounding (the
    gradients' direction and the loss agree closely, but not bit for bit), the LoRA weights and
    their gradients stay float32; under "grpo" the trainer refuses it (the ratio's two sides
    would come from different numerics)."""
    from flow_assets.rl.awr_loss import AWRLossConfig

    samples = [s for s in _synthetic_samples() if s.advantage > 0]
    steps = {}
    for bf16 in (False, True):
        model = _policy_with_moved_adapter()
        config = GRPOTrainerConfig(output_dir=str(tmp_path / str(bf16)), minibatch_size=len(samples), learning_rate=1e-2,
                                   update_rule="awr", awr=AWRLossConfig(weighting="positive", positive_weight="advantage", beta_kl=0.1),
                                   bf16=bf16)  # fmt: skip
        trainer = GRPORoundTrainer(model, samples, config)
        metrics = trainer._train_step(1)
        assert all(p.dtype == torch.float32 and p.grad.dtype == torch.float32 for p in trainer.params)
        steps[bf16] = (metrics, torch.cat([p.grad.detach().flatten() for p in trainer.params]))
    (full, g_full), (mixed, g_mixed) = steps[False], steps[True]
    assert mixed.loss != full.loss and mixed.loss == pytest.approx(full.loss, rel=2e-2)
    assert mixed.kl > 0 and mixed.kl == pytest.approx(full.kl, rel=5e-2)  # the adapter-free reference, under the same autocast
    assert float(torch.nn.functional.cosine_similarity(g_full, g_mixed, dim=0)) > 0.99
    with pytest.raises(ValueError, match="bf16 is for the 'awr' update rule only"):
        GRPORoundTrainer(_policy()[0], samples, GRPOTrainerConfig(output_dir=str(tmp_path / "grpo"), bf16=True))


@pytest.mark.parametrize("shared_prefix", [False, True])
def test_gradient_checkpointing_gives_the_same_step(shared_prefix, tmp_path):
    from flow_assets.policy.sampling import MIN_SHARED_PREFIX

    samples = _synthetic_samples()
    if shared_prefix:  # prompts sharing a prefix long enough for the prefix cache (unused when recomputing)
        head = list(range(4, 4 + MIN_SHARED_PREFIX))
        samples = [TrainingSample(head + s.prompt_ids[1:2], s.completion_ids[:32 - MIN_SHARED_PREFIX - 2], s.advantage, None, s.task_id) for s in samples]
    after = {}
    for checkpointing in (False, True):
        model = _policy_with_moved_adapter()
        config = GRPOTrainerConfig(output_dir=str(tmp_path / str(checkpointing)), minibatch_size=24, learning_rate=1e-2, gradient_checkpointing=checkpointing)
        trainer = GRPORoundTrainer(model, samples, config)
        assert model.is_gradient_checkpointing == checkpointing
        metrics = trainer._train_step(1)
        after[checkpointing] = (metrics, [p.grad.detach().clone() for p in trainer.params])
    (plain, grads_plain), (recomputed, grads_recomputed) = after[False], after[True]
    assert recomputed.grad_norm > 0 and recomputed.grad_norm == pytest.approx(plain.grad_norm, rel=1e-5)
    assert recomputed.loss == pytest.approx(plain.loss, rel=1e-6)
    assert all(torch.allclose(a, b, rtol=1e-4, atol=1e-7) for a, b in zip(grads_plain, grads_recomputed))
