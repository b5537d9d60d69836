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

import json
import random
import re
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

_MAX_EXPRESSION = 64
_TOKEN = re.compile(r"([0-9]+)|(\S)")  # whitespace between tokens is skipped


class _Expression:
    """Integer arithmetic, parsed and evaluated at once by recursive descent (Python's
    precedence: unary minus over ``*`` over ``+`` / ``-``, left to right)::

        expression := term (("+" | "-") term)*
        term       := factor ("*" factor)*
        factor     := "-" factor | integer | "(" expression ")"

    Pure and thread-safe: the agents call the tool from many threads at once. ``ast.parse`` is
    not (CPython 3.11 raises a spurious ``SystemError`` when threads compile at the same time,
    python/cpython#106905), nor is silencing its ``SyntaxWarning`` (``warnings.catch_warnings``
    swaps process-wide filters). Depth is bounded by the expression's length.

    Raises:
        SyntaxError: not an expression of that grammar (a message with the position).
        ValueError: a character no integer arithmetic uses (``/``, ``**``, names, ...).
    """

    def __init__(self, text: str):
        self.tokens: list[tuple[int, str]] = []  # (position, token)
        for match in _TOKEN.finditer(text):
            if match.group(1) is not None:
                self.tokens.append((match.start(1), match.group(1)))
            elif match.group(2) is not None:
                char = match.group(2)
                if char not in "+-*()":
                    raise ValueError(f"{char!r} at position {match.start(2)}: only integers, + - * and parentheses are allowed")
                self.tokens.append((match.start(2), char))
        self.at = 0

    def _peek(self) -> str | None:
        return self.tokens[self.at][1] if self.at < len(self.tokens) else None

    def _fail(self, expected: str) -> SyntaxError:
        if self.at >= len(self.tokens):
            return SyntaxError(f"expected {expected} at the end")
        where, found = self.tokens[self.at]
        return SyntaxError(f"expected {expected} at position {where}, found {found!r}")

    def value(self) -> int:
        result = self._expression()
        if self._peek() is not None:
            raise self._fail("an operator")
        return result

    def _expression(self) -> int:
        result = self._term()
        while (op := self._peek()) in ("+", "-"):
            self.at += 1
            right = self._term()
            result = result + right if op == "+" else result - right
        return result

    def _term(self) -> int:
        result = self._factor()
        while self._peek() == "*":
            self.at += 1
            result *= self._factor()
        return result

    def _factor(self) -> int:
        token = self._peek()
        if token == "-":
            self.at += 1
            return -self._factor()
        if token == "(":
            self.at += 1
            result = self._expression()
            if self._peek() != ")":
                raise self._fail("')'")
            self.at += 1
            return result
        if token is not None and token.isdigit():
            self.at += 1
            return int(token)
        raise self._fail("an integer or '('")


def calculator(expression: str) -> str:
    """The tool: the exact integer value of ``expression`` (integers, ``+ - *``, unary minus,
    parentheses; at most 64 characters), or a message starting with ``Error`` (the convention
    that marks a failed tool call in the logs). Never raises; safe to call from many threads."""
    if not isinstance(expression, str) or not expression.strip() or len(expression) > _MAX_EXPRESSION:
        return f"Error: expected an expression of 1-{_MAX_EXPRESSION} characters"
    try:
        return str(_Expression(expression).value())
    except (SyntaxError, ValueError) as exc:
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
