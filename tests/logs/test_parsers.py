"""Format parsers and detection on the real logs in ../shared/data (facts from their READMEs)."""

from __future__ import annotations

import hashlib
import json
import re
import statistics
import string
from collections import Counter
from datetime import datetime
from pathlib import Path

import orjson
import pytest

from flow_assets.logs.formats.fireact import agent_id_from_name
from flow_assets.logs.reader import FORMATS, detect_format, parse_file
from flow_assets.logs.records import ParseResult, UnreadableLogError
from flow_assets.logs.schema import Trajectory, json_schema

REPO = Path(__file__).resolve().parents[2]

# (relative path, simulations, reward == 1, tool calls per trajectory min/median/max): tau2 README.
_SONNET = "claude-sonnet-4-5_aide-platform_2025-10-31"
_IRONSHELL = "ironshell-ironforge_ironshell-ui_2026-03-09"
TAU2 = [
    ("toolorchestra_nvidia_2025-12-02/toolorchestra_airline_gpt-5_1trial.json", 50, 28, (1, 8, 93)),
    ("button-claude-opus-4-6_distyl-ai_2026-03-04/airline.json", 50, 38, (1, 7, 39)),
    (f"{_SONNET}/claude-sonnet-4-5_airline_default_gpt4.1_1trials.json", 50, 36, (1, 7, 36)),
    (f"{_IRONSHELL}/ironshell_airline_gpt54_run1.json", 50, 28, (1, 6, 37)),
    (f"{_IRONSHELL}/ironshell_airline_opus46_run1.json", 44, 31, (2, 7, 51)),
]
# Tool messages flagged error=true per file (toolorchestra omits the flag; its 6 failures are
# recognised by their "Error" text).
TAU2_TOOL_ERRORS = [6, 0, 1, 2, 2]
TAU2_AGENTS = [
    "llm_agent:gpt-4.1-mini-2025-04-14",
    "experimental_agent:claude-opus-4-6",
    "llm_agent:claude-sonnet-4-5",
    "llm_agent:gpt-5.4",
    "llm_agent:claude-opus-4-6",
]
# (file, questions, reward True, actions per trajectory min/median/max, agent): FireAct README.
FIREACT = [
    ("hotpotqa_dev_0_500_ft_gpt-3.5-turbo-0613_princeton-nlp__7woQRsdi_0.0_"
     "2023-09-21-16-19-51.json",
     465, 200, (1, 3, 11), "fireact:gpt-3.5-turbo-0613-ft"),
    ("hotpotqa_dev_0_500_llama_models_lora_llama-2-13b-d_1000_0.7_2023-09-18-13-40-08.json",
     499, 172, (2, 3, 10), "fireact:llama-2-13b-lora"),
    ("hotpotqa_dev_0_500_llama_models_lora_llama-2-7b-d_1000_0.7_2023-09-19-00-49-36.json",
     500, 131, (2, 3, 10), "fireact:llama-2-7b-lora"),
]


def _trajectories(result: ParseResult) -> list[Trajectory]:
    return [record.trajectory for record in result.valid]


def _spread(values: list[int]) -> tuple[int, float, int]:
    return min(values), statistics.median(values), max(values)


def _all_real_files(shared: Path) -> list[tuple[Path, str]]:
    return (
        [(shared / "tau-bench" / "gpt-4o-airline.json", "tau-bench")]
        + [(shared / "tau2-bench" / rel, "tau2") for rel, *_ in TAU2]
        + [(shared / "fireact" / name, "fireact") for name, *_ in FIREACT]
    )


@pytest.fixture(scope="module")
def tau_bench_path(shared_data: Path) -> Path:
    return shared_data / "tau-bench" / "gpt-4o-airline.json"


@pytest.fixture(scope="module")
def tau_bench(tau_bench_path: Path) -> ParseResult:
    return parse_file(tau_bench_path)


@pytest.fixture(scope="module")
def tau_bench_raw(tau_bench_path: Path) -> list[dict]:
    return orjson.loads(tau_bench_path.read_bytes())


# ---------------------------------------------------------------- tau-bench


