"""BFCL v4 as a task source: its questions, tools and split, and a reward that is BFCL's own verdict.

The reward goes through our path (an assistant message as JSON text -> BFCL's handler parse and
decode -> BFCL's runner and checker); each case compares it with BFCL's ``ast_checker`` called
directly on the same calls in BFCL's decoded format. Needs the ``bfcl`` extra (``make install-bfcl``).
"""

import ast
import dataclasses
import json
import sys

import pytest

pytest.importorskip("bfcl_eval", reason="needs bfcl-eval: make install-bfcl")

from flow_assets.tasks import bfcl  # noqa: E402
from flow_assets.tasks.bfcl import (  # noqa: E402
    CATEGORIES, MODEL_NAME, BfclSource, BfclSourceConfig, assistant_message, bfcl_api, load_entries, model_responses,
    possible_answer_tool_calls,
)  # fmt: skip
from flow_assets.tasks.sources import is_held_out  # noqa: E402

SIZES = {"simple_python": 400, "multiple": 200, "parallel": 200, "parallel_multiple": 200, "irrelevance": 240}
HELD_OUT = {"simple_python": 128, "multiple": 59, "parallel": 48, "parallel_multiple": 52, "irrelevance": 80}


@pytest.fixture(scope="module")
def source() -> BfclSource:
    return BfclSource()


@pytest.fixture(scope="module")
def api():
    return bfcl_api()


def by_category(tasks):
    found = {}
    for task in tasks:
        found.setdefault(task.metadata["category"], []).append(task)
    return found


def test_tasks_are_the_five_ast_categories_with_a_fixed_split_by_task_id(source):
    tasks = source.tasks()
    assert {c: len(ts) for c, ts in by_category(tasks).items()} == SIZES
    assert len({t.task_id for t in tasks}) == len(tasks) == 1240
    assert all(t.split == ("held_out" if is_held_out(t.task_id, 30) else "train") for t in tasks)
    assert {c: len(ts) for c, ts in by_category(source.tasks("held_out")).items()} == HELD_OUT
    assert len(source.tasks("held_out")) == 367 >= 300
    assert [t.task_id for t in BfclSource(BfclSourceConfig(categories=("parallel",))).tasks("held_out")] == [
        t.task_id for t in source.tasks("held_out") if t.metadata["category"] == "parallel"
    ]
    first = tasks[0]
    assert first.task_id == "bfcl-v4-simple_python_0" and first.source == "bfcl:simple_python" and source.tools == ()
    assert first.metadata["messages"] == [{"role": "user", "content": first.query}] and first.prompt == first.query


def test_tools_are_bfcls_openai_conversion_of_each_tasks_function_documents(source):
    def types_in(schema):
        if isinstance(schema, dict):
            if isinstance(schema.get("type"), str):
                yield schema["type"]
            for value in schema.values():
                yield from types_in(value)
        elif isinstance(schema, list):
            for value in schema:
                yield from types_in(value)

    tasks = {t.metadata["bfcl_id"]: t for t in source.tasks()}
    (factorial,) = tasks["simple_python_1"].metadata["tools"]  # BFCL's "math.factorial"
    assert factorial["type"] == "function" and factorial["function"]["name"] == "math_factorial"
    assert factorial["function"]["parameters"]["type"] == "object"
    assert factorial["function"]["description"].endswith("Note that the provided function is in Python 3 syntax.")
    for task in source.tasks():
        entry = source.entry(task)
        assert len(task.metadata["tools"]) == len(entry.functions)
        for tool in task.metadata["tools"]:
            assert "." not in tool["function"]["name"]
            assert set(types_in(tool["function"]["parameters"])) <= {"object", "string", "integer", "number", "boolean", "array"}
    # BFCL's own call on its own entries gives the same specs
    api = bfcl_api()
    api_tools = [api.handler._compile_tools({}, entry)["tools"] for entry in api.load_dataset_entry("multiple")]
    assert api_tools == [t.metadata["tools"] for t in source.tasks() if t.metadata["category"] == "multiple"]


def _perturbed_value(value):
    """A value of the same type that no possible answer allows."""
    if isinstance(value, bool):
        return not value
    if isinstance(value, int):
        return value + 1_000_003
    if isinstance(value, float):
        return value + 1000.5
    if isinstance(value, str):
        return value + " not allowed"
    if isinstance(value, list):
        return [*value, value[0]] if value else ["not allowed"]
    if isinstance(value, dict):
        return {**value, "not_allowed": 1}
    return "not allowed"


