"""The trajectory lake's partition writes: atomic replacement, chunked writes and reads, sinks."""

import polars as pl
import pytest

from resources.lake import TrajectoryLake

SCHEMA = {"trajectory_id": pl.String, "index": pl.UInt32, "logprobs": pl.List(pl.Float64)}


def frame(ids, start=0):
    return pl.DataFrame(
        {"trajectory_id": ids, "index": list(range(start, start + len(ids))), "logprobs": [[-0.5]] * len(ids)},
        schema=SCHEMA,
    )


def test_chunks_written_one_by_one_read_back_in_order(tmp_path):
    lake = TrajectoryLake(root=str(tmp_path))
    with lake.partition_writer("steps", "b1", SCHEMA) as out:
        out.write(frame(["a", "b"]))
        out.write(frame([], 2))  # an empty chunk adds nothing
        out.write(frame(["c", "d", "e"], 2).select("logprobs", "index", "trajectory_id"))  # any column order
    assert out.rows == 5
    whole = lake.read_partition("steps", "b1")
    assert whole.schema == pl.Schema(SCHEMA) and whole["trajectory_id"].to_list() == list("abcde")
    chunks = list(lake.iter_partition("steps", "b1", rows=2, columns=["index"]))
    assert [c["index"].to_list() for c in chunks] == [[0, 1], [2, 3], [4]]
    assert lake.scan("steps").collect()["batch"].unique().to_list() == ["b1"]


def test_a_writer_that_fails_leaves_the_old_partition_whole(tmp_path):
    lake = TrajectoryLake(root=str(tmp_path))
    lake.write_partition("steps", "b1", frame(["old"]))
    with pytest.raises(RuntimeError, match="parser died"):
        with lake.partition_writer("steps", "b1", SCHEMA) as out:
            out.write(frame(["new-1", "new-2"]))
            raise RuntimeError("parser died")
    assert lake.read_partition("steps", "b1")["trajectory_id"].to_list() == ["old"]
    assert [p.name for p in lake.partition_path("steps", "b1").parent.iterdir()] == ["data.parquet"]  # no temp left


def test_a_writer_with_no_rows_leaves_an_empty_partition_with_its_schema(tmp_path):
    lake = TrajectoryLake(root=str(tmp_path))
    with lake.partition_writer("quarantine", "b1", SCHEMA):
        pass
    empty = lake.read_partition("quarantine", "b1")
    assert empty.height == 0 and empty.schema == pl.Schema(SCHEMA)


def test_a_streamed_query_replaces_its_partition_keeping_row_order(tmp_path):
    lake = TrajectoryLake(root=str(tmp_path))
    ids = [f"t{i % 97}" for i in range(10_000)]
    lake.write_partition("steps", "b1", frame(ids))
    adv = pl.DataFrame({"trajectory_id": [f"t{i}" for i in range(96, -1, -1)], "advantage": [float(i) for i in range(97)]})
    query = lake.scan_partition("steps", "b1").join(adv.lazy(), on="trajectory_id", how="left", maintain_order="left")
    lake.sink_partition("step_advantages", "b1", query)
    out = lake.read_partition("step_advantages", "b1")
    assert out["trajectory_id"].to_list() == ids and out["index"].to_list() == list(range(10_000))
    assert out["advantage"].to_list() == [96.0 - (i % 97) for i in range(10_000)]


def test_reading_a_partition_never_written_names_it(tmp_path):
    lake = TrajectoryLake(root=str(tmp_path))
    for read in (lambda: lake.scan_partition("steps", "nope"), lambda: next(lake.iter_partition("steps", "nope"))):
        with pytest.raises(FileNotFoundError, match="'steps' has no partition 'nope'"):
            read()
