"""What parsing a log file yields: valid trajectories, quarantined records, and the count read.

Conservation holds for every file: ``len(valid) + len(quarantined) == records_read``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from flow_assets.logs.schema import Trajectory


def display_path(path: str | os.PathLike) -> str:
    """``path`` as text that can be stored and printed anywhere: a file name that is not valid
    UTF-8 (Python holds its bytes as surrogate escapes, which no UTF-8 writer accepts) shows its
    bytes as ``\\xNN`` (``caf\\xe9.json``); any other path is unchanged."""
    return os.fsencode(path).decode("utf-8", "backslashreplace")


class UnreadableLogError(Exception):
    """A whole log file cannot be read (missing, unreadable, or not parseable as its format at
    all). The message names the file (:func:`display_path`); only the partition of that file fails."""

    def __init__(self, path: str, reason: str):
        path = display_path(path)
        super().__init__(f"{path}: {reason}")
        self.path = path
        self.reason = reason


@dataclass(frozen=True)
class ValidRecord:
    """A record that parsed and validated into a :class:`Trajectory`.

    ``line`` is the 1-based line of the record in the file where the format has one record per
    line (JSONL), else ``None``; ``pointer`` is a JSON Pointer (RFC 6901) to the record inside a
    whole-file JSON document (e.g. ``/simulations/3``), else ``None``. ``record_json`` is the
    trajectory's canonical JSON when the reader made it (it checks that it can be).
    """

    trajectory: Trajectory
    file: str
    line: int | None = None
    pointer: str | None = None
    record_json: str | None = None


@dataclass(frozen=True)
class QuarantinedRecord:
    """A record that could not become a trajectory, kept with where it was and why.

    ``field`` is the dotted path of the offending field (``steps.2.kind``) when one is to blame;
    ``raw`` holds the record's original bytes, complete, so nothing is lost.
    """

    file: str
    reason: str
    raw: bytes
    line: int | None = None
    pointer: str | None = None
    field: str | None = None


@dataclass
class ParseResult:
    """Everything one file yielded. ``format`` is the parser that read it."""

    file: str
    format: str
    valid: list[ValidRecord] = field(default_factory=list)
    quarantined: list[QuarantinedRecord] = field(default_factory=list)
    records_read: int = 0
