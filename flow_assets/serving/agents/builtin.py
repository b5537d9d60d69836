"""The built-in agents: ordinary ``openai`` client code, as a team's own agent would be.

An agent is an ``async`` function ``agent(client, task) -> answer``: ``client`` is an
``openai.AsyncOpenAI`` already pointed at the flowopt gateway with its own rollout id, ``task``
the :class:`~flow_assets.tasks.sources.Task`. It asks for ``model="policy"``; which adapter
answers, and at which temperature during collection or evaluation, is the harness's business
(the rollout's settings), not the agent's.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from flow_assets.tasks.calculator import CALCULATOR_TOOL, execute_tool_call
from flow_assets.tasks.word_problems import WORKED_EXAMPLES
from flow_assets.tasks.sources import Task

if TYPE_CHECKING:
    from openai import AsyncOpenAI


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
    return await calculator_loop(client, [{"role": "user", "content": task.prompt}], max_turns, max_tokens=32)


async def word_problem_agent(client: AsyncOpenAI, task: Task, max_turns: int = 3) -> str | None:
    """The real-model agent of :mod:`flow_assets.tasks.word_problems`: two worked examples (a
    question, a calculator call, its result, the answer), then the task's question, in the
    :func:`calculator_loop`. A call's completion is capped at 48 tokens (a Hermes calculator call
    is about 30)."""
    messages = [*WORKED_EXAMPLES, {"role": "user", "content": task.prompt}]
    return await calculator_loop(client, messages, max_turns, max_tokens=48)


async def calculator_loop(client: AsyncOpenAI, messages: list[dict], max_turns: int, max_tokens: int) -> str | None:
    """Call the policy with ``messages`` and the calculator tool; run every call it makes and
    send the results back, until it answers without a call (that answer is returned) or
    ``max_turns`` LLM calls were made (``None``). ``messages`` grows with the conversation."""
    for _ in range(max_turns):
        response = await client.chat.completions.create(
            model="policy", messages=messages, tools=[CALCULATOR_TOOL], max_tokens=max_tokens
        )
        message = response.choices[0].message
        if not message.tool_calls:
            return message.content
        messages.append(message.model_dump(exclude_none=True))
        for call in message.tool_calls:
            result = execute_tool_call(call.function.name, call.function.arguments)
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    return None


#: completion cap of a BFCL call, tokens: a Hermes call of BFCL's longer possible answers
#: (parallel_multiple: four calls with their arguments) runs to about 200
BFCL_MAX_TOKENS = 256


async def bfcl_agent(client: AsyncOpenAI, task: Task, max_tokens: int = BFCL_MAX_TOKENS) -> str | None:
    """The agent of :class:`~flow_assets.tasks.bfcl.BfclSource`: one call, as BFCL's OpenAI Chat
    Completions FC handler makes it (the question's messages, the task's own tools as ``tools=``,
    nothing added), and the assistant message it got back as JSON text, which
    :meth:`~flow_assets.tasks.bfcl.BfclSource.score` hands to BFCL's parser and checker. The tools
    are never run: BFCL's AST categories judge the calls, not their results."""
    response = await client.chat.completions.create(
        model="policy", messages=task.metadata["messages"], tools=task.metadata["tools"], max_tokens=max_tokens
    )
    return response.choices[0].message.model_dump_json()

