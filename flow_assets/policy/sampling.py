"""Rollouts from the policy: token ids in, token ids and behaviour log-probs out.

:func:`sample_rollouts` draws ``n`` completions for every prompt in a few batched ``generate`` calls
(left padding) and returns, per sample, the prompt ids, the completion ids (ending with ``<eos>``
when the policy produced it), the decoded text, and the log-probability of every sampled token
under the policy that sampled it. The trainer consumes the ids as they are and never re-tokenises
the text, so the tokens it scores are exactly the tokens that were sampled.

Which log-prob (the behaviour log-prob ``log pi_old`` of GRPO's importance ratio)::

    logprobs[t] = log_softmax(logits_t / T)[token_t]        (natural log)

with ``logits_t`` the unmodified model logits at that step and ``T`` the sampling temperature.
This follows TRL's ``GRPOTrainer``, which divides the logits by the temperature both when it
computes the old log-probs and in the training forward pass, so the ratio compares like with like.
It is the distribution that was sampled *before* nucleus (``top_p``) truncation: with
``top_p < 1`` the actual sampling distribution is that one truncated and renormalised, and the
difference is ignored (as in TRL). In greedy mode (``temperature == 0``) the log-probs are those at
``T = 1``, i.e. ``log_softmax(logits_t)[token_t]``.

:func:`completion_logprobs` recomputes the same quantity with one teacher-forced forward pass for
given (prompt ids, completion ids) pairs; the trainer uses it for ``logp_new``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers import GenerationConfig, PreTrainedModel, PreTrainedTokenizerBase


@dataclass(frozen=True)
class SamplingConfig:
    """How rollouts are drawn.

    Attributes:
        num_samples: completions per prompt (the GRPO group size ``G``); 8 as in the flowopt demo.
        temperature: softmax temperature ``T``; ``0`` means greedy decoding (one argmax completion
            repeated ``num_samples`` times, so use ``num_samples=1`` with it).
        top_p: nucleus sampling threshold; ``1.0`` disables it (and keeps the returned log-probs the
            exact sampling log-probs).
        max_new_tokens: cap on completion length in tokens, ``<eos>`` included.
        seed: seeds the sampling RNG; same model + prompts + config gives the same rollouts. The
            caller's global torch RNG state is left as it was.
        max_batch_size: most sequences per ``generate`` call (memory bound); prompts x samples
            beyond it are split into several calls.
    """

    num_samples: int = 8
    temperature: float = 1.0
    top_p: float = 1.0
    max_new_tokens: int = 8
    seed: int = 0
    max_batch_size: int = 1024


@dataclass(frozen=True)
class Rollout:
    """One sampled completion of one prompt.

    Attributes:
        prompt_index: index of the prompt in the input list.
        sample_index: ``0 .. num_samples-1`` within that prompt's group.
        prompt: the prompt text.
        prompt_ids: the prompt's token ids as fed to the model (``<bos>`` first), unpadded.
        completion_ids: sampled token ids, up to and including the first ``<eos>`` if any.
        completion_text: ``completion_ids`` decoded without special tokens.
        logprobs: ``[len(completion_ids)]`` behaviour log-probs (natural log), see module docstring.
        finished: the completion ended with ``<eos>`` (else it hit ``max_new_tokens``).
        error: ``None``, or why this sample has no usable completion (then ``completion_ids`` and
            ``logprobs`` are empty); the other samples of the batch are unaffected.
    """

    prompt_index: int
    sample_index: int
    prompt: str
    prompt_ids: list[int]
    completion_ids: list[int]
    completion_text: str
    logprobs: list[float]
    finished: bool
    error: str | None = None


def _generation_config(config: SamplingConfig, tokenizer: PreTrainedTokenizerBase) -> GenerationConfig:
    common = dict(
        max_new_tokens=config.max_new_tokens,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.bos_token_id,
        return_dict_in_generate=True,
        output_logits=True,  # raw logits, before temperature / top-p processors
    )
    if config.temperature == 0:
        return GenerationConfig(do_sample=False, **common)
    return GenerationConfig(
        do_sample=True, temperature=config.temperature, top_p=config.top_p, top_k=0, **common
    )


def _left_pad(rows: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``rows`` -> ``input_ids: [batch, max_len]`` left-padded, ``attention_mask: [batch, max_len]``."""
    width = max(len(r) for r in rows)
    input_ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, r in enumerate(rows):
        input_ids[i, width - len(r) :] = torch.tensor(r, dtype=torch.long)
        attention_mask[i, width - len(r) :] = 1
    return input_ids, attention_mask


