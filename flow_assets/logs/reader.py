"""Read any supported log file: detect its format by content and run that format's parser.

``FORMATS`` maps a built-in format name to its parser, so a caller can also name the format
explicitly; formats from plug-ins (``flow_assets/logs/plugins.py``) are read the same way and
detected after the built-in ones.
Which files of the landing directory get read at all (never ``*.tmp`` or ``.``-prefixed names)
is decided by ``flow_assets/logs/landing.py``; see ``docs/log-format.md``.
"""

from __future__ import annotations

from collections.abc import Callable
from itertools import islice
from pathlib import Path
from typing import Any

import orjson

from flow_assets.logs.formats import canonical, flat
from flow_assets.logs.formats.canonical import stream_canonical
from flow_assets.logs.formats.common import (
    DEFAULT_MAX_RECORD_BYTES,
    READ_ERRORS,
    LineConverter,
    bounded_lines,
    RecordStream,
    empty_stream,
    load_document,
    open_log,
)
from flow_assets.logs.formats.fireact import stream_fireact
from flow_assets.logs.formats.flat import stream_flat
from flow_assets.logs.formats.openai_chat import stream_tau_bench
from flow_assets.logs.formats.tau2 import stream_tau2
from flow_assets.logs.plugins import plugin_formats
from flow_assets.logs.records import ParseResult, UnreadableLogError

Parser = Callable[..., RecordStream]

FORMATS: dict[str, Parser] = {
    "canonical": stream_canonical,
    "flat": stream_flat,
    "tau-bench": stream_tau_bench,
    "tau2": stream_tau2,
    "fireact": stream_fireact,
}
"""Format name → parser ``(path, *, max_record_bytes) -> RecordStream``. JSONL formats
(canonical, flat) stream a record at a time; whole-file formats load their document first."""

LINE_CONVERTERS: dict[str, Callable[[Path], LineConverter]] = {
    "canonical": canonical.line_converter,
    "flat": flat.line_converter,
}
"""JSONL format name → ``line_converter(path)``: the picklable per-line converter its parser uses,
so lines of a large file can be validated in other processes (``flow_assets.logs.chunks``)."""

BLANK = "unknown"
"""What :func:`resolve_format` says of an empty or whitespace-only file when asked to detect."""


# How many non-blank lines detection inspects looking for a recognisable JSONL record, and how
# many elements of a whole-file document it inspects for the expected keys: enough to step over
# a few corrupted records at the head of a file, few enough to stay O(1) on huge files.
_SNIFF_LINES = 100
_SNIFF_ELEMENTS = 20
_SNIFF_LINE_BYTES = DEFAULT_MAX_RECORD_BYTES


def _jsonl_kind(record: dict[str, Any]) -> str | None:
    if isinstance(record.get("messages"), list):
        # A chat transcript (OpenAI chat messages; an Anthropic request logged with its
        # "response", which would look flat): flat and canonical records never hold "messages"
        # (both refuse unknown keys), so the chat plug-in formats detect it instead.
        return None
    if "steps" in record or "trajectory_id" in record:
        return "canonical"
    if "response" in record or "input" in record:
        return "flat"
    return None


def _document_kind(doc: Any) -> str | None:
    """The whole-file format a decoded document has the shape of, or ``None``."""
    if isinstance(doc, list):
        head = [e for e in islice(doc, _SNIFF_ELEMENTS) if isinstance(e, dict)]
        if any("traj" in e and "task_id" in e for e in head):
            return "tau-bench"
    elif isinstance(doc, dict):
        if isinstance(doc.get("simulations"), list):
            return "tau2"
        head = [v for v in islice(doc.values(), _SNIFF_ELEMENTS) if isinstance(v, dict)]
        if any("traj" in v and "gt" in v for v in head):
            return "fireact"
    return None


def _head_lines(path: Path) -> list[bytes]:
    """Up to ``_SNIFF_LINES`` non-blank lines from the top of the file, stripped; lines over
    ``_SNIFF_LINE_BYTES`` are skipped (they would be quarantined unparsed anyway).

    Raises:
        UnreadableLogError: the file cannot be opened or read.
    """
    lines: list[bytes] = []
    with open_log(path) as handle:
        try:
            for line, oversized in bounded_lines(handle, _SNIFF_LINE_BYTES):
                if oversized is None and line.strip() and len(line) <= _SNIFF_LINE_BYTES:
                    lines.append(line.strip())
                    if len(lines) >= _SNIFF_LINES:
                        break
        except READ_ERRORS as error:
            raise UnreadableLogError(str(path), f"read failed: {error}") from None
    return lines


def is_blank_file(path: str | Path) -> bool:
    """Whether a file holds nothing but ASCII whitespace (0 bytes included; a gzip file's
    decompressed bytes; a byte order mark alone); read in chunks.

    Raises:
        UnreadableLogError: the file cannot be opened or read.
    """
    with open_log(path) as handle:
        try:
            while chunk := handle.read(1 << 16):
                if chunk.strip():
                    return False
        except READ_ERRORS as error:
            raise UnreadableLogError(str(path), f"read failed: {error}") from None
    return True


def _sniff_lines(lines: list[bytes]) -> str | None:
    for line in lines:
        try:
            value = orjson.loads(line)
        except orjson.JSONDecodeError:
            continue
        kind = _jsonl_kind(value) if isinstance(value, dict) else None
        kind = kind or _document_kind(value)  # a whole document written on one line
        if kind:
            return kind
    return None


