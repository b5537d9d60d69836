"""The message bus's three message kinds (the original design's schemas), validated strictly.

- ``tasks``: ``{task_id, input, metadata}``
- ``responses``: ``{task_id, response, agent_id, metadata}`` (+ optional ``adapter_version``,
  also read from ``metadata.adapter_version``)
- ``rewards``: ``{task_id, score, scoring_agent_id, metadata}`` (+ optional ``adapter_version``)

A message that is not UTF-8 JSON, not an object, or does not validate is never dropped: the
consumer quarantines it with the reason this module gives (naming the field). So is one larger
than ``max_bytes`` or nested deeper than ``max_depth``: parsing is bounded (orjson stops at 1,024
levels, an iterative walk enforces the tighter limit), so no message can raise ``RecursionError``
here or later when its record is written.
"""

from __future__ import annotations

import hashlib
from typing import Any

import orjson

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from flow_assets.logs.schema import FiniteFloat
from flow_assets.core.untrusted import json_depth

QUEUES = ("tasks", "responses", "rewards")
MAX_MESSAGE_BYTES = 8 * 1024 * 1024
"""Default cap on a message body (bytes): a larger one is quarantined unparsed."""
MAX_DEPTH = 64
"""Default cap on a body's nesting (objects and arrays, the body itself is level 1)."""


class TaskMessage(BaseModel):
    """A task put to the agents."""

    model_config = ConfigDict(extra="forbid", strict=True)
    task_id: str = Field(min_length=1)
    input: str
    metadata: dict[str, Any] = Field(default_factory=dict)


class _ServedBy(BaseModel):
    """A message that may name the adapter that served the response it is about."""

    adapter_version: str | None = None
    metadata: dict[str, Any] = Field(default_factory=dict)

    def adapter(self) -> str | None:
        """``adapter_version``, else ``metadata.adapter_version`` when it is a string."""
        fallback = self.metadata.get("adapter_version")
        return self.adapter_version or (fallback if isinstance(fallback, str) else None)


class ResponseMessage(_ServedBy):
    """An agent's response to a task; ``adapter_version`` says which adapter served it."""

    model_config = ConfigDict(extra="forbid", strict=True)
    task_id: str = Field(min_length=1)
    response: str
    agent_id: str = Field(min_length=1)


class RewardMessage(_ServedBy):
    """A scoring agent's score of a response (unitless; the flat format reads >= 0.5 as success)."""

    model_config = ConfigDict(extra="forbid", strict=True)
    task_id: str = Field(min_length=1)
    score: FiniteFloat
    scoring_agent_id: str = Field(min_length=1)


MODELS: dict[str, type[BaseModel]] = {"tasks": TaskMessage, "responses": ResponseMessage, "rewards": RewardMessage}


def message_id(body: bytes, property_id: str | None) -> str:
    """The id that de-duplicates redeliveries: the AMQP ``message_id`` property when the publisher
    set one, else ``sha256:<hex of the body>``."""
    return property_id if property_id else "sha256:" + hashlib.sha256(body).hexdigest()


def parse_message(queue: str, body: bytes, max_bytes: int = MAX_MESSAGE_BYTES, max_depth: int = MAX_DEPTH) -> tuple[BaseModel | None, str | None]:
    """``(message, None)``, or ``(None, reason)`` with the reason naming the field, e.g.
    ``score: Input should be a finite number``. Never raises on any body: a body over
    ``max_bytes`` (bytes) or nested deeper than ``max_depth`` levels is a reason like any other.
    JSON is read strictly (orjson: no ``NaN``, no integers beyond 64 bits)."""
    model = MODELS.get(queue)
    if model is None:
        return None, f"unknown queue {queue!r} (expected one of {', '.join(QUEUES)})"
    if len(body) > max_bytes:
        return None, f"body is {len(body):,} bytes, over the limit of {max_bytes:,}"
    try:
        body.decode("utf-8")
    except UnicodeDecodeError as exc:
        return None, f"body is not UTF-8 (byte {exc.start})"
    try:
        obj = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        if str(exc).startswith("depth limit exceeded"):  # orjson's own bound, 1,024 levels
            return None, f"body nests deeper than {max_depth} levels ({exc})"
        return None, f"body is not JSON: {exc}"
    if not isinstance(obj, dict):
        return None, f"body is a JSON {type(obj).__name__}, not an object"
    if json_depth(obj) > max_depth:
        return None, f"body nests deeper than {max_depth} levels"
    try:
        return model.model_validate(obj), None
    except ValidationError as exc:
        first = exc.errors()[0]
        field = ".".join(str(p) for p in first["loc"]) or "(body)"
        more = f" (+{exc.error_count() - 1} more)" if exc.error_count() > 1 else ""
        return None, f"{field}: {first['msg']}{more}"
