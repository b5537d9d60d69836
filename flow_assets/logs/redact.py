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
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

DEFAULT_PATTERNS: dict[str, str] = {
    "openai_key": r"sk-(?:proj-|ant-)?[A-Za-z0-9_-]{20,}",
    "slack_token": r"xox[abposr]-[A-Za-z0-9-]{10,}",
    "aws_access_key": r"AKIA[0-9A-Z]{16}(?![0-9A-Z])|ASIA[0-9A-Z]{16}(?![0-9A-Z])",
    "github_token": r"gh[pousr]_[A-Za-z0-9]{30,}",
    "bearer": r"Bearer\s+[A-Za-z0-9._~+/=-]{8,}|bearer\s+[A-Za-z0-9._~+/=-]{8,}|BEARER\s+[A-Za-z0-9._~+/=-]{8,}",
}
"""Kind → regular expression of a secret value (matched on the line's bytes as UTF-8)."""

# Each default pattern opens with a literal (an alternation of literals for AWS and Bearer), which
# lets the regex engine skip ahead at C speed: over 1 GB/s each on a line without secrets.

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
    """Compiled :class:`RedactionConfig`: call :meth:`line` on each line; :attr:`counts` holds
    the replacements made so far per kind.

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
        # A member needs its name followed by a quote (or an escaped one) in the lower-cased
        # line: substring searches for those (C speed) decide whether the member regexes, which
        # are slow, run at all. A trigger holding another is implied by it. (Shorter triggers,
        # such as the last three letters, matched common keys like "function" and were slower.)
        ends = {f.lower().encode() + q for f in config.fields for q in (b'"', b'\\"')}
        self._field_triggers = tuple(sorted(t for t in ends if not any(o != t and o in t for o in ends)))
        names = b"|".join(re.escape(f.encode()) for f in sorted(config.fields, key=len, reverse=True))
        # "name": "value" as a JSON member, or \"name\": \"value\" inside an encoded JSON string;
        # the value is everything up to the closing (escaped) quote, escapes included
        self._member = re.compile(rb'(?i)("(' + names + rb')"\s*:\s*")((?:[^"\\]|\\.)*)(")') if names else None
        self._escaped = (
            re.compile(rb'(?i)(\\"(' + names + rb')\\"\s*:\s*\\")((?:[^"\\]|\\[^"])*)(\\")') if names else None
        )

    def _field(self, match: re.Match) -> bytes:
        if not match.group(3):
            return match.group(0)  # an empty value hides nothing
        kind = match.group(2).decode().lower()
        self.counts[kind] += 1
        return match.group(1) + f"[REDACTED:{kind}]".encode() + match.group(4)

    def line(self, data: bytes) -> bytes:
        """``data`` (one line, UTF-8 JSON text) with every secret replaced."""
        if not self.config.enabled:
            return data
        lowered = data.lower()
        if self._member is not None and any(t in lowered for t in self._field_triggers):
            data = self._member.sub(self._field, data)
            data = self._escaped.sub(self._field, data)
        for kind, pattern in self._values:
            data, n = pattern.subn(f"[REDACTED:{kind}]".encode(), data)
            if n:
                self.counts[kind] += n
        return data


def redact_line(data: bytes, config: RedactionConfig = RedactionConfig()) -> tuple[bytes, dict[str, int]]:
    """One line redacted with ``config``, and the replacements per kind (for tests and tools;
    a file goes through one :class:`Redactor`)."""
    redactor = Redactor(config)
    return redactor.line(data), dict(redactor.counts)