def _unrecognised() -> str:
    formats = plugin_formats()
    plugins = [name for name, fmt in formats.items() if name not in FORMATS and not fmt.builtin]
    shipped = [name for name, fmt in formats.items() if name not in FORMATS and fmt.builtin]
    return (
        "unrecognised log format: not canonical or flat JSONL, nor a tau-bench, tau2 or FireAct JSON document, "
        f"nor {', '.join(shipped)} (gzip-compressed or not)"
        f"{', nor any plug-in format (' + ', '.join(plugins) + ')' if plugins else ''}; "
        "convert it to the canonical format (`flowopt schema`, docs/log-format.md), name a format with --format, "
        "or add a plug-in parser (docs/log-format.md, section 7)"
    )


def detect_format(path: str | Path) -> str:
    """The name (a key of :data:`FORMATS`) of the format of a log file, judged by content.

    JSONL is recognised by the keys of its first line that decodes to an object (``steps`` or
    ``trajectory_id``: canonical; ``input`` or ``response``: flat). A file whose first line is a
    lone ``{`` or ``[`` is read as one JSON document: a list of objects with ``traj`` and
    ``task_id`` is tau-bench, an object with a ``simulations`` list is tau2, an object whose
    values have ``traj`` and ``gt`` is FireAct.

    Raises:
        UnreadableLogError: the file cannot be read, is empty, is a JSON document that does not
            parse (e.g. truncated), or matches no format. The message names the file.
    """
    path = Path(path)
    if is_blank_file(path):
        raise UnreadableLogError(str(path), "empty file: no records to detect a format from")
    lines = _head_lines(path)
    # A pretty-printed document opens with a lone bracket; a JSONL record never does.
    pretty_document = bool(lines) and lines[0] in (b"{", b"[")
    if not pretty_document:
        kind = _sniff_lines(lines)
        if kind:
            return kind
    try:
        document = load_document(path)
    except UnreadableLogError:
        plugin = _detect_plugin(path)
        if plugin:
            return plugin
        if pretty_document:
            raise
        raise UnreadableLogError(str(path), _unrecognised()) from None
    kind = _document_kind(document.value) if document is not None else None
    if kind is None:
        kind = _detect_plugin(path)
    if kind is None:
        raise UnreadableLogError(str(path), _unrecognised())
    return kind


def known_formats() -> list[str]:
    """Names of every format a file may be read as: the built-in :data:`FORMATS`, then the
    plug-ins installed or registered (``flow_assets/logs/plugins.py``).

    Raises:
        PluginFormatError: a plug-in does not load (the message names it).
    """
    return [*FORMATS, *(name for name in plugin_formats() if name not in FORMATS)]


def _detect_plugin(path: Path) -> str | None:
    for name, fmt in plugin_formats().items():
        if name in FORMATS:
            continue
        try:
            if fmt.detect(path):
                return name
        except Exception as exc:  # a third party's detect must not hide which plug-in broke
            raise UnreadableLogError(str(path), f"log format plug-in {name!r} ({fmt.origin}) failed to detect: {exc!r}") from exc
    return None


def stream_file(
    path: str | Path, fmt: str = "auto", *, max_record_bytes: int = DEFAULT_MAX_RECORD_BYTES
) -> RecordStream:
    """The records of one log file as a stream (valid or quarantined, in file order), so a
    batch of any size is read in bounded memory; see :func:`parse_file` for the rules.

    ``fmt`` is a key of :data:`FORMATS` or ``"auto"`` (detect by content). An empty or
    whitespace-only file yields one quarantined record (reason ``"empty file: no records"``,
    ``records_read == 1``); its ``format`` is ``fmt``, or ``"unknown"`` when detecting.
    ``max_record_bytes`` bounds one JSONL line (bytes); longer lines are quarantined unparsed.

    Raises:
        ValueError: ``fmt`` names no known format.
        UnreadableLogError: the file cannot be read (JSONL: when iteration starts), its format
            cannot be detected, or a whole-file JSON document is not valid JSON / not the named
            format's shape.
    """
    path = Path(path)
    fmt = resolve_format(path, fmt)
    if fmt == BLANK:
        return empty_stream(path, BLANK)
    if fmt in FORMATS:
        return FORMATS[fmt](path, max_record_bytes=max_record_bytes)
    return plugin_formats()[fmt].parse(path, max_record_bytes=max_record_bytes)


def resolve_format(path: str | Path, fmt: str = "auto") -> str:
    """The parser for ``path``: ``fmt`` itself when it names one, else the detected format, or
    :data:`BLANK` for an empty/whitespace-only file (there is nothing to detect from).

    Raises:
        ValueError: ``fmt`` names no known format.
        UnreadableLogError: detection failed (see :func:`detect_format`).
    """
    if fmt != "auto" and fmt not in FORMATS and fmt not in plugin_formats():
        raise ValueError(f"unknown log format {fmt!r}; known: auto, {', '.join(known_formats())}")
    if fmt != "auto":
        return fmt
    if is_blank_file(path):
        return BLANK
    return detect_format(path)


def parse_file(
    path: str | Path, fmt: str = "auto", *, max_record_bytes: int = DEFAULT_MAX_RECORD_BYTES
) -> ParseResult:
    """:func:`stream_file` collected into valid trajectories and quarantined records held in
    memory (same arguments, rules and errors; the file is read to its end before returning)."""
    return stream_file(path, fmt, max_record_bytes=max_record_bytes).collect()
