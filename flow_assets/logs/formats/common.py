"""Machinery every format parser shares: reading records, explaining why one is bad, and
keeping the books (``len(valid) + len(quarantined) == records_read``).

Two shapes of file exist. JSONL formats (canonical, flat) hold one record per line and are read
in binary, line by line, so an oversized or non-UTF-8 line is quarantined without being parsed.
Whole-file JSON formats (tau-bench, tau2, FireAct) are one document whose elements are records;
a document that is not JSON at all makes the whole file unreadable, a bad element is quarantined
with its JSON Pointer.

Every reader opens a file through :func:`open_log`, so a gzip-compressed log (recognised by its
magic bytes, whatever its name) is decompressed as it streams, and a UTF-8 byte order mark at the
start is skipped (editors on Windows write one; it is not part of the first record).
"""

from __future__ import annotations

import gzip
import json
import re
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, BinaryIO

import orjson
from pydantic import BeforeValidator, ValidationError
from pydantic_core import PydanticSerializationError

from flow_assets.logs.faithful import decode_marked, find_problem, suspicious
from flow_assets.logs.records import ParseResult, QuarantinedRecord, UnreadableLogError, ValidRecord, display_path
from flow_assets.logs.schema import Trajectory

DEFAULT_MAX_RECORD_BYTES = 16 * 2**20
MAX_DEPTH = 255
"""Deepest nesting of a record that is stored (orjson's writer limit); deeper ones are quarantined."""
GZIP_MAGIC = b"\x1f\x8b"
UTF8_BOM = b"\xef\xbb\xbf"
READ_ERRORS = (OSError, EOFError)
"""What reading an opened log can raise: I/O errors, a corrupt gzip stream (``BadGzipFile`` is
an ``OSError``) and a truncated one (``EOFError``)."""
EMPTY_FILE_REASON = "empty file: no records"

# Converters turn one decoded record into a trajectory. The second argument says where the
# record sits: the 1-based line for JSONL, the JSON Pointer for whole-file documents.
LineConverter = Callable[[dict[str, Any], int], Trajectory]
ElementConverter = Callable[[dict[str, Any], str], Trajectory]

# What a converter raises when a record's shape surprises it (a key missing, a value of another
# type) in a place its pydantic model does not cover: the record is quarantined, naming the
# error, so one odd record never fails the whole file.
_SHAPE_ERRORS = (KeyError, TypeError, ValueError, AttributeError, IndexError)


def _task_id_text(value: Any) -> Any:
    # External logs number their tasks (tau-bench: int, tau2: str); the canonical id is a string.
    if isinstance(value, int) and not isinstance(value, bool):
        return str(value)
    if not isinstance(value, str):
        raise ValueError(f"task_id must be a string or an integer, not {type(value).__name__}")
    return value


TaskId = Annotated[str, BeforeValidator(_task_id_text)]
"""A task id given as a string or an integer, validated into a string."""


class RecordError(ValueError):
    """One record cannot become a trajectory. ``field`` is the dotted path to blame (``None``
    when the record as a whole is at fault); ``reason`` says why, in words."""

    def __init__(self, reason: str, field: str | None = None):
        super().__init__(reason)
        self.reason = reason
        self.field = field


def dotted(loc: Iterable[Any]) -> str | None:
    """Join a pydantic error location into a dotted path (``("steps", 2, "kind")`` gives
    ``"steps.2.kind"``); ``None`` for an empty location (a whole-model error)."""
    parts = [str(part) for part in loc]
    return ".".join(parts) if parts else None


def explain_validation(error: ValidationError) -> RecordError:
    """Turn a pydantic error into a :class:`RecordError` naming the first offending field
    (its dotted location) and, for a scalar, the offending value."""
    problems = error.errors(include_url=False)
    first = problems[0]
    field = dotted(first["loc"])
    message = first["msg"].removeprefix("Value error, ")
    reason = f"{field or 'record'}: {message}"
    got = first.get("input")
    # Show the offending value when it is a scalar; a whole object would drown the message.
    if first["type"] != "missing" and not isinstance(got, (dict, list)):
        shown = repr(got)
        reason += f" (got {shown if len(shown) <= 80 else shown[:77] + '...'})"
    if len(problems) > 1:
        reason += f"; and {len(problems) - 1} more problem(s)"
    return RecordError(reason, field)


