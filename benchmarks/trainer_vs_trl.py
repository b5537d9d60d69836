"""One GRPO step, flowopt vs TRL's ``GRPOTrainer``: same tiny model, same prompts, same loss settings.

Setup shared by both sides: the tiny Llama of :mod:`flow_assets.policy.tiny_model` (same config and
seed, fresh for each side and mode) with the character tokenizer; the same 8 ``spell_backward``
train prompts, 8 completions each (64 per step), at most 8 new tokens, temperature 1, no top-k /
top-p; reward = the task's verifier; loss ``dapo``, clip ``epsilon`` 0.2, ``beta`` 0 (no reference
pass), AdamW (``torch.optim.AdamW``, lr 2e-3, no weight decay), gradient clipping at 1.0; one
optimizer step covers all 64 completions. Two modes: full fine-tune and LoRA (rank 16, alpha 32,
all Llama projections; PEFT on both sides).

What is timed, per step, after warm-up steps:

- TRL: ``GRPOTrainer.train`` with ``max_steps`` steps; a callback times each optimizer step
  (``on_step_begin`` -> ``on_step_end``: generation, rewards, advantages, loss, backward, optimizer),
  and a wrapper around ``_generate_and_score_completions`` times its generation + scoring part;
  ``train = step - generation``.
- flowopt: ``collect`` = :func:`~flow_assets.policy.sampling.sample_rollouts` (with behaviour
  log-probs) + verifier + :func:`~flow_assets.rl.advantages.group_advantages`; ``train`` = one
  step of :class:`~flow_assets.policy.trainer.GRPORoundTrainer` on those 64 samples (LoRA; the
  trainer is built per step, as each round builds one, without the round's checkpoint write). The
  flowopt trainer trains LoRA adapters only, so the full fine-tune step is flowopt's same loss path
  without PEFT (:func:`full_finetune_step`: ``completion_logprobs`` -> ``grpo_loss`` -> AdamW).
  flowopt drops zero-variance groups (advantage exactly 0) before the loss; so that both sides put
  the same 64 completions through the loss, those rows get a small non-zero advantage here
  (the share this affects is reported as ``zero_variance_share``).

Ratios flowopt / TRL (below 1: flowopt is faster) for the whole step, the training part and the
generation part. A TRL configuration that fails is reported with its error text.
"""

from __future__ import annotations

import contextlib
import io
import tempfile
import time
import traceback

import numpy as np
import polars as pl
import torch

from benchmarks.common import ratio, summarize

NUM_PROMPTS = 8
NUM_GENERATIONS = 8
MAX_NEW_TOKENS = 8
LEARNING_RATE = 2e-3
EPSILON = 0.2
MODES = ("full", "lora")
FULL_STEPS, FULL_WARMUP = 20, 3
QUICK_STEPS, QUICK_WARMUP = 2, 1


def prompts_and_scorer():
    """The 8 train prompts and ``score(prompt, completion) -> reward`` (the spell_backward verifier)."""
    from flow_assets.tasks.sources import ReasoningGymSource, ReasoningGymSourceConfig

    source = ReasoningGymSource(ReasoningGymSourceConfig(size=200, seed=0))
    tasks = source.tasks("train")[:NUM_PROMPTS]
    by_prompt = {t.prompt: t for t in tasks}
    return [t.prompt for t in tasks], lambda prompt, completion: source.score(by_prompt[prompt], completion)


def tiny_model_and_tokenizer():
    """A freshly initialised tiny Llama (default config, seed 0) and the character tokenizer."""
    from flow_assets.policy.tiny_model import TinyModelConfig, build_tiny_model
    from flow_assets.policy.tokenizer import CharTokenizerConfig, build_char_tokenizer

    config = TinyModelConfig()
    tokenizer = build_char_tokenizer(CharTokenizerConfig(model_max_length=config.max_position_embeddings))
    return build_tiny_model(config, tokenizer), tokenizer