def test_tau_bench_gives_200_runs_of_50_tasks_with_4_trials_each(tau_bench: ParseResult):
    trajectories = _trajectories(tau_bench)
    assert (len(trajectories), len(tau_bench.quarantined), tau_bench.records_read) == (200, 0, 200)
    trials_per_task = Counter(t.task_id for t in trajectories)
    assert len(trials_per_task) == 50 and set(trials_per_task.values()) == {4}
    assert {t.metadata["trial"] for t in trajectories} == {0, 1, 2, 3}
    assert all(isinstance(t.task_id, str) for t in trajectories)


def test_tau_bench_success_is_reward_1_for_84_runs(
    tau_bench: ParseResult, tau_bench_raw: list[dict]
):
    trajectories = _trajectories(tau_bench)
    assert sum(t.outcome.success for t in trajectories) == 84
    assert [t.outcome.score for t in trajectories] == [run["reward"] for run in tau_bench_raw]
    # README: successes per task out of 4 -> 0/4: 14 tasks, 1/4: 12, 2/4: 10, 3/4: 4, 4/4: 10.
    per_task = Counter()
    for t in trajectories:
        per_task[t.task_id] += t.outcome.success
    assert Counter(per_task.values()) == {0: 14, 1: 12, 2: 10, 3: 4, 4: 10}


def test_tau_bench_trajectory_ids_are_stem_task_trial(tau_bench: ParseResult):
    ids = [t.trajectory_id for t in _trajectories(tau_bench)]
    assert len(set(ids)) == 200
    assert ids[0] == "gpt-4o-airline/task0/trial0"
    assert {t.agent_id for t in _trajectories(tau_bench)} == {"gpt-4o-airline"}


def test_tau_bench_tool_calls_per_trajectory_match_readme(tau_bench: ParseResult):
    trajectories = _trajectories(tau_bench)
    # README counts think calls as tool calls: min 0, median 5, mean 5.8, max 27.
    calls = [sum(1 for s in t.steps if s.tool is not None) for t in trajectories]
    assert _spread(calls) == (0, 5, 27) and sum(calls) == 1164
    # Our mapping makes the 92 think calls plan steps, leaving 1072 tool steps (0/5/25).
    tool_steps = [sum(1 for s in t.steps if s.kind == "tool") for t in trajectories]
    assert _spread(tool_steps) == (0, 5, 25) and sum(tool_steps) == 1072
    thinks = [s for t in trajectories for s in t.steps if s.tool == "think"]
    assert len(thinks) == 92 and {s.kind for s in thinks} == {"plan"}
    assert len({s.tool for t in trajectories for s in t.steps if s.tool}) == 14


def test_tau_bench_tool_output_is_the_result_of_that_very_call(
    tau_bench: ParseResult, tau_bench_raw: list[dict]
):
    # tau-bench reuses tool_call ids within an episode, so matching by id alone would attach
    # the wrong result; in the file every call is answered by the message right after it.
    reused = sum(
        n > 1
        for run in tau_bench_raw
        for n in Counter(m["tool_call_id"] for m in run["traj"] if m["role"] == "tool").values()
    )
    assert reused == 71
    for run, trajectory in zip(tau_bench_raw, _trajectories(tau_bench), strict=True):
        expected = [
            run["traj"][i + 1]["content"] for i, m in enumerate(run["traj"]) if m.get("tool_calls")
        ]
        assert [s.output for s in trajectory.steps if s.tool is not None] == expected


def test_tau_bench_tool_arguments_are_parsed_to_dicts(tau_bench: ParseResult):
    inputs = [s.input for t in _trajectories(tau_bench) for s in t.steps if s.tool is not None]
    assert all(isinstance(i, dict) for i in inputs)
    assert {"user_id": "mia_li_3668"} in inputs


def test_tau_bench_error_status_marks_results_starting_with_error(tau_bench: ParseResult):
    steps = [s for t in _trajectories(tau_bench) for s in t.steps if s.tool is not None]
    failed = [s for s in steps if s.status == "error"]
    assert len(failed) == 73
    assert all(s.output.startswith("Error") for s in failed)
    assert not any(s.output.startswith("Error") for s in steps if s.status == "ok")


