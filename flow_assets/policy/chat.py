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

Demonstrations (the SFT warm start) are conversations too: every assistant message becomes one
row ``(prompt ids, completion ids)``, where the prompt is the conversation before it rendered
with the generation prompt, and the completion the rest of the rendered conversation up to and
including that message (its end-of-turn token included): the same cut the gateway makes when it
samples that turn.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

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
) -> tuple[str, list[int]]:
    """The chat template applied to ``messages``: ``(text, ids)``.

    The text is tokenised once with ``add_special_tokens=False`` (the template writes its own
    ``<bos>``); ``ids`` are exactly what the policy is given.

    Raises:
        ValueError: the tokenizer has no chat template.
        jinja2.TemplateError: the template rejects the messages.
    """
    if not tokenizer.chat_template:
        raise ValueError("the policy's tokenizer has no chat template")
    text = tokenizer.apply_chat_template(
        template_messages(messages), tools=list(tools) if tools else None,
        add_generation_prompt=add_generation_prompt, tokenize=False,
    )  # fmt: skip
    return text, tokenizer(text, add_special_tokens=False)["input_ids"]


def conversation_rows(
    tokenizer: PreTrainedTokenizerBase,
    conversation: Sequence[dict[str, Any]],
    tools: Sequence[dict[str, Any]] | None = None,
) -> list[tuple[list[int], list[int]]]:
    """One ``(prompt ids, completion ids)`` row per assistant message of ``conversation``.

    Raises:
        ValueError: the template does not render a conversation as its prefix followed by the
            next message (then turns cannot be cut out of it), or the conversation has no
            assistant message.
    """
    rows = []
    for k, message in enumerate(conversation):
        if message.get("role") != "assistant":
            continue
        prompt, prompt_ids = render_prompt(tokenizer, conversation[:k], tools, add_generation_prompt=True)
        full, _ = render_prompt(tokenizer, conversation[: k + 1], tools, add_generation_prompt=False)
        if not full.startswith(prompt):
            raise ValueError(f"the chat template does not extend the prompt of turn {k} with that turn")
        rows.append((prompt_ids, tokenizer(full[len(prompt) :], add_special_tokens=False)["input_ids"]))
    if not rows:
        raise ValueError("a demonstration needs at least one assistant message")
    return rows
