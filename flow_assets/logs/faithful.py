"""Faithful JSON decoding: what the fast reader (orjson) would change or hide in a record is
found and named, so that a record is either stored exactly as written or quarantined with why.

orjson, which reads every record, accepts some JSON silently and not as written:

- an integer beyond 64 bits becomes a float (``1180591620717411303424`` -> ``1.18e21``: rounded);
- of duplicate keys in one object the last is kept and the others vanish;

and refuses some with a message that does not say what is in the file (``1e400``: "number is
infinity"; a lone surrogate escape ``\\ud800``). Every record gets two cheap checks at C speed
(:func:`suspicious`: a run of 20 or more digits; fewer ``":`` in orjson's re-serialisation than in
the record, which is what a dropped duplicate key leaves), and a record that fails one, or that
orjson refused, is decoded again by Python's ``json`` with hooks that mark what orjson would
have altered (:func:`decode_marked`). :func:`find_problem` then names the first such place: the
record is quarantined with that reason and field. A suspicious record with no problem (a long
digit run inside a string, say) is used as decoded, unchanged.
"""

from __future__ import annotations

import json
import math
from typing import Any

import orjson

_DIGITS = bytes(48 if 48 <= b <= 57 else 46 for b in range(256))  # digits -> "0", the rest -> "."
_LONG_DIGIT_RUN = b"0" * 20  # 2**64 has 20 digits
INT_MIN, INT_MAX = -(2**63), 2**64 - 1  # what orjson keeps exactly: int64 and uint64


class _BigInt(int):
    """An integer literal orjson would have rounded to a float."""


class _Overflow(float):
    """A number literal beyond a 64-bit float (``1e400``), with its text."""

    literal: str


class _Constant(float):
    """A ``NaN`` / ``Infinity`` / ``-Infinity`` literal (not JSON)."""

    literal: str


class _Object(dict):
    """A JSON object that remembers the keys it held more than once."""

    duplicates: tuple[str, ...] = ()


def suspicious(raw: bytes, value: Any) -> bool:
    """Whether ``value`` (orjson's decoding of ``raw``) may differ from what ``raw`` says: ``raw``
    holds a run of 20+ digits, or re-serialising ``value`` gives fewer ``":`` (key ends) than
    ``raw`` has (a quote inside a string is always escaped, so only a vanished key does that)."""
    if _LONG_DIGIT_RUN in raw.translate(_DIGITS):
        return True
    try:
        again = orjson.dumps(value)
    except orjson.JSONEncodeError:  # nested deeper than orjson writes: look closer
        return True
    # a compact record (as orjson and most loggers write it) comes back byte for byte, maybe
    # without its line end: nothing vanished, and one comparison replaces counting both texts
    # (~15% of a parse worker's time)
    if raw.startswith(again) and (len(raw) == len(again) or raw[len(again) :].isspace()):
        return False
    return again.count(b'":') < raw.count(b'":')


def _pairs(pairs: list[tuple[str, Any]]) -> _Object:
    obj = _Object(pairs)
    if len(obj) < len(pairs):
        seen: set[str] = set()
        obj.duplicates = tuple(k for k, _ in pairs if k in seen or seen.add(k))
    return obj


def _int(text: str) -> int:
    n = int(text)
    return _BigInt(n) if not INT_MIN <= n <= INT_MAX else n


def _float(text: str) -> float:
    x = float(text)
    if math.isinf(x):
        marked = _Overflow(x)
        marked.literal = text
        return marked
    return x


def _constant(text: str) -> float:
    marked = _Constant(float(text))
    marked.literal = text
    return marked


def decode_marked(text: str) -> Any:
    """``text`` decoded by Python's ``json``, with what orjson would alter or refuse marked for
    :func:`find_problem`.

    Raises:
        ValueError: not JSON. RecursionError: nested deeper than Python's recursion limit.
    """
    return json.loads(text, object_pairs_hook=_pairs, parse_int=_int, parse_float=_float, parse_constant=_constant)


def _surrogate(text: str) -> str | None:
    for ch in text:
        if 0xD800 <= ord(ch) <= 0xDFFF:
            return f"\\u{ord(ch):04x}"
    return None


def find_problem(value: Any, path: tuple[Any, ...] = ()) -> tuple[tuple[Any, ...], str] | None:
    """The first place (depth first) in a :func:`decode_marked` value that cannot be stored as
    written, as ``(path, what is wrong)``, or ``None``. Iterative: depth is no limit here."""
    stack: list[tuple[tuple[Any, ...], Any]] = [(path, value)]
    while stack:
        where, item = stack.pop()
        if isinstance(item, str):
            if (bad := _surrogate(item)) is not None:
                return where, f"holds a lone surrogate {bad} (not valid Unicode; the text cannot be stored as UTF-8)"
        elif isinstance(item, _BigInt):
            return where, f"integer {int(item)} does not fit in 64 bits (it would be rounded to a float)"
        elif isinstance(item, _Overflow):
            return where, f"{item.literal} is beyond the range of a 64-bit float"
        elif isinstance(item, _Constant):
            return where, f"{item.literal} is not a finite number (JSON has no NaN or Infinity)"
        elif isinstance(item, float) and not math.isfinite(item):
            return where, f"{item} is not a finite number"
        elif isinstance(item, dict):
            if isinstance(item, _Object) and item.duplicates:
                keys = ", ".join(repr(k) for k in dict.fromkeys(item.duplicates))
                return where, f"duplicate key {keys} in one object (a reader would keep only the last value)"
            children = []
            for key, child in item.items():
                if (bad := _surrogate(key)) is not None:
                    return (*where, key), f"key holds a lone surrogate {bad} (not valid Unicode)"
                children.append(((*where, key), child))
            stack.extend(reversed(children))
        elif isinstance(item, list):
            stack.extend(reversed([((*where, i), child) for i, child in enumerate(item)]))
    return None
