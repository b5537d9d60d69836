"""What stands in front of the gateway's routes: bearer tokens and request limits.

:class:`RequestGuard` is an ASGI middleware, so it decides before FastAPI reads anything:

1. **Token**: when the gateway has tokens, every route but ``/health`` needs
   ``Authorization: Bearer <token>`` or ``Bearer <token>:<rollout id>`` (or the same key as
   ``x-api-key``, as Anthropic's clients send it; checked from the headers
   alone by :func:`check_key`, constant-time compares as the training API's
   :func:`~flow_assets.core.untrusted.authorised`); otherwise HTTP 401 and the body is never read.
   OpenAI clients send their ``api_key`` this way, so an agent that can set nothing but its API
   key names its rollout with it (the route reads the rollout id with :func:`check_key` too).
2. **Size**: a declared ``Content-Length`` over ``max_body_bytes`` is HTTP 413 at once, before any
   of the body is read; a chunked body is 413 as soon as what arrived passes the cap. No request
   holds more than ``max_body_bytes`` of the gateway's memory.
3. **Time**: a body not received whole within ``body_timeout_s`` of its headers is HTTP 408 (a
   client trickling bytes does not hold a connection open forever).
4. **Nesting**: a JSON body nested deeper than ``max_json_depth`` is HTTP 400 (``json_too_deep``)
   instead of a ``RecursionError`` deep inside the JSON decoder, pydantic or the trajectory writer.

Each refusal is OpenAI's error shape and says ``Connection: close``, so uvicorn drops the
connection rather than wait for the rest of a body nobody will read. A body that passes is handed
to the app exactly as received.
"""

from __future__ import annotations

import asyncio
import hmac
import json
from collections.abc import Sequence
from dataclasses import dataclass

import orjson

from flow_assets.core.untrusted import json_depth

#: routes that answer without a token (liveness probes of a load balancer)
OPEN_PATHS = frozenset({"/health"})


@dataclass(frozen=True)
class RequestLimits:
    """What one request may cost the gateway (module docstring for how each is enforced).

    Attributes:
        max_body_bytes: largest request body, bytes (default 8 MiB: a long multi-turn conversation
            or the harness opening a thousand rollouts in one call is well under 1 MiB); larger
            is HTTP 413.
        body_timeout_s: seconds to receive the whole body once the headers are in (default 60);
            slower is HTTP 408.
        max_json_depth: deepest nesting of objects and arrays a JSON body may have (default 64;
            a chat request with tool schemas nests about 10 deep); deeper is HTTP 400.

    Raises:
        ValueError: a limit that is not positive.
    """

    max_body_bytes: int = 8 * 1024 * 1024
    body_timeout_s: float = 60.0
    max_json_depth: int = 64

    def __post_init__(self) -> None:
        for name in ("max_body_bytes", "body_timeout_s", "max_json_depth"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)!r}")


def bearer_key(authorization: str | None) -> str | None:
    """The API key of an ``Authorization: Bearer <key>`` header (``None`` without one)."""
    if not authorization or not authorization.startswith("Bearer "):
        return None
    return authorization[len("Bearer ") :] or None


def check_key(key: str | None, tokens: Sequence[str]) -> tuple[bool, str | None]:
    """Whether API key ``key`` may call the gateway, and the rollout id it names.

    With ``tokens``, the key is a token, or ``<token>:<rollout id>``: every token is compared
    with both forms by ``hmac.compare_digest`` (no early exit, so the time says nothing of the
    tokens' contents); a key that is a token names no rollout, and when several tokens prefix
    the key, the longest wins. Without tokens,
    anyone may call and the whole key is the candidate rollout id (the gateway uses it only when
    such a rollout exists: a dummy key such as ``"x"`` names nothing).

    Returns:
        ``(authorised, rollout id or None)``; ``(False, None)`` for a key that matches no token.
    """
    live = [t for t in tokens if t]
    if not live:
        return True, key
    if not key:
        return False, None
    given = key.encode()
    whole, rollout, longest = False, None, -1
    for token in live:
        raw = token.encode()
        whole |= hmac.compare_digest(given, raw)
        prefixed = hmac.compare_digest(given[: len(raw) + 1], raw + b":")
        if prefixed and len(raw) > longest and len(given) > len(raw) + 1:
            longest, rollout = len(raw), given[len(raw) + 1 :].decode()
    if whole:  # a key that is a token names no rollout, whichever other token prefixes it
        return True, None
    return rollout is not None, rollout


def too_deep(body: bytes, max_depth: int) -> bool:
    """Whether ``body`` is JSON nested deeper than ``max_depth``. orjson refuses more than 1,024
    levels by itself (a decode error naming the depth); a body that is not JSON for any other
    reason is not this check's business (the route answers it)."""
    try:
        value = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        return "depth" in str(exc)
    return json_depth(value) > max_depth


class RequestGuard:
    """ASGI middleware enforcing ``tokens`` and ``limits`` on every HTTP request (module docstring).

    Args:
        app: the ASGI app behind it.
        tokens: bearer tokens accepted; empty: no token is asked for (a gateway bound to loopback).
        limits: request limits.
    """

    def __init__(self, app, tokens: Sequence[str] = (), limits: RequestLimits | None = None):
        self.app = app
        self.tokens = tuple(t for t in tokens if t)
        self.limits = limits or RequestLimits()

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
        # x-api-key: how Anthropic's clients send their key (the Messages API route)
        keys = (bearer_key(headers.get("authorization")), headers.get("x-api-key"))
        if self.tokens and scope.get("path") not in OPEN_PATHS and not any(check_key(k, self.tokens)[0] for k in keys if k):
            await _refuse(send, 401, "a valid bearer token is required (Authorization: Bearer <token> or <token>:<rollout id>, or x-api-key: the same)", "invalid_api_key")
            return
        limits = self.limits
        declared = headers.get("content-length")
        if declared is not None:
            if not declared.strip().isdigit():
                await _refuse(send, 400, "Content-Length is not a number", "invalid_content_length")
                return
            if int(declared) > limits.max_body_bytes:
                await _refuse(send, 413, f"the body of {int(declared)} bytes exceeds this gateway's limit of {limits.max_body_bytes} bytes", "body_too_large")
                return
        chunks, size, more = [], 0, True
        try:
            async with asyncio.timeout(limits.body_timeout_s):
                while more:
                    message = await receive()
                    if message["type"] == "http.disconnect":
                        return  # the client went away: nobody to answer
                    chunk = message.get("body", b"")
                    size += len(chunk)
                    if size > limits.max_body_bytes:
                        await _refuse(send, 413, f"the body exceeds this gateway's limit of {limits.max_body_bytes} bytes", "body_too_large")
                        return
                    chunks.append(chunk)
                    more = message.get("more_body", False)
        except TimeoutError:
            await _refuse(send, 408, f"the body was not received within {limits.body_timeout_s:g} s", "body_timeout")
            return
        body = b"".join(chunks)
        if body and too_deep(body, limits.max_json_depth):
            await _refuse(send, 400, f"the JSON body nests objects or arrays deeper than {limits.max_json_depth} levels", "json_too_deep")
            return
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # after the body: disconnect notices, as the server sends them

        await self.app(scope, replay, send)


async def _refuse(send, status: int, message: str, code: str) -> None:
    """Answer with OpenAI's error shape and close the connection."""
    payload = json.dumps({"error": {"message": message, "type": "invalid_request_error", "param": None, "code": code}}).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode()), (b"connection", b"close")]
    if status == 401:
        headers.append((b"www-authenticate", b"Bearer"))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": payload})
