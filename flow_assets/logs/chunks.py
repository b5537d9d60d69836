"""A log batch read as chunks of canonical records, on one process or on several.

``interaction_logs`` spends most of its time in Python: decoding each line, validating it into a
:class:`~flow_assets.logs.schema.Trajectory` and writing its canonical JSON (~70 µs per trajectory
of ~8 steps on a 2-core machine). For a large JSONL batch that work is spread over worker
processes, block by block, while this process keeps what needs the whole file in order: line
numbers, the duplicate-id check and the record count. The chunks that come out, and so the
tables, hold the same rows as a serial read's; only the chunk (row-group) boundaries differ.

Worker processes come from a ``forkserver`` (never a fork of this process, which may hold
Dagster's threads and locks). A bounded number of blocks is in flight (:func:`ordered_map`), so
memory stays bounded whatever the size of the file.
"""

from __future__ import annotations

import multiprocessing
import os
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ProcessPoolExecutor
from functools import partial
from pathlib import Path
from typing import TypeVar

import polars as pl
import pyarrow as pa

from flow_assets.logs.formats.common import (
    DEFAULT_MAX_RECORD_BYTES,
    READ_ERRORS,
    Books,
    OVERSIZED_HEAD_BYTES,
    LineConverter,
    RecordError,
    open_log,
    oversized_error,
    read_line,
    record_guard,
)
from flow_assets.logs.reader import BLANK, LINE_CONVERTERS, resolve_format, stream_file
from flow_assets.logs.records import UnreadableLogError
from flow_assets.logs.tables import CHUNK_BYTES, CHUNK_RECORDS, RecordChunk, chunk_records, trajectory_tables, valid_records_frame
from flow_assets.core.worker_lifetime import die_with_parent

#: ``workers=0`` (auto) uses worker processes only for a file at least this large (bytes): below
#: it, starting them costs more than they save.
PARALLEL_MIN_BYTES = 32 * 2**20
#: Bytes of a file a worker validates at a time (at most; a longer line is never cut).
PARALLEL_BLOCK_BYTES = 8 * 2**20

T = TypeVar("T")
R = TypeVar("R")


def worker_count(requested: int, path: str | Path) -> int:
    """How many worker processes to read ``path`` with: ``requested`` when it is >= 1, else (auto)
    one per CPU core for a file of at least :data:`PARALLEL_MIN_BYTES`, and 1 (no workers) below.

    Raises:
        ValueError: ``requested`` < 0.
    """
    if requested < 0:
        raise ValueError(f"workers must be >= 0 (0 = auto), got {requested}")
    if requested:
        return requested
    try:
        large = os.path.getsize(path) >= PARALLEL_MIN_BYTES
    except OSError:
        large = False  # the reader reports the unreadable file itself
    return max(1, os.cpu_count() or 1) if large else 1


def ordered_map(function: Callable[[T], R], items: Iterable[T], workers: int) -> Iterator[tuple[T, R]]:
    """``(item, function(item))`` for each item, computed by ``workers`` processes and yielded in
    the order of ``items``. At most ``2 * workers + 1`` items are submitted and not yet yielded,
    so a long (lazy) ``items`` is consumed in bounded memory. Leaving the iteration early (or an
    error) cancels what is queued and waits for what is running.

    ``function`` and the items must be picklable (module-level functions, ``functools.partial``).
    Workers come from a ``forkserver``; as with every ``multiprocessing`` start method but fork,
    a script that starts them must guard its top level with ``if __name__ == "__main__":``.

    Raises:
        Exception: what ``function`` raised, for the first item (in order) that failed.
        concurrent.futures.process.BrokenProcessPool: a worker died (killed, out of memory).
    """
    context = multiprocessing.get_context("forkserver")
    # workers die with this process: a kill -9 mid-parse leaves no orphan holding its memory
    with ProcessPoolExecutor(workers, mp_context=context, initializer=die_with_parent, initargs=(os.getpid(),)) as pool:
        in_flight: deque[tuple[T, Future]] = deque()
        try:
            for item in items:
                in_flight.append((item, pool.submit(function, item)))
                if len(in_flight) > 2 * workers:
                    item, future = in_flight.popleft()
                    yield item, future.result()
            while in_flight:
                item, future = in_flight.popleft()
                yield item, future.result()
        finally:
            for _, future in in_flight:  # stopped early: do not compute what nobody will read
                future.cancel()


