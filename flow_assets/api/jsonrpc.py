"""JSON-RPC 2.0 (https://www.jsonrpc.org/specification) for the training API, as plain functions.

A :class:`Dispatcher` maps method names to handlers whose parameters are a pydantic model; it
takes the bytes of one HTTP request body and returns the bytes of the response body (or ``None``
when the request held only notifications). Everything the specification asks for is here:
single and batch requests, notifications (no ``id``: no response), by-name (object) and
by-position (array) parameters, and the error objects:

=======  ===================  ===================================================================
code     name                 when
=======  ===================  ===================================================================
-32700   parse error          the body is not JSON (or not UTF-8), or nests deeper than Python's
                              parser goes (``RecursionError``)
-32600   invalid request      not a request object: ``jsonrpc`` not ``"2.0"``, no string
                              ``method``, ``params`` neither object nor array, a bad ``id``; an
                              empty batch, or one of more than ``max_batch`` calls (refused whole,
                              nothing runs)
-32601   method not found     an unknown method
-32602   invalid params       the parameters do not validate; ``data.errors`` names each field
-32603   internal error       a handler failed unexpectedly; ``data.error_id`` finds it in the
                              server log, the response never holds a stack trace
-32001   unauthorised         (HTTP layer) no or a wrong bearer token
-32002   unknown job          no job with that id
-32003   budget exceeded      the agent's monthly budget is spent
-32004   invalid job state    e.g. resume a job that is not paused
=======  ===================  ===================================================================

No error message names a file of the server: every message passes :func:`scrub_paths`.
"""

from __future__ import annotations

import json
import logging
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ValidationError

from flow_assets.core.untrusted import scrub_paths  # noqa: F401 (re-exported: the API's handlers scrub with it)

PARSE_ERROR = -32700
INVALID_REQUEST = -32600
METHOD_NOT_FOUND = -32601
INVALID_PARAMS = -32602
INTERNAL_ERROR = -32603
UNAUTHORISED = -32001
UNKNOWN_JOB = -32002
BUDGET_EXCEEDED = -32003
INVALID_STATE = -32004

log = logging.getLogger("flowopt.api")

#: the most calls one batch may hold unless the dispatcher is told otherwise
DEFAULT_MAX_BATCH = 100

class RpcError(Exception):
    """An error a handler reports to the caller as a JSON-RPC error object (``code``, ``message``,
    optional ``data``); the application codes are the module's constants."""

    def __init__(self, code: int, message: str, data: Any = None):
        super().__init__(message)
        self.code, self.message, self.data = code, message, data


@dataclass(frozen=True)
class Method:
    """A registered method: its parameter model and its handler ``fn(params) -> result``."""

    name: str
    params: type[BaseModel]
    fn: Callable[[Any], Any]


def _error(code: int, message: str, ident: Any = None, data: Any = None) -> dict:
    error = {"code": code, "message": scrub_paths(message)}
    if data is not None:
        error["data"] = data
    return {"jsonrpc": "2.0", "error": error, "id": ident}


def _field_errors(exc: ValidationError) -> list[dict[str, str]]:
    return [{"field": ".".join(str(p) for p in e["loc"]) or "(params)", "message": e["msg"]} for e in exc.errors()]


class Dispatcher:
    """Methods by name, and the JSON-RPC 2.0 framing around them.

    Args:
        max_batch: the most calls one batch request may hold; a longer batch is refused whole
            (-32600, nothing runs), so one HTTP request cannot hold the server for thousands of
            calls.

    Raises:
        ValueError: ``max_batch`` < 1.
    """

    def __init__(self, max_batch: int = DEFAULT_MAX_BATCH) -> None:
        if max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {max_batch}")
        self.methods: dict[str, Method] = {}
        self.max_batch = max_batch

    def method(self, name: str, params: type[BaseModel]) -> Callable[[Callable[[Any], Any]], Callable[[Any], Any]]:
        """Decorator: register ``fn(params: <params model>) -> JSON-serialisable result`` as
        ``name``."""

        def register(fn: Callable[[Any], Any]) -> Callable[[Any], Any]:
            self.methods[name] = Method(name, params, fn)
            return fn

        return register

    def call_one(self, request: Any) -> dict | None:
        """The response object of one request object, or ``None`` for a notification."""
        if not isinstance(request, dict):
            return _error(INVALID_REQUEST, "a request must be a JSON object")
        ident = request.get("id")
        if "id" in request and not (ident is None or isinstance(ident, (str, int)) and not isinstance(ident, bool)):
            return _error(INVALID_REQUEST, "id must be a string, an integer or null")
        if request.get("jsonrpc") != "2.0":
            return _error(INVALID_REQUEST, 'jsonrpc must be "2.0"', ident)
        name = request.get("method")
        if not isinstance(name, str):
            return _error(INVALID_REQUEST, "method must be a string", ident)
        raw = request.get("params", {})
        if not isinstance(raw, (dict, list)):
            return _error(INVALID_REQUEST, "params must be an object or an array", ident)
        notification = "id" not in request
        method = self.methods.get(name)
        if method is None:
            return None if notification else _error(METHOD_NOT_FOUND, f"unknown method {name!r}", ident, {"methods": sorted(self.methods)})
        try:
            if isinstance(raw, list):
                fields = list(method.params.model_fields)
                if len(raw) > len(fields):
                    raise RpcError(INVALID_PARAMS, f"{name} takes at most {len(fields)} positional params", {"params": fields})
                raw = dict(zip(fields, raw))
            params = method.params.model_validate(raw)
        except ValidationError as exc:
            errors = _field_errors(exc)
            response = _error(INVALID_PARAMS, "invalid params: " + "; ".join(f"{e['field']}: {e['message']}" for e in errors), ident, {"errors": errors})
            return None if notification else response
        except RpcError as exc:
            return None if notification else _error(exc.code, exc.message, ident, exc.data)
        try:
            result = method.fn(params)
        except RpcError as exc:
            return None if notification else _error(exc.code, exc.message, ident, exc.data)
        except Exception:  # never a stack trace to the caller: an id to find it in the log
            error_id = uuid.uuid4().hex[:12]
            log.exception(json.dumps({"event": "rpc_internal_error", "method": name, "error_id": error_id}))
            return None if notification else _error(INTERNAL_ERROR, "internal error", ident, {"error_id": error_id})
        return None if notification else {"jsonrpc": "2.0", "result": result, "id": ident}

    def handle(self, body: bytes) -> bytes | None:
        """The response body for a request body (single or batch); ``None`` when nothing is to
        be answered (only notifications)."""
        try:
            payload = json.loads(body)
        except (UnicodeDecodeError, ValueError):
            return json.dumps(_error(PARSE_ERROR, "parse error: the body is not JSON")).encode()
        except RecursionError:
            return json.dumps(_error(PARSE_ERROR, "parse error: the body nests too deeply")).encode()
        if isinstance(payload, list):
            if not payload:
                return json.dumps(_error(INVALID_REQUEST, "an empty batch")).encode()
            if len(payload) > self.max_batch:
                message = f"a batch of {len(payload)} calls exceeds this server's limit of {self.max_batch}; send it as several requests"
                return json.dumps(_error(INVALID_REQUEST, message, None, {"calls": len(payload), "max_batch": self.max_batch})).encode()
            responses = [r for r in (self.call_one(item) for item in payload) if r is not None]
            return json.dumps(responses).encode() if responses else None
        response = self.call_one(payload)
        return json.dumps(response).encode() if response is not None else None
