"""OpenTelemetry GenAI spans, format ``otel-genai``: OTLP/JSON trace exports
(``{"resourceSpans": [{"resource", "scopeSpans": [{"scope", "spans": [...]}]}]}``, attributes as
``{key, value: AnyValue}`` lists), one document per file or one export request per line (what
the Collector's file exporter writes). One trajectory per trace: spans are grouped by
``traceId`` and ordered by ``startTimeUnixNano``.

Registered through the plug-in protocol (``detect`` / ``parse``, flow_assets/logs/plugins.py).

An **LLM span** carries its messages in one of three attribute dialects (read in this order):

* GenAI semantic conventions (current): ``gen_ai.input.messages`` / ``gen_ai.output.messages``
  (JSON: ``[{role, parts: [{type: text, content} | {type: tool_call, id, name, arguments} |
  {type: tool_call_response, id, response}]}]``), ``gen_ai.system_instructions``;
* GenAI, indexed (OpenLLMetry before its migration): ``gen_ai.prompt.<n>.role`` / ``.content`` /
  ``.tool_call_id`` / ``.tool_calls.<m>.{id,name,arguments}``, ``gen_ai.completion.<n>.*`` alike;
* OpenInference: ``llm.input_messages.<n>.message.role`` / ``.content`` /
  ``.contents.<m>.message_content.text`` / ``.tool_call_id`` /
  ``.tool_calls.<m>.tool_call.{id,function.name,function.arguments}``, ``llm.output_messages``.

A **tool span** (``gen_ai.operation.name = execute_tool``: ``gen_ai.tool.name``,
``gen_ai.tool.call.id``, ``.arguments``, ``.result``; OpenInference ``openinference.span.kind =
TOOL``: ``tool.name``, ``input.value``, ``output.value``) answers the tool call with its id, else
the earliest unanswered call of that name; a span status of ERROR makes that step fail.

The conversation of a trace is the first LLM span's input and output; each later LLM span adds
the input messages beyond those already seen (an agent loop resends the history plus the tool
results) and its output. It is then mapped to steps like every chat format
(:func:`.openai_chat.chat_to_steps`); a step's ``duration_ms`` follows from span times (an LLM
turn lasts its span, a tool step ends with its tool span). Outcome: span attribute
``flowopt.outcome.score`` / ``flowopt.outcome.success`` on any span of the trace, else the GenAI
evaluation score ``gen_ai.evaluation.score.value`` (a span attribute or a
``gen_ai.evaluation.result`` event's); none: unlabelled. ``task_id``: ``flowopt.task_id``, else
the prompt (:func:`.chat_records.prompt_task_id`). ``agent_id``: ``gen_ai.agent.name``, else the
resource's ``service.name``, else the model, else the file stem. ``trajectory_id`` = the trace id.

A span that cannot be read (no ``traceId``, attributes that are not a key/value list) is
quarantined alone with its pointer; a trace whose messages cannot be read, or that holds no LLM
span, is quarantined whole (its spans as JSON), with the reason and the attribute to blame.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import orjson

from flow_assets.logs.formats.chat_records import head_lines, is_document, prompt_task_id
from flow_assets.logs.formats.common import (
    DEFAULT_MAX_RECORD_BYTES,
    READ_ERRORS,
    Books,
    RecordError,
    RecordStream,
    bounded_lines,
    decode_element,
    load_document,
    open_log,
    oversized_error,
    record_guard,
)
from flow_assets.logs.formats.openai_chat import ChatMessage, chat_to_steps, prompt_fingerprint
from flow_assets.logs.records import QuarantinedRecord, UnreadableLogError, ValidRecord, display_path
from flow_assets.logs.schema import Outcome, Trajectory

FORMAT = "otel-genai"
_DETECT_BYTES = 64 * 2**10


def any_value(value: Any) -> Any:
    """An OTLP ``AnyValue`` (``{"stringValue": ...}``, ``intValue`` (a decimal string in
    OTLP/JSON), ``doubleValue``, ``boolValue``, ``arrayValue.values``, ``kvlistValue.values``,
    ``bytesValue``) as a plain value; a value that is not an AnyValue object is returned as is.

    Raises:
        ValueError: an ``intValue`` that is not an integer.
    """
    if not isinstance(value, dict):
        return value
    if "stringValue" in value:
        return value["stringValue"]
    if "intValue" in value:
        return int(value["intValue"])
    if "doubleValue" in value:
        return value["doubleValue"]
    if "boolValue" in value:
        return value["boolValue"]
    if "arrayValue" in value:
        return [any_value(v) for v in (value["arrayValue"] or {}).get("values", [])]
    if "kvlistValue" in value:
        return attributes_of((value["kvlistValue"] or {}).get("values", []), "kvlistValue")
    if "bytesValue" in value:
        return value["bytesValue"]
    return None


def attributes_of(raw: Any, where: str) -> dict[str, Any]:
    """OTLP attributes (a list of ``{key, value}``) as a dict; a dict is taken as already decoded.

    Raises:
        RecordError: ``raw`` is neither, or an entry has no string key (``where`` names it).
    """
    if raw is None:
        return {}
    if isinstance(raw, dict):
        return raw
    if not isinstance(raw, list):
        raise RecordError(f"{where}: expected a list of {{key, value}} attributes", where)
    out: dict[str, Any] = {}
    for i, entry in enumerate(raw):
        if not isinstance(entry, dict) or not isinstance(entry.get("key"), str):
            raise RecordError(f"{where}.{i}: an attribute needs a string 'key'", f"{where}.{i}")
        try:
            out[entry["key"]] = any_value(entry.get("value"))
        except (ValueError, TypeError) as error:
            raise RecordError(f"{where}.{i}: attribute {entry['key']!r} has a bad value: {error}", f"{where}.{i}") from None
    return out


@dataclass
class Span:
    """One span, decoded: ids, times (ns since the epoch), attributes, events, status code,
    its resource's attributes, where it sat in the file, and its raw JSON object."""

    trace_id: str
    span_id: str | None
    name: str
    start_ns: int
    end_ns: int | None
    attributes: dict[str, Any]
    events: list[dict[str, Any]]
    error: bool
    resource: dict[str, Any]
    pointer: str
    line: int | None
    raw: Any = field(repr=False)