class ChunkStream:
    """The records of one log file as :class:`~flow_assets.logs.tables.RecordChunk` s, in file
    order (iterate once, inside ``with`` so worker processes stop even if the reader does not
    finish). ``format`` is the parser; ``records_read`` counts every record read so far, apart
    from the records yielded, so ``valid + quarantined == records_read`` is a real check once
    the stream is exhausted.

    Raises (while iterating):
        UnreadableLogError: the file cannot be opened or read.
    """

    def __init__(self, fmt: str, chunks: Iterator[RecordChunk], records_read: Callable[[], int]):
        self.format = fmt
        self._chunks = chunks
        self._records_read = records_read

    @property
    def records_read(self) -> int:
        """Records read so far (all of them once the stream is exhausted)."""
        return self._records_read()

    def __iter__(self) -> Iterator[RecordChunk]:
        return self._chunks

    def __enter__(self) -> ChunkStream:
        return self

    def __exit__(self, *exc) -> None:
        self._chunks.close()


def read_chunks(
    path: str | Path,
    fmt: str = "auto",
    *,
    workers: int = 1,
    max_records: int = CHUNK_RECORDS,
    max_bytes: int = CHUNK_BYTES,
    max_record_bytes: int = DEFAULT_MAX_RECORD_BYTES,
) -> ChunkStream:
    """Read a log file as chunks of at most ``max_records`` records / about ``max_bytes`` bytes.

    With ``workers`` >= 2 and a JSONL format (canonical, flat), lines are validated by that many
    worker processes, in blocks of at most ``min(max_bytes, PARALLEL_BLOCK_BYTES)`` bytes;
    otherwise the file is read by :func:`~flow_assets.logs.reader.stream_file` and
    :func:`~flow_assets.logs.tables.chunk_records` in this process. Either way every record is
    yielded once, valid or quarantined, with the same reasons and positions (the rules of
    :func:`~flow_assets.logs.reader.stream_file`). :func:`worker_count` chooses ``workers``.

    Raises:
        ValueError: ``fmt`` names no known format, or a chunk bound is < 1.
        UnreadableLogError: the file cannot be read or its format detected (a JSONL file that
            cannot be opened: when iteration starts).
    """
    if max_records < 1 or max_bytes < 1:
        raise ValueError(f"chunk bounds must be >= 1, got {max_records} records, {max_bytes} bytes")
    path = Path(path)
    resolved = resolve_format(path, fmt)
    if workers >= 2 and resolved in LINE_CONVERTERS:
        books = Books(path, resolved)
        work = partial(
            canonicalise_block,
            convert=LINE_CONVERTERS[resolved](path),
            max_record_bytes=max_record_bytes,
            max_records=max_records,
        )
        chunks = _parallel_chunks(path, books, work, workers, min(max_bytes, PARALLEL_BLOCK_BYTES), max_record_bytes)
        return ChunkStream(resolved, chunks, lambda: books.records_read)
    stream = stream_file(path, "auto" if resolved == BLANK else resolved, max_record_bytes=max_record_bytes)
    return ChunkStream(stream.format, chunk_records(stream, max_records, max_bytes), lambda: stream.records_read)


Block = tuple[int, bytes] | tuple[int, bytes, int]
"""What :func:`file_blocks` yields: ``(number of its first line, whole lines)``, or for one line
over the record limit ``(its number, its first bytes, its size)``."""


