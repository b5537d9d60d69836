"""Proxy mode: the gateway in front of a model server it does not host.

``flowopt serve --upstream URL`` serves the same routes (chat completions, the Responses and
Messages APIs translated onto them, rollouts, batches) and forwards each chat call to an
OpenAI-compatible server: a hosted API, vLLM, llama.cpp's server, or another flowopt gateway in
plain serving mode. What the upstream answers is captured as a turn, as for the gateway's own
policy, with what an OpenAI-compatible server returns:

- the text, the tool calls (``message.tool_calls``, or the streamed ``delta.tool_calls``
  assembled by index), the finish reason, the usage (``prompt_tokens``, ``completion_tokens``)
  and the latency;
- **no token ids and no behaviour log-probs**: the Chat Completions API returns tokens as
  strings (``logprobs.content[].token``), which do not map back to ids without the upstream's
  tokenizer. The captured steps have ``token_ids``, ``logprobs`` and ``prompt_token_ids`` unset,
  the trajectory says ``metadata.capture = "text"``, and training reads such a flow as a text log
  (re-rendered with the trained policy's template, ``flow_assets.policy.logged_rows``).

What is forwarded: the agent's request as it was validated, with ``model`` replaced by the
upstream model (:attr:`Upstream.model`; ``None``: the name the agent asked for), the sampling
overrides of its rollout (``temperature``, ``top_p``) applied, and, for a stream,
``stream_options.include_usage`` set (the usage chunk is passed on only when the agent asked for
it). The agent's own credentials never go upstream: the upstream gets ``Authorization: Bearer
<key>`` with the key read once, at start-up, from ``FLOWOPT_UPSTREAM_API_KEY``
(``Settings.upstream_api_key``). The key is not part of any repr, log line, error text or landed
record (an upstream error body that echoes it is answered with the key replaced).
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import httpx

#: what an upstream error body is answered with in place of the key, where it echoes it
REDACTED = "[redacted]"


class UpstreamError(Exception):
    """The upstream answered with an error, or could not be reached.

    Attributes:
        status: the HTTP status to answer the agent with (the upstream's own for an error
            response; 502 when it could not be reached or answered something that is not JSON;
            504 when it timed out).
        body: the OpenAI-shaped error body to answer with (the key redacted).
    """

    def __init__(self, status: int, body: dict[str, Any]):
        super().__init__(f"upstream answered {status}")
        self.status = status
        self.body = body


@dataclass(frozen=True)
class Upstream:
    """Where proxy mode forwards chat calls.

    Attributes:
        base_url: the upstream's API root, the part before ``/chat/completions``
            (``https://api.openai.com/v1``, ``http://127.0.0.1:8080/v1``).
        model: the model name sent upstream; ``None``: the name the agent asked for.
        api_key: sent as ``Authorization: Bearer <key>``; ``None``: no header. Not in the repr.
        timeout_s: per-call timeout, seconds (connect, read and write each).

    Raises:
        ValueError: ``base_url`` is not an ``http(s)://`` URL, or ``timeout_s`` is not positive.
    """

    base_url: str
    model: str | None = None
    api_key: str | None = field(default=None, repr=False)
    timeout_s: float = 600.0

    def __post_init__(self) -> None:
        if not self.base_url.startswith(("http://", "https://")):
            raise ValueError(f"upstream URL must start with http:// or https://, got {self.base_url!r}")
        if not self.timeout_s > 0:
            raise ValueError(f"upstream timeout must be positive seconds, got {self.timeout_s}")
        object.__setattr__(self, "base_url", self.base_url.rstrip("/"))

    def redact(self, text: str) -> str:
        """``text`` with the API key replaced by :data:`REDACTED`."""
        return text.replace(self.api_key, REDACTED) if self.api_key else text


def forwarded_body(request: Mapping[str, Any], model: str, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
                   temperature: float | None, top_p: float | None) -> dict[str, Any]:  # fmt: skip
    """The JSON body sent upstream for one chat call (module docstring), built in one place.

    Args:
        request: the agent's request as validated, unset fields left out.
        model: the upstream model name (the proxy's ``--upstream-model``, else the name the agent asked for).
        messages / tools: what to send (the agent's, with any prompt policy applied; ``tools``
            ``None``: the request's own field, if any, is left as it is).
        temperature / top_p: the rollout's overrides (``None``: the agent's own value, or none).
    """
    body = dict(request)
    body["model"] = model
    body["messages"] = messages
    if tools is not None:
        body["tools"] = tools
    if temperature is not None:
        body["temperature"] = temperature
    if top_p is not None:
        body["top_p"] = top_p
    if body.get("stream"):
        body["stream_options"] = {**(body.get("stream_options") or {}), "include_usage": True}
    return body


class UpstreamClient:
    """An HTTP client for :class:`Upstream` (httpx; one connection pool, made in the event loop
    that first uses it; :meth:`aclose` in the same loop)."""

    def __init__(self, upstream: Upstream):
        self.upstream = upstream
        self._client: httpx.AsyncClient | None = None

    def _http(self) -> httpx.AsyncClient:
        if self._client is None:
            headers = {"Authorization": f"Bearer {self.upstream.api_key}"} if self.upstream.api_key else {}
            # no pool timeout: a call waiting for one of the pool's connections (more agents than
            # connections) is queueing, not an upstream failure; under load such waits passed the
            # call timeout and were recorded as 504s of whichever prompt queued most (a gate of
            # make demo-prompt on a busy machine counted 148 of them against its candidate)
            self._client = httpx.AsyncClient(base_url=self.upstream.base_url, headers=headers,
                                             timeout=httpx.Timeout(self.upstream.timeout_s, pool=None))  # fmt: skip
        return self._client

    async def aclose(self) -> None:
        """Close the connection pool (a later call opens a new one)."""
        if self._client is not None:
            client, self._client = self._client, None
            await client.aclose()

    def _failure(self, status: int, text: str) -> UpstreamError:
        text = self.upstream.redact(text)
        try:
            body = json.loads(text)
        except ValueError:
            body = None
        if not (isinstance(body, dict) and isinstance(body.get("error"), dict)):
            body = {"error": {"message": f"the upstream answered {status}: {text[:500]}", "type": "upstream_error",
                              "param": None, "code": None}}  # fmt: skip
        return UpstreamError(status, body)

    def _unreachable(self, exc: httpx.HTTPError) -> UpstreamError:
        status = 504 if isinstance(exc, httpx.TimeoutException) else 502
        message = self.upstream.redact(f"the upstream model server could not be reached ({type(exc).__name__}: {exc})")
        return UpstreamError(status, {"error": {"message": message, "type": "upstream_error", "param": None, "code": None}})

    async def complete(self, body: dict[str, Any]) -> dict[str, Any]:
        """POST ``/chat/completions`` (no stream): the upstream's JSON response.

        Raises:
            UpstreamError: an error status, a body that is not a JSON object, or a transport failure.
        """
        try:
            response = await self._http().post("/chat/completions", json=body)
        except httpx.HTTPError as exc:
            raise self._unreachable(exc) from None
        if response.status_code >= 400:
            raise self._failure(response.status_code, response.text)
        try:
            data = response.json()
        except ValueError:
            data = None
        if not isinstance(data, dict) or not isinstance(data.get("choices"), list):
            raise self._failure(502, response.text)
        return data

    async def stream(self, body: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
        """POST ``/chat/completions`` with ``stream: true``: the chunks, parsed, in order (the
        ``[DONE]`` sentinel ends the iteration; lines that are not ``data:`` are skipped).

        Raises:
            UpstreamError: before the first chunk: an error status or a transport failure; after it:
                a transport failure, or a chunk that is not JSON (the caller has begun answering
                and reports it in the stream).
        """
        try:
            async with self._http().stream("POST", "/chat/completions", json=body) as response:
                if response.status_code >= 400:
                    raise self._failure(response.status_code, (await response.aread()).decode("utf-8", "replace"))
                async for line in response.aiter_lines():
                    if not line.startswith("data:"):
                        continue
                    data = line[5:].strip()
                    if data == "[DONE]":
                        return
                    try:
                        chunk = json.loads(data)
                    except ValueError:
                        raise self._failure(502, data) from None
                    if isinstance(chunk, dict) and "error" in chunk and "choices" not in chunk:
                        raise self._failure(502, data)
                    yield chunk
        except httpx.HTTPError as exc:
            raise self._unreachable(exc) from None


@dataclass
class StreamedChoice:
    """One choice of a streamed upstream answer, assembled from its deltas.

    Attributes:
        content: the text deltas joined (``None`` when none came).
        tool_calls: OpenAI ``tool_calls`` assembled by their ``index`` (``id``, ``type``,
            ``function.name``; ``function.arguments`` the argument deltas joined).
        finish_reason: the last one the upstream sent (``None``: the stream ended without one).
    """

    content: str | None = None
    tool_calls: dict[int, dict[str, Any]] = field(default_factory=dict)
    finish_reason: str | None = None

    def add(self, delta: Mapping[str, Any], finish_reason: str | None) -> None:
        """Fold one chunk's ``delta`` (and ``finish_reason``) of this choice in."""
        if isinstance(delta.get("content"), str):
            self.content = (self.content or "") + delta["content"]
        for piece in delta.get("tool_calls") or ():
            call = self.tool_calls.setdefault(int(piece.get("index", 0)), {"id": None, "type": "function",
                                                                           "function": {"name": "", "arguments": ""}})  # fmt: skip
            if piece.get("id"):
                call["id"] = piece["id"]
            function = piece.get("function") or {}
            call["function"]["name"] += function.get("name") or ""
            call["function"]["arguments"] += function.get("arguments") or ""
        if finish_reason:
            self.finish_reason = finish_reason

    def message(self) -> dict[str, Any]:
        """The assembled assistant message (``content``; ``tool_calls`` in index order when any)."""
        message: dict[str, Any] = {"role": "assistant", "content": self.content}
        if self.tool_calls:
            message["tool_calls"] = [self.tool_calls[k] for k in sorted(self.tool_calls)]
        return message


def fold_chunks(chunks: list[dict[str, Any]]) -> tuple[dict[int, StreamedChoice], dict[str, int] | None]:
    """The choices (by index) and the usage (``None`` when no chunk carried one) of a streamed
    upstream answer's chunks (:meth:`UpstreamClient.stream`)."""
    choices: dict[int, StreamedChoice] = {}
    usage = None
    for chunk in chunks:
        for choice in chunk.get("choices") or ():
            choices.setdefault(int(choice.get("index", 0)), StreamedChoice()).add(choice.get("delta") or {}, choice.get("finish_reason"))
        if chunk.get("usage"):
            usage = chunk["usage"]
    return choices, usage
