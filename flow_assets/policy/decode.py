"""Continuous decoding: sequences join and leave one running batch at token boundaries.

:func:`~flow_assets.policy.sampling.sample_token_ids` decodes a fixed set of rows to the end, so
work that arrives one token after it started waits for all of it. :class:`RowDecoder` keeps one
batch running instead (the iteration-level scheduling of Orca, Yu et al., OSDI 2022, which vLLM
and TGI call continuous batching): :meth:`RowDecoder.add` runs the prompts of new rows through
the model and merges their keys and values into the running batch, :meth:`RowDecoder.step`
decodes one token of every row and hands back the rows that are done (``eos`` or their own
``max_tokens``). Their cache rows are dropped at the next merge, or once they are a quarter of the
batch: dropping copies every row's keys and values, while decoding a few more rows along (their
tokens never read) costs little.

Layout. Per layer one cache ``[rows, kv_heads, capacity, head_dim]`` in which every row is right
aligned: all rows write their next token at the same column, a row's own tokens are the columns
``valid: [rows, capacity]`` marks, and the left padding before them is masked. The model gets an
explicit 4-D additive mask and per-row position ids, so every row sees exactly its own tokens at
positions ``0 .. len - 1``, as it would alone. New rows are prefilled together in buckets of
similar prompt length (:func:`length_buckets`, so a short prompt is not padded to a long one's
width), a prefix all of a bucket's rows
share (at least :data:`~flow_assets.policy.sampling.MIN_SHARED_PREFIX` tokens) computed once, as in
``sample_token_ids``, and rows with the same prompt (a request's ``n`` choices, a GRPO group's
agents, one task in two evaluation modes) prefilled once and their cache rows copied; merging copies the running rows once into a cache sized for the longest
remaining completion, and columns no row uses any more are dropped then.

Sampling. A row's next token is drawn exactly as :class:`~flow_assets.policy.sampling.RowSampler`
draws it (its temperature, its nucleus, the inverse CDF at one uniform number), and its log-prob is
the one ``sample_token_ids`` records, ``log_softmax(logits / T)[token]`` (``T = 1`` for greedy rows).
The uniform numbers come from the row's own stream: draw ``t`` (``t = 0, 1, ...``) of a row with
state ``s`` is the top 24 bits of ``mix64(s + (t + 1) * gamma)`` over ``2^24``, i.e. SplitMix64
(Steele, Lea and Flood, "Fast splittable pseudorandom number generators", OOPSLA 2014; constants of
Vigna's reference implementation) started at ``s``; :func:`row_streams` gives the states of a
request's rows. So what a row samples depends on its prompt, settings and stream, not on the other
rows of the batch or when it joined (up to float rounding of the batch's shape, which could move a
token only if its uniform fell within rounding of a CDF boundary).

Constrained rows. A row with a ``matcher`` (an llguidance ``LLMatcher``,
:mod:`flow_assets.policy.constrained`) may only sample the tokens the matcher allows: before the
draw its logits are ``-inf`` elsewhere, its log-prob is that of the masked distribution,
``log_softmax(masked logits / T)[token]`` (renormalised over the allowed tokens: what actually
sampled the token, not the policy's own distribution), and the matcher consumes the token after
it. When the matcher says its grammar is complete (nothing but the end may follow) the row is
finished: ``eos`` is appended with log-prob 0 (the masked distribution's only token) when
``max_tokens`` leaves room. A matcher that refuses a token (it cannot happen with its own mask)
ends the row with :attr:`DecodeRow.error`. Rows without a matcher are decoded exactly as without
constrained rows in the batch: the mask touches only the rows that have one.

Budget. A grammar says what may follow, not that the text must end before ``max_tokens``: a
policy that never closes a string is cut inside it. A constrained row with a ``budget``
(:class:`~flow_assets.policy.constrained.ClosingBudget`) keeps a completion of its grammar that
fits the tokens it has left, ``r = max_tokens - len(tokens)``, once ``r`` comes near it: when the
completion needs all ``r`` tokens, its next token is the only one the mask leaves (log-prob 0);
a freely drawn token after which no completion fits ``r - 1`` tokens is masked out too and the
row drawn again from the same uniform (the recorded log-prob is that of this last draw's masked,
renormalised distribution), at most ``ClosingBudget.REDRAWS`` times before the completion's next
token is forced. So the row ends with its grammar complete whenever a completion fitted
``max_tokens`` when it was first needed (else it decodes as without a budget).
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from transformers import PreTrainedModel

from flow_assets.policy.sampling import MIN_SHARED_PREFIX, draw_tokens, shared_prefix_length

_GAMMA = np.uint64(0x9E3779B97F4A7C15)
_MIX1 = np.uint64(0xBF58476D1CE4E5B9)
_MIX2 = np.uint64(0x94D049BB133111EB)


def _mix64(z: np.ndarray) -> np.ndarray:
    """SplitMix64's output function on ``uint64`` arrays (arithmetic modulo 2^64)."""
    z = (z ^ (z >> np.uint64(30))) * _MIX1
    z = (z ^ (z >> np.uint64(27))) * _MIX2
    return z ^ (z >> np.uint64(31))