def file_blocks(path: Path, block_bytes: int, max_record_bytes: int = DEFAULT_MAX_RECORD_BYTES) -> Iterator[Block]:
    """The file cut into blocks of about ``block_bytes`` bytes that end at a line end (or at the
    file's end), each ``(number of its first line, block)``; a line longer than a block is never
    cut. A line longer than ``max_record_bytes`` (+ 2 for its line end) is never held whole: it
    is read through and yielded alone as ``(its number, its first OVERSIZED_HEAD_BYTES bytes,
    its size without the final \\n)``.

    Raises:
        UnreadableLogError: the file cannot be opened or read.
    """
    limit = max_record_bytes + 2
    with open_log(path, buffering=0) as handle:
        first_line, carry = 1, b""
        oversized: list | None = None  # [head, size] of the line being read through
        try:
            while data := handle.read(block_bytes):
                if oversized is not None:
                    end = data.find(b"\n")
                    if end < 0:
                        oversized[1] += len(data)
                        continue
                    cr = 1 if data[end - 1 : end] == b"\r" else 0  # a \r\n line end is no part of the size
                    yield first_line, oversized[0], oversized[1] + end - cr
                    first_line, oversized, data = first_line + 1, None, data[end + 1 :]
                data = carry + data if carry else data
                cut = data.rfind(b"\n") + 1
                block, carry = data[:cut], data[cut:]
                if block:
                    yield first_line, block
                    first_line += block.count(b"\n")
                if len(carry) > limit:  # the unfinished line is already over the limit
                    oversized, carry = [carry[:OVERSIZED_HEAD_BYTES], len(carry)], b""
        except READ_ERRORS as error:
            raise UnreadableLogError(str(path), f"read failed: {error}") from None
        if oversized is not None:
            yield first_line, oversized[0], oversized[1]
        elif carry:
            yield first_line, carry


def block_lines(block: bytes, first_line: int) -> Iterator[tuple[int, bytes]]:
    """The non-blank lines of a block with their 1-based numbers, each without its ``\\n`` (a
    ``\\r`` before it stays, as :func:`~flow_assets.logs.formats.common.read_line` allows)."""
    lines = block.split(b"\n")
    if block.endswith(b"\n"):
        lines.pop()  # the empty piece after the last terminator is not a line
    for line_no, line in enumerate(lines, start=first_line):
        if line and not line.isspace():
            yield line_no, line


Quarantined = tuple[int, str | None, str, bytes]
"""A record a worker quarantined: ``(line, field, reason, raw bytes)``."""

BlockResult = tuple[int, list[tuple[pa.Table, list[Quarantined]]]]
"""What a worker returns for one block: the number of records in it, then per chunk of at most
``max_records`` records the valid ones (an Arrow table of line, ids and canonical JSON:
:func:`polars.from_arrow` makes it a frame) and the quarantined ones. Arrow, not a polars frame,
because that is what crosses the process boundary: pickling a polars frame of a block cost a
worker ~17% of its time, pickling the same columns as Arrow ~5%."""

_WORKER_COLUMNS = {
    "line": pl.Int64,
    "trajectory_id": pl.String,
    "task_id": pl.String,
    "agent_id": pl.String,
    "record_json": pl.String,
}


def _arrow(rows: list[tuple[int, str, str, str, str]]) -> pa.Table:
    return pl.DataFrame(rows, schema=_WORKER_COLUMNS, orient="row").to_arrow()


def canonicalise_block(
    block: Block, convert: LineConverter, max_record_bytes: int, max_records: int
) -> BlockResult:
    """Worker side: decode, validate and serialise every record of a :data:`Block` (see
    :data:`BlockResult`). Duplicate ids are not checked here (a worker sees one block); the
    reading process does that, in file order."""
    if len(block) == 3:  # one oversized line, already read through
        line_no, head, size = block
        error = oversized_error(size, max_record_bytes, len(head))
        return 1, [(_arrow([]), [(line_no, None, error.reason, head)])]
    first_line, data = block
    records = 0
    chunks: list[tuple[pa.Table, list[Quarantined]]] = []
    rows: list[tuple[int, str, str, str, str]] = []
    quarantined: list[Quarantined] = []
    for line_no, line in block_lines(data, first_line):
        records += 1
        try:
            try:
                t = read_line(line, line_no, convert, max_record_bytes)
                row = (line_no, t.trajectory_id, t.task_id, t.agent_id, t.model_dump_json())
            except RecursionError as deep:
                raise record_guard(deep) from None
            except (ValueError, UnicodeError) as error:  # model_dump_json: as Books.accept refuses it
                if isinstance(error, RecordError):
                    raise
                raise RecordError(f"record cannot be stored as canonical JSON: {str(error).splitlines()[0][:200]}") from None
        except RecordError as error:
            quarantined.append((line_no, error.field, error.reason, line.rstrip(b"\r\n")))
        else:
            rows.append(row)
        if len(rows) + len(quarantined) >= max_records:
            chunks.append((_arrow(rows), quarantined))
            rows, quarantined = [], []
    if rows or quarantined:
        chunks.append((_arrow(rows), quarantined))
    return records, chunks


