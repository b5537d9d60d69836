"""Anthropic's Messages API on the gateway: ``POST /v1/messages``, a translation over Chat Completions.

An agent written for Claude (the official ``anthropic`` client, an SDK or CLI built on it) calls
``POST /v1/messages`` (or ``/rollouts/{id}/v1/messages``); the request is translated into a
:class:`~flow_assets.serving.gateway.protocol.ChatCompletionRequest`, served by the gateway's
chat path, and its answer translated back. Capture is therefore exactly a chat call's: the
translated messages are rendered with the policy's chat template and the turn (prompt ids,
sampled ids, log-probs, tool-call ids) is recorded by the same code.

Spec: https://docs.anthropic.com/en/api/messages (request, response),
https://docs.anthropic.com/en/docs/build-with-claude/streaming (events),
https://docs.anthropic.com/en/api/errors (error shape); checked against the ``anthropic``
client's types (``anthropic.types.Message``, ``RawMessageStreamEvent``), which parse what this
module sends.

Request (:func:`to_chat_request`):

======================================  =====================================================
Messages                                Chat Completions
======================================  =====================================================
``system`` (string or text blocks)      a leading ``system`` message
``text`` blocks                         ``content`` (a string stays a string; blocks become
                                        text parts, which the template joins)
assistant ``tool_use`` blocks           ``tool_calls`` (``id``, ``name``, ``input`` as JSON
                                        ``arguments``)
user ``tool_result`` blocks             one ``tool`` message each (``tool_call_id`` =
                                        ``tool_use_id``); ``is_error: true`` puts ``Error: ``
                                        before its text; the message's text blocks follow as a
                                        ``user`` message
``tools`` (``name``, ``description``,   ``function`` tools (``input_schema`` = ``parameters``)
``input_schema``)
``tool_choice`` auto / any / tool /     ``"auto"`` / ``"required"`` / the named function /
none                                    ``"none"`` (recorded, not enforced, as for chat)
``max_tokens``, ``stop_sequences``,     ``max_tokens``, ``stop``, ``temperature``, ``top_p``
``temperature`` (0..1), ``top_p``
``metadata.user_id``                    ``user`` (the live A/B's session when no
                                        ``X-Session-ID``)
``seed`` (a gateway extension)          ``seed``
======================================  =====================================================

Refused with 400 naming the field: ``image`` and ``document`` blocks (and any other block type
but ``text``, ``tool_use``, ``tool_result``), ``thinking`` enabled, server tools (a ``tools``
entry whose ``type`` is not ``custom``), ``mcp_servers``, ``output_config.format`` (structured
outputs), a last message from the assistant (prefill: the chat template opens a new assistant
turn). Accepted and ignored: ``top_k`` (sampling is ``temperature`` + ``top_p``),
``tool_choice.disable_parallel_tool_use``, ``cache_control``, ``output_config.effort``,
``service_tier`` and other fields, the ``anthropic-version`` and ``anthropic-beta`` headers.
Recent ``anthropic`` clients no longer offer ``temperature`` / ``top_p`` as arguments; the
gateway still honours them in the body (``extra_body``, older clients, other SDKs).

Response (:func:`to_message`): a ``message`` whose ``content`` is the text (a ``text`` block
when not empty) then one ``tool_use`` block per call, with the gateway's call id; ``stop_reason``
``tool_use`` / ``max_tokens`` / ``stop_sequence`` (with ``stop_sequence``, the chat choice's
vLLM-style ``stop_reason``) / ``end_turn``.

Streaming (:func:`stream_events`): ``message_start``, per block ``content_block_start``,
``content_block_delta`` (``text_delta``; ``input_json_delta`` with the whole arguments as one
``partial_json``), ``content_block_stop``, then ``message_delta`` (``stop_reason``,
``usage``) and ``message_stop``; a failure after the stream began is ``event: error``.

Errors are Anthropic's ``{"type": "error", "error": {"type", "message"}}`` with the HTTP status
(:func:`error_response`); the message begins with the field it is about.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, Literal

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator
from sse_starlette import ServerSentEvent

from flow_assets.core.untrusted import scrub_paths
from flow_assets.serving.gateway.protocol import ChatCompletionRequest
from flow_assets.serving.gateway.streaming import ChatStream

#: Anthropic's error ``type`` per HTTP status (https://docs.anthropic.com/en/api/errors); other
#: 4xx statuses are ``invalid_request_error``, other 5xx ``api_error``
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    529: "overloaded_error",
}

#: chat request fields -> the Messages field they came from (for error messages)
_CHAT_FIELDS = {"stop": "stop_sequences", "user": "metadata.user_id", "tool_choice": "tool_choice", "tools": "tools"}

#: chat ``finish_reason`` -> Messages ``stop_reason`` (``stop`` is ``end_turn`` or ``stop_sequence``)
_STOP_REASONS = {"tool_calls": "tool_use", "length": "max_tokens", "stop": "end_turn"}


class RequestError(ValueError):
    """A request the gateway refuses: ``param`` names the field (``messages.1.content.0.type``)."""

    def __init__(self, param: str | None, message: str):
        super().__init__(f"{param}: {message}" if param else message)
        self.param = param


class TextBlock(BaseModel):
    """A ``text`` content block (``cache_control`` and ``citations`` are ignored)."""

    model_config = ConfigDict(extra="ignore")
    type: Literal["text"]
    text: str


class ToolUseBlock(BaseModel):
    """An assistant's ``tool_use`` block: a call of tool ``name`` with arguments ``input``."""

    model_config = ConfigDict(extra="ignore")
    type: Literal["tool_use"]
    id: str = Field(min_length=1)
    name: str = Field(min_length=1)
    input: dict[str, Any]