def test_last_assistant_text_is_the_answer_and_the_final_answer(
    tau_bench: ParseResult, tau_bench_raw: list[dict]
):
    for run, t in zip(tau_bench_raw, _trajectories(tau_bench), strict=True):
        texts = [
            m["content"]
            for m in run["traj"]
            if m["role"] == "assistant" and not m.get("tool_calls") and m["content"]
        ]
        answers = [s for s in t.steps if s.kind == "answer"]
        assert len(answers) == 1 and answers[0].output == texts[-1] == t.final_answer
        assert [s.output for s in t.steps if s.kind == "message"] == texts[:-1]
        assert t.query == next(m["content"] for m in run["traj"] if m["role"] == "user")
    kinds = Counter(s.kind for t in _trajectories(tau_bench) for s in t.steps)
    # 90 assistant messages carry text alongside a tool call: each is a plan step (+92 think).
    assert kinds == {"message": 1090, "tool": 1072, "answer": 200, "plan": 182}


def test_the_conversation_is_kept_whole_beside_the_system_prompt_hash(
    tau_bench: ParseResult, tau_bench_raw: list[dict]
):
    # the steps cannot hold the user's later messages; training on the text and offline
    # evaluation need them, so the record keeps the conversation as OpenAI messages
    for run, t in zip(tau_bench_raw, _trajectories(tau_bench), strict=True):
        system = run["traj"][0]["content"]
        assert t.metadata["system_prompt_sha256"] == hashlib.sha256(system.encode()).hexdigest()
        assert t.metadata["system_prompt_chars"] == len(system)
        kept = t.metadata["messages"]
        assert [(m["role"], m["content"]) for m in kept] == [(m["role"], m.get("content")) for m in run["traj"]]
        for ours, logged in zip(kept, run["traj"]):
            calls = [(c["id"], c["function"]["name"], json.loads(c["function"]["arguments"])) for c in logged.get("tool_calls") or []]
            assert [(c["id"], c["function"]["name"], json.loads(c["function"]["arguments"])) for c in ours.get("tool_calls") or []] == calls
            assert ours.get("tool_call_id") == logged.get("tool_call_id")


# ---------------------------------------------------------------- tau2


@pytest.mark.parametrize(
    ("rel", "sims", "passed", "calls"), TAU2, ids=[r.split("/")[0] for r, *_ in TAU2]
)
def test_tau2_files_match_readme_counts(
    shared_data: Path, rel: str, sims: int, passed: int, calls: tuple
):
    result = parse_file(shared_data / "tau2-bench" / rel)
    trajectories = _trajectories(result)
    counts = (result.format, len(trajectories), result.records_read, len(result.quarantined))
    assert counts == ("tau2", sims, sims, 0)
    assert sum(t.outcome.success for t in trajectories) == passed
    assert all(t.outcome.score in (0.0, 1.0) for t in trajectories)
    assert all(t.outcome.success == (t.outcome.score == 1.0) for t in trajectories)
    assert _spread([sum(1 for s in t.steps if s.kind == "tool") for t in trajectories]) == calls
    assert len({t.trajectory_id for t in trajectories}) == sims
    assert {t.task_id for t in trajectories} <= {str(i) for i in range(50)}


@pytest.mark.parametrize(("index", "agent"), enumerate(TAU2_AGENTS))
def test_tau2_agent_id_and_metadata_come_from_the_document(
    shared_data: Path, index: int, agent: str
):
    path = shared_data / "tau2-bench" / TAU2[index][0]
    raw = orjson.loads(path.read_bytes())
    trajectories = _trajectories(parse_file(path))
    assert {t.agent_id for t in trajectories} == {agent}
    for sim, t in zip(raw["simulations"], trajectories, strict=True):
        assert t.trajectory_id == sim["id"] and t.task_id == sim["task_id"]
        assert t.metadata["domain"] == "airline" and t.metadata["trial"] == sim["trial"]
        assert t.metadata["termination_reason"] == sim["termination_reason"]
        assert t.metadata.get("agent_cost") == sim.get("agent_cost")
        assert t.metadata["duration_s"] == sim["duration"]
        assert t.timestamp == sim["start_time"]
        assert "policy" not in t.metadata and len(t.metadata["policy_sha256"]) == 64
        first_user = next(m["content"] for m in sim["messages"] if m["role"] == "user")
        assert t.query == first_user


@pytest.mark.parametrize(("index", "errors"), enumerate(TAU2_TOOL_ERRORS))
def test_tau2_tool_errors_follow_the_error_flag(shared_data: Path, index: int, errors: int):
    trajectories = _trajectories(parse_file(shared_data / "tau2-bench" / TAU2[index][0]))
    failed = [s for t in trajectories for s in t.steps if s.status == "error"]
    assert len(failed) == errors
    assert all(s.kind == "tool" and s.output.startswith("Error") for s in failed)


