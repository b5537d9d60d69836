"""A policy's next action in the context of a logged turn: what offline evaluation compares.

For each assistant turn of a held-out logged trajectory whose context is known
(:func:`flow_assets.policy.logged_rows.trajectory_conversation`), the policy is given the
conversation up to that turn, rendered with its own chat template exactly as the gateway would
(:func:`~flow_assets.policy.chat.render_prompt`), and decodes greedily; its completion is parsed
in the template's tool-call syntax (:func:`~flow_assets.policy.tool_calls.parse_tool_calls`) into
an :class:`~flow_assets.rl.next_action.Action`. The logged turn's own action is read from the
rebuilt message: its first tool call, or a text answer. Scoring and the paired test are
:mod:`flow_assets.rl.next_action`.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from flow_assets.logs.schema import Trajectory
from flow_assets.policy.chat import ChatFormat, chat_format, render_prompt
from flow_assets.policy.logged_rows import tools_for_calls, trajectory_conversation
from flow_assets.policy.tool_calls import parse_tool_calls
from flow_assets.rl.next_action import ANSWER, Action

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase


@dataclass(frozen=True)
class LoggedTurn:
    """One held-out decision: the context the logged agent had and what it did.

    Attributes:
        trajectory_id / task_id: where it comes from (the bootstrap's cluster; the split's key).
        turn: its index among the trajectory's assistant turns.
        messages: the conversation before the turn (OpenAI messages).
        tools: the tool specifications it is rendered with, or ``None``.
        action: the logged action.
    """

    trajectory_id: str
    task_id: str
    turn: int
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None
    action: Action


def logged_action(message: dict[str, Any]) -> Action:
    """The action of a rebuilt assistant message: its first tool call (name, arguments as JSON),
    else a text answer."""
    calls = message.get("tool_calls") or []
    if calls:
        function = calls[0]["function"]
        arguments = function.get("arguments")
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except ValueError:
                pass
        return Action(function["name"], arguments)
    return Action(ANSWER)


def logged_turns(
    trajectories: Sequence[Trajectory],
    fmt: ChatFormat,
    context: Sequence[dict[str, Any]] = (),
    tools: Sequence[dict[str, Any]] | None = None,
    successful_only: bool = True,
) -> list[LoggedTurn]:
    """Every assistant turn with a known context of ``trajectories`` (successful ones only, by
    default: imitating a failed flow is no evidence of a better policy).

    Args:
        fmt: the evaluated policy's chat format (its tool-call syntax reads captured turns).
        context / tools: what the agent sent besides the logged turns (a system prompt, the tool
            specifications), as in :func:`~flow_assets.policy.logged_rows.trajectory_conversation`.
    """
    turns = []
    for trajectory in trajectories:
        if successful_only and not (trajectory.outcome is not None and trajectory.outcome.success):
            continue
        conversation = trajectory_conversation(trajectory, fmt.tool_calls, context, tools)
        for k, turn in enumerate(conversation.turns):
            if not turn.context_known:
                continue
            before = [dict(m) for m in conversation.messages[: turn.message_index]]
            action = logged_action(conversation.messages[turn.message_index])
            turns.append(LoggedTurn(trajectory.trajectory_id, trajectory.task_id, k, before, conversation.tools, action))
    return turns


def predicted_actions(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    turns: Sequence[LoggedTurn],
    max_new_tokens: int = 64,
    batch_size: int = 16,
) -> list[Action | None]:
    """The policy's greedy next action for each of ``turns`` (``None`` where its completion
    attempts a tool call that does not parse, or the prompt does not fit the model's context).

    Args:
        model: the policy (plain or with its LoRA adapter).
        tokenizer: its tokenizer (the chat template renders the contexts).
        max_new_tokens: completion cap, tokens (a tool call of a small real model is about 30).
        batch_size: prompts decoded together.

    Returns:
        ``[len(turns)]`` actions, in order.
    """
    from flow_assets.policy.configs import SamplingConfig
    from flow_assets.policy.sampling import sample_token_ids

    fmt = chat_format(tokenizer)
    prompts = [render_prompt(tokenizer, t.messages, t.tools, add_generation_prompt=True, fmt=fmt)[1] for t in turns]
    config = SamplingConfig(num_samples=1, temperature=0.0, max_new_tokens=max_new_tokens, max_batch_size=batch_size)
    actions: list[Action | None] = []
    for start in range(0, len(turns), batch_size):
        rollouts = sample_token_ids(model, tokenizer, prompts[start : start + batch_size], config)
        for turn, rollout in zip(turns[start : start + batch_size], rollouts):
            if rollout.error:
                actions.append(None)
                continue
            text = tokenizer.decode(rollout.completion_ids, skip_special_tokens=True)
            # where the log kept no tool specifications: ones made up from the logged call (the
            # compact syntax needs a tool's first parameter to read a bare argument)
            logged = [] if turn.action.name == ANSWER else [{"name": turn.action.name, "arguments": turn.action.arguments}]
            parsed = parse_tool_calls(text, fmt.tool_calls, tools_for_calls(logged, turn.tools))
            if parsed.error:
                actions.append(None)
            elif parsed.tool_calls:
                call = parsed.tool_calls[0]
                actions.append(Action(call.name, json.loads(call.arguments)))
            else:
                actions.append(Action(ANSWER))
    return actions