def problem_error(found: tuple[tuple[Any, ...], str]) -> RecordError:
    """The quarantine reason for a place :func:`~flow_assets.logs.faithful.find_problem` found
    (a NaN, a number beyond 64 bits, a duplicate key, a lone surrogate), naming its field."""
    path, why = found
    field = dotted(path)
    return RecordError(f"{field or 'record'}: {why}", field)


def decode_record(raw: bytes) -> Any:
    """Decode one JSON record that orjson refused, and find out precisely why.

    Raises :class:`RecordError` naming the byte offset of the first non-UTF-8 byte, the field
    holding what orjson refuses and Python's ``json`` accepts (a NaN/Infinity literal, ``1e400``,
    a lone surrogate; :mod:`flow_assets.logs.faithful`), or orjson's own syntax message.
    """
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError as strict_error:
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as bad:
            raise RecordError(
                f"not valid UTF-8: byte 0x{raw[bad.start]:02x} at byte offset {bad.start}"
            ) from None
        try:
            marked = decode_marked(text)
        except (ValueError, RecursionError):  # nesting deeper than orjson's 1024 levels
            raise RecordError(f"invalid JSON: {strict_error}") from None
        found = find_problem(marked)
        if found is not None:
            raise problem_error(found) from None
        raise RecordError(f"invalid JSON: {strict_error}") from None


def faithful_record(raw: bytes) -> Any:
    """``raw`` (one record that orjson decoded but :func:`~flow_assets.logs.faithful.suspicious`
    flagged) decoded again faithfully: the value when nothing is altered, else
    :class:`RecordError` naming the field (an integer beyond 64 bits, a duplicate key)."""
    try:
        marked = decode_marked(raw.decode("utf-8"))
    except RecursionError:
        raise RecordError("record is nested too deeply to be read and stored (over about 1,000 levels)") from None
    found = find_problem(marked)
    if found is not None:
        raise problem_error(found)
    check_depth(marked)
    return marked


def check_depth(value: Any) -> None:
    """Raise :class:`RecordError` when ``value`` nests deeper than the lake's JSON writer goes
    (orjson writes 255 levels and the steps table stores tool inputs with it): such a record
    would fail a later stage of its whole batch, so it is quarantined here, alone. Only called
    for records :func:`~flow_assets.logs.faithful.suspicious` flagged, which every record
    nested that deep is (its check re-serialises the record)."""
    try:
        orjson.dumps(value)
    except TypeError as error:  # orjson: "Recursion limit reached"; nothing else fails on decoded JSON
        if "Recursion" not in str(error):
            raise
        raise RecordError(f"record is nested more than {MAX_DEPTH} levels deep; not stored") from None


def _json_kind(value: Any) -> str:
    if isinstance(value, list):
        return "an array"
    if isinstance(value, str):
        return "a string"
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    return "a number"


def _require_object(value: Any) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise RecordError(f"record is {_json_kind(value)}, expected a JSON object")
    return value


def _convert(
    convert: Callable[[dict[str, Any], Any], Trajectory], obj: dict[str, Any], where: Any
) -> Trajectory:
    """Run a converter and turn every way a record can be malformed into a RecordError."""
    try:
        return convert(obj, where)
    except RecordError:
        raise
    except ValidationError as error:
        raise explain_validation(error) from None
    except _SHAPE_ERRORS as error:
        raise RecordError(f"unexpected record shape: {type(error).__name__}: {error}") from None


