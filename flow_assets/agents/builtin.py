"""The built-in agents: ordinary ``openai`` client code, as a team's own agent would be.

An agent is an ``async`` function ``agent(client, task) -> answer``: ``client`` is an
``openai.AsyncOpenAI`` already pointed at the flowopt gateway with its own rollout id, ``task``
the :class:`~flow_assets.tasks.sources.Task`. It asks for ``model="policy"``; which adapter
answers, and at which temperature during collection or evaluation, is the harness's business
(the rollout's settings), not the agent's.
"""

from __future__ import annotations

from openai import AsyncOpenAI

from flow_assets.tasks.calculator import CALCULATOR_TOOL, execute_tool_call
from flow_assets.tasks.sources import Task


async def one_turn_agent(client: AsyncOpenAI, task: Task) -> str | None:
    """One question, one answer (``spell_backward`` and JSONL tasks): the completion's text."""
    response = await client.chat.completions.create(
        model="policy", messages=[{"role": "user", "content": task.prompt}]
    )
    return response.choices[0].message.content


async def calculator_agent(client: AsyncOpenAI, task: Task, max_turns: int = 4) -> str | None:
    """A tool-using agent loop: the policy either calls ``calculator`` (the agent runs it and
    sends the result back) or answers. Returns the first answer without a tool call, or ``None``
    after ``max_turns`` LLM calls without one."""
    messages: list[dict] = [{"role": "user", "content": task.prompt}]
    for _ in range(max_turns):
        response = await client.chat.completions.create(
            model="policy", messages=messages, tools=[CALCULATOR_TOOL], max_tokens=32
        )
        message = response.choices[0].message
        if not message.tool_calls:
            return message.content
        messages.append(message.model_dump(exclude_none=True))
        for call in message.tool_calls:
            result = execute_tool_call(call.function.name, call.function.arguments)
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    return None
