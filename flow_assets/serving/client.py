"""Rewards without glue code: a rollout around any agent framework, finished with the reward.

An agent framework only needs a base URL and an API key. :func:`rollout` opens a rollout on the
gateway (``POST /rollouts``), hands out both, and finishes the rollout when the block ends
(``POST /rollouts/{id}/finish``)::

    from flow_assets.serving.client import rollout

    with rollout("http://127.0.0.1:8000", task_id=task.id, query=task.question) as r:
        agent = make_agent(base_url=r.base_url, api_key=r.api_key)   # any framework
        answer = agent.run(task.question)
        r.reward(score=verify(task, answer), final_answer=answer)

The rollout id travels as the API key (the gateway's ``<token>:<rollout id>`` form when the
gateway has tokens), so nothing else of the framework is configured: every call it makes lands in
this rollout, whatever header or path it would have needed. The same object works with
``async with`` (an ``httpx.AsyncClient`` then makes the two requests).

How the block ends decides what lands:

- :meth:`Rollout.reward` was called: the rollout is finished with that outcome (``score`` and/or
  ``success``), the reward the user's verifier returned;
- an exception left the block: the rollout is finished as an error trajectory (``error_kind``
  ``agent_error``, the exception's type and message) and the exception propagates;
- neither: the rollout is left open, and the gateway lands it *unlabelled* once it has been idle
  for ``rollout_timeout_s`` (:meth:`~flow_assets.serving.gateway.capture.RolloutRecorder.reap`), so
  a judge can score it.

Base URLs: ``base_url`` is the gateway's OpenAI root (``<gateway>/v1``, for the ``openai``
client, openai-agents, LangChain, pydantic-ai, litellm, llama-index); ``anthropic_base_url`` is
the gateway itself (the ``anthropic`` client appends ``/v1/messages``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import httpx

from flow_assets.serving.tls import default_tls_context


class RolloutClientError(RuntimeError):
    """The gateway refused to open or finish a rollout (its status code and error message)."""


@dataclass
class Rollout:
    """One open rollout on a gateway (made by :func:`rollout`).

    Attributes:
        gateway_url: the gateway's root URL (no ``/v1``).
        rollout_id: the rollout's id (also in ``api_key``).
        api_key: the key a framework sends: the rollout id, or ``<token>:<rollout id>``.
        outcome: what :meth:`reward` recorded (``{"score", "success", "final_answer", "metadata"}``),
            ``None`` until then.
        landed: the gateway's answer to the finish call (``trajectory_id``, ``batch``, ``steps``,
            ``llm_calls`` ...), ``None`` before the rollout is finished or when it was left open.
    """

    gateway_url: str
    rollout_id: str
    api_key: str
    outcome: dict[str, Any] | None = None
    landed: dict[str, Any] | None = field(default=None, repr=False)

    @property
    def base_url(self) -> str:
        """The OpenAI-compatible base URL (``<gateway>/v1``)."""
        return f"{self.gateway_url}/v1"

    @property
    def anthropic_base_url(self) -> str:
        """The base URL for the ``anthropic`` client (the gateway's root)."""
        return self.gateway_url

    def reward(
        self,
        score: float | None = None,
        success: bool | None = None,
        final_answer: str | None = None,
        metadata: dict[str, Any] | None = None,
    ) -> None:
        """Record the episode's outcome; the rollout is finished with it when the block ends.

        Args:
            score: the scalar reward (usually in [0, 1]; finite).
            success: whether the task was solved.
            final_answer: the agent's answer (default: the last turn's text).
            metadata: stored with the trajectory.

        Raises:
            ValueError: neither ``score`` nor ``success`` given.
        """
        if score is None and success is None:
            raise ValueError("reward needs a score or success")
        self.outcome = {"score": score, "success": success, "final_answer": final_answer, "metadata": metadata or {}}

    def _finish_body(self, exc: BaseException | None) -> dict[str, Any] | None:
        if exc is not None:
            return {"error": f"{type(exc).__name__}: {exc}"[:2000], "error_kind": "agent_error"}
        if self.outcome is None:
            return None  # left open: the gateway lands it unlabelled after its idle timeout
        return {k: v for k, v in self.outcome.items() if v is not None and v != {}}


def _checked(response: httpx.Response, what: str) -> dict[str, Any]:
    if response.status_code >= 400:
        try:
            message = response.json()["error"]["message"]
        except (ValueError, KeyError, TypeError):
            message = response.text[:500]
        raise RolloutClientError(f"{what}: HTTP {response.status_code}: {message}")
    return response.json()


class rollout:  # noqa: N801 - used as a context manager, named like one (contextlib's style)
    """Open a rollout on a gateway for the block's duration (module docstring).

    Args:
        gateway_url: the gateway's root URL, e.g. ``http://127.0.0.1:8000`` (a trailing ``/v1``
            is accepted and dropped).
        token: the gateway's API token when it has tokens (``flowopt serve --token``), else ``None``.
        timeout_s: HTTP timeout of the open and finish requests, seconds.
        **settings: what the rollout is opened with (:class:`~flow_assets.serving.gateway.protocol.RolloutOpen`):
            ``task_id``, ``query``, ``agent_id``, ``batch``, ``model``, ``temperature``,
            ``metadata`` ...

    Raises:
        RolloutClientError: on entering, the gateway refused the rollout (e.g. a taken id); on
            leaving, it refused the finish (the block's own exception, if any, wins).
    """

    def __init__(self, gateway_url: str, token: str | None = None, timeout_s: float = 30.0, **settings: Any):
        url = gateway_url.rstrip("/")
        self.gateway_url = url[: -len("/v1")] if url.endswith("/v1") else url
        self.token = token
        self.timeout_s = timeout_s
        self.settings = {k: v for k, v in settings.items() if v is not None}
        self.handle: Rollout | None = None

    def _opened(self, body: dict[str, Any]) -> Rollout:
        rollout_id = body["id"]
        key = f"{self.token}:{rollout_id}" if self.token else rollout_id
        self.handle = Rollout(self.gateway_url, rollout_id, key)
        return self.handle

    def _headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.token}"} if self.token else {}

    def __enter__(self) -> Rollout:
        with httpx.Client(timeout=self.timeout_s, verify=default_tls_context()) as http:
            response = http.post(f"{self.gateway_url}/rollouts", json=self.settings, headers=self._headers())
        return self._opened(_checked(response, "opening a rollout"))

    def __exit__(self, exc_type, exc, tb) -> None:
        handle = self.handle
        body = handle._finish_body(exc) if handle is not None else None
        if body is None:
            return
        with httpx.Client(timeout=self.timeout_s, verify=default_tls_context()) as http:
            response = http.post(f"{self.gateway_url}/rollouts/{handle.rollout_id}/finish", json=body, headers=self._headers())
        if exc is None:
            handle.landed = _checked(response, f"finishing rollout {handle.rollout_id}")
        elif response.status_code < 400:
            handle.landed = response.json()

    async def __aenter__(self) -> Rollout:
        async with httpx.AsyncClient(timeout=self.timeout_s, verify=default_tls_context()) as http:
            response = await http.post(f"{self.gateway_url}/rollouts", json=self.settings, headers=self._headers())
        return self._opened(_checked(response, "opening a rollout"))

    async def __aexit__(self, exc_type, exc, tb) -> None:
        handle = self.handle
        body = handle._finish_body(exc) if handle is not None else None
        if body is None:
            return
        async with httpx.AsyncClient(timeout=self.timeout_s, verify=default_tls_context()) as http:
            response = await http.post(f"{self.gateway_url}/rollouts/{handle.rollout_id}/finish", json=body, headers=self._headers())
        if exc is None:
            handle.landed = _checked(response, f"finishing rollout {handle.rollout_id}")
        elif response.status_code < 400:
            handle.landed = response.json()
