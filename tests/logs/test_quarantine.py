"""Quarantine behaviour on corrupted copies of real logs: every bad record is kept with its
place, field and reason, its raw bytes are complete, and the rest of the file still parses."""

from __future__ import annotations

import json
import math
import threading
from pathlib import Path

import orjson
import pytest

from flow_assets.logs.formats.common import OVERSIZED_HEAD_BYTES
from flow_assets.logs.chunks import read_chunks, worker_count
from flow_assets.logs.reader import parse_file
from flow_assets.logs.records import ParseResult, QuarantinedRecord, UnreadableLogError
from flow_assets.logs.schema import Trajectory

BIG_LINE_BYTES = 50 * 2**20


def _trajectories(result: ParseResult) -> list[Trajectory]:
    return [record.trajectory for record in result.valid]


def _by_line(result: ParseResult) -> dict[int, QuarantinedRecord]:
    return {q.line: q for q in result.quarantined}


@pytest.fixture(scope="module")
def tau_bench_path(shared_data: Path) -> Path:
    return shared_data / "tau-bench" / "gpt-4o-airline.json"


@pytest.fixture(scope="module")
def originals(tau_bench_path: Path) -> list[Trajectory]:
    """The 200 real tau-bench runs as canonical trajectories."""
    return _trajectories(parse_file(tau_bench_path))


def _canonical(trajectory: Trajectory) -> dict:
    return orjson.loads(trajectory.model_dump_json())


def _edit(trajectory: Trajectory, change) -> bytes:
    record = _canonical(trajectory)
    change(record)
    return json.dumps(record, allow_nan=True).encode()


def _corruptions(originals: list[Trajectory]) -> dict[int, tuple[bytes, str | None, str]]:
    """1-based line -> (raw line, expected field, text the reason must contain)."""
    assert len(originals[29].steps) > 2 and len(originals[44].steps) > 1
    good = originals[69].model_dump_json().encode()
    big = good[:-1] + b',"padding":"' + b"x" * (BIG_LINE_BYTES - len(good)) + b'"}'
    def score(value):
        return lambda r: r["outcome"].update(score=value)

    def step(position, **change):
        return lambda r: r["steps"][position].update(change)

    good = originals[59].model_dump_json().encode()
    non_utf8 = good.replace(b'"query":"', b'"query":"\xff\xfe', 1)
    return {
        3: (originals[2].model_dump_json().encode()[:-40], None, "invalid JSON"),
        10: (_edit(originals[9], lambda r: r.pop("task_id")), "task_id", "Field required"),
        20: (_edit(originals[19], score("1.0")), "outcome.score", "valid number"),
        25: (_edit(originals[24], lambda r: r.update(steps="none")), "steps", "valid list"),
        30: (_edit(originals[29], step(2, kind="dance")), "steps.2.kind", "'dance'"),
        40: (_edit(originals[39], score(math.nan)), "outcome.score", "NaN"),
        45: (_edit(originals[44], step(1, confidence=math.nan)), "steps.1.confidence", "NaN"),
        50: (_edit(originals[49], score(math.inf)), "outcome.score", "Infinity"),
        55: (_edit(originals[54], score(-math.inf)), "outcome.score", "-Infinity"),
        60: (non_utf8, None, "not valid UTF-8"),
        65: (b"[1, 2, 3]", None, "record is an array"),
        70: (big, None, "not parsed"),
    }


@pytest.fixture(scope="module")
def corrupted(tmp_path_factory, originals: list[Trajectory]):
    """A canonical JSONL copy of the 200 runs with 12 corrupted lines and blank lines (so line
    numbers and record counts differ), parsed once."""
    corruptions = _corruptions(originals)
    lines: list[bytes] = []
    for number, trajectory in enumerate(originals, start=1):
        good = trajectory.model_dump_json().encode()
        lines.append(corruptions[number][0] if number in corruptions else good)
    # Blank and whitespace lines after record 100 and at the end: skipped, not counted.
    lines[100:100] = [b"", b"   \t"]
    lines += [b"", b""]
    path = tmp_path_factory.mktemp("canonical") / "gpt-4o-airline.corrupted.jsonl"
    path.write_bytes(b"\n".join(lines) + b"\n")
    # Line numbers in the file: records after the two inserted blank lines moved down by 2.
    line_of = {n: (n if n <= 100 else n + 2) for n in range(1, 201)}
    return path, parse_file(path), corruptions, line_of


