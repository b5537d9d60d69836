"""``flowopt api``: the JSON-RPC 2.0 training API over HTTP (FastAPI + uvicorn).

``POST /rpc`` takes a JSON-RPC request or batch (:mod:`flow_assets.api.jsonrpc`) with
``Authorization: Bearer <token>``; the tokens come from ``FLOWOPT_API_TOKENS`` (comma-separated,
read through Dagster's ``EnvVar`` convention: never in config files) and are compared in constant
time (``hmac.compare_digest``). A missing or wrong token is HTTP 401 with JSON-RPC error -32001.
``GET /exports/<name>`` downloads an export, ``GET /metrics`` is Prometheus text (requests and
latency per method, jobs per state, each agent's spend this month) and ``GET /openapi.json`` the
schema: all three need the token too. ``GET /health`` needs none. Logs are JSON lines on the
``flowopt.api`` logger, one per event: each call (method, outcome, latency, job id), each run
submitted or terminated (job id, run id).

Request limits (:class:`Limits`): the token is checked from the headers before any of the body
is read (an unauthenticated body is never read, whatever its size); a declared
``Content-Length`` over ``max_body_bytes`` is 413 at once, and a chunked body is 413 as soon as it
passes the cap; a body not received within ``body_timeout_s`` is 408; a batch of more than
``max_batch`` calls is refused whole (-32600). Each of these answers closes the connection, so
the rest of an unread body is not waited for.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from fastapi import FastAPI, Request, Response
from fastapi.responses import FileResponse, JSONResponse
from starlette.requests import ClientDisconnect
from starlette.concurrency import run_in_threadpool
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from flow_assets.api.export import ExportParams, export_trajectories
from flow_assets.api.jobs import EvaluateParams, JobParams, JobService, ListJobsParams, StartGrpoParams, log_event
from flow_assets.api.jsonrpc import DEFAULT_MAX_BATCH, INVALID_REQUEST, UNAUTHORISED, Dispatcher
from flow_assets.settings import DEFAULT_EXPORTS, Settings
from flow_assets.core.untrusted import authorised


@dataclass(frozen=True)
class Limits:
    """What one request may cost the API (module docstring for how each is enforced).

    Args:
        max_body_bytes: largest request body, bytes (default 4 MiB: a batch of 100 calls is a few
            kB); larger is HTTP 413.
        body_timeout_s: seconds to receive the whole body once the headers are in (default 30);
            slower is HTTP 408.
        max_batch: most calls in one JSON-RPC batch (default 100); more is -32600.
    """

    max_body_bytes: int = 4 * 1024 * 1024
    body_timeout_s: float = 30.0
    max_batch: int = DEFAULT_MAX_BATCH

    def __post_init__(self) -> None:
        for name in ("max_body_bytes", "body_timeout_s", "max_batch"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)!r}")


def training_dispatcher(service: JobService, export_dir: str | Path = DEFAULT_EXPORTS, max_batch: int = DEFAULT_MAX_BATCH) -> Dispatcher:
    """The ``training.*`` methods on ``service``; exports are written to ``export_dir`` under a
    name the API chooses and fetched with ``GET /exports/<name>`` (a client-given ``path`` is
    refused, -32602); a batch holds at most ``max_batch`` calls."""
    rpc = Dispatcher(max_batch=max_batch)

    @rpc.method("training.export_trajectories", ExportParams)
    def export(params: ExportParams) -> dict:
        if service.lake is None:
            raise RuntimeError("this API has no lake to export from")
        out = export_trajectories(service.lake, params, export_dir)
        return {**out, "url": f"/exports/{out['name']}"}

    rpc.method("training.start_grpo", StartGrpoParams)(service.start_grpo)
    rpc.method("training.get_status", JobParams)(service.get_status)
    rpc.method("training.list_jobs", ListJobsParams)(lambda p: {"jobs": service.list_jobs(p)})
    rpc.method("training.cancel", JobParams)(service.cancel)
    rpc.method("training.pause", JobParams)(service.pause)
    rpc.method("training.resume", JobParams)(service.resume)
    rpc.method("training.evaluate", EvaluateParams)(service.evaluate)
    return rpc


class _BodyRefused(Exception):
    """A request body the API will not read to its end: ``status`` (413, 408, 400) and why."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status, self.message = status, message