def _max_positions(model: PreTrainedModel) -> int | None:
    return getattr(model.config, "max_position_embeddings", None)


def sample_rollouts(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    prompts: list[str],
    config: SamplingConfig | None = None,
) -> list[Rollout]:
    """Sample ``config.num_samples`` completions for every prompt text, batched.

    Each prompt is encoded with the tokenizer's special tokens (``<bos>``), then sampled by
    :func:`sample_token_ids`; see there for the returned rollouts and the errors raised.
    """
    return sample_token_ids(
        model, tokenizer, [tokenizer(p)["input_ids"] if p else [] for p in prompts], config, texts=prompts
    )


def sample_token_ids(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    prompt_ids: list[list[int]],
    config: SamplingConfig | None = None,
    texts: list[str] | None = None,
) -> list[Rollout]:
    """Sample ``config.num_samples`` completions for every prompt given as token ids, batched.

    Args:
        model: a causal LM, plain or wrapped in a PEFT adapter; put in eval mode for the call and
            restored to its previous mode afterwards.
        tokenizer: the policy's tokenizer (needs ``pad`` and ``eos`` tokens).
        prompt_ids: ``[num_prompts][prompt_len]`` ids exactly as the policy is to be given them
            (e.g. a rendered chat template); they are not re-encoded.
        config: sampling settings.
        texts: the prompts' texts, stored on the rollouts (``""`` when not given).

    Returns:
        ``len(prompt_ids) * num_samples`` rollouts, prompt-major (prompt 0's samples first).
        A prompt that cannot be sampled (empty, or so long that prompt + ``max_new_tokens``
        exceeds the model's positions) yields rollouts with ``error`` set instead of raising; so
        does a sample whose log-probs are not finite.

    Raises:
        ValueError: if ``num_samples < 1``, ``temperature < 0``, ``top_p`` not in ``(0, 1]`` or
            ``max_new_tokens < 1``.
    """
    config = config or SamplingConfig()
    if config.num_samples < 1 or config.temperature < 0 or config.max_new_tokens < 1:
        raise ValueError(f"invalid sampling config: {config}")
    if not 0 < config.top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1], got {config.top_p}")
    texts = texts or [""] * len(prompt_ids)

    results: dict[tuple[int, int], Rollout] = {}
    queue: list[tuple[int, int, list[int]]] = []  # (prompt_index, sample_index, prompt_ids)
    max_positions = _max_positions(model)
    for p, ids in enumerate(prompt_ids):
        error = None
        if not ids:
            error = "empty prompt"
        elif max_positions is not None and len(ids) + config.max_new_tokens > max_positions:
            error = (
                f"prompt of {len(ids)} tokens + max_new_tokens {config.max_new_tokens} exceeds "
                f"the model's {max_positions} positions"
            )
        for s in range(config.num_samples):
            if error:
                results[(p, s)] = Rollout(p, s, texts[p], list(ids), [], "", [], False, error)
            else:
                queue.append((p, s, list(ids)))

    generation_config = _generation_config(config, tokenizer)
    temperature = config.temperature if config.temperature > 0 else 1.0
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad(), torch.random.fork_rng(devices=[]):
            torch.manual_seed(config.seed)
            for start in range(0, len(queue), config.max_batch_size):
                chunk = queue[start : start + config.max_batch_size]
                input_ids, attention_mask = _left_pad([ids for _, _, ids in chunk], tokenizer.pad_token_id)
                out = model.generate(
                    input_ids=input_ids, attention_mask=attention_mask, generation_config=generation_config
                )
                new_tokens = out.sequences[:, input_ids.shape[1] :]  # [batch, new]
                logits = torch.stack(out.logits, dim=1).float()  # [batch, new, vocab]
                logp_all = F.log_softmax(logits / temperature, dim=-1)
                logp = logp_all.gather(-1, new_tokens.unsqueeze(-1)).squeeze(-1)  # [batch, new]
                for row, (p, s, ids) in enumerate(chunk):
                    results[(p, s)] = _to_rollout(p, s, texts[p], ids, new_tokens[row], logp[row], tokenizer)
    finally:
        model.train(was_training)
    return [results[(p, s)] for p in range(len(prompt_ids)) for s in range(config.num_samples)]


