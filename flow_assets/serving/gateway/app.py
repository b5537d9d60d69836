"""The policy gateway: an OpenAI-compatible chat completion server that records every rollout.

Routes (all JSON; errors in OpenAI's shape, never a stack trace):

    GET  /v1/models                         the model names served (policy, champion, candidate, v0...)
    POST /v1/chat/completions               a chat completion (``stream: true``: Server-Sent Events,
                                            :mod:`flow_assets.serving.gateway.streaming`)
    POST /rollouts/{id}/v1/chat/completions the same, captured under rollout ``id`` (for clients
                                            that cannot set the ``X-Agent-ID`` header)
    POST /v1/responses                      the Responses API (stateless), served as a chat completion
                                            (:mod:`flow_assets.serving.gateway.responses_api`)
    POST /rollouts/{id}/v1/responses        the same, captured under rollout ``id``
    POST /v1/messages                       Anthropic's Messages API (streaming too), translated onto
    POST /rollouts/{id}/v1/messages         the chat path: :mod:`flow_assets.serving.gateway.messages_api`
    POST /rollouts                          open one rollout or a list of them (task, batch,
                                            sampling overrides; optional: a call with an unknown
                                            ``X-Agent-ID`` opens one with defaults)
    POST /rollouts/{id}/finish              close it with its outcome; it lands as a trajectory
    POST /batches/{name}/close              land an open batch now (``.tmp`` renamed)
    GET  /health                            counters (the only route that never needs a token)
    GET  /metrics                           Prometheus text: requests, latency, tokens per adapter

Live A/B: while the registry has a challenger, ``model="policy"`` is served by the challenger
for its share of sessions (``X-Session-ID`` header, else the request's ``user``, else the
rollout id; a call with none of them gets the champion) and by the champion otherwise; every
response says which in ``X-Flowopt-Adapter-Version`` and every captured turn records it.

A call is captured when it names a rollout: the path prefix, else ``X-Agent-ID: <id>``, else its
API key (``Authorization: Bearer <key>``): with gateway tokens a key ``<token>:<rollout id>``,
without tokens a key that is the id of a rollout the gateway knows (opened with ``POST /rollouts``;
any other key, such as a client's dummy ``"x"``, names nothing). Each call
is rendered with the policy's chat template, sampled by the batcher (continuous batching), its tool calls are
parsed into OpenAI ``tool_calls``, and what was sampled is recorded as a turn of its rollout
(:mod:`flow_assets.serving.gateway.capture`). A call whose ``tool_choice`` forces a tool call or
whose ``response_format`` asks for JSON is decoded under the matching grammar
(:mod:`flow_assets.policy.constrained`, :meth:`Gateway.constraint`; a 400 naming the field where it
cannot be enforced), and its turn is recorded as constrained.

In front of every route (:mod:`flow_assets.serving.gateway.guard`): bearer tokens when the gateway has
them (a gateway bound beyond loopback must), a body size cap (413), a body read timeout (408) and
a JSON nesting cap (400). Client-visible errors never carry a filesystem path: an unexpected
error is logged with an id and answered with that id only. The chat template is rendered and
tokenised off the event loop, after a cheap length check that refuses (400,
``context_length_exceeded``) messages too long for the context whatever their tokens, so one
large request does not hold up the others.

At start-up the gateway lands the open batches of a gateway that died in its landing directory
(:meth:`~flow_assets.serving.gateway.landing.BatchLander.recover`).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import threading
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jinja2
from fastapi import FastAPI, Header, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from flow_assets.serving.gateway.batcher import ContinuousBatcher, DynamicBatcher, GenerationRequest
from flow_assets.core.untrusted import scrub_paths
from flow_assets.serving.gateway.capture import Choice, RolloutError, RolloutRecorder, RolloutSettings, Turn
from flow_assets.serving.gateway.engine import AdapterRef, AdapterResolver, PolicyEngine, UnknownModelError
from flow_assets.serving.gateway.config import GatewayConfig
from flow_assets.serving.gateway.guard import RequestGuard, bearer_key, check_key
from flow_assets.serving.gateway.landing import BatchLander, RecoveredBatch, check_name
from flow_assets.serving.gateway.protocol import (
    ChatCompletionRequest,
    RolloutFinish,
    RolloutOpen,
    error_body,
    validation_message,
)
from flow_assets.serving.gateway import messages_api, responses_api
from flow_assets.serving.gateway.streaming import ChatStream, ChoiceText, chunk, token_queue
from flow_assets.serving.gateway.upstream import Upstream, UpstreamClient, UpstreamError, fold_chunks, forwarded_body
from flow_assets.logs.schema import Outcome
from flow_assets.policy.chat import render_prompt
from flow_assets.policy.constrained import Constraint, ConstraintCompiler, ConstraintError
from flow_assets.policy.prompt import PROMPT_POLICY_FILE, PromptPolicy, PromptPolicyError, policy_kind
from flow_assets.policy.tool_calls import parse_tool_calls

log = logging.getLogger("flowopt.gateway")


class Gateway:
    """Everything one gateway process holds: the policy, the batcher, open rollouts, open batches.

    Args:
        engine: the policy (base model + adapters); ``None`` in proxy mode.
        resolver: model name -> adapter (in proxy mode: the registry's names; a name it does
            not know is forwarded as it is, :mod:`flow_assets.serving.gateway.upstream`).
        landing: the landing directory finished rollouts go to; the open batches a dead gateway
            left in it land at once (:attr:`recovered`).
        config: settings.
        upstream: proxy mode: forward every chat call to this model server instead of sampling
            a hosted policy (``engine`` must then be ``None``).

    Raises:
        ValueError: both or neither of ``engine`` and ``upstream``.
    """

    def __init__(self, engine: PolicyEngine | None, resolver: AdapterResolver, landing: str | Path, config: GatewayConfig | None = None,
                 upstream: Upstream | None = None):  # fmt: skip
        if (engine is None) == (upstream is None):
            raise ValueError("a gateway serves either a hosted policy (engine) or an upstream model server (upstream), exactly one")
        self.engine = engine
        self.resolver = resolver
        self.config = config or GatewayConfig()
        self.upstream = UpstreamClient(upstream) if upstream is not None else None
        c = self.config
        self.batcher: ContinuousBatcher | DynamicBatcher | None = None  # a proxy samples nothing itself
        if engine is not None and c.continuous and engine.backend == "transformers":
            tok = engine.tokenizer
            self.batcher = ContinuousBatcher(engine.activate, tok.eos_token_id, tok.pad_token_id, engine.max_positions,
                                             c.max_batch_rows, c.max_wait_ms, c.seed, c.max_batch_total_tokens)  # fmt: skip
        elif engine is not None:
            self.batcher = DynamicBatcher(engine.generate, c.max_batch_rows, c.max_wait_ms, c.seed)
        self.recorder = RolloutRecorder(self.config.rollout_timeout_s)
        self.lander = BatchLander(
            landing, self.config.source, self.config.batch_max_trajectories, self.config.batch_flush_seconds
        )
        self.calls = 0
        self.recovered: list[RecoveredBatch] = self.lander.recover()
        # a token never covers more characters than the longest vocabulary entry: a prompt with more
        # than context * that many characters cannot fit, whatever its tokens (checked before tokenising)
        vocab = engine.tokenizer.get_vocab() if engine is not None else {}
        self.max_token_chars = max((len(t) for t in vocab), default=1) or 1
        self._compiler: ConstraintCompiler | None = None
        self._compiler_lock = threading.Lock()
        self._prompts: dict[str, PromptPolicy] = {}
        self._kinds: dict[str, str] = {}  # version directory -> policy_kind
        self._prompts_lock = threading.Lock()

    def prompt_policy(self, ref: AdapterRef) -> PromptPolicy | None:
        """The prompt policy a resolved name is served under (:mod:`flow_assets.policy.prompt`),
        loaded once per directory (registered versions do not change).

        Proxy mode: a version that is a prompt policy alone; ``None`` for a name the registry does
        not know (forwarded as it is). Hosting: the prompt policy of a version whose directory
        holds an adapter and ``prompt_policy.json``; ``None`` for an adapter alone (or the base).

        Raises:
            PromptPolicyError: proxy mode and a version holding a LoRA adapter (it needs a gateway
                that hosts the model); hosting and a prompt policy without an adapter (it needs an
                upstream model: ``flowopt serve --upstream``); or a policy file that is invalid.
        """
        if not ref.path:
            return None
        if (kind := self._kinds.get(ref.path)) is None:  # once per directory: no file checks on every call
            kind = self._kinds[ref.path] = policy_kind(ref.path)
        if self.upstream is not None and kind != "prompt":
            raise PromptPolicyError(f"{ref.version} is not a prompt policy alone (no {PROMPT_POLICY_FILE} in its directory, or a LoRA "
                                    "adapter beside it); a LoRA adapter needs a gateway that hosts the model")  # fmt: skip
        if self.upstream is None and kind != "adapter+prompt":
            if kind == "prompt":
                raise PromptPolicyError(f"{ref.version} is a prompt policy without a LoRA adapter: serve it in front of its model "
                                        "with `flowopt serve --upstream URL`")  # fmt: skip
            return None
        with self._prompts_lock:
            if ref.path not in self._prompts:
                self._prompts[ref.path] = PromptPolicy.load(ref.path)
            return self._prompts[ref.path]

    def close(self) -> None:
        """Stop the batcher's worker (a proxy has none; its HTTP client closes with the app)."""
        if self.batcher is not None:
            self.batcher.close()

    def constraint(self, req: ChatCompletionRequest, tools: list[dict[str, Any]] | None) -> Constraint | None:
        """The constraint of a call's ``response_format`` / ``tool_choice`` (``None``: none), built
        with the policy's tokenizer and tool-call syntax (:mod:`flow_assets.policy.constrained`;
        the first call builds llguidance's view of the tokenizer, up to a second for a large
        vocabulary: call it off the event loop).

        Raises:
            ConstraintError: ``param`` names the field: a ``response_format`` together with a
                ``tool_choice`` that forces a call, a backend without per-token decoding (vLLM,
                the dynamic batcher), or a grammar that cannot be enforced (the compiler's errors).
        """
        forces_call, formats = req.forces_call, req.formats
        if not (forces_call or formats):
            return None
        param = "tool_choice" if forces_call else "response_format"
        if forces_call and formats:
            raise ConstraintError("response_format cannot be enforced together with a tool_choice that forces a tool call", "response_format")
        if not isinstance(self.batcher, ContinuousBatcher):
            raise ConstraintError(
                f"{param} is not enforced on this gateway's backend (only the transformers backend with continuous "
                "batching decodes with a constraint)", param,
            )  # fmt: skip
        with self._compiler_lock:
            if self._compiler is None:
                vocab = getattr(self.engine.config, "vocab_size", None) or len(self.engine.tokenizer)
                self._compiler = ConstraintCompiler(self.engine.tokenizer, vocab, self.engine.chat.tool_calls)
        if forces_call:
            return self._compiler.tool_choice(req.tool_choice, tools, req.parallel_tool_calls is not False)
        return self._compiler.response_format(req.response_format)

    def land(self, trajectory, settings: RolloutSettings) -> str | None:
        """Hand a finished rollout to its batch (unless it must not land); returns the batch."""
        if not settings.land:
            return None
        return self.lander.add(trajectory, settings.batch, settings.source)

    def housekeeping(self, everything: bool = False) -> None:
        """Land idle rollouts as errors and close due batches (everything, when stopping)."""
        for trajectory, settings in self.recorder.reap(everything=everything):
            self.land(trajectory, settings)
        if everything:
            self.lander.close_all()
        else:
            self.lander.close_due()


