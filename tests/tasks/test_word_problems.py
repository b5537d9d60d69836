"""The real-model agent's task: arithmetic word problems, their split, verifier and demonstrations."""

import json

from flow_assets.tasks.calculator import calculator
from flow_assets.tasks.sources import is_held_out
from flow_assets.tasks.word_problems import TEMPLATES, WORKED_EXAMPLES, WordProblemSource, WordProblemSourceConfig, last_integer


def test_every_template_and_operation_is_in_both_splits_with_exact_references():
    source = WordProblemSource()
    tasks = source.tasks()
    assert len(source.tasks("held_out")) >= 200  # the demo's held-out evaluation size
    for split in ("train", "held_out"):
        assert {t.metadata["template"] for t in source.tasks(split)} == set(TEMPLATES)
    for t in tasks:
        assert t.split == ("held_out" if is_held_out(t.task_id) else "train")
        assert t.reference == calculator(t.metadata["expression"]) and int(t.reference) > 0
    assert {op for _, e in TEMPLATES.values() for op in "+-*" if op in e} == set("+-*")
    assert [t.task_id for t in WordProblemSource().tasks()] == [t.task_id for t in tasks]  # same order, same ids
    assert [t.task_id for t in WordProblemSource(WordProblemSourceConfig(seed=1)).tasks()] != [t.task_id for t in tasks]


def test_the_verifier_reads_the_last_integer_of_the_answer():
    task = next(t for t in WordProblemSource().tasks() if int(t.reference) >= 1000)
    ref = int(task.reference)
    assert WordProblemSource().score(task, task.reference) == 1.0
    assert WordProblemSource().score(task, f"There are {ref:,} eggs in all.") == 1.0
    assert WordProblemSource().score(task, f"{ref} or maybe {ref + 1}") == 0.0
    assert WordProblemSource().score(task, None) == 0.0 and WordProblemSource().score(task, "many") == 0.0
    assert last_integer("1,440 minutes and -3") == "-3" and last_integer("12,34") == "34"


def test_demonstrations_and_worked_examples_call_the_calculator_with_the_story_expression():
    source = WordProblemSource()
    task = source.tasks("train")[0]
    user, call, result, answer = source.demonstration(task)
    assert user == {"role": "user", "content": task.prompt}
    assert json.loads(call["tool_calls"][0]["function"]["arguments"]) == {"expression": task.metadata["expression"]}
    assert result["content"] == answer["content"] == task.reference
    questions = [m["content"] for m in WORKED_EXAMPLES if m["role"] == "user"]
    assert len(questions) == 2 and not set(questions) & {t.prompt for t in source.tasks()}
