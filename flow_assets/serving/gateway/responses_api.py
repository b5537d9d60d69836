"""OpenAI's Responses API (``POST /v1/responses``) as a translation layer over the gateway's Chat
Completions path.

A Responses request is translated into a :class:`~flow_assets.serving.gateway.protocol.ChatCompletionRequest`
(:func:`chat_request`), served by the chat path unchanged, and its answer translated back: a chat
completion's JSON into a Response object (:func:`response_from_chat`), a chat chunk stream into
the Responses API's Server-Sent Events (:func:`stream_events`, through
:meth:`~flow_assets.serving.gateway.streaming.ChatStream.translated`). What is captured (prompt and
completion token ids, log-probs, turns, rollouts) is therefore exactly what the equivalent chat
call captures.

The subset served is the stateless one (``store: false`` semantics): every request carries the
whole conversation in ``input``. Specification: https://platform.openai.com/docs/api-reference/responses
(request, Response object, streaming events); the shapes are those of the ``openai`` Python
package's ``openai.types.responses`` (the official client parses what this module writes).

Translation of a request (``input`` items in order):

============================================  ===================================================
Responses                                     Chat Completions
============================================  ===================================================
``instructions``                              a leading ``system`` message
``input`` as a string                         one ``user`` message
``{"role", "content"}`` / ``type: message``   a message of that role; ``input_text`` /
                                              ``output_text`` parts become ``text`` parts
``function_call`` items                       ``tool_calls`` of one assistant message: consecutive
                                              calls, and calls right after an assistant message,
                                              join that message (the chat path answered them as
                                              one message; the prompt must render as sampled)
``function_call_output``                      a ``tool`` message (``call_id`` -> ``tool_call_id``)
``tools`` (flat function tools)               ``tools`` (``{"type": "function", "function": ...}``)
``tool_choice``                               ``tool_choice`` in the chat shape
``max_output_tokens``                         ``max_tokens``
``text.format``                               ``response_format`` (chat shape)
``include: ["message.output_text.logprobs"]`` ``logprobs: true``
============================================  ===================================================

Refused with a 400 naming the field (they would change what is generated, or need stored state):
``previous_response_id``, ``conversation``, ``prompt``, ``background: true``, ``truncation:
"auto"``, tools other than functions, ``tool_choice`` other than ``none`` / ``auto`` /
``required`` / a function, input items other than the three above, content parts other than
text. Ignored (accepted, no effect here): ``store`` (nothing is ever stored), ``metadata``
(echoed), ``parallel_tool_calls``, ``reasoning``, ``service_tier``, ``safety_identifier``,
``prompt_cache_key``, ``max_tool_calls``, ``stream_options``, ``text.verbosity``, other
``include`` values, ``strict`` of a function tool. ``seed`` is a gateway extension (not in the
Responses API; ``extra_body={"seed": 7}``), passed to the chat path.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, Literal

from fastapi import FastAPI, Header, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator
from sse_starlette import ServerSentEvent

from flow_assets.serving.gateway.protocol import ChatCompletionRequest, error_body, validation_message
from flow_assets.serving.gateway.streaming import ChatStream

#: the ``include`` value that asks for the log-probs of the output text
LOGPROBS_INCLUDE = "message.output_text.logprobs"


class RequestError(ValueError):
    """A Responses request the gateway refuses (a 400): ``param`` names the field."""

    def __init__(self, message: str, param: str | None):
        super().__init__(message)
        self.param = param


class TextFormat(BaseModel):
    """``text.format``: ``{"type": "text"}``, ``{"type": "json_object"}`` or ``{"type":
    "json_schema", "name", "schema", "description", "strict"}``."""

    model_config = ConfigDict(extra="ignore", populate_by_name=True)
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = Field(None, min_length=1, max_length=64)
    # `schema` would shadow BaseModel.schema(); the JSON name stays "schema"
    json_schema: dict[str, Any] | None = Field(None, alias="schema")
    description: str | None = None
    strict: bool | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> "TextFormat":
        if self.type == "json_schema" and (self.name is None or self.json_schema is None):
            raise ValueError("a json_schema format needs 'name' and 'schema'")
        return self


class TextConfig(BaseModel):
    """``text``: the output format (``verbosity`` is ignored)."""

    model_config = ConfigDict(extra="ignore")
    format: TextFormat | None = None


class ResponsesRequest(BaseModel):
    """``POST /v1/responses``: the fields the gateway reads (module docstring: which are honoured,
    refused, ignored). ``input`` items and ``tools`` are checked by :func:`chat_request`, which
    names the item (``input.2.call_id``) in its error."""

    model_config = ConfigDict(extra="ignore")
    model: str = Field(min_length=1)
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    max_output_tokens: int | None = Field(None, ge=1)
    text: TextConfig | None = None
    include: list[str] | None = None
    top_logprobs: int | None = Field(None, ge=0, le=20)
    stream: bool | None = None
    store: bool | None = None
    metadata: dict[str, Any] | None = None
    user: str | None = None
    seed: int | None = Field(None, ge=-(2**63), le=2**63 - 1)
    previous_response_id: str | None = None
    conversation: str | dict[str, Any] | None = None
    prompt: dict[str, Any] | None = None
    background: bool | None = None
    truncation: Literal["auto", "disabled"] | None = None


class _MessageItem(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[dict[str, Any]]


class _FunctionCallItem(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["function_call"]
    call_id: str = Field(min_length=1)
    name: str = Field(min_length=1)
    arguments: str


class _FunctionCallOutputItem(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["function_call_output"]
    call_id: str = Field(min_length=1)
    output: str | list[dict[str, Any]]


class _FunctionTool(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["function"]
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None


_ITEMS: dict[str, type[BaseModel]] = {
    "message": _MessageItem,
    "function_call": _FunctionCallItem,
    "function_call_output": _FunctionCallOutputItem,
}
_TEXT_PARTS = ("input_text", "output_text", "text")


def _checked(model: type[BaseModel], value: Any, where: str) -> Any:
    """``value`` validated as ``model``; a :class:`RequestError` naming ``where.<field>`` else."""
    try:
        return model.model_validate(value)
    except ValidationError as exc:
        message, param = validation_message(exc)
        full = f"{where}.{param}" if param else where
        raise RequestError(message.replace(f"'{param}'", f"'{full}'") if param else f"Invalid value for '{where}': {message}", full) from None


def _text(parts: list[dict[str, Any]], where: str) -> list[dict[str, str]]:
    """Responses content parts as chat ``text`` parts (text only; a refusal is its text)."""
    out = []
    for j, part in enumerate(parts):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "refusal" and isinstance(part.get("refusal"), str):
            out.append({"type": "text", "text": part["refusal"]})
        elif kind in _TEXT_PARTS and isinstance(part.get("text"), str):
            out.append({"type": "text", "text": part["text"]})
        elif kind in _TEXT_PARTS:
            raise RequestError(f"Invalid value for '{where}.{j}.text': a {kind} part needs a string 'text'", f"{where}.{j}.text")
        else:
            raise RequestError(
                f"content parts of type {kind!r} are not supported: the policy reads text only (input_text, output_text)",
                f"{where}.{j}.type",
            )
    return out


def chat_messages(input: str | list[dict[str, Any]], instructions: str | None = None) -> list[dict[str, Any]]:
    """The chat ``messages`` of a Responses ``input`` (module docstring's table).

    Args:
        input: a string (one user message) or a list of input items: messages (``{"role",
            "content"}``, with or without ``"type": "message"``), ``function_call`` and
            ``function_call_output`` items.
        instructions: prepended as a system message.

    Returns:
        Chat messages (dicts as :class:`~flow_assets.serving.gateway.protocol.Message` reads them).

    Raises:
        RequestError: an item of another type, a malformed item, a non-text content part
            (``param`` such as ``input.3.type``), or no message at all (``input``).
    """
    messages: list[dict[str, Any]] = []
    if instructions:
        messages.append({"role": "system", "content": instructions})
    items = [{"role": "user", "content": input}] if isinstance(input, str) else input
    joinable = False  # whether a function_call item joins the last message (an assistant turn)
    for i, raw in enumerate(items):
        where = f"input.{i}"
        if not isinstance(raw, dict):
            raise RequestError(f"Invalid value for '{where}': an input item is an object", where)
        kind = raw.get("type", "message")
        model = _ITEMS.get(kind) if isinstance(kind, str) else None
        if model is None:
            raise RequestError(
                f"input items of type {kind!r} are not supported: the gateway keeps no state and serves "
                "message, function_call and function_call_output items",
                f"{where}.type",
            )
        item = _checked(model, raw, where)
        if isinstance(item, _MessageItem):
            content = item.content if isinstance(item.content, str) else _text(item.content, f"{where}.content")
            messages.append({"role": item.role, "content": content})
            joinable = item.role == "assistant"
        elif isinstance(item, _FunctionCallItem):
            call = {"id": item.call_id, "type": "function", "function": {"name": item.name, "arguments": item.arguments}}
            if joinable:
                messages[-1].setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "tool_calls": [call]})
                joinable = True
        else:
            output = item.output if isinstance(item.output, str) else "".join(p["text"] for p in _text(item.output, f"{where}.output"))
            messages.append({"role": "tool", "tool_call_id": item.call_id, "content": output})
            joinable = False
    if not messages:
        raise RequestError("Invalid value for 'input': no message to answer", "input")
    return messages


def chat_tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    """Responses function tools (``{"type": "function", "name", "description", "parameters",
    "strict"}``) in the chat shape (``{"type": "function", "function": {"name", "description",
    "parameters"}}``; ``strict`` is dropped: the chat path parses calls, it does not constrain them).

    Raises:
        RequestError: a tool of another type (``web_search``, ``file_search``, ``mcp`` ...) or a
            malformed one, naming ``tools.<i>...``.
    """
    if not tools:
        return None
    out = []
    for i, raw in enumerate(tools):
        kind = raw.get("type") if isinstance(raw, dict) else None
        if kind != "function":
            raise RequestError(f"tools of type {kind!r} are not supported: the gateway serves function tools only", f"tools.{i}.type")
        tool = _checked(_FunctionTool, raw, f"tools.{i}")
        out.append({"type": "function", "function": tool.model_dump(exclude={"type"}, exclude_none=True)})
    return out


def chat_tool_choice(choice: str | dict[str, Any] | None) -> str | dict[str, Any] | None:
    """``tool_choice`` in the chat shape: ``none`` / ``auto`` / ``required`` as they are,
    ``{"type": "function", "name"}`` as ``{"type": "function", "function": {"name"}}``.

    Raises:
        RequestError: any other choice (hosted tools, ``allowed_tools``, ``mcp``, ``custom``).
    """
    if choice is None or choice in ("none", "auto", "required"):
        return choice
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("name"), str) and choice["name"]:
        return {"type": "function", "function": {"name": choice["name"]}}
    raise RequestError("tool_choice must be 'none', 'auto', 'required' or {'type': 'function', 'name': ...}", "tool_choice")


def chat_response_format(text: TextConfig | None) -> dict[str, Any] | None:
    """``text.format`` as the chat ``response_format`` (``{"type": "json_schema", "json_schema":
    {"name", "schema", "description", "strict"}}``, ``{"type": "json_object"}``, ``{"type":
    "text"}``), or ``None``."""
    fmt = text.format if text else None
    if fmt is None:
        return None
    if fmt.type != "json_schema":
        return {"type": fmt.type}
    spec = {"name": fmt.name, "schema": fmt.json_schema, "description": fmt.description, "strict": fmt.strict}
    return {"type": "json_schema", "json_schema": {k: v for k, v in spec.items() if v is not None}}


def chat_request(req: ResponsesRequest) -> ChatCompletionRequest:
    """The chat completion request that serves ``req`` (module docstring). A streamed request
    asks for the usage chunk (the ``response.completed`` event carries the usage).

    Raises:
        RequestError: a refused field or a malformed item (its ``param`` names it).
    """
    for field, refused, why in (
        ("previous_response_id", req.previous_response_id is not None, "the gateway stores no responses: send the whole conversation in 'input'"),
        ("conversation", req.conversation is not None, "the gateway keeps no conversations: send the whole conversation in 'input'"),
        ("prompt", req.prompt is not None, "the gateway has no stored prompts: send 'instructions' and 'input'"),
        ("background", bool(req.background), "background responses need stored state; the gateway answers in the request"),
        ("truncation", req.truncation == "auto", "the gateway does not drop input to fit the context (a prompt too long is refused)"),
    ):
        if refused:
            raise RequestError(f"'{field}' is not supported: {why}", field)
    body = {
        "model": req.model,
        "messages": chat_messages(req.input, req.instructions),
        "tools": chat_tools(req.tools),
        "tool_choice": chat_tool_choice(req.tool_choice),
        "temperature": req.temperature,
        "top_p": req.top_p,
        "max_tokens": req.max_output_tokens,
        "seed": req.seed,
        "logprobs": LOGPROBS_INCLUDE in (req.include or ()),
        "top_logprobs": req.top_logprobs,
        "stream": bool(req.stream),
        "stream_options": {"include_usage": True} if req.stream else None,
        "user": req.user,
        "response_format": chat_response_format(req.text),
    }
    try:
        return ChatCompletionRequest.model_validate(body)
    except ValidationError as exc:  # the checks above should leave nothing; name the chat field if not
        message, param = validation_message(exc)
        raise RequestError(f"the translated chat request is invalid: {message}", param) from None


def _new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class _Output:
    """What one response produced so far: its message text and log-probs, its function calls, its
    finish reason and usage (shared by the plain and the streamed translation, so both build the
    same Response object)."""

    def __init__(self, response_id: str, created_at: float, model: str):
        self.response_id, self.created_at, self.model = response_id, created_at, model
        self.message_id = _new_id("msg")
        self.text = ""
        self.logprobs: list[dict[str, Any]] = []
        self.calls: list[dict[str, Any]] = []  # {"id", "call_id", "name", "arguments"}
        self.finish_reason: str | None = None
        self.usage: dict[str, int] | None = None

    @property
    def has_message(self) -> bool:
        """A message item is returned when there is text, or nothing else to return."""
        return bool(self.text) or not self.calls

    @property
    def status(self) -> str:
        """``incomplete`` when the completion hit ``max_output_tokens``, else ``completed``."""
        return "incomplete" if self.finish_reason == "length" else "completed"

    def message_item(self, status: str) -> dict[str, Any]:
        return {"id": self.message_id, "type": "message", "status": status, "role": "assistant", "content": [self.text_part()]}

    def text_part(self) -> dict[str, Any]:
        return {"type": "output_text", "text": self.text, "annotations": [], "logprobs": self.logprobs}

    def call_item(self, call: dict[str, Any], status: str) -> dict[str, Any]:
        return {"id": call["id"], "type": "function_call", "status": status, "call_id": call["call_id"], "name": call["name"],
                "arguments": call["arguments"]}  # fmt: skip

    def items(self) -> list[dict[str, Any]]:
        status = self.status
        out = [self.message_item(status)] if self.has_message else []
        return out + [self.call_item(c, "completed") for c in self.calls]


def _usage(chat_usage: dict[str, int] | None) -> dict[str, Any] | None:
    if chat_usage is None:
        return None
    return {
        "input_tokens": chat_usage["prompt_tokens"],
        "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
        "output_tokens": chat_usage["completion_tokens"],
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": chat_usage["total_tokens"],
    }


def _response(req: ResponsesRequest, out: _Output, status: str, error: dict[str, Any] | None = None) -> dict[str, Any]:
    """The Response object (https://platform.openai.com/docs/api-reference/responses/object) of
    ``out`` in ``status``, echoing the request's settings as OpenAI does."""
    done = status in ("completed", "incomplete")
    tools = [{"type": "function", "name": t["name"], "description": t.get("description"), "parameters": t.get("parameters"),
              "strict": t.get("strict", True)} for t in req.tools or ()]  # fmt: skip
    fmt = chat_response_format(req.text) if req.text and req.text.format else {"type": "text"}
    if fmt["type"] == "json_schema":
        fmt = {"type": "json_schema", **fmt["json_schema"]}
    return {
        "id": out.response_id,
        "object": "response",
        "created_at": out.created_at,
        "status": status,
        "error": error,
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
        "instructions": req.instructions,
        "max_output_tokens": req.max_output_tokens,
        "model": out.model,
        "output": out.items() if done else [],
        "parallel_tool_calls": True,
        "previous_response_id": None,
        "reasoning": {"effort": None, "summary": None},
        "store": False,
        "temperature": 1.0 if req.temperature is None else req.temperature,
        "text": {"format": fmt},
        "tool_choice": req.tool_choice or "auto",
        "tools": tools,
        "top_p": 1.0 if req.top_p is None else req.top_p,
        "truncation": "disabled",
        "usage": _usage(out.usage) if done else None,
        "user": req.user,
        "metadata": req.metadata or {},
    }


def response_from_chat(req: ResponsesRequest, chat: dict[str, Any]) -> dict[str, Any]:
    """The Response object of a (non-streamed) chat completion ``chat`` that served ``req``:
    its text as a ``message`` item (with the chat log-probs when asked for), its tool calls as
    ``function_call`` items (``call_id`` is the chat tool call's id, which the capture matches the
    ``function_call_output`` against), ``finish_reason: length`` as status ``incomplete``."""
    choice = chat["choices"][0]
    message = choice["message"]
    out = _Output(_new_id("resp"), chat["created"], chat["model"])
    out.text = message.get("content") or ""
    out.logprobs = list((choice.get("logprobs") or {}).get("content") or [])
    out.calls = [{"id": _new_id("fc"), "call_id": c["id"], "name": c["function"]["name"], "arguments": c["function"]["arguments"]}
                 for c in message.get("tool_calls") or []]  # fmt: skip
    out.finish_reason = choice["finish_reason"]
    out.usage = chat.get("usage")
    return _response(req, out, out.status)


async def stream_events(req: ResponsesRequest, chunks: AsyncIterator[str]) -> AsyncIterator[ServerSentEvent]:
    """The Responses API's streaming events for a streamed chat call's ``data`` texts.

    Events (https://platform.openai.com/docs/api-reference/responses-streaming), each with an
    ``event:`` name equal to its ``type`` and an increasing ``sequence_number``:
    ``response.created``, ``response.in_progress``; for the text, once it begins,
    ``response.output_item.added`` (a message), ``response.content_part.added``,
    ``response.output_text.delta`` per chat content chunk (with its log-probs when asked for);
    once the completion is done, ``response.output_text.done``, ``response.content_part.done``,
    ``response.output_item.done``, then per tool call ``response.output_item.added`` (a
    ``function_call``), ``response.function_call_arguments.delta`` / ``.done``,
    ``response.output_item.done``; last ``response.completed`` (``response.incomplete`` when
    ``max_output_tokens`` cut it). A chat error chunk becomes ``response.failed`` (its ``error``
    holds the chat error's code and message), and the stream ends.

    Tool calls are sent after the message is closed: the chat stream sends them at the end of the
    completion, and the log-probs of the completion's last tokens come with its finish chunk.
    """
    seq = 0
    out: _Output | None = None
    opened = False  # the message item was announced
    calls: dict[int, dict[str, Any]] = {}

    def event(kind: str, **fields: Any) -> ServerSentEvent:
        nonlocal seq
        body = {"type": kind, **fields, "sequence_number": seq}
        seq += 1
        # "\n" line ends, as the chat stream frames its events (ServerSentEvent's default is "\r\n")
        return ServerSentEvent(data=json.dumps(body, ensure_ascii=False, separators=(",", ":")), event=kind, sep="\n")

    def where() -> dict[str, Any]:
        return {"item_id": out.message_id, "output_index": 0, "content_index": 0}

    def open_message():
        yield event("response.output_item.added", output_index=0, item={**out.message_item("in_progress"), "content": []})
        yield event("response.content_part.added", **where(), part={"type": "output_text", "text": "", "annotations": [], "logprobs": []})

    async for data in chunks:
        if data == "[DONE]":
            break
        body = json.loads(data)
        if out is None:
            out = _Output(_new_id("resp"), body.get("created", int(time.time())), body.get("model", req.model))
            yield event("response.created", response=_response(req, out, "in_progress"))
            yield event("response.in_progress", response=_response(req, out, "in_progress"))
        if "error" in body:
            error = body["error"] or {}
            # ResponseError.code is an enumeration: a gateway fault or a request the policy could not serve
            code = "server_error" if error.get("type") == "server_error" else "invalid_prompt"
            failure = {"code": code, "message": error.get("message", ""), "type": error.get("type"), "param": error.get("param")}
            yield event("response.failed", response=_response(req, out, "failed", failure))
            return
        if body.get("usage"):
            out.usage = body["usage"]
        for choice in body.get("choices") or ():
            delta = choice.get("delta") or {}
            logprobs = list((choice.get("logprobs") or {}).get("content") or [])
            out.logprobs += logprobs
            if delta.get("content"):
                if not opened:
                    opened = True
                    for e in open_message():
                        yield e
                out.text += delta["content"]
                yield event("response.output_text.delta", **where(), delta=delta["content"], logprobs=logprobs)
            for piece in delta.get("tool_calls") or ():
                call = calls.setdefault(piece["index"], {"id": _new_id("fc"), "call_id": "", "name": "", "arguments": ""})
                function = piece.get("function") or {}
                call["call_id"] = piece.get("id") or call["call_id"]
                call["name"] += function.get("name") or ""
                call["arguments"] += function.get("arguments") or ""
            if choice.get("finish_reason"):
                out.finish_reason = choice["finish_reason"]
                out.calls = [calls[k] for k in sorted(calls)]
                status = out.status
                if out.has_message:
                    if not opened:
                        for e in open_message():
                            yield e
                    yield event("response.output_text.done", **where(), text=out.text, logprobs=out.logprobs)
                    yield event("response.content_part.done", **where(), part=out.text_part())
                    yield event("response.output_item.done", output_index=0, item=out.message_item(status))
                first = 1 if out.has_message else 0
                for k, call in enumerate(out.calls, start=first):
                    yield event("response.output_item.added", output_index=k, item={**out.call_item(call, "in_progress"), "arguments": ""})
                    yield event("response.function_call_arguments.delta", item_id=call["id"], output_index=k, delta=call["arguments"])
                    yield event("response.function_call_arguments.done", item_id=call["id"], output_index=k, arguments=call["arguments"])
                    yield event("response.output_item.done", output_index=k, item=out.call_item(call, "completed"))
    if out is not None and out.finish_reason is not None:
        status = out.status
        yield event(f"response.{status}", response=_response(req, out, status))


#: the gateway's chat path: ``(request, rollout id, session) -> JSONResponse | ChatStream``
ChatCall = Callable[[ChatCompletionRequest, str | None, str | None, Request | None], Awaitable[Any]]


def add_routes(app: FastAPI, chat: ChatCall, key_rollout: Callable[[str | None], str | None]) -> None:
    """Register ``POST /v1/responses`` and ``POST /rollouts/{rollout_id}/v1/responses`` on ``app``.

    Args:
        app: the gateway's application (its exception handlers answer a malformed body with a 400
            naming the field).
        chat: the chat path, ``chat(request, rollout_id, session, http_request)`` -> a JSONResponse (a
            completion, or an error in OpenAI's shape, which the Responses API shares) or a
            :class:`~flow_assets.serving.gateway.streaming.ChatStream`.
        key_rollout: the rollout an ``Authorization`` header's API key names, or ``None``. As for
            chat calls, the rollout is the path's, else ``X-Agent-ID``'s, else the key's.
    """

    @app.post("/v1/responses")
    async def responses(
        body: ResponsesRequest,
        http: Request,
        x_agent_id: str | None = Header(None),
        x_session_id: str | None = Header(None),
        authorization: str | None = Header(None),
    ):
        return await _respond(body, x_agent_id or key_rollout(authorization), x_session_id, http)

    @app.post("/rollouts/{rollout_id}/v1/responses")
    async def responses_in_rollout(rollout_id: str, body: ResponsesRequest, http: Request, x_session_id: str | None = Header(None)):
        return await _respond(body, rollout_id, x_session_id, http)

    async def _respond(body: ResponsesRequest, rollout_id: str | None, session: str | None, http: Request):
        try:
            request = chat_request(body)
        except RequestError as exc:
            return JSONResponse(error_body(str(exc), param=exc.param), status_code=400)
        answer = await chat(request, rollout_id, session, http)  # the client going away cancels the call
        if isinstance(answer, ChatStream):
            return answer.translated(lambda chunks: stream_events(body, chunks))
        if answer.status_code != 200:
            return answer
        headers = {k: v for k, v in answer.headers.items() if k.lower().startswith("x-flowopt")}
        return JSONResponse(response_from_chat(body, json.loads(answer.body)), headers=headers)