@dataclass
class _Call:
    """One chat completion call on its way through the gateway: the request, what it resolved to,
    and (once rendered) its prompt ids and sampling work."""

    req: ChatCompletionRequest
    rollout_id: str | None
    started: float  # perf_counter seconds
    name: str
    ref: AdapterRef
    temperature: float
    top_p: float
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None
    chars: int | None  # non-whitespace characters to render (None: the model has no context limit)
    prompt_ids: list[int] = field(default_factory=list)
    work: GenerationRequest | None = None
    constraint: Constraint | None = None
    upstream_model: str | None = None  # proxy mode: the model that answered (text-only turn)
    usage: dict[str, int] | None = None  # proxy mode: the upstream's token counts
    # the messages and tools the model is shown: the agent's under the version's prompt policy
    # (None: the agent's own); the turn records the agent's, the ids what the model saw
    sent_messages: list[dict[str, Any]] | None = None
    sent_tools: list[dict[str, Any]] | None = None

    def rendered(self) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
        """The messages and tools the policy's chat template renders for this call."""
        return (self.messages, self.tools) if self.sent_messages is None else (self.sent_messages, self.sent_tools)


#: the response header naming the registry version that served (or refused) a call
VERSION_HEADER = "X-Flowopt-Adapter-Version"


def _error(status: int, message: str, kind: str = "invalid_request_error", param: str | None = None, code: str | None = None):
    return JSONResponse(error_body(scrub_paths(message), kind, param, code), status_code=status)