def _nanos(value: Any, where: str, required: bool) -> int | None:
    if value is None and not required:
        return None
    try:
        if isinstance(value, bool):
            raise ValueError
        return int(value)
    except (TypeError, ValueError):
        raise RecordError(f"{where}: expected nanoseconds since the epoch (an integer or a decimal string)", where) from None


def read_span(raw: Any, resource: dict[str, Any], pointer: str, line: int | None) -> Span:
    """A span object of an OTLP export, decoded.

    Raises:
        RecordError: no ``traceId``, a bad time, or malformed attributes (the field names it).
    """
    if not isinstance(raw, dict):
        raise RecordError("span: expected an object")
    trace_id = raw.get("traceId")
    if not isinstance(trace_id, str) or not trace_id:
        raise RecordError("traceId: a span needs its trace id", "traceId")
    status = raw.get("status") if isinstance(raw.get("status"), dict) else {}
    events = []
    for i, event in enumerate(raw.get("events") or []):
        if isinstance(event, dict):
            events.append({"name": event.get("name"), "attributes": attributes_of(event.get("attributes"), f"events.{i}.attributes")})
    return Span(
        trace_id=trace_id,
        span_id=raw.get("spanId"),
        name=str(raw.get("name") or ""),
        start_ns=_nanos(raw.get("startTimeUnixNano"), "startTimeUnixNano", True),
        end_ns=_nanos(raw.get("endTimeUnixNano"), "endTimeUnixNano", False),
        attributes=attributes_of(raw.get("attributes"), "attributes"),
        events=events,
        error=status.get("code") in (2, "STATUS_CODE_ERROR"),
        resource=resource,
        pointer=pointer,
        line=line,
        raw=raw,
    )


