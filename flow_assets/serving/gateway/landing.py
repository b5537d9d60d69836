"""Landing finished rollouts as log batches: canonical JSONL, written ``.tmp`` then renamed.

A log batch is the unit ``new_logs_sensor`` ingests and GRPO groups within, so the G rollouts
of a task must land in the same file. Rollouts name their batch when they are opened (the
harness gives all rollouts of one collection the same batch); the others go to the gateway's
rolling batch, which closes after ``max_trajectories`` rollouts or ``flush_seconds``.

Each open batch is a file ``<landing>/<source>/<batch>.jsonl.tmp`` that every finished rollout
is appended to (flushed at once, so a crash loses no finished rollout's line); closing the
batch renames it to ``<batch>.jsonl``, the moment the sensor may see it. The sensor never reads
``.tmp`` files, so it never sees a half-written batch.

Crash recovery: while a gateway holds a batch open it holds an exclusive ``flock`` on its
``.tmp`` file (the kernel drops it when the process dies, SIGKILL included). A starting gateway
(:meth:`BatchLander.recover`) lands every ``<source>/<batch>.jsonl.tmp`` of its landing directory
whose lock is free: an open batch of a gateway that died. Its complete lines are finished
rollouts and land as they are (renamed, as a normal close does, so exactly once); a torn last line
(the process died inside a write) stays the last line of the landed file, where the data plane's
reader quarantines it with its reason (``invalid JSON: ...``) and keeps its bytes. Files held by a
live gateway (another process sharing the landing directory) are left alone. A batch file is
locked before its name appears (created hidden, locked, then linked into place), so a starting
gateway never takes a live gateway's new batch for an orphan.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import re
import threading
import time
import uuid
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

from flow_assets.logs.schema import Trajectory

log = logging.getLogger("flowopt.gateway")

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
    fd: int  # open for appending, holding the batch's exclusive flock
    count: int = 0
    size: int = 0


@dataclass(frozen=True)
class RecoveredBatch:
    """An open batch of a gateway that died, landed by :meth:`BatchLander.recover`.

    Attributes:
        path: the landed file.
        rollouts: its complete lines (finished rollouts).
        torn_bytes: bytes of a torn last line (0: none); the data plane quarantines that line.
    """

    path: Path
    rollouts: int
    torn_bytes: int


# a filesystem without flock (some FUSE mounts) or hard links: the batch is still written and
# landed; only the guard against a second gateway on the same directory is lost (logged once)
_UNSUPPORTED = {errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOTSUP, errno.ENOSYS, errno.EPERM, errno.EXDEV, errno.EMLINK}
_warned: set[str] = set()


def _warn_once(what: str, exc: OSError) -> None:
    if what not in _warned:
        _warned.add(what)
        log.warning("the landing directory's filesystem does not support %s (%s): a gateway sharing it could "
                    "take this gateway's open batch for a dead one's", what, exc.strerror or exc)  # fmt: skip


def _try_lock(fd: int) -> bool:
    """Take the exclusive flock of ``fd`` without waiting; ``False``: a live process holds it."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    except OSError as exc:
        if exc.errno not in _UNSUPPORTED:
            raise
        _warn_once("flock", exc)
    return True


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def _free_name(tmp: Path, batch: str) -> Path:
    """``<batch>.jsonl`` beside ``tmp``, or ``<batch>-<k>.jsonl`` if taken (nothing is overwritten)."""
    target, k = tmp.with_name(f"{batch}.jsonl"), 1
    while target.exists():
        target = tmp.with_name(f"{batch}-{k}.jsonl")
        k += 1
    return target