class ToolResultBlock(BaseModel):
    """A user's ``tool_result`` block: the result of call ``tool_use_id`` (``content`` a string or
    text blocks; ``is_error`` marks a failed call)."""

    model_config = ConfigDict(extra="ignore")
    type: Literal["tool_result"]
    tool_use_id: str = Field(min_length=1)
    content: str | list[dict[str, Any]] | None = None
    is_error: bool | None = None


class MessageParam(BaseModel):
    """One entry of ``messages`` (blocks are checked by :func:`to_chat_request`, which names the
    block a refusal is about)."""

    model_config = ConfigDict(extra="ignore")
    role: Literal["user", "assistant"]
    content: str | list[dict[str, Any]]


class ToolChoice(BaseModel):
    """``tool_choice``: ``auto``, ``any``, ``tool`` (with ``name``) or ``none``."""

    model_config = ConfigDict(extra="ignore")
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = Field(None, min_length=1)
    disable_parallel_tool_use: bool | None = None

    @model_validator(mode="after")
    def _named(self) -> "ToolChoice":
        if self.type == "tool" and not self.name:
            raise ValueError("a tool_choice of type 'tool' needs the tool's 'name'")
        return self


class Metadata(BaseModel):
    """``metadata``: ``user_id`` (the live A/B's session unit)."""

    model_config = ConfigDict(extra="ignore")
    user_id: str | None = None


class MessagesRequest(BaseModel):
    """``POST /v1/messages`` (https://docs.anthropic.com/en/api/messages). ``tools``, ``system``
    and ``thinking`` are checked by :func:`to_chat_request`; ``top_k`` is accepted and ignored;
    ``seed`` is the gateway's extension."""

    model_config = ConfigDict(extra="ignore")
    model: str = Field(min_length=1)
    messages: list[MessageParam] = Field(min_length=1)
    max_tokens: int = Field(ge=1)
    system: str | list[dict[str, Any]] | None = None
    stop_sequences: list[str] | None = Field(None, max_length=4)
    stream: bool | None = None
    temperature: float | None = Field(None, ge=0.0, le=1.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=0)
    tools: list[dict[str, Any]] | None = None
    tool_choice: ToolChoice | None = None
    metadata: Metadata | None = None
    thinking: dict[str, Any] | None = None
    mcp_servers: list[Any] | None = None
    output_config: dict[str, Any] | None = None
    # a gateway extension (``extra_body={"seed": 7}``), as for the Responses API: reproducible samples
    seed: int | None = Field(None, ge=-(2**63), le=2**63 - 1)


def parse_request(body: Any) -> MessagesRequest:
    """Validate a decoded JSON body as a :class:`MessagesRequest`.

    Raises:
        RequestError: the body is not an object, or a field is missing or wrong (named).
    """
    if not isinstance(body, dict):
        raise RequestError(None, "the request body must be a JSON object")
    try:
        return MessagesRequest.model_validate(body)
    except ValidationError as exc:
        raise _validation_error(exc, "") from None