def iter_spans(export: Any, prefix: str, line: int | None) -> Iterator[Span | tuple[RecordError, Any, str]]:
    """Each span of one export request (``{"resourceSpans": [...]}``), decoded, or
    ``(error, raw, pointer)`` for one that cannot be; ``prefix`` starts each JSON pointer.

    Raises:
        RecordError: the export itself has no ``resourceSpans`` list.
    """
    if not isinstance(export, dict) or not isinstance(export.get("resourceSpans"), list):
        raise RecordError("resourceSpans: expected an OTLP/JSON trace export with a resourceSpans list", "resourceSpans")
    for r, resource_spans in enumerate(export["resourceSpans"]):
        at = f"{prefix}/resourceSpans/{r}"
        if not isinstance(resource_spans, dict):
            yield RecordError("resourceSpans entry: expected an object"), resource_spans, at
            continue
        try:
            resource = attributes_of((resource_spans.get("resource") or {}).get("attributes"), "resource.attributes")
        except RecordError as error:
            yield error, resource_spans, at
            continue
        scopes = resource_spans.get("scopeSpans") or resource_spans.get("instrumentationLibrarySpans") or []
        for s, scope in enumerate(scopes):
            for k, raw in enumerate((scope or {}).get("spans") or [] if isinstance(scope, dict) else []):
                pointer = f"{at}/scopeSpans/{s}/spans/{k}"
                try:
                    yield read_span(raw, resource, pointer, line)
                except RecordError as error:
                    yield error, raw, pointer


# --- messages -------------------------------------------------------------------------------

_INDEXED = {
    "gen_ai.prompt": re.compile(r"^gen_ai\.prompt\.(\d+)\.(.+)$"),
    "gen_ai.completion": re.compile(r"^gen_ai\.completion\.(\d+)\.(.+)$"),
    "llm.input_messages": re.compile(r"^llm\.input_messages\.(\d+)\.message\.(.+)$"),
    "llm.output_messages": re.compile(r"^llm\.output_messages\.(\d+)\.message\.(.+)$"),
}
_CALL = re.compile(r"^tool_calls\.(\d+)\.(?:tool_call\.)?(.+)$")
_CONTENTS = re.compile(r"^contents\.(\d+)\.message_content\.text$")


def _json(value: Any, key: str) -> Any:
    if isinstance(value, str):
        try:
            return orjson.loads(value)
        except orjson.JSONDecodeError as error:
            raise RecordError(f"{key}: not valid JSON: {error}", key) from None
    return value


def _as_text(value: Any) -> str | None:
    if value is None or isinstance(value, str):
        return value
    return orjson.dumps(value).decode()


def _role(value: Any, key: str) -> str:
    role = {"developer": "system", "model": "assistant", "ai": "assistant", "human": "user"}.get(value, value)
    if role not in ("system", "user", "assistant", "tool"):
        raise RecordError(f"{key}: unknown message role {value!r:.40}", key)
    return role