def _count_lines(fd: int) -> tuple[int, int]:
    """``(complete lines, bytes after the last newline)`` of the file open at ``fd``, read in chunks."""
    os.lseek(fd, 0, os.SEEK_SET)
    lines = tail = 0
    while chunk := os.read(fd, 1 << 20):
        newlines = chunk.count(b"\n")
        lines += newlines
        tail = len(chunk) - 1 - chunk.rindex(b"\n") if newlines else tail + len(chunk)
    return lines, tail


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
            RuntimeError: another live gateway holds a batch of that name open in this directory.
            OSError: the file cannot be written (nothing of the line stays in it).
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
                tmp = folder / f"{batch}.jsonl.tmp"
                open_batch = _OpenBatch(batch, src, tmp, self.clock(), self._open_locked(tmp, batch))
                self._open[batch] = open_batch
            try:
                _write_all(open_batch.fd, line)
            except OSError:
                # a partial write (disk full) would glue the next rollout onto a torn line: cut it off
                os.ftruncate(open_batch.fd, open_batch.size)
                raise
            open_batch.size += len(line)
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
            target = _free_name(open_batch.tmp, batch)
            try:
                open_batch.tmp.rename(target)  # renamed while still locked: nobody recovers it twice
            finally:
                os.close(open_batch.fd)
            self.landed.append(target)
            return target

    def _open_locked(self, tmp: Path, batch: str) -> int:
        """A file descriptor appending to a new file ``tmp``, holding its flock.

        The file is created under a hidden name, locked, then linked to ``tmp``: no other
        gateway's :meth:`recover` can see it unlocked (where the filesystem has no hard links it
        is created at ``tmp`` directly). An orphan already at ``tmp`` (a dead gateway's) is
        landed first, as :meth:`recover` would.

        Raises:
            RuntimeError: a live gateway holds ``tmp``.
        """
        for _ in range(3):
            hidden = tmp.with_name(f".{tmp.name}.{os.getpid()}-{uuid.uuid4().hex[:8]}.opening")
            fd = os.open(hidden, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_EXCL, 0o644)
            try:
                _try_lock(fd)  # a fresh file: nobody else holds it
                try:
                    os.link(hidden, tmp)
                except FileExistsError:
                    raise
                except OSError as exc:
                    if exc.errno not in _UNSUPPORTED:
                        raise
                    _warn_once("hard links", exc)
                    os.close(fd)
                    fd = -1
                    fd = os.open(tmp, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_EXCL, 0o644)
                    _try_lock(fd)
                return fd
            except FileExistsError:
                if fd >= 0:
                    os.close(fd)
                if self._recover_file(tmp, batch) is None:
                    raise RuntimeError(f"batch {batch!r} is open in another gateway sharing this landing directory") from None
            except BaseException:
                if fd >= 0:
                    os.close(fd)
                raise
            finally:
                hidden.unlink(missing_ok=True)
        raise RuntimeError(f"batch {batch!r} could not be opened: its file keeps reappearing")

    def _recover_file(self, tmp: Path, batch: str) -> RecoveredBatch | bool | None:
        """Land the orphaned batch file ``tmp`` (see :meth:`recover`): what landed, ``True`` if
        it was empty (removed) or vanished, ``None`` if a live gateway holds it."""
        try:
            fd = os.open(tmp, os.O_RDONLY | os.O_NOFOLLOW)
        except FileNotFoundError:
            return True
        try:
            if not _try_lock(fd):
                return None
            if not tmp.exists() or not os.path.samestat(os.fstat(fd), tmp.stat()):
                return True  # landed by its owner meanwhile
            lines, torn = _count_lines(fd)
            if lines == 0 and torn == 0:
                tmp.unlink()
                return True
            target = _free_name(tmp, batch)
            tmp.rename(target)
        finally:
            os.close(fd)
        self.landed.append(target)
        found = RecoveredBatch(target, lines, torn)
        log.warning(
            "recovered the open batch of a gateway that stopped without landing it: %s, %d finished rollouts%s",
            target.name, lines, f", and a torn last line of {torn} bytes (the data plane quarantines it)" if torn else "",
        )  # fmt: skip
        return found

    def recover(self) -> list[RecoveredBatch]:
        """Land the open batches of gateways that died (module docstring): every
        ``<source>/<batch>.jsonl.tmp`` under the landing directory whose flock is free. Files a
        live gateway holds, symbolic links and files with other hard links are left alone.

        Returns:
            what landed, one entry per batch.
        """
        found: list[RecoveredBatch] = []
        if not self.directory.is_dir():
            return found
        for folder in sorted(p for p in self.directory.iterdir() if p.is_dir() and not p.is_symlink() and not p.name.startswith(".")):
            for stale in folder.glob(".*.jsonl.tmp.*.opening"):
                self._drop_stale_opening(stale)
            for tmp in sorted(folder.glob("*.jsonl.tmp")):
                if tmp.name.startswith(".") or tmp.is_symlink() or not tmp.is_file() or tmp.stat().st_nlink != 1:
                    continue
                batch = tmp.name[: -len(".jsonl.tmp")]
                with self._lock:
                    if batch in self._open:
                        continue
                    landed = self._recover_file(tmp, batch)
                if isinstance(landed, RecoveredBatch):
                    found.append(landed)
        return found

    @staticmethod
    def _drop_stale_opening(path: Path) -> None:
        """Remove a hidden half-opened batch file a dead gateway left (empty: nothing was written
        to it before it was linked into place)."""
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
        except OSError:
            return
        try:
            if _try_lock(fd):
                path.unlink(missing_ok=True)
        finally:
            os.close(fd)

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
