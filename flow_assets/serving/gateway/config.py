"""A gateway's settings (:class:`GatewayConfig`), apart from the app itself: the code location and
the rounds name them, and this module imports no web framework, so loading the code location does
not import FastAPI, Starlette or uvicorn (with the upstream's httpx, 0.35 s of its 2.1 s load,
2026-11-29)."""

from __future__ import annotations

from dataclasses import dataclass, field

from flow_assets.policy.configs import SERVE_MAX_TOKENS
from flow_assets.serving.gateway.guard import RequestLimits


@dataclass(frozen=True)
class GatewayConfig:
    """Settings of one gateway.

    Attributes:
        max_batch_rows: most sequences generated together (dynamic batching).
        max_wait_ms: how long the batcher waits for one more request, milliseconds.
        default_max_tokens: completion cap when a request sets none (also capped by the context).
        rollout_timeout_s: a rollout idle this long (no call, no finish) lands unlabelled (an error
            when it made no delivered call; :meth:`RolloutRecorder.reap`).
        batch_max_trajectories / batch_flush_seconds: when the rolling batch (rollouts that name
            no batch) closes.
        source: landing sub-directory of the rolling batch.
        reap_every_s: how often idle rollouts and due batches are checked, seconds.
        seed: seeds the sampling seeds of requests that bring none.
        limits: request limits (body size, body read timeout, JSON nesting).
        continuous: on the transformers backend, decode with continuous batching (a call joins
            the running batch at the next token, :class:`~flow_assets.serving.gateway.batcher.ContinuousBatcher`);
            ``False``, or the vLLM backend (which batches continuously itself): the dynamic batcher,
            which generates each batch to its end before it starts the next.
        max_batch_total_tokens: with continuous batching, most token slots of the running batch's
            cache, padding included (:class:`~flow_assets.serving.gateway.batcher.ContinuousBatcher`);
            ``None``: what :data:`~flow_assets.serving.gateway.batcher.DEFAULT_CACHE_BYTES` holds
            for the served model.
    """

    max_batch_rows: int = 256
    max_wait_ms: float = 3.0
    default_max_tokens: int = SERVE_MAX_TOKENS
    rollout_timeout_s: float = 600.0
    batch_max_trajectories: int = 1024
    batch_flush_seconds: float = 300.0
    source: str = "gateway"
    reap_every_s: float = 5.0
    seed: int = 0
    limits: RequestLimits = field(default_factory=RequestLimits)
    continuous: bool = True
    max_batch_total_tokens: int | None = None
