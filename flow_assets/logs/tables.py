"""Parsed records as lake tables: ``interaction_logs``, ``quarantine``, ``trajectories``, ``steps``.

Pure polars; no Dagster. JSON-valued fields (step input/output, metadata) are stored as JSON text
so every table has a fixed schema whatever the agent logged.
"""

from __future__ import annotations

from collections.abc import Iterable

import orjson
import polars as pl

from flow_assets.logs.records import ParseResult, QuarantinedRecord, ValidRecord

INTERACTION_LOGS_SCHEMA = {
    "record": pl.UInt32,
    "file": pl.String,
    "line": pl.Int64,
    "pointer": pl.String,
    "format": pl.String,
    "trajectory_id": pl.String,
    "task_id": pl.String,
    "agent_id": pl.String,
    "record_json": pl.String,
}
QUARANTINE_SCHEMA = {
    "file": pl.String,
    "line": pl.Int64,
    "pointer": pl.String,
    "field": pl.String,
    "reason": pl.String,
    "raw": pl.Binary,
}
TRAJECTORIES_SCHEMA = {
    "trajectory_id": pl.String,
    "task_id": pl.String,
    "agent_id": pl.String,
    "adapter_version": pl.String,
    "source": pl.String,
    "query": pl.String,
    "final_answer": pl.String,
    "outcome_success": pl.Boolean,
    "outcome_score": pl.Float64,
    "n_steps": pl.UInt32,
    "timestamp": pl.String,
    "metadata": pl.String,
}
STEPS_SCHEMA = {
    "trajectory_id": pl.String,
    "index": pl.UInt32,
    "kind": pl.String,
    "module": pl.String,
    "tool": pl.String,
    "input": pl.String,
    "output": pl.String,
    "status": pl.String,
    "confidence": pl.Float64,
    "duration_ms": pl.Float64,
    "token_ids": pl.List(pl.Int64),
    "logprobs": pl.List(pl.Float64),
}


def split_duplicates(result: ParseResult) -> tuple[list[ValidRecord], list[QuarantinedRecord]]:
    """Valid records with unique ``trajectory_id`` and the quarantine, in file order.

    A second record with an already-seen ``trajectory_id`` is quarantined (field
    ``trajectory_id``) rather than dropped, so valid + quarantined still equals records read.
    """
    seen: dict[str, ValidRecord] = {}
    valid: list[ValidRecord] = []
    quarantined = list(result.quarantined)
    for rec in result.valid:
        tid = rec.trajectory.trajectory_id
        if tid in seen:
            first = seen[tid]
            where = f"line {first.line}" if first.line is not None else f"record {first.pointer}"
            quarantined.append(
                QuarantinedRecord(
                    file=rec.file,
                    line=rec.line,
                    pointer=rec.pointer,
                    field="trajectory_id",
                    reason=f"duplicate trajectory_id {tid!r} (first seen at {where})",
                    raw=rec.trajectory.model_dump_json().encode(),
                )
            )
            continue
        seen[tid] = rec
        valid.append(rec)
    return valid, quarantined


def interaction_logs_frame(valid: Iterable[ValidRecord], fmt: str) -> pl.DataFrame:
    """One row per valid record: where it came from and its canonical JSON."""
    rows = [
        {
            "record": i,
            "file": rec.file,
            "line": rec.line,
            "pointer": rec.pointer,
            "format": fmt,
            "trajectory_id": rec.trajectory.trajectory_id,
            "task_id": rec.trajectory.task_id,
            "agent_id": rec.trajectory.agent_id,
            "record_json": rec.trajectory.model_dump_json(),
        }
        for i, rec in enumerate(valid)
    ]
    return pl.DataFrame(rows, schema=INTERACTION_LOGS_SCHEMA)


def quarantine_frame(quarantined: Iterable[QuarantinedRecord]) -> pl.DataFrame:
    """One row per quarantined record: file, line or pointer, field, reason and its raw bytes."""
    rows = [
        {
            "file": q.file,
            "line": q.line,
            "pointer": q.pointer,
            "field": q.field,
            "reason": q.reason,
            "raw": q.raw,
        }
        for q in quarantined
    ]
    return pl.DataFrame(rows, schema=QUARANTINE_SCHEMA)


def _as_text(value: object) -> str | None:
    # Text stays readable in the UI; anything else is kept exactly, as JSON.
    if value is None or isinstance(value, str):
        return value
    return orjson.dumps(value).decode()


def trajectory_tables(record_json: Iterable[str], source: str) -> tuple[pl.DataFrame, pl.DataFrame]:
    """The ``trajectories`` and ``steps`` tables of canonical records (already validated).

    Args:
        record_json: canonical trajectory JSON texts (the ``interaction_logs.record_json`` column).
        source: the batch's source name, stored on every trajectory.

    Returns:
        ``(trajectories, steps)`` with :data:`TRAJECTORIES_SCHEMA` and :data:`STEPS_SCHEMA`.
    """
    traj_rows: list[dict] = []
    step_rows: list[dict] = []
    for text in record_json:
        t = orjson.loads(text)
        tid = t["trajectory_id"]
        traj_rows.append(
            {
                "trajectory_id": tid,
                "task_id": t["task_id"],
                "agent_id": t["agent_id"],
                "adapter_version": t.get("adapter_version"),
                "source": source,
                "query": t["query"],
                "final_answer": t.get("final_answer"),
                "outcome_success": t["outcome"].get("success"),
                "outcome_score": t["outcome"].get("score"),
                "n_steps": len(t["steps"]),
                "timestamp": t.get("timestamp"),
                "metadata": orjson.dumps(t.get("metadata") or {}, option=orjson.OPT_SORT_KEYS).decode(),
            }
        )
        for s in t["steps"]:
            step_rows.append(
                {
                    "trajectory_id": tid,
                    "index": s["index"],
                    "kind": s["kind"],
                    "module": s.get("module"),
                    "tool": s.get("tool"),
                    "input": _as_text(s.get("input")),
                    "output": _as_text(s.get("output")),
                    "status": s.get("status", "ok"),
                    "confidence": s.get("confidence"),
                    "duration_ms": s.get("duration_ms"),
                    "token_ids": s.get("token_ids"),
                    "logprobs": s.get("logprobs"),
                }
            )
    return (
        pl.DataFrame(traj_rows, schema=TRAJECTORIES_SCHEMA),
        pl.DataFrame(step_rows, schema=STEPS_SCHEMA),
    )
