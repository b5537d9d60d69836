"""Anthropic Messages transcripts, format ``anthropic-messages``: a request's ``system`` +
``messages`` (+ ``tools``, ``model``) and, under ``response``, the Messages API's reply, one
record per JSONL line (or a JSON document holding one record, a list of records, or one bare
list of messages), as a logging proxy records a ``POST /v1/messages`` exchange.

Registered through the plug-in protocol (``detect`` / ``parse``, flow_assets/logs/plugins.py).
Content blocks are rewritten into OpenAI-style chat messages and mapped to steps by
:func:`.openai_chat.chat_to_steps` (the rules of docs/log-format.md, section 3):

* an assistant message's ``text`` blocks are its text (joined by newlines), its ``tool_use``
  blocks its tool calls (``input`` is the arguments); ``thinking`` / ``redacted_thinking`` blocks
  are not steps (counted in ``metadata.thinking_blocks``);
* a user message's ``tool_result`` blocks each answer the ``tool_use`` with that id (their
  content, a string or text blocks, is the step's output; ``is_error: true`` makes it fail),
  and its ``text`` blocks are a user message after them;
* ``response`` (when present) is the last assistant message; ``system`` (a string or text
  blocks) is kept only as its sha256 and length, like every format's system prompt.

A block of any other type (``image``, ``document``, server tool blocks) carries no step and is
counted in ``metadata.skipped_blocks``. Ids and outcome: :mod:`.chat_records`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from flow_assets.logs.formats.chat_records import chat_metadata, common_fields, detect_dialect, stream_chat_file
from flow_assets.logs.formats.common import DEFAULT_MAX_RECORD_BYTES, RecordError, RecordStream
from flow_assets.logs.formats.openai_chat import ChatMessage, chat_to_steps
from flow_assets.logs.records import display_path
from flow_assets.logs.schema import Trajectory

FORMAT = "anthropic-messages"
THINKING = ("thinking", "redacted_thinking")


def _block_text(content: Any, field: str) -> str | None:
    """The text of a ``tool_result``'s content: a string, or its ``text`` blocks joined."""
    if content is None or isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise RecordError(f"{field}: expected a string or a list of content blocks", field)
    texts = [b["text"] for b in content if isinstance(b, dict) and b.get("type") == "text" and isinstance(b.get("text"), str)]
    return "\n".join(texts)


class _Counts:
    def __init__(self) -> None:
        self.thinking = 0
        self.skipped = 0


def _message(message: Any, field: str, counts: _Counts) -> list[ChatMessage]:
    """One Anthropic message as chat messages (module docstring).

    Raises:
        RecordError: the message or one of its blocks is malformed (the field names it).
    """
    if not isinstance(message, dict):
        raise RecordError(f"{field}: a message must be an object", field)
    role = message.get("role")
    if role not in ("user", "assistant", "system"):
        raise RecordError(f"{field}.role: expected 'user' or 'assistant', got {role!r:.40}", f"{field}.role")
    content = message.get("content")
    if isinstance(content, str) or content is None:
        return [ChatMessage(role=role, content=content)]
    if not isinstance(content, list):
        raise RecordError(f"{field}.content: expected a string or a list of content blocks", f"{field}.content")
    texts: list[str] = []
    calls: list[dict[str, Any]] = []
    results: list[ChatMessage] = []
    for j, block in enumerate(content):
        where = f"{field}.content.{j}"
        kind = block.get("type") if isinstance(block, dict) else None
        if kind is None:
            raise RecordError(f"{where}: a content block must be an object with a 'type'", where)
        if kind == "text":
            if not isinstance(block.get("text"), str):
                raise RecordError(f"{where}.text: expected a string", f"{where}.text")
            texts.append(block["text"])
        elif kind == "tool_use" and role == "assistant":
            if not isinstance(block.get("name"), str) or not block["name"]:
                raise RecordError(f"{where}.name: a tool_use block needs its tool name", f"{where}.name")
            calls.append({"id": block.get("id"), "name": block["name"], "arguments": block.get("input")})
        elif kind == "tool_result" and role == "user":
            if not isinstance(block.get("tool_use_id"), str):
                raise RecordError(f"{where}.tool_use_id: a tool_result must name its tool_use id", f"{where}.tool_use_id")
            is_error = block.get("is_error")
            if is_error is not None and not isinstance(is_error, bool):
                raise RecordError(f"{where}.is_error: expected true or false", f"{where}.is_error")
            results.append(ChatMessage(role="tool", tool_call_id=block["tool_use_id"],
                                       content=_block_text(block.get("content"), f"{where}.content"), error=is_error))  # fmt: skip
        elif kind in THINKING:
            counts.thinking += 1
        else:
            counts.skipped += 1
    text = "\n".join(texts) if texts else None
    if role == "assistant":
        return [ChatMessage(role="assistant", content=text, tool_calls=calls or None)]
    return results + ([ChatMessage(role=role, content=text)] if text is not None or not results else [])


def _system_text(system: Any) -> str | None:
    if system is None or isinstance(system, str):
        return system
    if isinstance(system, list):
        return "\n".join(b["text"] for b in system if isinstance(b, dict) and isinstance(b.get("text"), str))
    raise RecordError("system: expected a string or a list of text blocks", "system")


def anthropic_trajectory(record: dict[str, Any], default_id: str, stem: str) -> Trajectory:
    """The canonical trajectory of one Anthropic Messages record.

    Raises:
        RecordError: a message, block or documented field is malformed (the field names it).
        pydantic.ValidationError: the result breaks the canonical schema.
    """
    messages = record.get("messages")
    if not isinstance(messages, list):
        raise RecordError("messages: expected a list of messages", "messages")
    counts = _Counts()
    chat: list[ChatMessage] = []
    system = _system_text(record.get("system"))
    if system is not None:
        chat.append(ChatMessage(role="system", content=system))
    for i, message in enumerate(messages):
        chat.extend(_message(message, f"messages.{i}", counts))
    response = record.get("response")
    if response is not None:
        if not isinstance(response, dict):
            raise RecordError("response: expected the Messages API's response object", "response")
        chat.extend(_message({"role": "assistant", "content": response.get("content")}, "response", counts))
    episode = chat_to_steps(chat, lambda m: bool(m.error))
    model = record.get("model") or (response.get("model") if isinstance(response, dict) else None)
    metadata = chat_metadata(FORMAT, record, model, episode.system_prompt)
    if isinstance(response, dict) and isinstance(response.get("stop_reason"), str):
        metadata["stop_reason"] = response["stop_reason"]
    metadata.update({k: v for k, v in (("thinking_blocks", counts.thinking), ("skipped_blocks", counts.skipped)) if v})
    return Trajectory(
        query=episode.query,
        steps=episode.steps,
        final_answer=episode.final_answer,
        metadata=metadata,
        **common_fields(record, default_id, stem, model, episode.system_prompt, episode.query),
    )


def detect(path: Path) -> bool:
    """Whether ``path`` holds Anthropic Messages records (:func:`.chat_records.dialect`)."""
    return detect_dialect(Path(path), "anthropic")


def parse(path: str | Path, *, max_record_bytes: int = DEFAULT_MAX_RECORD_BYTES) -> RecordStream:
    """Stream the records of an Anthropic Messages transcript file; a bad record is quarantined
    with its line (or pointer) and field, the others proceed.

    Raises:
        UnreadableLogError: the file cannot be read, or is a JSON document broken in its structure.
    """
    path = Path(path)
    stem = display_path(path.stem)
    return stream_chat_file(path, FORMAT, lambda obj, default_id: anthropic_trajectory(obj, default_id, stem), max_record_bytes)
