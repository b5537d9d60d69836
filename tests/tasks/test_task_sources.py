"""Task sources: deterministic hash splits, verifiers, and JSONL errors that name file and line."""

import json

import pytest

from flow_assets.tasks.sources import JsonlSource, JsonlSourceConfig, ReasoningGymSource, ReasoningGymSourceConfig, is_held_out
from resources.tasks import TaskSourceResource


@pytest.fixture(scope="module")
def spell():
    return ReasoningGymSource(ReasoningGymSourceConfig(size=600, seed=3))


def test_held_out_split_is_a_fifth_of_task_ids_by_hash_and_stable(spell):
    tasks = spell.tasks()
    held = spell.tasks("held_out")
    assert 0.12 < len(held) / len(tasks) < 0.28
    assert all(t.split == ("held_out" if is_held_out(t.task_id) else "train") for t in tasks)
    again = ReasoningGymSource(ReasoningGymSourceConfig(size=600, seed=3))
    assert [t.task_id for t in again.tasks("held_out")] == [t.task_id for t in held]
    # a word is never in both splits (task ids are a hash of the question)
    assert not {t.query for t in held} & {t.query for t in spell.tasks("train")}


def test_spell_backward_verifier_rewards_the_reversed_word(spell):
    task = spell.tasks()[0]
    word = task.metadata["word"]
    assert 3 <= len(word) <= 5
    assert task.reference == word[::-1] == task.demonstration
    assert spell.score(task, word[::-1]) == 1.0
    assert spell.score(task, word[::-1] + "x") < 1.0
    assert task.prompt == f"{word}="


def test_jsonl_source_with_named_verifiers(tmp_path):
    path = tmp_path / "tasks.jsonl"
    rows = [{"task_id": f"t{i}", "query": f"capital {i}", "reference": f"City {i}"} for i in range(50)]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    exact = JsonlSource(JsonlSourceConfig(path=str(path), verifier="exact"))
    task = exact.tasks()[3]
    assert (exact.score(task, "City 3"), exact.score(task, "city 3"), exact.score(task, None)) == (1.0, 0.0, 0.0)
    ci = JsonlSource(JsonlSourceConfig(path=str(path), verifier="exact_ci"))
    assert ci.score(ci.tasks()[3], "  city   3 ") == 1.0
    contains = JsonlSource(JsonlSourceConfig(path=str(path), verifier="contains"))
    assert contains.score(contains.tasks()[3], "It is City 3.") == 1.0
    assert len(exact.tasks("train")) + len(exact.tasks("held_out")) == 50
    res = TaskSourceResource(kind="jsonl", path=str(path), verifier="contains")
    assert res.agent_id == "flowopt:jsonl" and len(res.source().tasks()) == 50


def test_jsonl_errors_name_file_and_line(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"task_id": "a", "query": "q", "reference": "r"}\n{"task_id": "b", "query": "q"}\n')
    with pytest.raises(ValueError, match=r"bad\.jsonl:2"):
        JsonlSource(JsonlSourceConfig(path=str(path)))
    with pytest.raises(ValueError, match="unknown verifier"):
        JsonlSource(JsonlSourceConfig(path=str(path), verifier="vibes"))
    with pytest.raises(ValueError, match="needs a path"):
        TaskSourceResource(kind="jsonl").source()


def test_an_agent_offers_a_tasks_own_tools_where_it_carries_them_else_the_sources():
    from flow_assets.tasks.calculator import CalculatorSource
    from flow_assets.tasks.sources import Task, task_tools

    source = CalculatorSource()
    own = [{"type": "function", "function": {"name": "lookup", "parameters": {"type": "object", "properties": {}}}}]
    task = source.tasks("train")[0]
    assert task_tools(source, task) == source.tools and source.tools
    assert task_tools(source, Task("t", "q", "r", "q", "r", "train", "s", "exact", metadata={"tools": own})) == own
    assert task_tools(source, 3) == source.tools  # a source of plain ids: nothing of its own