def test_tau2_step_durations_partition_each_turn_from_timestamps(shared_data: Path):
    path = shared_data / "tau2-bench" / TAU2[2][0]
    sim = orjson.loads(path.read_bytes())["simulations"][0]
    t = _trajectories(parse_file(path))[0]
    stamp = [datetime.fromisoformat(m["timestamp"]) for m in sim["messages"]]
    # messages: 3 user, 4 assistant calling get_reservation_details, 5 its tool result.
    assert sim["messages"][4]["tool_calls"][0]["name"] == "get_reservation_details"
    first_tool = next(s for s in t.steps if s.kind == "tool")
    assert first_tool.tool == "get_reservation_details"
    assert first_tool.duration_ms == pytest.approx((stamp[5] - stamp[3]).total_seconds() * 1000)
    # The greeting has no earlier event to measure from.
    assert t.steps[0].duration_ms is None
    all_steps = [s for t in _trajectories(parse_file(path)) for s in t.steps]
    assert sum(s.duration_ms is not None for s in all_steps) == len(all_steps) - 50


def test_tau2_without_timestamps_has_no_durations(shared_data: Path):
    trajectories = _trajectories(parse_file(shared_data / "tau2-bench" / TAU2[0][0]))
    assert all(s.duration_ms is None for t in trajectories for s in t.steps)


# ---------------------------------------------------------------- FireAct


def _hotpot_normalise(text: str) -> str:
    text = "".join(c for c in text.lower() if c not in set(string.punctuation))
    return " ".join(re.sub(r"\b(a|an|the)\b", " ", text).split())


@pytest.mark.parametrize(
    ("name", "questions", "passed", "actions", "agent"),
    FIREACT,
    ids=["gpt35", "llama13b", "llama7b"],
)
def test_fireact_files_match_readme_counts(shared_data, name, questions, passed, actions, agent):
    result = parse_file(shared_data / "fireact" / name)
    trajectories = _trajectories(result)
    counts = (result.format, len(trajectories), result.records_read, len(result.quarantined))
    assert counts == ("fireact", questions, questions, 0)
    assert sum(t.outcome.success for t in trajectories) == passed
    per_trajectory = [sum(s.kind in ("tool", "answer") for s in t.steps) for t in trajectories]
    assert _spread(per_trajectory) == actions
    assert {t.agent_id for t in trajectories} == {agent}
    assert all(sum(s.kind == "answer" for s in t.steps) == 1 for t in trajectories)


@pytest.mark.parametrize(
    ("name", "differ"), [(FIREACT[0][0], 4), (FIREACT[1][0], 1), (FIREACT[2][0], 0)]
)
def test_fireact_final_answer_is_the_finish_argument_the_grader_saw(
    shared_data: Path, name: str, differ: int
):
    raw = orjson.loads((shared_data / "fireact" / name).read_bytes())
    trajectories = _trajectories(parse_file(shared_data / "fireact" / name))
    mismatched = 0
    for t in trajectories:
        pred = raw[t.task_id]["pred"]
        # the reward is FireAct's exact match; token F1 is kept in metadata
        assert t.outcome.score == (1.0 if raw[t.task_id]["reward"] else 0.0)
        assert t.metadata["f1"] == raw[t.task_id]["f1"]
        # The grader took everything after "finish[" when the model ran on past the bracket;
        # the finish argument is always where its prediction starts.
        assert pred.startswith(_hotpot_normalise(t.final_answer))
        mismatched += _hotpot_normalise(t.final_answer) != pred
    assert mismatched == differ


def test_fireact_search_steps_carry_query_and_observation(shared_data: Path):
    trajectories = _trajectories(parse_file(shared_data / "fireact" / FIREACT[1][0]))
    first = trajectories[0]
    assert first.query == "Who created the show with Wendy Schaal doing the voice of Francine?"
    assert [s.kind for s in first.steps] == ["plan", "tool", "plan", "answer"]
    search = first.steps[1]
    assert search.tool == "search"
    assert search.input == {
        "query": "who created the show with Wendy Schaal doing the voice of Francine?"
    }
    assert search.output.startswith("It was finally in '05 that Schaal landed")
    assert first.final_answer == "Seth MacFarlane"
    searches = [s for t in trajectories for s in t.steps if s.tool == "search"]
    assert len(searches) == 1144 and all(isinstance(s.output, str) for s in searches)