def test_conservation_holds_for_the_corrupted_copy(corrupted):
    _, result, corruptions, _ = corrupted
    assert result.format == "canonical"
    assert result.records_read == 200
    assert len(result.valid) + len(result.quarantined) == result.records_read
    assert len(result.quarantined) == len(corruptions) == 12


def test_each_corrupted_line_is_quarantined_with_its_line_and_field(corrupted):
    _, result, corruptions, line_of = corrupted
    quarantined = _by_line(result)
    assert set(quarantined) == {line_of[n] for n in corruptions}
    for n, (_, field, reason_part) in corruptions.items():
        q = quarantined[line_of[n]]
        assert (q.field, q.pointer) == (field, None), (n, q.reason)
        assert reason_part in q.reason, (n, q.reason)


def test_bad_json_line_is_quarantined_with_its_line(corrupted):
    _, result, _, _ = corrupted
    q = _by_line(result)[3]
    assert q.reason.startswith("invalid JSON") and q.field is None


def test_missing_task_id_is_quarantined_with_field_task_id(corrupted):
    q = _by_line(corrupted[1])[10]
    assert q.field == "task_id" and q.reason == "task_id: Field required"


def test_unknown_step_kind_is_quarantined_with_its_step_index(corrupted):
    _, result, corruptions, _ = corrupted
    q = _by_line(result)[30]
    assert q.field == "steps.2.kind"
    assert "'plan', 'tool', 'verify', 'answer', 'message' or 'observation'" in q.reason


def test_nan_score_is_quarantined_with_its_field(corrupted):
    q = _by_line(corrupted[1])[40]
    assert q.field == "outcome.score"
    assert q.reason == "outcome.score: NaN is not a finite number (JSON has no NaN or Infinity)"


def test_infinite_score_is_quarantined_with_its_field(corrupted):
    for line in (50, 55):
        q = _by_line(corrupted[1])[line]
        assert q.field == "outcome.score" and "not a finite number" in q.reason


def test_non_utf8_line_is_quarantined_with_the_byte_offset(corrupted):
    _, result, corruptions, _ = corrupted
    raw = corruptions[60][0]
    offset = raw.index(b"\xff")
    q = _by_line(result)[60]
    assert q.reason == f"not valid UTF-8: byte 0xff at byte offset {offset}"


def test_fifty_megabyte_line_is_quarantined_without_being_parsed(corrupted):
    _, result, corruptions, line_of = corrupted
    q = _by_line(result)[line_of[70]]
    # The line is a valid trajectory with padding: it would have parsed had it been decoded.
    assert orjson.loads(corruptions[70][0])["trajectory_id"]
    # never held whole (#25: a 200 MB line peaked at 3.2 GB): the record keeps the line's head
    # and says its size; the batch's snapshot keeps the line whole
    big = corruptions[70][0]
    assert q.raw == big[: len(q.raw)] and len(q.raw) == OVERSIZED_HEAD_BYTES
    assert f"record is {len(big)} bytes, over the {16 * 2**20}-byte limit" in q.reason


def test_raw_bytes_of_every_quarantined_line_are_kept_complete(corrupted):
    path, result, corruptions, line_of = corrupted
    file_lines = path.read_bytes().split(b"\n")
    for n, (raw, _, _) in corruptions.items():
        q = _by_line(result)[line_of[n]]
        if n == 70:  # the oversized line keeps its head (test above)
            continue
        assert q.raw == raw == file_lines[line_of[n] - 1]
        assert q.file == str(path)


def test_untouched_lines_still_parse_to_the_original_trajectories(corrupted, originals):
    _, result, corruptions, line_of = corrupted
    untouched = [n for n in range(1, 201) if n not in corruptions]
    assert [r.line for r in result.valid] == [line_of[n] for n in untouched]
    assert _trajectories(result) == [originals[n - 1] for n in untouched]