# -- TRL -----------------------------------------------------------------------------------------
def trl_steps(mode: str, steps: int, warmup: int) -> dict:
    """Time ``steps`` GRPOTrainer optimizer steps after ``warmup`` ones.

    Returns:
        ``step_seconds``, ``generation_seconds`` (generation + scoring) and ``train_seconds``
        (step minus generation), each a list of ``steps`` values.
    """
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from flow_assets.policy.lora import LLAMA_PROJECTIONS, LoraAdapterConfig

    prompts, score = prompts_and_scorer()
    model, tokenizer = tiny_model_and_tokenizer()

    def reward(prompts, completions, **_):
        return [score(p, c) for p, c in zip(prompts, completions)]

    total = warmup + steps
    output_dir = tempfile.TemporaryDirectory(prefix="flowopt-bench-trl-")
    args = GRPOConfig(
        output_dir=output_dir.name,
        num_generations=NUM_GENERATIONS,
        per_device_train_batch_size=NUM_PROMPTS * NUM_GENERATIONS,
        gradient_accumulation_steps=1,
        max_completion_length=MAX_NEW_TOKENS,
        temperature=1.0,
        top_k=0,
        top_p=1.0,
        beta=0.0,
        loss_type="dapo",
        epsilon=EPSILON,
        learning_rate=LEARNING_RATE,
        lr_scheduler_type="constant",
        weight_decay=0.0,
        max_grad_norm=1.0,
        optim="adamw_torch",
        max_steps=total,
        use_cpu=True,
        bf16=False,
        fp16=False,
        report_to="none",
        save_strategy="no",
        logging_steps=10_000,
        disable_tqdm=True,
        dataloader_num_workers=0,
        seed=0,
    )
    lora = LoraAdapterConfig()
    peft_config = (
        LoraConfig(r=lora.rank, lora_alpha=lora.alpha, lora_dropout=lora.dropout,
                   target_modules=list(LLAMA_PROJECTIONS), bias="none", task_type="CAUSAL_LM")
        if mode == "lora" else None
    )
    step_seconds: list[float] = []
    generation_seconds: list[float] = []

    class StepTimer(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            self.started = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            step_seconds.append(time.perf_counter() - self.started)

    dataset = Dataset.from_list([{"prompt": p} for p in prompts] * (total + 1))
    trainer = GRPOTrainer(model=model, reward_funcs=reward, args=args, train_dataset=dataset,
                          processing_class=tokenizer, peft_config=peft_config, callbacks=[StepTimer()])
    generate_and_score = trainer._generate_and_score_completions

    def timed_generate_and_score(inputs):
        started = time.perf_counter()
        out = generate_and_score(inputs)
        generation_seconds.append(time.perf_counter() - started)
        return out

    trainer._generate_and_score_completions = timed_generate_and_score
    with output_dir, contextlib.redirect_stdout(io.StringIO()):  # the Trainer prints its final metrics
        trainer.train()
    if len(step_seconds) != total or len(generation_seconds) != total:
        raise RuntimeError(f"expected {total} timed steps, got {len(step_seconds)} steps / {len(generation_seconds)} generations")
    step, gen = step_seconds[warmup:], generation_seconds[warmup:]
    return {"step_seconds": step, "generation_seconds": gen, "train_seconds": [s - g for s, g in zip(step, gen)]}


# -- flowopt ---------------------------------------------------------------------------------------
def full_finetune_step(model, optimizer, samples, pad_id: int) -> float:
    """One full fine-tune GRPO step with flowopt's loss path: teacher-forced log-probs
    (:func:`~flow_assets.policy.sampling.completion_logprobs`), the clipped surrogate
    (:func:`~flow_assets.rl.grpo_loss.grpo_loss`, behaviour log-probs as ``logp_old``), gradient
    clipping at 1.0, one AdamW step. Returns the loss."""
    from flow_assets.policy.sampling import completion_logprobs
    from flow_assets.rl.grpo_loss import GRPOLossConfig, grpo_loss

    model.train()
    logp_new, mask = completion_logprobs(model, [s.prompt_ids for s in samples], [s.completion_ids for s in samples], pad_id)
    logp_old = torch.zeros_like(logp_new)  # [batch, seq]
    for i, s in enumerate(samples):
        logp_old[i, : len(s.behaviour_logprobs)] = torch.tensor(s.behaviour_logprobs)
    advantages = torch.tensor([s.advantage for s in samples])  # [batch]
    out = grpo_loss(logp_new, logp_old, advantages, mask, None, GRPOLossConfig(eps_low=EPSILON, eps_high=EPSILON))
    optimizer.zero_grad(set_to_none=True)
    out.loss.backward()
    torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.requires_grad], 1.0)
    optimizer.step()
    return float(out.loss.detach())


