"""Constrained decoding: grammars for ``response_format`` and ``tool_choice``, enforced token by
token with llguidance.

OpenAI's Chat Completions API lets a caller demand a shape of the completion: ``response_format``
``{"type": "json_schema", "json_schema": {"name", "schema", "strict"}}`` (valid JSON matching the
schema), ``{"type": "json_object"}`` (any JSON object), and ``tool_choice`` ``"required"`` (one
or more tool calls of the offered tools) or ``{"type": "function", "function": {"name"}}`` (a call
of that tool). (OpenAI API reference, "Create chat completion",
https://platform.openai.com/docs/api-reference/chat/create.) The gateway honours them by
constrained decoding: at every step the sampler may only pick tokens after which the text can
still be completed into a string of the grammar (the token mask), and the completion ends when
the grammar is complete.

The masks come from llguidance (https://github.com/guidance-ai/llguidance: an Earley parser over a
lexer, ~50 us of CPU per mask for a 128k vocabulary), given a grammar in its JSON-schema or Lark
syntax (https://github.com/guidance-ai/llguidance/blob/main/docs/syntax.md; ``%json {schema}``
embeds a JSON schema in a Lark rule). :class:`ConstraintCompiler` turns a request's fields into a
:class:`Constraint` (the compiled grammar, checked once); every decoded row gets its own
:class:`llguidance.LLMatcher` from it (:meth:`Constraint.matcher`), which
:class:`~flow_assets.policy.decode.RowDecoder` asks for the allowed tokens
(:func:`allowed_tokens`) before each draw and hands each sampled token.

Tool calls are constrained to the policy's OWN call syntax
(:mod:`flow_assets.policy.tool_calls`), so :func:`~flow_assets.policy.tool_calls.parse_tool_calls`
reads them back as it reads unconstrained ones:

- ``compact``: ``@name(<arguments>)``, the arguments either a JSON object matching the tool's
  ``parameters`` or, for a tool whose only required parameter is a plain string (the calculator's
  ``expression``), the bare string with balanced parentheses (``@calculator(12*(3+4))``), which is
  what the parser maps to that parameter. Calls follow each other without separator.
- ``hermes``: ``<tool_call>{"name": <name>, "arguments": <object>}</tool_call>``, the object
  matching the named tool's ``parameters``, an optional newline inside the tags and between calls.

JSON layout. Every JSON the grammars allow is laid out as ``json.dumps`` lays it out: ``", "``
between items, ``": "`` after keys, no other whitespace (:data:`JSON_LAYOUT`; llguidance's own
default allows any whitespace run between tokens, and a sampled policy, the tiny model at T = 1
for one, then writes runs of tabs and newlines until ``max_tokens`` cuts the JSON). A schema's own
``"x-guidance"`` options (llguidance's JSON compile options) override it.

A tool whose name the syntax cannot carry (``compact`` names match ``[A-Za-z_][A-Za-z0-9_.-]*``)
is refused (:class:`ConstraintError` naming ``tool_choice``).

Closing within ``max_tokens``. A grammar does not make the text end in time: SmolLM2-135M at T = 1
forced to call the calculator wrote ``expression`` strings until ``max_tokens`` cut the call (8
of 50 at 64 tokens). Each row therefore gets a :class:`ClosingBudget`: near the end of its budget
it keeps a completion of the grammar from where the row is (:func:`find_closing`: a search over
the single-byte tokens the matcher allows, each step validated by the matcher, the result
re-tokenized), and restricts the mask so that the row always still fits one; when the completion
needs every token left, only its tokens are allowed. This uses only the matcher's own API
(``compute_ff_tokens``, ``compute_bitmask``, ``consume_token`` / ``rollback``), so it is the same for
both call syntaxes and for JSON; it knows no closer of any syntax beyond trying :data:`CLOSING_BYTES`
first.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from flow_assets.policy.tool_calls import ToolCallFormat

if TYPE_CHECKING:  # llguidance and transformers load when the first constrained call comes
    import llguidance
    from transformers import PreTrainedTokenizerBase

_COMPACT_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_.-]*")
#: schema keywords that leave a string parameter a plain string (anything else constrains it, so
#: a bare ``compact`` argument could break it)
_PLAIN_KEYS = {"type", "description", "title"}
_OBJECT_KEYS = {"type", "properties", "required", "additionalProperties", "description", "title"}
#: llguidance JSON compile options: the layout of ``json.dumps`` (module docstring)
JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class ConstraintError(ValueError):
    """A request's ``response_format`` or ``tool_choice`` cannot be enforced; ``param`` names the
    field (the gateway answers 400 with it)."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class Constraint:
    """What one call's completions must be: a compiled llguidance grammar.

    Attributes:
        kind: what it enforces, recorded with the captured turn: ``"json_schema"``,
            ``"json_object"``, ``"tool_choice:required"`` or ``"tool_choice:function"``.
        grammar: the llguidance grammar (its serialised JSON form).
        prototype: a matcher at the grammar's start, never advanced; rows get copies of it.
        bytes_: the policy's single-byte tokens (:class:`ByteTokens`), what :func:`find_closing`
            searches over.
        start: a shortest-found completion of the whole grammar (:func:`find_closing` from the
            start; ``None``: none found within :data:`CLOSING_SEARCH_NODES`).
    """

    kind: str
    grammar: str
    prototype: Any  # llguidance.LLMatcher
    bytes_: ByteTokens | None = None
    start: Closing | None = None

    def matcher(self) -> llguidance.LLMatcher:
        """A fresh matcher for one row (a copy of the compiled prototype: no recompilation)."""
        return self.prototype.deep_copy()

    def budget(self) -> ClosingBudget | None:
        """A fresh :class:`ClosingBudget` for one row (``None`` when no completion of the grammar
        was found: such a row decodes as without one)."""
        if self.bytes_ is None or self.start is None:
            return None
        return ClosingBudget(self.bytes_, self.start)


