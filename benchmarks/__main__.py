"""``python -m benchmarks`` (``make bench``): run every benchmark, write ``results/latest.json`` and
``results/latest.md``, print the table.

    python -m benchmarks                      # every benchmark at full size (33 minutes on 2 cores, 12 of them the data plane)
    python -m benchmarks --quick              # smallest sizes, one repeat: proves they still run
    python -m benchmarks --only data_plane --only collection
    python -m benchmarks --threads 2 --out /tmp/bench

A benchmark that raises is recorded with its error and the others still run; the exit status is
1 when any failed.
"""

from __future__ import annotations

import argparse
import importlib
import json
import math
import sys
import time
import traceback
from pathlib import Path

from benchmarks.common import machine_snapshot, quiet_libraries, set_torch_threads, versions

BENCHMARKS = ("data_plane", "trainer_vs_trl", "collection", "gateway", "training_round", "sample_efficiency", "jobs_api", "scale_out")
RESULTS_DIR = Path(__file__).resolve().parent / "results"


def run_benchmark(name: str, quick: bool) -> dict:
    """``benchmarks.<name>.run(quick)`` with its wall seconds; an exception becomes ``error``."""
    started = time.perf_counter()
    try:
        result = importlib.import_module(f"benchmarks.{name}").run(quick=quick)
    except Exception as exc:  # one broken benchmark must not hide the others' numbers
        result = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()[-4000:], "headline": []}
    result["wall_seconds"] = time.perf_counter() - started
    return result


def _format(value) -> str:
    if value is None:
        return "n/a"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, (list, tuple)):
        return " / ".join(_format(v) for v in value)
    if isinstance(value, int):
        return f"{value:,}"
    if isinstance(value, float):
        if not math.isfinite(value):
            return str(value)
        if value == 0 or abs(value) >= 100:
            return f"{value:,.0f}"
        return f"{value:.3g}"
    return str(value)


def _format_spread(spread) -> str:
    if isinstance(spread, (list, tuple)) and len(spread) == 2 and not isinstance(spread[0], (list, tuple)):
        return f"{_format(spread[0])} – {_format(spread[1])}"
    if isinstance(spread, (list, tuple)):
        return " / ".join(_format_spread(s) for s in spread)
    return _format(spread)


def _table(table: dict) -> list[str]:
    """A benchmark's extra table (``title``, ``columns``, ``rows``) as Markdown lines."""
    return [
        "",
        f"**{table['title']}**",
        "",
        "| " + " | ".join(table["columns"]) + " |",
        "|" + "---|" * len(table["columns"]),
        *("| " + " | ".join(_format(v) for v in row) + " |" for row in table["rows"]),
    ]


def markdown(report: dict) -> str:
    """The short Markdown report: context lines, one table row per headline figure, then the
    benchmarks' extra tables (data-plane sizes, the learning curve) and notes."""
    before, after = report["machine"]["before"], report["machine"]["after"]
    lines = [
        f"# flowopt benchmarks ({'quick' if report['quick'] else 'full'} run, {report['machine']['before']['time']})",
        "",
        f"Total wall time {report['total_seconds']:.0f} s; torch threads {report['torch_threads']}; "
        f"load average (1/5/15 min) before {before['loadavg_1_5_15']}, after {after['loadavg_1_5_15']} "
        f"on {before['cpu_count']} CPUs. Values are medians over repeats; spread is min – max unless noted (several: one per value).",
        "",
        "| benchmark | figure | value | unit | spread | note |",
        "|---|---|---|---|---|---|",
    ]
    for name, result in report["benchmarks"].items():
        if "error" in result:
            lines.append(f"| {name} | FAILED | | | | {result['error'].splitlines()[0][:200]} |")
            continue
        for row in result["headline"]:
            lines.append(
                f"| {name} | {row['figure']} | {_format(row['value'])} | {row.get('unit', '')} | "
                f"{_format_spread(row['spread']) if 'spread' in row else ''} | {row.get('note', '')} |"
            )
        lines.append(f"| {name} | benchmark wall time | {result['wall_seconds']:.0f} | s | | |")
    for result in report["benchmarks"].values():
        for table in result.get("tables", []):
            lines += _table(table)
    notes = [r.get("sizes_note") for r in report["benchmarks"].values() if r.get("sizes_note")]
    if notes:
        lines += ["", *(f"Note: {n}." for n in notes)]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    """Entry point; returns the exit status (1 when a benchmark failed)."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="smallest sizes, one repeat each")
    parser.add_argument("--only", action="append", choices=BENCHMARKS, help="run only this benchmark (repeatable)")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default 1, see benchmarks/common.py)")
    parser.add_argument("--out", type=Path, default=RESULTS_DIR, help="directory for latest.json and latest.md")
    args = parser.parse_args(argv)
    quiet_libraries()
    set_torch_threads(args.threads)
    names = args.only or list(BENCHMARKS)
    started = time.perf_counter()
    before = machine_snapshot()
    results = {}
    for name in names:
        print(f"[bench] {name} ...", flush=True)
        results[name] = run_benchmark(name, args.quick)
        status = "FAILED: " + results[name]["error"].splitlines()[0] if "error" in results[name] else "done"
        print(f"[bench] {name} {status} in {results[name]['wall_seconds']:.1f} s", flush=True)
    report = {
        "quick": args.quick,
        "torch_threads": args.threads,
        "total_seconds": time.perf_counter() - started,
        "machine": {"before": before, "after": machine_snapshot()},
        "versions": versions(),
        "benchmarks": results,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "latest.json").write_text(json.dumps(report, indent=2, default=str) + "\n")
    table = markdown(report)
    (args.out / "latest.md").write_text(table)
    print()
    print(table)
    print(f"written {args.out / 'latest.json'} and {args.out / 'latest.md'}")
    return 1 if any("error" in r for r in results.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