def _validation_error(exc: ValidationError, prefix: str) -> RequestError:
    """The first problem of ``exc`` as a :class:`RequestError` naming its field under ``prefix``.
    pydantic's union members (``str``, ``list[...]``) are left out of the name."""
    first = exc.errors()[0]
    loc = [str(p) for p in first.get("loc", ()) if not (isinstance(p, str) and ("[" in p or p == "str"))]
    param = ".".join(([prefix] if prefix else []) + loc) or None
    return RequestError(param, str(first.get("msg")))


def _blocks(content: str | list[dict[str, Any]], param: str, allowed: tuple[str, ...]) -> list[BaseModel]:
    """The content blocks of ``content`` (a string is one text block), each validated; ``param``
    names ``content`` in errors.

    Raises:
        RequestError: a block of a type not in ``allowed``, or a malformed one.
    """
    if isinstance(content, str):
        return [TextBlock(type="text", text=content)]
    models = {"text": TextBlock, "tool_use": ToolUseBlock, "tool_result": ToolResultBlock}
    out = []
    for j, raw in enumerate(content):
        where = f"{param}.{j}"
        kind = raw.get("type")
        if kind not in allowed:
            if kind in ("image", "document"):
                why = f"{kind} blocks are not supported: the policy reads text only"
            elif kind in models:
                why = f"{kind} blocks are not allowed here (this message may hold {', '.join(allowed)} blocks)"
            else:
                why = f"{kind!r} blocks are not supported (only {', '.join(allowed)} blocks are)"
            raise RequestError(f"{where}.type", why)
        try:
            out.append(models[kind].model_validate(raw))
        except ValidationError as exc:
            raise _validation_error(exc, where) from None
    return out


def _text_parts(blocks: list[TextBlock]) -> str | list[dict[str, str]]:
    """Text blocks as chat content: one block is its string, several are text parts (the chat
    template joins them, as it joins OpenAI's parts)."""
    if len(blocks) == 1:
        return blocks[0].text
    return [{"type": "text", "text": b.text} for b in blocks]


def _system(system: str | list[dict[str, Any]]) -> str | list[dict[str, str]]:
    if isinstance(system, str):
        return system
    return _text_parts(_blocks(system, "system", ("text",)))  # type: ignore[arg-type]


def _tool(raw: dict[str, Any], i: int) -> dict[str, Any]:
    """A custom tool as a chat function tool.

    Raises:
        RequestError: a server tool (``type`` other than ``custom``), or no ``name`` /
            ``input_schema``.
    """
    kind = raw.get("type")
    if kind not in (None, "custom"):
        raise RequestError(f"tools.{i}.type", f"server tools ({kind!r}) are not supported: only custom tools with an input_schema are")
    name, schema = raw.get("name"), raw.get("input_schema")
    if not isinstance(name, str) or not name:
        raise RequestError(f"tools.{i}.name", "a tool needs a non-empty 'name'")
    if not isinstance(schema, dict):
        raise RequestError(f"tools.{i}.input_schema", "a tool needs an 'input_schema' object (JSON Schema)")
    function: dict[str, Any] = {"name": name, "parameters": schema}
    if isinstance(raw.get("description"), str):
        function["description"] = raw["description"]
    return {"type": "function", "function": function}


def _tool_choice(choice: ToolChoice) -> str | dict[str, Any]:
    if choice.type == "tool":
        return {"type": "function", "function": {"name": choice.name}}
    return {"auto": "auto", "any": "required", "none": "none"}[choice.type]


def _tool_result(block: ToolResultBlock, param: str) -> dict[str, Any]:
    """One ``tool`` message for a ``tool_result`` block (``param`` names the block)."""
    if block.content is None:
        content: str | list[dict[str, str]] = ""
    elif isinstance(block.content, str):
        content = block.content
    else:
        content = _text_parts(_blocks(block.content, f"{param}.content", ("text",)))  # type: ignore[arg-type]
    if block.is_error:  # chat has no error flag: the model reads it in the text
        content = "Error: " + content if isinstance(content, str) else [{"type": "text", "text": "Error: "}, *content]
    return {"role": "tool", "tool_call_id": block.tool_use_id, "content": content}


