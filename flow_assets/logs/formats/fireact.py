"""FireAct HotpotQA ReAct traces: a JSON object keyed by question id, each value
``{reward, em, f1, gt, pred, prompt, traj, [traj_by_line]}``.

``traj`` is either a chat list (user question, then assistant ``Thought: ...\\nAction: ...``
turns answered by user ``Observation: ...`` turns) or one Alpaca-format string whose
``### Response:`` part holds ``Thought:``/``Action:``/``Observation:`` lines.

Steps: a thought is a ``plan`` step; ``Action: finish[a]`` is the ``answer`` step (output ``a``);
any other ``Action: name[arg]`` is a ``tool`` step (``search`` gets ``input={"query": arg}``,
other names ``{"argument": arg}``) whose output is the observation that follows, with status
``error`` when the environment reports that the action "generated an exception".

The argument is the text between the first ``[`` and the last ``]`` of the action (the rest of
it if unclosed); unlabelled lines continue the segment before them.

In the chat form one assistant message is one LLM turn and the environment executed only its
first line-start ``Action:``; when the model went on writing Thought/Action lines in the same
message, that text was never executed and is kept verbatim in ``metadata["unexecuted_text"]``
rather than turned into steps.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict

from flow_assets.logs.records import display_path
from flow_assets.logs.formats.common import (
    DEFAULT_MAX_RECORD_BYTES,
    RecordError,
    RecordStream,
    empty_stream,
    load_document,
    pointer_token,
    stream_elements,
    require_document_shape,
)
from flow_assets.logs.schema import FiniteFloat, Outcome, Step, Trajectory

FORMAT = "fireact"
FINISH = "finish"
_PREFIX = re.compile(r"^(Thought|Action|Observation)\s*(?:\d+\s*)?:\s?")
_FAILED = "generated an exception"


class FireActRecord(BaseModel):
    """One question's run. ``reward`` is exact match against ``gt``; ``f1`` is token F1."""

    model_config = ConfigDict(extra="ignore", strict=True)

    reward: bool
    f1: FiniteFloat
    em: bool | None = None
    gt: str | None = None
    pred: str | None = None
    traj: Any


def agent_id_from_name(stem: str) -> str:
    """``fireact:<model>-ft`` or ``fireact:<model>-lora`` from a FireAct trajectory file name
    (e.g. ``fireact:gpt-3.5-turbo-0613-ft``, ``fireact:llama-2-13b-lora``); ``fireact:<stem>``
    when the name follows neither pattern."""
    if match := re.search(r"_ft_(gpt-[\d.]+-turbo(?:-\d{4})?)", stem):
        return f"fireact:{match[1]}-ft"
    if match := re.search(r"_lora_(llama-\d+-\d+b)", stem):
        return f"fireact:{match[1]}-lora"
    return f"fireact:{stem}"


def _segments(text: str) -> list[tuple[str, str]]:
    """Split ReAct text into ``(label, body)`` segments; a line without a known label continues
    the segment before it (multi-line observations), leading unlabelled lines are dropped."""
    segments: list[tuple[str, list[str]]] = []
    for line in text.split("\n"):
        match = _PREFIX.match(line)
        if match:
            segments.append((match[1], [line[match.end():]]))
        elif segments:
            segments[-1][1].append(line)
    return [(label, "\n".join(body).strip()) for label, body in segments]


def _action_fields(action: str) -> dict[str, Any]:
    """Step fields (without output) of one ``name[argument]`` action."""
    opening = action.find("[")
    if opening < 0:
        name, argument = action.strip(), None
    else:
        closing = action.rfind("]")
        name = action[:opening].strip()
        argument = action[opening + 1 : closing] if closing > opening else action[opening + 1 :]
    if name == FINISH:
        return {"kind": "answer", "output": argument}
    key = "query" if name == "search" else "argument"
    return {"kind": "tool", "tool": name or None, "input": {key: argument}}


class _Builder:
    """Accumulates steps from labelled segments, attaching observations to the open tool step."""

    def __init__(self) -> None:
        self.steps: list[dict[str, Any]] = []
        self._open_tool: dict[str, Any] | None = None

    def thought(self, text: str) -> None:
        """A ``Thought:`` segment: a plan step."""
        self.steps.append({"kind": "plan", "output": text})
        self._open_tool = None

    def action(self, text: str) -> None:
        """An ``Action:`` segment: a tool or answer step."""
        fields = _action_fields(text)
        self.steps.append(fields)
        self._open_tool = fields if fields["kind"] == "tool" else None

    def observation(self, text: str) -> None:
        """An ``Observation:`` segment: the output of the open tool step, if any."""
        # Observations after finish ("Episode finished, reward = ...") restate the outcome.
        if self._open_tool is not None:
            self._open_tool["output"] = text
            self._open_tool["status"] = "error" if _FAILED in text else "ok"
            self._open_tool = None

    def feed(self, segments: list[tuple[str, str]]) -> None:
        """Apply labelled segments in order."""
        handlers = {"Thought": self.thought, "Action": self.action, "Observation": self.observation}
        for label, body in segments:
            handlers[label](body)