#: closing bytes :func:`find_closing` tries first, in this order, before any other byte the grammar
#: allows: what ends a bracket or a string, and the shortest JSON value
CLOSING_BYTES = b')]}0"'
#: the budget starts watching a row when its remaining tokens are at most this many more than the
#: last completion found needs (:class:`ClosingBudget`)
BUDGET_WATCH = 16
#: choice points one :func:`find_closing` search may visit before it gives up
CLOSING_SEARCH_NODES = 64
#: most tokens of the completion searched from a grammar's start (:attr:`Constraint.start`)
START_CLOSING_LIMIT = 512


@dataclass(frozen=True)
class ByteTokens:
    """A tokenizer's tokens of exactly one byte, for :func:`find_closing`.

    Attributes:
        ids: ``[k]`` int64 token ids, ordered by their byte.
        preferred: the ids of :data:`CLOSING_BYTES` that exist, in that order.
        tokenizer: llguidance's view of the tokenizer (decodes and re-tokenizes a completion).
    """

    ids: np.ndarray
    preferred: tuple[int, ...]
    tokenizer: Any  # llguidance.LLTokenizer

    @classmethod
    def of(cls, tokenizer: llguidance.LLTokenizer) -> ByteTokens:
        """The single-byte tokens of ``tokenizer``: for each byte value, the token it tokenizes to
        alone if that token decodes to exactly that byte (byte-level BPE has all 256, a character
        tokenizer its ASCII characters). Takes ~256 tokenizer calls."""
        found: dict[int, int] = {}
        for b in range(256):
            try:
                ids = tokenizer.tokenize_bytes(bytes([b]))
            except (ValueError, UnicodeDecodeError):
                continue
            if len(ids) == 1 and tokenizer.decode_bytes(ids) == bytes([b]):
                found[b] = ids[0]
        preferred = tuple(found[b] for b in CLOSING_BYTES if b in found)
        return cls(np.array([found[b] for b in sorted(found)], dtype=np.int64), preferred, tokenizer)


