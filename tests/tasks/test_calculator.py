"""The built-in tool task: a safe calculator, stable splits, exact verifier."""

from flow_assets.tasks.calculator import CalculatorSource, calculator, execute_tool_call
from flow_assets.tasks.sources import is_held_out


def test_calculator_is_exact_and_refuses_everything_but_arithmetic():
    assert calculator("874*59") == "51566" and calculator("(1+2)*-3") == "-9"
    for bad in ("__import__('os')", "2**8", "1/2", "a+1", "", "9" * 65, "1+(2"):
        assert calculator(bad).startswith("Error"), bad
    assert execute_tool_call("calculator", '{"expression": "2*3"}') == "6"
    assert execute_tool_call("shell", "{}").startswith("Error")
    assert execute_tool_call("calculator", "not json").startswith("Error")


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
