"""Secret redaction: API keys, bearer tokens and password-like fields out of a log's bytes before
anything of it is stored in the lake.

Agent logs carry secrets: keys in tool arguments, ``Authorization`` headers in HTTP tool
outputs, passwords typed into forms. A batch's snapshot in the lake is written through
:func:`redact_line`, so every table built from it (interaction logs, trajectories, steps,
quarantine raw bytes, the UI's previews) holds ``[REDACTED:<kind>]`` in their place.

Two rules, both on the JSON text of each line (a record, or a line of a pretty-printed document):

1. **Values that look like secrets**, wherever they occur (:data:`DEFAULT_PATTERNS`): OpenAI-style
   keys ``sk-…``, Slack tokens ``xox?-…``, AWS access key ids ``AKIA…``, GitHub tokens ``ghp_…``
   (and ``gho_``/``ghu_``/``ghs_``/``ghr_``), ``Bearer …`` credentials.
2. **String values of fields named like a secret** (:data:`DEFAULT_FIELDS`, matched exactly,
   case-insensitive: ``password``, ``api_key``, ``secret``, ``token``, ``access_token`` ...), as
   a JSON member ``"name": "value"`` or, inside a JSON-encoded string such as a tool call's
   ``arguments``, ``\\"name\\": \\"value\\"``.

Only JSON strings are rewritten: numbers and arrays (token ids, log-probs) are never touched.
Counting is per kind (the pattern's name, or the field's name in lower case).
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial

DEFAULT_PATTERNS: dict[str, str] = {
    "openai_key": r"sk-(?:proj-|ant-)?[A-Za-z0-9_-]{20,}",
    "slack_token": r"xox[abposr]-[A-Za-z0-9-]{10,}",
    "aws_access_key": r"AKIA[0-9A-Z]{16}(?![0-9A-Z])|ASIA[0-9A-Z]{16}(?![0-9A-Z])",
    "github_token": r"gh[pousr]_[A-Za-z0-9]{30,}",
    "bearer": r"(?i:bearer)\s+[A-Za-z0-9._~+/=-]{8,}",
}
"""Kind → regular expression of a secret value (matched on the UTF-8 bytes; a match should not
span a line end, since blocks of many lines are searched at once)."""

# Each default pattern opens with a literal (an alternation of two for AWS), which lets the regex
# engine skip ahead at C speed: over 1 GB/s each on text without secrets. Bearer is the exception
# (case-insensitive, about 240 MB/s), and the slowest part of redaction.

DEFAULT_FIELDS: tuple[str, ...] = (
    "password", "passwd", "pwd", "secret", "client_secret", "api_key", "apikey", "x-api-key",
    "token", "access_token", "refresh_token", "id_token", "auth_token", "session_token",
    "private_key", "secret_key", "authorization",
)  # fmt: skip
"""Field names (case-insensitive, exact) whose string values are always redacted."""


@dataclass(frozen=True)
class RedactionConfig:
    """What :func:`redact_line` replaces.

    Attributes:
        enabled: false turns redaction off (the opt-out; the snapshot is then the file's bytes).
        patterns: kind → regex of secret values (default :data:`DEFAULT_PATTERNS`).
        fields: field names whose string values are redacted (default :data:`DEFAULT_FIELDS`).
    """

    enabled: bool = True
    patterns: Mapping[str, str] = field(default_factory=lambda: dict(DEFAULT_PATTERNS))
    fields: Sequence[str] = DEFAULT_FIELDS


class Redactor:
    """Compiled :class:`RedactionConfig`: call :meth:`block` on runs of whole lines (or
    :meth:`line` on one); :attr:`counts` holds the replacements made so far per kind.

    Speed (why it works on blocks): per line, the fixed cost of a dozen substring scans and five
    regex calls dominated (40 MB/s on canonical JSONL). On a block of about a megabyte each
    scan runs once at C speed, and the slow member regexes run only on the lines around a hit.

    Raises:
        re.error: a pattern does not compile (the message names it).
    """

    def __init__(self, config: RedactionConfig = RedactionConfig()):
        self.config = config
        self.counts: Counter[str] = Counter()
        self._values = []
        for kind, pattern in config.patterns.items():
            try:
                compiled = re.compile(pattern.encode())
            except re.error as error:
                raise re.error(f"redaction pattern {kind!r} ({pattern!r}): {error}") from None
            self._values.append((kind, compiled))
        self._field_triggers = field_triggers(config.fields)
        names = b"|".join(re.escape(f.encode()) for f in sorted(config.fields, key=len, reverse=True))
        # "name": "value" as a JSON member, or \"name\": \"value\" inside an encoded JSON string;
        # the value is everything up to the closing (escaped) quote, escapes included. Neither
        # crosses a line end: a block holds many lines and an unclosed quote must stay in its own.
        self._member = re.compile(rb'(?i)("(' + names + rb')"[ \t]*:[ \t]*")((?:[^"\\\n]|\\[^\n])*)(")') if names else None
        self._escaped = (
            re.compile(rb'(?i)(\\"(' + names + rb')\\"[ \t]*:[ \t]*\\")((?:[^"\\\n]|\\[^"\n])*)(\\")') if names else None
        )

    def _field(self, match: re.Match) -> bytes:
        if not match.group(3):
            return match.group(0)  # an empty value hides nothing
        kind = match.group(2).decode().lower()
        self.counts[kind] += 1
        return match.group(1) + f"[REDACTED:{kind}]".encode() + match.group(4)

    def _lines_with_triggers(self, lowered: bytes) -> list[tuple[int, int]]:
        """Sorted, disjoint ``(start, end)`` byte spans of the lines holding a field trigger."""
        spans = []
        for trigger in self._field_triggers:
            at = lowered.find(trigger)
            while at >= 0:
                start = lowered.rfind(b"\n", 0, at) + 1
                end = lowered.find(b"\n", at)
                end = len(lowered) if end < 0 else end + 1
                spans.append((start, end))
                at = lowered.find(trigger, end)
        merged: list[tuple[int, int]] = []
        for start, end in sorted(spans):
            if merged and start < merged[-1][1]:
                merged[-1] = (merged[-1][0], max(end, merged[-1][1]))
            else:
                merged.append((start, end))
        return merged

    def block(self, data: bytes) -> bytes:
        """``data`` (whole lines of UTF-8 JSON text, ``\\n``-separated) with every secret replaced;
        the bytes between secrets, line ends included, are unchanged."""
        if not self.config.enabled:
            return data
        if self._member is not None:
            spans = self._lines_with_triggers(data.lower())
            if spans:
                parts, done = [], 0
                for start, end in spans:
                    text = self._escaped.sub(self._field, self._member.sub(self._field, data[start:end]))
                    parts += [data[done:start], text]
                    done = end
                parts.append(data[done:])
                data = b"".join(parts)
        for kind, pattern in self._values:
            data, n = pattern.subn(f"[REDACTED:{kind}]".encode(), data)
            if n:
                self.counts[kind] += n
        return data

    line = block  # a line is a block of one

    def stream(self, blocks: Iterable[bytes], workers: int = 1) -> Iterator[bytes]:
        """Each of ``blocks`` (whole lines) redacted, in order; :attr:`counts` grows as they are
        yielded. With ``workers`` > 1 the blocks are redacted by that many processes
        (:func:`~flow_assets.logs.chunks.ordered_map`: bounded memory, order kept), since one core
        redacts slower than the data plane reads.

        Raises:
            concurrent.futures.process.BrokenProcessPool: a worker died.
        """
        if workers <= 1 or not self.config.enabled:
            yield from map(self.block, blocks)
            return
        from flow_assets.logs.chunks import ordered_map  # the process pool lives with the reader's

        for _, (text, counts) in ordered_map(partial(redact_block, self.config), blocks, workers):
            self.counts.update(counts)
            yield text


def field_triggers(fields: Sequence[str]) -> tuple[bytes, ...]:
    """Lower-case byte strings, one of which occurs in (the lower-cased text of) every JSON member
    ``"f": …`` or encoded member ``\\"f\\": …`` of a field ``f`` in ``fields``.

    Only a line holding a trigger is searched with the (slow) member regexes, so the set is kept
    small and rare: a name of six characters or more is its own trigger (such names rarely occur
    except as that field); a shorter one (``pwd``, ``token``, common in shell commands and LLM
    logs) needs its closing quote, plain or escaped; a field whose both member forms already hold
    a trigger adds none (``access_token`` is covered by ``token"`` and ``token\\"``).
    """
    triggers: list[bytes] = []
    for name in sorted({f.lower().encode() for f in fields}, key=len):
        forms = (name + b'"', name + b'\\"')
        if all(any(t in form for t in triggers) for form in forms):
            continue
        triggers += [name] if len(name) >= 6 else list(forms)
    return tuple(triggers)


def redact_block(config: RedactionConfig, data: bytes) -> tuple[bytes, dict[str, int]]:
    """``data`` (whole lines) redacted with ``config``, and the replacements per kind: the unit
    of work of :meth:`Redactor.stream`'s worker processes (compiled patterns come from ``re``'s
    cache after a worker's first block)."""
    redactor = Redactor(config)
    return redactor.block(data), dict(redactor.counts)


def redact_line(data: bytes, config: RedactionConfig = RedactionConfig()) -> tuple[bytes, dict[str, int]]:
    """One line redacted with ``config``, and the replacements per kind (for tests and tools;
    a file goes through one :class:`Redactor`)."""
    redactor = Redactor(config)
    return redactor.line(data), dict(redactor.counts)