def parts_messages(value: Any, key: str) -> list[dict[str, Any]]:
    """Messages in the GenAI conventions' JSON shape (``[{role, parts}]``, or OpenAI-style
    ``[{role, content, tool_calls}]``) as chat-message dicts; a ``tool_call_response`` part is a
    tool message answering its call id.

    Raises:
        RecordError: not JSON, not a list of messages, or an unknown role (``key`` names it).
    """
    messages = _json(value, key)
    if isinstance(messages, dict) and isinstance(messages.get("messages"), list):
        messages = messages["messages"]
    if not isinstance(messages, list):
        raise RecordError(f"{key}: expected a JSON list of messages", key)
    out: list[dict[str, Any]] = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise RecordError(f"{key}: message {i} is not an object", key)
        role = _role(message.get("role"), f"{key}[{i}].role")
        if "parts" not in message:
            out.append({"role": role, "content": _as_text(message.get("content")), "tool_calls": message.get("tool_calls"),
                        "tool_call_id": message.get("tool_call_id")})  # fmt: skip
            continue
        texts, calls = [], []
        for part in message.get("parts") or []:
            kind = part.get("type") if isinstance(part, dict) else None
            if kind == "text" and isinstance(part.get("content"), str):
                texts.append(part["content"])
            elif kind == "tool_call":
                calls.append({"id": part.get("id"), "name": part.get("name"), "arguments": part.get("arguments")})
            elif kind == "tool_call_response":
                out.append({"role": "tool", "tool_call_id": part.get("id"), "content": _as_text(part.get("response"))})
        if texts or calls or role != "tool":
            out.append({"role": role, "content": "\n".join(texts) if texts else None, "tool_calls": calls or None})
    return out


def indexed_messages(attributes: dict[str, Any], prefix: str) -> list[dict[str, Any]]:
    """Messages flattened into indexed attributes (``gen_ai.prompt.<n>.*``,
    ``llm.input_messages.<n>.message.*``...; module docstring) as chat-message dicts, by index.

    Raises:
        RecordError: an unknown role (the attribute key names it).
    """
    pattern = _INDEXED[prefix]
    by_index: dict[int, dict[str, Any]] = {}
    for key, value in attributes.items():
        match = pattern.match(key)
        if not match:
            continue
        message = by_index.setdefault(int(match.group(1)), {"_calls": {}, "_texts": {}})
        rest = match.group(2)
        call, contents = _CALL.match(rest), _CONTENTS.match(rest)
        if call:
            name = {"function.name": "name", "function.arguments": "arguments"}.get(call.group(2), call.group(2))
            message["_calls"].setdefault(int(call.group(1)), {})[name] = value
        elif contents:
            message["_texts"][int(contents.group(1))] = value
        elif rest in ("role", "content", "tool_call_id"):
            message[rest] = value
            message[f"_{rest}_key"] = key
    out = []
    for index in sorted(by_index):
        m = by_index[index]
        content = m.get("content")
        if content is None and m["_texts"]:
            content = "\n".join(str(m["_texts"][j]) for j in sorted(m["_texts"]))
        calls = [m["_calls"][j] for j in sorted(m["_calls"])]
        role = _role(m.get("role", "assistant" if prefix in ("gen_ai.completion", "llm.output_messages") else None),
                     m.get("_role_key", f"{prefix}.{index}.role"))  # fmt: skip
        out.append({"role": role, "content": _as_text(content), "tool_calls": calls or None, "tool_call_id": m.get("tool_call_id")})
    return out


def span_messages(attributes: dict[str, Any]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]] | None:
    """``(input messages, output messages)`` of an LLM span in whichever dialect it uses
    (module docstring), or ``None`` when the span carries no messages (not an LLM span).

    Raises:
        RecordError: the messages are present but malformed (the attribute key names it).
    """
    if "gen_ai.input.messages" in attributes or "gen_ai.output.messages" in attributes:
        inputs = parts_messages(attributes.get("gen_ai.input.messages", "[]"), "gen_ai.input.messages")
        if "gen_ai.system_instructions" in attributes:
            instructions = _json(attributes["gen_ai.system_instructions"], "gen_ai.system_instructions")
            text = "\n".join(p.get("content", "") for p in instructions if isinstance(p, dict)) if isinstance(instructions, list) else _as_text(instructions)
            inputs.insert(0, {"role": "system", "content": text})
        return inputs, parts_messages(attributes.get("gen_ai.output.messages", "[]"), "gen_ai.output.messages")
    for inputs, outputs in (("gen_ai.prompt", "gen_ai.completion"), ("llm.input_messages", "llm.output_messages")):
        if any(_INDEXED[inputs].match(k) or _INDEXED[outputs].match(k) for k in attributes):
            return indexed_messages(attributes, inputs), indexed_messages(attributes, outputs)
    return None


