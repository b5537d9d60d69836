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

A third mode, ``smollm2_lora``, runs the same comparison on the real pretrained model
(SmolLM2-135M-Instruct, prepared from the ``smollm2`` extra; skipped without it): the first turn of
the real-model demo's word-problem agent (two worked examples and a question, the calculator
tool written into the system message by flowopt's chat rendering) for 8 train tasks, 8
completions each at T = 0.5 (the demo's), at most 40 new tokens, lr 2e-4, micro-batches of 16
(TRL: ``per_device_train_batch_size`` 16 with 4 accumulation steps, one generation per optimizer
step); reward 1 when the completion calls the calculator with the story's expression. Both sides
get the same prompt text and tokenise it to the same ids (checked). One timed step per side, no
warm-up (a step takes minutes), with 2 torch threads (``real_model_threads``), as the demo runs.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import tempfile
import time
import traceback
from dataclasses import dataclass

import numpy as np
import polars as pl
import torch

from benchmarks.common import REPO_ROOT, ratio, real_model_threads, summarize

NUM_PROMPTS = 8
NUM_GENERATIONS = 8
EPSILON = 0.2
MODES = ("full", "lora", "smollm2_lora")
FULL_STEPS, FULL_WARMUP = 20, 3
QUICK_STEPS, QUICK_WARMUP = 2, 1


@dataclass(frozen=True)
class Setup:
    """What one mode compares: the model, its prompts and sampling, the step's size.

    Attributes:
        lora: train a LoRA adapter (else the full model).
        max_new_tokens / temperature / learning_rate: generation cap, sampling temperature, AdamW lr.
        micro_batch_size: rows per forward/backward (``None``: all 64 at once).
        steps / warmup: timed steps and untimed ones before them (``None``: the run's sizes).
    """

    lora: bool
    max_new_tokens: int = 8
    temperature: float = 1.0
    learning_rate: float = 2e-3
    micro_batch_size: int | None = None
    steps: int | None = None
    warmup: int | None = None


SETUPS = {
    "full": Setup(lora=False),
    "lora": Setup(lora=True),
    "smollm2_lora": Setup(lora=True, max_new_tokens=40, temperature=0.5, learning_rate=2e-4, micro_batch_size=16, steps=1, warmup=0),
}


def prompts_and_scorer(mode: str, tokenizer):
    """The 8 train prompts (texts) and ``score(prompt, completion) -> reward`` of ``mode``: the
    spell_backward verifier on the tiny model; for SmolLM2 the word-problem agent's first turn,
    rendered with flowopt's chat template code, scored 1 when it calls the calculator with the
    story's expression."""
    if mode != "smollm2_lora":
        from flow_assets.tasks.sources import ReasoningGymSource, ReasoningGymSourceConfig

        source = ReasoningGymSource(ReasoningGymSourceConfig(size=200, seed=0))
        tasks = source.tasks("train")[:NUM_PROMPTS]
        by_prompt = {t.prompt: t for t in tasks}
        return [t.prompt for t in tasks], lambda prompt, completion: source.score(by_prompt[prompt], completion)
    from flow_assets.policy.chat import render_prompt
    from flow_assets.policy.tool_calls import parse_tool_calls
    from flow_assets.tasks.calculator import CALCULATOR_TOOL
    from flow_assets.tasks.word_problems import WORKED_EXAMPLES, WordProblemSource

    tasks = WordProblemSource().tasks("train")[:NUM_PROMPTS]
    texts = {}
    for t in tasks:
        text, ids = render_prompt(tokenizer, [*WORKED_EXAMPLES, {"role": "user", "content": t.prompt}], [CALCULATOR_TOOL])
        if tokenizer(text)["input_ids"] != ids:  # TRL tokenises the text itself: it must get the gateway's ids
            raise RuntimeError("TRL would tokenise the rendered prompt to other ids than the gateway's")
        texts[text] = t

    def score(prompt: str, completion: str) -> float:
        calls = parse_tool_calls(completion, "hermes", [CALCULATOR_TOOL]).tool_calls
        return float(bool(calls) and json.loads(calls[0].arguments).get("expression") == texts[prompt].metadata["expression"])

    return list(texts), score


def model_and_tokenizer(mode: str):
    """A fresh model and its tokenizer: the tiny Llama (default config, seed 0) with the
    character tokenizer, or SmolLM2-135M-Instruct through ``from_pretrained``.

    Raises:
        PresetUnavailable: ``smollm2_lora`` without the ``smollm2`` extra.
    """
    if mode == "smollm2_lora":
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from flow_assets.policy.presets import prepare_model

        path = prepare_model("smollm2-135m-instruct", REPO_ROOT / ".models" / "presets" / "smollm2-135m-instruct").path
        return AutoModelForCausalLM.from_pretrained(path), AutoTokenizer.from_pretrained(path)
    from flow_assets.policy.tiny_model import TinyModelConfig, build_tiny_model
    from flow_assets.policy.tokenizer import CharTokenizerConfig, build_char_tokenizer

    config = TinyModelConfig()
    tokenizer = build_char_tokenizer(CharTokenizerConfig(model_max_length=config.max_position_embeddings))
    return build_tiny_model(config, tokenizer), tokenizer


# -- TRL -----------------------------------------------------------------------------------------
def trl_steps(mode: str, steps: int, warmup: int) -> dict:
    """Time ``steps`` GRPOTrainer optimizer steps after ``warmup`` ones (``mode``: :data:`SETUPS`).

    Returns:
        ``step_seconds``, ``generation_seconds`` (generation + scoring) and ``train_seconds``
        (step minus generation), each a list of ``steps`` values.
    """
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from flow_assets.policy.lora import LLAMA_PROJECTIONS, LoraAdapterConfig

    setup = SETUPS[mode]
    model, tokenizer = model_and_tokenizer(mode)
    prompts, score = prompts_and_scorer(mode, tokenizer)
    micro = setup.micro_batch_size or NUM_PROMPTS * NUM_GENERATIONS

    def reward(prompts, completions, **_):
        return [score(p, c) for p, c in zip(prompts, completions)]

    total = warmup + steps
    output_dir = tempfile.TemporaryDirectory(prefix="flowopt-bench-trl-")
    args = GRPOConfig(
        output_dir=output_dir.name,
        num_generations=NUM_GENERATIONS,
        per_device_train_batch_size=micro,
        gradient_accumulation_steps=NUM_PROMPTS * NUM_GENERATIONS // micro,
        max_completion_length=setup.max_new_tokens,
        temperature=setup.temperature,
        top_k=0,
        top_p=1.0,
        beta=0.0,
        loss_type="dapo",
        epsilon=EPSILON,
        learning_rate=setup.learning_rate,
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
        if setup.lora else None
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
    out = grpo_loss(logp_new, logp_old, advantages, mask, None, GRPOLossConfig(epsilon=EPSILON, epsilon_high=EPSILON))
    optimizer.zero_grad(set_to_none=True)
    out.loss.backward()
    torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.requires_grad], 1.0)
    optimizer.step()
    return float(out.loss.detach())


