"""``flowopt demo``: the real logs of ``../shared/data`` through the sensor path, end to end.

Every run lands in the local instance (``.dagster_home``), so ``make ui`` shows them afterwards.
The demo starts from a clean lake, landing directory and instance storage each time so its
numbers are reproducible.
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import polars as pl

from flow_assets.definitions import build_definitions
from flow_assets.local import REPO_ROOT, execute_requests, local_instance, tick_sensor
from flow_assets.summary import batch_summary, source_summary
from resources.lake import TrajectoryLake

SHARED_DATA = REPO_ROOT.parent / "shared" / "data"
_INSTANCE_STORAGE = ("storage", "history", "schedules", "logs", ".logs_queue", ".telemetry")


def land_shared_data(data_dir: Path, landing: Path) -> list[Path]:
    """Copy every ``*.json`` log of ``data_dir`` into ``landing/<source>/...`` the way a writer
    must (write ``.tmp``, then rename); the source is the top folder (tau-bench, tau2-bench,
    fireact). Returns the landed paths.

    Raises:
        FileNotFoundError: ``data_dir`` does not exist (the message names it).
    """
    if not data_dir.is_dir():
        raise FileNotFoundError(f"real agent logs not found at {data_dir}")
    landed = []
    for src in sorted(data_dir.rglob("*.json")):
        dest = landing / src.relative_to(data_dir)
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp = dest.with_name(dest.name + ".tmp")
        shutil.copyfile(src, tmp)
        tmp.rename(dest)
        landed.append(dest)
    return landed


def _reset(home: Path, lake: Path, landing: Path) -> None:
    for path in (lake, landing, *(home / name for name in _INSTANCE_STORAGE)):
        if path.is_dir():
            shutil.rmtree(path)
        elif path.exists():
            path.unlink()


def _print_table(frame: pl.DataFrame) -> None:
    cols = frame.columns
    rows = [[str(v) for v in row] for row in frame.iter_rows()]
    widths = [max(len(c), *(len(r[i]) for r in rows)) if rows else len(c) for i, c in enumerate(cols)]
    print("  ".join(c.ljust(w) for c, w in zip(cols, widths)))
    for r in rows:
        print("  ".join(v.ljust(w) for v, w in zip(r, widths)))


def run_demo(
    home: Path = REPO_ROOT / ".dagster_home",
    lake_root: Path = REPO_ROOT / ".lake",
    landing_dir: Path = REPO_ROOT / ".landing",
    data_dir: Path = SHARED_DATA,
    report: Path = REPO_ROOT / "reports" / "demo-summary.json",
) -> dict:
    """Run the demo and write ``report``; returns the report's content.

    Raises:
        RuntimeError: a batch of the real logs failed (the message names it and the error).
    """
    started = time.perf_counter()
    _reset(home, lake_root, landing_dir)
    instance = local_instance(home)
    defs = build_definitions(str(lake_root), str(landing_dir))
    land_shared_data(data_dir, landing_dir)
    tick = tick_sensor(defs, instance, "new_logs_sensor")
    execute_requests(defs, instance, "log_batch_job", tick)
    if tick.failed:
        raise RuntimeError(f"demo batches failed: {tick.failed}")
    lake = TrajectoryLake(root=str(lake_root))
    per_batch = batch_summary(lake, tick.succeeded)
    per_source = source_summary(lake, per_batch)
    seconds = time.perf_counter() - started
    print(f"\nflowopt demo: {len(tick.succeeded)} log batches through the data plane in {seconds:.1f} s\n")
    _print_table(per_source)
    content = {
        "data_plane": {
            "seconds": round(seconds, 2),
            "batches": per_batch.to_dicts(),
            "sources": per_source.to_dicts(),
            "dagster_home": str(home),
        }
    }
    report.parent.mkdir(parents=True, exist_ok=True)
    report.write_text(json.dumps(content, indent=2) + "\n")
    print(f"\nwritten {report}; `make ui` shows the runs and materialisations")
    return content