async def read_body(request: Request, limits: Limits) -> bytes:
    """The request's body, read within ``limits`` (see :class:`Limits`).

    Raises:
        _BodyRefused: 400 (a malformed ``Content-Length`` or the client went away), 413 (larger
            than ``limits.max_body_bytes``, declared or as received), 408 (not received within
            ``limits.body_timeout_s``).
    """
    declared = request.headers.get("content-length")
    if declared is not None:
        if not (declared.isascii() and declared.isdigit()):
            raise _BodyRefused(400, "Content-Length is not a number")
        if int(declared) > limits.max_body_bytes:
            raise _BodyRefused(413, f"the body of {int(declared)} bytes exceeds this server's limit of {limits.max_body_bytes} bytes")
    chunks, size = [], 0
    try:
        async with asyncio.timeout(limits.body_timeout_s):
            async for chunk in request.stream():
                size += len(chunk)
                if size > limits.max_body_bytes:
                    raise _BodyRefused(413, f"the body exceeds this server's limit of {limits.max_body_bytes} bytes")
                chunks.append(chunk)
    except TimeoutError:
        raise _BodyRefused(408, f"the body was not received within {limits.body_timeout_s:g} s") from None
    except ClientDisconnect:
        raise _BodyRefused(400, "the client went away before the body was received") from None
    return b"".join(chunks)


def _refusal(status: int, code: int, message: str) -> Response:
    """An HTTP error with a JSON-RPC error object; ``Connection: close``, so uvicorn drops the
    connection instead of reading the rest of a body nobody will use."""
    headers = {"Connection": "close"}
    if status == 401:
        headers["WWW-Authenticate"] = "Bearer"
    payload = {"jsonrpc": "2.0", "error": {"code": code, "message": message}, "id": None}
    return Response(json.dumps(payload), status_code=status, media_type="application/json", headers=headers)


def _unauthorised() -> Response:
    return _refusal(401, UNAUTHORISED, "unauthorised: a valid bearer token is required")


def create_app(
    rpc: Dispatcher, tokens: Sequence[str], service: JobService | None = None, export_dir: str | Path = DEFAULT_EXPORTS, limits: Limits | None = None
) -> FastAPI:
    """The ASGI app of the API (module docstring); ``limits`` default to :class:`Limits`'s
    defaults."""
    limits = limits or Limits()
    # the schema is served below behind the token, not at FastAPI's open default route
    app = FastAPI(title="flowopt training API", docs_url=None, redoc_url=None, openapi_url=None)

    @app.get("/openapi.json", include_in_schema=False)
    async def openapi(request: Request) -> Response:
        if not authorised(request.headers.get("authorization"), tokens):
            return _unauthorised()
        return JSONResponse(app.openapi())

    @app.get("/exports/{name}")
    async def download(name: str, request: Request) -> Response:
        if not authorised(request.headers.get("authorization"), tokens):
            return _unauthorised()
        path = Path(export_dir) / name
        if "/" in name or name.startswith(".") or not path.is_file():
            return Response(status_code=404)
        return FileResponse(path, filename=name)
    registry = CollectorRegistry()
    requests = Counter("flowopt_api_requests", "JSON-RPC calls by method and outcome", ["method", "outcome"], registry=registry)
    latency = Histogram("flowopt_api_request_seconds", "HTTP request latency by route, seconds", ["route"], registry=registry,
                        buckets=(0.001, 0.0025, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2.5))  # fmt: skip
    jobs = Gauge("flowopt_api_jobs", "training jobs by state", ["state"], registry=registry)
    spent = Gauge("flowopt_budget_spent_usd", "spend this calendar month per agent (served tokens at configured prices + judge), USD", ["agent"], registry=registry)

    @app.get("/health")
    async def health() -> dict:
        return {"ok": True}

    @app.get("/metrics")
    async def metrics(request: Request) -> Response:
        # per-agent spend and job counts are the deployment's business: token required
        if not authorised(request.headers.get("authorization"), tokens):
            return _unauthorised()
        if service is not None:
            counts: dict[str, int] = {s: 0 for s in ("queued", "running", "paused", "completed", "failed", "cancelled")}
            listed = service.list_jobs(ListJobsParams(limit=1000))
            for job in listed:
                counts[job["state"]] += 1
            for state, n in counts.items():
                jobs.labels(state).set(n)
            if service.spend is not None:  # this month's spend of every agent a job trains
                for agent in sorted({j["agent_id"] for j in listed if j["agent_id"]}):
                    spent.labels(agent).set(service.spend(agent).total_usd)
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    @app.post("/rpc")
    async def rpc_endpoint(request: Request) -> Response:
        started = time.perf_counter()
        # decided from the headers alone: an unauthenticated body is never read
        if not authorised(request.headers.get("authorization"), tokens):
            requests.labels("(unauthorised)", "error").inc()
            return _unauthorised()
        try:
            body = await read_body(request, limits)
        except _BodyRefused as refused:
            requests.labels(f"(refused {refused.status})", "error").inc()
            log_event("rpc_refused", status=refused.status, why=refused.message)
            return _refusal(refused.status, INVALID_REQUEST, refused.message)
        answer = await run_in_threadpool(rpc.handle, body)  # the instance's reads block: off the event loop
        seconds = time.perf_counter() - started
        latency.labels("/rpc").observe(seconds)
        for method, outcome, job in _summaries(body, answer, set(rpc.methods), rpc.max_batch):
            requests.labels(method, outcome).inc()
            log_event("rpc", method=method, outcome=outcome, job_id=job, seconds=round(seconds, 6))
        if answer is None:
            return Response(status_code=204)
        return Response(answer, media_type="application/json")

    return app


