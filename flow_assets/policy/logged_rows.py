"""Training rows from logged trajectories: a conversation rendered with the policy's own chat
template, one forward pass per conversation where the template allows it.

A logged trajectory (:class:`~flow_assets.logs.schema.Trajectory`, whatever format it came from)
is turned back into chat messages (:func:`trajectory_conversation`), and each assistant message
into ``(prompt ids, completion ids)`` exactly as the gateway would have given that turn to the
policy and as the policy would have written it (:func:`~flow_assets.policy.chat.assistant_turn_ids`:
the same :func:`~flow_assets.policy.chat.render_prompt`, tool specifications injected for a
template that ignores ``tools=``, tool calls in the template's own syntax).

**Captured ids win.** A step the gateway captured carries ``prompt_token_ids`` and ``token_ids``:
those are used as they are (the text is re-rendered only for steps without them), so a captured
rollout trains on exactly what was sampled. :func:`render_drift` measures how often re-rendering
would have given other ids.

**One pass per conversation.** Turn ``k``'s prompt followed by its completion is usually a token
prefix of turn ``k + 1``'s prompt (the template is *prefix-consistent*). Then the last turn's
``prompt + completion`` holds every turn at the place it had when it was generated, and one row
with an assistant mask trains all of them in one forward pass: for a causal LM the log-prob of a
token depends only on the tokens before it, so each masked token gets the same log-prob as in
its own per-turn row. The check is made on ids for every pair of consecutive turns of every
conversation; where it fails (a template that rewrites earlier turns, e.g. one that drops the
reasoning of past assistant messages, or a sampled completion the template would render
otherwise) the row is cut there and the next turn starts a new row. With no consistent pair at
all this is one row per assistant turn.

**What the canonical trajectory does not keep** (so a conversation rebuilt from it is the logged
one only where these did not occur):

- messages before the query (system prompt, few-shot examples): pass them as ``context``; the
  tool specifications: pass ``tools`` (the gateway and the log formats do not store them;
  tau-bench keeps only a hash of its system prompt);
- user messages after the first: an assistant text turn that is not the last decision (kind
  ``message`` or ``verify``) was answered by a user message that is not in the trajectory, so
  every later turn has an unknown context. Such turns are not rendered (they are listed in
  :attr:`LoggedRows.skipped`); captured turns still train from their ids. (tau-bench holds 7.45
  user messages per conversation, tau2 4.7 to 6.3.)
- which tool steps shared one assistant message: chat logs (tau-bench, tau2, OpenAI messages)
  store each call as a ``tool`` step with its result. The rebuild puts one call in each
  assistant message, the text step (``plan``) before it in the same message. This is exact for
  tau-bench's gpt-4o-airline (no message holds two calls) and approximate for tau2, where 30 to
  50% of the messages with calls hold several.

Rebuilt from the canonical record, 202 of tau-bench's 2,454 assistant turns have a known context
(8%; tau2 about 7%), FireAct's all of them. Where the record kept the messages whole
(``metadata.messages``: tau-bench's parser keeps its ``traj`` with the steps each assistant
message became), :func:`kept_conversation` gives every turn its context and
:func:`trajectory_conversation` uses it: with SmolLM2's template, 200 rows (one per
conversation, all prefix-consistent) of 4,332 tokens on average (without tool specifications)
instead of 2,454 per-turn rows holding 9.5 times as many tokens.

Two step conventions are read (:func:`trajectory_conversation`):

- *turn steps* (the gateway's capture, ``flow_assets.serving.gateway.capture``): one decision step
  per LLM call, ``output`` the completion text, ``input = {"tool_calls": [{id, name, arguments}]}``,
  followed by one ``observation`` step per answered call;
- *chat steps* (``flow_assets.logs.formats.openai_chat``, ``fireact``, ``flat``): a ``plan`` step for
  the text that accompanies calls, one ``tool`` step per call with its result as ``output`` (a
  ``plan`` step naming the ``think`` tool is a call of it), ``message`` / ``answer`` steps for text.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import jinja2

from flow_assets.logs.schema import Step, Trajectory
from flow_assets.policy.chat import ChatFormat, assistant_turn_ids, chat_format
from flow_assets.policy.tool_calls import ToolCallFormat, parse_tool_calls

if TYPE_CHECKING:  # annotations only: transformers costs seconds to import
    from transformers import PreTrainedTokenizerBase

#: ``Step.kind`` values that are assistant text
_TEXT_KINDS = ("message", "answer", "verify")


@dataclass(frozen=True)
class AssistantTurn:
    """One assistant message of a rebuilt conversation.

    Attributes:
        message_index: its position in :attr:`LoggedConversation.messages`.
        steps: the trajectory steps it was rebuilt from (``Step.index``), in order.
        context_known: every message before it is known (no user message was lost before it).
        captured: the step carrying the gateway's ids for this turn (``Step.index``), or ``None``.
    """

    message_index: int
    steps: tuple[int, ...]
    context_known: bool
    captured: int | None = None


@dataclass(frozen=True)
class LoggedConversation:
    """A trajectory as chat messages (OpenAI form) and its assistant turns.

    Attributes:
        messages: ``context``, the query as a user message, then assistant and tool messages.
        tools: the tool specifications the turns are rendered with (OpenAI ``tools``), or ``None``.
        turns: the assistant turns, in order.
    """

    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None
    turns: tuple[AssistantTurn, ...]


@dataclass(frozen=True)
class TrainingRow:
    """One forward pass: a token sequence and which of its tokens are in the loss.

    Attributes:
        input_ids: ``[seq]`` token ids (the last trained turn's prompt followed by its completion).
        assistant_mask: ``[seq]`` 1 on the completion tokens of the row's turns (each ending with
            its end-of-turn token), 0 on everything else (system, user, tool messages, template
            markup, the generation prompt).
        turn_index: ``[seq]`` the index (into :attr:`LoggedConversation.turns`) of the turn a
            masked token belongs to; -1 where the mask is 0.
        turns: the turns the row trains.
        captured: how many of them use the gateway's captured ids.
        behaviour_logprobs: ``[seq]`` the captured log-probs on masked tokens (0.0 elsewhere)
            when every turn of the row has them, else ``None``.
    """

    input_ids: list[int]
    assistant_mask: list[int]
    turn_index: list[int]
    turns: tuple[int, ...]
    captured: int
    behaviour_logprobs: list[float] | None = None


@dataclass(frozen=True)
class LoggedRows:
    """The rows of one trajectory.

    Attributes:
        rows: the training rows (one when the whole conversation is prefix-consistent).
        links: for every pair of consecutive trained turns, whether the earlier one's
            ``prompt + completion`` is a token prefix of the later one's prompt.
        skipped: ``(turn, reason)`` for turns that are in no row.
        conversation: the rebuilt conversation.
    """

    rows: list[TrainingRow]
    links: list[bool]
    skipped: list[tuple[int, str]]
    conversation: LoggedConversation

    @property
    def prefix_consistent(self) -> bool:
        """Every trained turn is in one row (vacuously true for a single turn)."""
        return all(self.links)


@dataclass
class _TurnIds:
    turn: int
    prompt: list[int]
    completion: list[int]
    captured: bool
    logprobs: list[float] | None = field(default=None)


def _text(value: Any) -> str:
    """A step's output or a tool result as message text (JSON for anything but a string)."""
    if value is None:
        return ""
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)


