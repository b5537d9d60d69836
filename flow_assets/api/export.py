"""``training.export_trajectories``: trajectories of the lake, by batch or time range, as a file.

One row per trajectory: the ``trajectories`` table's columns, the trajectory's ``reward`` and
``advantage`` where computed, and its canonical record (``record_json``: query, every step with
token ids and log-probs, outcome), so an export is a complete training set on its own. Parquet
(written by polars) or JSONL.

Where it is written is the API's business alone: the export directory the server was started
with (``FLOWOPT_EXPORTS``), under a name the API chooses (``trajectories-<random>.<format>``);
the client fetches it with ``GET /exports/<name>``. A client-given ``path`` is refused (-32602,
field ``path``): it once let any caller overwrite any file the API could write (the adapter
registry among them). The file is written under a hidden temporary name and hard-linked to its
final name, which fails rather than replaces when that name exists: an export never overwrites
a file.
"""

from __future__ import annotations

import os
import uuid
from datetime import datetime
from pathlib import Path
from typing import Literal

import polars as pl
from pydantic import BaseModel, Field, field_validator

from flow_assets.api.jsonrpc import INVALID_PARAMS, RpcError


class ExportParams(BaseModel):
    """Which trajectories (``batches``, and/or ``since`` / ``until`` on their timestamps, ISO 8601
    with a time zone), in which ``format``. ``path`` exists only to be refused by name: the API
    alone decides where it writes (module docstring)."""

    batches: list[str] | None = Field(None, max_length=10_000)
    since: datetime | None = None
    until: datetime | None = None
    format: Literal["parquet", "jsonl"] = "parquet"
    path: str | None = None

    @field_validator("path")
    @classmethod
    def _no_client_path(cls, value: str | None) -> None:
        if value is not None:
            raise ValueError("the API chooses where an export is written (its export directory); download it from the returned url instead")
        return None


def export_trajectories(lake, params: ExportParams, export_dir: str | Path) -> dict:
    """Write the selection to a new file in ``export_dir`` (created if missing) under a name
    chosen here; returns ``{"rows", "format", "batches", "name"}``.

    Raises:
        RpcError(INVALID_PARAMS): an unknown batch (named by index), a naive datetime, or a
            selection that matches nothing.
    """
    known = set(lake.batches("trajectories"))
    for i, key in enumerate(params.batches or []):
        if key not in known:
            raise RpcError(INVALID_PARAMS, f"invalid params: batches.{i}: no batch {key!r} in the lake", {"errors": [{"field": f"batches.{i}", "message": "unknown batch"}]})
    for name in ("since", "until"):
        value = getattr(params, name)
        if value is not None and value.tzinfo is None:
            raise RpcError(INVALID_PARAMS, f"invalid params: {name}: give a time zone (e.g. 2026-11-01T00:00:00Z)", {"errors": [{"field": name, "message": "naive datetime"}]})
    chosen = params.batches or sorted(known)
    if not chosen:
        raise RpcError(INVALID_PARAMS, "invalid params: the lake holds no trajectories yet")
    frame = pl.concat([lake.scan_partition("trajectories", b).with_columns(batch=pl.lit(b)) for b in chosen], how="diagonal_relaxed")
    at = pl.col("timestamp").str.to_datetime(time_zone="UTC", strict=False)
    if params.since is not None:
        frame = frame.filter(at >= params.since)
    if params.until is not None:
        frame = frame.filter(at < params.until)
    table = frame.collect()
    for extra, columns in (("rewards", ["trajectory_id", "reward"]), ("advantages", ["trajectory_id", "advantage"]), ("interaction_logs", ["trajectory_id", "record_json"])):
        parts = [lake.read_partition(extra, b).select(columns).with_columns(batch=pl.lit(b)) for b in chosen if b in set(lake.batches(extra))]
        if parts:
            table = table.join(pl.concat(parts).unique(["batch", "trajectory_id"]), on=["batch", "trajectory_id"], how="left")
    name = _write_new(table, params.format, Path(export_dir))
    return {"rows": table.height, "format": params.format, "batches": sorted(set(table["batch"].to_list())), "name": name}


def _write_new(table: pl.DataFrame, fmt: str, export_dir: Path) -> str:
    """Write ``table`` to a new file of ``export_dir``; its name. Written under a hidden unique
    temporary name, then hard-linked to ``trajectories-<random>.<fmt>`` (``os.link`` fails when
    the name exists, where a rename would replace it), so a reader never sees a partial file and
    no existing file is replaced."""
    export_dir.mkdir(parents=True, exist_ok=True)
    tmp = export_dir / f".export-{uuid.uuid4().hex}.tmp"
    try:
        if fmt == "parquet":
            table.write_parquet(tmp)
        else:
            table.write_ndjson(tmp)
        for _ in range(3):  # a 48-bit random name collides only by chance: try another
            name = f"trajectories-{uuid.uuid4().hex[:12]}.{fmt}"
            try:
                os.link(tmp, export_dir / name)
                return name
            except FileExistsError:
                continue
        raise FileExistsError("three export names in a row were taken")
    finally:
        tmp.unlink(missing_ok=True)
