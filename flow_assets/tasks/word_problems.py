"""Arithmetic word problems with a calculator: the real-model agent's task (``make demo-real``).

A task is a one-sentence story that needs one operation (``+``, ``-`` or ``*``) on two numbers
too large to compute reliably in the head. The agent has the ``calculator`` tool
(:data:`~flow_assets.tasks.calculator.CALCULATOR_TOOL`); the expected flow is one call with the
right expression, then the answer::

    user:       A shop had 347 apples and sold 43. How many apples are left?
    assistant:  calculator(expression="347-43")           (turn 1: the story as an expression)
    tool:       304
    assistant:  304                                       (turn 2: the answer)

Nine templates, three per operation (:data:`TEMPLATES`); the agent sees two worked examples in
other wordings (:data:`WORKED_EXAMPLES`). What decides success is reading the story: whether
the policy calls the tool at all, picks the operation, and writes the numbers in the right
order. Measured on SmolLM2-135M-Instruct with these examples (96 tasks, 12 per template, when
the task was chosen): greedy about 30-40% (most multiplications and subtractions, no
additions: it answers those without the tool and gets them wrong), sampled at T = 0.5 about
25% and at T = 0.7 about 10%, and at T = 0.5 a group of 8 attempts held at least one success
for 56% of the tasks: failures the policy's own samples show how to fix, which GRPO can turn
into greedy gains. (Two tasks were rejected on the way: unit conversions, where the model did
not know most factors and never sampled them, so there was nothing to reinforce; and division
stories, which it never solved at any temperature.)

Task ids are ``word-<template>-<a>-<b>``; the held-out split is 20% of ids by hash, as for every
source, so train and held-out stories share templates but not numbers. The verifier accepts an
answer whose last integer (thousands separators ignored) is the exact result.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass
from typing import Any

from flow_assets.tasks.calculator import CALCULATOR_TOOL, calculator, calculator_conversation
from flow_assets.tasks.sources import Split, Task, is_held_out

#: template name -> (story, expression); ``a`` is the larger number for ``+`` and ``-``
TEMPLATES: dict[str, tuple[str, str]] = {
    "boxes": ("A box holds {b} eggs. How many eggs are in {a} boxes?", "{a}*{b}"),
    "bags": ("Each bag has {b} marbles. How many marbles are in {a} bags?", "{a}*{b}"),
    "buses": ("A bus has {b} seats. How many seats are there on {a} buses?", "{a}*{b}"),
    "stickers": ("Tom has {a} stickers and buys {b} more. How many stickers does he have now?", "{a}+{b}"),
    "library": ("A library had {a} books and received {b} new ones. How many books does it have now?", "{a}+{b}"),
    "farm": ("A farm has {a} sheep and {b} goats. How many animals does it have in all?", "{a}+{b}"),
    "shop": ("A shop had {a} apples and sold {b}. How many apples are left?", "{a}-{b}"),
    "tank": ("A tank held {a} liters and {b} liters leaked out. How many liters are left?", "{a}-{b}"),
    "coins": ("Sam had {a} coins and spent {b}. How many coins does he have left?", "{a}-{b}"),
}


#: the agent's worked examples (few-shot turns before the question), in wordings no task uses
WORKED_EXAMPLES: tuple[dict[str, Any], ...] = (
    *calculator_conversation("A crate holds 24 bottles. How many bottles are in 17 crates?", "17*24"),
    *calculator_conversation("Ann had 245 beads and gave away 37. How many beads does she have left?", "245-37"),
)

_INTEGER = re.compile(r"-?\d+")


def last_integer(text: str | None) -> str | None:
    """The last integer in ``text`` with thousands separators removed (``"1,440 eggs"`` ->
    ``"1440"``), or ``None``."""
    if not text:
        return None
    found = _INTEGER.findall(re.sub(r"(?<=\d),(?=\d{3}\b)", "", text))
    return found[-1] if found else None


@dataclass(frozen=True)
class WordProblemSourceConfig:
    """Attributes:
    size: stories generated, spread evenly over the templates (duplicates merged, so a few fewer).
    seed: generator seed.
    held_out_percent: share of task ids (by hash) in the held-out split.
    """

    size: int = 1000
    seed: int = 0
    held_out_percent: int = 20


class WordProblemSource:
    """Arithmetic word problems (module docstring) in a fixed order: the templates take turns.
    Multiplications draw both numbers from 12..99; additions and subtractions ``a`` from
    120..999 and ``b`` from 12..99."""

    tools: tuple[dict[str, Any], ...] = (CALCULATOR_TOOL,)

    def __init__(self, config: WordProblemSourceConfig | None = None):
        self.config = c = config or WordProblemSourceConfig()
        rng = random.Random(c.seed)
        names = list(TEMPLATES)
        seen: set[str] = set()
        self._tasks: list[Task] = []
        for k in range(c.size):
            name = names[k % len(names)]
            story, expression = TEMPLATES[name]
            a = rng.randint(12, 99) if "*" in expression else rng.randint(120, 999)
            b = rng.randint(12, 99)
            task_id = f"word-{name}-{a}-{b}"
            if task_id in seen:
                continue
            seen.add(task_id)
            question, expr = story.format(a=a, b=b), expression.format(a=a, b=b)
            answer = calculator(expr)
            self._tasks.append(
                Task(
                    task_id=task_id,
                    query=question,
                    reference=answer,
                    prompt=question,
                    demonstration=answer,
                    split="held_out" if is_held_out(task_id, c.held_out_percent) else "train",
                    source="flowopt:word_problems",
                    verifier="last_integer",
                    metadata={"expression": expr, "template": name},
                )
            )

    def tasks(self, split: Split | None = None) -> list[Task]:
        """All tasks, or those of ``split``."""
        return [t for t in self._tasks if split is None or t.split == split]

    def score(self, task: Task, answer: str | None) -> float:
        """1.0 when the last integer of ``answer`` is the exact result, else 0.0."""
        return float(last_integer(answer) == task.reference)

    def demonstration(self, task: Task) -> list[dict[str, Any]]:
        """The expert conversation: the calculator called with the story's expression, then its result."""
        return calculator_conversation(task.prompt, task.metadata["expression"])
