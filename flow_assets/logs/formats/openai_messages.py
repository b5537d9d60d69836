"""OpenAI chat-messages JSONL, format ``openai-chat``: one ``{"messages": [...], "tools": [...]}``
per line, the fine-tuning / evals shape that logging proxies and tracing tools export (a JSON
document holding one such object, a list of them, or one bare list of messages is read too).

Registered through the plug-in protocol (``detect`` / ``parse``, flow_assets/logs/plugins.py).
Messages map to steps by :func:`.openai_chat.chat_to_steps`, the tau-bench rules. Before that,
each message is normalised one to one, so a quarantine field still names ``messages.<i>``:
content given as a list of parts keeps its text parts (``text``, ``input_text``,
``output_text``) joined by newlines; role ``developer`` is read as ``system``; the legacy
``function_call`` / role ``function`` pair becomes a tool call answered by the next ``function``
message. A tool step fails when its result text starts with ``Error`` (as tau-bench; the format
has no error flag). Ids and outcome: :mod:`.chat_records`.

Two documented fields serve training from the text (an agent that logs its own episodes,
docs/log-format.md), each read at the top level, then inside ``metadata`` (:func:`.chat_records.pick`):

* ``context_messages`` (an integer ``n``): the first ``n`` messages are the agent's fixed
  prompt (system prompt, few-shot examples) sent before the episode's query. They are not the
  episode: its query is the first user message after them and its steps start there. The
  trajectory keeps them, as normalised, in ``metadata.context``, and the record's ``tools`` in
  ``metadata.tools``, so every turn can be rendered again with what the policy saw
  (:func:`flow_assets.policy.rollouts.text_training_samples`).
* ``temperature`` (a number >= 0): the sampling temperature the agent was served at, copied
  to ``metadata.temperature`` (where the text path reads the behaviour policy's temperature).

An assistant message may carry the API's ``finish_reason`` for the reply it was; the steps of a
reply cut at its token cap (``"length"``) are listed in ``metadata.cut_steps``, and the text path
renders such a turn without the end-of-turn token the template would close it with (the policy
never sampled one).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict

from flow_assets.logs.formats.chat_records import chat_metadata, common_fields, detect_dialect, pick, stream_chat_file
from flow_assets.logs.formats.common import DEFAULT_MAX_RECORD_BYTES, RecordError, RecordStream
from flow_assets.logs.formats.openai_chat import ChatMessage, chat_to_steps
from flow_assets.logs.records import display_path
from flow_assets.logs.schema import Trajectory

FORMAT = "openai-chat"
TEXT_PARTS = ("text", "input_text", "output_text")


class ChatRecord(BaseModel):
    """The part of a record the steps need: its messages, validated strictly."""

    model_config = ConfigDict(extra="ignore", strict=True)

    messages: list[ChatMessage]


def _text_of(content: Any, field: str) -> Any:
    """Content as text: a string unchanged, a list of parts as its text parts joined by
    newlines (images and audio carry no text); anything else is left for validation to refuse."""
    if not isinstance(content, list):
        return content
    texts = []
    for j, part in enumerate(content):
        if not isinstance(part, dict):
            raise RecordError(f"{field}.{j}: a content part must be an object", f"{field}.{j}")
        if part.get("type") in TEXT_PARTS and isinstance(part.get("text"), str):
            texts.append(part["text"])
    return "\n".join(texts) if texts else None


def normalise_messages(messages: Any) -> list[Any]:
    """The messages of one record rewritten one to one into the shape
    :class:`~.openai_chat.ChatMessage` validates (module docstring); elements that are not
    objects are kept as they are, for validation to name.

    Raises:
        RecordError: ``messages`` is not a list, or a content part is not an object.
    """
    if not isinstance(messages, list):
        raise RecordError("messages: expected a list of chat messages", "messages")
    out: list[Any] = []
    pending_function: list[str] = []  # legacy function calls not yet answered, oldest first
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            out.append(message)
            continue
        m = dict(message)
        m["content"] = _text_of(m.get("content"), f"messages.{i}.content")
        if m.get("role") == "developer":
            m["role"] = "system"
        call = m.pop("function_call", None)
        if m.get("role") == "assistant" and isinstance(call, dict) and not m.get("tool_calls"):
            call_id = f"function_call@{i}"
            m["tool_calls"] = [{"id": call_id, "function": call}]
            pending_function.append(call_id)
        if m.get("role") == "function":
            m["role"] = "tool"
            m["tool_call_id"] = pending_function.pop(0) if pending_function else None
            m.pop("name", None)
        out.append(m)
    return out


def _failed(tool_message: ChatMessage) -> bool:
    return (tool_message.content or "").startswith("Error")


def openai_chat_trajectory(record: dict[str, Any], default_id: str, stem: str) -> Trajectory:
    """The canonical trajectory of one chat-messages record.

    Raises:
        RecordError: a documented field has the wrong type, or the record has no messages.
        pydantic.ValidationError: a message breaks :class:`~.openai_chat.ChatMessage` (the
            location names ``messages.<i>``).
    """
    if "messages" not in record:
        raise RecordError("messages: missing (an OpenAI chat record is {\"messages\": [...]})", "messages")
    normalised = normalise_messages(record["messages"])
    chat = ChatRecord.model_validate({"messages": normalised})
    n = context_messages(record, len(chat.messages))
    episode = chat_to_steps(chat.messages[n:], _failed)
    system = next((m.content or "" for m in chat.messages[:n] if m.role == "system"), episode.system_prompt)
    model = record.get("model")
    metadata = chat_metadata(FORMAT, record, model, system)
    if cut := episode.cut_steps(chat.messages[n:]):
        metadata["cut_steps"] = cut
    if n:
        metadata["context"] = normalised[:n]
        if isinstance(record.get("tools"), list):
            metadata["tools"] = record["tools"]
    temperature, field = pick(record, "temperature")
    if field is not None:
        if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or not math.isfinite(temperature) or temperature < 0:
            raise RecordError(f"{field}: a temperature must be a finite number >= 0, got {temperature!r:.80}", field)
        metadata["temperature"] = float(temperature)
    return Trajectory(
        query=episode.query,
        steps=episode.steps,
        final_answer=episode.final_answer,
        metadata=metadata,
        **common_fields(record, default_id, stem, model, system, episode.query),
    )


def context_messages(record: dict[str, Any], total: int) -> int:
    """``context_messages`` of ``record`` (module docstring), 0 when absent.

    Raises:
        RecordError: not an integer, negative, or not leaving a message for the episode.
    """
    value, field = pick(record, "context_messages")
    if field is None:
        return 0
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < total:
        raise RecordError(f"{field}: expected an integer from 0 to {total - 1} (messages before the query), got {value!r:.80}", field)
    return value


def detect(path: Path) -> bool:
    """Whether ``path`` holds OpenAI chat-messages records (:func:`.chat_records.dialect`)."""
    return detect_dialect(Path(path), "openai")


def parse(path: str | Path, *, max_record_bytes: int = DEFAULT_MAX_RECORD_BYTES) -> RecordStream:
    """Stream the records of an OpenAI chat-messages file; a bad record is quarantined with
    its line (or pointer) and field, the others proceed.

    Raises:
        UnreadableLogError: the file cannot be read, or is a JSON document broken in its structure.
    """
    path = Path(path)
    stem = display_path(path.stem)
    return stream_chat_file(path, FORMAT, lambda obj, default_id: openai_chat_trajectory(obj, default_id, stem), max_record_bytes)
