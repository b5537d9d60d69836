"""Chat conversations as token ids: the policy's chat template, and demonstrations as training rows.

The gateway never hands text to the trainer: it renders the messages of every call with the
tokenizer's own chat template (``apply_chat_template(messages, tools=...)``), tokenises that text
once, and those ids are what the policy is given and what training later consumes.

The tiny character-level model has no template of its own; :data:`COMPACT_CHAT_TEMPLATE` is one
short enough for a model that pays one token per character::

    <bos>U:{user}\\n A:{assistant}<eos> T:{tool result}\\n A:        (no spaces; S: for system)

An assistant turn that calls a tool renders the call as ``@name(argument)`` (the value of a
single string argument whose parentheses pair up) or ``@name({json})`` (anything else), the
syntax :mod:`flow_assets.policy.tool_calls` parses back (format ``"compact"``). The template ignores ``tools=``: the tiny model learns its
tools from demonstrations, and a long tool specification would not fit its context.

Real models (:class:`ChatFormat`, detected by :func:`chat_format`):

- a template that renders ``tools=`` and assistant ``tool_calls`` itself (Qwen 2.5 / 3, Hermes,
  Llama 3.1 and most tool-tuned models) is used as it is; calls come back in the Hermes
  ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` syntax;
- a template that ignores them (SmolLM2's renders ``<|im_start|>{role}\n{content}<|im_end|>`` for
  every message and nothing else) gets them from flowopt, in the same Hermes syntax
  (:func:`inject_tools`): the tool specifications are appended to the system message
  (:data:`TOOL_PROMPT`, then one JSON object per tool: its OpenAI ``function`` object), an
  assistant message's calls become ``<tool_call>...</tool_call>`` blocks after its text, and
  ``tool`` messages keep their role. Example, SmolLM2 with the calculator::

      <|im_start|>system
      You can call tools. To call one, reply with only
      <tool_call>{"name": <tool name>, "arguments": <arguments as a JSON object>}</tool_call>
      and its result comes back in a tool message. Tools:
      {"name": "calculator", "description": "...", "parameters": {...}}<|im_end|>
      <|im_start|>user
      How many hours are in 7 days?<|im_end|>
      <|im_start|>assistant
      <tool_call>{"name": "calculator", "arguments": {"expression": "7*24"}}</tool_call><|im_end|>
      <|im_start|>tool
      168<|im_end|>

Demonstrations (the SFT warm start) are conversations too: every assistant message becomes one
row ``(prompt ids, completion ids)``, where the prompt is the conversation before it rendered
with the generation prompt, and the completion the rest of the rendered conversation up to and
including that message's end-of-turn token (what the template writes after it, such as
SmolLM2's newline, belongs to the next prompt): the same cut the gateway makes when it samples
that turn.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import jinja2

from flow_assets.policy.tool_calls import ToolCallFormat

if TYPE_CHECKING:  # annotations only: transformers costs seconds in every process that loads the code location
    from transformers import PreTrainedTokenizerBase

#: the tiny model's chat template (module docstring); saved with its tokenizer
COMPACT_CHAT_TEMPLATE = (
    "{{- bos_token -}}"
    "{%- for m in messages -%}"
    "{%- if m.role == 'system' or m.role == 'developer' -%}S:{{ m.content }}{{ '\\n' }}"
    "{%- elif m.role == 'user' -%}U:{{ m.content }}{{ '\\n' }}"
    "{%- elif m.role == 'assistant' -%}A:{{ m.content or '' }}"
    "{%- for tc in m.tool_calls or [] -%}"
    "{%- set args = tc.function.arguments -%}"
    "@{{ tc.function.name }}("
    "{%- set one = args.values()|first if args is mapping and args|length == 1 else none -%}"
    "{%- if one is string and one.count('(') == one.count(')') -%}{{ one }}"
    "{%- elif args is mapping -%}{{ args|tojson }}"
    "{%- else -%}{{ args }}{%- endif -%})"
    "{%- endfor -%}{{ eos_token }}"
    "{%- elif m.role == 'tool' -%}T:{{ m.content }}{{ '\\n' }}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}A:{%- endif -%}"
)


#: what :func:`inject_tools` appends to the system message, followed by one JSON line per tool
TOOL_PROMPT = (
    "You can call tools. To call one, reply with only\n"
    '<tool_call>{"name": <tool name>, "arguments": <arguments as a JSON object>}</tool_call>\n'
    "and its result comes back in a tool message. Tools:\n"
)


@dataclass(frozen=True)
class ChatFormat:
    """How a policy's chat template handles tools.

    Attributes:
        tool_calls: the syntax the policy writes calls in (``"compact"`` for the tiny model's
            template, ``"hermes"`` otherwise), parsed by :func:`~flow_assets.policy.tool_calls.parse_tool_calls`.
        inject_tools: the template ignores ``tools=`` or assistant ``tool_calls``; flowopt renders
            them into the messages (:func:`inject_tools`) before applying it.
    """

    tool_calls: ToolCallFormat
    inject_tools: bool


_PROBE_TOOL = {
    "type": "function",
    "function": {"name": "flowopt_probe_tool", "description": "", "parameters": {"type": "object", "properties": {}}},
}


def chat_format(tokenizer: PreTrainedTokenizerBase) -> ChatFormat:
    """Detect how ``tokenizer``'s chat template handles tools: it renders them itself when the
    name of a probe tool appears both in a prompt rendered with ``tools=[probe]`` and in an
    assistant message that calls it; otherwise they are injected (module docstring).

    Raises:
        ValueError: the tokenizer has no chat template.
    """
    if not tokenizer.chat_template:
        raise ValueError("the policy's tokenizer has no chat template")
    if tokenizer.chat_template == COMPACT_CHAT_TEMPLATE:
        return ChatFormat("compact", inject_tools=False)
    name = _PROBE_TOOL["function"]["name"]
    user = {"role": "user", "content": "hi"}
    call = {"role": "assistant", "content": "", "tool_calls": [{"id": "c0", "type": "function", "function": {"name": name, "arguments": {}}}]}
    try:
        offered = tokenizer.apply_chat_template([user], tools=[_PROBE_TOOL], add_generation_prompt=True, tokenize=False)
        called = tokenizer.apply_chat_template([user, call], add_generation_prompt=False, tokenize=False)
        native = name in offered and name in called
    except (jinja2.TemplateError, TypeError, ValueError):  # e.g. a template that rejects tool calls
        native = False
    return ChatFormat("hermes", inject_tools=not native)


def inject_tools(messages: Sequence[dict[str, Any]], tools: Sequence[dict[str, Any]] | None) -> list[dict[str, Any]]:
    """``messages`` (as :func:`template_messages` returns them) with the tools written into them
    for a template that ignores tools: :data:`TOOL_PROMPT` and one JSON line per tool's
    ``function`` appended to the system message (one is added first when there is none), every
    assistant ``tool_calls`` turned into ``<tool_call>{"name": ..., "arguments": ...}</tool_call>``
    blocks after its text, and missing content as ``""``. Without ``tools`` no specification is
    added (calls already in the history are still written out)."""
    out = []
    for m in messages:
        m = dict(m)
        calls = m.pop("tool_calls", None) or []
        text = m.get("content") or ""
        for c in calls:
            function = c.get("function") or {}
            block = {"name": function.get("name"), "arguments": function.get("arguments", {})}
            text += f"<tool_call>{json.dumps(block, ensure_ascii=False)}</tool_call>"
        m["content"] = text
        out.append(m)
    if tools:
        spec = TOOL_PROMPT + "\n".join(json.dumps(t.get("function", t), ensure_ascii=False) for t in tools)
        if out and out[0].get("role") == "system":
            out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{spec}" if out[0]["content"] else spec}
        else:
            out.insert(0, {"role": "system", "content": spec})
    return out


def template_messages(messages: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Messages as chat templates expect them: text content (a list of text parts joined),
    and tool-call ``arguments`` as a mapping (OpenAI sends a JSON string; Hugging Face templates
    read a dict). Arguments that are not a JSON object stay the string they were."""
    out = []
    for m in messages:
        m = dict(m)
        content = m.get("content")
        if isinstance(content, list):
            m["content"] = "".join(part.get("text", "") for part in content if isinstance(part, dict))
        calls = []
        for call in m.get("tool_calls") or []:
            function = dict(call.get("function") or {})
            args = function.get("arguments")
            if isinstance(args, str):
                try:
                    parsed = json.loads(args)
                except json.JSONDecodeError:
                    parsed = args
                function["arguments"] = parsed if isinstance(parsed, dict) else args
            calls.append({**call, "function": function})
        if calls:
            m["tool_calls"] = calls
        out.append(m)
    return out