def collect_batch(model, tokenizer, prompts, score, seed: int, setup: Setup = SETUPS["lora"]):
    """flowopt's collection for one step: 8 x 8 rollouts, verifier rewards, group advantages.

    Returns:
        ``(samples, zero_variance_share)``: 64 :class:`~flow_assets.policy.trainer.TrainingSample`
        (zero advantages replaced by a small non-zero value, see module docstring) and the share of
        the 64 that were in zero-variance groups.
    """
    from flow_assets.policy.sampling import SamplingConfig, sample_token_ids
    from flow_assets.policy.trainer import TrainingSample
    from flow_assets.rl.advantages import AdvantageConfig, group_advantages

    ids = [tokenizer(p)["input_ids"] for p in prompts]  # as TRL tokenises a text prompt
    rollouts = sample_token_ids(model, tokenizer, ids, SamplingConfig(
        num_samples=NUM_GENERATIONS, temperature=setup.temperature, max_new_tokens=setup.max_new_tokens, seed=seed), texts=prompts)
    rewards = pl.DataFrame({
        "group_key": [prompts[r.prompt_index] for r in rollouts],
        "reward": [score(prompts[r.prompt_index], r.completion_text) if r.error is None else 0.0 for r in rollouts],
    })
    scored = group_advantages(rewards, AdvantageConfig())
    zero = scored["zero_variance"].to_list()
    advantages = [1e-3 if z else a for a, z in zip(scored["advantage"].to_list(), zero)]
    samples = [TrainingSample(r.prompt_ids, r.completion_ids, a, r.logprobs, None, setup.temperature) for r, a in zip(rollouts, advantages)]
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

    setup = SETUPS[mode]
    model, tokenizer = model_and_tokenizer(mode)
    prompts, score = prompts_and_scorer(mode, tokenizer)
    if setup.lora:
        model = add_lora_adapter(model)
        # one step, no checkpoint: the trainer never writes into output_dir here
        config = GRPOTrainerConfig(output_dir="unused-no-checkpoint", learning_rate=setup.learning_rate,
                                   minibatch_size=NUM_PROMPTS * NUM_GENERATIONS, micro_batch_size=setup.micro_batch_size,
                                   loss=GRPOLossConfig(epsilon=EPSILON, epsilon_high=EPSILON), save_steps=10**9)
    else:
        optimizer = torch.optim.AdamW(model.parameters(), lr=setup.learning_rate, weight_decay=0.0)
    collect, train, zero_shares = [], [], []
    for i in range(warmup + steps):
        started = time.perf_counter()
        samples, zero_share = collect_batch(model, tokenizer, prompts, score, seed=i, setup=setup)
        collected = time.perf_counter()
        if setup.lora:
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
    the medians (``step``, ``train``, ``generation``). A side that fails carries ``error``; a mode
    whose model is not installed carries ``skipped``."""
    from flow_assets.policy.presets import PresetUnavailable, find_gguf, get_preset

    if mode == "smollm2_lora":
        try:
            find_gguf(get_preset("smollm2-135m-instruct"))
        except PresetUnavailable as exc:
            return {"skipped": str(exc)}
    setup = SETUPS[mode]
    steps, warmup = setup.steps or steps, warmup if setup.warmup is None else setup.warmup
    out: dict = {"timed_steps": steps, "warmup_steps": warmup}
    for side, fn in (("flowopt", flowopt_steps), ("trl", trl_steps)):
        try:
            with real_model_threads() if mode == "smollm2_lora" else contextlib.nullcontext():
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
    modes = {
        mode: {"skipped": "a quick run leaves out the real model (minutes per step)"} if quick and mode == "smollm2_lora"
        else compare(mode, steps, warmup)
        for mode in MODES
    }  # fmt: skip
    headline = []
    for mode, res in modes.items():
        if "skipped" in res:  # said once in the full run's table; a quick run is a smoke test
            if not quick:
                headline.append({"figure": f"{mode}: step flowopt / TRL", "value": None, "unit": "", "note": f"skipped: {res['skipped']}"})
            continue
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
            "prompts": NUM_PROMPTS, "completions_per_prompt": NUM_GENERATIONS,
            "setups": {mode: dataclasses.asdict(setup) for mode, setup in SETUPS.items()},
            "loss_type": "dapo", "epsilon": EPSILON, "beta": 0.0,
            "optimizer": "torch.optim.AdamW", "timed_steps": steps, "warmup_steps": warmup,
            "torch_threads": torch.get_num_threads(),
            "flowopt_full_ft": "completion_logprobs + grpo_loss + AdamW (GRPORoundTrainer trains LoRA adapters only)",
        },
        "modes": modes,
        "seconds": time.perf_counter() - started,
        "headline": headline,
    }
