"""Supervised fine-tuning (the warm start before GRPO) on (prompt, answer) demonstrations.

Each demonstration becomes ``<bos> prompt`` followed by ``answer <eos>``; the loss is the mean
negative log-likelihood of the answer tokens (``<eos>`` included) over all answer tokens of the
minibatch, so prompt tokens carry no loss::

    loss = - sum_{i,t} m_{i,t} log pi(a_{i,t} | prompt_i, a_{i,<t}) / sum_{i,t} m_{i,t}

All parameters the caller left trainable are trained (for the tiny model: all of them), with
AdamW (Loshchilov & Hutter 2019) at a constant learning rate and gradient-norm clipping; a step
may run as micro-batches (gradient accumulation) and in bfloat16 mixed precision (``SFTConfig``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np
import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from flow_assets.policy.configs import SFTConfig
from flow_assets.policy.sampling import completion_logprobs


@dataclass
class SFTResult:
    """What a warm start did.

    Attributes:
        losses: ``[steps]`` mean answer-token NLL (nats) per step.
        steps: optimizer steps taken.
        seconds: wall-clock time of the loop.
    """

    losses: list[float] = field(default_factory=list)
    steps: int = 0
    seconds: float = 0.0


def tokenize_demonstrations(
    tokenizer: PreTrainedTokenizerBase, demonstrations: list[tuple[str, str]]
) -> tuple[list[list[int]], list[list[int]]]:
    """``(prompt, answer)`` pairs -> (prompt ids with ``<bos>``, answer ids + ``<eos>``)."""
    prompts = [tokenizer(p)["input_ids"] for p, _ in demonstrations]
    answers = [
        tokenizer(a, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        for _, a in demonstrations
    ]
    return prompts, answers


def sft_train(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    demonstrations: list[tuple[str, str]],
    config: SFTConfig | None = None,
) -> SFTResult:
    """Fine-tune ``model`` in place on ``(prompt text, answer text)`` demonstrations (raw
    prompts, no chat template; see :func:`sft_on_rows` for conversations rendered by one).

    Raises:
        ValueError: if there are no demonstrations or no trainable parameters.
    """
    if not demonstrations:
        raise ValueError("no demonstrations")
    prompts, answers = tokenize_demonstrations(tokenizer, demonstrations)
    return sft_on_rows(model, list(zip(prompts, answers)), tokenizer.pad_token_id, config)


def sft_on_rows(
    model: PreTrainedModel,
    rows: list[tuple[list[int], list[int]]],
    pad_token_id: int,
    config: SFTConfig | None = None,
) -> SFTResult:
    """Fine-tune ``model`` in place on ``(prompt ids, completion ids)`` rows; left in eval mode.

    The rows of a chat demonstration come from
    :func:`~flow_assets.policy.chat.conversation_rows` (one per assistant turn, the turn's
    end-of-turn token included in its completion).

    Args:
        model: causal LM with trainable parameters.
        rows: token rows; only completion tokens carry loss.
        pad_token_id: id used for padding.
        config: steps, learning rate, batch size, micro-batch size, seed.

    Returns:
        :class:`SFTResult` with the per-step losses.

    Raises:
        ValueError: if there are no rows, no trainable parameters, or a negative micro-batch size.
    """
    config = config or SFTConfig()
    if not rows:
        raise ValueError("no demonstrations")
    params = [p for p in model.parameters() if p.requires_grad]
    if not params:
        raise ValueError("model has no trainable parameters")
    if config.micro_batch_size < 0:
        raise ValueError(f"micro_batch_size must be >= 0, got {config.micro_batch_size}")
    device = params[0].device
    optimizer = torch.optim.AdamW(params, lr=config.learning_rate, weight_decay=config.weight_decay)
    rng = np.random.default_rng(config.seed)
    order: list[int] = []
    result = SFTResult()
    start = time.perf_counter()
    model.train()
    for _ in range(config.steps):
        if len(order) < config.batch_size:
            order += rng.permutation(len(rows)).tolist()
        batch, order = order[: config.batch_size], order[config.batch_size :]
        # the step's loss is normalised by all its answer tokens, so accumulating micro-batches
        # gives the gradient of one pass over the whole batch
        tokens = sum(len(rows[i][1]) for i in batch)
        micro = config.micro_batch_size or len(batch)
        # rows of similar length share a micro-batch (less padding); the sum is the same
        batch = sorted(batch, key=lambda i: len(rows[i][0]) + len(rows[i][1]))
        optimizer.zero_grad(set_to_none=True)
        step_loss = 0.0
        for j in range(0, len(batch), micro):
            part = batch[j : j + micro]
            with torch.autocast(device_type=device.type, dtype=torch.bfloat16, enabled=config.bf16):
                logp, mask = completion_logprobs(
                    model, [rows[i][0] for i in part], [rows[i][1] for i in part], pad_token_id
                )  # [micro, answer_len] each, float32 (the log-softmax runs in float32)
            loss = -(logp * mask).sum() / tokens
            loss.backward()
            step_loss += float(loss.detach())
        torch.nn.utils.clip_grad_norm_(params, config.max_grad_norm)
        optimizer.step()
        result.losses.append(step_loss)
    model.eval()
    result.steps = config.steps
    result.seconds = time.perf_counter() - start
    return result
