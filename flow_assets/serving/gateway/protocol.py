"""The HTTP protocol of the gateway: OpenAI's chat completion request and error shapes, and
flowopt's rollout endpoints.

Requests are validated here, so a client learns which field is wrong with a 400 in OpenAI's error
shape (``{"error": {"message", "type", "param", "code"}}``) instead of a 500. Fields it uses
are type-checked. Fields that would change what is sampled but cannot be honoured (repetition
penalties, ``logit_bias``, the legacy ``functions``, audio, images) are refused by name unless they
carry their neutral value; fields without effect on sampling (``metadata``, ``store``,
``service_tier`` ...) are accepted and ignored. docs/gateway.md's support table lists them, and a
test checks every row of it.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator


class FunctionCall(BaseModel):
    """``tool_calls[].function`` of an assistant message."""

    model_config = ConfigDict(extra="ignore")
    name: str
    arguments: str | dict[str, Any] = "{}"


class ToolCallIn(BaseModel):
    """A tool call the agent sends back in its history."""

    model_config = ConfigDict(extra="ignore")
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class Message(BaseModel):
    """One chat message (``content`` a string or a list of ``{"type": "text", "text": ...}`` parts).

    Raises:
        pydantic.ValidationError: a content part that is not text (``image_url``,
            ``input_audio``, ``file``): the policies served are text-only, and a part silently
            dropped would train the policy on a conversation the agent never had.
    """

    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None
    tool_call_id: str | None = None

    @field_validator("content")
    @classmethod
    def _text_parts_only(cls, value: str | list[dict[str, Any]] | None) -> str | list[dict[str, Any]] | None:
        if isinstance(value, list):
            for k, part in enumerate(value):
                kind = part.get("type")
                if kind != "text" or not isinstance(part.get("text"), str):
                    raise ValueError(f"content part {k} has type {kind!r}: only text parts are supported (this policy reads no images, audio or files)")
        return value


class FunctionSpec(BaseModel):
    """``tools[].function``: a function the model may call (JSON Schema ``parameters``)."""

    model_config = ConfigDict(extra="ignore")
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None


class ToolSpec(BaseModel):
    """One entry of ``tools``."""

    model_config = ConfigDict(extra="ignore")
    type: Literal["function"] = "function"
    function: FunctionSpec


class StreamOptions(BaseModel):
    """``stream_options``: ``include_usage`` adds a last chunk with the usage (and ``"usage":
    null`` to every other chunk)."""

    model_config = ConfigDict(extra="ignore")
    include_usage: bool = False


class ChatCompletionRequest(BaseModel):
    """``POST /v1/chat/completions`` (``stream: true``: Server-Sent Events,
    :mod:`flow_assets.serving.gateway.streaming`).

    ``tool_choice`` ``"required"`` or ``{"type": "function", "function": {"name"}}`` and
    ``response_format`` ``json_object`` / ``json_schema`` are enforced by constrained decoding
    (:mod:`flow_assets.policy.constrained`; one call or more with ``parallel_tool_calls``, the
    default); ``"auto"`` leaves the choice to the policy and ``"none"`` stops the gateway from
    parsing calls. ``top_logprobs`` is accepted; the returned ``top_logprobs`` lists are empty
    (the sampled token's log-prob is exact).
    """

    model_config = ConfigDict(extra="ignore")
    model: str = Field(min_length=1)
    messages: list[Message] = Field(min_length=1)
    tools: list[ToolSpec] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    response_format: dict[str, Any] | None = None
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    n: int = Field(1, ge=1, le=64)
    # a 64-bit signed integer, as OpenAI's schema says: larger seeds cannot seed a generator
    seed: int | None = Field(None, ge=-(2**63), le=2**63 - 1)
    stop: str | list[str] | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=20)
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    user: str | None = None

    @property
    def forces_call(self) -> bool:
        """``tool_choice`` is ``"required"`` or names a tool (the completion must be a call)."""
        return self.tool_choice not in (None, "none", "auto")

    @property
    def formats(self) -> bool:
        """``response_format`` asks for JSON (``json_object`` / ``json_schema``)."""
        return bool(self.response_format) and self.response_format.get("type") != "text"

    @field_validator("tool_choice")
    @classmethod
    def _tool_choice(cls, value: str | dict[str, Any] | None) -> str | dict[str, Any] | None:
        # OpenAI's shapes: "none" | "auto" | "required" | {"type": "function", "function": {"name"}}
        if isinstance(value, str) and value not in ("none", "auto", "required"):
            raise ValueError("tool_choice must be 'none', 'auto', 'required' or {'type': 'function', 'function': {'name': ...}}")
        if isinstance(value, dict):
            function = value.get("function")
            if value.get("type") != "function" or not isinstance(function, dict) or not isinstance(function.get("name"), str):
                raise ValueError("a named tool_choice is {'type': 'function', 'function': {'name': <a tool's name>}}")
        return value

    @field_validator("response_format")
    @classmethod
    def _response_format(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        # OpenAI's shapes: {"type": "text"} | {"type": "json_object"} |
        # {"type": "json_schema", "json_schema": {"name", "description"?, "schema"?, "strict"?}}
        if value is None:
            return None
        kind = value.get("type")
        if kind not in ("text", "json_object", "json_schema"):
            raise ValueError("response_format.type must be 'text', 'json_object' or 'json_schema'")
        if kind == "json_schema":
            spec = value.get("json_schema")
            if not isinstance(spec, dict) or not isinstance(spec.get("name"), str) or not spec["name"]:
                raise ValueError("response_format json_schema needs 'json_schema': {'name': ..., 'schema': {...}}")
            if "schema" in spec and not isinstance(spec["schema"], dict):
                raise ValueError("response_format.json_schema.schema must be a JSON Schema object")
        return value

    @field_validator("stop")
    @classmethod
    def _stop_list(cls, value: str | list[str] | None) -> list[str] | None:
        if value is None:
            return None
        stops = [value] if isinstance(value, str) else value
        if len(stops) > 4 or any(not s for s in stops):
            raise ValueError("stop must be up to 4 non-empty strings")
        return stops

    # Fields that would change what is sampled and that the gateway cannot honour: their neutral
    # values (what clients send by default) pass, any other is refused by name rather than
    # silently ignored, so an agent never believes a setting took effect when it did not.
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    functions: list[dict[str, Any]] | None = None
    function_call: str | dict[str, Any] | None = None
    modalities: list[str] | None = None
    audio: dict[str, Any] | None = None
    prediction: dict[str, Any] | None = None

    @field_validator("frequency_penalty", "presence_penalty")
    @classmethod
    def _no_penalty(cls, value: float | None) -> float | None:
        if value:
            raise ValueError("repetition penalties are not supported (sampling is temperature and top_p only): send 0 or omit it")
        return value

    @field_validator("logit_bias")
    @classmethod
    def _no_bias(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        if value:
            raise ValueError("logit_bias is not supported: omit it (or send {})")
        return value

    @field_validator("functions", "function_call")
    @classmethod
    def _no_legacy_functions(cls, value: Any) -> Any:
        if value:
            raise ValueError("the legacy functions / function_call fields are not supported: send tools and tool_choice")
        return value

    @field_validator("modalities")
    @classmethod
    def _text_only(cls, value: list[str] | None) -> list[str] | None:
        if value and any(m != "text" for m in value):
            raise ValueError("only the text modality is served")
        return value

    @field_validator("audio", "prediction")
    @classmethod
    def _not_served(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        if value is not None:
            raise ValueError("not supported by this gateway (text completions only, no predicted outputs)")
        return value


class RolloutOpen(BaseModel):
    """``POST /rollouts``: open a rollout (see :class:`~flow_assets.serving.gateway.capture.RolloutSettings`)."""

    model_config = ConfigDict(extra="forbid")
    rollout_id: str | None = Field(None, min_length=1, max_length=200)
    task_id: str | None = Field(None, min_length=1)
    query: str | None = None
    agent_id: str | None = Field(None, min_length=1)
    trajectory_id: str | None = Field(None, min_length=1)
    batch: str | None = None
    source: str | None = None
    land: bool = True
    model: str | None = None
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    seed: int | None = Field(None, ge=-(2**63), le=2**63 - 1)
    metadata: dict[str, Any] = Field(default_factory=dict)


class RolloutFinish(BaseModel):
    """``POST /rollouts/{id}/finish``: the outcome (``success`` and/or ``score``), or an ``error``
    that makes it a failed rollout (score 0)."""

    model_config = ConfigDict(extra="forbid")
    success: bool | None = None
    score: float | None = Field(None, allow_inf_nan=False)
    final_answer: str | None = None
    task_id: str | None = Field(None, min_length=1)
    query: str | None = None
    agent_id: str | None = Field(None, min_length=1)
    metadata: dict[str, Any] = Field(default_factory=dict)
    error: str | None = None
    error_kind: str = "agent_error"


def error_body(message: str, kind: str = "invalid_request_error", param: str | None = None, code: str | None = None) -> dict:
    """OpenAI's error JSON."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def validation_message(exc: ValidationError | Any) -> tuple[str, str | None]:
    """``(message, param)`` for the first problem of a pydantic / FastAPI validation error,
    naming the field (``messages.0.role``)."""
    errors = exc.errors()
    if not errors:
        return "invalid request", None
    first = errors[0]
    loc = [str(p) for p in first.get("loc", ()) if p not in ("body",)]
    param = ".".join(loc) or None
    return (f"Invalid value for '{param}': {first.get('msg')}" if param else str(first.get("msg"))), param