def row_streams(seed: int, count: int) -> list[int]:
    """The stream states of ``count`` rows of one seed: state ``i`` is output ``i + 1`` of
    SplitMix64 seeded with ``seed`` (taken modulo 2^64, so any 64-bit signed seed works).

    Returns:
        ``count`` integers in ``[0, 2^64)``.
    """
    steps = np.arange(1, count + 1, dtype=np.uint64)
    return [int(s) for s in _mix64(np.uint64(seed % 2**64) + steps * _GAMMA)]


def stream_uniforms(states: np.ndarray, draws: np.ndarray) -> torch.Tensor:
    """Draw ``draws[i]`` of stream ``states[i]`` (module docstring) for every row.

    Args:
        states: ``[rows]`` ``uint64`` stream states.
        draws: ``[rows]`` ``uint64`` draw indices (0 for a row's first token).

    Returns:
        ``[rows, 1]`` float32 uniforms in ``[0, 1)``, multiples of ``2^-24`` (exact in float32).
    """
    bits = _mix64(states + (draws + np.uint64(1)) * _GAMMA) >> np.uint64(40)
    return torch.from_numpy((bits.astype(np.float64) * 2.0**-24).astype(np.float32)).unsqueeze(1)


@dataclass(eq=False)
class DecodeRow:
    """One sequence being decoded.

    Attributes:
        prompt_ids: the prompt, token ids (non-empty).
        temperature: ``>= 0`` (``0``: greedy); ``top_p`` in ``(0, 1]``.
        max_tokens: most completion tokens, ``>= 1``.
        stream: the row's random stream state (:func:`row_streams`).
        owner: anything the caller wants back with the row.
        tokens / logprobs: the completion so far and its log-probs (module docstring).
        finished: it ended with ``eos``, or its constraint's grammar is complete (else it is still
            running or hit ``max_tokens``).
        matcher: an llguidance ``LLMatcher`` the completion must satisfy (module docstring);
            ``None``: unconstrained.
        budget: a :class:`~flow_assets.policy.constrained.ClosingBudget` that keeps a
            constrained row able to complete its grammar within ``max_tokens`` (module
            docstring); ``None``: the grammar may be cut by ``max_tokens``. Only with ``matcher``.
        error: why a constrained row was cut short (its matcher refused a token), else ``None``.
    """

    prompt_ids: list[int]
    temperature: float
    top_p: float
    max_tokens: int
    stream: int
    owner: Any = None
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finished: bool = False
    matcher: Any = None
    budget: Any = None
    error: str | None = None


class _RowCache:
    """The keys and values the model writes into, in the layout of the module docstring. It has
    what transformers' attention layers call (``update``); the masks are given explicitly, so
    nothing else of a ``Cache`` is asked for.

    ``whole_steps``: a one-token step gets every column of the buffers, ``[rows, kv_heads,
    capacity, head_dim]``, not only the ``length + 1`` written so far, and its mask covers them all
    (widened in ``RowDecoder._forward``). Why: PyTorch's bfloat16 ``bmm`` on a CPU copies a column-sliced view
    whole before multiplying (50 rows, 1,028 of 1,253 columns, 3 of 9 heads: 13.9 ms a layer
    against 3.6 ms on the contiguous buffer, 2026-11-28), where float32's takes the view as it is;
    the masked columns cost their share of the two matmuls instead. The unwritten columns are
    zeros (finite: a masked key or value still turns its row's output into NaN if it is NaN).
    """

    def __init__(self, layers: int, length: int, capacity: int, keys=None, values=None, whole_steps: bool = False):
        self.keys: list[torch.Tensor | None] = keys or [None] * layers
        self.values: list[torch.Tensor | None] = values or [None] * layers
        self.length = length  # columns written
        self.capacity = capacity
        self.whole_steps = whole_steps

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        """Write ``[rows, kv_heads, q, head_dim]`` at columns ``length .. length + q``; return the
        keys and values of columns ``0 .. length + q`` (of all ``capacity`` columns for a one-token
        step with ``whole_steps``)."""
        if self.keys[layer_idx] is None:
            rows, heads, _, dim = key_states.shape
            self.keys[layer_idx] = key_states.new_zeros((rows, heads, self.capacity, dim))
            self.values[layer_idx] = value_states.new_zeros((rows, heads, self.capacity, value_states.shape[-1]))
        end = self.length + key_states.shape[2]
        keys, values = self.keys[layer_idx], self.values[layer_idx]
        keys[:, :, self.length : end] = key_states
        values[:, :, self.length : end] = value_states
        if self.whole_steps and key_states.shape[2] == 1:
            return keys, values
        return keys[:, :, :end], values[:, :, :end]


