"""Tool calls out of a completion's text, as OpenAI ``tool_calls``.

The policy writes tool calls as text in the syntax its chat template renders them in; the
gateway parses them back so the agent receives OpenAI's structured ``tool_calls``. Two syntaxes:

- ``compact`` (the tiny model's :data:`~flow_assets.policy.chat.COMPACT_CHAT_TEMPLATE`):
  ``@name(argument)`` or ``@name({"a": 1, "b": 2})``, one or more, after any text. A bare argument
  (parentheses inside it balanced, as in ``@calculator(12*(3+4))``) is the value of the tool's
  first required parameter (as declared in the request's ``tools``); a JSON object is the
  arguments as they are.
- ``hermes`` (Hermes, Qwen 2.5 / 3 and vLLM's ``hermes`` parser): ``<tool_call>{"name": ...,
  "arguments": {...}}</tool_call>`` blocks; the text outside them is the content. A block's JSON
  is read as JSON, so a string in it may contain ``</tool_call>`` (vLLM's parser ends the block
  at the first one).

A completion whose call syntax does not parse (a tool that was not offered, malformed JSON, an
unclosed ``<tool_call>``) is returned as plain content with the reason in
:attr:`ParsedCompletion.error`: the agent then sees what the policy wrote, the rollout's outcome
judges it, and the gateway logs the reason with the turn (a learning signal, not a server error).
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

ToolCallFormat = Literal["compact", "hermes"]

_COMPACT = re.compile(r"@([A-Za-z_][A-Za-z0-9_.-]*)\(")
_HERMES = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


@dataclass(frozen=True)
class ToolCall:
    """One parsed call. ``arguments`` is the JSON text OpenAI's API carries (an object)."""

    name: str
    arguments: str


@dataclass(frozen=True)
class ParsedCompletion:
    """A completion split into its text ``content`` (``None`` when only calls) and ``tool_calls``;
    ``error`` says why text that attempts a call did not parse (then ``content`` is the whole
    text and there are no calls)."""

    content: str | None
    tool_calls: tuple[ToolCall, ...] = ()
    error: str | None = None


def _first_parameter(tools: Sequence[dict[str, Any]], name: str) -> str | None:
    for tool in tools:
        function = tool.get("function") or {}
        if function.get("name") == name:
            properties = (function.get("parameters") or {}).get("properties") or {}
            required = (function.get("parameters") or {}).get("required") or []
            return (required or list(properties) or [None])[0]
    return None


def _closing_paren(body: str) -> int:
    """Index of the ``)`` that closes a call whose ``(`` precedes ``body`` (nesting counted), or -1."""
    depth = 0
    for i, ch in enumerate(body):
        if ch == "(":
            depth += 1
        elif ch == ")":
            if depth == 0:
                return i
            depth -= 1
    return -1


def _parse_compact(text: str, tools: Sequence[dict[str, Any]]) -> ParsedCompletion:
    match = _COMPACT.search(text)
    if match is None:
        return ParsedCompletion(text)
    if not text.rstrip().endswith(")"):
        return ParsedCompletion(text, error=f"call of {match.group(1)!r} is not closed")
    content, calls, rest = text[: match.start()], [], text[match.start() :].rstrip()
    offered = {(t.get("function") or {}).get("name") for t in tools}
    while rest:
        m = _COMPACT.match(rest)
        if m is None:
            return ParsedCompletion(text, error=f"text after a call: {rest[:40]!r}")
        if m.group(1) not in offered:
            return ParsedCompletion(text, error=f"tool {m.group(1)!r} was not offered")
        name, body = m.group(1), rest[m.end() :]
        if body.startswith("{"):
            try:
                args, end = json.JSONDecoder().raw_decode(body)
            except json.JSONDecodeError as exc:
                return ParsedCompletion(text, error=f"arguments of {name!r} are not JSON: {exc}")
            if not isinstance(args, dict) or body[end : end + 1] != ")":
                return ParsedCompletion(text, error=f"arguments of {name!r} are not one JSON object")
            rest = body[end + 1 :]
        else:
            end = _closing_paren(body)
            parameter = _first_parameter(tools, name)
            if end < 0 or parameter is None:
                return ParsedCompletion(text, error=f"call of {name!r} is not closed or the tool has no parameter")
            args, rest = {parameter: body[:end]}, body[end + 1 :]
        calls.append(ToolCall(name, json.dumps(args, ensure_ascii=False)))
    return ParsedCompletion(content or None, tuple(calls))


_HERMES_CLOSE = re.compile(r"\s*</tool_call>")