def _is_turn_step(step: Step) -> bool:
    return step.token_ids is not None or (isinstance(step.input, dict) and isinstance(step.input.get("tool_calls"), list))


def _openai_call(call_id: str, name: str, arguments: Any) -> dict[str, Any]:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments if arguments is not None else {}}}


def tools_for_calls(calls: Sequence[dict[str, Any]], tools: Sequence[dict[str, Any]] | None) -> list[dict[str, Any]]:
    """The tools a turn's text is parsed with: the given ones, else one made up per called tool
    of ``calls`` (``[{"name", "arguments"}]``) from its arguments (their keys, the first one
    required: what the compact syntax's bare argument fills)."""
    if tools:
        return list(tools)
    made = {}
    for c in calls:
        keys = list(c.get("arguments") or {}) if isinstance(c.get("arguments"), dict) else []
        made[c.get("name")] = {
            "type": "function",
            "function": {"name": c.get("name"), "parameters": {"type": "object", "properties": {k: {} for k in keys}, "required": keys[:1]}},
        }
    return list(made.values())


def trajectory_conversation(
    trajectory: Trajectory,
    call_format: ToolCallFormat = "hermes",
    context: Sequence[dict[str, Any]] = (),
    tools: Sequence[dict[str, Any]] | None = None,
    query: str | None = None,
) -> LoggedConversation:
    """Rebuild the chat messages of ``trajectory`` (rules and limits in the module docstring);
    a record that kept its conversation whole gives :func:`kept_conversation` (``context`` and
    ``query`` are then not used: the kept messages hold them).

    Args:
        trajectory: a canonical trajectory.
        call_format: the syntax a captured turn's text writes its calls in (the capturing
            policy's :class:`~flow_assets.policy.chat.ChatFormat`), used to separate its text from
            its calls.
        context: messages the agent sent before the query (system prompt, examples).
        tools: the tool specifications the agent offered (OpenAI ``tools``), or ``None``.
        query: the first user message as the agent sent it, where the trajectory's ``query`` is
            the task's statement instead (the harness logs ``Task.query``; the built-in agents
            send ``Task.prompt``, e.g. ``"874*59"`` for ``"What is 874*59?"``); ``None`` uses
            ``trajectory.query``.

    Returns:
        :class:`LoggedConversation`; a tool call's id is the logged one where the log kept it,
        else ``call_<step index>``.
    """
    kept = kept_conversation(trajectory, tools)
    if kept is not None:
        return kept
    messages: list[dict[str, Any]] = [dict(m) for m in context]
    messages.append({"role": "user", "content": trajectory.query if query is None else query})
    turns: list[AssistantTurn] = []
    steps_of: list[list[int]] = []
    known = True
    pending: list[dict[str, Any]] = []  # calls of the last turn step not yet answered by an observation
    open_text: int | None = None  # turn opened by a plan text step, which a tool step may join
    decisions = [s.index for s in trajectory.steps if s.kind != "observation"]
    last_decision = decisions[-1] if decisions else None

    def open_turn(message: dict[str, Any], step: Step, captured: bool) -> int:
        messages.append(message)
        turns.append(AssistantTurn(len(messages) - 1, (), known, step.index if captured else None))
        steps_of.append([step.index])
        return len(turns) - 1

    for step in trajectory.steps:
        if step.kind == "observation":
            match = next((c for c in pending if c["name"] == step.tool), pending[0] if pending else None)
            if match is not None:
                pending.remove(match)
            call_id = match["id"] if match is not None else f"call_{step.index}"
            messages.append({"role": "tool", "tool_call_id": call_id, "content": _text(step.output)})
            open_text = None
            continue
        if _is_turn_step(step):
            calls = list((step.input or {}).get("tool_calls") or []) if isinstance(step.input, dict) else []
            calls = [{**c, "id": c.get("id") or f"call_{step.index}_{i}"} for i, c in enumerate(calls)]
            text = _text(step.output)
            if calls:
                parsed = parse_tool_calls(text, call_format, tools_for_calls(calls, tools))
                content = parsed.content if parsed.tool_calls else text
                message = {
                    "role": "assistant",
                    "content": content,
                    "tool_calls": [_openai_call(c["id"], c["name"], c.get("arguments")) for c in calls],
                }
            else:
                message = {"role": "assistant", "content": text}
            open_turn(message, step, step.token_ids is not None)
            pending, open_text = calls, None
        elif step.kind == "tool" or (step.kind == "plan" and step.tool):
            call = _openai_call(f"call_{step.index}", step.tool or "", step.input)
            if open_text is not None:  # the text of the same assistant message came first
                messages[turns[open_text].message_index]["tool_calls"] = [call]
                steps_of[open_text].append(step.index)
                open_text = None
            else:
                open_turn({"role": "assistant", "content": None, "tool_calls": [call]}, step, False)
            if step.output is not None:  # an unanswered call (the episode ended) has no result
                messages.append({"role": "tool", "tool_call_id": call["id"], "content": _text(step.output)})
            pending = []
        elif step.kind == "plan":
            open_text = open_turn({"role": "assistant", "content": _text(step.output)}, step, False)
            pending = []
        else:  # message, answer, verify: assistant text
            if open_text is not None:  # a thought and its answer written in one message (ReAct)
                message = messages[turns[open_text].message_index]
                message["content"] = f"{message['content']}\n{_text(step.output)}"
                steps_of[open_text].append(step.index)
            else:
                open_turn({"role": "assistant", "content": _text(step.output)}, step, False)
            open_text, pending = None, []
        if step.kind in _TEXT_KINDS and step.index != last_decision:
            known = False  # a user message answered this text; the trajectory does not hold it
    turns = [AssistantTurn(t.message_index, tuple(s), t.context_known, t.captured) for t, s in zip(turns, steps_of)]
    return LoggedConversation(messages, list(tools) if tools else None, tuple(turns))