@dataclass(frozen=True)
class ToolRun:
    """What a tool span says: the call it answers (id and/or name), its result, failure, end."""

    call_id: str | None
    name: str | None
    result: str | None
    error: bool
    end_ns: int | None


def tool_run(span: Span) -> ToolRun | None:
    """The tool execution a span records (module docstring), or ``None``."""
    a = span.attributes
    if a.get("gen_ai.operation.name") == "execute_tool":
        return ToolRun(a.get("gen_ai.tool.call.id"), a.get("gen_ai.tool.name"), _as_text(a.get("gen_ai.tool.call.result")), span.error, span.end_ns)
    if a.get("openinference.span.kind") == "TOOL":
        return ToolRun(a.get("tool_call.id"), a.get("tool.name"), _as_text(a.get("output.value")), span.error, span.end_ns)
    return None


def _iso(ns: int | None) -> str | None:
    return None if ns is None else datetime.fromtimestamp(ns / 1e9, tz=timezone.utc).isoformat()


def conversation(spans: list[Span]) -> tuple[list[ChatMessage], Span | None]:
    """The chat messages of one trace (module docstring) with span times as message stamps,
    and its first LLM span (``None`` when it has none).

    Raises:
        RecordError: an LLM span's messages are malformed.
        pydantic.ValidationError: a message breaks :class:`~.openai_chat.ChatMessage`.
    """
    messages: list[dict[str, Any]] = []
    first_llm: Span | None = None
    tool_runs: list[ToolRun] = []
    for span in spans:
        try:
            found = span_messages(span.attributes)
        except RecordError as error:
            raise RecordError(f"span {span.span_id} ({span.name}): {error.reason}", error.field) from None
        run = tool_run(span)
        if run is not None:
            tool_runs.append(run)
        if found is None:
            continue
        inputs, outputs = found
        first_llm = first_llm or span
        for m in inputs[len(messages):]:  # an agent loop resends the history: only what is beyond it is new
            messages.append({**m, "timestamp": _iso(span.start_ns), "_input": True})
        for m in outputs:
            messages.append({**m, "timestamp": _iso(span.end_ns or span.start_ns)})
    _answer_calls(messages, tool_runs)
    chat = [ChatMessage.model_validate({k: v for k, v in m.items() if not k.startswith("_") and v is not None}) for m in messages]
    return chat, first_llm


def _answer_calls(messages: list[dict[str, Any]], runs: list[ToolRun]) -> None:
    """Insert a tool message for each call that no message answers but a tool span does, right
    after the assistant message that made the call (by id, else the earliest of that name)."""
    answered = {m.get("tool_call_id") for m in messages if m.get("role") == "tool"}
    unused = list(runs)
    at = 0
    while at < len(messages):
        m = messages[at]
        for call in (m.get("tool_calls") or []) if m.get("role") == "assistant" else []:
            call_id = call.get("id") if isinstance(call, dict) else None
            if call_id in answered and call_id is not None:
                continue
            name = call.get("name") or (call.get("function") or {}).get("name") if isinstance(call, dict) else None
            run = next((r for r in unused if r.call_id is not None and r.call_id == call_id), None)
            run = run or next((r for r in unused if r.call_id is None and r.name == name), None)
            if run is None:
                continue
            unused.remove(run)
            at += 1
            messages.insert(at, {"role": "tool", "tool_call_id": call_id, "content": run.result, "error": run.error,
                                 "timestamp": _iso(run.end_ns)})  # fmt: skip
        at += 1


def _first(spans: list[Span], *keys: str) -> Any:
    for span in spans:
        for key in keys:
            if span.attributes.get(key) is not None:
                return span.attributes[key]
    return None


