"""An agent that writes its own text log while it works, as a team's agent talking to any
OpenAI-compatible server would: no token ids, only what the API returns.

:func:`text_logging_agent` wraps an agent ``agent(client, task)`` (:mod:`.builtin`): the client
it gets records each chat completion the agent asks for, and when the episode ends one line is
appended to a JSONL file in the ``openai-chat`` format (docs/log-format.md)::

    {"messages": [<the agent's fixed context>, user, assistant, tool, ..., assistant],
     "tools": [...], "model": "policy", "task_id": ..., "agent_id": ..., "adapter_version": ...,
     "trajectory_id": ..., "timestamp": ..., "reward": 1.0, "success": true,
     "metadata": {"temperature": 0.5, "context_messages": 8}}

``messages`` is the last call's request followed by its reply: the whole conversation the
policy saw and wrote (tool results of calls made after the last LLM call were never shown to
the policy and are not logged); an assistant message that was a reply cut at its token cap
carries that reply's ``finish_reason: "length"``. ``adapter_version`` is the version the server reported for
the last call (``system_fingerprint``, which the flowopt gateway sets to the adapter that
answered; ``null`` where a server reports none); ``reward`` and ``success`` are the task
source's verifier on the agent's answer (success: reward 1). ``metadata.context_messages``
counts the messages before the query (system prompt, worked examples), so the lake keeps them
and can render every turn with them; ``metadata.temperature`` is the temperature the agent is
served at (the deployment's setting, or what the agent asked for).
"""

from __future__ import annotations

import datetime
import json
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from flow_assets.serving.agents.harness import AgentFn
from flow_assets.tasks.sources import Task

if TYPE_CHECKING:
    from openai import AsyncOpenAI


class _RecordingCompletions:
    """``client.chat.completions`` that remembers the last request and reply, and every reply's
    text with its ``finish_reason``."""

    def __init__(self, completions: Any):
        self._completions = completions
        self.request: dict[str, Any] | None = None
        self.response: Any = None
        self.calls = 0
        #: ``(content, finish_reason)`` of each reply, in order
        self.finishes: list[tuple[str | None, str | None]] = []

    async def create(self, **kwargs: Any) -> Any:
        """Forward to the real ``create``; keep a copy of the request's messages and tools."""
        response = await self._completions.create(**kwargs)
        self.request = {**kwargs, "messages": [dict(m) if isinstance(m, dict) else m for m in kwargs.get("messages", [])]}
        self.response, self.calls = response, self.calls + 1
        choice = response.choices[0]
        self.finishes.append((choice.message.content, choice.finish_reason))
        return response


class _Chat:
    def __init__(self, completions: _RecordingCompletions):
        self.completions = completions


class RecordingClient:
    """An ``openai.AsyncOpenAI`` whose ``chat.completions.create`` is recorded
    (:class:`_RecordingCompletions`); every other attribute is the wrapped client's."""

    def __init__(self, client: AsyncOpenAI):
        self._client = client
        self.recorder = _RecordingCompletions(client.chat.completions)
        self.chat = _Chat(self.recorder)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._client, name)


def episode_record(
    recorder: _RecordingCompletions,
    task: Task,
    agent_id: str,
    reward: float,
    temperature: float | None,
    context_messages: int,
) -> dict[str, Any] | None:
    """The ``openai-chat`` line of one episode (module docstring), or ``None`` when the agent made
    no LLM call. ``reward`` is the verifier's score of the agent's answer."""
    if recorder.request is None or recorder.response is None:
        return None
    reply = recorder.response.choices[0].message.model_dump(exclude_none=True)
    reply = {k: v for k, v in reply.items() if k in ("role", "content", "tool_calls")}
    messages = [*recorder.request["messages"], reply]
    # the episode's assistant messages are its replies in order, as the agent sent them back; a
    # reply cut at its token cap says so (``finish_reason``), so training does not close it with
    # an end-of-turn token the policy never sampled
    replies = [i for i, m in enumerate(messages) if i >= context_messages and isinstance(m, dict) and m.get("role") == "assistant"]
    for i, (content, finish) in zip(replies, recorder.finishes):
        if finish == "length" and messages[i].get("content") == content:
            messages[i] = {**messages[i], "finish_reason": finish}
    asked = recorder.request.get("temperature")
    served = temperature if temperature is not None else asked
    metadata: dict[str, Any] = {"context_messages": context_messages, "llm_calls": recorder.calls}
    if served is not None:
        metadata["temperature"] = float(served)
    return {
        "messages": messages,
        "tools": recorder.request.get("tools") or [],
        "model": getattr(recorder.response, "model", None),
        "task_id": task.task_id,
        "agent_id": agent_id,
        "adapter_version": getattr(recorder.response, "system_fingerprint", None),
        "trajectory_id": f"text/{task.task_id}/{uuid.uuid4().hex[:12]}",
        "timestamp": datetime.datetime.now(datetime.timezone.utc).isoformat(),
        "reward": float(reward),
        "success": reward >= 1.0,
        "metadata": metadata,
    }


def text_logging_agent(
    agent: AgentFn,
    path: str | Path,
    agent_id: str,
    score: Callable[[Task, str | None], float],
    context_messages: int,
    temperature: float | None = None,
) -> AgentFn:
    """``agent`` writing its own text log: one ``openai-chat`` line per episode appended to
    ``path`` (module docstring) when the agent returns; an agent that raises logs nothing.

    Args:
        agent: ``async agent(client, task) -> answer``.
        path: the JSONL file (its folder is created; lines are appended).
        agent_id: the ``agent_id`` written on every line.
        score: the task source's verifier, ``score(task, answer) -> reward``.
        context_messages: how many messages the agent sends before the task's query (its system
            prompt and worked examples: ``len(WORKED_EXAMPLES)`` for ``word_problem_agent``).
        temperature: the temperature the agent is served at, where the agent does not ask for
            one itself (``None``: the one it asked for, else none is logged).

    Returns:
        An agent function with the same signature and answer.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)

    async def logged(client: AsyncOpenAI, task: Task) -> str | None:
        recording = RecordingClient(client)
        answer = await agent(recording, task)
        record = episode_record(recording.recorder, task, agent_id, float(score(task, answer)), temperature, context_messages)
        if record is not None:
            with path.open("a") as handle:  # one write per line, from the event loop's one thread
                handle.write(json.dumps(record, ensure_ascii=False) + "\n")
        return answer

    return logged
