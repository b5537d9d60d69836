"""The chat-transcript and trace formats shipped through the plug-in protocol (openai-chat,
anthropic-messages, otel-genai), on real exported files nobody here wrote (tests/data/*/README.md
says where each comes from). Expected values are read from those files, not written here."""

from __future__ import annotations

import copy
import gzip
import json
from pathlib import Path

import pytest
import yaml

from flow_assets.logs.plugins import BUILTIN_PLUGINS, plugin_formats
from flow_assets.logs.reader import detect_format, known_formats, parse_file

DATA = Path(__file__).resolve().parents[1] / "data"
DRONE = DATA / "openai-chat" / "drone_training.head1.jsonl"
TOY = DATA / "openai-chat" / "toy_chat_fine_tuning.head4.jsonl"
CASSETTE = DATA / "anthropic-messages" / "test_anthropic_tools_history_legacy.yaml"
OPENINFERENCE = DATA / "otel-genai" / "openinference-openai-chat.json"
OPENLLMETRY = DATA / "otel-genai" / "openllmetry-openai-chat.json"


def _lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _write_jsonl(path: Path, records: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def _anthropic_exchange() -> dict:
    """The recorded POST /v1/messages of the cassette as one transcript record: the request
    body as sent, and the reply (gzip in the cassette) under ``response``."""
    interaction = yaml.safe_load(CASSETTE.read_text())["interactions"][0]
    request = json.loads(interaction["request"]["body"])
    response = json.loads(gzip.decompress(interaction["response"]["body"]["string"]))
    return {**request, "response": response}


def _llm_spans(path: Path) -> list[dict]:
    doc = json.loads(path.read_text())
    spans = [s for rs in doc["resourceSpans"] for ss in rs["scopeSpans"] for s in ss["spans"]]
    return [s for s in spans if any(a["key"].startswith(("gen_ai.input", "llm.input")) for a in s["attributes"])]


# --- registration and detection ---------------------------------------------------------------


def test_the_three_formats_are_built_in_plug_ins_known_by_name():
    formats = plugin_formats()
    for name in BUILTIN_PLUGINS:
        assert formats[name].builtin and formats[name].origin.startswith("built in")
        assert name in known_formats()


@pytest.mark.parametrize(
    "path, fmt",
    [(DRONE, "openai-chat"), (TOY, "openai-chat"), (OPENINFERENCE, "otel-genai"), (OPENLLMETRY, "otel-genai")],
)
def test_real_exports_are_detected(path: Path, fmt: str):
    assert detect_format(path) == fmt


def test_an_anthropic_exchange_with_its_response_is_not_read_as_flat(tmp_path):
    # "response" makes a line look flat to the built-in sniffing; "messages" rules that out.
    path = _write_jsonl(tmp_path / "claude.jsonl", [_anthropic_exchange()])
    assert detect_format(path) == "anthropic-messages"
    flat = _write_jsonl(tmp_path / "flat.jsonl", [{"task_id": "t", "input": "q", "response": "a", "agent_id": "x"}])
    assert detect_format(flat) == "flat"


def test_a_plain_messages_line_was_refused_and_is_now_read(tmp_path):
    # The shape issue #28 reported as "unrecognised log format": messages only, no tools.
    path = _write_jsonl(tmp_path / "plain.jsonl", [{"messages": m["messages"]} for m in _lines(TOY)])
    result = parse_file(path)
    assert result.format == "openai-chat" and len(result.valid) == len(_lines(TOY))


# --- openai-chat ------------------------------------------------------------------------------


def test_drone_tool_call_becomes_a_tool_step_and_stays_unlabelled():
    (record,) = _lines(DRONE)
    (call,) = record["messages"][-1]["tool_calls"]
    (valid,) = parse_file(DRONE).valid
    trajectory = valid.trajectory
    assert trajectory.query == record["messages"][1]["content"]
    [step] = trajectory.steps
    assert (step.kind, step.tool, step.input) == ("tool", call["function"]["name"], json.loads(call["function"]["arguments"]))
    assert trajectory.outcome is None  # the file has no reward field
    assert trajectory.metadata["tool_names"] == [t["function"]["name"] for t in record["tools"]]
    assert "system_prompt" not in json.dumps(trajectory.metadata).replace("system_prompt_", "")


def test_toy_conversations_map_one_step_per_assistant_message():
    records = _lines(TOY)
    result = parse_file(TOY)
    assert result.records_read == len(records) == len(result.valid)
    for record, valid in zip(records, result.valid):
        said = [m["content"] for m in record["messages"] if m["role"] == "assistant"]
        steps = valid.trajectory.steps
        assert [s.output for s in steps] == said
        assert [s.kind for s in steps] == ["message"] * (len(said) - 1) + ["answer"]
        assert valid.trajectory.final_answer == said[-1]
        users = [m["content"] for m in record["messages"] if m["role"] == "user"]
        assert valid.trajectory.query == (users[0] if users else "")


def test_documented_outcome_fields_and_a_bad_reward_is_quarantined_alone(tmp_path):
    (record,) = _lines(DRONE)
    labelled = {**record, "metadata": {"reward": 0.5, "task_id": 7}}
    scored = {**record, "score": 1, "success": True}
    bad = {**record, "reward": "high"}
    path = _write_jsonl(tmp_path / "drone-rewarded.jsonl", [labelled, scored, bad])
    result = parse_file(path)
    assert result.records_read == 3 and len(result.valid) == 2
    first, second = (v.trajectory for v in result.valid)
    assert (first.outcome.score, first.outcome.success, first.task_id) == (0.5, None, "7")
    assert (second.outcome.score, second.outcome.success) == (1.0, True)
    assert first.metadata["source_metadata"] == labelled["metadata"]
    (quarantined,) = result.quarantined
    assert (quarantined.line, quarantined.field) == (3, "reward") and "finite number" in quarantined.reason
    assert json.loads(quarantined.raw) == bad


def test_a_malformed_message_is_quarantined_with_its_line_and_field(tmp_path):
    records = _lines(TOY)
    broken = copy.deepcopy(records[0])
    broken["messages"][1]["role"] = "robot"
    path = _write_jsonl(tmp_path / "toy.jsonl", [broken, *records[1:]])
    result = parse_file(path, "openai-chat")
    (quarantined,) = result.quarantined
    assert (quarantined.line, quarantined.field) == (1, "messages.1.role") and "'robot'" in quarantined.reason
    assert len(result.valid) == len(records) - 1


def test_context_messages_are_kept_as_the_agents_context_and_not_trained_as_its_steps(tmp_path):
    """An agent's own log names how many leading messages are its fixed prompt (few-shot
    examples): they are not the episode (no steps, not the query), and the trajectory keeps
    them, the tools and the temperature, so every turn can be rendered again as it was seen."""
    (record,) = _lines(DRONE)
    system, user, call_turn = record["messages"][0], record["messages"][1], record["messages"][-1]
    example = [{"role": "user", "content": "Take off."}, {"role": "assistant", "content": "Taking off."}]
    messages = [system, *example, user, call_turn]
    logged = {**record, "messages": messages, "task_id": "t1", "reward": 1.0,
              "metadata": {"context_messages": 3, "temperature": 0.5}}  # fmt: skip
    plain = {**record, "messages": messages, "task_id": "t1"}
    bad = {**record, "messages": messages, "metadata": {"context_messages": len(messages)}}
    result = parse_file(_write_jsonl(tmp_path / "agent-log.jsonl", [logged, plain, bad]))
    own, whole = (v.trajectory for v in result.valid)
    assert own.query == user["content"] and whole.query == example[0]["content"]
    assert [s.kind for s in own.steps] == ["tool"] and [s.kind for s in whole.steps] == ["answer", "tool"]
    assert own.metadata["context"] == [system, *example] and own.metadata["tools"] == record["tools"]
    assert own.metadata["temperature"] == 0.5 and "context" not in whole.metadata and "temperature" not in whole.metadata
    assert own.metadata["system_prompt_sha256"] == whole.metadata["system_prompt_sha256"]
    (quarantined,) = result.quarantined
    assert (quarantined.line, quarantined.field) == (3, "metadata.context_messages")


def test_a_reply_cut_at_its_token_cap_lists_its_steps(tmp_path):
    """``finish_reason: "length"`` on an assistant message names that reply's steps in
    ``metadata.cut_steps``; other finish reasons and unmarked messages add nothing."""
    messages = [{"role": "user", "content": "Add 2 and 3."},
                {"role": "assistant", "content": "Let me think", "finish_reason": "length"},
                {"role": "user", "content": "Go on."},
                {"role": "assistant", "content": "5", "finish_reason": "stop"}]  # fmt: skip
    cut, whole = {"messages": messages, "task_id": "t1"}, {"messages": [m for m in messages if m.get("finish_reason") != "length"], "task_id": "t2"}
    result = parse_file(_write_jsonl(tmp_path / "agent-log.jsonl", [cut, whole]))
    first, second = (v.trajectory for v in result.valid)
    assert [s.output for s in first.steps] == ["Let me think", "5"]
    assert first.metadata["cut_steps"] == [0] and "cut_steps" not in second.metadata


# --- anthropic-messages -----------------------------------------------------------------------


def test_anthropic_blocks_map_to_steps_with_tool_results(tmp_path):
    exchange = _anthropic_exchange()
    path = _write_jsonl(tmp_path / "claude.jsonl", [exchange])
    (valid,) = parse_file(path).valid
    trajectory = valid.trajectory
    turn = exchange["messages"][1]["content"]  # the assistant's text and tool_use blocks
    result = exchange["messages"][2]["content"][0]
    replied = [b for b in exchange["response"]["content"] if b["type"] == "tool_use"]
    assert trajectory.query == exchange["messages"][0]["content"]
    expected = [("plan", None, None, turn[0]["text"]), ("tool", turn[1]["name"], turn[1]["input"], result["content"])]
    expected += [("tool", b["name"], b["input"], None) for b in replied]  # the reply's call: not answered yet
    assert [(s.kind, s.tool, s.input, s.output) for s in trajectory.steps] == expected
    assert trajectory.agent_id == exchange["model"] and trajectory.metadata["stop_reason"] == exchange["response"]["stop_reason"]
    assert trajectory.final_answer is None and trajectory.outcome is None


def test_anthropic_is_error_fails_the_step_and_a_bad_block_is_quarantined(tmp_path):
    exchange = _anthropic_exchange()
    failed = copy.deepcopy(exchange)
    failed["messages"][2]["content"][0]["is_error"] = True
    failed["reward"] = 0.0
    broken = copy.deepcopy(exchange)
    del broken["messages"][2]["content"][0]["tool_use_id"]
    path = _write_jsonl(tmp_path / "claude.jsonl", [failed, broken])
    result = parse_file(path)
    (valid,) = result.valid
    assert [s.status for s in valid.trajectory.steps if s.kind == "tool"][0] == "error"
    assert valid.trajectory.outcome.score == 0.0
    (quarantined,) = result.quarantined
    assert (quarantined.line, quarantined.field) == (2, "messages.2.content.0.tool_use_id")


# --- otel-genai -------------------------------------------------------------------------------


@pytest.mark.parametrize("path", [OPENINFERENCE, OPENLLMETRY])
def test_one_trajectory_per_trace_with_the_llm_span_as_its_turn(path: Path):
    (span,) = _llm_spans(path)
    (valid,) = parse_file(path).valid
    trajectory = valid.trajectory
    assert trajectory.trajectory_id == span["traceId"] and trajectory.query == "Where is order A-1187?"
    [step] = trajectory.steps
    assert step.kind == "tool" and step.tool == "lookup_order" and step.input == {"order_id": "A-1187"}
    span_ms = (int(span["endTimeUnixNano"]) - int(span["startTimeUnixNano"])) / 1e6
    assert step.duration_ms == pytest.approx(span_ms)
    assert trajectory.outcome is None


def test_two_instrumentations_of_one_exchange_give_the_same_steps():
    one, other = (parse_file(p).valid[0].trajectory for p in (OPENINFERENCE, OPENLLMETRY))
    assert one.task_id == other.task_id  # same system prompt and question: one GRPO group
    assert [(s.kind, s.tool, s.input) for s in one.steps] == [(s.kind, s.tool, s.input) for s in other.steps]
    assert one.metadata["system_prompt_sha256"] == other.metadata["system_prompt_sha256"]


def test_traces_are_grouped_across_resources_and_a_tool_span_answers_the_call(tmp_path):
    merged = {"resourceSpans": json.loads(OPENLLMETRY.read_text())["resourceSpans"][::-1]
              + json.loads(OPENINFERENCE.read_text())["resourceSpans"]}  # fmt: skip
    (llm,) = _llm_spans(OPENLLMETRY)
    end = int(llm["endTimeUnixNano"])
    # A tool span built from the GenAI conventions (execute_tool), not from an exporter: the real
    # captures stop at the model's call.
    tool_span = {
        "traceId": llm["traceId"], "spanId": "00000000000000aa", "name": "execute_tool lookup_order",
        "startTimeUnixNano": str(end + 1_000_000), "endTimeUnixNano": str(end + 5_000_000), "status": {"code": 2},
        "attributes": [
            {"key": "gen_ai.operation.name", "value": {"stringValue": "execute_tool"}},
            {"key": "gen_ai.tool.name", "value": {"stringValue": "lookup_order"}},
            {"key": "gen_ai.tool.call.id", "value": {"stringValue": "call_9RtYbK2mXqLp"}},
            {"key": "gen_ai.tool.call.result", "value": {"stringValue": "order service unavailable"}},
            {"key": "flowopt.outcome.score", "value": {"doubleValue": 0.25}},
        ],
    }  # fmt: skip
    broken_span = {"spanId": "00000000000000bb", "name": "no trace id", "startTimeUnixNano": "1"}
    spans = merged["resourceSpans"][0]["scopeSpans"][0]["spans"]
    spans += [tool_span, broken_span]
    path = tmp_path / "export.json"
    path.write_text(json.dumps(merged, indent=2))
    assert detect_format(path) == "otel-genai"
    result = parse_file(path)
    assert result.records_read == 3 and len(result.valid) == 2
    by_trace = {v.trajectory.trajectory_id: v.trajectory for v in result.valid}
    traced = by_trace[llm["traceId"]]
    [step] = traced.steps
    assert (step.output, step.status) == ("order service unavailable", "error")
    assert step.duration_ms == pytest.approx((end + 5_000_000 - int(llm["startTimeUnixNano"])) / 1e6)
    assert traced.outcome.score == 0.25
    (quarantined,) = result.quarantined
    assert quarantined.field == "traceId" and quarantined.pointer == f"/resourceSpans/0/scopeSpans/0/spans/{len(spans) - 1}"


def test_a_trace_without_llm_spans_or_with_bad_messages_is_quarantined_whole(tmp_path):
    doc = json.loads(OPENLLMETRY.read_text())
    workflow_only = {"resourceSpans": [doc["resourceSpans"][1]]}  # the workflow span alone
    bad = json.loads(OPENINFERENCE.read_text())
    for attribute in bad["resourceSpans"][0]["scopeSpans"][0]["spans"][0]["attributes"]:
        if attribute["key"] == "llm.input_messages.1.message.role":
            attribute["value"]["stringValue"] = "robot"
    path = tmp_path / "lines.jsonl"  # the Collector's file exporter: one export request per line
    path.write_text(json.dumps(workflow_only) + "\n" + json.dumps(bad) + "\n")
    result = parse_file(path, "otel-genai")
    assert not result.valid and result.records_read == 2
    no_llm, bad_role = sorted(result.quarantined, key=lambda q: q.line)
    assert no_llm.line == 1 and "no LLM span" in no_llm.reason
    assert bad_role.line == 2 and bad_role.field == "llm.input_messages.1.message.role" and "'robot'" in bad_role.reason


def test_the_indexed_gen_ai_dialect_reads_like_the_others():
    # Built from the attribute names OpenLLMetry used before its migration (no captured export of
    # that shape was found): the same exchange as the captures, flattened into indexed keys.
    from flow_assets.logs.formats.otel_genai import span_messages

    (llm,) = _llm_spans(OPENINFERENCE)
    captured = {a["key"]: a["value"].get("stringValue") for a in llm["attributes"]}
    attributes = {
        "gen_ai.prompt.0.role": "system", "gen_ai.prompt.0.content": captured["llm.input_messages.0.message.content"],
        "gen_ai.prompt.1.role": "user", "gen_ai.prompt.1.content": captured["llm.input_messages.1.message.content"],
        "gen_ai.completion.0.role": "assistant",
        "gen_ai.completion.0.tool_calls.0.id": "call_1", "gen_ai.completion.0.tool_calls.0.name": "lookup_order",
        "gen_ai.completion.0.tool_calls.0.arguments": '{"order_id": "A-1187"}',
    }  # fmt: skip
    indexed_in, indexed_out = span_messages(attributes)
    openinference_in, openinference_out = span_messages({a["key"]: a["value"].get("stringValue") for a in llm["attributes"]})
    assert [(m["role"], m["content"]) for m in indexed_in] == [(m["role"], m["content"]) for m in openinference_in]
    assert indexed_out[0]["tool_calls"] == [{"id": "call_1", "name": "lookup_order", "arguments": '{"order_id": "A-1187"}'}]
    assert openinference_out[0]["tool_calls"][0]["name"] == "lookup_order"


def test_a_one_line_export_larger_than_the_line_limit_is_read_as_a_document(tmp_path):
    # An OTLP/HTTP body saved as is is one compact line; it is one document, not an oversized line.
    path = tmp_path / "body.json"
    path.write_text(json.dumps(json.loads(OPENLLMETRY.read_text())))
    assert path.stat().st_size > 4000
    result = parse_file(path, "otel-genai", max_record_bytes=4000)
    assert len(result.valid) == 1 and not result.quarantined