def trace_outcome(spans: list[Span]) -> Outcome | None:
    """The outcome a trace records (module docstring), or ``None`` (unlabelled).

    Raises:
        RecordError: a score that is not a finite number, or a success that is not a boolean.
    """
    score = _first(spans, "flowopt.outcome.score", "gen_ai.evaluation.score.value")
    if score is None:
        score = next((e["attributes"].get("gen_ai.evaluation.score.value") for s in spans for e in s.events
                      if e["name"] == "gen_ai.evaluation.result" and e["attributes"].get("gen_ai.evaluation.score.value") is not None), None)  # fmt: skip
    success = _first(spans, "flowopt.outcome.success")
    if score is not None and (isinstance(score, bool) or not isinstance(score, (int, float)) or not math.isfinite(score)):
        raise RecordError(f"flowopt.outcome.score: a score must be a finite number, got {score!r:.80}", "flowopt.outcome.score")
    if success is not None and not isinstance(success, bool):
        raise RecordError(f"flowopt.outcome.success: expected a boolean, got {success!r:.80}", "flowopt.outcome.success")
    if score is None and success is None:
        return None
    return Outcome(success=success, score=None if score is None else float(score))


def _tool_failed(message: ChatMessage) -> bool:
    return message.error if message.error is not None else (message.content or "").startswith("Error")


def trace_trajectory(trace_id: str, spans: list[Span], stem: str) -> Trajectory:
    """The canonical trajectory of one trace (its spans in start order).

    Raises:
        RecordError: no LLM span, or malformed messages/outcome (the field names the attribute).
        pydantic.ValidationError: a message or the result breaks the canonical schema.
    """
    chat, first_llm = conversation(spans)
    if first_llm is None:
        raise RecordError("trace has no LLM span: no gen_ai.* (input/output messages, prompt/completion) or OpenInference llm.*_messages attributes")
    episode = chat_to_steps(chat, _tool_failed)
    model = _first(spans, "gen_ai.request.model", "gen_ai.response.model", "llm.model_name")
    task_id = _first(spans, "flowopt.task_id")
    agent = _first(spans, "gen_ai.agent.name") or first_llm.resource.get("service.name") or model or stem
    metadata: dict[str, Any] = {"source_format": FORMAT, "spans": len(spans)}
    for key, value in (("model", model), ("provider", _first(spans, "gen_ai.provider.name", "gen_ai.system", "llm.system")),
                       ("service_name", first_llm.resource.get("service.name"))):  # fmt: skip
        if isinstance(value, str):
            metadata[key] = value
    metadata.update(prompt_fingerprint(episode.system_prompt, "system_prompt"))
    return Trajectory(
        trajectory_id=trace_id,
        task_id=str(task_id) if task_id is not None else prompt_task_id(episode.system_prompt, episode.query),
        agent_id=str(agent),
        query=episode.query,
        steps=episode.steps,
        final_answer=episode.final_answer,
        outcome=trace_outcome(spans),
        timestamp=_iso(spans[0].start_ns),
        metadata=metadata,
    )


# --- reading --------------------------------------------------------------------------------


def _one_line(path: Path) -> bool:
    """Whether the file holds a single non-blank line: one compact export request, however large
    (an OTLP/HTTP body saved as is), read as a document rather than refused as an oversized line.

    Raises:
        UnreadableLogError: the file cannot be read.
    """
    with open_log(path) as handle:
        try:
            lines = 0
            while chunk := handle.readline(1 << 20):
                if not chunk.strip():
                    continue
                lines += 1
                while not chunk.endswith(b"\n") and (chunk := handle.readline(1 << 20)):
                    pass  # the rest of a long line
                if lines > 1:
                    return False
        except READ_ERRORS as error:
            raise UnreadableLogError(str(path), f"read failed: {error}") from None
    return lines == 1