def test_fireact_unknown_actions_are_error_tool_steps(shared_data: Path):
    trajectories = _trajectories(parse_file(shared_data / "fireact" / FIREACT[2][0]))
    reflect = [s for t in trajectories for s in t.steps if s.tool == "reflect"]
    assert len(reflect) == 26 and all(s.status == "error" for s in reflect)
    assert all("Unknown tool name" in s.output for s in reflect)


def test_fireact_chat_turn_that_ran_on_keeps_its_unexecuted_text(shared_data: Path):
    result = parse_file(shared_data / "fireact" / FIREACT[0][0])
    trajectories = {t.task_id: t for t in _trajectories(result)}
    assert sum("unexecuted_text" in t.metadata for t in trajectories.values()) == 8
    frigg = trajectories["457"]
    click = next(s for s in frigg.steps if s.tool == "click")
    assert click.status == "error" and click.input == {"argument": "Frige - Wikipedia"}
    assert frigg.metadata["unexecuted_text"] == [
        {"turn": 3, "text": "Action: search[tales associated with Frigg]"}
    ]


def test_fireact_agent_id_derivation_falls_back_to_the_stem():
    gpt = agent_id_from_name("hotpotqa_dev_0_500_ft_gpt-3.5-turbo-0613_x")
    assert gpt == "fireact:gpt-3.5-turbo-0613-ft"
    assert agent_id_from_name("my_run") == "fireact:my_run"


# ---------------------------------------------------------------- detection and selection


def test_detection_picks_the_right_format_for_every_real_file(shared_data: Path):
    files = _all_real_files(shared_data)
    assert len(files) == 9
    for path, expected in files:
        assert detect_format(path) == expected, path
        assert parse_file(path).format == expected


def _write_canonical(trajectories: list[Trajectory], path: Path) -> Path:
    path.write_bytes(b"".join(t.model_dump_json().encode() + b"\n" for t in trajectories))
    return path


def _write_flat(trajectories: list[Trajectory], path: Path) -> Path:
    lines = [
        orjson.dumps({
            "task_id": t.task_id, "input": t.query, "response": t.final_answer or "",
            "score": t.outcome.score, "agent_id": t.agent_id, "adapter_version": "v1",
            "timestamp": None, "metadata": {"trial": t.metadata["trial"]},
        })
        for t in trajectories
    ]
    path.write_bytes(b"\n".join(lines) + b"\n")
    return path


def test_canonical_jsonl_round_trips_every_real_trajectory(shared_data: Path, tmp_path: Path):
    for source, _ in _all_real_files(shared_data):
        originals = _trajectories(parse_file(source))
        copy = _write_canonical(originals, tmp_path / f"{source.stem}.jsonl")
        assert detect_format(copy) == "canonical"
        result = parse_file(copy)
        assert result.format == "canonical" and not result.quarantined
        assert _trajectories(result) == originals
        assert [r.line for r in result.valid] == list(range(1, len(originals) + 1))


def test_flat_records_become_one_answer_step_with_success_from_score(
    tau_bench: ParseResult, tmp_path: Path
):
    originals = _trajectories(tau_bench)
    path = _write_flat(originals, tmp_path / "interactions.jsonl")
    assert detect_format(path) == "flat"
    result = parse_file(path)
    flat = _trajectories(result)
    assert len(flat) == 200 and not result.quarantined
    assert [t.trajectory_id for t in flat[:2]] == ["interactions:1", "interactions:2"]
    for original, t in zip(originals, flat, strict=True):
        assert [(s.kind, s.output) for s in t.steps] == [("answer", original.final_answer)]
        assert t.query == original.query and t.final_answer == original.final_answer
        assert t.outcome.score == original.outcome.score
        assert t.outcome.success == original.outcome.success  # reward is 0/1, so >= 0.5 agrees
        assert t.adapter_version == "v1"


