"""``flowopt api``: the JSON-RPC 2.0 training API over HTTP (FastAPI + uvicorn).

``POST /rpc`` takes a JSON-RPC request or batch (:mod:`flow_assets.api.jsonrpc`) with
``Authorization: Bearer <token>``; the tokens come from ``FLOWOPT_API_TOKENS`` (comma-separated,
read through Dagster's ``EnvVar`` convention: never in config files) and are compared in constant
time (``hmac.compare_digest``). A missing or wrong token is HTTP 401 with JSON-RPC error -32001.
``GET /exports/<name>`` downloads an export (token required). ``GET /metrics`` is Prometheus text (requests and latency per method, jobs per state, each
agent's spend this month);
``GET /health`` needs no token. Logs are JSON lines on the ``flowopt.api`` logger, one per event:
each call (method, outcome, latency, job id), each run submitted or terminated (job id, run id).
"""

from __future__ import annotations

import hmac
import json
import os
import uuid
from pathlib import Path
import time
from collections.abc import Sequence

from fastapi import FastAPI, Request, Response
from fastapi.responses import FileResponse
from starlette.concurrency import run_in_threadpool
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from flow_assets.api.export import ExportParams, export_trajectories
from flow_assets.api.jobs import EvaluateParams, JobParams, JobService, ListJobsParams, StartGrpoParams, log_event
from flow_assets.api.jsonrpc import UNAUTHORISED, Dispatcher

def training_dispatcher(service: JobService, export_dir: str | Path = ".exports") -> Dispatcher:
    """The ``training.*`` methods on ``service``; exports without a ``path`` go to ``export_dir``
    and are fetched with ``GET /exports/<name>``."""
    rpc = Dispatcher()

    @rpc.method("training.export_trajectories", ExportParams)
    def export(params: ExportParams) -> dict:
        if service.lake is None:
            raise RuntimeError("this API has no lake to export from")
        name = f"trajectories-{uuid.uuid4().hex[:12]}.{params.format}"
        target = Path(params.path) if params.path else Path(export_dir) / name
        out = export_trajectories(service.lake, params, target)
        return {**out, "path": str(target.resolve()), "url": None if params.path else f"/exports/{name}"}

    rpc.method("training.start_grpo", StartGrpoParams)(service.start_grpo)
    rpc.method("training.get_status", JobParams)(service.get_status)
    rpc.method("training.list_jobs", ListJobsParams)(lambda p: {"jobs": service.list_jobs(p)})
    rpc.method("training.cancel", JobParams)(service.cancel)
    rpc.method("training.pause", JobParams)(service.pause)
    rpc.method("training.resume", JobParams)(service.resume)
    rpc.method("training.evaluate", EvaluateParams)(service.evaluate)
    return rpc


def authorised(header: str | None, tokens: Sequence[str]) -> bool:
    """Whether ``Authorization: Bearer <token>`` names one of ``tokens`` (constant-time compare;
    no tokens configured means nobody is authorised)."""
    if not header or not header.startswith("Bearer "):
        return False
    given = header[len("Bearer ") :].encode()
    return any(hmac.compare_digest(given, t.encode()) for t in tokens if t)


def create_app(rpc: Dispatcher, tokens: Sequence[str], service: JobService | None = None, export_dir: str | Path = ".exports") -> FastAPI:
    """The ASGI app of the API (module docstring)."""
    app = FastAPI(title="flowopt training API", docs_url=None, redoc_url=None)

    @app.get("/exports/{name}")
    async def download(name: str, request: Request) -> Response:
        if not authorised(request.headers.get("authorization"), tokens):
            return Response(status_code=401, headers={"WWW-Authenticate": "Bearer"})
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
    async def metrics() -> Response:
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
        body = await request.body()
        if not authorised(request.headers.get("authorization"), tokens):
            requests.labels("(unauthorised)", "error").inc()
            payload = {"jsonrpc": "2.0", "error": {"code": UNAUTHORISED, "message": "unauthorised: a valid bearer token is required"}, "id": None}
            return Response(json.dumps(payload), status_code=401, media_type="application/json", headers={"WWW-Authenticate": "Bearer"})
        answer = await run_in_threadpool(rpc.handle, body)  # the instance's reads block: off the event loop
        seconds = time.perf_counter() - started
        latency.labels("/rpc").observe(seconds)
        for method, outcome, job in _summaries(body, answer):
            requests.labels(method, outcome).inc()
            log_event("rpc", method=method, outcome=outcome, job_id=job, seconds=round(seconds, 6))
        if answer is None:
            return Response(status_code=204)
        return Response(answer, media_type="application/json")

    return app


