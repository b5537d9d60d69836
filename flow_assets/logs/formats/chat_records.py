"""What the chat-transcript formats (``openai-chat``, ``anthropic-messages``) share: reading a file
that is either JSONL (one record per line) or one JSON document, detecting which dialect a record
is written in, and the documented fields a record's ids and outcome are taken from.

Fields read from a record (top level first, then inside its ``metadata`` object; the first one
present and not null wins; see docs/log-format.md, section 3):

* outcome ``score``: ``reward``, ``score``, ``metadata.reward``, ``metadata.score`` (a finite
  number); ``success``: ``success``, ``metadata.success`` (a boolean). A score alone leaves
  ``success`` null: these exports carry no threshold, and inventing one would mislabel episodes.
  Neither present: the trajectory is unlabelled (stored, no reward until something labels it).
* ``task_id`` (string or integer), ``trajectory_id``, ``agent_id``, ``adapter_version``,
  ``timestamp`` (strings). Without a ``task_id`` the task is the prompt: ``prompt:`` and the first
  16 hex of the sha256 of the system prompt and the first user message, so runs of one prompt
  form one GRPO group. Without a ``trajectory_id``: ``{file stem}:{line}`` (JSONL) or
  ``{file stem}{JSON pointer}`` (a document). Without an ``agent_id``: the record's model name,
  else the file stem.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import orjson

from flow_assets.logs.formats.common import (
    READ_ERRORS,
    RecordError,
    RecordStream,
    bounded_lines,
    empty_stream,
    load_document,
    open_log,
    stream_elements,
    stream_jsonl,
)
from flow_assets.logs.formats.openai_chat import prompt_fingerprint
from flow_assets.logs.records import UnreadableLogError, display_path
from flow_assets.logs.schema import Outcome

# A converter of this family: one decoded record and the trajectory id to use when the record
# names none (it depends on where the record sits: a line or a JSON pointer).
RecordConverter = Callable[[dict[str, Any], str], Any]

SNIFF_LINES = 20
"""How many non-blank lines :func:`sniff_records` decodes when detecting: enough to step over a
few corrupt lines, few enough to stay O(1) on a large file."""
SNIFF_LINE_BYTES = 4 * 2**20

ANTHROPIC_BLOCKS = frozenset({"tool_use", "tool_result", "thinking", "redacted_thinking", "server_tool_use"})


def head_lines(path: Path) -> list[bytes]:
    """Up to :data:`SNIFF_LINES` non-blank, stripped lines from the top of ``path`` (lines over
    :data:`SNIFF_LINE_BYTES` skipped). Raises UnreadableLogError when the file cannot be read."""
    lines: list[bytes] = []
    with open_log(path) as handle:
        try:
            for line, oversized in bounded_lines(handle, SNIFF_LINE_BYTES):
                if oversized is None and line.strip():
                    lines.append(line.strip())
                    if len(lines) >= SNIFF_LINES:
                        break
        except READ_ERRORS as error:
            raise UnreadableLogError(str(path), f"read failed: {error}") from None
    return lines


def is_document(lines: list[bytes]) -> bool:
    """Whether a file whose first non-blank lines are ``lines`` is one JSON document rather
    than JSONL: its first line is a lone ``{``, or starts with ``[`` (a JSONL record is an
    object on one line; an array is a document: a list of records or of messages)."""
    return bool(lines) and (lines[0] == b"{" or lines[0].startswith(b"["))


def sniff_records(path: Path) -> Iterator[Any]:
    """Decoded records from the head of ``path`` for ``detect``: each decodable line of a JSONL
    file, or the elements (up to :data:`SNIFF_LINES`) of a whole document. Never raises on
    content: an unreadable or non-JSON file yields nothing.

    Raises:
        UnreadableLogError: the file cannot be opened or read.
    """
    lines = head_lines(path)
    if not is_document(lines):
        for line in lines:
            try:
                yield orjson.loads(line)
            except orjson.JSONDecodeError:
                continue
        return
    try:
        document = load_document(path)
    except UnreadableLogError:
        return
    if document is None:
        return
    value = document.value
    if isinstance(value, list) and value and all(isinstance(e, dict) and "role" in e for e in value[:SNIFF_LINES]):
        yield {"messages": value}  # the whole file is one conversation
    elif isinstance(value, list):
        yield from value[:SNIFF_LINES]
    else:
        yield value


def dialect(record: Any) -> str | None:
    """``"anthropic"``, ``"openai"`` or ``None``: which chat dialect a decoded record is written
    in. A record is a chat record when it holds a ``messages`` list of objects with a ``role``.
    Anthropic evidence (any one): a top-level ``system`` (OpenAI puts the system prompt among the
    messages), a ``response`` object, or a content block of type ``tool_use``, ``tool_result``,
    ``thinking``, ``redacted_thinking`` or ``server_tool_use``. OpenAI evidence: a ``tool``,
    ``system``, ``developer`` or ``function`` role, or ``tool_calls``/``function_call``. A
    text-only conversation with neither is read as OpenAI (both map it to the same steps)."""
    if not isinstance(record, dict):
        return None
    messages = record.get("messages")
    if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) and "role" in m for m in messages):
        return None
    for message in messages:
        if message.get("role") in ("tool", "system", "developer", "function") or "tool_calls" in message or "function_call" in message:
            return "openai"
        content = message.get("content")
        if isinstance(content, list) and any(isinstance(b, dict) and b.get("type") in ANTHROPIC_BLOCKS for b in content):
            return "anthropic"
    if "system" in record or isinstance(record.get("response"), dict):
        return "anthropic"
    return "openai"


def detect_dialect(path: Path, wanted: str) -> bool:
    """Whether the first chat record found at the head of ``path`` is in dialect ``wanted``.

    Raises:
        UnreadableLogError: the file cannot be opened or read.
    """
    for record in sniff_records(path):
        found = dialect(record)
        if found is not None:
            return found == wanted
    return False


def stream_chat_file(path: Path, fmt: str, convert: RecordConverter, max_record_bytes: int) -> RecordStream:
    """The records of a chat-transcript file: JSONL (one record per line, read by
    :func:`~.common.stream_jsonl`) or one document (:func:`is_document`): an object is one
    record (pointer ``""``), an array of messages is one record, an array of anything else is
    one record per element (pointer ``/<i>``). ``convert(record, default_id)`` builds the
    trajectory.

    Raises:
        UnreadableLogError: the file cannot be read, or is a document whose JSON structure is
            broken (truncated, trailing bytes).
    """
    stem = display_path(path.stem)
    if not is_document(head_lines(path)):
        return stream_jsonl(path, fmt, lambda obj, line: convert(obj, f"{stem}:{line}"), max_record_bytes)
    document = load_document(path, max_record_bytes)
    if document is None:
        return empty_stream(path, fmt)
    value = document.value
    if isinstance(value, list) and value and all(isinstance(e, dict) and "role" in e for e in value):
        elements: Any = [("", {"messages": value})]
    elif isinstance(value, list):
        elements = ((f"/{i}", element) for i, element in enumerate(value))
    else:
        elements = [("", value)]
    return stream_elements(path, fmt, document, elements, lambda obj, pointer: convert(obj, f"{stem}{pointer}"))


def pick(record: dict[str, Any], name: str) -> tuple[Any, str | None]:
    """``(value, field)`` of ``name`` at the top of ``record``, else inside its ``metadata``
    object; ``(None, None)`` when neither holds a non-null value."""
    if record.get(name) is not None:
        return record[name], name
    metadata = record.get("metadata")
    if isinstance(metadata, dict) and metadata.get(name) is not None:
        return metadata[name], f"metadata.{name}"
    return None, None


def text_field(record: dict[str, Any], name: str) -> str | None:
    """A string field read by :func:`pick`; an integer is accepted for ``task_id``.

    Raises:
        RecordError: the value is present but not a non-empty string (naming the field).
    """
    value, field = pick(record, name)
    if value is None:
        return None
    if name == "task_id" and isinstance(value, int) and not isinstance(value, bool):
        return str(value)
    if not isinstance(value, str) or not value:
        raise RecordError(f"{field}: expected a non-empty string, got {value!r:.80}", field)
    return value


def outcome_of(record: dict[str, Any]) -> Outcome | None:
    """The outcome from the documented fields (module docstring); ``None`` when unlabelled.

    Raises:
        RecordError: a score that is not a finite number, or a success that is not a boolean.
    """
    score, score_field = None, None
    for name in ("reward", "score"):
        score, score_field = (record[name], name) if record.get(name) is not None else (None, None)
        if score_field:
            break
    if score_field is None:
        for name in ("reward", "score"):
            score, score_field = pick({"metadata": record.get("metadata")}, name)
            if score_field:
                break
    if score_field is not None:
        if isinstance(score, bool) or not isinstance(score, (int, float)) or not math.isfinite(score):
            raise RecordError(f"{score_field}: a reward must be a finite number, got {score!r:.80}", score_field)
        score = float(score)
    success, success_field = pick(record, "success")
    if success_field is not None and not isinstance(success, bool):
        raise RecordError(f"{success_field}: expected true or false, got {success!r:.80}", success_field)
    if score is None and success is None:
        return None
    return Outcome(success=success, score=score)


def prompt_task_id(system: str | None, query: str) -> str:
    """The task id of a record that names none: ``prompt:`` + the first 16 hex of the sha256 of
    the JSON array ``[system, query]`` (UTF-8), so one prompt's runs share a task."""
    return "prompt:" + hashlib.sha256(orjson.dumps([system, query])).hexdigest()[:16]


def tool_facts(tools: Any) -> dict[str, Any]:
    """Metadata about a record's tool specs without storing them: ``tool_names`` (in order) and
    ``tools_sha256`` (of their compact JSON); empty when the record lists none."""
    if not isinstance(tools, list) or not tools:
        return {}
    names = []
    for tool in tools:
        if isinstance(tool, dict):
            function = tool.get("function") if isinstance(tool.get("function"), dict) else tool
            if isinstance(function.get("name"), str):
                names.append(function["name"])
    return {"tool_names": names, "tools_sha256": hashlib.sha256(orjson.dumps(tools)).hexdigest()}


def common_fields(record: dict[str, Any], default_id: str, stem: str, model: Any, system: str | None, query: str) -> dict[str, Any]:
    """The :class:`~flow_assets.logs.schema.Trajectory` fields every chat format fills the same
    way (ids, outcome, timestamp) from the documented fields (module docstring).

    Raises:
        RecordError: one of those fields has the wrong type.
    """
    task_id = text_field(record, "task_id") or prompt_task_id(system, query)
    agent_id = text_field(record, "agent_id") or (model if isinstance(model, str) and model else stem)
    return {
        "trajectory_id": text_field(record, "trajectory_id") or default_id,
        "task_id": task_id,
        "agent_id": agent_id,
        "adapter_version": text_field(record, "adapter_version"),
        "timestamp": text_field(record, "timestamp"),
        "outcome": outcome_of(record),
    }


def chat_metadata(fmt: str, record: dict[str, Any], model: Any, system: str | None) -> dict[str, Any]:
    """Source facts kept in a chat trajectory's metadata: format, model, tool names and hash,
    the system prompt's hash and length (never its text), and the record's own ``metadata``."""
    metadata: dict[str, Any] = {"source_format": fmt}
    if isinstance(model, str):
        metadata["model"] = model
    metadata.update(tool_facts(record.get("tools")))
    metadata.update(prompt_fingerprint(system, "system_prompt"))
    if isinstance(record.get("metadata"), dict):
        metadata["source_metadata"] = record["metadata"]
    return metadata