def to_chat_request(req: MessagesRequest) -> ChatCompletionRequest:
    """The chat completion request that serves a Messages request (mapping in the module
    docstring); streaming asks for the usage chunk (the ``message_delta`` event's usage).

    Raises:
        RequestError: a refused or malformed field (module docstring), named.
    """
    if req.thinking is not None and req.thinking.get("type") != "disabled":
        raise RequestError("thinking.type", "extended thinking is not supported by this gateway (send thinking.type 'disabled' or leave it out)")
    if req.mcp_servers:
        raise RequestError("mcp_servers", "MCP servers (server tools) are not supported by this gateway")
    if req.output_config and req.output_config.get("format") is not None:
        raise RequestError("output_config.format", "structured outputs are not supported: the policy's output is not constrained to a schema")
    if req.messages[-1].role == "assistant":
        raise RequestError(f"messages.{len(req.messages) - 1}.role",
                           "a last assistant message (prefill) is not supported: the policy's chat template opens a new assistant turn")  # fmt: skip
    messages: list[dict[str, Any]] = []
    if req.system is not None and req.system != []:
        messages.append({"role": "system", "content": _system(req.system)})
    for i, message in enumerate(req.messages):
        param = f"messages.{i}.content"
        if message.role == "assistant":
            blocks = _blocks(message.content, param, ("text", "tool_use"))
            texts = [b for b in blocks if isinstance(b, TextBlock)]
            out: dict[str, Any] = {"role": "assistant", "content": _text_parts(texts) if texts else None}
            calls = [
                {"id": b.id, "type": "function", "function": {"name": b.name, "arguments": json.dumps(b.input, ensure_ascii=False)}}
                for b in blocks
                if isinstance(b, ToolUseBlock)
            ]
            if calls:
                out["tool_calls"] = calls
            messages.append(out)
            continue
        blocks = _blocks(message.content, param, ("text", "tool_result"))
        for j, block in enumerate(blocks):
            if isinstance(block, ToolResultBlock):
                messages.append(_tool_result(block, f"{param}.{j}"))
        texts = [b for b in blocks if isinstance(b, TextBlock)]
        if texts or not blocks:
            messages.append({"role": "user", "content": _text_parts(texts) if texts else ""})
    body: dict[str, Any] = {
        "model": req.model,
        "messages": messages,
        "max_tokens": req.max_tokens,
        "stream": bool(req.stream),
    }
    if req.stream:
        body["stream_options"] = {"include_usage": True}
    if req.tools:
        body["tools"] = [_tool(t, i) for i, t in enumerate(req.tools)]
    if req.tool_choice is not None:
        body["tool_choice"] = _tool_choice(req.tool_choice)
    for field in ("temperature", "top_p", "seed"):
        if getattr(req, field) is not None:
            body[field] = getattr(req, field)
    if req.stop_sequences:
        body["stop"] = req.stop_sequences
    if req.metadata and req.metadata.user_id:
        body["user"] = req.metadata.user_id
    try:
        return ChatCompletionRequest.model_validate(body)
    except ValidationError as exc:
        error = _validation_error(exc, "")
        head = (error.param or "").split(".")[0]
        raise RequestError(_CHAT_FIELDS.get(head, error.param), str(exc.errors()[0].get("msg"))) from None


def _stop(choice: dict[str, Any]) -> tuple[str, str | None]:
    """``(stop_reason, stop_sequence)`` of a chat choice (its ``finish_reason`` and the stop
    string it carries as ``stop_reason``, vLLM's field)."""
    reason = _STOP_REASONS.get(choice.get("finish_reason") or "stop", "end_turn")
    stop = choice.get("stop_reason")
    if reason == "end_turn" and isinstance(stop, str):
        return "stop_sequence", stop
    return reason, None


def _message_id(chat_id: str | None) -> str:
    return "msg_" + (chat_id or "").removeprefix("chatcmpl-")