async def _client_gone(request: Request) -> None:
    """Returns when the client of ``request`` disconnects (its body has been read, so the next
    ASGI message is the disconnect)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _versioned(response: JSONResponse, version: str) -> JSONResponse:
    """An error answer of a call the registry version ``version`` was serving: its header names
    the version, as a success's does, and the rollout records the failure as that version's."""
    response.headers[VERSION_HEADER] = version
    return response


def _error_message(response: JSONResponse) -> str:
    try:
        body = json.loads(response.body)
    except ValueError:
        return response.body.decode(errors="replace")[:500]
    error = body.get("error", body) if isinstance(body, dict) else body
    return str(error.get("message", error) if isinstance(error, dict) else error)


#: prompts of at most this many non-whitespace characters render on the event loop (well under a
#: millisecond each); longer ones in a worker thread
INLINE_RENDER_CHARS = 32_000


def _whitespace_free_chars(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> int:
    """Characters other than ASCII whitespace in what a request asks to render (some tokenisers
    drop whitespace; no tokeniser drops other characters)."""
    total = 0
    for text in _strings(messages) + _strings(tools or []):
        total += len(text) - sum(text.count(c) for c in " \t\n\r\f\v")
    return total


def _strings(value: Any) -> list[str]:
    found, stack = [], [value]
    while stack:  # iterative: the guard caps nesting, this stays cheap and recursion-free anyway
        item = stack.pop()
        if isinstance(item, str):
            found.append(item)
        elif isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return found


def _cut_at_stop(tokenizer, ids: list[int], logprobs: list[float], text: str, stops: list[str] | None):
    """Cut a completion at the first stop string: ``(ids, logprobs, text, stop)``, ``stop`` the
    stop string that cut it (``None``: none did). The ids keep the token that completed the stop
    string (it was sampled); the text ends before it."""
    hits = [(text.find(s), s) for s in stops or () if s in text]
    if not hits:
        return ids, logprobs, text, None
    pos, stop = min(hits)
    for k in range(1, len(ids) + 1):
        if len(tokenizer.decode(ids[:k], skip_special_tokens=True)) >= pos + len(stop):
            return ids[:k], logprobs[:k], text[:pos], stop
    return ids, logprobs, text[:pos], stop


def _logprobs_payload(tokenizer, ids: list[int], logprobs: list[float]) -> dict:
    content = []
    for token_id, lp in zip(ids, logprobs):
        token = tokenizer.decode([token_id])
        content.append({"token": token, "logprob": lp, "bytes": list(token.encode("utf-8")), "top_logprobs": []})
    return {"content": content}


#: the adapter version a proxied turn records (no hosted adapter answered it)
UPSTREAM_VERSION = "upstream"


def _upstream_choice(message: dict[str, Any], finish_reason: str | None) -> Choice:
    """A captured choice of an upstream's answer: text only (no ids, no log-probs;
    :mod:`flow_assets.serving.gateway.upstream`); tool call arguments kept as the JSON text sent."""
    calls = []
    for c in message.get("tool_calls") or ():
        function = c.get("function") or {}
        arguments = function.get("arguments", "{}")
        calls.append({"id": c.get("id") or f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                      "function": {"name": function.get("name", ""),
                                   "arguments": arguments if isinstance(arguments, str) else json.dumps(arguments)}})  # fmt: skip
    content = message.get("content")
    content = content if isinstance(content, str) else None
    return Choice([], [], content or "", content, calls, finish_reason or ("tool_calls" if calls else "stop"))


class _Metrics:
    """ASGI middleware counting requests and their latency per route template and status (a
    plain ASGI callable: Starlette's ``@app.middleware("http")`` runs every request through an
    extra task and memory streams, a fixed cost per call on the gateway's event loop)."""

    def __init__(self, app, requests_total: Counter, latency: Histogram):
        self.app, self.requests_total, self.latency = app, requests_total, latency

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started, status = time.perf_counter(), 500

        async def sending(message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, sending)
        finally:
            path = getattr(scope.get("route"), "path", "(unmatched)")  # the router sets it on this scope
            self.requests_total.labels(path, str(status)).inc()
            self.latency.labels(path).observe(time.perf_counter() - started)


def create_app(gateway: Gateway, tokens: Sequence[str] = ()) -> FastAPI:
    """The FastAPI application serving ``gateway`` (module docstring); ``tokens``: the bearer
    tokens every route but ``/health`` asks for (none: no token asked, for loopback only)."""

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        async def reaper():
            while True:
                await asyncio.sleep(gateway.config.reap_every_s)
                gateway.housekeeping()

        task = asyncio.create_task(reaper())
        try:
            yield
        finally:
            task.cancel()
            gateway.housekeeping(everything=True)
            if gateway.upstream is not None:
                await gateway.upstream.aclose()

    app = FastAPI(title="flowopt policy gateway", lifespan=lifespan)
    app.state.gateway = gateway
    app.add_middleware(RequestGuard, tokens=tuple(tokens), limits=gateway.config.limits)
    tokenizer = gateway.engine.tokenizer if gateway.engine is not None else None
    metrics = CollectorRegistry()  # per app: two gateways in one process count apart
    requests_total = Counter("flowopt_gateway_requests", "HTTP requests by route and status", ["route", "status"], registry=metrics)
    latency = Histogram("flowopt_gateway_request_seconds", "HTTP request latency by route, seconds", ["route"], registry=metrics,
                        buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30))  # fmt: skip
    tokens_served = Counter("flowopt_gateway_tokens", "tokens served by kind (prompt, completion) and adapter version", ["kind", "adapter"], registry=metrics)
    cancelled_total = Counter("flowopt_gateway_cancelled", "generations cancelled because their client went away, by mode",
                              ["mode"], registry=metrics)  # fmt: skip

    app.add_middleware(_Metrics, requests_total=requests_total, latency=latency)

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        return Response(generate_latest(metrics), media_type=CONTENT_TYPE_LATEST)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError):
        errors = exc.errors()
        if any(e.get("type") == "json_invalid" for e in errors) or (
            len(errors) == 1 and tuple(errors[0].get("loc", ())) == ("body",)
        ):
            return _error(400, "We could not parse the JSON body of your request.", code="invalid_json")
        message, param = validation_message(exc)
        return _error(400, message, param=param)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException):
        kind = "invalid_request_error" if exc.status_code < 500 else "server_error"
        return _error(exc.status_code, str(exc.detail), kind)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception):
        # the details (paths, library internals) go to the log; the client gets an id to quote
        error_id = uuid.uuid4().hex[:12]
        log.exception("gateway error %s on %s %s", error_id, request.method, request.url.path)
        return _error(500, f"internal error {error_id} ({type(exc).__name__}); the gateway's log has the details", "server_error")

    @app.get("/health")
    async def health() -> dict:
        return {
            "status": "ok",
            "calls": gateway.calls,
            "open_rollouts": gateway.recorder.open_count,
            "open_batches": gateway.lander.open_batches(),
            # relative to the landing directory: where the server keeps its files is not the client's business
            "landed_batches": [str(p.relative_to(gateway.lander.directory)) for p in gateway.lander.landed],
            "recovered_batches": [
                {"batch": str(r.path.relative_to(gateway.lander.directory)), "rollouts": r.rollouts, "torn_bytes": r.torn_bytes}
                for r in gateway.recovered
            ],
            "generation_batches": gateway.batcher.batches if gateway.batcher else 0,
            "generated_sequences": gateway.batcher.rows if gateway.batcher else 0,
            **({"upstream_model": gateway.upstream.upstream.model} if gateway.upstream else {}),
        }

    @app.get("/v1/models")
    @app.get("/rollouts/{rollout_id}/v1/models")
    async def models(rollout_id: str | None = None) -> dict:
        data = []
        for name in gateway.resolver.names():
            ref = gateway.resolver.resolve(name)
            data.append({"id": name, "object": "model", "created": 0, "owned_by": "flowopt", "root": ref.version})
        if gateway.upstream is not None and gateway.upstream.upstream.model:
            data.append({"id": gateway.upstream.upstream.model, "object": "model", "created": 0, "owned_by": "upstream",
                         "root": UPSTREAM_VERSION})  # fmt: skip
        return {"object": "list", "data": data}

    live_tokens = tuple(t for t in tokens if t)

    def key_rollout(authorization: str | None) -> str | None:
        """The rollout an API key names (``<token>:<rollout id>`` with tokens; without, a key that
        is the id of a rollout the gateway knows), else ``None``."""
        _, rollout = check_key(bearer_key(authorization), live_tokens)
        if rollout is None or not (live_tokens or gateway.recorder.known(rollout)):
            return None
        return rollout

    @app.post("/v1/chat/completions")
    async def chat(
        body: ChatCompletionRequest,
        request: Request,
        x_agent_id: str | None = Header(None),
        x_session_id: str | None = Header(None),
        authorization: str | None = Header(None),
    ):
        return await _chat(body, x_agent_id or key_rollout(authorization), x_session_id, request)

    @app.post("/rollouts/{rollout_id}/v1/chat/completions")
    async def chat_in_rollout(rollout_id: str, body: ChatCompletionRequest, request: Request, x_session_id: str | None = Header(None)):
        return await _chat(body, rollout_id, x_session_id, request)

    async def _chat(req: ChatCompletionRequest, rollout_id: str | None, session: str | None = None, request: Request | None = None):
        """Serve one chat call (a JSONResponse, or a ChatStream for ``stream``); ``request``, when
        given, is watched for the client going away (its generation is then cancelled)."""
        if not rollout_id:
            return await _serve_call(req, None, None, session, request)
        try:
            # the call is activity from its start: a generation longer than the rollout timeout
            # must not see its rollout reaped under it
            settings, seed = gateway.recorder.begin_call(rollout_id)
        except RolloutError as exc:
            return _error(409, str(exc), param="X-Agent-ID", code="rollout_finished")
        if seed is not None and not isinstance(gateway.batcher, DynamicBatcher):
            # a seeded rollout's calls sample with its seeds, as its temperature is imposed: the
            # same agent on the same task samples the same completions, whatever it is batched with.
            # The dynamic batcher (vLLM) batches only calls of one seed: every call seeded apart
            # would be generated alone, so there the batcher's seeds stay
            req = req.model_copy(update={"seed": seed})
        response = None
        try:
            response = await _serve_call(req, rollout_id, settings, session, request)
            if isinstance(response, JSONResponse) and response.status_code >= 400 and (version := response.headers.get(VERSION_HEADER)):
                gateway.recorder.record_failure(rollout_id, version, response.status_code, _error_message(response))
            return response
        finally:
            if not isinstance(response, ChatStream):  # a stream ends the call when it is over
                gateway.recorder.call_ended(rollout_id)

    responses_api.add_routes(app, _chat, key_rollout)
    # Anthropic's Messages API, translated onto the chat path (same capture)
    messages_api.add_routes(app, _chat, key_rollout)

    def _prepare(req: ChatCompletionRequest, rollout_id: str | None, settings: RolloutSettings | None, session: str | None):
        """The call's rendered prompt and sampling work, or the error response that refuses it."""
        started = time.perf_counter()
        name = settings.model if settings and settings.model else req.model
        try:
            # the live A/B's unit is the session: X-Session-ID, else OpenAI's `user`, else the
            # rollout, so every turn of one conversation is served by the same adapter
            ref = gateway.resolver.resolve(name, session or req.user or rollout_id)
        except UnknownModelError as exc:
            return _error(404, str(exc), param="model", code="model_not_found")
        temperature = settings.temperature if settings and settings.temperature is not None else req.temperature
        top_p = settings.top_p if settings and settings.top_p is not None else req.top_p
        temperature = 1.0 if temperature is None else temperature
        top_p = 1.0 if top_p is None else top_p
        messages = [m.model_dump(exclude_none=True) for m in req.messages]
        tools = [t.model_dump(exclude_none=True) for t in req.tools] if req.tools else None
        try:
            prompt = gateway.prompt_policy(ref)
        except (OSError, PromptPolicyError) as exc:
            return _versioned(_error(400, f"model {name!r} resolves to {ref.version}, which this gateway cannot serve: {exc}", param="model"),
                              ref.version)  # fmt: skip
        shown = prompt.apply(messages, tools) if prompt else (messages, tools)
        context = gateway.engine.max_positions
        if context is not None and (chars := _whitespace_free_chars(*shown)) > 4 * gateway.max_token_chars * context:
            # refused before tokenising (seconds of CPU for megabytes of text): more characters than
            # the context can hold even at the longest token, with a 4x margin for normalisers
            return _versioned(_error(
                400,
                f"This model's maximum context length is {context} tokens. However, your messages hold {chars} "
                f"characters, more than {context} tokens can cover.",
                param="messages",
                code="context_length_exceeded",
            ), ref.version)  # fmt: skip
        return _Call(req, rollout_id, started, name, ref, temperature, top_p, messages, tools, chars if context is not None else None,
                     sent_messages=shown[0] if prompt else None, sent_tools=shown[1] if prompt else None)  # fmt: skip

    async def _render(call: _Call):
        """Render and tokenise the call's prompt and build its sampling work (or an error response)."""
        req, context = call.req, gateway.engine.max_positions
        if req.forces_call or req.formats:
            try:
                # compiling a grammar (and, once, reading the tokenizer) takes milliseconds to a second
                call.constraint = await asyncio.to_thread(gateway.constraint, req, call.rendered()[1])
            except ConstraintError as exc:
                return _error(400, str(exc), param=exc.param)
        render = functools.partial(render_prompt, tokenizer, *call.rendered(), fmt=gateway.engine.chat)
        try:
            # A large prompt renders off the event loop, so it cannot stall other clients. An ordinary
            # one renders in it: a thread hop per call spread concurrent agents' calls past the
            # batcher's wait and halved its batches (6 instead of 8 sequences per generate call
            # with 8 agents, 18 instead of 36 with 64), which made a demo's collection ~3x slower.
            if call.chars is None or call.chars > INLINE_RENDER_CHARS:
                _, prompt_ids = await asyncio.to_thread(render)
            else:
                _, prompt_ids = render()
        except (jinja2.TemplateError, ValueError, TypeError) as exc:
            return _error(400, f"the messages cannot be rendered with the policy's chat template: {exc}", param="messages")
        requested = req.max_completion_tokens or req.max_tokens
        max_tokens = requested or gateway.config.default_max_tokens
        if context is not None:
            if requested is None:
                max_tokens = min(max_tokens, context - len(prompt_ids))
            if max_tokens < 1 or len(prompt_ids) + max_tokens > context:
                return _error(
                    400,
                    f"This model's maximum context length is {context} tokens. However, you requested "
                    f"{len(prompt_ids) + max(max_tokens, 1)} tokens ({len(prompt_ids)} in the messages, "
                    f"{max(max_tokens, 1)} in the completion).",
                    param="messages",
                    code="context_length_exceeded",
                )
        call.prompt_ids = prompt_ids
        call.work = GenerationRequest(call.ref.path, prompt_ids, req.n, call.temperature, call.top_p, max_tokens, req.seed,
                                      constraint=call.constraint)  # fmt: skip
        return None

    def _choices(call: _Call, rollouts) -> tuple[list[Choice], list[dict[str, Any]]]:
        """The sampled rollouts as captured choices and OpenAI ``choices`` (cut at stop strings,
        tool calls parsed): the same for a streamed and a non-streamed call."""
        req = call.req
        choices, out_choices = [], []
        for index, rollout in enumerate(rollouts):
            text = tokenizer.decode(rollout.completion_ids, skip_special_tokens=True)
            ids, lps, text, stop = _cut_at_stop(tokenizer, rollout.completion_ids, rollout.logprobs, text, req.stop)
            parsed = parse_tool_calls(text, gateway.engine.chat.tool_calls, None if req.tool_choice == "none" else call.tools)
            calls = [
                {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                for c in parsed.tool_calls
            ]
            reason = "tool_calls" if calls else ("stop" if rollout.finished or stop else "length")
            if parsed.error:
                log.info("rollout %s: tool call not parsed (%s); returned as text", call.rollout_id or "-", parsed.error)
            choices.append(Choice(ids, lps, text, parsed.content, calls, reason, parsed.error,
                                  call.constraint.kind if call.constraint else None))  # fmt: skip
            message: dict[str, Any] = {"role": "assistant", "content": parsed.content if calls else text}
            if calls:
                message["tool_calls"] = calls
            out_choices.append(
                {
                    "index": index,
                    "message": message,
                    "logprobs": _logprobs_payload(tokenizer, ids, lps) if req.logprobs else None,
                    "finish_reason": reason,
                    # vLLM's field: the stop string that ended the choice (the Messages API's stop_sequence)
                    "stop_reason": stop,
                }
            )
        return choices, out_choices

    def _served(call: _Call, choices: list[Choice], delivered: bool = True) -> JSONResponse | None:
        """Count the call and record its turn (a 409 response when its rollout finished meanwhile)."""
        latency_ms = (time.perf_counter() - call.started) * 1000.0
        gateway.calls += 1
        turn = Turn(call.messages, call.prompt_ids, choices, call.name, call.ref.version, call.temperature, call.top_p,
                    latency_ms, delivered, call.upstream_model, call.usage)  # fmt: skip
        tokens_served.labels("prompt", call.ref.version).inc(turn.token_count("prompt"))
        tokens_served.labels("completion", call.ref.version).inc(turn.token_count("completion"))
        if call.rollout_id:
            try:
                gateway.recorder.record(call.rollout_id, turn)
            except RolloutError as exc:
                return _error(409, str(exc), param="X-Agent-ID", code="rollout_finished")
        return None

    def _usage(call: _Call, choices: list[Choice]) -> dict[str, int]:
        completion_tokens = sum(len(c.completion_ids) for c in choices)
        return {"prompt_tokens": len(call.prompt_ids), "completion_tokens": completion_tokens,
                "total_tokens": len(call.prompt_ids) + completion_tokens}  # fmt: skip

    async def _generated(call: _Call, request: Request | None) -> tuple[list, bool]:
        """The call's rollouts, and whether its client is still there. A client that goes away
        while its completion is sampled (a timeout, a retry) cancels the generation: the batch
        stops decoding for nobody, and the retry does not queue behind its abandoned twin."""
        future = asyncio.wrap_future(gateway.batcher.submit(call.work))
        if request is None:
            return await future, True
        watcher = asyncio.ensure_future(_client_gone(request))
        try:
            await asyncio.wait((future, watcher), return_when=asyncio.FIRST_COMPLETED)
            if not future.done() and watcher.done() and watcher.exception() is None:
                call.work.cancelled = True
                cancelled_total.labels("plain").inc()
                return await future, False
            return await future, True
        finally:
            watcher.cancel()

    async def _serve_call(req: ChatCompletionRequest, rollout_id: str | None, settings: RolloutSettings | None, session: str | None,
                          request: Request | None = None):  # fmt: skip
        if gateway.upstream is not None:
            return await _proxy(req, rollout_id, settings, session, request)
        call = _prepare(req, rollout_id, settings, session)
        if isinstance(call, JSONResponse):
            return call
        if (refused := await _render(call)) is not None:
            return _versioned(refused, call.ref.version)
        if req.stream:
            return await _stream(call)
        rollouts, connected = await _generated(call, request)
        failed = next((r.error for r in rollouts if r.error), None)
        if failed:
            return _versioned(_error(400, failed, param="messages"), call.ref.version)
        choices, out_choices = _choices(call, rollouts)
        if not connected:
            # recorded as not delivered (never trained); the answer below goes nowhere
            _served(call, choices, delivered=False)
            return _error(499, "the client closed the request before its completion was ready", code="client_closed_request")
        if (conflict := _served(call, choices)) is not None:
            return conflict
        return JSONResponse(
            {
                "id": f"chatcmpl-{uuid.uuid4().hex}",
                "object": "chat.completion",
                "created": int(time.time()),
                "model": call.name,
                "system_fingerprint": call.ref.version,
                "choices": out_choices,
                "usage": _usage(call, choices),
            },
            headers={"X-Flowopt-Adapter-Version": call.ref.version},
        )

    async def _proxy(req: ChatCompletionRequest, rollout_id: str | None, settings: RolloutSettings | None, session: str | None,
                     request: Request | None = None):  # fmt: skip
        """Proxy mode: apply the prompt policy the model name resolves to (none for a name the
        registry does not know), forward the call to the upstream and capture its answer as a
        text-only turn of the messages the agent sent (:mod:`flow_assets.serving.gateway.upstream`).
        A client that leaves before a non-streamed answer came cancels the upstream call (its
        connection closed, so the upstream can stop generating); nothing is recorded for it."""
        client = gateway.upstream
        name = settings.model if settings and settings.model else req.model
        try:
            # the live A/B's unit is the session, as for adapters (_prepare)
            ref = gateway.resolver.resolve(name, session or req.user or rollout_id)
        except UnknownModelError:
            ref = AdapterRef(UPSTREAM_VERSION, "")
        try:
            prompt = gateway.prompt_policy(ref)
        except (OSError, PromptPolicyError) as exc:
            return _versioned(_error(400, f"model {name!r} resolves to {ref.version}, which this gateway cannot apply: {exc}", param="model"),
                              ref.version)  # fmt: skip
        t_override = settings.temperature if settings else None
        p_override = settings.top_p if settings else None
        messages = [m.model_dump(exclude_none=True) for m in req.messages]
        tools = [t.model_dump(exclude_none=True) for t in req.tools] if req.tools else None
        sent_messages, sent_tools = prompt.apply(messages, tools) if prompt else (messages, tools)
        body = forwarded_body(req.model_dump(exclude_unset=True, exclude_none=True), client.upstream.model or name, sent_messages, sent_tools,
                              t_override, p_override)  # fmt: skip
        temperature, top_p = body.get("temperature", 1.0), body.get("top_p", 1.0)
        call = _Call(req, rollout_id, time.perf_counter(), name, ref, temperature, top_p, messages, tools,
                     None, upstream_model=body["model"])  # fmt: skip
        if req.stream:
            return await _proxy_stream(call, body)
        answer = asyncio.ensure_future(client.complete(body))
        if request is not None:
            watcher = asyncio.ensure_future(_client_gone(request))
            try:
                await asyncio.wait((answer, watcher), return_when=asyncio.FIRST_COMPLETED)
                if not answer.done():
                    answer.cancel()
                    cancelled_total.labels("plain").inc()
                    with contextlib.suppress(asyncio.CancelledError, UpstreamError):
                        await answer
                    return _error(499, "the client closed the request before the upstream answered", code="client_closed_request")
            finally:
                watcher.cancel()
        try:
            data = await answer
        except UpstreamError as exc:
            return _versioned(JSONResponse(exc.body, status_code=exc.status), call.ref.version)
        call.upstream_model, call.usage = data.get("model") or body["model"], data.get("usage")
        ordered = sorted(data["choices"], key=lambda c: c.get("index", 0))
        choices = [_upstream_choice(c.get("message") or {}, c.get("finish_reason")) for c in ordered]
        if (conflict := _served(call, choices)) is not None:
            return conflict
        return JSONResponse(data, headers={"X-Flowopt-Adapter-Version": call.ref.version})

    async def _proxy_stream(call: _Call, body: dict[str, Any]):
        """A streamed proxy call: the upstream's chunks relayed as they come. The chunks that end
        a choice (a ``finish_reason``) and the usage chunk are held back until the turn is recorded,
        as a hosted stream records its turn before its finish chunks."""
        upstream = gateway.upstream.stream(body)
        try:
            first = await anext(upstream, None)
        except UpstreamError as exc:
            return _versioned(JSONResponse(exc.body, status_code=exc.status), call.ref.version)
        include_usage = bool(call.req.stream_options and call.req.stream_options.include_usage)
        state: dict[str, Any] = {"recorded": False, "chunks": []}

        def folded() -> list[Choice]:
            choices, usage = fold_chunks(state["chunks"])
            call.usage = usage
            return [_upstream_choice(c.message(), c.finish_reason) for _, c in sorted(choices.items())]

        async def events():
            held: list[dict[str, Any]] = []
            item = first
            try:
                while item is not None:
                    state["chunks"].append(item)
                    if item.get("model"):
                        call.upstream_model = item["model"]
                    if not include_usage:
                        if not item.get("choices") and "usage" in item:
                            item = await anext(upstream, None)
                            continue
                        item = {k: v for k, v in item.items() if k != "usage"}
                    if item.get("usage") or any(c.get("finish_reason") for c in item.get("choices") or ()):
                        held.append(item)
                    else:
                        yield json.dumps(item)
                    item = await anext(upstream, None)
            except UpstreamError as exc:
                yield json.dumps(exc.body)
                return
            finally:
                await upstream.aclose()
            state["recorded"] = True
            if (conflict := _served(call, folded())) is not None:
                yield conflict.body.decode()
                return
            for item in held:
                yield json.dumps(item)
            yield "[DONE]"

        def closed() -> None:
            if not call.rollout_id:
                return
            if not state["recorded"] and state["chunks"]:
                _served(call, folded(), delivered=False)  # the agent went away mid-stream: never trained
            gateway.recorder.call_ended(call.rollout_id)

        return ChatStream(events(), closed, headers={"X-Flowopt-Adapter-Version": call.ref.version})

    async def _stream(call: _Call):
        """Serve ``call`` as Server-Sent Events (:mod:`flow_assets.serving.gateway.streaming`). The
        response starts with the first sampled token: a call the batcher refuses (or that fails
        before any token) is an ordinary error response."""
        req, loop = call.req, asyncio.get_running_loop()
        queue, call.work.on_tokens, on_done = token_queue(loop)
        future = gateway.batcher.submit(call.work)
        future.add_done_callback(on_done)
        first = await queue.get()
        if first is None:
            rollouts = await asyncio.wrap_future(future)  # the batcher's exception, if any, is a 500 as without streaming
            if failed := next((r.error for r in rollouts if r.error), None):
                return _error(400, failed, param="messages")
        parse = None if req.tool_choice == "none" or not call.tools else gateway.engine.chat.tool_calls
        decode = functools.partial(tokenizer.decode, skip_special_tokens=True)
        texts = [ChoiceText(decode, req.stop, parse) for _ in range(req.n)]
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        header = {"id": f"chatcmpl-{uuid.uuid4().hex}", "created": int(time.time()), "model": call.name,
                  "system_fingerprint": call.ref.version}  # fmt: skip
        state = {"recorded": False}

        def piece(index: int, delta: dict[str, Any], first_token: int, end: int, ids, lps, reason: str | None = None, **extra):
            logprobs = _logprobs_payload(tokenizer, ids[first_token:end], lps[first_token:end]) if req.logprobs else None
            return chunk(header, [{"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": reason, **extra}], include_usage)

        async def events():
            for i in range(req.n):
                yield chunk(header, [{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}], include_usage)
            lps: list[list[float]] = [[] for _ in range(req.n)]
            item = first
            while item is not None:
                i, new_ids, new_lps = item
                lps[i] += new_lps
                delta, a, b = texts[i].push(new_ids)
                if delta or (req.logprobs and b > a):
                    yield piece(i, {"content": delta}, a, b, texts[i].ids, lps[i])
                item = await queue.get()
            try:
                rollouts = await asyncio.wrap_future(future)
            except Exception as exc:  # noqa: BLE001 - the stream has begun: the error goes in it
                error_id = uuid.uuid4().hex[:12]
                log.error("gateway error %s in a stream: %s", error_id, exc, exc_info=exc)
                yield json.dumps(error_body(f"internal error {error_id} ({type(exc).__name__})", "server_error"))
                return
            if failed := next((r.error for r in rollouts if r.error), None):
                yield json.dumps(error_body(scrub_paths(failed), param="messages"))
                return
            choices, out_choices = _choices(call, rollouts)
            tail: list[str | None] = []  # per choice: its finish chunk, sent after the turn is recorded
            for i, (choice, out) in enumerate(zip(choices, out_choices)):
                content = out["message"]["content"]
                delta, a, b, consistent = texts[i].rest(content, len(choice.completion_ids))
                if not consistent:
                    log.warning("stream of rollout %s: the text sent is not a prefix of the content", call.rollout_id or "-")
                ids, c_lps = choice.completion_ids, choice.logprobs
                if delta:
                    yield piece(i, {"content": delta}, a, b, ids, c_lps)
                    a = b
                for k, tool_call in enumerate(choice.tool_calls):
                    function = tool_call["function"]
                    start = {"index": k, "id": tool_call["id"], "type": "function", "function": {"name": function["name"], "arguments": ""}}
                    yield piece(i, {"tool_calls": [start]}, a, a, ids, c_lps)
                    yield piece(i, {"tool_calls": [{"index": k, "function": {"arguments": function["arguments"]}}]}, a, a, ids, c_lps)
                tail.append(piece(i, {}, a, b, ids, c_lps, choice.finish_reason, stop_reason=out["stop_reason"]))
            # everything the agent acts on has been handed to the server: the turn is delivered
            state["recorded"] = True
            if (conflict := _served(call, choices)) is not None:
                yield conflict.body.decode()
                return
            for text in tail:
                yield text
            if include_usage:
                yield chunk(header, [], True, _usage(call, choices))
            yield "[DONE]"

        def closed() -> None:
            """The response is over: end the rollout's call, recording the turn as undelivered
            when the stream did not get that far (once its generation is done)."""
            if not state["recorded"] and not future.done():
                call.work.cancelled = True  # nobody reads the rest: stop sampling it
                cancelled_total.labels("stream").inc()
            if state["recorded"] or not call.rollout_id:
                if call.rollout_id:
                    gateway.recorder.call_ended(call.rollout_id)
                return

            def undelivered(done) -> None:
                try:
                    rollouts = done.result()
                    if not any(r.error for r in rollouts):
                        _served(call, _choices(call, rollouts)[0], delivered=False)
                except Exception:  # noqa: BLE001 - the generation failed: nothing to record
                    pass
                finally:
                    gateway.recorder.call_ended(call.rollout_id)

            def hop(done) -> None:
                try:
                    loop.call_soon_threadsafe(undelivered, done)
                except RuntimeError:  # the gateway stopped; its shutdown lands the rollout
                    pass

            future.add_done_callback(hop)  # runs at once when the generation is already done

        # the prompt's tokens, known now: the Messages API's message_start event reports them
        headers = {"X-Flowopt-Adapter-Version": call.ref.version, "X-Flowopt-Prompt-Tokens": str(len(call.prompt_ids))}
        return ChatStream(events(), closed, headers=headers)

    @app.post("/rollouts")
    async def open_rollouts(body: RolloutOpen | list[RolloutOpen]):
        items = body if isinstance(body, list) else [body]
        ids = []
        for item in items:
            try:
                for kind, value in (("batch", item.batch), ("source", item.source)):
                    if value is not None:
                        check_name(kind, value)
                if item.model is not None:
                    gateway.resolver.resolve(item.model)
                fields = item.model_dump(exclude={"rollout_id"})
                ids.append(gateway.recorder.open(RolloutSettings(**fields), item.rollout_id))
            except UnknownModelError as exc:
                return _error(404, str(exc), param="model", code="model_not_found")
            except (RolloutError, ValueError) as exc:
                return _error(400, str(exc))
        return {"ids": ids} if isinstance(body, list) else {"id": ids[0]}

    @app.post("/rollouts/{rollout_id}/finish")
    async def finish(rollout_id: str, body: RolloutFinish):
        if body.error is None and body.success is None and body.score is None:
            return _error(400, "finish needs 'success' or 'score' (or an 'error')", param="success")
        outcome = None if body.error is not None else Outcome(success=body.success, score=body.score)
        error = {"kind": body.error_kind, "message": body.error} if body.error is not None else None
        try:
            trajectory, settings = gateway.recorder.finish(
                rollout_id, outcome, body.final_answer, body.metadata, error,
                task_id=body.task_id, query=body.query, agent_id=body.agent_id,
            )  # fmt: skip
        except RolloutError as exc:
            return _error(404, str(exc), param="rollout_id", code="rollout_not_found")
        except ValidationError as exc:
            message, param = validation_message(exc)
            return _error(400, f"the rollout is not a valid trajectory: {message}", param=param)
        batch = gateway.land(trajectory, settings)
        return {
            "trajectory_id": trajectory.trajectory_id,
            "batch": batch,
            "steps": len(trajectory.steps),
            "llm_calls": trajectory.metadata["llm_calls"],
            "tool_calls": trajectory.metadata["tool_calls"],
            "completion_tokens": trajectory.metadata["completion_tokens"],
            "error": trajectory.metadata.get("error"),
        }

    @app.post("/batches/{name}/close")
    async def close_batch(name: str):
        count = gateway.lander.open_batches().get(name, 0)
        path = gateway.lander.close(name)
        return {"batch": name, "path": str(path) if path else None, "trajectories": count}

    return app
