"""Dynamic batching: concurrent chat requests share one batched generation on the model.

Requests arrive on the gateway's event loop; one worker thread owns the model. When the worker
is free it takes every request waiting, keeps taking new ones while they keep arriving (none for
``max_wait_ms``) up to ``max_batch_rows`` sequences, then generates them together. So 8 agents
calling at once cost about one batched forward pass per token, not eight, while a lone caller
waits at most ``max_wait_ms`` longer than it would alone.

Requests are generated together when they share what a single ``generate`` call fixes: adapter
and seed. Each brings its own temperature and top_p (applied per row) and its own
``max_tokens``: the group is generated up to the largest and every completion is cut at its own
limit afterwards, which samples exactly what a separate call would (generation is left to right;
what comes after the cut is discarded). Larger batches pay: on 2 CPU cores a decode step of
SmolLM2-135M costs 0.27 s for 32 rows and 0.61 s for 128.

Seeds: a request with a ``seed`` is batched only with requests of the same seed, and that seed
seeds the generation, so it is reproducible for the same batch; requests without one get seeds
from the batcher's own generator (seeded by ``seed``).

Continuous batching. :class:`ContinuousBatcher` (the gateway's batcher on the transformers
backend) does not generate a batch to its end before it starts the next: a call that arrives
while others are decoding joins them at a token boundary (prefilled, then decoded with them, by
:class:`~flow_assets.policy.decode.RowDecoder`), and every completion is answered at the token it
ends on. A multi-turn agent's next call, which comes back a few milliseconds after its tool
result, so no longer waits for a whole generation of the calls that happened to start before it.
Admission is batched a little: waiting calls join once their rows are an eighth of the running
batch's, or after 4 decoding steps (:data:`ADMIT_SHARE`, :data:`ADMIT_AFTER_STEPS`), because
each admission copies the whole running cache; a call to an idle batcher, or to a batch of 8 rows
or fewer, still starts at once. Requests are admitted in arrival order while they use the adapter of the running batch; one for
another adapter waits until the running batch is done (and holds back those behind it, so none
waits forever). Its seeds are per row: choice ``i`` of a request with seed ``s`` draws from its own
random stream (:func:`~flow_assets.policy.decode.row_streams` of ``s``), so a seeded request
samples the same completions whatever it is batched with; requests without a seed get one from
the batcher's generator. A request with a ``constraint`` (``response_format`` / ``tool_choice``)
gives each of its rows its own matcher of it and its own budget (which keeps the row able to
complete the grammar within its ``max_tokens``): those rows sample under the grammar's token mask,
the others as they would without them.

Memory. The running batch's cache holds every row padded to the longest (right-aligned, see
:mod:`~flow_assets.policy.decode`), so it costs ``rows * (longest prompt + largest cap)`` token
slots however short most rows are. ``max_batch_total_tokens`` bounds that product (TGI's setting of
the same name bounds the same padded count): a request that would push the merged cache past it
waits for rows to finish, as one past ``max_batch_rows`` does. Unset, it is what
:data:`DEFAULT_CACHE_BYTES` holds for the model being served. Without it, 416 word-problem agents
on SmolLM2-135M-Instruct (256 rows of ~430 slots, 46 KB each) took the evaluation to 14.4 GB.
"""

from __future__ import annotations

import queue
import threading
from collections import defaultdict, deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from flow_assets.policy.configs import Rollout, SamplingConfig

#: the cache the continuous batcher sizes its batch for when ``max_batch_total_tokens`` is unset,
#: bytes (2 GiB: 46,603 token slots of SmolLM2-135M in float32); merging new rows into the running
#: batch holds about twice it for a moment
DEFAULT_CACHE_BYTES = 2 * 2**30

#: a running batch takes in waiting calls once their rows are at least this share of its own rows,
#: or once the first of them has waited :data:`ADMIT_AFTER_STEPS` decoding steps (or at once when
#: nothing is decoding): each admission copies every running row's cache into the merged one, so
#: admitting each call at the next token made the copies 18% of a busy upstream's time (128
#: word-problem agents on SmolLM2-135M, 2026-11-28)
ADMIT_SHARE = 0.125
ADMIT_AFTER_STEPS = 4