class Books:
    """Keeps the books of one file while its records stream past: counts every record read and
    refuses a second record with an already-seen ``trajectory_id``. Memory is one entry per
    valid trajectory id (not per record body), so a file of any size streams in bounded space."""

    def __init__(self, path: Path, fmt: str):
        self.file = display_path(path)
        self.format = fmt
        self.records_read = 0
        self._seen_ids: dict[str, int | str] = {}

    def claim_id(self, trajectory_id: str, where: int | str) -> None:
        """Record that ``trajectory_id`` was found valid at ``where`` (a line number or a JSON
        Pointer). Raises RecordError when another record already holds it."""
        first = self._seen_ids.setdefault(trajectory_id, where)
        if first != where:
            seen_at = f"line {first}" if isinstance(first, int) else first
            raise RecordError(
                f"trajectory_id: duplicate {trajectory_id!r} (first seen at {seen_at})",
                "trajectory_id",
            )

    def accept(self, trajectory: Trajectory, where: int | str, **position: Any) -> ValidRecord:
        """A valid record of ``trajectory`` found at ``where`` (see :meth:`claim_id`), with its
        canonical JSON. Raises RecordError when its id was already seen, or when it cannot be
        written as JSON (nested deeper than the serialiser goes, text that is not Unicode), so
        that record, not its file, fails."""
        try:
            record_json = trajectory.model_dump_json()
        except (PydanticSerializationError, ValueError, UnicodeError, RecursionError) as error:
            message = str(error).splitlines()[0][:200]
            raise RecordError(f"record cannot be stored as canonical JSON: {message}") from None
        self.claim_id(trajectory.trajectory_id, where)
        return ValidRecord(trajectory, self.file, record_json=record_json, **position)

    def empty_file(self) -> QuarantinedRecord:
        """The one record of a file that held none (empty or whitespace only), counted as read,
        so the empty arrival is visible and the books still balance."""
        self.records_read = 1
        return QuarantinedRecord(self.file, EMPTY_FILE_REASON, b"")

    def quarantine(self, error: RecordError, raw: bytes, **position: Any) -> QuarantinedRecord:
        """A quarantined record with its raw bytes and position."""
        return QuarantinedRecord(self.file, error.reason, raw, field=error.field, **position)


Record = ValidRecord | QuarantinedRecord
"""What a record stream yields: one item per record read, valid or quarantined."""


class RecordStream:
    """The records of one log file, yielded one at a time in file order (iterate once).

    Every record read is yielded exactly once, as a :class:`ValidRecord` or a
    :class:`QuarantinedRecord`; ``records_read`` counts them independently as they are read, so
    after the stream is exhausted ``valid + quarantined == records_read`` is a real check.
    JSONL formats hold one record in memory at a time; whole-file formats hold their document.

    Raises (while iterating):
        UnreadableLogError: the file cannot be opened or read.
    """

    def __init__(self, books: Books, records: Iterator[Record]):
        self._books = books
        self._records = records

    @property
    def file(self) -> str:
        """Path of the file, as given."""
        return self._books.file

    @property
    def format(self) -> str:
        """The parser reading it (a key of ``reader.FORMATS``)."""
        return self._books.format

    @property
    def records_read(self) -> int:
        """Records read so far (all of them once the stream is exhausted)."""
        return self._books.records_read

    def __iter__(self) -> Iterator[Record]:
        return self._records

    def collect(self) -> ParseResult:
        """Read the whole stream into a :class:`ParseResult` (lists held in memory)."""
        result = ParseResult(file=self.file, format=self.format)
        for record in self:
            (result.valid if isinstance(record, ValidRecord) else result.quarantined).append(record)
        result.records_read = self.records_read
        return result


def empty_stream(path: Path, fmt: str) -> RecordStream:
    """The stream of an empty (or whitespace-only) file: one quarantined record."""
    books = Books(path, fmt)

    def records() -> Iterator[Record]:
        yield books.empty_file()

    return RecordStream(books, records())