def _summaries(body: bytes, answer: bytes | None, known: set[str], max_batch: int) -> list[tuple[str, str, str | None]]:
    """``(method, "ok"|"error", job id)`` per call, for metrics and the log line. A method name
    the API does not serve reads ``(unknown)``: a client's names never become metric labels (one
    label per name would let a client grow the metrics without bound)."""
    try:
        calls = json.loads(body)
        replies = json.loads(answer) if answer else []
    except (ValueError, RecursionError):
        return [("(unparsed)", "error", None)]
    if isinstance(calls, list) and len(calls) > max_batch:
        return [("(batch too large)", "error", None)]
    calls = calls if isinstance(calls, list) else [calls]
    replies = replies if isinstance(replies, list) else [replies]
    by_id = {json.dumps(r.get("id")): r for r in replies if isinstance(r, dict)}
    out = []
    for call in calls:
        if not isinstance(call, dict):
            out.append(("(invalid)", "error", None))
            continue
        method = call.get("method") if isinstance(call.get("method"), str) else "(invalid)"
        method = method if method in known or method == "(invalid)" else "(unknown)"
        reply = by_id.get(json.dumps(call.get("id"))) if "id" in call else None
        params = call.get("params") if isinstance(call.get("params"), dict) else {}
        result = reply.get("result") if reply else None
        job = params.get("job_id") or (result.get("job_id") if isinstance(result, dict) else None)
        out.append((method, "error" if reply and "error" in reply else "ok", job))
    return out


def deployment_service(instance, dagster_url: str, location: str = "flowopt", settings: Settings | None = None) -> JobService:
    """The job service of a deployment: runs read from ``instance``, submitted and terminated
    through the webserver's GraphQL API at ``dagster_url`` (``http://host:port``), with the
    ``dagster-graphql`` client; the lake, the adapter registry (``training.evaluate``), the
    policy's prices and the default monthly budget from ``settings`` (default: the environment,
    read now), which should be those the code location reads.

    Raises:
        ValueError: ``dagster_url`` is not ``http(s)://host:port``, or a bad setting.
    """
    from urllib.parse import urlparse

    from dagster_graphql import DagsterGraphQLClient

    from flow_assets.core.partitions import adapter_versions, log_batches
    from resources.registry import AdapterRegistry

    url = urlparse(dagster_url)
    if url.scheme not in ("http", "https") or not url.hostname:
        raise ValueError(f"the Dagster webserver URL must be http(s)://host:port, got {dagster_url!r}")
    client = DagsterGraphQLClient(url.hostname, port_number=url.port, use_https=url.scheme == "https")

    def submit(job_name, run_config, tags):
        return client.submit_job_execution(job_name, repository_location_name=location, run_config=run_config, tags=tags)

    from flow_assets.training.budget import CachedSpend, prices_of
    from resources.lake import TrajectoryLake

    settings = settings or Settings.load()
    lake = TrajectoryLake(root=settings.lake)
    prices = prices_of(settings)
    registry = AdapterRegistry(root=settings.models)
    return JobService(
        instance=instance, submit=submit, terminate=lambda run_ids: client.terminate_runs(run_ids),
        partitions=lambda: set(instance.get_dynamic_partitions(log_batches.name)),
        spend=CachedSpend(lake, prices), default_budget_usd=settings.monthly_budget_usd, lake=lake,
        versions=lambda version: registry.version(version) is not None,
        add_version=lambda version: instance.add_dynamic_partitions(adapter_versions.name, [version]),
    )  # fmt: skip
