"""Secret redaction: keys, tokens, credentials and password-like fields out of a log's bytes before
anything of it is stored in the lake.

Agent logs carry secrets: keys in tool arguments, ``Authorization`` headers in HTTP tool outputs,
connection strings in configs, private keys in files an agent read, passwords typed into forms. A
batch's snapshot in the lake is written through a :class:`Redactor`, so every table built from it
(interaction logs, trajectories, steps, quarantine raw bytes, the UI's previews) holds
``[REDACTED:<kind>]`` in their place.

Two rules, both on the JSON text of each line (a record, or a line of a pretty-printed document):

1. **Values that look like secrets**, wherever they occur (:data:`DEFAULT_PATTERNS`): OpenAI and
   Anthropic keys ``sk-…``, Slack tokens ``xox?-…``, AWS access key ids ``AKIA…``/``ASIA…`` and
   AWS secret access keys by their context (``aws_secret_access_key = …``), GitHub tokens
   (``ghp_``/``gho_``/``ghu_``/``ghs_``/``ghr_``, ``github_pat_``), GitLab ``glpat-``, Google
   ``AIza…``, Stripe ``sk_live_``/``rk_live_``, npm ``npm_``, JWTs ``eyJ….….…``, PEM private key
   blocks (``-----BEGIN … PRIVATE KEY-----`` to its END line, escaped newlines and all), the
   ``user:password`` of a URL (``postgres://user:pw@host``) and ``Bearer …`` credentials. A
   pattern may name the part to replace ``(?P<secret>…)``; otherwise the whole match goes.
2. **String values of fields named like a secret**, as a JSON member ``"name": "value"`` or,
   inside a JSON-encoded string such as a tool call's ``arguments``, ``\\"name\\": \\"value\\"``:
   any field whose name *contains* one of :data:`DEFAULT_FIELDS` (case-insensitive:
   ``new_password``, ``user_password``, ``passphrase``, ``client_secret``, ``max_token``...),
   or *is* one of :data:`DEFAULT_EXACT_FIELDS` (``pass``, ``pwd``).

Only JSON strings are rewritten: numbers, nulls and arrays (``token_ids``, log-probs) are never
touched. Counting is per kind: the pattern's name, or the field's name in lower case.

Why one RE2 expression and not detect-secrets: every rule is one branch of a single regular
expression compiled by RE2 (``google-re2``), a DFA that reads each byte once whatever the number of
branches, so redaction is one pass over the text. Python's ``re`` tries every branch at every
candidate position (a combined expression of these rules ran at 6 MB/s on canonical JSONL; one
``re`` pass per rule, the previous design, 56 MB/s; RE2's one pass about 200 MB/s).
``detect-secrets``' plug-ins are run one regex per plug-in per line in Python and are tuned for
source code (its keyword plug-in flags any ``password = x`` in prose), so its patterns served as a
reference for the value rules here rather than as the scanner.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial

import re2

_TOKEN = r"[A-Za-z0-9_-]"
DEFAULT_PATTERNS: dict[str, str] = {
    "pem_private_key": (
        # key material holds no quote; escaped newlines (\n, or \\n in an encoded string) are
        # consumed as pairs, so the match ends at the END line or, if truncated, at the string's end
        r"-----BEGIN[A-Z ]{0,40}PRIVATE KEY-----(?:[^\"\\\n-]|\\[^\"\n]|-[^\"\\\n-])*(?:-----END[A-Z ]{0,40}PRIVATE KEY-----)?"
    ),
    "jwt": rf"eyJ{_TOKEN}{{10,}}\.{_TOKEN}{{4,}}\.{_TOKEN}*",
    "bearer": r"(?i:bearer)\s+[A-Za-z0-9._~+/=-]{8,}",
    # anchored on "://" (a scheme's letters would start a match attempt at every word)
    "url_credentials": r":(?:\\?/){2}(?P<secret>[^/\s:@\"\\]{1,200}:[^/\s@\"\\]{1,200})@",
    "aws_secret_key": (
        r"(?i:aws_?secret_?access_?key|aws_?secret_?key|secret_?access_?key)[\s\"'\\:=]{1,12}(?P<secret>[A-Za-z0-9/+]{40})"
    ),
    "openai_key": rf"sk-(?:proj-|ant-)?{_TOKEN}{{20,}}",
    "slack_token": r"xox[a-z]-[A-Za-z0-9-]{10,}",
    "aws_access_key": r"(?:AKIA|ASIA)[0-9A-Z]{16}\b",
    "github_token": r"gh[pousr]_[A-Za-z0-9]{30,}|github_pat_[A-Za-z0-9_]{22,}",
    "gitlab_token": rf"glpat-{_TOKEN}{{20,}}",
    "google_api_key": rf"AIza{_TOKEN}{{35}}",
    "stripe_key": r"[sr]k_live_[A-Za-z0-9]{20,}",
    "npm_token": r"npm_[A-Za-z0-9]{36}",
}
"""Kind → regular expression (RE2 syntax: no look-around, no back-references) of a secret value,
matched on the UTF-8 bytes; ``(?P<secret>…)`` marks the part replaced (default: all of it). A
match must not span a line end, since blocks of many lines are searched at once. Earlier kinds
win where two would match at the same place (a JWT after ``Bearer`` is one ``bearer``)."""

DEFAULT_FIELDS: tuple[str, ...] = (
    "password", "passwd", "passphrase", "secret", "token", "api_key", "apikey", "api-key",
    "credential", "private_key", "privatekey", "authorization",
)  # fmt: skip
"""Case-insensitive substrings: a field whose name contains one has its string value redacted."""

DEFAULT_EXACT_FIELDS: tuple[str, ...] = ("pass", "pwd", "pw")
"""Field names (case-insensitive, exact) whose string values are redacted: too short to match
as substrings (``pass`` is in ``passenger`` and ``passport``)."""


@dataclass(frozen=True)
class RedactionConfig:
    """What :class:`Redactor` replaces.

    Attributes:
        enabled: false turns redaction off (the opt-out; the snapshot is then the file's bytes).
        patterns: kind → RE2 regex of secret values (default :data:`DEFAULT_PATTERNS`).
        fields: substrings of field names whose string values are redacted (default
            :data:`DEFAULT_FIELDS`; case-insensitive).
        exact_fields: whole field names whose string values are redacted (default
            :data:`DEFAULT_EXACT_FIELDS`; case-insensitive).
    """

    enabled: bool = True
    patterns: Mapping[str, str] = field(default_factory=lambda: dict(DEFAULT_PATTERNS))
    fields: Sequence[str] = DEFAULT_FIELDS
    exact_fields: Sequence[str] = DEFAULT_EXACT_FIELDS


_RE2_MEMORY = 256 * 2**20  # bytes; an upper bound RE2 may use for its DFA cache, not an allocation
_KEY_CHAR = rb'[^"\\\n]'
# a value of an encoded member: escapes as pairs, ending at the escaped quote \"
_ENCODED_VALUE = rb'(?:[^"\\\n]|\\[^"\n])*'
_PLAIN_VALUE = rb'(?:[^"\\\n]|\\[^\n])*'


def _alternation(names: Iterable[str]) -> bytes:
    return b"|".join(re.escape(n.lower()).encode() for n in sorted(set(names), key=len, reverse=True))


def _field_branches(fields: Sequence[str], exact_fields: Sequence[str]) -> list[bytes]:
    """The member branches: plain ``"key": "value"`` and encoded ``\\"key\\": \\"value\\"``, with
    groups ``key``/``value`` (plain) and ``ekey``/``evalue`` (encoded)."""
    names = []
    if fields:
        names.append(_KEY_CHAR + b"*(?i:" + _alternation(fields) + b")" + _KEY_CHAR + b"*")
    if exact_fields:
        names.append(b"(?i:" + _alternation(exact_fields) + b")")
    if not names:
        return []
    key = b"|".join(names)
    return [
        rb'"(?P<key>' + key + rb')"[ \t]*:[ \t]*"(?P<value>' + _PLAIN_VALUE + rb')"',
        rb'\\"(?P<ekey>' + key + rb')\\"[ \t]*:[ \t]*\\"(?P<evalue>' + _ENCODED_VALUE + rb')\\"',
    ]


class Redactor:
    """Compiled :class:`RedactionConfig`: call :meth:`block` on runs of whole lines (or
    :meth:`line` on one); :attr:`counts` holds the replacements made so far per kind.

    Every rule is a branch of one RE2 expression (module docstring), so a block is read once
    however many rules there are; Python runs only at a match.

    Raises:
        ValueError: a pattern is not valid RE2 syntax (the message names its kind).
    """

    def __init__(self, config: RedactionConfig = RedactionConfig()):
        self.config = config
        self.counts: Counter[str] = Counter()
        branches: list[bytes] = []
        self._kinds: list[tuple[str, str]] = []  # (group of the branch, kind)
        for i, (kind, pattern) in enumerate(config.patterns.items()):
            source = pattern.encode()
            try:
                re2.compile(source)
            except re2.error as error:
                raise ValueError(f"redaction pattern {kind!r} ({pattern!r}) is not valid RE2: {error}") from None
            group = f"p{i}"
            branches.append(f"(?P<{group}>".encode() + source.replace(b"(?P<secret>", f"(?P<{group}_secret>".encode()) + b")")
            self._kinds.append((group, kind))
        branches += _field_branches(config.fields, config.exact_fields)
        options = re2.Options()
        options.max_mem = _RE2_MEMORY  # room for the DFA of every branch at once (else RE2 falls back to slower engines)
        self._regex = re2.compile(b"|".join(branches), options) if branches else None
        index = {(k.decode() if isinstance(k, bytes) else k): v for k, v in (self._regex.groupindex if self._regex is not None else {}).items()}
        # (group whose presence says which branch matched, group replaced, kind or None: the key names it)
        self._branches: list[tuple[int, int, int | None, str | None]] = [
            (index[key], index[value], index[key], None)
            for key, value in (("key", "value"), ("ekey", "evalue"))
            if key in index
        ]
        for group, kind in self._kinds:
            secret = index.get(f"{group}_secret")
            self._branches.append((index[group], index[group] if secret is None else secret, None, kind))

    def _replacement(self, match) -> tuple[int, int, str] | None:
        """``(start, end, kind)`` of the bytes to replace in a match, or ``None`` (an empty value,
        or a secret group that took no part)."""
        for branch, replaced, key, kind in self._branches:
            if match.start(branch) < 0:
                continue
            start, end = match.span(replaced)
            if start == end:
                return None  # an empty value hides nothing
            if kind is None:
                kind = match.group(key).decode("utf-8", "replace").lower()
            return start, end, kind
        return None  # not reached: every match is of some branch

    def block(self, data: bytes) -> bytes:
        """``data`` (whole lines of UTF-8 JSON text, ``\\n``-separated) with every secret replaced;
        the bytes between secrets, line ends included, are unchanged."""
        if not self.config.enabled or self._regex is None:
            return data
        parts: list[bytes] = []
        done = 0
        for match in self._regex.finditer(data):
            found = self._replacement(match)
            if found is None:
                continue
            start, end, kind = found
            parts += [data[done:start], f"[REDACTED:{kind}]".encode()]
            done = end
            self.counts[kind] += 1
        if not parts:
            return data
        parts.append(data[done:])
        return b"".join(parts)

    line = block  # a line is a block of one

    def stream(self, blocks: Iterable[bytes], workers: int = 1) -> Iterator[bytes]:
        """Each of ``blocks`` (whole lines) redacted, in order; :attr:`counts` grows as they are
        yielded. With ``workers`` > 1 the blocks are redacted by that many processes
        (:func:`~flow_assets.logs.chunks.ordered_map`: bounded memory, order kept).

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


# A worker process compiles each configuration once, not once per block (RE2 builds its DFA
# lazily, so a fresh expression per block would also rebuild it).
_COMPILED: dict[tuple, Redactor] = {}


def redact_block(config: RedactionConfig, data: bytes) -> tuple[bytes, dict[str, int]]:
    """``data`` (whole lines) redacted with ``config``, and the replacements per kind: the unit
    of work of :meth:`Redactor.stream`'s worker processes."""
    key = (config.enabled, tuple(config.patterns.items()), tuple(config.fields), tuple(config.exact_fields))
    redactor = _COMPILED.get(key)
    if redactor is None:
        redactor = _COMPILED[key] = Redactor(config)
    redactor.counts = Counter()
    return redactor.block(data), dict(redactor.counts)


def redact_line(data: bytes, config: RedactionConfig = RedactionConfig()) -> tuple[bytes, dict[str, int]]:
    """One line redacted with ``config``, and the replacements per kind (for tests and tools;
    a file goes through one :class:`Redactor`)."""
    redactor = Redactor(config)
    return redactor.line(data), dict(redactor.counts)