def test_flat_success_and_interaction_id_are_taken_when_given(tmp_path: Path):
    path = tmp_path / "f.jsonl"
    record = {"task_id": "t", "input": "q", "response": "a", "score": 0.9, "agent_id": "a",
              "success": False, "interaction_id": "i-1"}
    path.write_bytes(orjson.dumps(record) + b"\n")
    (t,) = _trajectories(parse_file(path))
    assert (t.trajectory_id, t.outcome.success, t.outcome.score) == ("i-1", False, 0.9)


def test_explicit_format_selection_gives_the_same_result_as_detection(shared_data: Path):
    for path, fmt in _all_real_files(shared_data)[:3]:
        assert _trajectories(parse_file(path, fmt)) == _trajectories(parse_file(path))
        assert _trajectories(FORMATS[fmt](path).collect()) == _trajectories(parse_file(path))
    assert set(FORMATS) == {"canonical", "flat", "tau-bench", "tau2", "fireact"}


def test_wrong_explicit_whole_file_format_raises_naming_the_file(shared_data: Path):
    tau2 = shared_data / "tau2-bench" / TAU2[1][0]
    expected = "expected a JSON list of tau-bench runs"
    with pytest.raises(UnreadableLogError, match=expected) as caught:
        parse_file(tau2, "tau-bench")
    assert str(tau2) in str(caught.value)
    with pytest.raises(UnreadableLogError, match='"simulations" list'):
        parse_file(shared_data / "tau-bench" / "gpt-4o-airline.json", "tau2")
    with pytest.raises(UnreadableLogError, match="keyed by question id"):
        parse_file(shared_data / "tau-bench" / "gpt-4o-airline.json", "fireact")


def test_wrong_explicit_jsonl_format_quarantines_every_record(
    tau_bench: ParseResult, tmp_path: Path
):
    canonical = _write_canonical(_trajectories(tau_bench)[:10], tmp_path / "c.jsonl")
    as_flat = parse_file(canonical, "flat")
    assert (len(as_flat.valid), len(as_flat.quarantined), as_flat.records_read) == (0, 10, 10)
    reasons = [q.reason for q in as_flat.quarantined]
    assert all("Field required" in r or "Extra inputs" in r for r in reasons)
    flat = _write_flat(_trajectories(tau_bench)[:10], tmp_path / "f.jsonl")
    as_canonical = parse_file(flat, "canonical")
    assert {q.field for q in as_canonical.quarantined} == {"trajectory_id"}
    assert len(as_canonical.quarantined) == 10 and not as_canonical.valid

def test_whole_file_document_read_as_jsonl_quarantines_every_line(tau_bench_path: Path):
    result = parse_file(tau_bench_path, "canonical")
    non_blank = sum(1 for line in tau_bench_path.read_bytes().split(b"\n") if line.strip())
    counts = (len(result.valid), len(result.quarantined), result.records_read)
    assert counts == (0, non_blank, non_blank)
    first = result.quarantined[0]
    assert first.reason.startswith("invalid JSON") and first.line == 1
    assert {q.reason.split(":")[0].split(",")[0] for q in result.quarantined} <= {
        "invalid JSON", "record is a number", "record is a string", "record is an array",
        "record is a boolean", "record is null", "trajectory_id",
    }


def test_unknown_format_name_is_a_value_error(tau_bench_path: Path):
    with pytest.raises(ValueError, match="unknown log format 'jsonl'"):
        parse_file(tau_bench_path, "jsonl")


def test_unrecognised_content_raises_naming_the_file(tmp_path: Path):
    odd = tmp_path / "odd.json"
    odd.write_text(json.dumps({"rows": [1, 2, 3]}))
    with pytest.raises(UnreadableLogError, match="unrecognised log format") as caught:
        parse_file(odd)
    assert str(odd) in str(caught.value)
    garbage = tmp_path / "garbage.jsonl"
    garbage.write_text("not json\nstill not\n")
    with pytest.raises(UnreadableLogError, match="unrecognised log format"):
        detect_format(garbage)


def test_trajectory_ids_are_unique_within_every_real_file(shared_data: Path):
    for path, _ in _all_real_files(shared_data):
        ids = [t.trajectory_id for t in _trajectories(parse_file(path))]
        assert len(ids) == len(set(ids)), path


# ---------------------------------------------------------------- schema file


def test_committed_json_schema_equals_the_generated_one():
    committed = json.loads((REPO / "docs" / "trajectory.schema.json").read_text(encoding="utf-8"))
    assert committed == json_schema(), "run .venv/bin/flowopt schema > docs/trajectory.schema.json"


