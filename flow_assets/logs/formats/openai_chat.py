"""OpenAI chat messages with ``tool_calls`` → canonical steps, and the tau-bench run list.

The message→step mapping (a step is one agent decision) is shared with :mod:`.tau2`:

* every assistant tool call is a ``tool`` step (``tool`` = function name, ``input`` = the
  arguments, parsed into a dict when they arrive as a JSON string, ``output`` = the content of
  the tool message answering that call id); a call of the ``think`` tool is a ``plan`` step;
* assistant text that accompanies tool calls is its own ``plan`` step, placed before them;
* assistant text with no tool calls is a ``message`` step, except the last such message of the
  episode, which is the ``answer`` step and the trajectory's ``final_answer``;
* user, system and tool messages are not steps: the query is the first user message, the system
  prompt's sha256 and length are in the metadata.

The steps cannot hold the user's later messages, so a tau-bench record also keeps the whole
conversation as OpenAI messages (``metadata.messages``, :func:`openai_messages`) with the steps
each assistant message became (``metadata.message_steps``): what training on the logged text and
offline evaluation render (:func:`flow_assets.policy.logged_rows.kept_conversation`).

tau-bench's historical trajectories are a JSON list of ``{task_id, trial, reward, info, traj}``.
"""

from __future__ import annotations

import hashlib
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any, Literal

import orjson
from pydantic import BaseModel, ConfigDict, Field, model_validator

from flow_assets.logs.records import display_path
from flow_assets.logs.formats.common import (
    DEFAULT_MAX_RECORD_BYTES,
    TaskId,
    load_document,
    RecordStream,
    empty_stream,
    stream_elements,
    require_document_shape,
)
from flow_assets.logs.schema import FiniteFloat, Outcome, Step, Trajectory

FORMAT = "tau-bench"
THINK_TOOL = "think"


class FunctionCall(BaseModel):
    """The ``function`` part of an OpenAI tool call (tau-bench)."""

    model_config = ConfigDict(extra="ignore", strict=True)

    name: str = Field(min_length=1)
    arguments: Any = None


class ToolCall(BaseModel):
    """One tool call of an assistant message, in either dialect: OpenAI's
    ``{id, function: {name, arguments}}`` (tau-bench) or tau2's ``{id, name, arguments}``."""

    model_config = ConfigDict(extra="ignore", strict=True)

    id: str | None = None
    function: FunctionCall | None = None
    name: str | None = None
    arguments: Any = None

    @model_validator(mode="after")
    def _has_a_name(self) -> ToolCall:
        if self.function is None and not self.name:
            raise ValueError("tool call has neither function.name nor name")
        return self

    @property
    def tool_name(self) -> str:
        """The called function's name."""
        return self.function.name if self.function is not None else str(self.name)

    @property
    def parsed_arguments(self) -> Any:
        """The arguments, decoded into a dict when they are a JSON-object string; any other
        value (a dict already, or a string that is not a JSON object) is returned unchanged."""
        raw = self.function.arguments if self.function is not None else self.arguments
        if isinstance(raw, str):
            try:
                decoded = orjson.loads(raw)
            except orjson.JSONDecodeError:
                return raw
            return decoded if isinstance(decoded, dict) else raw
        return raw


class ChatMessage(BaseModel):
    """One chat message. ``tool_call_id`` (OpenAI) or ``id`` (tau2) ties a tool message to its
    call; ``error`` is tau2's flag on a failed tool call; ``timestamp`` is ISO 8601 (tau2);
    ``finish_reason`` on an assistant message is the API's for the reply it was (``"length"``: cut
    at its token cap), where the log kept it."""

    model_config = ConfigDict(extra="ignore", strict=True)

    role: Literal["system", "user", "assistant", "tool"]
    content: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    id: str | None = None
    error: bool | None = None
    timestamp: str | None = None
    finish_reason: str | None = None


@dataclass(frozen=True)
class ChatEpisode:
    """What a conversation yields besides its outcome: steps, query, final answer, the system
    prompt text (hashed into the metadata) and which steps each assistant message became."""

    steps: list[Step]
    query: str
    final_answer: str | None
    system_prompt: str | None
    #: per assistant message that yielded steps: ``[position in the conversation, [step indices]]``
    message_steps: list[list[Any]]

    def cut_steps(self, messages: list[ChatMessage]) -> list[int]:
        """The steps of the assistant messages of ``messages`` (the conversation this episode
        was made from) whose ``finish_reason`` is ``"length"``: replies cut at their token cap."""
        return [i for position, indices in self.message_steps if messages[position].finish_reason == "length" for i in indices]