@dataclass(frozen=True)
class Closing:
    """A way to end a constrained completion from a matcher's current state.

    Attributes:
        tokens: the token ids to sample, in order.
        end: whether an end token must follow them (the grammar is then complete but could go
            on, e.g. another call); ``False``: the grammar is finished after them (its matcher
            stops, and the decoder ends the row by itself).
    """

    tokens: tuple[int, ...]
    end: bool

    @property
    def need(self) -> int:
        """Tokens it takes: ``len(tokens) + end``."""
        return len(self.tokens) + self.end

    def first(self, end_token: int) -> int:
        """The next token of it: ``tokens[0]``, or ``end_token`` when only the end is left.

        Raises:
            IndexError: nothing is left (``need == 0``).
        """
        if self.tokens:
            return self.tokens[0]
        if self.end:
            return end_token
        raise IndexError("an empty closing has no next token")

    def advanced(self) -> Closing:
        """It after its first token was sampled."""
        return Closing(self.tokens[1:], self.end) if self.tokens else Closing((), False)


def _signature(matcher: Any) -> tuple[bytes, bool]:
    return matcher.compute_bitmask(), matcher.is_accepting()


def find_closing(matcher: Any, bytes_: ByteTokens, limit: int, max_nodes: int = CLOSING_SEARCH_NODES) -> Closing | None:
    """A short sequence of tokens that completes ``matcher``'s grammar from its current state in
    at most ``limit`` tokens (the end token counted when one is needed), or ``None``.

    Depth-first search over what the matcher allows, every step validated by the matcher: forced
    tokens (:meth:`llguidance.LLMatcher.compute_ff_tokens`) are taken as they are; at a choice
    point the single-byte tokens are tried in this order: those of :data:`CLOSING_BYTES` after
    which the matcher's state visibly changes (its token mask or whether it accepts: a closing
    quote in a string, a ``}`` that ends an object), the other ones of :data:`CLOSING_BYTES`
    (a ``)`` that closes a nested parenthesis changes nothing visible), then every other allowed
    single byte by byte value. The first completion found is kept (not necessarily the shortest;
    it is a valid one), then re-tokenized as the tokenizer would write its text, which is kept
    if the matcher accepts it and it is shorter (``"}}`` as one or two tokens, not three).

    Args:
        matcher: an llguidance ``LLMatcher`` (not in an error state). Left as it was: the search
            consumes tokens and rolls them back.
        bytes_: the tokenizer's single-byte tokens.
        limit: most tokens, ``>= 0``.
        max_nodes: most choice points visited (each costs ``len(CLOSING_BYTES) + 1`` token masks
            at most); past it the search gives up.

    Returns:
        The :class:`Closing`, or ``None`` when none was found within ``limit`` and ``max_nodes``.
    """
    if matcher.is_error():
        return None
    path: list[int] = []
    nodes = [0]

    def search() -> Closing | None:
        if matcher.is_stopped():
            return Closing(tuple(path), False)
        if matcher.is_accepting():
            return Closing(tuple(path), True) if len(path) < limit else None
        if len(path) >= limit:
            return None
        forced = matcher.compute_ff_tokens()
        if forced:
            taken = 0 if len(path) + len(forced) > limit else matcher.try_consume_tokens(forced)
            if taken < len(forced):
                matcher.rollback(taken)
                return None
            path.extend(forced)
            try:
                return search()
            finally:
                del path[-len(forced) :]
                matcher.rollback(len(forced))
        nodes[0] += 1
        if nodes[0] > max_nodes:
            return None
        here = _signature(matcher)
        words = np.frombuffer(here[0], dtype="<u4")
        ids = bytes_.ids
        allowed = ids[((words[ids >> 5] >> (ids & 31).astype(np.uint32)) & 1) == 1].tolist()
        changing, same = [], []
        for token in bytes_.preferred:
            if token in allowed and matcher.try_consume_tokens([token]) == 1:
                (changing if _signature(matcher) != here else same).append(token)
                matcher.rollback(1)
        tried = set(changing + same)
        for token in changing + same + [t for t in allowed if t not in tried]:
            if matcher.try_consume_tokens([token]) != 1:  # (never puts the matcher in an error state)
                continue
            path.append(token)
            try:
                found = search()
            finally:
                path.pop()
                matcher.rollback(1)
            if found is not None or nodes[0] > max_nodes:
                return found
        return None

    try:
        found = search()
    except RecursionError:  # a completion longer than Python's stack: none found
        return None
    if found is None or len(found.tokens) < 2:
        return found
    retokenized = tuple(bytes_.tokenizer.tokenize_bytes(bytes_.tokenizer.decode_bytes(list(found.tokens))))
    if len(retokenized) < len(found.tokens):
        again = check_closing(matcher, Closing(retokenized, found.end))
        if again is not None and again.need <= found.need:
            return again
    return found