def test_documented_example_line_is_a_valid_trajectory(tmp_path: Path):
    text = (REPO / "docs" / "log-format.md").read_text(encoding="utf-8")
    example = text.split("```jsonl\n", 1)[1].split("\n```", 1)[0]
    path = tmp_path / "example.jsonl"
    path.write_text(example + "\n", encoding="utf-8")
    assert detect_format(path) == "canonical"
    result = parse_file(path)
    assert not result.quarantined
    (trajectory,) = _trajectories(result)
    assert [s.kind for s in trajectory.steps] == ["plan", "tool", "tool", "answer"]


def _same_records(a: ParseResult, b: ParseResult) -> bool:
    dump = lambda r: [v.trajectory.model_dump_json() for v in r.valid]  # noqa: E731
    return dump(a) == dump(b) and len(a.quarantined) == len(b.quarantined)


def test_gzip_logs_are_read_as_their_decompressed_bytes(shared_data: Path, tmp_path: Path):
    import gzip

    tau2 = shared_data / "tau2-bench" / TAU2[1][0]
    original = parse_file(tau2)
    packed = tmp_path / "airline.json.gz"
    packed.write_bytes(gzip.compress(tau2.read_bytes()))
    assert detect_format(packed) == "tau2"
    assert _same_records(parse_file(packed), original)
    # canonical JSONL, compressed and named without .gz: recognised by its magic bytes
    jsonl = tmp_path / "canonical.jsonl"
    jsonl.write_text("".join(v.trajectory.model_dump_json() + "\n" for v in original.valid))
    hidden = tmp_path / "canonical.log"
    hidden.write_bytes(gzip.compress(jsonl.read_bytes()))
    assert detect_format(hidden) == "canonical"
    assert _same_records(parse_file(hidden), parse_file(jsonl))
    from flow_assets.logs.chunks import read_chunks

    with read_chunks(hidden, "auto", workers=2, max_records=7, max_bytes=1 << 20) as stream:
        rows = sum(chunk.valid.height for chunk in stream)
    assert rows == len(original.valid) and stream.records_read == len(original.valid)


def test_a_truncated_gzip_log_is_unreadable_naming_the_file(tau_bench_path: Path, tmp_path: Path):
    import gzip

    cut = tmp_path / "cut.json.gz"
    cut.write_bytes(gzip.compress(tau_bench_path.read_bytes())[:20000])
    with pytest.raises(UnreadableLogError, match="read failed") as caught:
        parse_file(cut)
    assert str(cut) in str(caught.value)


def test_a_utf8_byte_order_mark_costs_no_record(shared_data: Path, tau_bench_path: Path, tmp_path: Path):
    bom = b"\xef\xbb\xbf"
    original = parse_file(tau_bench_path)
    marked = tmp_path / tau_bench_path.name  # the agent id is taken from the file's name
    marked.write_bytes(bom + tau_bench_path.read_bytes())
    assert _same_records(parse_file(marked), original)
    jsonl = tmp_path / "canonical.jsonl"
    jsonl.write_bytes(bom + "".join(v.trajectory.model_dump_json() + "\n" for v in original.valid[:20]).encode())
    result = parse_file(jsonl)
    assert len(result.valid) == 20 and not result.quarantined
    assert result.valid[0].trajectory.trajectory_id == original.valid[0].trajectory.trajectory_id


def test_logs_without_an_outcome_are_read_as_unlabelled(tau_bench_path: Path, tmp_path: Path):
    t = json.loads(parse_file(tau_bench_path).valid[0].trajectory.model_dump_json())
    del t["outcome"]
    canonical = tmp_path / "unlabelled.jsonl"
    canonical.write_text(json.dumps(t) + "\n" + json.dumps({**t, "trajectory_id": "x2", "outcome": None}) + "\n")
    result = parse_file(canonical)
    assert [v.trajectory.outcome for v in result.valid] == [None, None] and not result.quarantined
    flat = tmp_path / "flat.jsonl"
    flat.write_text(json.dumps({"task_id": "7", "input": "q", "response": "a", "agent_id": "me"}) + "\n")
    (record,) = parse_file(flat).valid
    assert record.trajectory.outcome is None