def test_max_record_bytes_is_the_inclusive_line_limit(originals, tmp_path: Path):
    line = originals[0].model_dump_json().encode()
    path = tmp_path / "one.jsonl"
    path.write_bytes(line + b"\r\n")  # the terminator is not part of the record
    assert len(parse_file(path, max_record_bytes=len(line)).valid) == 1
    limited = parse_file(path, max_record_bytes=len(line) - 1)
    assert not limited.valid and limited.quarantined[0].raw == line


def test_duplicate_trajectory_id_is_quarantined(originals, tmp_path: Path):
    path = tmp_path / "dup.jsonl"
    lines = [t.model_dump_json().encode() for t in originals[:3]]
    path.write_bytes(b"\n".join([lines[0], lines[1], lines[0], lines[2]]))  # no final newline
    result = parse_file(path)
    assert [r.line for r in result.valid] == [1, 2, 4]
    (q,) = result.quarantined
    assert (q.line, q.field) == (3, "trajectory_id") and "first seen at line 1" in q.reason


# ---------------------------------------------------------------- flat JSONL


def test_flat_copy_quarantines_by_flat_field(originals, tmp_path: Path):
    def record(t: Trajectory, **changes) -> bytes:
        base = {"task_id": t.task_id, "input": t.query, "response": t.final_answer or "",
                "score": t.outcome.score, "agent_id": t.agent_id, "adapter_version": None,
                "timestamp": None, "metadata": {}}
        base.update(changes)
        return json.dumps({k: v for k, v in base.items() if v is not ...}, allow_nan=True).encode()

    lines = [record(t) for t in originals[:20]]
    lines[1] = record(originals[1], score=math.nan)
    lines[4] = record(originals[4], task_id=...)
    lines[7] = record(originals[7], score="high")
    lines[9] = record(originals[9], score=math.inf)
    lines[11] = record(originals[11], task_id=12)
    path = tmp_path / "flat.jsonl"
    path.write_bytes(b"\n".join(lines) + b"\n")
    result = parse_file(path)
    assert result.format == "flat" and result.records_read == 20 and len(result.valid) == 15
    got = {q.line: (q.field, q.raw) for q in result.quarantined}
    assert got == {2: ("score", lines[1]), 5: ("task_id", lines[4]), 8: ("score", lines[7]),
                   10: ("score", lines[9]), 12: ("task_id", lines[11])}
    assert "NaN" in _by_line(result)[2].reason


# ---------------------------------------------------------------- empty files


@pytest.mark.parametrize("content", [b"", b"  \n\n\t \r\n"], ids=["zero-bytes", "whitespace"])
@pytest.mark.parametrize("fmt", ["auto", "canonical", "flat", "tau-bench", "tau2", "fireact"])
def test_empty_file_yields_one_quarantined_record(tmp_path: Path, content: bytes, fmt: str):
    path = tmp_path / "empty.jsonl"
    path.write_bytes(content)
    result = parse_file(path, fmt)
    assert (result.records_read, len(result.valid)) == (1, 0)
    (q,) = result.quarantined
    assert (q.reason, q.line, q.pointer, q.raw) == ("empty file: no records", None, None, b"")
    assert result.format == ("unknown" if fmt == "auto" else fmt)


# ---------------------------------------------------------------- whole-file JSON