def _exports(path: Path, max_record_bytes: int) -> Iterator[tuple[Any, str, int | None]]:
    """``(export request or RecordError, pointer prefix, line)`` for each export in the file:
    the whole document (pretty-printed, or one line), or each line of a JSONL file (a bad line
    is its RecordError)."""
    if is_document(head_lines(path)) or _one_line(path):
        document = load_document(path, max_record_bytes)
        if document is not None:
            yield document.value, "", None
        return
    with open_log(path) as handle:
        try:
            for line_no, (line, oversized) in enumerate(bounded_lines(handle, max_record_bytes), start=1):
                if oversized is not None:
                    yield oversized_error(oversized, max_record_bytes, len(line)), "", line_no
                elif line.strip():
                    try:
                        yield decode_element(line.strip(), max_record_bytes), "", line_no
                    except RecordError as error:
                        yield error, "", line_no
        except READ_ERRORS as error:
            raise UnreadableLogError(str(path), f"read failed: {error}") from None


def parse(path: str | Path, *, max_record_bytes: int = DEFAULT_MAX_RECORD_BYTES) -> RecordStream:
    """Stream the traces of an OTLP/JSON export file as trajectories (one record per trace; a
    span or export line that cannot be read is a record of its own, quarantined). The whole file
    is read before the first trace is yielded: a trace's spans may lie anywhere in it.

    Raises:
        UnreadableLogError: the file cannot be read, or is a document broken in its structure.
    """
    path = Path(path)
    books = Books(path, FORMAT)
    stem = display_path(path.stem)

    def records() -> Iterator[ValidRecord | QuarantinedRecord]:
        traces: dict[str, list[Span]] = {}
        for export, prefix, line in _exports(path, max_record_bytes):
            if isinstance(export, RecordError):
                books.records_read += 1
                yield books.quarantine(export, b"", line=line)
                continue
            try:
                spans = list(iter_spans(export, prefix, line))
            except RecordError as error:
                books.records_read += 1
                yield books.quarantine(error, orjson.dumps(export)[:65536], line=line, pointer=prefix or "")
                continue
            for item in spans:
                if isinstance(item, Span):
                    traces.setdefault(item.trace_id, []).append(item)
                else:
                    error, raw, pointer = item
                    books.records_read += 1
                    yield books.quarantine(error, _dump(raw), line=line, pointer=pointer)
        if books.records_read == 0 and not traces:
            yield books.empty_file()
            return
        for trace_id, spans in traces.items():
            spans.sort(key=lambda s: s.start_ns)
            first = min(spans, key=lambda s: (s.line or 0, s.pointer))
            books.records_read += 1
            try:
                try:
                    yield books.accept(trace_trajectory(trace_id, spans, stem), first.pointer, line=first.line, pointer=first.pointer)
                except RecursionError as deep:
                    raise record_guard(deep) from None
            except RecordError as error:
                yield books.quarantine(error, _dump({"traceId": trace_id, "spans": [s.raw for s in spans]}), line=first.line, pointer=first.pointer)
            except ValueError as error:  # pydantic's ValidationError is a ValueError
                yield books.quarantine(RecordError(f"trace {trace_id}: {str(error).splitlines()[0]}"), _dump({"traceId": trace_id, "spans": [s.raw for s in spans]}),
                                       line=first.line, pointer=first.pointer)  # fmt: skip

    return RecordStream(books, records())


def _dump(value: Any) -> bytes:
    try:
        return orjson.dumps(value)
    except (TypeError, orjson.JSONEncodeError):
        return repr(value).encode()


def detect(path: Path) -> bool:
    """Whether ``path`` is an OTLP/JSON trace export: ``"resourceSpans"`` (or the protobuf
    field name ``"resource_spans"``) within its first 64 KiB.

    Raises:
        UnreadableLogError: the file cannot be opened or read.
    """
    with open_log(Path(path)) as handle:
        try:
            head = handle.read(_DETECT_BYTES)
        except READ_ERRORS as error:
            raise UnreadableLogError(str(path), f"read failed: {error}") from None
    return b'"resourceSpans"' in head or b'"resource_spans"' in head