def _perturbations(source, task):
    """The rendered possible answer, then one argument's value changed, the first call's name
    changed, and a required argument dropped."""
    entry = source.entry(task)
    calls = possible_answer_tool_calls(entry)
    yield "possible answer", calls
    first = calls[0]["function"]
    arguments = json.loads(first["arguments"])
    if arguments:
        name, value = next(iter(arguments.items()))
        yield f"value of {name}", [{**calls[0], "function": {**first, "arguments": json.dumps({**arguments, name: _perturbed_value(value)})}}, *calls[1:]]
    yield "function name", [{**calls[0], "function": {**first, "name": first["name"] + "_v2"}}, *calls[1:]]
    docs = {entry.tool_names[d["name"]]: d for d in entry.functions}
    required = [p for p in docs[first["name"]]["parameters"].get("required", []) if p in arguments]
    if required:
        rest = {k: v for k, v in arguments.items() if k != required[0]}
        yield f"without {required[0]}", [{**calls[0], "function": {**first, "arguments": json.dumps(rest)}}, *calls[1:]]


def test_reward_equals_bfcls_checker_on_its_possible_answers_and_perturbed_ones(source, api):
    verdicts, mismatches = {}, []
    for task in source.tasks():
        if task.metadata["category"] == "irrelevance":
            continue
        entry = source.entry(task)
        for kind, calls in _perturbations(source, task):
            ours = source.score(task, assistant_message(calls))
            decoded = [{c["function"]["name"]: json.loads(c["function"]["arguments"])} for c in calls]
            direct = api.ast_checker(entry.functions, decoded, entry.ground_truth, api.Language.PYTHON, entry.category, MODEL_NAME)
            verdicts.setdefault(kind.split(" ")[0], []).append(direct["valid"])
            if ours != (1.0 if direct["valid"] else 0.0):
                mismatches.append((task.task_id, kind, ours, direct))
    assert not mismatches, f"{len(mismatches)} answers where our reward is not BFCL's verdict, e.g. {mismatches[:3]}"
    assert len(verdicts["possible"]) == 1000 and all(verdicts["possible"])  # every possible answer, rendered, is right
    for kind in ("value", "function", "without"):  # every perturbed one is wrong
        assert len(verdicts[kind]) > 900 and not any(verdicts[kind]), kind


def test_irrelevance_is_right_exactly_when_the_answer_calls_no_function(source, api):
    for task in by_category(source.tasks())["irrelevance"]:
        entry = source.entry(task)
        tool = task.metadata["tools"][0]["function"]
        call = {"id": "call_0", "type": "function", "function": {"name": tool["name"], "arguments": "{}"}}
        for answer, recorded, right in [
            (task.demonstration, json.loads(task.demonstration)["content"], True),
            ("I cannot help with that.", "I cannot help with that.", True),
            (None, None, True),
            (assistant_message([call]), [{tool["name"]: "{}"}], False),
        ]:
            prompt = {"id": entry.bfcl_id, "function": entry.functions}
            direct = api.evaluate_relevance_entry(api.handler, entry.bfcl_id, recorded, prompt, MODEL_NAME, "irrelevance")
            assert direct["valid"] is right
            assert source.score(task, answer) == (1.0 if right else 0.0), (task.task_id, answer)


def test_answers_without_a_valid_call_score_zero_on_ast_tasks(source):
    task = source.tasks()[0]
    assert source.score(task, task.demonstration) == 1.0
    assert source.score(task, "The area is 25 square units.") == 0.0
    assert source.score(task, None) == 0.0
    bad_json = [{"id": "c", "type": "function", "function": {"name": "calculate_triangle_area", "arguments": "{base: 10"}}]
    assert model_responses(assistant_message(bad_json)) == [{"calculate_triangle_area": "{base: 10"}]
    assert source.score(task, assistant_message(bad_json)) == 0.0  # BFCL's decode fails: invalid
    with pytest.raises(ValueError, match="not a Chat Completions assistant message"):
        source.score(task, json.dumps({"role": "assistant", "tool_calls": [{"type": "function"}]}))


def test_demonstrations_are_conversations_that_score_one(source):
    for task in source.tasks():
        conversation = source.demonstration(task)
        assert conversation[:-1] == task.metadata["messages"] and conversation[-1]["role"] == "assistant"
        assert source.score(task, json.dumps(conversation[-1])) == 1.0, task.task_id


