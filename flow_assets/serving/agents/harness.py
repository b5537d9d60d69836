"""The agent harness: G ephemeral agents per task, each with its own rollout, against the gateway.

This is the original design's ``AgentManager``: for every task it deploys ``group_size``
independent agents in parallel (at most ``concurrency`` at a time), each an ``openai.AsyncOpenAI``
client whose calls carry its own rollout id (``X-Agent-ID``). When an agent returns, the task
source's verifier scores its answer and the harness finishes the rollout with that outcome, so
the gateway lands it as one trajectory of the batch. The agents share nothing but the gateway.

Isolation: an agent that raises, runs past ``timeout_s`` or never calls the model does not stop
the others; its rollout lands as an error trajectory (``metadata.error.kind`` = ``agent_error``,
``timeout``, ``no_llm_call``) with every turn it did make, reward 0. (A call still being
generated when its agent is given up on is not recorded: the agent never saw it.)

Everything goes over real HTTP: the rollouts are opened with ``POST /rollouts`` (one request
for all of them), finished with ``POST /rollouts/{id}/finish``, and the batch is landed with
``POST /batches/{name}/close``.
"""

from __future__ import annotations

import asyncio
import hashlib
import inspect
import time
import uuid
from collections.abc import Awaitable, Callable, Collection, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import httpx2

from flow_assets.core.imports import import_function
from flow_assets.serving.tls import default_tls_context
from flow_assets.tasks.sources import Task

if TYPE_CHECKING:  # openai costs ~0.5 s to import; the code location must load without it
    import openai

AgentFn = Callable[["openai.AsyncOpenAI", Task], Awaitable[str | None]]
ScoreFn = Callable[[Task, str | None], float]


class AgentLoadError(ValueError):
    """An agent path (``module:function``) does not name an ``async`` function of two arguments."""


def load_agent(path: str) -> AgentFn:
    """Import an agent from ``"package.module:function"``.

    Raises:
        AgentLoadError: malformed path, missing module or attribute, or not an ``async`` function
            taking ``(client, task)``.
    """
    fn = import_function(path, "agent", AgentLoadError, 2)
    if not inspect.iscoroutinefunction(fn):
        raise AgentLoadError(f"agent {path!r} must be an async function agent(client, task)")
    return fn


@dataclass(frozen=True)
class HarnessConfig:
    """How agents are run.

    Attributes:
        concurrency: agents running at once (each holds at most one request at the gateway).
        timeout_s: an agent still running after this many seconds is cancelled (an error rollout).
        model: the model name every call of these rollouts is served by, whatever the agent asks
            (``"policy"`` = the champion; the evaluation serves ``"candidate"``).
        temperature / top_p: sampling settings imposed on every call (``None``: the agent's own).
        land: whether the rollouts land as a log batch (held-out evaluation: ``False``).
        seed: seeds every rollout (:func:`rollout_seed` of it, the batch, the task and the sample
            index), so the same policy samples the same rollouts whatever order the agents' calls
            reach the gateway in, and two policies evaluated with the same seed draw the same
            random numbers on each task (common random numbers). ``None``: unseeded.
    """

    concurrency: int = 64
    timeout_s: float = 120.0
    model: str = "policy"
    temperature: float | None = 1.0
    top_p: float | None = None
    land: bool = True
    connections: int = 64
    seed: int | None = None


def rollout_seed(seed: int, batch: str | None, task_id: str, sample_index: int) -> int:
    """The sampling seed of sample ``sample_index`` of task ``task_id`` in log batch ``batch``
    (``None``: a held-out evaluation, which lands nothing) under the harness seed ``seed``: the
    first 63 bits of the BLAKE2b digest of the four, the same in every process and on every
    machine (Python's ``hash`` of a string is not).

    Returns:
        An integer in ``[0, 2^63)`` (the gateway derives each call's seed from it,
        :func:`~flow_assets.serving.gateway.capture.call_seed`).
    """
    key = "\x1f".join((str(seed), batch or "", task_id, str(sample_index))).encode()
    return int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "big") >> 1


@dataclass(frozen=True)
class RolloutResult:
    """What one agent did.

    Attributes:
        rollout_id / trajectory_id / task_id / sample_index: which rollout.
        answer: what the agent returned (``None`` on error or no answer).
        score / success: the verifier's reward and whether it is 1 (0 / False on error).
        error: ``{"kind", "message"}`` when the rollout failed, else ``None``.
        llm_calls / tool_calls / steps / completion_tokens: counts of the trajectory.
        seconds: the agent's wall time.
    """

    rollout_id: str
    trajectory_id: str
    task_id: str
    sample_index: int
    answer: str | None
    score: float
    success: bool
    error: dict[str, str] | None
    llm_calls: int
    tool_calls: int
    steps: int
    completion_tokens: int
    seconds: float


class GatewayError(RuntimeError):
    """The gateway refused a harness request (the message carries its error)."""


async def _post(http: httpx2.AsyncClient, path: str, body: Any) -> dict:
    response = await http.post(path, json=body)
    data = response.json()
    if response.status_code >= 400:
        raise GatewayError(f"POST {path}: {response.status_code} {data.get('error', data)}")
    return data