def kept_conversation(trajectory: Trajectory, tools: Sequence[dict[str, Any]] | None = None) -> LoggedConversation | None:
    """The conversation a record kept whole (``metadata.messages``: OpenAI chat messages, with
    ``metadata.message_steps`` saying which steps each assistant message became; tau-bench's
    parser keeps both), or ``None`` when it kept none or the trajectory carries captured ids
    (captured ids win). Every turn's context is known, the system prompt and every user message
    included; a turn's steps are the ones its message became (none for an empty message).

    Raises:
        ValueError: ``metadata.messages`` holds a message without a ``role``.
    """
    messages = trajectory.metadata.get("messages")
    if not isinstance(messages, list) or any(step.token_ids is not None for step in trajectory.steps):
        return None
    conversation = chat_conversation(messages, tools)
    steps_at = {int(position): tuple(int(i) for i in indices) for position, indices in trajectory.metadata.get("message_steps") or []}
    turns = tuple(AssistantTurn(t.message_index, steps_at.get(t.message_index, ()), True) for t in conversation.turns)
    return LoggedConversation(conversation.messages, conversation.tools, turns)


def infer_tools(conversations: Sequence[LoggedConversation]) -> list[dict[str, Any]]:
    """Tool specifications made up from the calls of logs that kept none (tau-bench logs the
    calls, not the ``tools`` its agent offered): one function per called name, in order of first
    use, with every argument key seen in its calls; a key's JSON type where all its values share
    one (``integer`` widens to ``number``), and ``required`` the keys present in every call.
    There are no descriptions: the log holds none.

    Args:
        conversations: rebuilt conversations (their assistant ``tool_calls``).

    Returns:
        OpenAI ``tools``: ``[{"type": "function", "function": {"name", "parameters"}}]``.
    """
    kinds = {bool: "boolean", int: "integer", float: "number", str: "string", list: "array", dict: "object", type(None): "null"}
    seen: dict[str, dict[str, set[str]]] = {}
    calls: dict[str, int] = {}
    present: dict[str, dict[str, int]] = {}
    for conversation in conversations:
        for message in conversation.messages:
            for call in message.get("tool_calls") or []:
                function = call.get("function") or {}
                name, arguments = function.get("name"), function.get("arguments")
                if isinstance(arguments, str):
                    try:
                        arguments = json.loads(arguments)
                    except ValueError:
                        arguments = None
                if not name:
                    continue
                keys = seen.setdefault(name, {})
                calls[name] = calls.get(name, 0) + 1
                for key, value in (arguments or {}).items() if isinstance(arguments, dict) else ():
                    keys.setdefault(key, set()).add(kinds.get(type(value), "string"))
                    present.setdefault(name, {})[key] = present.get(name, {}).get(key, 0) + 1
    tools = []
    for name, keys in seen.items():
        properties = {}
        for key, types in keys.items():
            types = {"number"} if types == {"integer", "number"} else types
            properties[key] = {"type": next(iter(types))} if len(types) == 1 else {}
        required = [k for k in keys if present.get(name, {}).get(k, 0) == calls[name]]
        tools.append({"type": "function", "function": {"name": name, "parameters": {"type": "object", "properties": properties, "required": required}}})
    return tools


