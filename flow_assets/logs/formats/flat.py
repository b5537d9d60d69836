"""The flat interaction-record JSONL: one prompt/response exchange per line.

``{task_id, input, response, score, agent_id, adapter_version?, timestamp?, metadata?,
success?, interaction_id?}``. Each line becomes a one-step trajectory: ``query = input``, one
``answer`` step whose output is ``response``, ``final_answer = response``.

Choice: when ``success`` is absent it is inferred as ``score >= 0.5`` (flat scores are rewards
in [0, 1] and 0.5 is the midpoint); a producer with another threshold must send ``success``.
"""

from __future__ import annotations

from functools import partial
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from flow_assets.logs.records import display_path
from flow_assets.logs.formats.common import DEFAULT_MAX_RECORD_BYTES, LineConverter, RecordStream, stream_jsonl
from flow_assets.logs.schema import FiniteFloat, Outcome, Step, Trajectory

FORMAT = "flat"
SUCCESS_THRESHOLD = 0.5


class FlatRecord(BaseModel):
    """One flat line, validated strictly (unknown keys are an error, so a canonical line fed to
    this parser is quarantined instead of silently half-read)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    task_id: str = Field(min_length=1)
    input: str
    response: str
    score: FiniteFloat | None = None
    agent_id: str = Field(min_length=1)
    adapter_version: str | None = None
    timestamp: str | None = None
    metadata: dict[str, Any] = Field(default_factory=dict)
    success: bool | None = None
    interaction_id: str | None = Field(None, min_length=1)


def flat_trajectory(record: FlatRecord, default_id: str) -> Trajectory:
    """The one-step trajectory of a validated flat record; ``default_id`` is used as
    ``trajectory_id`` when the record has no ``interaction_id``."""
    if record.success is None and record.score is None:
        outcome = None  # unlabelled: stored, rewarded once a verifier, judge or feedback labels it
    else:
        success = record.success if record.success is not None else record.score >= SUCCESS_THRESHOLD
        outcome = Outcome(success=success, score=record.score)
    return Trajectory(
        trajectory_id=record.interaction_id or default_id,
        task_id=record.task_id,
        agent_id=record.agent_id,
        adapter_version=record.adapter_version,
        query=record.input,
        steps=[Step(index=0, kind="answer", output=record.response)],
        final_answer=record.response,
        outcome=outcome,
        timestamp=record.timestamp,
        metadata=record.metadata,
    )


def stream_flat(
    path: str | Path, *, max_record_bytes: int = DEFAULT_MAX_RECORD_BYTES
) -> RecordStream:
    """Stream the records of a flat JSONL file; bad lines are quarantined with their line and field (the field
    is the flat key, e.g. ``score``). ``trajectory_id`` defaults to ``"{file stem}:{line}"``.

    Raises:
        UnreadableLogError (while iterating): the file cannot be opened or read.
    """
    path = Path(path)
    return stream_jsonl(path, FORMAT, line_converter(path), max_record_bytes)


def flat_line(stem: str, obj: dict[str, Any], line: int) -> Trajectory:
    """Validate one decoded flat line of a file named ``stem`` (its default id is ``"{stem}:{line}"``).

    Raises:
        pydantic.ValidationError: the object is not a flat record.
    """
    return flat_trajectory(FlatRecord.model_validate(obj), f"{stem}:{line}")


def line_converter(path: str | Path) -> LineConverter:
    """The converter of ``path``'s lines; picklable, so worker processes can run it."""
    return partial(flat_line, display_path(Path(path).stem))