def _split_turn(content: str) -> tuple[str, str]:
    """``(executed, rest)`` of an assistant turn: ``executed`` ends with the turn's first
    line-start ``Action:`` line, ``rest`` is what the model wrote after it."""
    lines = content.split("\n")
    for i, line in enumerate(lines):
        match = _PREFIX.match(line)
        if match and match[1] == "Action":
            return "\n".join(lines[: i + 1]), "\n".join(lines[i + 1 :])
    return content, ""


def _chat_episode(traj: list[Any]) -> tuple[str, _Builder, list[dict[str, Any]]]:
    """Query, steps and unexecuted continuations of a chat-form trace."""
    builder = _Builder()
    unexecuted: list[dict[str, Any]] = []
    query: str | None = None
    for turn_no, turn in enumerate(traj):
        if not isinstance(turn, dict) or not isinstance(turn.get("content"), str):
            field = f"traj.{turn_no}"
            raise RecordError(f"{field}: expected {{role, content: string}}", field)
        role, content = turn.get("role"), turn["content"]
        if role == "user" and query is None:
            query = content
        elif role == "user":
            builder.feed(_segments(content))
        elif role == "assistant":
            executed, rest = _split_turn(content)
            builder.feed(_segments(executed))
            if rest.strip():
                unexecuted.append({"turn": turn_no, "text": rest})
    return query or "", builder, unexecuted


def _alpaca_episode(traj: str) -> tuple[str, _Builder]:
    """Query and steps of an Alpaca-form trace (``### Instruction:`` / ``### Response:``)."""
    instruction, marker, response = traj.partition("### Response:")
    if not marker:
        raise RecordError('traj: Alpaca-format string without "### Response:"', "traj")
    query = instruction.partition("### Instruction:")[2].strip()
    builder = _Builder()
    builder.feed(_segments(response))
    return query, builder


def fireact_trajectory(question_id: str, record: FireActRecord, stem: str) -> Trajectory:
    """The canonical trajectory of one FireAct question run.

    Raises:
        RecordError: ``traj`` is neither a chat list nor an Alpaca string.
        pydantic.ValidationError: the result breaks the canonical schema.
    """
    metadata: dict[str, Any] = {
        "source_format": FORMAT, "gt": record.gt, "pred": record.pred, "em": record.em
    }
    if isinstance(record.traj, list):
        query, builder, unexecuted = _chat_episode(record.traj)
        metadata["trace_form"] = "chat"
        if unexecuted:
            metadata["unexecuted_text"] = unexecuted
    elif isinstance(record.traj, str):
        query, builder = _alpaca_episode(record.traj)
        metadata["trace_form"] = "alpaca"
    else:
        raise RecordError("traj: expected a chat list or an Alpaca-format string", "traj")
    steps = [Step(index=i, **fields) for i, fields in enumerate(builder.steps)]
    answers = [step.output for step in steps if step.kind == "answer"]
    agent_id = agent_id_from_name(stem)
    return Trajectory(
        trajectory_id=f"{stem}/{question_id}",
        task_id=question_id,
        agent_id=agent_id,
        query=query,
        steps=steps,
        final_answer=answers[-1] if answers else record.pred,
        # the episode's reward is exact match (FireAct's own); token F1 is kept for analysis
        outcome=Outcome(success=record.reward, score=1.0 if record.reward else 0.0),
        metadata={k: v for k, v in {**metadata, "f1": record.f1}.items() if v is not None},
    )


def stream_fireact(
    path: str | Path, *, max_record_bytes: int = DEFAULT_MAX_RECORD_BYTES
) -> RecordStream:
    """Stream the records of a FireAct trajectories file; each question is one record with pointer
    ``/<question id>``. A document that does not decode whole is read element by element
    (``common.split_document``): a bad element (nested too deeply, over ``max_record_bytes``,
    not JSON) is one quarantined record.

    Raises:
        UnreadableLogError: the file cannot be read, is not JSON, or is not a JSON object.
    """
    path = Path(path)
    document = load_document(path, max_record_bytes)
    if document is None:
        return empty_stream(path, FORMAT)
    is_object = isinstance(document.value, dict)
    require_document_shape(path, document, is_object, "a JSON object keyed by question id")

    question_of = {f"/{pointer_token(key)}": key for key in document.value}

    def convert(obj: dict[str, Any], pointer: str) -> Trajectory:
        record = FireActRecord.model_validate(obj)
        return fireact_trajectory(question_of[pointer], record, display_path(path.stem))

    elements = ((pointer, document.value[key]) for pointer, key in question_of.items())
    return stream_elements(path, FORMAT, document, elements, convert)