def read_line(line: bytes, line_no: int, convert: LineConverter, max_record_bytes: int) -> Trajectory:
    """One JSONL record (a line, its terminator included or not) decoded and converted.

    Args:
        line: the line's bytes.
        line_no: its 1-based line number (some converters derive a default id from it).
        convert: the format's converter.
        max_record_bytes: longest line (bytes, terminator excluded) that is decoded at all.

    Raises:
        RecordError: the line is oversized, not JSON, not an object, or not a valid record of
            the format; ``field`` and ``reason`` say why.
    """
    # The happy path copies nothing: orjson skips the line terminator itself.
    if len(line) > max_record_bytes:  # the terminator does not count
        size = len(line.rstrip(b"\r\n"))
        if size > max_record_bytes:
            raise RecordError(f"record is {size} bytes, over the {max_record_bytes}-byte limit; not parsed")
    try:
        obj = orjson.loads(line)
    except orjson.JSONDecodeError:
        obj = decode_record(line.rstrip(b"\r\n"))  # says why, on the record's bytes
    else:
        if suspicious(line, obj):  # orjson may have rounded a number or dropped a duplicate key
            obj = faithful_record(line.rstrip(b"\r\n"))
    return _convert(convert, _require_object(obj), line_no)


def record_guard(error: RecursionError) -> RecordError:
    """The quarantine reason of a record whose conversion ran out of Python stack (nested too
    deeply for a validator or converter): the record fails, never its file."""
    return RecordError(f"record is nested too deeply to be read (over about {MAX_DEPTH} levels): {error}")


def is_gzip(path: str | Path) -> bool:
    """Whether the file starts with the gzip magic bytes ``1f 8b`` (RFC 1952, section 2.3.1).

    Raises:
        UnreadableLogError: the file cannot be opened.
    """
    try:
        with open(path, "rb") as handle:
            return handle.read(2) == GZIP_MAGIC
    except OSError as error:
        raise UnreadableLogError(str(path), f"cannot open: {error.strerror or error}") from None


def open_log(path: str | Path, buffering: int = -1) -> BinaryIO:
    """Open a log file for binary reading: decompressed on the fly when it is gzip
    (:func:`is_gzip`), positioned after a leading UTF-8 byte order mark when there is one.
    ``buffering`` applies to a plain file (0: unbuffered, for large block reads).

    Raises:
        UnreadableLogError: the file cannot be opened, or is gzip whose first bytes do not
            decompress (the message says so and names the file).
    """
    try:
        handle: BinaryIO = gzip.open(path, "rb") if is_gzip(path) else open(path, "rb", buffering=buffering)
    except OSError as error:
        raise UnreadableLogError(str(path), f"cannot open: {error.strerror or error}") from None
    try:
        head = handle.read(len(UTF8_BOM))
        if head != UTF8_BOM:
            handle.seek(0)
    except READ_ERRORS as error:
        handle.close()
        raise UnreadableLogError(str(path), f"read failed: {error}") from None
    return handle


OVERSIZED_HEAD_BYTES = 64 * 2**10
"""How much of an oversized line a quarantine record keeps (the batch's snapshot keeps it whole)."""


def oversized_error(size: int, max_record_bytes: int, kept: int) -> RecordError:
    """The quarantine reason of a line of ``size`` bytes (its line end excluded) over the limit."""
    return RecordError(
        f"record is {size} bytes, over the {max_record_bytes}-byte limit; not parsed "
        f"(its first {kept} bytes are kept here, the whole line in the batch's snapshot)"
    )


def bounded_lines(handle: BinaryIO, max_record_bytes: int) -> Iterator[tuple[bytes, int | None]]:
    """The lines of ``handle`` (terminators kept) as ``(line, None)``, never holding more than
    ``max_record_bytes`` + 2 bytes of one line in memory: a longer line is read through in
    pieces and yielded as ``(its first OVERSIZED_HEAD_BYTES bytes, its size in bytes without
    its line end)``, so a 200 MB line costs no more memory than a 16 MB one.

    Raises:
        OSError, EOFError: reading failed (see :data:`READ_ERRORS`).
    """
    limit = max_record_bytes + 2  # room for a \r\n after a line of exactly the limit
    while line := handle.readline(limit):
        if len(line) < limit or line.endswith(b"\n"):
            yield line, None
            continue
        head, size, tail = line[:OVERSIZED_HEAD_BYTES], len(line), line[-2:]
        del line
        while piece := handle.readline(1 << 20):
            size, tail = size + len(piece), (tail + piece)[-2:]
            if piece.endswith(b"\n"):
                break
        end = len(tail) - len(tail.rstrip(b"\r\n")) if tail.endswith(b"\n") else 0  # the line end is no part of it
        yield (head if size - end > len(head) else head[: size - end]), size - end


