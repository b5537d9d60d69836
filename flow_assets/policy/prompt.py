"""Prompt policies: the part of an agent's policy that lives in its context, not in its weights.

A :class:`PromptPolicy` is a versioned artefact, a directory holding ``prompt_policy.json``,
registered, promoted, A/B-tested and rolled back in the same registry as LoRA adapters (its
directory is the entry's ``adapter_path``). It holds:

- ``instructions``: text for the system message;
- ``demonstrations``: few-shot examples, each a whole conversation in chat-completions messages
  (``user`` / ``assistant`` with ``content`` or ``tool_calls`` / ``tool`` results), as the
  successful trajectories they were selected from went;
- ``tool_descriptions``: ``{tool name: description}`` replacing the description of the tools an
  agent sends under that name.

How the gateway applies it to a request (:meth:`PromptPolicy.apply`), in this order:

1. **Instructions.** When the agent's messages start with a ``system`` (or ``developer``) message,
   the instructions come first in that message's text, then a blank line, then the agent's own
   system text (the agent's prompt is kept whole; the policy adds to it, never replaces it). When
   they do not, a ``system`` message holding the instructions is put first.
2. **Demonstrations**, in their order, right after the leading system messages and before the
   agent's first other message: the model sees them as earlier turns of the same conversation.
3. **Tool descriptions**: each tool of the request whose ``function.name`` has an override gets
   that description; the tool's name and parameters never change, so the agent's calls still parse.

An empty policy changes nothing. The same policy applies wherever a version is served: by the
proxy in front of an upstream model (a directory holding only ``prompt_policy.json``), and by the
hosting gateway to a version whose directory holds a LoRA adapter *and* ``prompt_policy.json``
(an adapter trained under that prompt; :func:`policy_kind`). The captured token ids are those of
the prompt as applied (what the model saw); the trajectory's messages are the agent's own.

The content hash (:attr:`PromptPolicy.content_hash`) is
sha256 over the canonical JSON of the three fields, so two directories with the same policy have
the same hash whatever their version names.
"""

from __future__ import annotations

import copy
import hashlib
import json
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

#: the file of a prompt policy directory
PROMPT_POLICY_FILE = "prompt_policy.json"

_SYSTEM_ROLES = ("system", "developer")
_DEMO_ROLES = ("user", "assistant", "tool")


class PromptPolicyError(ValueError):
    """A prompt policy file or value is not valid; the message names the file and the field."""