def render_prompt(
    tokenizer: PreTrainedTokenizerBase,
    messages: Sequence[dict[str, Any]],
    tools: Sequence[dict[str, Any]] | None = None,
    add_generation_prompt: bool = True,
    fmt: ChatFormat | None = None,
) -> tuple[str, list[int]]:
    """The chat template applied to ``messages``: ``(text, ids)``.

    The text is tokenised once with ``add_special_tokens=False`` (the template writes its own
    ``<bos>``); ``ids`` are exactly what the policy is given. ``fmt`` is the template's
    :class:`ChatFormat` (detected when ``None``; callers that render often pass it).

    Raises:
        ValueError: the tokenizer has no chat template.
        jinja2.TemplateError: the template rejects the messages.
    """
    fmt = fmt or chat_format(tokenizer)
    messages = template_messages(messages)
    if fmt.inject_tools:
        messages, tools = inject_tools(messages, tools), None
    text = tokenizer.apply_chat_template(
        messages, tools=list(tools) if tools else None, add_generation_prompt=add_generation_prompt, tokenize=False
    )
    return text, tokenizer(text, add_special_tokens=False)["input_ids"]


def assistant_turn_ids(
    tokenizer: PreTrainedTokenizerBase,
    conversation: Sequence[dict[str, Any]],
    k: int,
    tools: Sequence[dict[str, Any]] | None = None,
    fmt: ChatFormat | None = None,
) -> tuple[list[int], list[int]]:
    """``(prompt ids, completion ids)`` of the assistant message ``conversation[k]``: the
    conversation before it rendered with the generation prompt (what the gateway gives the policy
    for that turn), and the rest of the rendered conversation up to and including that message's
    end-of-turn token (``eos``; the module docstring's cut).

    Raises:
        ValueError: ``conversation[k]`` is not an assistant message, or the template does not
            render ``conversation[:k + 1]`` as the prompt of turn ``k`` followed by that turn.
        jinja2.TemplateError: the template rejects the messages.
    """
    if conversation[k].get("role") != "assistant":
        raise ValueError(f"message {k} is a {conversation[k].get('role')!r} message, not an assistant turn")
    fmt = fmt or chat_format(tokenizer)
    prompt, prompt_ids = render_prompt(tokenizer, conversation[:k], tools, add_generation_prompt=True, fmt=fmt)
    full, _ = render_prompt(tokenizer, conversation[: k + 1], tools, add_generation_prompt=False, fmt=fmt)
    if not full.startswith(prompt):
        raise ValueError(f"the chat template does not extend the prompt of turn {k} with that turn")
    completion = tokenizer(full[len(prompt) :], add_special_tokens=False)["input_ids"]
    if tokenizer.eos_token_id in completion:  # sampling stops at eos; what follows opens the next turn
        completion = completion[: completion.index(tokenizer.eos_token_id) + 1]
    return prompt_ids, completion


def conversation_rows(
    tokenizer: PreTrainedTokenizerBase,
    conversation: Sequence[dict[str, Any]],
    tools: Sequence[dict[str, Any]] | None = None,
) -> list[tuple[list[int], list[int]]]:
    """One ``(prompt ids, completion ids)`` row per assistant message of ``conversation``
    (:func:`assistant_turn_ids`); the completion ends with the turn's end-of-turn token (``eos``).

    Raises:
        ValueError: the template does not render a conversation as its prefix followed by the
            next message (then turns cannot be cut out of it), or the conversation has no
            assistant message.
    """
    fmt = chat_format(tokenizer)
    rows = [
        assistant_turn_ids(tokenizer, conversation, k, tools, fmt)
        for k, message in enumerate(conversation)
        if message.get("role") == "assistant"
    ]
    if not rows:
        raise ValueError("a demonstration needs at least one assistant message")
    return rows
