"""flowopt canonical JSONL: one :class:`~flow_assets.logs.schema.Trajectory` JSON object per
line, fields exactly as the schema (``docs/log-format.md``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from flow_assets.logs.formats.common import DEFAULT_MAX_RECORD_BYTES, LineConverter, RecordStream, stream_jsonl
from flow_assets.logs.schema import Trajectory

FORMAT = "canonical"


def canonical_record(obj: dict[str, Any], line: int) -> Trajectory:
    """Validate one decoded canonical line.

    Raises:
        pydantic.ValidationError: the object does not match the schema.
    """
    return Trajectory.model_validate(obj)


def stream_canonical(
    path: str | Path, *, max_record_bytes: int = DEFAULT_MAX_RECORD_BYTES
) -> RecordStream:
    """Stream the records of a canonical JSONL file; bad lines are quarantined with their line and field.

    Raises:
        UnreadableLogError (while iterating): the file cannot be opened or read.
    """
    return stream_jsonl(Path(path), FORMAT, canonical_record, max_record_bytes)


def line_converter(path: str | Path) -> LineConverter:
    """The converter of ``path``'s lines (the same for every file); picklable."""
    return canonical_record
