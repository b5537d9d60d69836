"""Landing finished rollouts as log batches: canonical JSONL, written ``.tmp`` then renamed.

A log batch is the unit ``new_logs_sensor`` ingests and GRPO groups within, so the G rollouts
of a task must land in the same file. Rollouts name their batch when they are opened (the
harness gives all rollouts of one collection the same batch); the others go to the gateway's
rolling batch, which closes after ``max_trajectories`` rollouts or ``flush_seconds``.

Each open batch is a file ``<landing>/<source>/<batch>.jsonl.tmp`` that every finished rollout
is appended to (flushed at once, so a crash loses no finished rollout's line); closing the
batch renames it to ``<batch>.jsonl``, the moment the sensor may see it. The sensor never reads
``.tmp`` files, so it never sees a half-written batch.
"""

from __future__ import annotations

import re
import threading
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

from flow_assets.logs.schema import Trajectory

_SAFE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.:-]{0,127}$")


def check_name(kind: str, name: str) -> str:
    """``name`` if it is safe as one path component (letters, digits, ``_ . : -``), else raise.

    Raises:
        ValueError: an empty name, a separator or ``..``, or more than 128 characters.
    """
    if not _SAFE.match(name) or ".." in name:
        raise ValueError(f"{kind} {name!r} must be 1-128 letters, digits, '_', '.', ':' or '-' (not '..')")
    return name


@dataclass
class _OpenBatch:
    name: str
    source: str
    tmp: Path
    opened: float
    count: int = 0


class BatchLander:
    """Appends finished trajectories to open batch files and closes them into the landing dir.

    Args:
        directory: the landing directory ``new_logs_sensor`` watches.
        source: sub-directory for batches that do not name one (the gateway's own).
        max_trajectories: the rolling batch closes once it holds this many.
        flush_seconds: the rolling batch closes this long after its first trajectory.
        clock: monotonic seconds.
    """

    def __init__(
        self,
        directory: str | Path,
        source: str = "gateway",
        max_trajectories: int = 1024,
        flush_seconds: float = 300.0,
        clock=time.monotonic,
    ):
        self.directory = Path(directory)
        self.source = check_name("source", source)
        self.max_trajectories = max_trajectories
        self.flush_seconds = flush_seconds
        self.clock = clock
        self._open: dict[str, _OpenBatch] = {}
        self._rolling: str | None = None
        self._lock = threading.Lock()
        self.landed: list[Path] = []

    def _new_rolling(self) -> str:
        stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%S%fZ")
        return f"gateway-{stamp}"

    def add(self, trajectory: Trajectory, batch: str | None = None, source: str | None = None) -> str:
        """Append ``trajectory`` to ``batch`` (opened on first use; ``None`` = the rolling batch).

        Returns:
            the batch name.

        Raises:
            ValueError: an unsafe batch or source name.
        """
        line = trajectory.model_dump_json().encode() + b"\n"
        with self._lock:
            if batch is None:
                if self._rolling is None:
                    self._rolling = self._new_rolling()
                batch = self._rolling
            open_batch = self._open.get(batch)
            if open_batch is None:
                src = check_name("source", source or self.source)
                check_name("batch", batch)
                folder = self.directory / src
                folder.mkdir(parents=True, exist_ok=True)
                open_batch = _OpenBatch(batch, src, folder / f"{batch}.jsonl.tmp", self.clock())
                self._open[batch] = open_batch
            with open(open_batch.tmp, "ab") as fh:
                fh.write(line)
            open_batch.count += 1
            rolling_full = batch == self._rolling and open_batch.count >= self.max_trajectories
        if rolling_full:
            self.close(batch)
        return batch

    def close(self, batch: str) -> Path | None:
        """Rename ``batch``'s file into place (``.tmp`` -> ``.jsonl``); ``None`` if it holds nothing.

        If a file of that name already landed, the new one gets a numbered suffix (nothing is
        overwritten).
        """
        with self._lock:
            open_batch = self._open.pop(batch, None)
            if batch == self._rolling:
                self._rolling = None
            if open_batch is None:
                return None
            target = open_batch.tmp.with_name(f"{batch}.jsonl")
            k = 1
            while target.exists():
                target = open_batch.tmp.with_name(f"{batch}-{k}.jsonl")
                k += 1
            open_batch.tmp.rename(target)
            self.landed.append(target)
            return target

    def close_due(self) -> list[Path]:
        """Close the rolling batch if it is older than ``flush_seconds``; returns what landed."""
        with self._lock:
            rolling = self._open.get(self._rolling) if self._rolling else None
            due = rolling is not None and self.clock() - rolling.opened >= self.flush_seconds
        path = self.close(rolling.name) if due else None
        return [path] if path else []

    def close_all(self) -> list[Path]:
        """Close every open batch (the gateway stops); returns what landed."""
        with self._lock:
            names = list(self._open)
        return [p for p in (self.close(n) for n in names) if p is not None]

    def open_batches(self) -> dict[str, int]:
        """Open batch name -> trajectories in it."""
        with self._lock:
            return {name: b.count for name, b in self._open.items()}