def test_tau_bench_copy_quarantines_bad_elements_by_pointer(
    tau_bench_path: Path, originals, tmp_path: Path
):
    runs = orjson.loads(tau_bench_path.read_bytes())
    runs[5].pop("task_id")
    runs[17].pop("task_id")
    runs[33]["reward"] = math.nan
    runs[41]["reward"] = math.inf
    runs[60]["trial"] = "zero"
    runs[80]["traj"][3]["role"] = "robot"
    runs[99]["reward"] = "1.0"
    runs[120] = "not a run"
    path = tmp_path / "gpt-4o-airline.json"
    path.write_text(json.dumps(runs, indent=2, allow_nan=True))
    result = parse_file(path)
    assert result.format == "tau-bench"
    assert result.records_read == 200 and len(result.valid) + len(result.quarantined) == 200
    got = {q.pointer: q.field for q in result.quarantined}
    assert got == {"/5": "task_id", "/17": "task_id", "/33": "reward", "/41": "reward",
                   "/60": "trial", "/80": "traj.3.role", "/99": "reward", "/120": None}
    reasons = {q.pointer: q.reason for q in result.quarantined}
    assert reasons["/33"] == "reward: NaN is not a finite number (JSON has no NaN or Infinity)"
    assert reasons["/41"].startswith("reward: Infinity is not a finite number")
    assert "expected a JSON object" in reasons["/120"]
    for q in result.quarantined:
        index = int(q.pointer[1:])
        assert q.line is None
        # Raw is the element complete, NaN kept as NaN (not turned into null).
        assert json.dumps(json.loads(q.raw)) == json.dumps(runs[index])
    bad = {5, 17, 33, 41, 60, 80, 99, 120}
    assert _trajectories(result) == [t for i, t in enumerate(originals) if i not in bad]
    assert [r.pointer for r in result.valid][:5] == ["/0", "/1", "/2", "/3", "/4"]


def test_tau2_copy_quarantines_a_nan_reward_by_pointer(shared_data: Path, tmp_path: Path):
    submission = "button-claude-opus-4-6_distyl-ai_2026-03-04"
    source = shared_data / "tau2-bench" / submission / "airline.json"
    doc = orjson.loads(source.read_bytes())
    doc["simulations"][3]["reward_info"]["reward"] = math.nan
    del doc["simulations"][7]["id"]
    doc["simulations"][9]["messages"][1]["content"] = ["a", "list"]
    path = tmp_path / "airline.json"
    path.write_text(json.dumps(doc, allow_nan=True))
    result = parse_file(path)
    assert result.format == "tau2" and (len(result.valid), result.records_read) == (47, 50)
    got = {q.pointer: q.field for q in result.quarantined}
    assert got == {"/simulations/3": "reward_info.reward", "/simulations/7": "id",
                   "/simulations/9": "messages.1.content"}


def test_fireact_copy_quarantines_a_question_by_pointer(shared_data: Path, tmp_path: Path):
    name = "hotpotqa_dev_0_500_llama_models_lora_llama-2-7b-d_1000_0.7_2023-09-19-00-49-36.json"
    source = shared_data / "fireact" / name
    doc = orjson.loads(source.read_bytes())
    first, second = list(doc)[:2]
    doc[first]["reward"] = "yes"
    doc[second]["traj"] = 42
    path = tmp_path / source.name
    path.write_bytes(orjson.dumps(doc))
    result = parse_file(path)
    assert result.format == "fireact" and (len(result.valid), result.records_read) == (498, 500)
    got = {q.pointer: q.field for q in result.quarantined}
    assert got == {f"/{first}": "reward", f"/{second}": "traj"}
    assert orjson.loads(result.quarantined[0].raw) == doc[first]