@dataclass(frozen=True)
class PromptPolicy:
    """Instructions, demonstrations and tool description overrides (module docstring).

    Attributes:
        instructions: system text added before the agent's own ("" : none).
        demonstrations: conversations, each a list of chat-completions messages (roles ``user``,
            ``assistant``, ``tool``).
        tool_descriptions: tool name -> description.

    Raises:
        PromptPolicyError: a field of the wrong type, a demonstration that is empty or holds a
            message without a known role.
    """

    instructions: str = ""
    demonstrations: tuple[tuple[dict[str, Any], ...], ...] = ()
    tool_descriptions: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not isinstance(self.instructions, str):
            raise PromptPolicyError(f"instructions: expected text, got {type(self.instructions).__name__}")
        demos = []
        for i, demo in enumerate(self.demonstrations):
            if not isinstance(demo, (list, tuple)) or not demo:
                raise PromptPolicyError(f"demonstrations[{i}]: expected a non-empty list of messages")
            for j, message in enumerate(demo):
                if not isinstance(message, dict) or message.get("role") not in _DEMO_ROLES:
                    raise PromptPolicyError(f"demonstrations[{i}][{j}].role: expected one of {', '.join(_DEMO_ROLES)}")
            demos.append(tuple(copy.deepcopy(dict(m)) for m in demo))
        object.__setattr__(self, "demonstrations", tuple(demos))
        if not isinstance(self.tool_descriptions, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in self.tool_descriptions.items()
        ):
            raise PromptPolicyError("tool_descriptions: expected an object of tool name -> description text")

    def to_json(self) -> dict[str, Any]:
        """The policy as the JSON object its file holds."""
        return {"instructions": self.instructions, "demonstrations": [list(d) for d in self.demonstrations],
                "tool_descriptions": dict(sorted(self.tool_descriptions.items()))}  # fmt: skip

    @property
    def content_hash(self) -> str:
        """sha256 (hex) of the canonical JSON of the policy (sorted keys, no spaces)."""
        return hashlib.sha256(json.dumps(self.to_json(), sort_keys=True, separators=(",", ":")).encode()).hexdigest()

    @classmethod
    def from_json(cls, data: Any, where: str = "prompt policy") -> PromptPolicy:
        """The policy a JSON object describes (unknown keys refused).

        Raises:
            PromptPolicyError: not an object, an unknown key, or an invalid field (``where`` prefixes the message).
        """
        if not isinstance(data, dict):
            raise PromptPolicyError(f"{where}: expected a JSON object, got {type(data).__name__}")
        if unknown := sorted(set(data) - {"instructions", "demonstrations", "tool_descriptions", "content_hash"}):
            raise PromptPolicyError(f"{where}: unknown field {unknown[0]!r}")
        try:
            return cls(data.get("instructions", ""), tuple(data.get("demonstrations") or ()), dict(data.get("tool_descriptions") or {}))
        except (PromptPolicyError, TypeError, ValueError) as exc:
            raise PromptPolicyError(f"{where}: {exc}") from None

    def save(self, directory: str | Path) -> Path:
        """Write ``directory/prompt_policy.json`` (with its ``content_hash``); returns the directory."""
        path = Path(directory)
        path.mkdir(parents=True, exist_ok=True)
        text = json.dumps({**self.to_json(), "content_hash": self.content_hash}, indent=1, ensure_ascii=False)
        tmp = path / (PROMPT_POLICY_FILE + ".tmp")
        tmp.write_text(text + "\n", encoding="utf-8")
        tmp.replace(path / PROMPT_POLICY_FILE)
        return path

    @classmethod
    def load(cls, directory: str | Path) -> PromptPolicy:
        """The policy saved in ``directory``.

        Raises:
            FileNotFoundError: no ``prompt_policy.json`` there.
            PromptPolicyError: the file is not JSON, a field is invalid, or its ``content_hash``
                does not match its content (it was edited by hand without updating it).
        """
        file = Path(directory) / PROMPT_POLICY_FILE
        try:
            data = json.loads(file.read_text(encoding="utf-8"))
        except json.JSONDecodeError as exc:
            raise PromptPolicyError(f"{file}: not JSON (line {exc.lineno}: {exc.msg})") from None
        policy = cls.from_json(data, str(file))
        if data.get("content_hash") not in (None, policy.content_hash):
            raise PromptPolicyError(f"{file}: content_hash {data['content_hash'][:12]}... does not match the content ({policy.content_hash[:12]}...)")
        return policy

    def apply(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
        """The request's ``(messages, tools)`` under this policy (module docstring); the inputs are
        not changed."""
        messages = [dict(m) for m in messages]
        lead = 0
        while lead < len(messages) and messages[lead].get("role") in _SYSTEM_ROLES:
            lead += 1
        if self.instructions:
            if lead:
                own = messages[0].get("content")
                if isinstance(own, list):  # text parts: the instructions become the first part
                    messages[0]["content"] = [{"type": "text", "text": self.instructions + "\n\n"}, *own]
                else:
                    messages[0]["content"] = f"{self.instructions}\n\n{own}" if own else self.instructions
            else:
                messages.insert(0, {"role": "system", "content": self.instructions})
                lead = 1
        # null fields left out, as the agent's own messages are forwarded: some servers
        # (llama-cpp-python's) refuse an assistant turn with "content": null beside its tool calls
        demos = [{k: copy.deepcopy(v) for k, v in m.items() if v is not None} for demo in self.demonstrations for m in demo]
        messages[lead:lead] = demos
        if tools and self.tool_descriptions:
            tools = [
                {**t, "function": {**t["function"], "description": self.tool_descriptions[t["function"]["name"]]}}
                if t.get("function", {}).get("name") in self.tool_descriptions else t
                for t in tools
            ]  # fmt: skip
        return messages, tools


def is_prompt_policy(directory: str | Path) -> bool:
    """Whether ``directory`` holds a prompt policy (a ``prompt_policy.json``)."""
    return (Path(directory) / PROMPT_POLICY_FILE).is_file()


#: the LoRA adapter's configuration file (PEFT's format); its presence makes a version hosted
ADAPTER_CONFIG = "adapter_config.json"

#: the kinds of policy a registry version can be (:func:`policy_kind`)
POLICY_KINDS = ("adapter", "prompt", "adapter+prompt")


def policy_kind(directory: str | Path) -> str:
    """What a version directory holds: ``"adapter"`` (a LoRA adapter, served by a gateway that
    hosts the base model), ``"prompt"`` (only a prompt policy, served by the proxy in front of an
    upstream model), or ``"adapter+prompt"`` (an adapter and the prompt policy it is served
    under, hosted). A directory with neither counts as ``"adapter"`` (what loading it says is
    :func:`resources.registry.adapter_problem`'s to report)."""
    path = Path(directory)
    prompt = is_prompt_policy(path)
    if prompt and not (path / ADAPTER_CONFIG).is_file():
        return "prompt"
    return "adapter+prompt" if prompt else "adapter"


def carry_prompt(parent: str | Path, child: str | Path) -> bool:
    """Copy the prompt policy of version directory ``parent`` (if it has one) into ``child`` (a
    new adapter trained under it), so the child is served under the same prompt and differs from
    its parent by its weights only. Returns whether a policy was copied.

    Raises:
        PromptPolicyError: the parent's policy does not load (checked, not copied blindly).
    """
    if not is_prompt_policy(parent):
        return False
    PromptPolicy.load(parent).save(child)
    return True


def hosted_version(adapter_dir: str | Path, prompt: PromptPolicy, target: str | Path) -> Path:
    """A version directory at ``target`` holding the LoRA adapter of ``adapter_dir`` (its files
    copied, except any prompt policy it had) under ``prompt``: the candidate of a prompt round on
    a hosted policy, which differs from its champion by the prompt only.

    Raises:
        FileNotFoundError: ``adapter_dir`` holds no :data:`ADAPTER_CONFIG`.
    """
    source, path = Path(adapter_dir), Path(target)
    if not (source / ADAPTER_CONFIG).is_file():
        raise FileNotFoundError(f"{source}: no {ADAPTER_CONFIG}, not a LoRA adapter directory")
    path.mkdir(parents=True, exist_ok=True)
    for item in source.iterdir():
        if item.is_file() and item.name != PROMPT_POLICY_FILE:
            shutil.copyfile(item, path / item.name)
    return prompt.save(path)


#: the kinds of round a policy gets (one change per round): new weights, or a new prompt
ROUND_KINDS = ("adapter", "prompt")


def next_round_kind(kind: str, schedule: tuple[str, ...] | list[str], rounds_so_far: int) -> str:
    """The kind of the next round for a champion of ``kind`` (:func:`policy_kind`): one change
    per round, so the gate always compares one change (``docs/training.md``, "Prompt-policy rounds").

    - a prompt policy alone (an upstream model flowopt cannot train): ``"prompt"``, always;
    - a hosted policy (an adapter, with or without a prompt policy): ``schedule`` read as a cycle,
      round ``rounds_so_far`` (0-based, counted over both kinds) taking
      ``schedule[rounds_so_far % len(schedule)]``. ``("adapter",)`` (the default): LoRA rounds
      only; ``("prompt", "adapter")``: optimise the prompt, then train the adapter under it, and
      again.

    Raises:
        ValueError: an empty schedule, or a kind not in :data:`ROUND_KINDS` / :data:`POLICY_KINDS`.
    """
    if kind not in POLICY_KINDS:
        raise ValueError(f"policy kind {kind!r} is not one of {', '.join(POLICY_KINDS)}")
    if not schedule or set(schedule) - set(ROUND_KINDS):
        raise ValueError(f"round schedule {list(schedule)!r}: expected a non-empty list of {', '.join(ROUND_KINDS)}")
    if kind == "prompt":
        return "prompt"
    return schedule[rounds_so_far % len(schedule)]