def chat_conversation(messages: Sequence[dict[str, Any]], tools: Sequence[dict[str, Any]] | None = None) -> LoggedConversation:
    """A conversation whose messages were logged whole (OpenAI chat messages: tau-bench's
    ``traj``, an OpenAI chat-messages JSONL line): every assistant message is a turn and every
    context is known. For logs with user turns after the first this is the complete source that
    :func:`trajectory_conversation` cannot rebuild from the canonical record.

    Raises:
        ValueError: a message without a ``role``.
    """
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or "role" not in m:
            raise ValueError(f"messages[{i}] has no role")
    turns = tuple(AssistantTurn(i, (), True) for i, m in enumerate(messages) if m["role"] == "assistant")
    return LoggedConversation([dict(m) for m in messages], list(tools) if tools else None, turns)


def is_token_prefix(prefix: Sequence[int], ids: Sequence[int]) -> bool:
    """``ids`` starts with ``prefix`` (token ids)."""
    return len(prefix) <= len(ids) and list(ids[: len(prefix)]) == list(prefix)


def chain_rows(turn_ids: Sequence[tuple[int, list[int], list[int]]], logprobs: Sequence[list[float] | None] | None = None, captured: Sequence[bool] | None = None) -> tuple[list[TrainingRow], list[bool]]:
    """Pack per-turn ``(turn, prompt ids, completion ids)`` into rows (module docstring):
    consecutive turns share a row while each one's ``prompt + completion`` is a token prefix of
    the next one's prompt.

    Args:
        turn_ids: per trained turn, in conversation order.
        logprobs: per turn, the captured ``[len(completion)]`` log-probs or ``None``.
        captured: per turn, whether its ids are the gateway's.

    Returns:
        ``(rows, links)``: ``links[i]`` says whether turns ``i`` and ``i + 1`` (of ``turn_ids``)
        share a row.
    """
    n = len(turn_ids)
    logprobs = list(logprobs) if logprobs is not None else [None] * n
    captured = list(captured) if captured is not None else [False] * n
    links = [is_token_prefix(turn_ids[i][1] + turn_ids[i][2], turn_ids[i + 1][1]) for i in range(n - 1)]
    rows, start = [], 0
    for end in range(n):
        if end == n - 1 or not links[end]:
            rows.append(_row([turn_ids[i] for i in range(start, end + 1)], logprobs[start : end + 1], captured[start : end + 1]))
            start = end + 1
    return rows, links