def _hermes_blocks(text: str) -> list[tuple[int, int, str]]:
    """The ``<tool_call>`` blocks of ``text`` as ``(start, end, body)``: a body that is one JSON
    value followed by ``</tool_call>`` ends after that value, so a string inside it may hold
    ``</tool_call>`` itself (which a constrained call's JSON may: SmolLM2 wrote it into a
    calculator ``expression``); any other body ends at the first ``</tool_call>``."""
    blocks, at = [], 0
    while (start := text.find("<tool_call>", at)) >= 0:
        body = start + len("<tool_call>")
        body += len(text[body:]) - len(text[body:].lstrip())
        try:
            _, end = json.JSONDecoder().raw_decode(text, body)
        except json.JSONDecodeError:
            end = -1
        close = _HERMES_CLOSE.match(text, end) if end >= 0 else None
        if close is not None:
            blocks.append((start, close.end(), text[body:end]))
        elif (block := _HERMES.match(text, start)) is not None:
            blocks.append((start, block.end(), block.group(1)))
        else:
            break
        at = blocks[-1][1]
    return blocks


def _parse_hermes(text: str, tools: Sequence[dict[str, Any]]) -> ParsedCompletion:
    blocks = _hermes_blocks(text)
    if not blocks:
        return ParsedCompletion(text, error="<tool_call> is not closed" if "<tool_call>" in text else None)
    offered = {(t.get("function") or {}).get("name") for t in tools}
    calls = []
    for k, (_, _, body) in enumerate(blocks, start=1):
        try:
            call = json.loads(body)
        except json.JSONDecodeError as exc:
            return ParsedCompletion(text, error=f"<tool_call> {k} is not JSON: {exc}")
        if not isinstance(call, dict) or call.get("name") not in offered:
            name = call.get("name") if isinstance(call, dict) else None
            return ParsedCompletion(text, error=f"<tool_call> {k} names tool {name!r}, which was not offered")
        args = call.get("arguments", {})
        if isinstance(args, str):
            try:
                args = json.loads(args)
            except json.JSONDecodeError as exc:
                return ParsedCompletion(text, error=f"<tool_call> {k}: arguments are not JSON: {exc}")
        if not isinstance(args, dict):
            return ParsedCompletion(text, error=f"<tool_call> {k}: arguments are not a JSON object")
        calls.append(ToolCall(call["name"], json.dumps(args, ensure_ascii=False)))
    content = "".join(text[a:b] for a, b in zip([0] + [end for _, end, _ in blocks], [start for start, _, _ in blocks] + [len(text)])).strip()
    return ParsedCompletion(content or None, tuple(calls))


_COMPACT_OPEN = re.compile(r"@(?:[A-Za-z_][A-Za-z0-9_.-]*)?")
_HERMES_OPEN = "<tool_call>"


def call_start(text: str, fmt: ToolCallFormat) -> int | None:
    """Where a tool call starts in a completion that may still grow (a stream): the index of the
    first call :func:`parse_tool_calls` would find, or of the first place one could begin once more
    text comes (``@calc`` at the end in ``compact``, ``<tool_`` at the end in ``hermes``); ``None``
    when no call can start before the end. Text before it is the same in the final ``content``
    whatever follows (``hermes`` strips the content around calls: the caller holds leading and
    trailing whitespace).

    Raises:
        ValueError: unknown ``fmt``.
    """
    if fmt == "compact":
        start = text.find("@")
        while start >= 0:
            if _COMPACT.match(text, start) or _COMPACT_OPEN.fullmatch(text, start):
                return start
            start = text.find("@", start + 1)
        return None
    if fmt == "hermes":
        start = text.find(_HERMES_OPEN)
        if start >= 0:
            return start
        for k in range(min(len(_HERMES_OPEN) - 1, len(text)), 0, -1):
            if text.endswith(_HERMES_OPEN[:k]):
                return len(text) - k
        return None
    raise ValueError(f"unknown tool-call format {fmt!r} (expected 'compact' or 'hermes')")


def parse_tool_calls(text: str, fmt: ToolCallFormat, tools: Sequence[dict[str, Any]] | None) -> ParsedCompletion:
    """Split a completion's text into content and the tool calls it makes.

    Args:
        text: the completion, decoded without special tokens.
        fmt: the policy's call syntax (module docstring).
        tools: the request's ``tools`` (OpenAI function specifications); without any, nothing
            is parsed as a call.

    Returns:
        :class:`ParsedCompletion`; ``tool_calls`` is empty when the text makes no valid call, and
        ``error`` is set when it attempts one that does not parse.

    Raises:
        ValueError: unknown ``fmt``.
    """
    if fmt not in ("compact", "hermes"):
        raise ValueError(f"unknown tool-call format {fmt!r} (expected 'compact' or 'hermes')")
    if not tools:
        return ParsedCompletion(text)
    return _parse_compact(text, tools) if fmt == "compact" else _parse_hermes(text, tools)