def to_message(completion: dict[str, Any]) -> dict[str, Any]:
    """A chat completion (JSON, one choice) as an Anthropic ``message``.

    Returns:
        ``{"id": "msg_...", "type": "message", "role": "assistant", "model", "content": [text
        block (when there is text), tool_use blocks...], "stop_reason", "stop_sequence",
        "usage": {"input_tokens", "output_tokens"}}``; a ``tool_use`` block's ``input`` is the
        call's arguments parsed (``{}`` when they are not a JSON object).
    """
    choice = completion["choices"][0]
    message = choice.get("message") or {}
    content: list[dict[str, Any]] = []
    if message.get("content"):
        content.append({"type": "text", "text": message["content"]})
    for call in message.get("tool_calls") or []:
        content.append({"type": "tool_use", "id": call["id"], "name": call["function"]["name"], "input": _arguments(call["function"]["arguments"])})
    reason, stop = _stop(choice)
    usage = completion.get("usage") or {}
    return {
        "id": _message_id(completion.get("id")),
        "type": "message",
        "role": "assistant",
        "model": completion.get("model"),
        "content": content,
        "stop_reason": reason,
        "stop_sequence": stop,
        "usage": {"input_tokens": usage.get("prompt_tokens", 0), "output_tokens": usage.get("completion_tokens", 0)},
    }


def _arguments(arguments: str | dict[str, Any]) -> dict[str, Any]:
    if isinstance(arguments, dict):
        return arguments
    try:
        parsed = json.loads(arguments)
    except json.JSONDecodeError:
        return {}
    return parsed if isinstance(parsed, dict) else {}