def check_closing(matcher: Any, closing: Closing) -> Closing | None:
    """``closing``'s tokens as a completion from ``matcher``'s current state (which they may no
    longer complete after the matcher took other tokens): the :class:`Closing` they make from
    here (``end`` as the state after them needs), or ``None`` when they do not complete the
    grammar. ``matcher`` is left as it was."""
    tokens = list(closing.tokens)
    taken = matcher.try_consume_tokens(tokens)
    stopped, accepting = matcher.is_stopped(), matcher.is_accepting()
    matcher.rollback(taken)
    if taken < len(tokens) or not (stopped or accepting):
        return None
    return Closing(closing.tokens, not stopped)


class ClosingBudget:
    """Keeps a constrained row able to complete its grammar within its ``max_tokens``.

    Without it a row decodes its grammar until ``max_tokens`` cuts it, e.g. inside a string the
    policy never closes. With it the row always holds a :class:`Closing` (a way to complete from
    where it is, validated by its matcher) whose ``need`` fits the tokens it has left, ``r``:

    - before a draw (:meth:`forced`): when ``need == r``, the only token allowed is the closing's
      next one (its log-prob is then 0), so the row ends in time;
    - after a free draw (:meth:`accept`): a token that leaves no completion within ``r - 1``
      tokens is refused (the decoder draws again without it, at most :data:`REDRAWS` times, then
      forces the closing's next token). The closing is kept when the token is its next one or
      its tokens still complete the grammar after the token (more text inside a string), else
      searched again (:func:`find_closing`).

    Cost: none while ``r > need + BUDGET_WATCH`` (``need`` of the last closing known; the closing
    is then dropped at the first token off it, and searched again when the row comes within
    :data:`BUDGET_WATCH` of it); within it, a check of the closing's tokens per token and a search
    when they no longer complete. A row for which no completion fits ``r`` when it is searched
    (``max_tokens`` below the shortest completion, or the completion grew by more than
    :data:`BUDGET_WATCH` tokens while not watched) decodes as without a budget, and ends at
    ``max_tokens`` (``finish_reason`` ``"length"``) unless it completes by itself.

    Args:
        bytes_: the tokenizer's single-byte tokens.
        start: a completion from the matcher's start state (:attr:`Constraint.start`).
    """

    REDRAWS = 3

    def __init__(self, bytes_: ByteTokens, start: Closing):
        self.bytes_ = bytes_
        self.closing: Closing | None = start  # valid from the row's current state; None: unknown
        self.hint = start.need  # need of the last closing known
        self.off = False  # no completion fitted: the row decodes as without a budget

    def watching(self, remaining: int) -> bool:
        """Whether a row with ``remaining`` tokens left is within :data:`BUDGET_WATCH` of its
        last known completion (and the budget is on)."""
        return not self.off and remaining <= self.hint + BUDGET_WATCH

    def forced(self, matcher: Any, remaining: int, end_token: int) -> int | None:
        """The token the row must sample next so that it completes within ``remaining`` tokens
        (``>= 1``, including this one), or ``None`` when it may sample any token its matcher
        allows. Searches a completion when the row comes within :data:`BUDGET_WATCH` of the
        last one without knowing one from here; switches the budget off when none fits."""
        if not self.watching(remaining):
            return None
        if self.closing is None:
            self.closing = find_closing(matcher, self.bytes_, remaining)
            if self.closing is None:
                self.off = True
                return None
            self.hint = self.closing.need
        if self.closing.need > remaining:
            self.off, self.closing = True, None
            return None
        return self.closing.first(end_token) if self.closing.need == remaining else None

    def accept(self, matcher: Any, token: int, remaining: int, end_token: int) -> bool:
        """Whether the row may take ``token`` (drawn freely, not yet consumed by ``matcher``) and
        still complete within the ``remaining`` tokens after it; keeps the closing from the state
        after it. The end token is always accepted (the matcher allows it only when its grammar
        is complete)."""
        if self.off or token == end_token:
            return True
        closing = self.closing
        if closing is not None and closing.need and closing.first(end_token) == token:
            self.closing = closing.advanced()
            self.hint = self.closing.need
            return True
        if not self.watching(remaining + 1):
            self.closing = None  # off the closing, far from the end: found again when needed
            return True
        if not matcher.consume_token(token):
            return True  # the decoder reports the matcher's error
        try:
            found = check_closing(matcher, closing) if closing is not None else None
            if found is None or found.need > remaining:
                found = find_closing(matcher, self.bytes_, remaining)
        finally:
            matcher.rollback(1)
        if found is None:
            return False
        self.closing, self.hint = found, found.need
        return True


