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

Shared prefix. The rows of one call usually begin with the same tokens: an agent's system prompt,
its tool specification and worked examples, or ``n`` samples of one prompt. When all rows share
at least :data:`MIN_SHARED_PREFIX` leading tokens, both functions run that prefix through the
model once (batch 1), repeat its key/value cache over the batch and feed each row only the rest
(the prefix caching of vLLM and of Hugging Face's "re-use a prompt cache", applied to one batch).
Attention, positions and therefore log-probs are those of the full rows; only the arithmetic of
the prefix is not repeated (on 2 CPU cores, 33 rows with a 177-token shared prefix: 3.9-4.7 s
instead of 15.8-17.5 s for 12 new tokens). In :func:`completion_logprobs` the prefix forward
keeps its graph, so the gradient reaching the prefix is the sum over rows, as without sharing.

Decoding. ``generate`` runs greedy over scores that :class:`RowSampler` has already reduced to
one token per row: the sampler applies each row's temperature and nucleus and draws the token
from a generator seeded by ``SamplingConfig.seed`` (so rows at different settings share a batch,
and the caller's global RNG is untouched). The cache is preallocated for the whole completion,
and decoding runs :data:`DECODE_CHUNK` steps at a time: between chunks, rows that produced
``<eos>`` leave the batch, so one long completion does not keep every finished row computing.
Measured on SmolLM2-135M (2 CPU cores, 192 rows of a 284-token shared prefix, the real-model
demo's evaluation): 1.3 s per two-call trajectory before these changes, 0.6 s after.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from transformers import (
    GenerationConfig,
    LogitsProcessor,
    LogitsProcessorList,
    PreTrainedModel,
    PreTrainedTokenizerBase,
    StaticCache,
)

from flow_assets.policy.configs import Rollout, SamplingConfig


def _generation_config(max_new_tokens: int, tokenizer: PreTrainedTokenizerBase) -> GenerationConfig:
    """Greedy decoding of the processed scores: :class:`RowSampler` has already drawn each row's
    token and left it the only finite score."""
    return GenerationConfig(
        max_new_tokens=max_new_tokens,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.bos_token_id,
        return_dict_in_generate=True,
        output_logits=True,  # raw logits, before any processor
        do_sample=False,
    )


class RowSampler(LogitsProcessor):
    """Draws every row's next token with that row's own temperature and nucleus threshold, so
    rows sampled at different settings (a greedy evaluation beside a ``T = 0.7`` one) share one
    ``generate`` call.

    ``scores: [batch, vocab]`` are divided by each row's temperature; then, as Hugging Face's
    ``TopPLogitsWarper`` does (Holtzman et al. 2020, "The Curious Case of Neural Text
    Degeneration", sec. 3.1), the tokens outside the smallest set whose probability reaches
    ``top_p`` are removed; the token is drawn from the softmax of the rest by inverting its
    cumulative distribution at one uniform number per row (a row at ``T = 0`` takes its argmax).
    The returned scores are ``0`` at the drawn token and ``-inf`` elsewhere, and ``generate``
    runs in greedy mode, so it appends exactly that token. (Drawing here rather than through
    ``generate``'s ``multinomial`` costs one cumulative sum instead of one exponential variate
    per vocabulary entry: on 2 CPU cores 0.23 s of a 1.5 s decode step of 192 rows.)

    Args:
        temperatures: ``[batch]`` temperatures (``>= 0``).
        top_ps: ``[batch]`` thresholds in ``(0, 1]``.
        generator: the random stream (seeded by the caller).
    """

    def __init__(self, temperatures: torch.Tensor, top_ps: torch.Tensor, generator: torch.Generator):
        self.greedy = (temperatures == 0).unsqueeze(1)  # [batch, 1]
        self.temperatures = torch.where(temperatures == 0, torch.ones_like(temperatures), temperatures).unsqueeze(1)
        self.top_ps = top_ps.unsqueeze(1)  # [batch, 1]
        self.nucleus = bool((top_ps < 1).any())
        self.generator = generator

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        u = torch.rand((scores.shape[0], 1), generator=self.generator)
        token = draw_tokens(scores, self.greedy, self.temperatures, self.top_ps, u, self.nucleus)
        return torch.full_like(scores, -math.inf, dtype=torch.float).scatter_(1, token, 0.0)


def draw_tokens(
    scores: torch.Tensor,
    greedy: torch.Tensor,
    temperatures: torch.Tensor,
    top_ps: torch.Tensor,
    u: torch.Tensor,
    nucleus: bool = True,
) -> torch.Tensor:
    """The draw of :class:`RowSampler`, from given uniforms (its docstring has the method and source).

    Args:
        scores: ``[batch, vocab]`` raw logits.
        greedy: ``[batch, 1]`` bool, rows that take their argmax (``T = 0``).
        temperatures: ``[batch, 1]`` divisors, ``> 0`` (``1`` on greedy rows).
        top_ps: ``[batch, 1]`` nucleus thresholds in ``(0, 1]``.
        u: ``[batch, 1]`` uniform numbers in ``[0, 1)``, one per row.
        nucleus: ``False`` skips the nucleus cut (every ``top_p`` is 1).

    Returns:
        ``[batch, 1]`` token ids (long).
    """
    scores = scores.float() / temperatures.to(scores.device)
    if nucleus:
        ordered, order = torch.sort(scores, descending=False, dim=-1)
        drop = ordered.softmax(dim=-1).cumsum(dim=-1) <= (1 - top_ps.to(scores.device))
        drop[:, -1] = False  # keep at least the most likely token
        scores = scores.masked_fill(drop.scatter(1, order, drop), -math.inf)
    cdf = scores.softmax(dim=-1).cumsum(dim=-1)  # [batch, vocab]
    drawn = torch.searchsorted(cdf, u.to(scores.device) * cdf[:, -1:]).clamp(max=scores.shape[-1] - 1)  # [batch, 1]
    return torch.where(greedy.to(scores.device), scores.argmax(dim=-1, keepdim=True), drawn)


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


#: rows sharing at least this many leading tokens have them computed once (module docstring)
MIN_SHARED_PREFIX = 16


def shared_prefix_length(rows: Sequence[Sequence[int]]) -> int:
    """Length of the longest common prefix of ``rows``, capped so that every row keeps at least one
    token of its own (the last prompt token must be fed to predict the first completion token).
    ``0`` for no rows."""
    if not rows:
        return 0
    first, limit = rows[0], min(len(r) for r in rows) - 1
    n = 0
    while n < limit and all(r[n] == first[n] for r in rows):
        n += 1
    return max(n, 0)


def _prefix_cache(model: PreTrainedModel, prefix: list[int], batch: int):
    """The key/value cache of ``prefix`` (one forward pass, batch 1) repeated ``batch`` times."""
    device = next(model.parameters()).device
    cache = model(input_ids=torch.tensor([prefix], device=device), use_cache=True).past_key_values
    cache.batch_repeat_interleave(batch)
    return cache


def _static_cache(model: PreTrainedModel, prefix: list[int], batch: int, max_len: int) -> StaticCache:
    """A preallocated cache for ``batch`` rows of up to ``max_len`` tokens, holding the keys and
    values of ``prefix`` (computed once, batch 1) in every row. Decoding writes in place: a
    growing cache would copy every row's keys and values at every step (on 2 CPU cores, 74% of a
    decode step of 32 rows with 330 cached tokens went to that copy)."""
    device = next(model.parameters()).device
    config = model.config
    heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    dtype = next(model.parameters()).dtype
    cache = StaticCache(config=config, max_cache_len=max_len)
    cache.early_initialization(batch, heads, head_dim, dtype, device)
    if prefix:
        computed = model(input_ids=torch.tensor([prefix], device=device), use_cache=True).past_key_values
        for layer, done in zip(cache.layers, computed.layers):
            layer.keys[:, :, : len(prefix)] = done.keys
            layer.values[:, :, : len(prefix)] = done.values
            layer.cumulative_length.fill_(len(prefix))
    return cache


def _keep_rows(cache: StaticCache, keep: torch.Tensor) -> None:
    """Drop the rows of ``cache`` not in ``keep`` (``[rows]`` indices)."""
    for layer in cache.layers:
        layer.keys = layer.keys.index_select(0, keep)
        layer.values = layer.values.index_select(0, keep)
        layer.batch_size = len(keep)


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
    temperatures: Sequence[float] | None = None,
    top_ps: Sequence[float] | None = None,
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
        temperatures / top_ps: one value per prompt, instead of ``config.temperature`` /
            ``config.top_p`` (rows at different settings are generated together,
            :class:`RowSampler`); each row's log-probs are at its own temperature.

    Returns:
        ``len(prompt_ids) * num_samples`` rollouts, prompt-major (prompt 0's samples first).
        A prompt that cannot be sampled (empty, or so long that prompt + ``max_new_tokens``
        exceeds the model's positions) yields rollouts with ``error`` set instead of raising; so
        does a sample whose log-probs are not finite.

    Raises:
        ValueError: if ``num_samples < 1``, a temperature ``< 0``, a ``top_p`` not in ``(0, 1]``,
            ``max_new_tokens < 1``, or per-prompt settings of another length than ``prompt_ids``.
    """
    config = config or SamplingConfig()
    n = len(prompt_ids)
    temperatures = [config.temperature] * n if temperatures is None else [float(t) for t in temperatures]
    top_ps = [config.top_p] * n if top_ps is None else [float(p) for p in top_ps]
    if config.num_samples < 1 or config.max_new_tokens < 1 or any(t < 0 for t in temperatures):
        raise ValueError(f"invalid sampling config: {config} (temperatures {sorted(set(temperatures))})")
    if not all(0 < p <= 1 for p in top_ps):
        raise ValueError(f"top_p must be in (0, 1], got {sorted(set(top_ps))}")
    if len(temperatures) != n or len(top_ps) != n:
        raise ValueError(f"{len(temperatures)} temperatures and {len(top_ps)} top_ps for {n} prompts")
    texts = texts or [""] * n

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

    was_training = model.training
    model.eval()
    try:
        generator = torch.Generator().manual_seed(config.seed)
        with torch.no_grad():
            for start in range(0, len(queue), config.max_batch_size):
                chunk = queue[start : start + config.max_batch_size]
                row_t = torch.tensor([temperatures[p] for p, _, _ in chunk])  # [batch]
                row_p = torch.tensor([top_ps[p] for p, _, _ in chunk])  # [batch]
                tokens, logprobs = _generate(
                    model, tokenizer, [ids for _, _, ids in chunk], row_t, row_p, config.max_new_tokens, generator
                )
                for row, (p, s, ids) in enumerate(chunk):
                    results[(p, s)] = _to_rollout(p, s, texts[p], ids, tokens[row], logprobs[row], tokenizer)
    finally:
        model.train(was_training)
    return [results[(p, s)] for p in range(n) for s in range(config.num_samples)]


#: decoding steps between two removals of finished rows (module docstring)
DECODE_CHUNK = 8


def _generate(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    rows: list[list[int]],
    temperatures: torch.Tensor,
    top_ps: torch.Tensor,
    max_new_tokens: int,
    generator: torch.Generator,
) -> tuple[list[list[int]], list[list[float]]]:
    """Decode ``rows`` (at most ``max_new_tokens`` each): every row's new token ids, up to and
    including its first ``eos``, and their log-probs at the row's temperature (greedy rows at 1).

    The rows sit ``[shared prefix][left padding][rest of the row]`` in one preallocated cache
    (the prefix computed once; the attention mask keeps every row's positions contiguous).
    ``generate`` runs :data:`DECODE_CHUNK` steps at a time; between chunks the rows that
    produced ``eos`` leave the batch (their cache rows are dropped) and the others continue from
    the cache, so one long completion does not keep every finished row in every step.
    """
    shared = shared_prefix_length(rows)
    shared = shared if shared >= MIN_SHARED_PREFIX else 0
    rest, rest_mask = _left_pad([r[shared:] for r in rows], tokenizer.pad_token_id)
    sequences = torch.cat([torch.tensor([rows[0][:shared]] * len(rows), dtype=torch.long).view(len(rows), shared), rest], dim=1)
    mask = torch.cat([torch.ones((len(rows), shared), dtype=torch.long), rest_mask], dim=1)
    cache = _static_cache(model, rows[0][:shared], len(rows), sequences.shape[1] + max_new_tokens)
    scale = torch.where(temperatures > 0, temperatures, torch.ones_like(temperatures))  # greedy: log-probs at T = 1
    device = next(model.parameters()).device
    active = torch.arange(len(rows))  # original index of each row still decoding
    tokens: list[list[int]] = [[] for _ in rows]
    logprobs: list[list[float]] = [[] for _ in rows]
    eos = tokenizer.eos_token_id
    while len(active) and len(tokens[int(active[0])]) < max_new_tokens:
        steps = min(DECODE_CHUNK, max_new_tokens - len(tokens[int(active[0])]))
        sampled = bool((temperatures[active] > 0).any())
        processors = LogitsProcessorList([RowSampler(temperatures[active], top_ps[active], generator)] if sampled else [])
        out = model.generate(
            input_ids=sequences.to(device), attention_mask=mask.to(device), past_key_values=cache,
            generation_config=_generation_config(steps, tokenizer), logits_processor=processors,
        )  # fmt: skip
        new = out.sequences[:, sequences.shape[1] :].cpu()  # [active, new]
        step_logp = torch.stack(
            [F.log_softmax(step.float().cpu() / scale[active].unsqueeze(1), dim=-1).gather(-1, new[:, k : k + 1]).squeeze(-1)
             for k, step in enumerate(out.logits)],
            dim=1,
        )  # [active, new]  # fmt: skip
        finished = torch.zeros(len(active), dtype=torch.bool)
        for j, i in enumerate(active.tolist()):
            for token, lp in zip(new[j].tolist(), step_logp[j].tolist()):
                tokens[i].append(token)
                logprobs[i].append(lp)
                if token == eos:
                    break
            finished[j] = tokens[i][-1] == eos
        keep = (~finished).nonzero().squeeze(1)
        if len(keep) == 0:
            break
        sequences = out.sequences.cpu()[keep]
        mask = torch.cat([mask, torch.ones((len(mask), new.shape[1]), dtype=torch.long)], dim=1)[keep]
        if len(keep) < len(active):
            _keep_rows(cache, keep.to(device))
        active = active[keep]
    return tokens, logprobs


def _to_rollout(
    p: int,
    s: int,
    prompt: str,
    prompt_ids: list[int],
    tokens: list[int],
    logprobs: list[float],
    tokenizer: PreTrainedTokenizerBase,
) -> Rollout:
    """Package one decoded row (its tokens end at the first ``<eos>``, if any)."""
    finished = bool(tokens) and tokens[-1] == tokenizer.eos_token_id
    if not all(math.isfinite(x) for x in logprobs):
        return Rollout(p, s, prompt, prompt_ids, [], "", [], False, "non-finite log-prob")
    text = tokenizer.decode(tokens, skip_special_tokens=True)
    return Rollout(p, s, prompt, prompt_ids, list(tokens), text, list(logprobs), finished)


def completion_logprobs(
    model: PreTrainedModel,
    prompt_ids: list[list[int]],
    completion_ids: list[list[int]],
    pad_token_id: int,
    temperature: float | Sequence[float] = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Teacher-forced log-probs of given completions, in one forward pass (differentiable).

    Each sequence ``prompt_ids[i] + completion_ids[i]`` is left-padded, so every completion ends
    in the last column; explicit position ids keep every real token at positions ``0 .. len-1``
    (as in generation). Only the last ``max completion length + 1`` columns are turned into
    logits (``logits_to_keep``): the vocabulary projection of prompt positions would be
    discarded, and for a 49k-token vocabulary it is most of the pass's memory. A prefix shared
    by every prompt of two or more rows is computed once (module docstring), except while a
    model in training recomputes its activations (gradient checkpointing runs without a cache).

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
    shared = shared_prefix_length(prompt_ids)
    # one row has nothing to share; and a model that recomputes activations (gradient
    # checkpointing, in training) runs without a KV cache, so it cannot take the prefix's
    checkpointing = model.training and bool(getattr(model, "is_gradient_checkpointing", False))
    shared = shared if shared >= MIN_SHARED_PREFIX and batch > 1 and not checkpointing else 0
    rows = [list(p[shared:]) + list(c) for p, c in zip(prompt_ids, completion_ids)]
    input_ids, attention_mask = _left_pad(rows, pad_token_id)  # [batch, width]
    comp_width = max(1, max(len(c) for c in completion_ids))
    device = next(model.parameters()).device
    # kept logits column k predicts the token in column width - comp_width + k; completion token j
    # of row i is in column width - len(c_i) + j, so it is predicted at k = comp_width - len(c_i) + j - 1
    predict_at = torch.zeros((batch, comp_width), dtype=torch.long)
    targets = torch.full((batch, comp_width), pad_token_id, dtype=torch.long)
    completion_mask = torch.zeros((batch, comp_width))
    for i, c in enumerate(completion_ids):
        if c:
            predict_at[i, : len(c)] = torch.arange(comp_width - len(c), comp_width)
            targets[i, : len(c)] = torch.tensor(c, dtype=torch.long)
            completion_mask[i, : len(c)] = 1.0
    position_ids = (attention_mask.cumsum(dim=1) - 1).clamp(min=0) + shared  # [batch, width]

    cache = _prefix_cache(model, list(prompt_ids[0][:shared]), batch) if shared else None
    logits = model(
        input_ids=input_ids.to(device),
        attention_mask=torch.cat([torch.ones((batch, shared), dtype=torch.long), attention_mask], dim=1).to(device),
        position_ids=position_ids.to(device),
        past_key_values=cache,
        use_cache=cache is not None,
        logits_to_keep=comp_width + 1,
    ).logits[:, :-1]  # [batch, comp_width, vocab]: the last column predicts past the end
    picked = logits.gather(1, predict_at.to(device).unsqueeze(-1).expand(-1, -1, logits.shape[-1]))  # [batch, comp, vocab]
    row_temperature = torch.tensor([t if t > 0 else 1.0 for t in temps], device=device).view(batch, 1, 1)
    logp = F.log_softmax(picked.float() / row_temperature, dim=-1)
    logp = logp.gather(-1, targets.to(device).unsqueeze(-1)).squeeze(-1)  # [batch, comp]
    completion_mask = completion_mask.to(device)
    return logp * completion_mask, completion_mask