def error_body(status: int, message: str) -> dict[str, Any]:
    """Anthropic's error JSON for HTTP ``status`` (type from :data:`ERROR_TYPES`)."""
    kind = ERROR_TYPES.get(status) or ("api_error" if status >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": message}}


def error_response(status: int, message: str, headers: dict[str, str] | None = None) -> JSONResponse:
    """:func:`error_body` as a response (no filesystem path in the message)."""
    return JSONResponse(error_body(status, scrub_paths(message)), status_code=status, headers=headers)


def _from_chat_error(status: int, body: dict[str, Any]) -> dict[str, Any]:
    """An OpenAI-shaped error body of the chat path as Anthropic's, its ``param`` named first."""
    error = body.get("error") or {}
    param = error.get("param")
    param = _CHAT_FIELDS.get(param, param)
    message = str(error.get("message") or "error")
    return error_body(status, f"{param}: {message}" if param else message)


def _event(name: str, data: dict[str, Any]) -> ServerSentEvent:
    return ServerSentEvent(data=json.dumps({"type": name, **data}, ensure_ascii=False, separators=(",", ":")), event=name)


async def stream_events(chunks: AsyncIterator[str], input_tokens: int = 0) -> AsyncIterator[ServerSentEvent]:
    """Translate a streamed chat call (its SSE ``data`` texts: ``chat.completion.chunk`` JSON
    with ``include_usage``, an error body, ``[DONE]``) into Anthropic's stream events.

    Each chat content delta is a ``text_delta`` of the open text block; each tool call start
    closes the open block and opens a ``tool_use`` block (``id``, ``name``, ``input: {}``) whose
    arguments follow as one ``input_json_delta``. The chat usage chunk gives ``message_delta``'s
    ``usage``; ``input_tokens`` (known when the prompt was rendered) goes in ``message_start``.
    An error body (the generation failed, or the rollout finished meanwhile) is ``event: error``
    and ends the stream. Every chunk is pulled: the gateway records the turn when the last tool
    call's chunk has been consumed.
    """
    started = False
    block: str | None = None  # the open block's type
    index = -1
    reason, stop, usage = "end_turn", None, {}

    def close() -> list[ServerSentEvent]:
        nonlocal block
        if block is None:
            return []
        block = None
        return [_event("content_block_stop", {"index": index})]

    def open_block(kind: str, content_block: dict[str, Any]) -> list[ServerSentEvent]:
        nonlocal block, index
        events = close()
        index += 1
        block = kind
        return events + [_event("content_block_start", {"index": index, "content_block": content_block})]

    async for text in chunks:
        if text == "[DONE]":
            continue
        body = json.loads(text)
        if "error" in body:
            error = body.get("error") or {}
            kind = "api_error" if error.get("type") == "server_error" else "invalid_request_error"
            message = str(error.get("message") or "error")
            param = error.get("param")
            yield _event("error", {"error": {"type": kind, "message": f"{param}: {message}" if param else message}})
            return
        if not started:
            started = True
            message = {"id": _message_id(body.get("id")), "type": "message", "role": "assistant", "model": body.get("model"),
                       "content": [], "stop_reason": None, "stop_sequence": None,
                       "usage": {"input_tokens": input_tokens, "output_tokens": 0}}  # fmt: skip
            yield _event("message_start", {"message": message})
        for choice in body.get("choices") or []:
            delta = choice.get("delta") or {}
            if delta.get("content"):
                if block != "text":
                    for event in open_block("text", {"type": "text", "text": ""}):
                        yield event
                yield _event("content_block_delta", {"index": index, "delta": {"type": "text_delta", "text": delta["content"]}})
            for call in delta.get("tool_calls") or []:
                function = call.get("function") or {}
                if call.get("id"):
                    for event in open_block("tool_use", {"type": "tool_use", "id": call["id"], "name": function.get("name", ""), "input": {}}):
                        yield event
                if function.get("arguments"):
                    yield _event("content_block_delta", {"index": index, "delta": {"type": "input_json_delta", "partial_json": function["arguments"]}})
            if choice.get("finish_reason"):
                for event in close():
                    yield event
                reason, stop = _stop(choice)
        if body.get("usage"):
            usage = body["usage"]
    for event in close():
        yield event
    out_usage = {"input_tokens": usage.get("prompt_tokens", input_tokens), "output_tokens": usage.get("completion_tokens", 0)}
    yield _event("message_delta", {"delta": {"stop_reason": reason, "stop_sequence": stop}, "usage": out_usage})
    yield _event("message_stop", {})


#: ``chat(request, rollout id, session, http request)``: the gateway's chat path (a JSONResponse or a
#: ChatStream); the HTTP request is watched for the client going away (which cancels the call)
ChatCall = Callable[[ChatCompletionRequest, str | None, str | None, Request | None], Awaitable[Any]]


def add_routes(app: FastAPI, chat: ChatCall, key_rollout: Callable[[str | None], str | None]) -> None:
    """Serve ``POST /v1/messages`` and ``POST /rollouts/{rollout_id}/v1/messages`` on ``app``.

    The rollout is named as for chat: the path prefix, else ``X-Agent-ID``, else the API key
    (``Authorization: Bearer <key>``, or ``x-api-key``, which the ``anthropic`` client sends)
    through ``key_rollout``; ``X-Session-ID`` picks the live A/B's session. The body is parsed
    here, so a malformed one is answered in Anthropic's error shape, not the app's OpenAI one.

    Args:
        app: the gateway's FastAPI app.
        chat: the chat path, ``chat(ChatCompletionRequest, rollout id, session, http request)``.
        key_rollout: ``fn(authorization header) -> rollout id or None``.
    """

    async def serve(request: Request, rollout_id: str | None):
        try:
            body = json.loads(await request.body())
        except (json.JSONDecodeError, UnicodeDecodeError):
            return error_response(400, "The request body is not valid JSON.")
        try:
            chat_request = to_chat_request(parse_request(body))
        except RequestError as exc:
            return error_response(400, str(exc))
        headers = request.headers
        if not rollout_id:
            api_key = headers.get("x-api-key")
            rollout_id = headers.get("x-agent-id") or key_rollout(headers.get("authorization")) or (
                key_rollout("Bearer " + api_key) if api_key else None
            )
        response = await chat(chat_request, rollout_id, headers.get("x-session-id"), request)  # a client that goes away cancels it
        flowopt = {k: v for k, v in response.headers.items() if k.lower().startswith("x-flowopt")}
        if isinstance(response, ChatStream):
            input_tokens = int(response.headers.get("x-flowopt-prompt-tokens", 0))
            return response.translated(lambda chunks: stream_events(chunks, input_tokens))
        completion = json.loads(response.body)
        if response.status_code != 200:
            return JSONResponse(_from_chat_error(response.status_code, completion), status_code=response.status_code, headers=flowopt)
        return JSONResponse(to_message(completion), headers=flowopt)

    @app.post("/v1/messages")
    async def messages(request: Request):
        return await serve(request, None)

    @app.post("/rollouts/{rollout_id}/v1/messages")
    async def messages_in_rollout(rollout_id: str, request: Request):
        return await serve(request, rollout_id)