if TYPE_CHECKING:  # torch is imported when the worker starts decoding, not with the gateway's code
    from flow_assets.policy.decode import DecodeRow


@dataclass
class GenerationRequest:
    """One call's sampling work.

    Attributes:
        adapter_path: adapter to sample with.
        prompt_ids: the rendered prompt, token ids.
        n: completions wanted.
        temperature / top_p / max_tokens / seed: sampling settings (``seed`` ``None`` = any).
        future: resolved by the worker with ``list[Rollout]`` (``n`` of them) or an exception.
        on_tokens: ``fn(choice index, new token ids, their log-probs)``, called on the worker
            thread as the tokens of a choice are sampled, before ``future`` resolves (a streamed
            call); the :class:`ContinuousBatcher` calls it after every decoding step, the
            :class:`DynamicBatcher` never (the future's rollouts carry the whole completion).
            It must not block: the worker decodes every running row.
        cancelled: set (from any thread) when the caller no longer wants the completions (its
            client went away): the :class:`ContinuousBatcher` ends the request's rows at the next
            token and resolves ``future`` with what was sampled so far (``finished`` false), so
            the work of a call nobody reads stops occupying the batch; the
            :class:`DynamicBatcher` still runs a request it has started to the end.
        constraint: a :class:`~flow_assets.policy.constrained.Constraint` every completion must
            satisfy (each row decodes with its own matcher of it); ``None``: unconstrained. Only
            the :class:`ContinuousBatcher` enforces it: the :class:`DynamicBatcher` refuses it
            (``ValueError``).
    """

    adapter_path: str
    prompt_ids: list[int]
    n: int
    temperature: float
    top_p: float
    max_tokens: int
    seed: int | None = None
    future: Future = field(default_factory=Future)
    on_tokens: Callable[[int, list[int], list[float]], None] | None = None
    cancelled: bool = False
    constraint: Any = None

    @property
    def group_key(self) -> tuple:
        """What requests must share to be generated in one call."""
        return (self.adapter_path, self.seed)


class DynamicBatcher:
    """A worker thread generating queued :class:`GenerationRequest` s in batches.

    Args:
        generate: ``fn(adapter_path, prompt_ids, SamplingConfig, temperatures, top_ps) ->
            list[Rollout]`` (e.g. :meth:`PolicyEngine.generate`); called only from the worker thread.
        max_batch_rows: most sequences (sum of ``n``) per batch.
        max_wait_ms: how long the worker waits for one more request before it starts a batch.
        seed: seeds the seeds given to requests without one.
    """

    def __init__(self, generate, max_batch_rows: int = 256, max_wait_ms: float = 3.0, seed: int = 0):
        self._generate = generate
        self.max_batch_rows = max_batch_rows
        self.max_wait_s = max_wait_ms / 1000.0
        self._rng = np.random.default_rng(seed)
        self._queue: queue.Queue[GenerationRequest | None] = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="flowopt-batcher", daemon=True)
        self.batches = 0
        self.rows = 0
        self._thread.start()

    def submit(self, request: GenerationRequest) -> Future:
        """Queue ``request``; its ``future`` resolves when its batch is generated (with a
        ``ValueError`` at once for a request with a ``constraint``, which this batcher cannot
        enforce: ``generate`` samples whole batches without a per-token hook)."""
        if request.constraint is not None:
            request.future.set_exception(ValueError("constrained decoding needs the continuous batcher"))
            return request.future
        self._queue.put(request)
        return request.future

    def close(self) -> None:
        """Finish the queued work and stop the worker."""
        self._queue.put(None)
        self._thread.join()

    def _collect(self, first: GenerationRequest) -> tuple[list[GenerationRequest], bool]:
        batch, rows, stop = [first], first.n, False
        while rows < self.max_batch_rows:
            try:
                item = self._queue.get(timeout=self.max_wait_s)
            except queue.Empty:
                break
            if item is None:
                stop = True
                break
            batch.append(item)
            rows += item.n
        return batch, stop

    def _run(self) -> None:
        while True:
            first = self._queue.get()
            if first is None:
                return
            batch, stop = self._collect(first)
            groups: dict[tuple, list[GenerationRequest]] = defaultdict(list)
            for request in batch:
                groups[request.group_key].append(request)
            for requests in groups.values():
                self._generate_group(requests)
            if stop:
                return

    def _generate_group(self, requests: list[GenerationRequest]) -> None:
        first = requests[0]
        seed = first.seed if first.seed is not None else int(self._rng.integers(2**31))
        config = SamplingConfig(
            num_samples=1, max_new_tokens=max(r.max_tokens for r in requests), seed=seed, max_batch_size=self.max_batch_rows
        )
        rows = [r.prompt_ids for r in requests for _ in range(r.n)]
        temperatures = [r.temperature for r in requests for _ in range(r.n)]
        top_ps = [r.top_p for r in requests for _ in range(r.n)]
        self.batches += 1
        self.rows += len(rows)
        try:
            rollouts = self._generate(first.adapter_path, rows, config, temperatures, top_ps)
        except Exception as exc:  # noqa: BLE001 - handed to every caller of the group
            for r in requests:
                r.future.set_exception(exc)
            return
        start = 0
        for r in requests:
            r.future.set_result([_cut(x, r.max_tokens) for x in rollouts[start : start + r.n]])
            start += r.n