def _summaries(body: bytes, answer: bytes | None) -> list[tuple[str, str, str | None]]:
    """``(method, "ok"|"error", job id)`` per call, for metrics and the log line."""
    try:
        calls = json.loads(body)
        replies = json.loads(answer) if answer else []
    except ValueError:
        return [("(unparsed)", "error", None)]
    calls = calls if isinstance(calls, list) else [calls]
    replies = replies if isinstance(replies, list) else [replies]
    by_id = {json.dumps(r.get("id")): r for r in replies if isinstance(r, dict)}
    out = []
    for call in calls:
        if not isinstance(call, dict):
            out.append(("(invalid)", "error", None))
            continue
        method = call.get("method") if isinstance(call.get("method"), str) else "(invalid)"
        reply = by_id.get(json.dumps(call.get("id"))) if "id" in call else None
        params = call.get("params") if isinstance(call.get("params"), dict) else {}
        result = reply.get("result") if reply else None
        job = params.get("job_id") or (result.get("job_id") if isinstance(result, dict) else None)
        out.append((method, "error" if reply and "error" in reply else "ok", job))
    return out


def deployment_service(
    instance, dagster_url: str, location: str = "flowopt", lake_root: str | None = None, models_root: str | None = None
) -> JobService:
    """The job service of a deployment: runs read from ``instance``, submitted and terminated
    through the webserver's GraphQL API at ``dagster_url`` (``http://host:port``), with the
    ``dagster-graphql`` client; the lake and the adapter registry (``training.evaluate``) at
    ``lake_root`` / ``models_root``, else ``FLOWOPT_LAKE`` / ``FLOWOPT_MODELS`` (as the code
    location reads them).

    Raises:
        ValueError: ``dagster_url`` is not ``http(s)://host:port``.
    """
    from urllib.parse import urlparse

    from dagster_graphql import DagsterGraphQLClient

    from flow_assets.partitions import adapter_versions, log_batches
    from resources.registry import AdapterRegistry

    url = urlparse(dagster_url)
    if url.scheme not in ("http", "https") or not url.hostname:
        raise ValueError(f"the Dagster webserver URL must be http(s)://host:port, got {dagster_url!r}")
    client = DagsterGraphQLClient(url.hostname, port_number=url.port, use_https=url.scheme == "https")

    def submit(job_name, run_config, tags):
        return client.submit_job_execution(job_name, repository_location_name=location, run_config=run_config, tags=tags)

    from flow_assets.api.budget import CachedSpend, monthly_budget_from_env, prices_from_env
    from resources.lake import TrajectoryLake

    lake = TrajectoryLake(root=lake_root or os.environ.get("FLOWOPT_LAKE", ".lake"))
    prices = prices_from_env()
    registry = AdapterRegistry(root=models_root or os.environ.get("FLOWOPT_MODELS", ".models"))
    return JobService(
        instance=instance, submit=submit, terminate=lambda run_ids: client.terminate_runs(run_ids),
        partitions=lambda: set(instance.get_dynamic_partitions(log_batches.name)),
        spend=CachedSpend(lake, prices), default_budget_usd=monthly_budget_from_env(), lake=lake,
        versions=lambda version: registry.version(version) is not None,
        add_version=lambda version: instance.add_dynamic_partitions(adapter_versions.name, [version]),
    )  # fmt: skip
