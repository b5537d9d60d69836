"""Per-record isolation and values kept as written: a record that is nested too deep, holds an
integer beyond 64 bits, a duplicate key, a number beyond a float or a lone surrogate is
quarantined alone, with a reason naming what is in the file; everything else is read exactly.
Each case used to fail its whole file or alter a value silently."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from flow_assets.logs.faithful import decode_marked, find_problem, suspicious
from flow_assets.logs.reader import parse_file
from flow_assets.logs.tables import chunk_records, quarantine_frame
from tests.conftest import TAU_BENCH

FLOWOPT = str(Path(sys.executable).with_name("flowopt"))


@pytest.fixture(scope="module")
def real_lines():
    """Canonical JSON of the first five real tau-bench trajectories."""
    return [v.trajectory.model_dump_json() for v in parse_file(TAU_BENCH).valid[:5]]


def _with(line: str, trajectory_id: str, metadata_json: str) -> str:
    record = json.loads(line)
    record["trajectory_id"], record["metadata"] = trajectory_id, {"PLACE": 0}
    return json.dumps(record).replace('{"PLACE": 0}', metadata_json)


def test_each_bad_record_of_a_canonical_file_is_quarantined_alone_with_what_is_in_it(tmp_path, real_lines):
    good = real_lines[0]
    lines = [
        good,
        _with(real_lines[1], "deep", '{"x": ' + "[" * 1000 + "1" + "]" * 1000 + "}"),
        _with(real_lines[2], "big", '{"n": 1180591620717411303424}'),
        _with(real_lines[3], "dup", '{"k": 1, "k": 2}'),
        _with(real_lines[4], "huge", '{"v": 1e400}'),
        _with(real_lines[1], "surrogate", '{"note": "\\ud800"}'),
        _with(real_lines[2], "u64", '{"n": 18446744073709551615, "id": "123456789012345678901234"}'),
    ]
    path = tmp_path / "copies.jsonl"
    path.write_text("\n".join(lines) + "\n")
    result = parse_file(path)
    assert [v.trajectory.trajectory_id for v in result.valid] == [json.loads(good)["trajectory_id"], "u64"]
    u64 = result.valid[1].trajectory.metadata
    assert u64["n"] == 18446744073709551615 and isinstance(u64["n"], int)  # the largest exact integer, kept
    reasons = {q.line: (q.field, q.reason) for q in result.quarantined}
    assert reasons[2] == (None, "record is nested too deeply to be read and stored (over about 1,000 levels)")
    assert reasons[3] == ("metadata.n", "metadata.n: integer 1180591620717411303424 does not fit in 64 bits (it would be rounded to a float)")
    assert reasons[4][0] == "metadata" and "duplicate key 'k'" in reasons[4][1]
    assert reasons[5] == ("metadata.v", "metadata.v: 1e400 is beyond the range of a 64-bit float")
    assert reasons[6][0] == "metadata.note" and "lone surrogate \\ud800" in reasons[6][1]
    assert all(q.raw == lines[q.line - 1].encode() for q in result.quarantined)  # raw bytes complete
    # and the data plane's frames take every record (the deep one used to fail the whole file)
    chunks = list(chunk_records(iter([*result.valid, *result.quarantined])))
    assert sum(c.valid.height for c in chunks) == 2 and quarantine_frame(result.quarantined).height == 5


def test_a_lone_surrogate_in_one_element_of_a_tau_bench_document_quarantines_that_element(tmp_path):
    text = TAU_BENCH.read_text()
    at = text.index('"content": "') + len('"content": "')
    path = tmp_path / "airline.json"
    path.write_text(text[:at] + "\\ud800" + text[at:])
    result = parse_file(path)
    assert len(result.valid) == 199
    (bad,) = result.quarantined
    assert bad.pointer == "/0" and bad.field == "traj.0.content" and "lone surrogate \\ud800" in bad.reason
    assert b"\\ud800" in bad.raw and json.loads(bad.raw)["task_id"] == json.loads(text)[0]["task_id"]
    assert quarantine_frame(result.quarantined).height == 1


def test_a_duplicate_key_in_one_element_of_a_document_quarantines_only_that_element(tmp_path):
    runs = json.loads(TAU_BENCH.read_bytes())
    text = json.dumps(runs[:3], indent=1).replace('"reward":', '"reward": 1.0, "reward":', 1)
    path = tmp_path / "airline.json"
    path.write_text(text)
    result = parse_file(path)
    assert len(result.valid) == 2
    (bad,) = result.quarantined
    assert bad.pointer == "/0" and "duplicate key 'reward'" in bad.reason


def test_the_cheap_checks_flag_what_orjson_alters_and_pass_the_real_logs(real_lines):
    import orjson

    for raw in (b'{"a": 1, "a": 2}', b'{"n": 100000000000000000000}'):
        assert suspicious(raw, orjson.loads(raw))
        assert find_problem(decode_marked(raw.decode())) is not None
    for line in real_lines:
        raw = line.encode()
        assert not suspicious(raw, orjson.loads(raw))
    pretty = json.dumps(json.loads(TAU_BENCH.read_bytes())[:20], indent=2).encode()
    assert not suspicious(pretty, orjson.loads(pretty))


def test_a_file_name_that_is_not_utf8_is_ingested_and_named(tmp_path):
    logs = tmp_path / "logs"
    logs.mkdir()
    shutil.copyfile(TAU_BENCH, os.fsdecode(bytes(logs) + b"/caf\xe9.json"))
    cmd = [FLOWOPT, "ingest", str(logs), "--landing", str(tmp_path / "landing"), "--lake", str(tmp_path / "lake"),
           "--home", str(tmp_path / "home")]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    (row,) = json.loads(done.stdout)["files"]
    assert row["file"].endswith("logs/caf\\xe9.json") and row["trajectories"] == 200
    assert row["partition_key"].startswith("logs.caf~E9.")