def _row(chain: list[tuple[int, list[int], list[int]]], logprobs: list[list[float] | None], captured: list[bool]) -> TrainingRow:
    _, last_prompt, last_completion = chain[-1]
    ids = list(last_prompt) + list(last_completion)
    mask, turn_index = [0] * len(ids), [-1] * len(ids)
    behaviour = [0.0] * len(ids) if all(lp is not None for lp in logprobs) else None
    for (turn, prompt, completion), lp in zip(chain, logprobs):
        start = len(prompt)
        for offset in range(len(completion)):
            mask[start + offset], turn_index[start + offset] = 1, turn
            if behaviour is not None:
                behaviour[start + offset] = lp[offset]
    return TrainingRow(ids, mask, turn_index, tuple(t for t, _, _ in chain), sum(captured), behaviour)


def cut_steps(trajectory: Trajectory) -> set[int]:
    """The steps of replies the log says were cut at their token cap (``metadata.cut_steps``,
    from an assistant message's ``finish_reason: "length"``): their turns are rendered without the
    template's closing end-of-turn token, as the policy wrote them."""
    return {int(i) for i in trajectory.metadata.get("cut_steps") or []}


def _turn_ids(
    tokenizer: PreTrainedTokenizerBase,
    conversation: LoggedConversation,
    k: int,
    trajectory: Trajectory | None,
    use_captured_ids: bool,
    fmt: ChatFormat,
    cut: set[int] = frozenset(),
) -> _TurnIds:
    """The ids of turn ``k``: captured where the step has them, else rendered (without the
    closing end-of-turn token where one of its steps is in ``cut``: :func:`cut_steps`).

    Raises:
        ValueError / jinja2.TemplateError: the turn cannot be rendered (unknown context, a
            template that does not extend a prompt with its turn, or rejects the messages).
    """
    turn = conversation.turns[k]
    step = trajectory.steps[turn.captured] if (trajectory is not None and turn.captured is not None and use_captured_ids) else None
    if step is not None and step.prompt_token_ids is not None:
        return _TurnIds(k, list(step.prompt_token_ids), list(step.token_ids or []), True, step.logprobs)
    if not turn.context_known:
        raise ValueError("a user message before this turn is not in the trajectory (the canonical form keeps only the first)")
    prompt, completion = assistant_turn_ids(tokenizer, conversation.messages, turn.message_index, conversation.tools, fmt)
    if step is not None and step.token_ids is not None:  # completion ids captured without their prompt
        return _TurnIds(k, prompt, list(step.token_ids), True, step.logprobs)
    if completion[-1:] == [tokenizer.eos_token_id] and set(turn.steps) & cut:
        completion = completion[:-1]  # cut at its token cap: the policy never sampled the end-of-turn token
    return _TurnIds(k, prompt, completion, False)


