"""Names from users' files and flags: partition keys are injective and bounded, and ``--source``
is one safe directory name inside the landing directory (attacks that used to escape it, collide
or crash)."""

import json
import os
from pathlib import Path

import pytest
from dagster import DagsterInstance

from flow_assets.logs.ingest import IngestUsageError, resolve_arguments
from flow_assets.core.partitions import log_batches
from tests.conftest import run_cli
from flow_assets.logs.landing import KEY_COMPONENT_LIMIT, LandedFile, batch_key, key_component, key_source
from tests.conftest import SHARED_DATA, TAU_BENCH

SHA = "0123456789abcdef" * 4


def _key(relpath: str) -> str:
    parts = relpath.split("/")
    source = parts[0] if len(parts) > 1 else Path(parts[0]).stem
    return batch_key(LandedFile(Path("/landing", relpath), relpath, source, 1, 1), SHA)


def test_partition_keys_never_collapse_two_names_into_one():
    names = [
        "team a/x.json", "team-a/x.json", "team_a/x.json",  # used to collide on "team-a"
        "a.b/c.json", "a/b.c.json",  # a dot inside a name must not read as the separator
        "src/dir/file.json", "src/dir-file.json", "src/dir.file.json",
        "ログ/x.json", "日志/x.json",  # non-Latin names used to collapse to "-"
        "x.json", "x/x.json",
        "long/" + "a" * 200 + "1.json", "long/" + "a" * 200 + "2.json",  # cut names used to collide
        "flowopt-calc/r0001-v0-ab.jsonl", "r0001-v0-ab/flowopt-calc.jsonl", "r0001/flowopt-calc.v0-ab.jsonl",  # round keys
        "flowopt-calc/r0001-v0-ab/x.jsonl", "flowopt-calc/r001-v0-ab.jsonl",
    ]
    keys = [_key(n) for n in names]
    assert len(set(keys)) == len(keys), keys
    assert _key("tau-bench/gpt-4o-airline.json") == f"tau-bench.gpt-4o-airline.{SHA[:12]}"  # plain names read as before
    assert all(len(k) <= 2 * KEY_COMPONENT_LIMIT + 14 and "..." not in k for k in keys)


def test_a_rounds_batch_key_starts_with_the_round_and_names_its_source():
    key = _key("flowopt-calculator/r0018-v3-0a1b2c3d4e.jsonl")
    assert key == f"r0018.flowopt-calculator.v3-0a1b2c3d4e.{SHA[:12]}"  # the UI cuts long keys in the middle
    assert key_source(key) == "flowopt-calculator"
    assert key_source(_key("tau-bench/gpt-4o-airline.json")) == "tau-bench"
    assert key_source(_key("r0018/x.json")) == "r0018"  # a source named like a round is still a source
    assert key_source(_key("x.json")) == "x"


def test_a_component_from_bytes_that_are_not_utf8_is_encoded_from_the_bytes():
    name = os.fsdecode(b"caf\xe9")  # latin-1 on a UTF-8 file system: a surrogate escape in Python
    assert key_component(name) == "caf~E9" and key_component("café") == "caf~C3~A9"


def _ingest(tmp_path, *args):
    return run_cli(["ingest", *map(str, args), "--landing", str(tmp_path / "landing"), "--lake", str(tmp_path / "lake"),
                    "--home", str(tmp_path / "home")])  # fmt: skip


@pytest.mark.parametrize("source", ["/tmp/abs", "a/b", ".", "..", "tab\there", ".hidden", "x.tmp", "", "x" * 201])
def test_a_source_that_is_not_one_safe_name_is_refused(source):
    with pytest.raises(IngestUsageError) as info:
        resolve_arguments([TAU_BENCH], source)
    (problem,) = info.value.problems
    assert problem.startswith("--source") and "one directory name inside the landing directory" in problem


def test_a_source_that_would_escape_the_landing_directory_writes_nothing(tmp_path):
    rc, out, err = _ingest(tmp_path, TAU_BENCH, "--source", "../../escaped")
    assert rc == 2 and out == ""
    assert "--source '../../escaped' holds a path separator" in err and "Traceback" not in err
    assert not (tmp_path / "landing").exists() and not (tmp_path / "escaped").exists() and not (tmp_path / "home").exists()


def test_sources_that_differ_only_in_unsafe_characters_are_two_batches(tmp_path):
    for source in ("team a", "team-a"):
        rc, out, err = _ingest(tmp_path, TAU_BENCH, "--source", source)
        assert rc == 0, err[-2000:]
    keys = DagsterInstance.local_temp(str(tmp_path / "home")).get_dynamic_partitions(log_batches.name)
    assert sorted(k.split(".")[0] for k in keys) == ["team-a", "team~20a"]  # used to collide on one key


def test_a_file_name_near_the_file_system_limit_is_ingested(tmp_path):
    tau2 = SHARED_DATA / "tau2-bench" / "button-claude-opus-4-6_distyl-ai_2026-03-04" / "airline.json"
    long_name = tmp_path / "logs" / ("r" * 247 + ".json")  # 252 bytes: name + ".tmp" used to pass 255
    long_name.parent.mkdir()
    long_name.write_bytes(tau2.read_bytes())
    rc, out, err = _ingest(tmp_path, long_name)
    assert rc == 0, err[-2000:]
    (row,) = json.loads(out)["files"]
    assert row["status"] == "ingested" and row["trajectories"] > 0
    assert len(row["partition_key"]) < 100 and "~~" in row["partition_key"]