def _to_rollout(
    p: int,
    s: int,
    prompt: str,
    prompt_ids: list[int],
    tokens: torch.Tensor,  # [new]
    logp: torch.Tensor,  # [new]
    tokenizer: PreTrainedTokenizerBase,
) -> Rollout:
    """Cut one generated row at its first ``<eos>`` (kept) and package it."""
    token_list = tokens.tolist()
    eos = tokenizer.eos_token_id
    finished = eos in token_list
    length = token_list.index(eos) + 1 if finished else len(token_list)
    completion_ids = token_list[:length]
    logprobs = logp[:length].tolist()
    if not all(math.isfinite(x) for x in logprobs):
        return Rollout(p, s, prompt, prompt_ids, [], "", [], False, "non-finite log-prob")
    text = tokenizer.decode(completion_ids, skip_special_tokens=True)
    return Rollout(p, s, prompt, prompt_ids, completion_ids, text, logprobs, finished)


def completion_logprobs(
    model: PreTrainedModel,
    prompt_ids: list[list[int]],
    completion_ids: list[list[int]],
    pad_token_id: int,
    temperature: float | Sequence[float] = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Teacher-forced log-probs of given completions, in one forward pass (differentiable).

    Each sequence ``prompt_ids[i] + completion_ids[i]`` is right-padded, so every real token keeps
    positions ``0 .. len-1`` (as in generation, where left padding is compensated by position ids).

    Args:
        model: the policy (plain or PEFT); gradients flow when grad is enabled.
        prompt_ids: ``batch`` lists of prompt token ids (non-empty).
        completion_ids: ``batch`` lists of completion token ids (may be empty).
        pad_token_id: id used for padding (masked out).
        temperature: logits are divided by it before the log-softmax (``0`` is treated as ``1``),
            matching :func:`sample_rollouts`' behaviour log-probs: one value for every row, or
            ``batch`` values (each row at the temperature it was sampled at).

    Returns:
        ``logprobs: [batch, max_completion_len]`` natural-log probabilities of the completion tokens
        (0 at padding) and ``completion_mask: [batch, max_completion_len]`` (1.0 on real tokens).

    Raises:
        ValueError: if the lists differ in length, are empty, a prompt is empty, or
            ``temperature`` is a sequence of another length or has a negative value.
    """
    if len(prompt_ids) != len(completion_ids) or not prompt_ids:
        raise ValueError("prompt_ids and completion_ids must be non-empty lists of equal length")
    if any(len(p) == 0 for p in prompt_ids):
        raise ValueError("every prompt needs at least one token (e.g. <bos>)")
    batch = len(prompt_ids)
    temps = [float(temperature)] * batch if isinstance(temperature, (int, float)) else [float(t) for t in temperature]
    if len(temps) != batch or any(t < 0 for t in temps):
        raise ValueError(f"temperature must be >= 0, one value or {batch} values; got {temperature!r}")
    width = max(len(p) + len(c) for p, c in zip(prompt_ids, completion_ids))
    comp_width = max(1, max(len(c) for c in completion_ids))
    device = next(model.parameters()).device

    input_ids = torch.full((batch, width), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros((batch, width), dtype=torch.long)
    # position (in the sequence) of the logits that predict completion token j: len(prompt) - 1 + j
    predict_at = torch.zeros((batch, comp_width), dtype=torch.long)
    targets = torch.full((batch, comp_width), pad_token_id, dtype=torch.long)
    completion_mask = torch.zeros((batch, comp_width))
    for i, (p, c) in enumerate(zip(prompt_ids, completion_ids)):
        seq = list(p) + list(c)
        input_ids[i, : len(seq)] = torch.tensor(seq, dtype=torch.long)
        attention_mask[i, : len(seq)] = 1
        n = len(c)
        if n:
            predict_at[i, :n] = torch.arange(len(p) - 1, len(p) - 1 + n)
            targets[i, :n] = torch.tensor(c, dtype=torch.long)
            completion_mask[i, :n] = 1.0

    logits = model(
        input_ids=input_ids.to(device), attention_mask=attention_mask.to(device)
    ).logits  # [batch, width, vocab]
    vocab = logits.shape[-1]
    picked = logits.gather(1, predict_at.to(device).unsqueeze(-1).expand(-1, -1, vocab))  # [batch, comp, vocab]
    row_temperature = torch.tensor([t if t > 0 else 1.0 for t in temps], device=device).view(batch, 1, 1)
    logp = F.log_softmax(picked.float() / row_temperature, dim=-1)
    logp = logp.gather(-1, targets.to(device).unsqueeze(-1)).squeeze(-1)  # [batch, comp]
    completion_mask = completion_mask.to(device)
    return logp * completion_mask, completion_mask