def conversation_training_rows(
    tokenizer: PreTrainedTokenizerBase,
    conversation: LoggedConversation,
    trajectory: Trajectory | None = None,
    use_captured_ids: bool = True,
    fmt: ChatFormat | None = None,
) -> LoggedRows:
    """Training rows of a conversation (module docstring).

    Args:
        tokenizer: the policy's tokenizer (its chat template renders the turns).
        conversation: from :func:`trajectory_conversation`, or built by a caller that holds the
            full logged messages (then every turn's context is known).
        trajectory: the trajectory the conversation was rebuilt from (its captured ids), if any.
        use_captured_ids: use the gateway's ids where a step has them (``False`` for a policy
            whose tokenizer is not the capturing one's).
        fmt: the template's :class:`~flow_assets.policy.chat.ChatFormat` (detected when ``None``).

    Returns:
        :class:`LoggedRows`. A turn that cannot be rendered is in ``skipped`` with the reason.

    Raises:
        ValueError: a captured id is outside the tokenizer's vocabulary (the trajectory was
            captured with another tokenizer: pass ``use_captured_ids=False``).
    """
    fmt = fmt or chat_format(tokenizer)
    done, skipped = [], []
    cut = cut_steps(trajectory) if trajectory is not None else set()
    for k in range(len(conversation.turns)):
        try:
            done.append(_turn_ids(tokenizer, conversation, k, trajectory, use_captured_ids, fmt, cut))
        except (ValueError, jinja2.TemplateError) as exc:
            skipped.append((k, str(exc)))
    vocabulary = len(tokenizer)
    for t in done:
        if t.captured and any(not 0 <= i < vocabulary for i in t.prompt + t.completion):
            where = f"trajectory {trajectory.trajectory_id!r} " if trajectory is not None else ""
            raise ValueError(
                f"{where}turn {t.turn} (step {conversation.turns[t.turn].captured}): captured ids outside this tokenizer's "
                f"{vocabulary} tokens; the trajectory was captured with another tokenizer (use_captured_ids=False)"
            )
    rows, links = chain_rows([(t.turn, t.prompt, t.completion) for t in done], [t.logprobs for t in done], [t.captured for t in done])
    return LoggedRows(rows, links, skipped, conversation)


