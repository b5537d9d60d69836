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
    """

    kind: str
    grammar: str
    prototype: Any  # llguidance.LLMatcher

    def matcher(self) -> llguidance.LLMatcher:
        """A fresh matcher for one row (a copy of the compiled prototype: no recompilation)."""
        return self.prototype.deep_copy()


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
        self.tool_format = tool_format

    def _compile(self, kind: str, grammar: str, param: str) -> Constraint:
        import llguidance

        error = llguidance.LLMatcher.validate_grammar(grammar, self.tokenizer)
        if error:
            raise ConstraintError(f"{param} cannot be enforced: {error.splitlines()[0]}", param)
        prototype = llguidance.LLMatcher(self.tokenizer, grammar, log_level=0)
        if prototype.is_error():
            raise ConstraintError(f"{param} cannot be enforced: {prototype.get_error().splitlines()[0]}", param)
        return Constraint(kind, grammar, prototype)

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
