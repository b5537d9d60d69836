"""``training.export_trajectories``: trajectories of the lake, by batch or time range, as a file.

One row per trajectory: the ``trajectories`` table's columns, the trajectory's ``reward`` and
``advantage`` where computed, and its canonical record (``record_json``: query, every step with
token ids and log-probs, outcome), so an export is a complete training set on its own. Parquet
(written by polars) or JSONL, written to a temporary name and renamed.
"""

from __future__ import annotations

import os
from datetime import datetime
from pathlib import Path
from typing import Literal

import polars as pl
from pydantic import BaseModel, Field

from flow_assets.api.jsonrpc import INVALID_PARAMS, RpcError


class ExportParams(BaseModel):
    """Which trajectories (``batches``, and/or ``since`` / ``until`` on their timestamps, ISO 8601
    with a time zone), in which ``format``, to which server-side ``path`` (default: the API's
    export directory, fetched with ``GET /exports/<name>``)."""

    batches: list[str] | None = Field(None, max_length=10_000)
    since: datetime | None = None
    until: datetime | None = None
    format: Literal["parquet", "jsonl"] = "parquet"
    path: str | None = None


def export_trajectories(lake, params: ExportParams, target: Path) -> dict:
    """Write the selection to ``target``; returns ``{"rows", "format", "batches"}``.

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
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.tmp")
    if params.format == "parquet":
        table.write_parquet(tmp)
    else:
        table.write_ndjson(tmp)
    os.replace(tmp, target)
    return {"rows": table.height, "format": params.format, "batches": sorted(set(table["batch"].to_list()))}