def _instant(stamp: str | None) -> datetime | None:
    if stamp is None:
        return None
    try:
        return datetime.fromisoformat(stamp)
    except ValueError:
        return None


def _elapsed_ms(start: datetime | None, end: datetime | None) -> float | None:
    if start is None or end is None:
        return None
    try:
        ms = (end - start).total_seconds() * 1000.0
    except TypeError:  # one stamp has a timezone and the other does not
        return None
    # Clock skew between writers can order stamps backwards; a negative duration is no data.
    return ms if ms >= 0 else None


def _text(message: ChatMessage) -> str | None:
    return message.content if message.content and message.content.strip() else None


def chat_to_steps(
    messages: list[ChatMessage], tool_failed: Callable[[ChatMessage], bool]
) -> ChatEpisode:
    """Map a conversation to canonical steps (rules in the module docstring).

    ``tool_failed(tool_message)`` decides a tool step's ``status``. ``duration_ms`` comes from
    message timestamps where every stamp involved is known: the first step of an assistant turn
    runs from the previous message to its end, each later step of the same turn from the end of
    the step before it; a text step ends at the assistant message, a tool step at its tool
    message. The steps of one turn therefore partition the turn's wall time (milliseconds).
    """
    results = _ResultQueue(messages)
    text_only = [
        i for i, m in enumerate(messages) if m.role == "assistant" and not m.tool_calls and _text(m)
    ]
    answer_at = text_only[-1] if text_only else None

    steps: list[Step] = []
    message_steps: list[list[Any]] = []
    clock: datetime | None = None
    query: str | None = None
    system_prompt: str | None = None
    for position, message in enumerate(messages):
        stamp = _instant(message.timestamp)
        if message.role != "assistant":
            if message.role == "user" and query is None:
                query = message.content or ""
            elif message.role == "system" and system_prompt is None:
                system_prompt = message.content or ""
            clock = stamp
            continue
        turn = _turn_steps(message, position, position == answer_at, stamp, results, tool_failed)
        first = len(steps)
        for fields, end in turn:
            steps.append(Step(index=len(steps), duration_ms=_elapsed_ms(clock, end), **fields))
            clock = end
        if len(steps) > first:
            message_steps.append([position, list(range(first, len(steps)))])
    final_answer = messages[answer_at].content if answer_at is not None else None
    return ChatEpisode(steps, query or "", final_answer, system_prompt, message_steps)