def stream_jsonl(path: Path, fmt: str, convert: LineConverter, max_record_bytes: int) -> RecordStream:
    """Stream a JSONL file, one record per non-blank line, quarantining bad lines.

    Lines are counted from 1, blank lines included, but blank lines are not records. A line
    longer than ``max_record_bytes`` (bytes, line terminator excluded) is quarantined without
    being decoded, and without ever being held whole (:func:`bounded_lines`): its ``raw`` is its
    first :data:`OVERSIZED_HEAD_BYTES` bytes. ``raw`` of any other quarantined record is the
    line's bytes without its terminator.
    A file with no record at all yields the one quarantined record of :func:`empty_stream`.

    Raises (while iterating):
        UnreadableLogError: the file cannot be opened or read.
    """
    books = Books(path, fmt)

    def records() -> Iterator[Record]:
        with open_log(path) as handle:
            try:
                for line_no, (line, oversized) in enumerate(bounded_lines(handle, max_record_bytes), start=1):
                    if oversized is not None:
                        books.records_read += 1
                        yield books.quarantine(oversized_error(oversized, max_record_bytes, len(line)), line, line=line_no)
                        continue
                    if line.isspace():
                        continue
                    books.records_read += 1
                    try:
                        try:
                            record = books.accept(read_line(line, line_no, convert, max_record_bytes), line_no, line=line_no)
                        except RecursionError as deep:
                            raise record_guard(deep) from None
                    except RecordError as error:
                        record = books.quarantine(error, line.rstrip(b"\r\n"), line=line_no)
                    yield record
            except READ_ERRORS as error:
                raise UnreadableLogError(str(path), f"read failed: {error}") from None
        if books.records_read == 0:
            yield books.empty_file()

    return RecordStream(books, records())


@dataclass(frozen=True)
class Document:
    """A whole-file JSON document. ``lenient`` is true when orjson refused it, or may have
    altered it (:func:`~flow_assets.logs.faithful.suspicious`), and Python's ``json`` read it
    with marks (:func:`~flow_assets.logs.faithful.decode_marked`); each element must then be
    checked (:func:`~flow_assets.logs.faithful.find_problem`) and is re-serialised with ``json``."""

    value: Any
    lenient: bool = False

    def raw(self, element: Any) -> bytes:
        """The element's bytes for a quarantine record: compact JSON, NaN kept as ``NaN``, a lone
        surrogate as its ``\\u`` escape. (The batch's snapshot keeps the document as written.)"""
        try:
            if self.lenient:
                try:
                    return json.dumps(element, ensure_ascii=False, allow_nan=True).encode("utf-8")
                except UnicodeEncodeError:
                    return json.dumps(element, ensure_ascii=True, allow_nan=True).encode("ascii")
            return orjson.dumps(element)
        except (RecursionError, orjson.JSONEncodeError, ValueError, TypeError) as error:
            return f"(element not re-serialisable: {type(error).__name__}: {error}; see the batch's snapshot)".encode()


@dataclass(frozen=True)
class BadElement:
    """An element of a whole-file document that could not be decoded on its own (nested too
    deeply, oversized, not JSON): it stands in the document's value where the element was, and
    :func:`stream_elements` quarantines it with ``error`` and ``raw`` (its bytes as written)."""

    error: RecordError
    raw: bytes


# Tokens of a document's structure: a whole string (escapes included), a bracket, a comma or a
# colon; a lone quote is an unterminated string. Numbers and literals lie between tokens.
_STRUCTURE = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"|[\[\]{},:"]', re.S)
_WHITESPACE = b" \t\r\n"