def _cut(rollout: Rollout, max_tokens: int) -> Rollout:
    """The rollout as if it had been generated with ``max_new_tokens = max_tokens``."""
    if len(rollout.completion_ids) <= max_tokens:
        return rollout
    return Rollout(
        rollout.prompt_index, rollout.sample_index, rollout.prompt, rollout.prompt_ids,
        rollout.completion_ids[:max_tokens], "", rollout.logprobs[:max_tokens], False, rollout.error,
    )  # fmt: skip


@dataclass(eq=False)
class _Pending:
    """A request being decoded: its rows' results as they finish."""

    request: GenerationRequest
    results: list[Rollout | None]
    left: int
    rows: list[DecodeRow] = field(default_factory=list)  # every row of the request
    reported: list[int] = field(default_factory=list)  # tokens of each row handed to on_tokens


class ContinuousBatcher:
    """A worker thread decoding queued :class:`GenerationRequest` s in one running batch that
    requests join and leave at token boundaries (module docstring).

    Args:
        activate: ``fn(adapter_path) -> model``: the model with that adapter active (e.g.
            :meth:`PolicyEngine.activate`); called only from the worker thread, and only when no
            row is decoding.
        eos_token_id / pad_token_id: the tokenizer's end and padding ids.
        max_positions: the model's context length (prompt + completion), ``None`` for no limit;
            a request beyond it gets error rollouts, as from ``sample_token_ids``.
        max_batch_rows: most sequences decoding at once (sum of ``n``); a request that would pass
            it waits for rows to finish (one larger than it runs alone).
        max_wait_ms: when no row is decoding, how long the worker waits for one more request
            before it starts (later ones join at the next token anyway).
        seed: seeds the seeds given to requests without one.
        max_batch_total_tokens: most token slots of the running batch's cache, padding included
            (rows times the longest prompt plus the largest remaining cap; module docstring); a
            request that would pass it waits for rows to finish (one larger than it runs alone).
            ``None``: :data:`DEFAULT_CACHE_BYTES` over the model's bytes per slot.
    """

    def __init__(
        self,
        activate: Callable,
        eos_token_id: int,
        pad_token_id: int,
        max_positions: int | None = None,
        max_batch_rows: int = 256,
        max_wait_ms: float = 3.0,
        seed: int = 0,
        max_batch_total_tokens: int | None = None,
    ):
        if max_batch_total_tokens is not None and max_batch_total_tokens < 1:
            raise ValueError(f"max_batch_total_tokens must be at least 1, got {max_batch_total_tokens}")
        self._activate = activate
        self.eos_token_id, self.pad_token_id = eos_token_id, pad_token_id
        self.max_positions = max_positions
        self.max_batch_rows = max_batch_rows
        self.max_batch_total_tokens = max_batch_total_tokens
        self.peak_total_tokens = 0  # the largest cache admitted, token slots (padding included)
        self.max_wait_s = max_wait_ms / 1000.0
        self._rng = np.random.default_rng(seed)
        self._queue: queue.Queue[GenerationRequest | None] = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="flowopt-batcher", daemon=True)
        self.batches = 0  # admissions: groups of requests prefilled together
        self.rows = 0  # sequences decoded
        self.steps = 0  # decoding steps (one token of every running row)
        # adapters made active (the first, then one per switch): each switch waits for the running
        # batch to drain, so a workload that alternates adapters call by call shows here
        self.activations = 0
        self._thread.start()

    def submit(self, request: GenerationRequest) -> Future:
        """Queue ``request``; its ``future`` resolves with its ``n`` rollouts when the last of its
        completions ends (``ValueError`` for invalid settings; the model's error if decoding fails)."""
        self._queue.put(request)
        return request.future

    def close(self) -> None:
        """Finish the queued and running work and stop the worker."""
        self._queue.put(None)
        self._thread.join()

    def _take(self, waiting: deque, block: bool) -> bool:
        """Move queued requests to ``waiting``: all that are there, and when ``block``, the next one
        and then more while they keep coming within ``max_wait_s``. Returns whether ``close`` was
        called."""
        timeout = None if block else 0.0
        while True:
            try:
                item = self._queue.get(timeout=timeout) if timeout != 0.0 else self._queue.get_nowait()
            except queue.Empty:
                return False
            if item is None:
                return True
            waiting.append(item)
            if block:
                timeout = self.max_wait_s
                if sum(r.n for r in waiting) >= self.max_batch_rows:
                    block, timeout = False, 0.0

    def _run(self) -> None:
        from flow_assets.policy.decode import RowDecoder

        waiting: deque[GenerationRequest] = deque()
        decoder: RowDecoder | None = None
        adapter: str | None = None
        running: list[_Pending] = []
        stopping = False
        since: int | None = None  # the step at which the oldest waiting call arrived
        while True:
            idle = decoder is None or decoder.size == 0
            if not stopping:
                stopping = self._take(waiting, block=idle and not waiting)
            since = None if not waiting else self.steps if since is None else since
            if idle and not waiting:
                if stopping:
                    return
                continue
            if idle and (decoder is None or waiting[0].adapter_path != adapter):
                adapter, decoder = waiting[0].adapter_path, None
                self.activations += 1
                try:
                    decoder = RowDecoder(self._activate(adapter), self.eos_token_id, self.pad_token_id)
                except Exception as exc:  # noqa: BLE001 - e.g. a missing adapter: its callers get the error
                    while waiting and waiting[0].adapter_path == adapter:
                        request = waiting.popleft()
                        if request.future.set_running_or_notify_cancel():
                            request.future.set_exception(exc)
                    continue
            try:
                if waiting and waiting[0].adapter_path == adapter and self._due(waiting, decoder, since):
                    self._admit(waiting, decoder, running)
                    since = self.steps if waiting else None
                if decoder.size:
                    self.steps += 1
                    done = decoder.step()
                    self._report(running)
                    self._finish(done, running)
                    self._cancel(decoder, running)
            except Exception as exc:  # noqa: BLE001 - handed to every caller whose rows were decoding
                for pending in running:
                    if not pending.request.future.done():
                        pending.request.future.set_exception(exc)
                running.clear()
                decoder = None

    def _due(self, waiting: deque, decoder, since: int) -> bool:
        """Whether the waiting calls join the running batch now (:data:`ADMIT_SHARE`)."""
        if not decoder.size:
            return True
        return sum(r.n for r in waiting) >= ADMIT_SHARE * decoder.size or self.steps - since >= ADMIT_AFTER_STEPS

    def _admit(self, waiting: deque, decoder, running: list[_Pending]) -> None:
        """Prefill the requests at the head of ``waiting`` that use the running adapter and fit."""
        from flow_assets.policy.decode import DecodeRow, row_streams

        rows: list[DecodeRow] = []
        adapter = waiting[0].adapter_path
        limit = self.max_batch_total_tokens or max(1, DEFAULT_CACHE_BYTES // decoder.token_bytes)
        count, span, remaining = decoder.footprint()
        while waiting and waiting[0].adapter_path == adapter:
            request = waiting[0]
            wide, long = max(span, len(request.prompt_ids)), max(remaining, request.max_tokens - 1)
            slots = (count + request.n) * (wide + long)
            if (count + request.n > self.max_batch_rows or slots > limit) and count:
                break
            waiting.popleft()
            if request.cancelled:
                request.future.set_running_or_notify_cancel()
                request.future.set_result([Rollout(0, i, "", list(request.prompt_ids), [], "", [], False) for i in range(request.n)])
                continue
            if not request.future.set_running_or_notify_cancel():
                continue  # the caller went away
            pending = _Pending(request, [None] * request.n, request.n)
            error = self._invalid(request)
            if error is not None:
                if isinstance(error, Exception):
                    request.future.set_exception(error)
                else:
                    request.future.set_result([Rollout(0, i, "", list(request.prompt_ids), [], "", [], False, error) for i in range(request.n)])
                continue
            seed = request.seed if request.seed is not None else int(self._rng.integers(2**63))
            for i, stream in enumerate(row_streams(seed, request.n)):
                constraint = request.constraint
                matcher, budget = (constraint.matcher(), constraint.budget()) if constraint is not None else (None, None)
                rows.append(DecodeRow(list(request.prompt_ids), request.temperature, request.top_p, request.max_tokens, stream,
                                      (pending, i), matcher=matcher, budget=budget))  # fmt: skip
                pending.rows.append(rows[-1])
                pending.reported.append(0)
            running.append(pending)
            count, span, remaining = count + request.n, wide, long
            self.peak_total_tokens = max(self.peak_total_tokens, slots)
        if rows:
            self.batches += 1
            self.rows += len(rows)
            done = decoder.add(rows)
            self._report(running)
            self._finish(done, running)

    def _cancel(self, decoder, running: list[_Pending]) -> None:
        """End the rows of cancelled requests; their futures get the tokens sampled so far."""
        for pending in [p for p in running if p.request.cancelled]:
            self._finish(decoder.stop(pending.rows), running)

    @staticmethod
    def _report(running: list[_Pending]) -> None:
        """Hand the tokens sampled since the last report to the requests that stream them."""
        for pending in running:
            if pending.request.on_tokens is None:
                continue
            for i, row in enumerate(pending.rows):
                if len(row.tokens) > pending.reported[i]:
                    start, pending.reported[i] = pending.reported[i], len(row.tokens)
                    pending.request.on_tokens(i, row.tokens[start:], row.logprobs[start:])

    def _invalid(self, request: GenerationRequest) -> str | Exception | None:
        """Why ``request`` cannot be decoded: a ``ValueError`` for invalid settings (as
        ``sample_token_ids`` raises), an error text for a prompt it cannot sample, else ``None``."""
        if request.n < 1 or request.max_tokens < 1 or request.temperature < 0 or not 0 < request.top_p <= 1:
            return ValueError(f"invalid sampling settings: n {request.n}, max_tokens {request.max_tokens}, "
                              f"temperature {request.temperature}, top_p {request.top_p}")  # fmt: skip
        if not request.prompt_ids:
            return "empty prompt"
        if self.max_positions is not None and len(request.prompt_ids) + request.max_tokens > self.max_positions:
            return (
                f"prompt of {len(request.prompt_ids)} tokens + max_new_tokens {request.max_tokens} exceeds "
                f"the model's {self.max_positions} positions"
            )
        return None

    def _finish(self, done: list[DecodeRow], running: list[_Pending]) -> None:
        """Record finished rows; answer the requests whose rows are all done."""
        import math

        for row in done:
            pending, i = row.owner
            if row.error is not None:
                rollout = Rollout(0, i, "", row.prompt_ids, [], "", [], False, row.error)
            elif all(math.isfinite(x) for x in row.logprobs):
                rollout = Rollout(0, i, "", row.prompt_ids, row.tokens, "", row.logprobs, row.finished)
            else:
                rollout = Rollout(0, i, "", row.prompt_ids, [], "", [], False, "non-finite log-prob")
            pending.results[i] = rollout
            pending.left -= 1
            if pending.left == 0:
                running.remove(pending)
                pending.request.future.set_result(pending.results)
