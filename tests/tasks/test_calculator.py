"""The built-in tool task: a safe calculator, stable splits, exact verifier."""

import random

from flow_assets.tasks.calculator import CalculatorSource, calculator, execute_tool_call
from flow_assets.tasks.sources import is_held_out


def test_calculator_is_exact_and_refuses_everything_but_arithmetic():
    assert calculator("874*59") == "51566" and calculator("(1+2)*-3") == "-9"
    for bad in ("__import__('os')", "2**8", "1/2", "a+1", "", "9" * 65, "1+(2"):
        assert calculator(bad).startswith("Error"), bad
    assert execute_tool_call("calculator", '{"expression": "2*3"}') == "6"
    assert execute_tool_call("shell", "{}").startswith("Error")
    assert execute_tool_call("calculator", "not json").startswith("Error")


def _random_expression(rng: random.Random, depth: int = 0) -> str:
    """A random expression of the tool's grammar: integers, + - *, unary minus, parentheses."""
    if depth >= 3 or rng.random() < 0.3:
        return str(rng.randint(0, 999))
    roll = rng.random()
    if roll < 0.15:
        return "-" + _random_expression(rng, depth + 1)
    if roll < 0.3:
        return "(" + _random_expression(rng, depth + 1) + ")"
    op = rng.choice(["+", "-", "*", " + ", " * "])
    return _random_expression(rng, depth + 1) + op + _random_expression(rng, depth + 1)


def test_calculator_follows_pythons_precedence_on_random_expressions():
    # Python's own arithmetic is the reference: unary minus binds tighter than *, * than + and -,
    # all left to right
    rng = random.Random(7)
    checked = 0
    for _ in range(2000):
        expression = _random_expression(rng)
        if len(expression) > 64:
            continue
        assert calculator(expression) == str(eval(expression, {"__builtins__": {}})), expression  # noqa: S307
        checked += 1
    assert checked > 1000


def test_calculator_errors_say_where():
    assert calculator("1+(2") == "Error: SyntaxError: expected ')' at the end"
    assert calculator("1 2") == "Error: SyntaxError: expected an operator at position 2, found '2'"
    assert calculator("12abc").startswith("Error: ValueError: 'a' at position 2")
    assert calculator("+3").startswith("Error: SyntaxError")  # unary plus is not offered
    assert calculator(" 874 * 59\n") == "51566"


def test_tasks_need_the_tool_and_split_by_hash():
    source = CalculatorSource()
    tasks = source.tasks()
    assert len({t.task_id for t in tasks}) == len(tasks) > 3900
    assert all(t.split == ("held_out" if is_held_out(t.task_id) else "train") for t in tasks)
    held = len(source.tasks("held_out")) / len(tasks)
    assert 0.17 < held < 0.23
    task = tasks[0]
    assert source.score(task, f" {task.reference}\n") == 1.0 and source.score(task, None) == 0.0
    assert source.score(task, str(int(task.reference) + 1)) == 0.0
    assert CalculatorSource().tasks() == tasks  # same seed, same tasks