def _select_rows(cache: _RowCache, index: torch.Tensor) -> None:
    """Keep only the rows ``index`` of ``cache``, one layer at a time (each layer's old tensor is
    released before the next is copied, so memory peaks one layer above the result)."""
    for tensors in (cache.keys, cache.values):
        for layer, x in enumerate(tensors):
            tensors[layer] = None
            tensors[layer] = x.index_select(0, index)
            del x


#: a prefill's rows are padded to the longest prompt among them; prompts longer than this times
#: the shortest of their bucket are prefilled in a bucket of their own (:func:`length_buckets`)
PREFILL_BUCKET_RATIO = 1.3


def length_buckets(rows: Sequence[DecodeRow], ratio: float) -> list[list[DecodeRow]]:
    """``rows`` in buckets of similar prompt length, shortest first, for separate prefills.

    Why: a prefill pads every prompt to the longest one. Agents whose prompts range from 300 to
    1,100 tokens (BFCL: each task brings its own tools) admitted together would spend most of the
    prefill's matmuls on padding, and its attention (quadratic in the width) more so. Rows with
    the same prompt have the same length and stay in one bucket (prefilled once).

    Args:
        rows: the rows to prefill (any order).
        ratio: a bucket's longest prompt is at most ``ratio`` times its shortest (``>= 1``).

    Returns:
        Every row exactly once, in buckets ordered by prompt length.

    Raises:
        ValueError: ``ratio < 1``.
    """
    if ratio < 1:
        raise ValueError(f"ratio must be >= 1, got {ratio}")
    buckets: list[list[DecodeRow]] = []
    for r in sorted(rows, key=lambda r: len(r.prompt_ids)):
        if buckets and len(r.prompt_ids) <= ratio * len(buckets[-1][0].prompt_ids):
            buckets[-1].append(r)
        else:
            buckets.append([r])
    return buckets