async def run_rollouts(
    base_url: str,
    agent: AgentFn,
    tasks: Sequence[Task],
    score: ScoreFn,
    group_size: int = 1,
    *,
    agent_id: str,
    batch: str | None = None,
    source: str | None = None,
    config: HarnessConfig | None = None,
    metadata: dict[str, Any] | None = None,
    skip: Collection[tuple[str, int]] = (),
) -> list[RolloutResult]:
    """Run ``group_size`` agents on every task through the gateway at ``base_url``.

    Args:
        base_url: the gateway, e.g. ``http://127.0.0.1:8000`` (no ``/v1``).
        agent: the agent function (see :func:`load_agent`).
        tasks: the tasks; ``score`` is their verifier.
        agent_id: the trajectories' ``agent_id`` (the trainable agent's id).
        batch / source: the log batch the rollouts land in and its landing sub-directory.
        config: concurrency, timeout, served model, sampling overrides, landing.
        metadata: merged into every trajectory's metadata.
        skip: ``(task_id, sample_index)`` pairs not to run (rollouts a killed attempt already
            landed, :mod:`flow_assets.cluster.ray_rollouts`).

    Returns:
        One :class:`RolloutResult` per (task, sample) run, task-major, in input order.

    Raises:
        GatewayError: the gateway refused to open or finish the rollouts.
    """
    from openai import AsyncOpenAI

    config = config or HarnessConfig()
    tag = batch or f"eval-{uuid.uuid4().hex[:8]}"
    left_out = set(skip)
    specs = [(task, g, f"{tag}-{i}-{g}-{uuid.uuid4().hex[:8]}") for i, task in enumerate(tasks) for g in range(group_size)
             if (task.task_id, g) not in left_out]  # fmt: skip
    semaphore = asyncio.Semaphore(config.concurrency)
    tls = default_tls_context()  # shared: building one costs ~21 ms (flow_assets.serving.tls)
    # one Timeout for every agent's client: given a float, httpx2 builds its own through a runtime
    # protocol check (isinstance of SupportsFloat); a client took 0.22 ms to build, 0.05 ms so
    timeout = httpx2.Timeout(config.timeout_s + 60)
    async with httpx2.AsyncClient(base_url=base_url, timeout=timeout, verify=tls) as http:
        def registration(task: Task, g: int, rid: str) -> dict[str, Any]:
            return {
                "rollout_id": rid,
                "task_id": task.task_id,
                "query": task.query,
                "agent_id": agent_id,
                "trajectory_id": f"{tag}/{task.task_id}/{g}",
                "batch": batch,
                "source": source,
                "land": config.land,
                "model": config.model,
                "temperature": config.temperature,
                "top_p": config.top_p,
                "seed": None if config.seed is None else rollout_seed(config.seed, batch, task.task_id, g),
                "metadata": {**(metadata or {}), "split": task.split, "source": task.source, "sample_index": g},
            }

        async def one(task: Task, g: int, rid: str) -> RolloutResult:
            # each agent has its own HTTP client: isolated, and a pool of one connection (a pool
            # shared by hundreds of agents scans every connection on each request: measured at
            # half the harness's time with 256 agents)
            async with semaphore, httpx2.AsyncClient(base_url=base_url, timeout=timeout, verify=tls) as own:
                # registered when its agent starts, not with the batch: a rollout waiting for a
                # free agent slot would otherwise sit idle at the gateway and, past its idle
                # timeout, be landed unfinished and refuse this agent's finish (a whole evaluation
                # failed that way with 624 rollouts at concurrency 128 on a loaded machine)
                await _post(own, "/rollouts", [registration(task, g, rid)])
                client = AsyncOpenAI(
                    base_url=f"{base_url}/v1", api_key="flowopt", default_headers={"X-Agent-ID": rid},
                    http_client=own, max_retries=0, timeout=config.timeout_s,
                )  # fmt: skip
                started = time.perf_counter()
                answer, error = None, None
                try:
                    answer = await asyncio.wait_for(agent(client, task), config.timeout_s)
                except asyncio.TimeoutError:
                    error = {"kind": "timeout", "message": f"the agent ran longer than {config.timeout_s:g} s"}
                except Exception as exc:  # noqa: BLE001 - an agent's failure is its rollout's, not the batch's
                    error = {"kind": "agent_error", "message": f"{type(exc).__name__}: {exc}"}
                seconds = time.perf_counter() - started
                body: dict[str, Any] = {"final_answer": answer if isinstance(answer, str) else None}
                value = 0.0
                if error is None:
                    value = float(score(task, body["final_answer"]))
                    body.update(success=value >= 1.0, score=value)
                else:
                    body.update(error=error["message"], error_kind=error["kind"])
                done = await _post(own, f"/rollouts/{rid}/finish", body)
                if done.get("error"):
                    error = done["error"]
                return RolloutResult(
                    rid, done["trajectory_id"], task.task_id, g, body["final_answer"],
                    value if error is None else 0.0, error is None and value >= 1.0, error,
                    done["llm_calls"], done["tool_calls"], done["steps"], done["completion_tokens"], seconds,
                )  # fmt: skip

        results = await asyncio.gather(*(one(*spec) for spec in specs))
        if batch is not None and config.land:
            await _post(http, f"/batches/{batch}/close", {})
    return list(results)


def run_rollouts_sync(*args, **kwargs) -> list[RolloutResult]:
    """:func:`run_rollouts` from synchronous code (its own event loop)."""
    return asyncio.run(run_rollouts(*args, **kwargs))