def _members(data: bytes, start: int, end: int) -> tuple[bool, list[tuple[bytes | None, int, int]]]:
    """Split the container (array or object) spanning ``data[start:end]`` into its members
    without decoding them: ``(is_object, [(key token or None, value start, value end)])``.
    Only the structure is checked (brackets, commas, strings), at any depth, in one pass.

    Raises:
        ValueError: the span is not one well-formed container (truncated, trailing bytes, an
            empty member, a member without its key).
    """
    at = start
    while at < end and data[at] in _WHITESPACE:
        at += 1
    if at >= end or data[at] not in b"[{":
        raise ValueError("not a JSON array or object")
    is_object = data[at] == ord("{")
    members: list[tuple[bytes | None, int, int]] = []
    depth, key, value_at, closed = 0, None, at + 1, -1

    def member(stop: int) -> None:
        if is_object and key is None:
            raise ValueError(f"member without a key before byte {stop}")
        if not data[value_at:stop].strip(_WHITESPACE):
            raise ValueError(f"empty member before byte {stop}")
        members.append((key, value_at, stop))

    for token in _STRUCTURE.finditer(data, at, end):
        char = data[token.start()]
        if char == ord('"'):
            if token.end() - token.start() == 1:
                raise ValueError(f"unterminated string at byte {token.start()}")
            if depth == 1 and is_object and key is None:
                key = token.group()
        elif char in b"[{":
            depth += 1
        elif char in b"]}":
            depth -= 1
            if depth == 0:
                if members or data[value_at : token.start()].strip(_WHITESPACE) or key is not None:
                    member(token.start())
                closed = token.end()
                break
        elif depth == 1 and char == ord(","):
            member(token.start())
            key, value_at = None, token.end()
        elif depth == 1 and char == ord(":"):
            value_at = token.end()
    if closed < 0:
        raise ValueError("truncated: the document never closes")
    if data[closed:end].strip(_WHITESPACE):
        raise ValueError(f"bytes after the document's end at byte {closed}")
    return is_object, members


def decode_element(raw: bytes, max_record_bytes: int) -> Any:
    """One record's JSON decoded on its own, by the rules of a JSONL line: refused when over
    ``max_record_bytes``, decoded by orjson, checked faithfully when suspicious, nested no
    deeper than :data:`MAX_DEPTH`.

    Raises:
        RecordError: why the element cannot be a record.
    """
    if len(raw) > max_record_bytes:
        raise RecordError(f"record is {len(raw)} bytes, over the {max_record_bytes}-byte limit; not parsed")
    try:
        value = orjson.loads(raw)
    except orjson.JSONDecodeError:
        return decode_record(raw)
    return faithful_record(raw) if suspicious(raw, value) else value


def _split_container(data: bytes, start: int, end: int, max_record_bytes: int, arrays_below: bool) -> Any:
    """The container at ``data[start:end]`` with every member decoded on its own; a member that
    fails is a :class:`BadElement`, or, when it is an array and ``arrays_below``, is split the
    same way (tau2 keeps its records in the ``simulations`` array of the top object).

    Raises:
        ValueError: the container's structure is broken (see :func:`_members`).
    """
    is_object, members = _members(data, start, end)
    values: list[tuple[Any, Any]] = []
    for key_token, value_start, value_end in members:
        key = decode_element(key_token, max_record_bytes) if key_token is not None else None
        raw = data[value_start:value_end].strip(_WHITESPACE)
        try:
            value = decode_element(raw, max_record_bytes)
        except RecordError as error:
            value = BadElement(error, raw)
            if arrays_below and raw[:1] == b"[":
                try:
                    value = _split_container(data, value_start, value_end, max_record_bytes, False)
                except ValueError:
                    pass
        values.append((key, value))
    return dict(values) if is_object else [value for _, value in values]