def _additive(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A boolean mask as the additive float mask attention takes (0 where allowed, the dtype's
    minimum elsewhere: a row with nothing allowed gets uniform weights, never NaN)."""
    return torch.zeros(allowed.shape, dtype=dtype).masked_fill_(~allowed, torch.finfo(dtype).min)


#: bytes of prompt-prefix keys and values a :class:`RowDecoder` keeps between admissions (256 MiB:
#: 5,825 token slots of SmolLM2-135M in float32, six copies of a ~900-token few-shot prefix)
PREFIX_CACHE_BYTES = 256 * 2**20


def common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    """Length of the longest common prefix of two 1-D token id arrays."""
    n = min(len(a), len(b))
    differ = np.flatnonzero(a[:n] != b[:n])
    return int(differ[0]) if len(differ) else n


class RowDecoder:
    """A running batch of rows on one model (module docstring). Not thread-safe: one thread adds
    and steps.

    Prefix reuse across admissions: the keys and values of each admission's shared prefix (for a
    lone prompt: all of it but its last token) are kept, least recently used first out, up to
    ``prefix_cache_bytes``; a later admission whose prefix starts with one of them (at least
    :data:`~flow_assets.policy.sampling.MIN_SHARED_PREFIX` tokens) copies those columns and runs
    only the rest through the model. So a few-shot prompt's demonstrations, which every call of an
    agent under that prompt repeats, and an agent's earlier turns, which its next call repeats,
    are computed once, not once per admission (the automatic prefix caching of vLLM, Kwon et al.,
    SOSP 2023, at the granularity of whole prefixes). The keys and values are those of the same
    positions computed in one pass, up to float rounding of the matmul shapes. They depend on the
    weights: a decoder serves one adapter (the batcher makes a new one when it switches).

    Args:
        model: a causal LM (plain or PEFT) whose attention layers take transformers' ``cache``
            interface and a 4-D mask (the Llama family: the tiny model, SmolLM2), in eval mode.
        eos_token_id: the token that ends a completion.
        pad_token_id: the id fed at padding positions (masked).
        prefix_cache_bytes: bytes of prefix keys and values kept between admissions (0: none).
    """

    def __init__(self, model: PreTrainedModel, eos_token_id: int, pad_token_id: int, prefix_cache_bytes: int = PREFIX_CACHE_BYTES):
        self.model = model
        self.eos = eos_token_id
        self.pad = pad_token_id
        param = next(model.parameters())
        self.device, self.dtype = param.device, param.dtype
        # where a one-token step attends over the whole cache (:class:`_RowCache`): bfloat16 on a CPU
        self.whole_steps = self.dtype == torch.bfloat16 and self.device.type == "cpu"
        self.layers = model.config.num_hidden_layers
        self.rows: list[DecodeRow | None] = []
        self.prefill_tokens = 0  # prompt positions run through the model by add() so far, padding included (shared prefixes once)
        self.prefix_reused = 0  # prompt positions whose keys and values came from an earlier admission's prefix
        self.prefix_cache_bytes = prefix_cache_bytes
        self._prefixes: OrderedDict[tuple[int, ...], tuple[np.ndarray, _RowCache]] = OrderedDict()
        self._empty()

    def _empty(self) -> None:
        self.rows = []  # one slot per cache row; None: a row that is done and not yet dropped
        self.live = 0
        self.cache: _RowCache | None = None
        self.valid = torch.zeros((0, 0), dtype=torch.bool)  # [rows, capacity]
        self.last = torch.zeros(0, dtype=torch.long)  # [rows] token fed at the next step
        self.positions = torch.zeros(0, dtype=torch.long)  # [rows] its position
        self.states = np.zeros(0, dtype=np.uint64)  # [rows] stream states
        self.draws = np.zeros(0, dtype=np.uint64)  # [rows] tokens drawn so far
        self._settings(self.rows)

    def _settings(self, rows: Sequence[DecodeRow]) -> None:
        t = torch.tensor([r.temperature for r in rows], dtype=torch.float)
        self.greedy = (t == 0).unsqueeze(1)  # [rows, 1]
        self.scale = torch.where(t == 0, torch.ones_like(t), t).unsqueeze(1)  # [rows, 1]
        self.top_ps = torch.tensor([r.top_p for r in rows], dtype=torch.float).unsqueeze(1)
        self.nucleus = bool((self.top_ps < 1).any())

    @property
    def size(self) -> int:
        """Rows decoding now."""
        return self.live

    @property
    def token_bytes(self) -> int:
        """Bytes of the cache per token slot of a row: keys and values of every layer
        (``2 * layers * kv_heads * head_dim * element size``; 46,080 for SmolLM2-135M in float32)."""
        config = self.model.config
        heads = config.num_attention_heads
        kv_heads = getattr(config, "num_key_value_heads", None) or heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        return 2 * self.layers * kv_heads * head_dim * torch.finfo(self.dtype).bits // 8

    def footprint(self) -> tuple[int, int, int]:
        """What the running batch needs of a merged cache: ``(rows, span, remaining)``, the rows
        still decoding, the columns their tokens span (from the first column any of them uses to
        the last written) and the most completion tokens any of them may still add.

        Adding ``b`` rows of prompts up to ``p`` tokens and caps up to ``m`` tokens makes the
        cache ``(rows + b) * (max(span, p) + max(remaining, m - 1))`` token slots (:meth:`_merge`;
        the first token of a new row comes from its prefill)."""
        if not self.live:
            return 0, 0, 0
        live = [i for i, r in enumerate(self.rows) if r is not None]
        used = self.valid[live, : self.cache.length].any(0).nonzero()
        span = self.cache.length - int(used[0]) if len(used) else 0
        return len(live), span, max(r.max_tokens - len(r.tokens) for r in self.rows if r is not None)

    def _forward(self, ids: torch.Tensor, positions: torch.Tensor, allowed: torch.Tensor, cache: _RowCache) -> torch.Tensor:
        """Logits ``[rows, vocab]`` after the last column of ``ids: [rows, q]``; ``allowed:
        [rows, q, cache.length + q]``."""
        if cache.whole_steps and ids.shape[1] == 1:
            # a one-token pass attends over every column of the cache (:class:`_RowCache`), the
            # ones not written yet masked
            wide = torch.zeros((allowed.shape[0], 1, cache.capacity), dtype=torch.bool)
            wide[:, :, : allowed.shape[2]] = allowed
            allowed = wide
        out = self.model(
            input_ids=ids.to(self.device), position_ids=positions.to(self.device),
            attention_mask=_additive(allowed, self.dtype).unsqueeze(1).to(self.device),
            past_key_values=cache, use_cache=True, logits_to_keep=1,
        )  # fmt: skip
        cache.length += ids.shape[1]
        return out.logits[:, -1].float().cpu()

    def _sample(self, logits: torch.Tensor, greedy, scale, top_ps, nucleus, states, draws, rows) -> tuple[list[int], list[float]]:
        u = stream_uniforms(states, draws)
        constrained = [i for i, r in enumerate(rows) if r is not None and r.matcher is not None]
        if constrained:
            logits, u = self._mask(logits, u, constrained, rows)
        token = draw_tokens(logits, greedy, scale, top_ps, u, nucleus)  # [rows, 1]
        for i in constrained:
            if rows[i].budget is not None:
                self._budget(rows[i], i, logits, token, greedy, scale, top_ps, u, nucleus)
        logp = F.log_softmax(logits / scale, dim=-1).gather(1, token).squeeze(1)
        return token.squeeze(1).tolist(), logp.tolist()

    def _mask(self, logits: torch.Tensor, u: torch.Tensor, constrained: list[int], rows) -> tuple[torch.Tensor, torch.Tensor]:
        """``logits`` with ``-inf`` where the matchers of rows ``constrained`` allow no token (or,
        for a row its budget forces, every token but the forced one), and those rows' uniforms
        at least ``2^-24``: the inverse CDF at ``u = 0`` would pick the first id whatever its
        probability, a masked one included. Other rows are left as they are."""
        from flow_assets.policy.constrained import allowed_tokens

        allowed = torch.from_numpy(allowed_tokens([rows[i].matcher for i in constrained], logits.shape[1]))  # [k, vocab]
        # a matcher in an error state allows nothing: its row may end (eos) rather than sample NaN
        allowed[~allowed.any(dim=1), self.eos] = True
        for k, i in enumerate(constrained):
            r = rows[i]
            if r.budget is not None:
                forced = r.budget.forced(r.matcher, r.max_tokens - len(r.tokens), self.eos)
                if forced is not None:
                    allowed[k] = False
                    allowed[k, forced] = True
        index = torch.tensor(constrained)
        logits, u = logits.clone(), u.clone()
        logits[index] = logits[index].masked_fill(~allowed, -math.inf)
        u[index] = u[index].clamp(min=2.0**-24)
        return logits, u

    def _budget(self, row: DecodeRow, i: int, logits: torch.Tensor, token: torch.Tensor, greedy, scale, top_ps, u, nucleus) -> None:
        """Row ``i``'s drawn token checked by its budget (module docstring): a token after which
        the grammar cannot complete in the tokens left is masked out of ``logits[i]`` and the
        row drawn again from the same uniform, at most ``ClosingBudget.REDRAWS`` times, then
        the budget's next closing token is the only one left. ``logits`` and ``token`` are
        updated in place, so the log-prob is that of the distribution of the last draw."""
        remaining = row.max_tokens - len(row.tokens) - 1  # after this token
        for redraw in range(row.budget.REDRAWS + 1):
            drawn = int(token[i, 0])
            if row.budget.accept(row.matcher, drawn, remaining, self.eos):
                return
            logits[i, drawn] = -math.inf
            if redraw < row.budget.REDRAWS:
                token[i] = draw_tokens(logits[i : i + 1], greedy[i : i + 1], scale[i : i + 1], top_ps[i : i + 1], u[i : i + 1], nucleus)[0]
        forced = row.budget.closing.first(self.eos)
        keep = logits[i, forced].clone()
        logits[i] = -math.inf
        logits[i, forced] = keep
        token[i, 0] = forced
        row.budget.accept(row.matcher, forced, remaining, self.eos)

    def _record(self, row: DecodeRow, token: int, logprob: float) -> bool:
        """Append a sampled token to ``row`` (and feed it to the row's matcher); whether the row is
        done (module docstring)."""
        row.tokens.append(token)
        row.logprobs.append(logprob)
        row.finished = token == self.eos
        if row.matcher is not None:
            # an end drawn from an empty mask (a matcher in an error state) is an error, not an end
            if (not row.finished and not row.matcher.consume_token(token)) or row.matcher.is_error():
                row.error = f"constrained decoding failed: {(row.matcher.get_error() or 'no token allowed').splitlines()[0]}"
                return True
            if not row.finished and row.matcher.is_stopped():
                row.finished = True
                if len(row.tokens) < row.max_tokens:
                    row.tokens.append(self.eos)
                    row.logprobs.append(0.0)  # the only token the mask leaves: probability 1
        return row.finished or len(row.tokens) >= row.max_tokens

    def add(self, rows: Sequence[DecodeRow]) -> list[DecodeRow]:
        """Prefill ``rows`` and draw their first tokens; those not done yet join the batch.

        Returns:
            The rows of ``rows`` already done (``eos`` or ``max_tokens == 1``).

        Raises:
            ValueError: a row with an empty prompt, ``max_tokens < 1``, a negative temperature or
                a ``top_p`` outside ``(0, 1]``.
        """
        for r in rows:
            if not r.prompt_ids or r.max_tokens < 1 or r.temperature < 0 or not 0 < r.top_p <= 1:
                raise ValueError(f"cannot decode a row with {len(r.prompt_ids)} prompt tokens, max_tokens {r.max_tokens}, "
                                 f"temperature {r.temperature}, top_p {r.top_p}")  # fmt: skip
        if not rows:
            return []
        with torch.inference_mode():
            return [r for bucket in length_buckets(rows, PREFILL_BUCKET_RATIO) for r in self._add(bucket)]

    def _add(self, rows: list[DecodeRow]) -> list[DecodeRow]:
        n = len(rows)
        # rows with the same prompt (a request's n choices, a GRPO group's agents, one task in two
        # evaluation modes) are prefilled once: their keys, values and first logits are the same
        first: dict[tuple[int, ...], int] = {}
        owner = [first.setdefault(tuple(r.prompt_ids), len(first)) for r in rows]  # [n] -> unique prompt
        prompts = [list(p) for p in first]
        u = len(prompts)
        shared = shared_prefix_length(prompts)
        shared = shared if shared >= MIN_SHARED_PREFIX else 0
        width = max(len(p) for p in prompts) - shared
        length = shared + width
        # every new row needs max_tokens - 1 columns after its prompt (the first token comes from the prefill)
        capacity = length + max(r.max_tokens for r in rows) - 1
        if shared:
            prefix = self._prefix(prompts[0][:shared])
            keys = [k.new_zeros((u, k.shape[1], capacity, k.shape[3])) for k in prefix.keys]
            values = [v.new_zeros((u, v.shape[1], capacity, v.shape[3])) for v in prefix.values]
            for full, part in zip(keys + values, prefix.keys + prefix.values):
                full[:, :, :shared] = part
            cache = _RowCache(self.layers, shared, capacity, keys, values, self.whole_steps)
        else:
            cache = _RowCache(self.layers, 0, capacity, whole_steps=self.whole_steps)
        ids = torch.full((u, width), self.pad, dtype=torch.long)
        own = torch.zeros((u, width), dtype=torch.bool)  # [u, width] the prompts' own tokens after the prefix
        for i, p in enumerate(prompts):
            ids[i, width - (len(p) - shared) :] = torch.tensor(p[shared:], dtype=torch.long)
            own[i, width - (len(p) - shared) :] = True
        positions = (own.long().cumsum(1) - 1).clamp(min=0) + shared  # [u, width]
        causal = torch.ones((width, width), dtype=torch.bool).tril()  # [q, k]
        allowed = torch.cat([torch.ones((u, width, shared), dtype=torch.bool), causal.unsqueeze(0) & own.unsqueeze(1)], dim=2)
        logits = self._forward(ids, positions, allowed, cache)  # [u, vocab]
        self.prefill_tokens += u * width
        valid = torch.zeros((u, capacity), dtype=torch.bool)
        valid[:, :shared] = True
        valid[:, shared:length] = own
        if u < n:  # one cache row and one logits row per row from here on
            index = torch.tensor(owner)
            _select_rows(cache, index)
            logits, valid = logits.index_select(0, index), valid.index_select(0, index)
        greedy_t = torch.tensor([r.temperature for r in rows], dtype=torch.float)
        scale = torch.where(greedy_t == 0, torch.ones_like(greedy_t), greedy_t).unsqueeze(1)
        top_ps = torch.tensor([r.top_p for r in rows], dtype=torch.float).unsqueeze(1)
        states = np.array([r.stream for r in rows], dtype=np.uint64)
        tokens, logps = self._sample(logits, (greedy_t == 0).unsqueeze(1), scale, top_ps, bool((top_ps < 1).any()), states,
                                     np.zeros(n, dtype=np.uint64), rows)  # fmt: skip
        done, keep = [], []
        for i, (r, token, lp) in enumerate(zip(rows, tokens, logps)):
            if self._record(r, token, lp):
                done.append(r)
            else:
                keep.append(i)
        if keep:
            index = torch.tensor(keep)
            if len(keep) < n:  # rows done at their first token leave before the merge
                _select_rows(cache, index)
            self._merge([rows[i] for i in keep], cache, valid.index_select(0, index), torch.tensor(tokens)[index],
                        torch.tensor([len(rows[i].prompt_ids) for i in keep]), states[keep])  # fmt: skip
        return done

    def _prefix(self, ids: list[int]) -> _RowCache:
        """The keys and values of ``ids`` at positions ``0 .. len - 1`` (one row), reusing the
        longest kept prefix of them (class docstring); kept for later admissions."""
        want = np.asarray(ids, dtype=np.int64)
        reuse, best = 0, None
        for key, (tokens, _) in self._prefixes.items():
            m = common_prefix(tokens, want)
            if m > reuse:
                reuse, best = m, key
        reuse = reuse if reuse >= MIN_SHARED_PREFIX else 0
        cache = _RowCache(self.layers, 0, len(ids))
        if reuse:
            self._prefixes.move_to_end(best)
            kept = self._prefixes[best][1]
            for ours, theirs in ((cache.keys, kept.keys), (cache.values, kept.values)):
                for layer, x in enumerate(theirs):
                    ours[layer] = x.new_zeros((1, x.shape[1], len(ids), x.shape[3]))
                    ours[layer][:, :, :reuse] = x[:, :, :reuse]
            cache.length = reuse
            self.prefix_reused += reuse
        if reuse < len(ids):
            q = len(ids) - reuse
            allowed = torch.cat([torch.ones((1, q, reuse), dtype=torch.bool), torch.ones((1, q, q), dtype=torch.bool).tril()], dim=2)
            self._forward(torch.tensor([ids[reuse:]]), torch.arange(reuse, len(ids)).unsqueeze(0), allowed, cache)
            self.prefill_tokens += q
        self._keep_prefix(tuple(ids), want, cache)
        return cache

    def _keep_prefix(self, key: tuple[int, ...], tokens: np.ndarray, cache: _RowCache) -> None:
        """Keep ``cache`` (the keys and values of ``tokens``, never written again) for later
        admissions; drop the kept prefixes it extends (it serves whatever they served) and the least
        recently used beyond :attr:`prefix_cache_bytes`."""
        size = len(tokens) * self.token_bytes
        if size > self.prefix_cache_bytes:
            return
        for old in [k for k, (t, _) in self._prefixes.items() if len(t) <= len(tokens) and common_prefix(t, tokens) == len(t)]:
            del self._prefixes[old]
        self._prefixes[key] = (tokens, cache)
        total = sum(len(t) for t, _ in self._prefixes.values()) * self.token_bytes
        while total > self.prefix_cache_bytes:
            _, (t, _) = self._prefixes.popitem(last=False)
            total -= len(t) * self.token_bytes

    def _merge(self, rows, cache: _RowCache, valid, last, positions, states) -> None:
        """Join prefilled ``rows`` (their cache right-aligned at ``cache.length``) to the batch.

        The merged cache is built one layer at a time and each layer of the two it comes from is
        released once copied, so memory peaks one layer above the merged cache, not at twice it;
        ``cache`` is consumed. An error part-way (out of memory) leaves the decoder unusable."""
        if not self.live:
            self.rows, self.cache, self.valid, self.last, self.positions = list(rows), cache, valid, last, positions
            self.states, self.draws = states, np.ones(len(rows), dtype=np.uint64)
            self.live = len(rows)
            self._settings(self.rows)
            return
        old = self.cache
        keep = [i for i, r in enumerate(self.rows) if r is not None]  # rows that are done are dropped here
        index = torch.tensor(keep)
        mine = self.valid.index_select(0, index)
        used = mine[:, : old.length].any(0).nonzero()
        start = int(used[0]) if len(used) else old.length  # columns before it: padding for every row
        kept = old.length - start
        length = max(kept, cache.length)
        everyone = [*(self.rows[i] for i in keep), *rows]
        capacity = length + max(r.max_tokens - len(r.tokens) for r in everyone)
        a, b = len(keep), len(rows)
        every = a == len(self.rows)
        keys, values = [], []
        for ours, theirs, out in ((old.keys, cache.keys, keys), (old.values, cache.values, values)):
            for layer in range(len(ours)):
                x, y = ours[layer], theirs[layer]
                ours[layer] = theirs[layer] = None
                # left padding must be finite (a masked NaN key still makes its row's softmax NaN),
                # and so must the columns after ``length`` where a step reads them all (whole_steps)
                z = x.new_empty((a + b, x.shape[1], capacity, x.shape[3]))
                if self.whole_steps:
                    z[:, :, length:] = 0
                part = x[:, :, start : old.length]
                z[:a, :, : length - kept] = 0
                z[:a, :, length - kept : length] = part if every else part.index_select(0, index)
                z[a:, :, : length - cache.length] = 0
                z[a:, :, length - cache.length : length] = y[:, :, : cache.length]
                out.append(z)
                del x, y, part
        merged = torch.zeros((a + b, capacity), dtype=torch.bool)
        merged[:a, length - kept : length] = mine[:, start : old.length]
        merged[a:, length - cache.length : length] = valid[:, : cache.length]
        self.rows, self.cache, self.valid = everyone, _RowCache(self.layers, length, capacity, keys, values, self.whole_steps), merged
        self.last = torch.cat([self.last[index], last])
        self.positions = torch.cat([self.positions[index], positions])
        self.states = np.concatenate([self.states[keep], states])
        self.draws = np.concatenate([self.draws[keep], np.ones(b, dtype=np.uint64)])
        self.live = a + b
        self._settings(self.rows)

    def step(self) -> list[DecodeRow]:
        """Decode one token of every row.

        Returns:
            The rows done after this token (``eos`` or ``max_tokens``); they are no longer decoded
            for (module docstring).
        """
        if not self.live:
            return []
        with torch.inference_mode():
            cache = self.cache
            column = cache.length
            self.valid[:, column] = True
            allowed = self.valid[:, : column + 1].unsqueeze(1)  # [rows, 1, column + 1]
            logits = self._forward(self.last.unsqueeze(1), self.positions.unsqueeze(1), allowed, cache)
            tokens, logps = self._sample(logits, self.greedy, self.scale, self.top_ps, self.nucleus, self.states, self.draws, self.rows)
            self.draws += np.uint64(1)
            self.positions += 1
            self.last = torch.tensor(tokens)
            done = []
            for i, (r, token, lp) in enumerate(zip(self.rows, tokens, logps)):
                if r is None:
                    continue  # done earlier: decoded along until the rows are compacted, never read
                if self._record(r, token, lp):
                    done.append(r)
                    self.rows[i] = None
            self._retire(len(done))
            return done

    def _retire(self, count: int) -> None:
        """``count`` rows were just set to ``None`` in :attr:`rows`: account for them."""
        self.live -= count
        if not self.live:
            self._empty()
        elif count and 4 * (len(self.rows) - self.live) >= len(self.rows):
            # rows that are done leave the cache when they are a quarter of it (or at the next
            # merge): dropping them copies every row's keys and values, decoding them is cheap
            self._keep([i for i, r in enumerate(self.rows) if r is not None])

    def stop(self, rows: Sequence[DecodeRow]) -> list[DecodeRow]:
        """End ``rows`` now (their caller went away): they keep the tokens sampled so far, are
        not ``finished``, and are no longer decoded for. Rows not in the batch are ignored.

        Returns:
            The rows of ``rows`` that were still running.
        """
        wanted = {id(r) for r in rows}
        stopped = []
        for i, r in enumerate(self.rows):
            if r is not None and id(r) in wanted:
                stopped.append(r)
                self.rows[i] = None
        if stopped:
            self._retire(len(stopped))
        return stopped

    def _keep(self, keep: list[int]) -> None:
        index = torch.tensor(keep)
        _select_rows(self.cache, index)
        self.valid = self.valid.index_select(0, index)
        self.last, self.positions = self.last[index], self.positions[index]
        self.states, self.draws = self.states[keep], self.draws[keep]
        self.rows = [self.rows[i] for i in keep]
        self._settings(self.rows)
