"""The built-in multi-turn, tool-using task: arithmetic the agent can only answer with a tool.

A task asks for ``a + b`` or ``a * b`` (``a`` in 10..999, ``b`` in 10..99). The tiny policy cannot
compute a product of that size, so to answer it must call the ``calculator`` tool and then
answer with what the tool returned: two LLM turns with a tool call in between::

    user:       874*59
    assistant:  calculator(expression="874*59")          (turn 1: a tool call)
    tool:       51566                                     (executed by the agent, not the model)
    assistant:  51566                                     (turn 2: the answer)

The verifier accepts exactly the result (surrounding whitespace ignored). ``task_id`` is
``calculator-<expression>``, so the held-out split (20% of ids by hash, as every source) never
shares an expression with the train split.
"""

from __future__ import annotations

import ast
import json
import operator
import random
import warnings
from dataclasses import dataclass
from typing import Any

from flow_assets.tasks.sources import Split, Task, is_held_out

#: the tool as the agent offers it (OpenAI function specification)
CALCULATOR_TOOL: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluate an arithmetic expression of integers (+, -, *, parentheses) exactly.",
        "parameters": {
            "type": "object",
            "properties": {"expression": {"type": "string", "description": "for example 874*59"}},
            "required": ["expression"],
        },
    },
}

_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul}
_MAX_EXPRESSION = 64


def _evaluate(node: ast.AST) -> int:
    if isinstance(node, ast.Constant) and type(node.value) is int:
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        return _OPS[type(node.op)](_evaluate(node.left), _evaluate(node.right))
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        return -_evaluate(node.operand)
    raise ValueError("only integers, + - * and parentheses are allowed")


def calculator(expression: str) -> str:
    """The tool: the exact integer value of ``expression``, or a message starting with ``Error``
    (the convention that marks a failed tool call in the logs). Never raises."""
    if not isinstance(expression, str) or not expression.strip() or len(expression) > _MAX_EXPRESSION:
        return f"Error: expected an expression of 1-{_MAX_EXPRESSION} characters"
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", SyntaxWarning)  # e.g. "12abc": the error below says it
            tree = ast.parse(expression.strip(), mode="eval")
        return str(_evaluate(tree.body))
    except (SyntaxError, ValueError, RecursionError) as exc:
        return f"Error: {exc.__class__.__name__}: {exc}"


def execute_tool_call(name: str, arguments: str) -> str:
    """Run one OpenAI tool call (``arguments`` is its JSON text) with the calculator tools.
    Unknown tools and bad arguments give an ``Error`` result, as a real tool server would."""
    if name != "calculator":
        return f"Error: unknown tool {name!r}"
    try:
        args = json.loads(arguments)
    except json.JSONDecodeError as exc:
        return f"Error: arguments are not JSON ({exc})"
    if not isinstance(args, dict) or "expression" not in args:
        return "Error: missing argument 'expression'"
    return calculator(args["expression"])


@dataclass(frozen=True)
class CalculatorSourceConfig:
    """Attributes:
    size: tasks generated (duplicates merged, so a few fewer).
    seed: generator seed.
    ops: operators drawn from.
    held_out_percent: share of task ids (by hash) in the held-out split.
    """

    size: int = 4000
    seed: int = 0
    ops: str = "+*"
    held_out_percent: int = 20


class CalculatorSource:
    """Arithmetic tasks scored by exact match; the agent has one tool, ``calculator``."""

    tools: tuple[dict[str, Any], ...] = (CALCULATOR_TOOL,)

    def __init__(self, config: CalculatorSourceConfig | None = None):
        self.config = c = config or CalculatorSourceConfig()
        rng = random.Random(c.seed)
        seen: set[str] = set()
        self._tasks: list[Task] = []
        for _ in range(c.size):
            expression = f"{rng.randint(10, 999)}{rng.choice(c.ops)}{rng.randint(10, 99)}"
            if expression in seen:
                continue
            seen.add(expression)
            task_id = f"calculator-{expression}"
            result = calculator(expression)
            self._tasks.append(
                Task(
                    task_id=task_id,
                    query=f"What is {expression}?",
                    reference=result,
                    prompt=expression,
                    demonstration=result,
                    split="held_out" if is_held_out(task_id, c.held_out_percent) else "train",
                    source="flowopt:calculator",
                    verifier="exact",
                    metadata={"expression": expression},
                )
            )

    def tasks(self, split: Split | None = None) -> list[Task]:
        """All tasks, or those of ``split``, in generation order."""
        return [t for t in self._tasks if split is None or t.split == split]

    def score(self, task: Task, answer: str | None) -> float:
        """1.0 when ``answer`` is exactly the result (whitespace stripped), else 0.0."""
        return float(answer is not None and answer.strip() == task.reference)

    def demonstration(self, task: Task) -> list[dict[str, Any]]:
        """The conversation an expert agent has on ``task`` (OpenAI messages): a calculator call,
        its result, the answer."""
        return calculator_conversation(task.prompt, task.prompt)


def calculator_conversation(question: str, expression: str) -> list[dict[str, Any]]:
    """An expert's conversation (OpenAI messages): the user's ``question``, one calculator call
    of ``expression``, its result, and that result as the answer."""
    call = {"id": "call_0", "type": "function", "function": {"name": "calculator", "arguments": json.dumps({"expression": expression})}}
    result = calculator(expression)
    return [
        {"role": "user", "content": question},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_0", "content": result},
        {"role": "assistant", "content": result},
    ]