def collect_batch(model, tokenizer, prompts, score, seed: int):
    """flowopt's collection for one step: 8 x 8 rollouts, verifier rewards, group advantages.

    Returns:
        ``(samples, zero_variance_share)``: 64 :class:`~flow_assets.policy.trainer.TrainingSample`
        (zero advantages replaced by a small non-zero value, see module docstring) and the share of
        the 64 that were in zero-variance groups.
    """
    from flow_assets.policy.sampling import SamplingConfig, sample_rollouts
    from flow_assets.policy.trainer import TrainingSample
    from flow_assets.rl.advantages import AdvantageConfig, group_advantages

    rollouts = sample_rollouts(model, tokenizer, prompts, SamplingConfig(
        num_samples=NUM_GENERATIONS, temperature=1.0, max_new_tokens=MAX_NEW_TOKENS, seed=seed))
    rewards = pl.DataFrame({
        "group_key": [prompts[r.prompt_index] for r in rollouts],
        "reward": [score(prompts[r.prompt_index], r.completion_text) if r.error is None else 0.0 for r in rollouts],
    })
    scored = group_advantages(rewards, AdvantageConfig())
    zero = scored["zero_variance"].to_list()
    advantages = [1e-3 if z else a for a, z in zip(scored["advantage"].to_list(), zero)]
    samples = [TrainingSample(r.prompt_ids, r.completion_ids, a, r.logprobs) for r, a in zip(rollouts, advantages)]
    return samples, float(np.mean(zero))


def flowopt_steps(mode: str, steps: int, warmup: int) -> dict:
    """Time ``steps`` flowopt collect + train steps after ``warmup`` ones.

    Returns:
        ``step_seconds`` (collect + train), ``generation_seconds`` (collect), ``train_seconds`` and
        ``zero_variance_share`` (mean over the timed steps).
    """
    from flow_assets.policy.lora import add_lora_adapter
    from flow_assets.policy.trainer import GRPORoundTrainer, GRPOTrainerConfig
    from flow_assets.rl.grpo_loss import GRPOLossConfig

    prompts, score = prompts_and_scorer()
    model, tokenizer = tiny_model_and_tokenizer()
    if mode == "lora":
        model = add_lora_adapter(model)
        # one step, no checkpoint: the trainer never writes into output_dir here
        config = GRPOTrainerConfig(output_dir="unused-no-checkpoint", learning_rate=LEARNING_RATE,
                                   minibatch_size=NUM_PROMPTS * NUM_GENERATIONS,
                                   loss=GRPOLossConfig(eps_low=EPSILON, eps_high=EPSILON), checkpoint_every=10**9)
    else:
        optimizer = torch.optim.AdamW(model.parameters(), lr=LEARNING_RATE, weight_decay=0.0)
    collect, train, zero_shares = [], [], []
    for i in range(warmup + steps):
        started = time.perf_counter()
        samples, zero_share = collect_batch(model, tokenizer, prompts, score, seed=i)
        collected = time.perf_counter()
        if mode == "lora":
            trainer = GRPORoundTrainer(model, samples, config)
            trainer._train_step(trainer.step + 1)
        else:
            full_finetune_step(model, optimizer, samples, tokenizer.pad_token_id)
        trained = time.perf_counter()
        if i >= warmup:
            collect.append(collected - started)
            train.append(trained - collected)
            zero_shares.append(zero_share)
    return {
        "step_seconds": [c + t for c, t in zip(collect, train)],
        "generation_seconds": collect,
        "train_seconds": train,
        "zero_variance_share": float(np.mean(zero_shares)),
    }