def allowed_tokens(matchers: Sequence[Any], vocab: int) -> np.ndarray:
    """The tokens each matcher allows next.

    Args:
        matchers: ``k`` llguidance ``LLMatcher`` s (one per constrained row).
        vocab: the width of the logits (``>=`` the tokenizer's vocabulary; ids beyond it are never
            allowed).

    Returns:
        ``[k, vocab]`` bool. A matcher in an error state allows nothing (llguidance's mask is
        empty then); the caller decides what such a row does.
    """
    import llguidance.numpy as llg_np

    width = max(vocab, 1)
    bitmask = llg_np.allocate_token_bitmask(len(matchers), width)
    for i, m in enumerate(matchers):
        llg_np.fill_next_token_bitmask(m, bitmask, i)
    # bit j of 32-bit word w is token 32 w + j; on a little-endian machine that is bit j % 8 of
    # byte 4 w + j // 8, which unpackbits(bitorder="little") puts at position 32 w + j
    bits = np.unpackbits(bitmask.astype("<i4").view(np.uint8), axis=1, bitorder="little")
    return bits[:, :vocab].astype(bool)


def ll_tokenizer(tokenizer: PreTrainedTokenizerBase, vocab_size: int) -> llguidance.LLTokenizer:
    """llguidance's view of a Hugging Face tokenizer.

    A fast tokenizer whose ``tokenizer.json`` llguidance reads (byte-level BPE, SentencePiece:
    SmolLM2, Qwen, Llama) goes through :func:`llguidance.hf.from_tokenizer`. Others (the tiny
    model's character tokenizer, whose ``Fuse`` decoder llguidance does not know) are described
    token by token through :class:`llguidance.TokenizerWrapper`: each id's text is
    ``decode([id])``, which is exact for vocabularies whose tokens decode on their own (character
    or word level), not for byte-level BPE (which llguidance reads itself).

    Args:
        tokenizer: the policy's tokenizer.
        vocab_size: the width of the model's logits (may exceed the tokenizer's vocabulary).
    """
    import llguidance
    import llguidance.hf

    n_vocab = max(vocab_size, len(tokenizer))
    try:
        return llguidance.hf.from_tokenizer(tokenizer, n_vocab=n_vocab)
    except ValueError:
        pass  # a decoder llguidance cannot read: described token by token below
    special = set(tokenizer.all_special_ids)

    class _Tokens:
        eos_token_id = tokenizer.eos_token_id
        bos_token_id = tokenizer.bos_token_id
        special_token_ids = sorted(special)
        tokens = [
            (tokenizer.convert_ids_to_tokens(i) if i in special else tokenizer.decode([i])).encode("utf-8")
            for i in range(len(tokenizer))
        ]

        def __call__(self, text: str) -> list[int]:
            return tokenizer.encode(text, add_special_tokens=False)

    return llguidance.LLTokenizer(llguidance.TokenizerWrapper(_Tokens()), n_vocab=n_vocab)


def _lark_string(text: str) -> str:
    """A Lark string literal of ``text`` (JSON's escapes are Lark's)."""
    return json.dumps(text)