def split_document(data: bytes, max_record_bytes: int = DEFAULT_MAX_RECORD_BYTES) -> Document:
    """A document that does not decode whole (one element nested too deeply, oversized, or not
    JSON), read element by element: each member of the top array or object, and of an array
    inside the top object, is decoded on its own, and one that fails stands as a
    :class:`BadElement` to be quarantined, so the rest of the file is kept.

    Raises:
        ValueError: the document's structure itself is broken (truncated, trailing bytes...).
    """
    try:
        return Document(_split_container(data, 0, len(data), max_record_bytes, True))
    except RecordError as error:  # a key that is not a JSON string
        raise ValueError(error.reason) from None


def load_document(path: Path, max_record_bytes: int = DEFAULT_MAX_RECORD_BYTES) -> Document | None:
    """Read a whole-file JSON document; ``None`` when the file is empty or whitespace only.
    A document that does not decode whole is read element by element (:func:`split_document`),
    so one bad element is one quarantined record; ``max_record_bytes`` bounds an element there.

    Raises:
        UnreadableLogError: the file cannot be opened, is not UTF-8 (the message gives the byte
            offset), or is not JSON (truncated, trailing garbage...) in its structure.
    """
    with open_log(path) as handle:
        try:
            data = handle.read()
        except READ_ERRORS as error:
            raise UnreadableLogError(str(path), f"read failed: {error}") from None
    if not data.strip():
        return None
    try:
        value = orjson.loads(data)
    except orjson.JSONDecodeError as strict_error:
        problem = f"not valid JSON: {strict_error}"
    else:
        if not suspicious(data, value):
            return Document(value)
        problem = None  # maybe a number rounded or a key dropped: read it faithfully, check per element
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as bad:
        reason = f"not valid UTF-8: byte 0x{data[bad.start]:02x} at byte offset {bad.start}"
        raise UnreadableLogError(str(path), reason) from None
    try:
        return Document(decode_marked(text), lenient=True)
    except (ValueError, RecursionError) as error:
        whole_error = problem or f"not valid JSON: {error}"
    try:
        return split_document(data, max_record_bytes)
    except ValueError:
        raise UnreadableLogError(str(path), whole_error) from None


def pointer_token(key: Any) -> str:
    """Escape one JSON Pointer reference token (RFC 6901: ``~`` → ``~0``, ``/`` → ``~1``)."""
    return str(key).replace("~", "~0").replace("/", "~1")


def stream_elements(
    path: Path,
    fmt: str,
    document: Document,
    elements: Iterable[tuple[str, Any]],
    convert: ElementConverter,
) -> RecordStream:
    """Stream the record elements of a whole-file document, quarantining bad ones.

    ``elements`` yields ``(json_pointer, element)``; each counts as one record read. A document
    with no elements (``[]``) gives an empty stream: the file was not empty, it held no runs.
    """
    books = Books(path, fmt)

    def records() -> Iterator[Record]:
        for pointer, element in elements:
            books.records_read += 1
            if isinstance(element, BadElement):
                yield books.quarantine(element.error, element.raw, pointer=pointer)
                continue
            try:
                try:
                    obj = _require_object(element)
                    if document.lenient:
                        found = find_problem(obj)
                        if found is not None:
                            raise problem_error(found)
                    record = books.accept(_convert(convert, obj, pointer), pointer, pointer=pointer)
                except RecursionError as deep:
                    raise record_guard(deep) from None
            except RecordError as error:
                record = books.quarantine(error, document.raw(element), pointer=pointer)
            yield record

    return RecordStream(books, records())


def require_document_shape(path: Path, document: Document, ok: bool, expected: str) -> None:
    """Raise :class:`UnreadableLogError` when a document's top level is not what the format
    expects (``ok`` is false), e.g. an explicit ``tau-bench`` on a tau2 file."""
    if not ok:
        found = _json_kind_top(document.value)
        raise UnreadableLogError(str(path), f"expected {expected}, found {found}")


def _json_kind_top(value: Any) -> str:
    if isinstance(value, dict):
        keys = ", ".join(list(value)[:5])
        return f"an object with keys [{keys}]"
    return _json_kind(value)