# -- the benchmark -------------------------------------------------------------------------------
def compare(mode: str, steps: int, warmup: int) -> dict:
    """flowopt and TRL in one mode, each side's timings summarised, and the flowopt/TRL ratios of
    the medians (``step``, ``train``, ``generation``). A side that fails carries ``error``."""
    out: dict = {}
    for side, fn in (("flowopt", flowopt_steps), ("trl", trl_steps)):
        try:
            raw = fn(mode, steps, warmup)
        except Exception as exc:  # report the failure instead of crashing the suite
            out[side] = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()[-2000:]}
            continue
        out[side] = {k: summarize(v) if isinstance(v, list) else v for k, v in raw.items()}
        out[side]["completions_per_second"] = NUM_PROMPTS * NUM_GENERATIONS / out[side]["step_seconds"]["median"]
    if "error" not in out["flowopt"] and "error" not in out["trl"]:
        out["ratio_flowopt_over_trl"] = {
            part: ratio(out["flowopt"][f"{part}_seconds"]["median"], out["trl"][f"{part}_seconds"]["median"])
            for part in ("step", "train", "generation")
        }
    return out


def run(quick: bool = False) -> dict:
    """The trainer benchmark (module docstring).

    Returns:
        ``modes`` (``full`` and ``lora``: per side seconds per step / train part / generation part
        with spread, completions/s, and ``ratio_flowopt_over_trl``), the settings, ``headline``.
    """
    steps, warmup = (QUICK_STEPS, QUICK_WARMUP) if quick else (FULL_STEPS, FULL_WARMUP)
    started = time.perf_counter()
    modes = {mode: compare(mode, steps, warmup) for mode in MODES}
    headline = []
    for mode, res in modes.items():
        if "ratio_flowopt_over_trl" not in res:
            errors = "; ".join(f"{side}: {res[side]['error']}" for side in ("flowopt", "trl") if "error" in res[side])
            headline.append({"figure": f"{mode}: step flowopt / TRL", "value": None, "unit": "", "note": errors})
            continue
        r = res["ratio_flowopt_over_trl"]
        f, t = res["flowopt"], res["trl"]
        headline += [
            {"figure": f"{mode}: s/step flowopt vs TRL (64 completions)", "value": [f["step_seconds"]["median"], t["step_seconds"]["median"]], "unit": "s",
             "spread": [[f["step_seconds"]["q1"], f["step_seconds"]["q3"]], [t["step_seconds"]["q1"], t["step_seconds"]["q3"]]],
             "note": "spread: interquartile range"},
            {"figure": f"{mode}: completions/s flowopt vs TRL", "value": [f["completions_per_second"], t["completions_per_second"]], "unit": "compl/s"},
            {"figure": f"{mode}: ratio flowopt / TRL, whole step", "value": r["step"], "unit": "x"},
            {"figure": f"{mode}: ratio flowopt / TRL, training part", "value": r["train"], "unit": "x"},
            {"figure": f"{mode}: ratio flowopt / TRL, generation part", "value": r["generation"], "unit": "x"},
        ]
    return {
        "what": "one GRPO optimizer step on 8 prompts x 8 completions, flowopt vs TRL GRPOTrainer",
        "settings": {
            "prompts": NUM_PROMPTS, "completions_per_prompt": NUM_GENERATIONS, "max_new_tokens": MAX_NEW_TOKENS,
            "loss_type": "dapo", "epsilon": EPSILON, "beta": 0.0, "learning_rate": LEARNING_RATE,
            "optimizer": "torch.optim.AdamW", "timed_steps": steps, "warmup_steps": warmup,
            "torch_threads": torch.get_num_threads(),
            "flowopt_full_ft": "completion_logprobs + grpo_loss + AdamW (GRPORoundTrainer trains LoRA adapters only)",
        },
        "modes": modes,
        "seconds": time.perf_counter() - started,
        "headline": headline,
    }