def _settle(books: Books, block: tuple[int, bytes], valid: pl.DataFrame, bad: list[Quarantined]) -> RecordChunk:
    """One chunk of a worker's block as records of the batch, duplicate ids checked in order."""
    quarantined = [
        books.quarantine(RecordError(reason, field), raw, line=line_no) for line_no, field, reason, raw in bad
    ]
    duplicates: list[int] = []
    lines: dict[int, bytes] | None = None
    for row, (tid, line_no) in enumerate(zip(valid["trajectory_id"].to_list(), valid["line"].to_list())):
        try:
            books.claim_id(tid, line_no)
        except RecordError as error:
            duplicates.append(row)
            if lines is None:  # rare: only a chunk holding a duplicate splits its block again
                lines = dict(block_lines(block[1], block[0]))
            quarantined.append(books.quarantine(error, lines[line_no].rstrip(b"\r\n"), line=line_no))
    if duplicates:
        valid = valid.with_row_index("_row").filter(~pl.col("_row").is_in(duplicates)).drop("_row")
        quarantined.sort(key=lambda q: q.line)
    frame = valid.select(
        file=pl.lit(books.file, dtype=pl.String),
        line="line",
        pointer=pl.lit(None, dtype=pl.String),
        trajectory_id="trajectory_id",
        task_id="task_id",
        agent_id="agent_id",
        record_json="record_json",
    )
    return RecordChunk(frame, quarantined)


def _parallel_chunks(
    path: Path,
    books: Books,
    work: Callable[[Block], BlockResult],
    workers: int,
    block_bytes: int,
    max_record_bytes: int,
) -> Iterator[RecordChunk]:
    for block, (records, chunks) in ordered_map(work, file_blocks(path, block_bytes, max_record_bytes), workers):
        books.records_read += records
        for valid, bad in chunks:
            yield _settle(books, block, pl.from_arrow(valid), bad)
    if books.records_read == 0:
        yield RecordChunk(valid_records_frame([]), [books.empty_file()])


def _tables_of_row_group(path: str, source: str, row_group: int) -> tuple[pa.Table, pa.Table]:
    """Worker side of :func:`parallel_trajectory_tables`: one row group of an ``interaction_logs``
    partition as its ``trajectories`` and ``steps`` rows (Arrow: what crosses the process
    boundary cheaply, see :data:`BlockResult`)."""
    import pyarrow.parquet as pq

    column = pq.ParquetFile(path, pre_buffer=False).read_row_group(row_group, columns=["record_json"]).column(0)
    traj, steps = trajectory_tables(pl.from_arrow(column).to_list(), source)
    return traj.to_arrow(), steps.to_arrow()


def parallel_trajectory_tables(path: str | Path, source: str, workers: int) -> Iterator[tuple[pl.DataFrame, pl.DataFrame]]:
    """The ``trajectories`` and ``steps`` tables of an ``interaction_logs`` partition file, one
    pair per Parquet row group, built by ``workers`` processes and yielded in file order: the
    same rows, in the same order, as :func:`~flow_assets.logs.tables.trajectory_tables` over
    the whole file in one process.

    Each worker reads its row group's ``record_json`` itself, so only the tables cross the
    process boundary. Building them is a decode and a Python loop per step (~4.3 s per 1M
    steps on one core of the 2-core machine, 2026-12-05), which a large batch would otherwise
    pay on one core while the other idles. Memory: at most ``2 * workers + 1`` row groups
    (:func:`ordered_map`); the lake writes ``interaction_logs`` in row groups of at most
    :data:`~flow_assets.logs.tables.CHUNK_RECORDS` records.

    Args:
        path: the ``interaction_logs`` partition's Parquet file.
        source: the batch's source name, stored on every trajectory.
        workers: worker processes (>= 1).

    Raises:
        FileNotFoundError / pyarrow.ArrowInvalid: ``path`` is missing or not Parquet.
        concurrent.futures.process.BrokenProcessPool: a worker died (killed, out of memory).
    """
    import pyarrow.parquet as pq

    row_groups = range(pq.ParquetFile(str(path)).num_row_groups)
    work = partial(_tables_of_row_group, str(path), source)
    for _, (traj, steps) in ordered_map(work, row_groups, workers):
        yield pl.from_arrow(traj), pl.from_arrow(steps)
