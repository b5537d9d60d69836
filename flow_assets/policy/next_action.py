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
            text = None if rollout.error else tokenizer.decode(rollout.completion_ids, skip_special_tokens=True)
            actions.append(completion_action(text, turn, fmt))
    return actions


def completion_action(text: str | None, turn: LoggedTurn, fmt: ChatFormat) -> Action | None:
    """The action a policy's completion ``text`` for ``turn`` takes: its first tool call, else a
    text answer; ``None`` when ``text`` is ``None`` (no completion) or attempts a call that does
    not parse."""
    if text is None:
        return None
    # where the log kept no tool specifications: ones made up from the logged call (the
    # compact syntax needs a tool's first parameter to read a bare argument)
    logged = [] if turn.action.name == ANSWER else [{"name": turn.action.name, "arguments": turn.action.arguments}]
    parsed = parse_tool_calls(text, fmt.tool_calls, tools_for_calls(logged, turn.tools))
    if parsed.error:
        return None
    if parsed.tool_calls:
        call = parsed.tool_calls[0]
        return Action(call.name, json.loads(call.arguments))
    return Action(ANSWER)


def conversation_greedy_actions(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    turns: Sequence[LoggedTurn],
    max_new_tokens: int = 64,
    max_length: int | None = None,
) -> list[Action | None]:
    """:func:`predicted_actions` for long conversations: the same greedy next action per turn
    (:func:`conversation_greedy_completions`, then :func:`completion_action`).

    Returns:
        ``[len(turns)]`` actions, in the order of ``turns``; ``None`` for a turn over
        ``max_length`` or whose call does not parse.
    """
    fmt = chat_format(tokenizer)
    completions = conversation_greedy_completions(model, tokenizer, turns, max_new_tokens, max_length)
    texts = [None if ids is None else tokenizer.decode(ids, skip_special_tokens=True) for ids in completions]
    return [completion_action(text, turn, fmt) for text, turn in zip(texts, turns)]


def _tree_greedy(model: PreTrainedModel, sequence: list[int], ends: list[int], max_new_tokens: int, eos: int) -> list[list[int]]:
    """Greedy completions of the prompts ``sequence[:end]`` for each of ``ends``, decoded together
    on one KV cache of batch 1: ``sequence`` is prefilled once, then every step appends each
    unfinished row's newest token as a new position, and a 4D additive mask lets that row see
    only its own prompt ``[0, end)`` and its own tokens (tree attention, as in speculative
    decoding's token trees). Position ids continue each row's own prompt. Each step copies the
    one shared cache once, where repeating the cache per row copied it once per row (measured
    on SmolLM2 with a 4,000-token cache: batch 1 0.11 s a step, batch 8 0.6 s a step).

    Returns:
        ``[len(ends)]`` token lists, each ending at its first ``eos`` or at ``max_new_tokens``.
    """
    import torch

    dtype = next(model.parameters()).dtype
    blocked = torch.finfo(dtype).min
    with torch.no_grad():
        # logits only where a turn's first token is predicted: the full [len, vocab] would be GBs
        out = model(input_ids=torch.tensor([sequence]), use_cache=True, logits_to_keep=torch.tensor([e - 1 for e in ends]))
        cache = out.past_key_values
        generated = [[int(t)] for t in out.logits[0].argmax(-1)]
        columns: list[list[int]] = [[] for _ in ends]  # each row's own generated positions in the cache
        length = len(sequence)
        for _ in range(1, max_new_tokens):
            active = [r for r, tokens in enumerate(generated) if tokens[-1] != eos]
            if not active:
                break
            for k, r in enumerate(active):
                columns[r].append(length + k)
            length += len(active)
            mask = torch.full((1, 1, len(active), length), blocked, dtype=dtype)
            for k, r in enumerate(active):
                mask[0, 0, k, : ends[r]] = 0
                mask[0, 0, k, columns[r]] = 0
            logits = model(
                input_ids=torch.tensor([[generated[r][-1] for r in active]]),
                position_ids=torch.tensor([[ends[r] + len(generated[r]) - 1 for r in active]]),
                attention_mask=mask, past_key_values=cache, use_cache=True,
            ).logits  # fmt: skip
            for k, token in enumerate(logits[0].argmax(-1).tolist()):
                generated[active[k]].append(token)
    return generated


def conversation_greedy_completions(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    turns: Sequence[LoggedTurn],
    max_new_tokens: int = 64,
    max_length: int | None = None,
) -> list[list[int] | None]:
    """Each turn's greedy completion, the turns of one conversation decoded together on ONE
    prefill of the conversation.

    When turn ``k``'s prompt ids are a prefix of turn ``k + 1``'s (a prefix-consistent
    template), the last turn's prompt holds every earlier one: it is prefilled once and each
    turn decodes greedily from the end of its own prompt (:func:`_tree_greedy`: position ids
    from there; an attention mask hides the conversation after its prompt, so a turn never sees
    what the log did next). For a causal LM this is the computation of decoding each prompt
    alone; only the floating-point order differs. A tau-bench conversation (~5,500 tokens, ~11
    turns) costs one prefill instead of 11, and its turns decode together. Turns whose prompts
    are not prefixes of one another form separate chains.

    Args:
        model / tokenizer: the policy (plain or with its LoRA adapter) and its tokenizer.
        turns: held-out turns (:func:`logged_turns`), any order.
        max_new_tokens: completion cap per turn, tokens.
        max_length: the model's context; a turn whose prompt plus ``max_new_tokens`` exceeds it
            gets ``None`` (no completion), as a prompt the sampler refuses does.

    Returns:
        ``[len(turns)]`` completion ids (up to and including ``<eos>``, at most
        ``max_new_tokens``) in the order of ``turns``; ``None`` for a turn over ``max_length``.
    """
    from flow_assets.policy.logged_rows import is_token_prefix

    fmt = chat_format(tokenizer)
    prompts = [render_prompt(tokenizer, t.messages, t.tools, add_generation_prompt=True, fmt=fmt)[1] for t in turns]
    chains: dict[str, list[list[int]]] = {}  # trajectory -> chains of turn indices, shortest prompt first
    for i in sorted(range(len(turns)), key=lambda i: (turns[i].trajectory_id, len(prompts[i]))):
        own = chains.setdefault(turns[i].trajectory_id, [])
        if own and is_token_prefix(prompts[own[-1][-1]], prompts[i]):
            own[-1].append(i)
        else:
            own.append([i])
    completions: list[list[int] | None] = [None] * len(turns)
    eos = tokenizer.eos_token_id
    for chain in (c for cs in chains.values() for c in cs):
        chain = [i for i in chain if max_length is None or len(prompts[i]) + max_new_tokens <= max_length]
        if not chain:
            continue
        sequence, ends = prompts[chain[-1]], [len(prompts[i]) for i in chain]
        generated = _tree_greedy(model, sequence, ends, max_new_tokens, eos)
        for row, i in enumerate(chain):
            completions[i] = generated[row]
    return completions