def _parameters(tool: dict[str, Any]) -> dict[str, Any]:
    """A tool's ``parameters`` as the grammar enforces them: an object schema that does not say
    otherwise admits only its declared properties (``additionalProperties: false``, as OpenAI's
    strict function calling makes it). JSON Schema's default admits any other key, and a small
    model forced to call a tool then writes keys until ``max_tokens`` cuts the call: SmolLM2-135M
    at T = 1 on word problems with the calculator tool made 32 valid calls of 50 at 64 tokens
    without this, 42 with it (the 8 others cut inside an ``expression`` string it never closed;
    40 of 50 at 256 tokens, all 10 cut the same way)."""
    parameters = (tool.get("function") or {}).get("parameters")
    if not (isinstance(parameters, dict) and parameters):
        return {"type": "object"}
    if parameters.get("type") == "object" and "additionalProperties" not in parameters:
        return {**parameters, "additionalProperties": False}
    return parameters


def _laid_out(schema: dict[str, Any]) -> dict[str, Any]:
    """``schema`` with :data:`JSON_LAYOUT` as its ``x-guidance`` options (its own ones win): how
    a ``%json`` schema inside a Lark grammar gets compile options."""
    own = schema.get("x-guidance")
    return {**schema, "x-guidance": {**JSON_LAYOUT, **(own if isinstance(own, dict) else {})}}


def _bare_parameter(parameters: dict[str, Any]) -> str | None:
    """The parameter a bare ``compact`` argument fills when ``{that parameter: any string}`` is
    always valid arguments (the same choice as the parser's: the first required parameter, else
    the first property), else ``None``."""
    if set(parameters) - _OBJECT_KEYS or parameters.get("type") != "object":
        return None
    properties = parameters.get("properties") or {}
    required = parameters.get("required") or []
    name = (required or list(properties) or [None])[0]
    if name is None or set(required) - {name} or not isinstance(properties.get(name), dict):
        return None
    prop = properties[name]
    return name if prop.get("type") == "string" and not set(prop) - _PLAIN_KEYS else None