def test_truncated_whole_file_json_raises_unreadable_naming_the_file(
    tau_bench_path: Path, tmp_path: Path
):
    data = tau_bench_path.read_bytes()
    path = tmp_path / "gpt-4o-airline.json"
    path.write_bytes(data[: len(data) // 2])
    for fmt in ("auto", "tau-bench"):
        with pytest.raises(UnreadableLogError, match="not valid JSON") as caught:
            parse_file(path, fmt)
        assert str(path) in str(caught.value) and caught.value.path == str(path)


def test_non_utf8_whole_file_json_raises_with_the_byte_offset(tau_bench_path: Path, tmp_path: Path):
    data = tau_bench_path.read_bytes()
    at = data.index(b"Mia")
    path = tmp_path / "gpt-4o-airline.json"
    path.write_bytes(data[:at] + b"\xc3\x28" + data[at:])
    with pytest.raises(UnreadableLogError, match=f"byte 0xc3 at byte offset {at}") as caught:
        parse_file(path, "tau-bench")
    assert str(path) in str(caught.value)


def test_missing_file_raises_unreadable(tmp_path: Path):
    for fmt in ("auto", "canonical", "tau2"):
        with pytest.raises(UnreadableLogError, match="cannot open"):
            parse_file(tmp_path / "gone.jsonl", fmt)


def test_deeply_nested_line_is_quarantined_not_fatal(originals, tmp_path: Path):
    path = tmp_path / "deep.jsonl"
    deep = b'{"metadata":' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    path.write_bytes(originals[0].model_dump_json().encode() + b"\n" + deep + b"\n")
    result = parse_file(path)
    assert [r.line for r in result.valid] == [1]
    (q,) = result.quarantined
    assert q.line == 2 and q.reason.startswith("invalid JSON") and q.raw == deep


# ---------------------------------------------------------------- read by worker processes


def _read_all(path: Path, fmt: str = "auto", **options) -> tuple[str, int, list, list]:
    with read_chunks(path, fmt, **options) as stream:
        chunks = list(stream)
    valid = [record for chunk in chunks for record in chunk.valid.rows(named=True)]
    quarantined = [record for chunk in chunks for record in chunk.quarantined]
    return stream.format, stream.records_read, valid, quarantined


def test_workers_read_the_corrupted_copy_exactly_as_one_process(corrupted, tmp_path: Path):
    path, *_ = corrupted
    # duplicates of lines that sit in other chunks than their first copy, one of them in flight
    lines = path.read_bytes().split(b"\n")
    copy = tmp_path / "with-duplicates.jsonl"
    copy.write_bytes(b"\n".join(lines + [lines[0], lines[150]]) + b"\n")
    serial = _read_all(copy, workers=1)
    for options in ({"max_records": 16}, {"max_records": 1000, "max_bytes": 40_000}):
        assert _read_all(copy, workers=2, **options) == serial
    fmt, records_read, valid, quarantined = serial
    assert (fmt, records_read, len(valid)) == ("canonical", 202, 188)
    duplicates = [q for q in quarantined if q.field == "trajectory_id"]
    assert [q.line for q in duplicates] == [len(lines) + 1, len(lines) + 2]
    assert "first seen at line 1" in duplicates[0].reason


def test_workers_read_flat_lines_with_their_default_ids(originals, tmp_path: Path):
    path = tmp_path / "fleet.jsonl"
    rows = [{"task_id": t.task_id, "input": t.query, "response": "ok", "score": 1.0, "agent_id": "a"} for t in originals[:9]]
    rows[4]["score"] = "high"
    path.write_bytes(b"\n".join(orjson.dumps(r) for r in rows))
    fmt, records_read, valid, quarantined = _read_all(path, workers=2, max_records=2)
    assert (fmt, records_read) == ("flat", 9)
    assert [r["trajectory_id"] for r in valid] == [f"fleet:{n}" for n in (1, 2, 3, 4, 6, 7, 8, 9)]
    assert [(q.line, q.field) for q in quarantined] == [(5, "score")]
    assert _read_all(path, workers=1, max_records=2) == (fmt, records_read, valid, quarantined)


def test_workers_keep_the_empty_file_record(tmp_path: Path):
    path = tmp_path / "blank.jsonl"
    path.write_bytes(b"\n  \n")
    fmt, records_read, valid, (q,) = _read_all(path, "canonical", workers=2)
    assert (fmt, records_read, valid, q.reason) == ("canonical", 1, [], "empty file: no records")


def test_a_reader_stopped_early_stops_its_workers(corrupted):
    path, *_ = corrupted
    done = threading.Event()

    def read_one_chunk():
        with read_chunks(path, workers=2, max_records=4) as stream:
            next(iter(stream))
        done.set()

    thread = threading.Thread(target=read_one_chunk, daemon=True)
    thread.start()
    assert done.wait(timeout=120), "leaving the with block did not shut the worker pool down"


def test_worker_count_auto_uses_workers_only_for_large_files(tmp_path: Path):
    small = tmp_path / "small.jsonl"
    small.write_bytes(b"{}\n")
    assert worker_count(0, small) == 1
    assert worker_count(3, small) == 3
    with pytest.raises(ValueError, match="workers must be >= 0"):
        worker_count(-1, small)
