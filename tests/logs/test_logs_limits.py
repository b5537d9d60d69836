"""One bad record is one quarantined record, whatever the format and however it is bad (#25):
an element nested 1,000 or 100,000 levels deep inside a tau-bench, tau2 or FireAct document, or a
line of canonical or flat JSONL, costs that record alone; an oversized line is read through
without ever being held whole."""

from __future__ import annotations

import json
import tracemalloc
from pathlib import Path

import pytest

from flow_assets.logs.chunks import file_blocks, read_chunks
from flow_assets.logs.formats.common import OVERSIZED_HEAD_BYTES
from flow_assets.logs.reader import parse_file
from flow_assets.logs.records import UnreadableLogError
from tests.conftest import TAU_BENCH

SHARED = TAU_BENCH.parents[1]
TAU2 = sorted((SHARED / "tau2-bench").rglob("*.json"))[0]
FIREACT = sorted((SHARED / "fireact").glob("*.json"))[0]


def _deep(levels: int) -> str:
    return "[" * levels + "]" * levels


def _deep_reason(reason: str) -> bool:
    """Whether a quarantine reason says the record nests too deeply (ours, or orjson's words)."""
    return "nested" in reason or "depth limit exceeded" in reason


def _plant(text: str, marker: str, levels: int) -> str:
    """``text`` (JSON) with the first ``marker`` value replaced by ``levels`` nested arrays."""
    assert marker in text
    return text.replace(marker, _deep(levels), 1)


@pytest.mark.parametrize("levels", [1_000, 100_000])
def test_a_deeply_nested_tau_bench_element_is_one_quarantined_record(tmp_path: Path, levels: int):
    runs = json.loads(TAU_BENCH.read_bytes())[:30]
    runs[5]["info"] = {"nested": "MARK"}
    path = tmp_path / "gpt-4o-airline.json"
    path.write_text(_plant(json.dumps(runs), '"MARK"', levels))
    result = parse_file(path)
    assert result.format == "tau-bench" and result.records_read == 30
    assert len(result.valid) == 29 and [v.pointer for v in result.valid] == [f"/{i}" for i in range(30) if i != 5]
    (q,) = result.quarantined
    assert q.pointer == "/5" and _deep_reason(q.reason) and q.raw.startswith(b'{"task_id"')


def test_a_deeply_nested_tau2_simulation_is_one_quarantined_record(tmp_path: Path):
    doc = json.loads(TAU2.read_bytes())
    n = len(doc["simulations"])
    doc["simulations"][2]["messages"][0]["content"] = "MARK"
    path = tmp_path / TAU2.name
    path.write_text(_plant(json.dumps(doc), '"MARK"', 3_000))
    result = parse_file(path)
    assert result.format == "tau2" and result.records_read == n and len(result.valid) == n - 1
    (q,) = result.quarantined
    assert q.pointer == "/simulations/2" and _deep_reason(q.reason)


def test_a_deeply_nested_fireact_question_is_one_quarantined_record(tmp_path: Path):
    doc = json.loads(FIREACT.read_bytes())
    first = next(iter(doc))
    doc[first]["pred"] = "MARK"
    path = tmp_path / FIREACT.name
    path.write_text(_plant(json.dumps(doc), '"MARK"', 2_000))
    result = parse_file(path)
    assert result.format == "fireact" and result.records_read == len(doc) and len(result.valid) == len(doc) - 1
    (q,) = result.quarantined
    assert q.pointer == f"/{first}" and _deep_reason(q.reason)


@pytest.mark.parametrize("levels", [300, 1_000, 100_000])
@pytest.mark.parametrize("fmt", ["canonical", "flat"])
def test_a_deeply_nested_jsonl_line_is_one_quarantined_record(tmp_path: Path, fmt: str, levels: int):
    good = parse_file(TAU_BENCH).valid[0].trajectory.model_dump_json()
    if fmt == "flat":
        good = json.dumps({"task_id": "t", "input": "q", "response": "a", "score": 1.0, "agent_id": "a"})
    lines = [json.loads(good) for _ in range(3)]
    for i, line in enumerate(lines):
        line["trajectory_id" if fmt == "canonical" else "interaction_id"] = f"id{i}"
    lines[1]["metadata"] = {"deep": "MARK"}
    path = tmp_path / f"{fmt}.jsonl"
    path.write_text("\n".join(json.dumps(line) for line in lines[:1]) + "\n"
                    + _plant(json.dumps(lines[1]), '"MARK"', levels) + "\n" + json.dumps(lines[2]) + "\n")
    for workers in (1, 2) if levels == 1_000 else (1,):  # the parallel reader's workers too
        with read_chunks(path, fmt, workers=workers) as stream:
            chunks = list(stream)
        valid = [line for c in chunks for line in c.valid["line"].to_list()]
        quarantined = [q for c in chunks for q in c.quarantined]
        assert stream.records_read == 3 and valid == [1, 3], workers
        assert [q.line for q in quarantined] == [2]


def test_a_document_whose_structure_is_broken_is_still_unreadable(tmp_path: Path):
    path = tmp_path / "gpt-4o-airline.json"
    text = json.dumps(json.loads(TAU_BENCH.read_bytes())[:3])
    path.write_text(text[:-40])  # truncated: no element boundary can be trusted
    with pytest.raises(UnreadableLogError, match="not valid JSON"):
        parse_file(path, "tau-bench")


def _oversized_file(path: Path, line_bytes: int) -> bytes:
    good = parse_file(TAU_BENCH).valid[0].trajectory.model_dump_json().encode()
    big = good[:-1] + b',"padding":"' + b"x" * line_bytes + b'"}'
    other = good.replace(b"task0/trial0", b"task0/trialX")
    path.write_bytes(good + b"\n" + big + b"\r\n" + other + b"\n")
    return big


def test_an_oversized_line_is_quarantined_without_being_held_whole(tmp_path: Path):
    path = tmp_path / "big.jsonl"
    big = _oversized_file(path, 48 * 2**20)
    limit = 2**20
    tracemalloc.start()
    try:
        result = parse_file(path, "canonical", max_record_bytes=limit)
        blocks = [b[:1] + (len(b[1]),) + b[2:] for b in file_blocks(path, 2**20, limit)]
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 12 * 2**20  # the 48 MiB line was never one bytes object (old code: > 48 MiB)
    assert [v.line for v in result.valid] == [1, 3] and result.records_read == 3
    (q,) = result.quarantined
    assert q.line == 2 and q.raw == big[:OVERSIZED_HEAD_BYTES]
    assert f"record is {len(big)} bytes, over the {limit}-byte limit" in q.reason
    # the parallel reader's blocks: line 1, then line 2 alone as (line, head, size), then line 3
    assert [b for b in blocks if len(b) == 3] == [(2, OVERSIZED_HEAD_BYTES, len(big))]
    with read_chunks(path, "canonical", workers=2, max_record_bytes=limit) as stream:
        chunks = list(stream)
    (pq,) = [q for c in chunks for q in c.quarantined]
    assert (pq.line, pq.reason, pq.raw) == (q.line, q.reason, q.raw)