class ConstraintCompiler:
    """Builds the :class:`Constraint` of a request's ``response_format`` / ``tool_choice`` for one
    policy (module docstring). Compiles on the caller's thread (a few milliseconds for the
    grammars of ordinary tools and schemas).

    Args:
        tokenizer: the policy's tokenizer.
        vocab_size: the width of its logits.
        tool_format: the policy's tool-call syntax (``"compact"`` or ``"hermes"``).
    """

    def __init__(self, tokenizer: PreTrainedTokenizerBase, vocab_size: int, tool_format: ToolCallFormat):
        self.tokenizer = ll_tokenizer(tokenizer, vocab_size)
        self.bytes_ = ByteTokens.of(self.tokenizer)
        self.tool_format = tool_format

    def _compile(self, kind: str, grammar: str, param: str) -> Constraint:
        import llguidance

        error = llguidance.LLMatcher.validate_grammar(grammar, self.tokenizer)
        if error:
            raise ConstraintError(f"{param} cannot be enforced: {error.splitlines()[0]}", param)
        prototype = llguidance.LLMatcher(self.tokenizer, grammar, log_level=0)
        if prototype.is_error():
            raise ConstraintError(f"{param} cannot be enforced: {prototype.get_error().splitlines()[0]}", param)
        return Constraint(kind, grammar, prototype, self.bytes_, find_closing(prototype, self.bytes_, START_CLOSING_LIMIT))

    def response_format(self, spec: dict[str, Any] | None) -> Constraint | None:
        """The constraint of a ``response_format`` (``None`` for none or ``{"type": "text"}``).
        A ``json_schema`` without ``schema`` constrains to any JSON value (the empty schema).

        Raises:
            ConstraintError: the schema is not one llguidance can enforce (an unsupported keyword,
                an invalid schema); ``param`` ``response_format.json_schema.schema``.
        """
        import llguidance

        if not spec or spec.get("type") == "text":
            return None
        if spec["type"] == "json_object":
            grammar = llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_LAYOUT)
            return self._compile("json_object", grammar, "response_format")
        schema = spec["json_schema"].get("schema", {})
        param = "response_format.json_schema.schema"
        try:
            grammar = llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_LAYOUT)
        except ValueError as exc:
            raise ConstraintError(f"{param} cannot be enforced: {exc}", param) from exc
        return self._compile("json_schema", grammar, param)

    def tool_choice(self, choice: str | dict[str, Any] | None, tools: Sequence[dict[str, Any]] | None, parallel: bool = True) -> Constraint | None:
        """The constraint of a ``tool_choice`` (``None`` for none, ``"none"`` or ``"auto"``): the
        completion is one tool call (one or more with ``parallel``) in the policy's syntax, of any
        offered tool (``"required"``) or of the named one, with arguments valid for its
        ``parameters``.

        Raises:
            ConstraintError: (``param`` ``tool_choice``) no tools offered, a named tool not among
                them, or a tool name the policy's syntax cannot carry.
        """
        if choice is None or choice in ("none", "auto"):
            return None
        if not tools:
            raise ConstraintError("tool_choice requires a call but the request offers no tools", "tool_choice")
        if isinstance(choice, dict):
            name = (choice.get("function") or {}).get("name")
            chosen = [t for t in tools if (t.get("function") or {}).get("name") == name]
            if not chosen:
                raise ConstraintError(f"tool_choice names tool {name!r}, which is not among the request's tools", "tool_choice")
            tools, kind = chosen[:1], "tool_choice:function"
        else:
            kind = "tool_choice:required"
        lark = self._compact(tools, parallel) if self.tool_format == "compact" else self._hermes(tools, parallel)
        return self._compile(kind, llguidance_lark(lark), "tool_choice")

    @staticmethod
    def _compact(tools: Sequence[dict[str, Any]], parallel: bool) -> str:
        rules, calls = [], []
        for k, tool in enumerate(tools):
            name = tool["function"]["name"]
            if not _COMPACT_NAME.fullmatch(name):
                raise ConstraintError(
                    f"tool_choice cannot be enforced: the policy's call syntax '@name(...)' cannot carry the tool name {name!r}",
                    "tool_choice",
                )
            parameters = _parameters(tool)
            arguments = f"args_{k}" + (" | bare" if _bare_parameter(parameters) else "")
            calls.append(f"call_{k}")
            rules.append(f"call_{k}: {_lark_string('@' + name + '(')} ({arguments}) \")\"")
            rules.append(f"args_{k}: %json {json.dumps(_laid_out(parameters))}")
        head = ["start: call+" if parallel else "start: call", "call: " + " | ".join(calls)]
        # a bare argument: text with balanced parentheses that does not start with "{" (the parser
        # reads "{" as JSON arguments); the parser hands it to the tool's one string parameter
        bare = [
            'bare: BARE_FIRST bare_rest | "(" bare_rest ")" bare_rest',
            'bare_rest: (BARE_CHAR | "(" bare_rest ")")*',
            "BARE_FIRST: /[^(){]/",
            "BARE_CHAR: /[^()]/",
        ]
        return "\n".join(head + rules + bare) + "\n"

    @staticmethod
    def _hermes(tools: Sequence[dict[str, Any]], parallel: bool) -> str:
        rules, calls = [], []
        for k, tool in enumerate(tools):
            schema = {
                "type": "object",
                "properties": {"name": {"const": tool["function"]["name"]}, "arguments": _parameters(tool)},
                "required": ["name", "arguments"],
                "additionalProperties": False,
            }
            calls.append(f"call_{k}")
            rules.append(f"call_{k}: %json {json.dumps(_laid_out(schema))}")
        head = [
            'start: call ("\\n"? call)*' if parallel else "start: call",
            'call: "<tool_call>" "\\n"? (' + " | ".join(calls) + ') "\\n"? "</tool_call>"',
        ]
        return "\n".join(head + rules) + "\n"


def llguidance_lark(lark: str) -> str:
    """llguidance's grammar of a Lark grammar text (:meth:`llguidance.LLMatcher.grammar_from_lark`)."""
    import llguidance

    return llguidance.LLMatcher.grammar_from_lark(lark)