def test_the_checker_is_imported_without_bfcls_model_registry(api):
    # BFCL's config for its OpenAI Chat Completions FC handler compares names with dots as
    # underscores: the stand-in registry says the same for MODEL_NAME
    tree = ast.parse(open(api.prompt_path.parent / "constants" / "model_config.py").read())
    configs = [
        {k.arg: k.value for k in node.keywords}
        for node in ast.walk(tree)
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "ModelConfig"
    ]
    openai_fc = [c for c in configs if getattr(c.get("model_handler"), "id", None) == "OpenAICompletionsHandler"
                 and ast.literal_eval(c["is_fc_model"])]  # fmt: skip
    assert openai_fc and all(ast.literal_eval(c["underscore_to_dot"]) for c in openai_fc)
    # neither the stand-in nor a module bound to it stays registered; no vendor SDK was imported
    for name in ("bfcl_eval.constants.model_config", "bfcl_eval.eval_checker.ast_eval.ast_checker", "bfcl_eval.eval_checker.eval_runner"):
        assert name not in sys.modules, name
    assert not {"mistralai", "cohere", "boto3", "qwen_agent", "faiss", "sentence_transformers"} & set(sys.modules)


def test_bad_entries_name_file_line_and_field(monkeypatch, api):
    entries = api.load_dataset_entry("parallel")
    del entries[3]["function"]
    broken = dataclasses.replace(api, load_dataset_entry=lambda category, **kwargs: entries)
    monkeypatch.setattr(bfcl, "bfcl_api", lambda: broken)
    with pytest.raises(ValueError, match=r"BFCL_v4_parallel\.json:4: field 'function'"):
        load_entries("parallel")
    answers = api.load_ground_truth_entry("parallel")
    answers[5]["id"] = "parallel_999"
    shifted = dataclasses.replace(api, load_ground_truth_entry=lambda category: answers)
    monkeypatch.setattr(bfcl, "bfcl_api", lambda: shifted)
    with pytest.raises(ValueError, match=r"possible_answer/BFCL_v4_parallel\.json:6: field 'id'"):
        load_entries("parallel")
    with pytest.raises(ValueError, match="unknown BFCL categor"):
        BfclSource(BfclSourceConfig(categories=("live_simple",)))
    assert set(CATEGORIES) == set(SIZES)


def test_the_bfcl_agent_answers_through_the_gateway_and_is_scored_on_its_message(source, tmp_path):
    import asyncio
    from functools import partial

    from flow_assets.policy.sft import SFTConfig
    from flow_assets.policy.store import PolicyStore
    from flow_assets.policy.tiny_model import TinyModelConfig
    from flow_assets.training.rounds import build_base_policy
    from resources.registry import AdapterRegistry
    from flow_assets.serving.agents.builtin import bfcl_agent
    from flow_assets.serving.agents.harness import HarnessConfig, run_rollouts
    from flow_assets.serving.gateway.serve import serve_policy

    # the tiny model with room for BFCL's tool specifications (its default context is 128 positions)
    models = tmp_path / "models"
    build_base_policy(PolicyStore(str(models)), AdapterRegistry(root=str(models)), source, TinyModelConfig(max_position_embeddings=2048),
                      SFTConfig(steps=0), 1, by="test")  # fmt: skip
    picked = [ts[0] for ts in by_category(source.tasks("held_out")).values()]  # one task of each category
    landing = tmp_path / "landing"
    with serve_policy(PolicyStore(str(models)), landing) as server:
        results = asyncio.run(run_rollouts(server.url, partial(bfcl_agent, max_tokens=16), picked, source.score, 1, agent_id="flowopt:bfcl",
                                           batch="b", source="bfcl", config=HarnessConfig(temperature=0.0)))  # fmt: skip
    tasks = {t.task_id: t for t in picked}
    assert len(results) == len(picked) and all(r.error is None and r.llm_calls == 1 for r in results)
    for r in results:
        message = json.loads(r.answer)
        assert message["role"] == "assistant"
        assert r.score == source.score(tasks[r.task_id], r.answer)  # the harness scored the message BFCL's way
    (landed,) = landing.rglob("*.jsonl")
    assert sorted(json.loads(line)["task_id"] for line in landed.read_text().splitlines()) == sorted(tasks)  # every call captured


def test_the_task_source_resource_serves_bfcl_with_its_documented_split_and_agent():
    from flow_assets.serving.agents.builtin import bfcl_agent
    from resources.tasks import TaskSourceResource

    resource = TaskSourceResource(kind="bfcl")
    assert len(resource.source().tasks("held_out")) == sum(HELD_OUT.values())  # 30%, not the other kinds' 20
    assert resource.agent_fn() is bfcl_agent and resource.agent_id == "flowopt:bfcl"
    assert len(TaskSourceResource(kind="bfcl", held_out_percent=20).source().tasks("held_out")) < sum(HELD_OUT.values())