def trajectory_rows(
    tokenizer: PreTrainedTokenizerBase,
    trajectory: Trajectory,
    context: Sequence[dict[str, Any]] = (),
    tools: Sequence[dict[str, Any]] | None = None,
    use_captured_ids: bool = True,
    fmt: ChatFormat | None = None,
    query: str | None = None,
) -> LoggedRows:
    """Training rows of a logged trajectory for the policy of ``tokenizer``:
    :func:`trajectory_conversation` then :func:`conversation_training_rows`.

    Args:
        context / tools / query: what the agent sent besides the logged turns
            (:func:`trajectory_conversation`).
        use_captured_ids / fmt: as :func:`conversation_training_rows`.

    Returns / raises: as :func:`conversation_training_rows`.
    """
    fmt = fmt or chat_format(tokenizer)
    conversation = trajectory_conversation(trajectory, fmt.tool_calls, context, tools, query)
    return conversation_training_rows(tokenizer, conversation, trajectory, use_captured_ids, fmt)


@dataclass(frozen=True)
class DriftReport:
    """How often re-rendering a captured turn gives other ids than the gateway captured.

    Attributes:
        captured_turns: turns with captured prompt and completion ids.
        compared: those whose context is known (the others cannot be re-rendered).
        differing: compared turns whose re-rendered prompt or completion ids differ.
        prompt_differs / completion_differs: of those, where.
        same_text: differing completions whose decoded text is the same (a different
            tokenisation of the same text, not a different text).
        cut_at_length: differing completions that are the captured ids followed by the
            end-of-turn token: the sampled turn stopped at its token cap, and the template closes
            every turn it renders.
        not_rendered: ``(trajectory_id, turn, reason)`` of captured turns not compared.
    """

    captured_turns: int
    compared: int
    differing: int
    prompt_differs: int
    completion_differs: int
    same_text: int
    cut_at_length: int
    not_rendered: list[tuple[str, int, str]]

    @property
    def share(self) -> float:
        """``differing / compared`` (NaN with nothing compared)."""
        return self.differing / self.compared if self.compared else float("nan")


def render_drift(
    tokenizer: PreTrainedTokenizerBase,
    trajectories: Sequence[Trajectory],
    context: Sequence[dict[str, Any]] = (),
    tools: Sequence[dict[str, Any]] | None = None,
    fmt: ChatFormat | None = None,
    queries: Callable[[Trajectory], str | None] | None = None,
) -> DriftReport:
    """For the captured turns of ``trajectories``: the share whose re-rendered ids (the
    conversation rebuilt from the trajectory's text, rendered with the policy's template as in
    :func:`trajectory_rows` with ``use_captured_ids=False``) differ from the captured ones.

    ``context`` and ``tools`` are what the agent sent besides the logged turns (the same for every
    trajectory: one agent); ``queries(trajectory)`` gives the first user message as sent where
    it is not the logged ``query`` (:func:`trajectory_conversation`). A captured turn that cannot
    be re-rendered is in ``not_rendered``.
    """
    fmt = fmt or chat_format(tokenizer)
    captured = compared = differing = prompt_differs = completion_differs = same_text = cut = 0
    not_rendered = []
    for trajectory in trajectories:
        query = queries(trajectory) if queries is not None else None
        conversation = trajectory_conversation(trajectory, fmt.tool_calls, context, tools, query)
        for k, turn in enumerate(conversation.turns):
            step = trajectory.steps[turn.captured] if turn.captured is not None else None
            if step is None or step.prompt_token_ids is None:
                continue
            captured += 1
            try:
                again = _turn_ids(tokenizer, conversation, k, None, False, fmt)
            except (ValueError, jinja2.TemplateError) as exc:
                not_rendered.append((trajectory.trajectory_id, k, str(exc)))
                continue
            compared += 1
            p, c = again.prompt != step.prompt_token_ids, again.completion != step.token_ids
            if p or c:
                differing += 1
                prompt_differs += p
                completion_differs += c
                if c and tokenizer.decode(again.completion) == tokenizer.decode(step.token_ids):
                    same_text += 1
                cut += c and again.completion == [*step.token_ids, tokenizer.eos_token_id]
    return DriftReport(captured, compared, differing, prompt_differs, completion_differs, same_text, cut, not_rendered)