def openai_messages(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """The conversation as OpenAI chat messages, whichever dialect it was logged in: each tool
    call as ``{id, type: "function", function: {name, arguments: <JSON string>}}``, a tool
    message's call id as ``tool_call_id`` (tau2's ``id``); timestamps and tau2's ``error`` flag
    are left out (they are in the steps). This is what a chat template renders."""
    out: list[dict[str, Any]] = []
    for m in messages:
        message: dict[str, Any] = {"role": m.role, "content": m.content}
        if m.tool_calls:
            message["tool_calls"] = [{
                "id": c.id, "type": "function",
                "function": {"name": c.tool_name, "arguments": orjson.dumps(c.parsed_arguments if c.parsed_arguments is not None else {}).decode()},
            } for c in m.tool_calls]  # fmt: skip
        if m.role == "tool":
            message["tool_call_id"] = m.tool_call_id or m.id
        out.append(message)
    return out


class _ResultQueue:
    """Tool messages by call id, in order. tau-bench reuses call ids inside one episode (71
    times in gpt-4o-airline.json), so a call is answered by the first unclaimed tool message
    with its id that comes after the call, not by any message with that id."""

    def __init__(self, messages: list[ChatMessage]):
        self._messages = messages
        self._waiting: dict[str, deque[int]] = {}
        for position, m in enumerate(messages):
            key = m.tool_call_id or m.id
            if m.role == "tool" and key is not None:
                self._waiting.setdefault(key, deque()).append(position)

    def claim(self, call_id: str | None, after: int) -> ChatMessage | None:
        """The tool message answering call ``call_id`` made at position ``after``, or ``None``."""
        queue = self._waiting.get(call_id) if call_id is not None else None
        while queue and queue[0] < after:
            queue.popleft()  # answered an earlier call with the same id
        return self._messages[queue.popleft()] if queue else None


def _turn_steps(
    message: ChatMessage,
    position: int,
    is_answer: bool,
    stamp: datetime | None,
    results: _ResultQueue,
    tool_failed: Callable[[ChatMessage], bool],
) -> Iterator[tuple[dict[str, Any], datetime | None]]:
    """The step fields of one assistant message, each with the instant the step ended."""
    calls = message.tool_calls or []
    if _text(message):
        kind = "plan" if calls else ("answer" if is_answer else "message")
        yield {"kind": kind, "output": message.content}, stamp
    for call in calls:
        result = results.claim(call.id, position)
        name = call.tool_name
        yield {
            "kind": "plan" if name == THINK_TOOL else "tool",
            "tool": name,
            "input": call.parsed_arguments,
            "output": result.content if result is not None else None,
            "status": "error" if result is not None and tool_failed(result) else "ok",
        }, (_instant(result.timestamp) if result is not None else stamp)


def prompt_fingerprint(text: str | None, prefix: str) -> dict[str, Any]:
    """Metadata identifying a prompt without storing it: ``{prefix}_sha256`` (hex of the
    UTF-8 bytes) and ``{prefix}_chars`` (length in characters); empty when there is none."""
    if text is None:
        return {}
    return {
        f"{prefix}_sha256": hashlib.sha256(text.encode("utf-8")).hexdigest(),
        f"{prefix}_chars": len(text),
    }


class TauBenchRun(BaseModel):
    """One element of a tau-bench historical-trajectories list."""

    model_config = ConfigDict(extra="ignore", strict=True)

    task_id: TaskId = Field(min_length=1)
    trial: int
    reward: FiniteFloat
    info: dict[str, Any] = Field(default_factory=dict)
    traj: list[ChatMessage]


def _tau_bench_failed(tool_message: ChatMessage) -> bool:
    # tau-bench's environment reports a failed action only in the text it returns.
    return (tool_message.content or "").startswith("Error")


def tau_bench_trajectory(run: TauBenchRun, stem: str) -> Trajectory:
    """The canonical trajectory of one tau-bench run; ``stem`` (the file name without its
    extension) is the agent id and prefixes the trajectory id.

    Raises:
        pydantic.ValidationError: the result breaks the canonical schema.
    """
    episode = chat_to_steps(run.traj, _tau_bench_failed)
    metadata: dict[str, Any] = {"source_format": FORMAT, "trial": run.trial}
    if "user_cost" in run.info:
        metadata["user_cost"] = run.info["user_cost"]
    metadata.update(prompt_fingerprint(episode.system_prompt, "system_prompt"))
    metadata["messages"] = openai_messages(run.traj)
    metadata["message_steps"] = episode.message_steps
    return Trajectory(
        trajectory_id=f"{stem}/task{run.task_id}/trial{run.trial}",
        task_id=run.task_id,
        agent_id=stem,
        query=episode.query,
        steps=episode.steps,
        final_answer=episode.final_answer,
        outcome=Outcome(success=run.reward >= 1.0, score=run.reward),
        metadata=metadata,
    )


def stream_tau_bench(
    path: str | Path, *, max_record_bytes: int = DEFAULT_MAX_RECORD_BYTES
) -> RecordStream:
    """Stream the records of a tau-bench trajectories file (a JSON list); each element is one record whose
    A document that does not decode whole is read element by element
    (``common.split_document``): a bad element (nested too deeply, over ``max_record_bytes``,
    not JSON) is one quarantined record.

    Raises:
        UnreadableLogError: the file cannot be read, is not JSON, or is not a JSON list.
    """
    path = Path(path)
    document = load_document(path, max_record_bytes)
    if document is None:
        return empty_stream(path, FORMAT)
    is_list = isinstance(document.value, list)
    require_document_shape(path, document, is_list, "a JSON list of tau-bench runs")

    def convert(obj: dict[str, Any], pointer: str) -> Trajectory:
        return tau_bench_trajectory(TauBenchRun.model_validate(obj), display_path(path.stem))

    elements = ((f"/{i}", element) for i, element in enumerate(document.value))
    return stream_elements(path, FORMAT, document, elements, convert)
