"""BFCL's own entry point pointed at the gateway (flow_assets/tasks/bfcl_cli.py): the ids file, the
subprocess's environment, BFCL's result and score files read back, and the id-by-id comparison.
The files are written here in the format bfcl-eval 2026.3.23 writes them (eval_runner_helper.py:
save_eval_results: a header line, then one line per wrong entry); the run of the real CLI on the
gateway is `make bfcl-entry-point` (its own 1.9 GB environment, not in CI)."""

import ast
import json
import os
from pathlib import Path

import pytest

from flow_assets.tasks.bfcl_cli import ENTRY_MODEL, cli_commands, cli_environment, compare_verdicts, read_verdicts, run_ids_file
from flow_assets.settings import child_environ
from flow_assets.tasks.sources import Task


def _task(task_id: str, meta: dict) -> Task:
    return Task(task_id, "q", "r", "q", "r", "held_out", "bfcl", "bfcl:ast", meta)


def _write(root: Path, kind: str, category: str, rows: list[dict]) -> Path:
    path = root / kind / "openbmb_MiniCPM-SALA-FC" / "non_live" / f"BFCL_v4_{category}_{kind}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _bfcl_run(root: Path, generated: dict[str, list[str]], wrong: set[str]) -> None:
    for category, ids in generated.items():
        _write(root, "result", category, [{"id": i, "result": "prose"} for i in ids])
        bad = [i for i in ids if i in wrong]
        header = {"accuracy": (len(ids) - len(bad)) / len(ids), "correct_count": len(ids) - len(bad), "total_count": len(ids)}
        _write(root, "score", category, [header, *({"id": i, "valid": False, "error_type": "ast_decoder:decoder_failed"} for i in bad)])


def test_the_ids_file_groups_bfcl_ids_by_category_in_task_order():
    tasks = [_task("bfcl-v4-parallel_3", {"bfcl_id": "parallel_3", "category": "parallel"}),
             _task("bfcl-v4-irrelevance_9", {"bfcl_id": "irrelevance_9", "category": "irrelevance"}),
             _task("bfcl-v4-parallel_1", {"bfcl_id": "parallel_1", "category": "parallel"})]  # fmt: skip
    assert run_ids_file(tasks) == {"parallel": ["parallel_3", "parallel_1"], "irrelevance": ["irrelevance_9"]}
    with pytest.raises(ValueError, match="'calculator-1' is not a BFCL task"):
        run_ids_file([_task("calculator-1", {})])


def test_the_cli_gets_the_gateway_in_its_own_environment_and_ours_stays_as_it_is():
    before = dict(os.environ)
    env = child_environ(cli_environment("http://127.0.0.1:9/v1", "/x/bfcl"))
    assert env["OPENAI_BASE_URL"] == "http://127.0.0.1:9/v1" and env["BFCL_PROJECT_ROOT"] == "/x/bfcl" and env["OPENAI_API_KEY"]
    assert dict(os.environ) == before and env["PATH"] == os.environ["PATH"]
    generate, evaluate = cli_commands("/v/bin/python", ["simple_python", "irrelevance"], 0.0, 64)
    assert generate[:4] == ["/v/bin/python", "-m", "bfcl_eval", "generate"] and "--run-ids" in generate
    assert generate[generate.index("--model") + 1] == ENTRY_MODEL and generate[generate.index("--temperature") + 1] == "0.0"
    assert evaluate[3] == "evaluate" and "--partial-eval" in evaluate and evaluate[evaluate.index("--test-category") + 1] == "simple_python,irrelevance"


def test_the_entry_model_is_bfcls_plain_openai_chat_completions_fc_handler():
    bfcl_eval = pytest.importorskip("bfcl_eval", reason="needs bfcl-eval: make install-bfcl")
    tree = ast.parse((Path(bfcl_eval.__file__).parent / "constants" / "model_config.py").read_text())
    entries = {
        ast.literal_eval(key): {k.arg: k.value for k in value.keywords}
        for node in ast.walk(tree) if isinstance(node, ast.Dict)
        for key, value in zip(node.keys, node.values)
        if isinstance(key, ast.Constant) and isinstance(value, ast.Call) and getattr(value.func, "id", None) == "ModelConfig"
    }  # fmt: skip
    entry = entries[ENTRY_MODEL]
    assert entry["model_handler"].id == "OpenAICompletionsHandler"
    assert ast.literal_eval(entry["is_fc_model"]) and ast.literal_eval(entry["underscore_to_dot"])


def test_bfcls_verdicts_are_read_from_its_result_and_score_files(tmp_path):
    _bfcl_run(tmp_path, {"parallel": ["parallel_1", "parallel_3"], "irrelevance": ["irrelevance_9"]}, wrong={"parallel_3"})
    verdicts, headers = read_verdicts(tmp_path, ["parallel", "irrelevance"])
    assert verdicts == {"parallel_1": True, "parallel_3": False, "irrelevance_9": True}
    assert headers["parallel"] == {"accuracy": 0.5, "correct_count": 1, "total_count": 2}
    with pytest.raises(FileNotFoundError, match="BFCL_v4_multiple_result.json"):
        read_verdicts(tmp_path, ["multiple"])


def test_bfcl_files_that_disagree_or_do_not_parse_are_refused_with_file_and_line(tmp_path):
    _bfcl_run(tmp_path, {"parallel": ["parallel_1", "parallel_3"]}, wrong={"parallel_3"})
    score = next(tmp_path.glob("score/*/non_live/BFCL_v4_parallel_score.json"))
    lines = score.read_text().splitlines()
    score.write_text("\n".join([json.dumps({"accuracy": 1.0, "correct_count": 2, "total_count": 2}), *lines[1:]]) + "\n")
    with pytest.raises(ValueError, match="disagree with 2 generated ids and 1 listed as wrong"):
        read_verdicts(tmp_path, ["parallel"])
    score.write_text("\n".join([lines[0], "{not json"]) + "\n")
    with pytest.raises(ValueError, match=r"BFCL_v4_parallel_score.json:2: not JSON"):
        read_verdicts(tmp_path, ["parallel"])
    score.write_text("\n".join([lines[0], json.dumps({"valid": False})]) + "\n")
    with pytest.raises(ValueError, match=r"BFCL_v4_parallel_score.json:2: a row without 'id'"):
        read_verdicts(tmp_path, ["parallel"])
    # blank lines are skipped, and the error still names the line the row is on
    score.write_text("\n".join([lines[0], "", "", json.dumps({"valid": False})]) + "\n")
    with pytest.raises(ValueError, match=r"BFCL_v4_parallel_score.json:4: a row without 'id'"):
        read_verdicts(tmp_path, ["parallel"])


def test_the_comparison_counts_agreement_per_category_and_names_each_disagreement():
    category_of = {"parallel_1": "parallel", "parallel_3": "parallel", "irrelevance_9": "irrelevance"}
    ours = {"parallel_1": True, "parallel_3": True, "irrelevance_9": True}
    theirs = {"parallel_1": True, "parallel_3": False, "irrelevance_9": True}
    table = compare_verdicts(ours, theirs, category_of)
    assert table["parallel"] == {"n": 2, "flowopt": 1.0, "bfcl": 0.5, "agree": 1, "only_flowopt": ["parallel_3"], "only_bfcl": []}
    assert table["overall"]["agree"] == 2 and table["overall"]["n"] == 3 and table["irrelevance"]["agree"] == 1
    with pytest.raises(ValueError, match="1 only by flowopt"):
        compare_verdicts(ours, {"parallel_1": True, "irrelevance_9": True}, category_of)
