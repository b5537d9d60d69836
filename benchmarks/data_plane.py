"""Data plane throughput: the real logs of ``../shared/data``, replicated, through ``log_batch_job``.

What is measured, per size and repeat, in a fresh child process (so that its peak memory is its
own):

1. ``register``: one tick of ``new_logs_sensor`` (sha256 of the landed file, its manifest, one
   dynamic partition);
2. ``job``: ``log_batch_job`` executed in process on a real (SQLite) Dagster instance:
   ``interaction_logs -> trajectories -> rewards -> advantages``: the snapshot copy into the lake
   with secret redaction (the default), lake writes and metadata included;
   each asset's own seconds come from its step events, the rest of the job is Dagster's overhead.

The input: every real log file is parsed once (``parse_file``), its trajectories written back as
canonical JSONL and replicated with new ``trajectory_id`` and ``task_id`` (``<id>#<copy>``) until
the batch holds the wanted number of steps, so groups keep their real sizes and rewards, and the
batch is one landed file (one partition) as a large agent fleet would write it.

The floor: the same file read line by line and every line decoded by the fastest JSON reader
installed (``orjson``, ``msgspec`` or ``ujson``), nothing kept; ``job seconds / floor seconds`` is
how many times slower than merely parsing JSON the whole data plane is.

Sizes: about 1, 4 and 16 million steps, as the issue asks. Canonical JSONL of these logs is about
590 bytes per step, so the 16 M batch is ~9 GB of JSON; the data plane streams it chunk by chunk
(memory grows only with the number of trajectories). Each size's input is written just before it
is measured and deleted after, and a size is skipped, with the reason in the results, when the
disk cannot hold its input, snapshot and lake. A 16 M run (register, job and floor) takes about
five minutes on a 2-core machine, so the large sizes run once (:data:`FULL_REPEATS`); the spread
comes from the repeats at 1 M.
"""

from __future__ import annotations

import importlib
import shutil
import tempfile
import time
from pathlib import Path

import orjson
import polars as pl

from benchmarks.common import (
    SHARED_DATA,
    dagster_step_seconds,
    linear_fit,
    ratio,
    rss_mb,
    run_child,
    scaling_exponent,
    summarize,
    time_call,
)

#: steps per batch in the full run (the issue's 1 M, 4 M and 16 M)
FULL_SIZES = (1_000_000, 4_000_000, 16_000_000)
#: repeats per size in the full run (each in a fresh process)
FULL_REPEATS = (3, 1, 1)
#: seconds a child may take per million steps (register + job), before it is killed
CHILD_SECONDS_PER_MILLION_STEPS = 120.0
#: disk needed per byte of input JSON: the input, its snapshot in the lake, the lake's tables
DISK_FACTOR = 3.0
#: ``--quick``: two small sizes (a fit needs two), one repeat each
QUICK_SIZES = (4_000, 16_000)
QUICK_REPEATS = (1, 1)
SOURCE = "replicated"


# -- input ---------------------------------------------------------------------------------------
def real_records(data_dir: Path = SHARED_DATA) -> list[dict]:
    """Every valid trajectory of the real logs in ``data_dir`` as a canonical JSON object (dict).

    Raises:
        FileNotFoundError: ``data_dir`` holds no ``*.json`` log.
    """
    from flow_assets.logs.reader import parse_file

    files = sorted(Path(data_dir).rglob("*.json"))
    if not files:
        raise FileNotFoundError(f"no real logs (*.json) under {data_dir}")
    return [orjson.loads(v.trajectory.model_dump_json()) for f in files for v in parse_file(f).valid]


def write_replicated(records: list[dict], target_steps: int, path: Path) -> dict:
    """Write canonical JSONL holding at least ``target_steps`` steps: ``records`` over and over,
    copy ``k`` renaming ``trajectory_id`` and ``task_id`` to ``<id>#<k>``.

    Each record is serialised once, with placeholder ids, and copies are made by substituting the
    ids into those bytes, so writing gigabytes costs little more than the disk writes.

    Returns:
        ``trajectories``, ``steps`` and ``bytes`` written.

    Raises:
        RuntimeError: a record's ids cannot be substituted (checked against a plain rewrite).
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    templates = []
    for rec in records:
        line = orjson.dumps({**rec, "trajectory_id": "\x00tid\x00", "task_id": "\x00task\x00"})
        head, _, rest = line.partition(b"\\u0000tid\\u0000")
        middle, _, tail = rest.partition(b"\\u0000task\\u0000")
        tid, task = orjson.dumps(rec["trajectory_id"])[1:-1], orjson.dumps(rec["task_id"])[1:-1]
        expected = orjson.dumps({**rec, "trajectory_id": f"{rec['trajectory_id']}#0", "task_id": f"{rec['task_id']}#0"})
        if b"".join((head, tid, b"#0", middle, task, b"#0", tail)) != expected:
            raise RuntimeError(f"cannot template record {rec['trajectory_id']!r} (ids out of order or repeated)")
        templates.append((head, tid, middle, task, tail + b"\n", len(rec["steps"])))
    trajectories = steps = 0
    with open(path, "wb", buffering=2**22) as out:
        copy = 0
        while steps < target_steps:
            suffix = b"#%d" % copy
            for head, tid, middle, task, tail, n_steps in templates:
                out.write(b"".join((head, tid, suffix, middle, task, suffix, tail)))
                trajectories += 1
                steps += n_steps
                if steps >= target_steps:
                    break
            copy += 1
    return {"trajectories": trajectories, "steps": steps, "bytes": path.stat().st_size}


# -- floor ---------------------------------------------------------------------------------------
def json_readers() -> dict:
    """The installed fast JSON decoders, name -> ``loads(bytes)``."""
    readers = {}
    for name, attr in (("orjson", "loads"), ("msgspec", "json.decode"), ("ujson", "loads")):
        try:
            obj = importlib.import_module(name)
        except ImportError:
            continue
        for part in attr.split("."):
            obj = getattr(obj, part)
        readers[name] = obj
    return readers


def decode_all(path: Path, loads) -> int:
    """Read ``path`` line by line and decode every non-blank line with ``loads`` (keeping
    nothing); returns the number of lines decoded."""
    n = 0
    with open(path, "rb") as handle:
        for line in handle:
            if not line.isspace():
                loads(line)
                n += 1
    return n


def read_through(path: Path, block: int = 2**24) -> int:
    """Read ``path`` to its end in ``block``-byte reads (bringing it into the page cache);
    returns the bytes read."""
    total = 0
    with open(path, "rb", buffering=0) as handle:
        while data := handle.read(block):
            total += len(data)
    return total


def floor_seconds(path: Path, repeats: int) -> dict:
    """Seconds to read and decode ``path`` with each installed reader; the floor is the fastest.

    Returns:
        ``reader`` (the fastest), ``seconds`` (its :func:`summarize`), ``by_reader`` (median
        seconds of each).
    """
    by_reader = {}
    read_through(path)  # the page cache, warm as it was for the job (a decoding pass would cost ~50 s at 16M)
    for name, loads in json_readers().items():
        by_reader[name] = summarize([time_call(decode_all, path, loads)[0] for _ in range(repeats)])
    best = min(by_reader, key=lambda n: by_reader[n]["median"])
    return {"reader": best, "seconds": by_reader[best], "by_reader": {n: s["median"] for n, s in by_reader.items()}}


def copy_rates(path: Path, scratch: Path) -> dict:
    """MB/s (MiB of the file per second) of the lake's snapshot copy of ``path`` in this process:
    ``plain`` (copy and hash) and ``redacting`` (copy and hash through one
    :class:`~flow_assets.logs.redact.Redactor`, the default rules, no worker processes): what
    secret redaction costs per byte, apart from the rest of the job."""
    from flow_assets.logs.redact import Redactor
    from resources.lake import _copy_hashed

    size = path.stat().st_size / 2**20
    rates = {}
    for name, transform in (("plain", None), ("redacting", Redactor().stream)):
        target = scratch / f"copy-{name}"
        seconds, _ = time_call(_copy_hashed, path, target, transform)
        target.unlink()
        rates[name] = size / seconds
    return rates


# -- the job, in a child process ---------------------------------------------------------------
def job_child(landing: str, work: str) -> dict:
    """Child process: register the landed batch and run ``log_batch_job`` on a fresh instance.

    Args:
        landing: landing directory holding ``replicated/<file>.jsonl``.
        work: empty directory for this run's lake and ``DAGSTER_HOME``.

    Returns:
        ``register_seconds``, ``job_seconds``, ``asset_seconds`` (per asset), ``dagster_overhead_seconds``
        (job minus its assets), ``trajectories``, ``steps``, ``baseline_rss_mb`` (after imports).

    Raises:
        RuntimeError: the batch failed.
    """
    from benchmarks.common import quiet_libraries

    quiet_libraries()
    from flow_assets.definitions import build_definitions
    from flow_assets.runtime.local import execute_requests, local_instance, tick_sensor
    from resources.lake import TrajectoryLake

    work_dir = Path(work)
    instance = local_instance(work_dir / "dagster_home")
    lake_root = str(work_dir / "lake")
    defs = build_definitions(lake_root, landing, settle_seconds=0)  # the batch landed complete
    baseline = rss_mb()
    register_seconds, tick = time_call(tick_sensor, defs, instance, "new_logs_sensor")
    job_seconds, tick = time_call(execute_requests, defs, instance, "log_batch_job", tick)
    if tick.failed or len(tick.succeeded) != 1:
        raise RuntimeError(f"log batch failed: {tick.failed or 'no run'}")
    run_id = instance.get_runs(limit=1)[0].run_id
    assets = dagster_step_seconds(instance, run_id)
    lake = TrajectoryLake(root=lake_root)
    key = tick.succeeded[0]
    return {
        "register_seconds": register_seconds,
        "job_seconds": job_seconds,
        "asset_seconds": assets,
        "dagster_overhead_seconds": job_seconds - sum(assets.values()),
        # counted from the Parquet footers: reading a 16M-step table to count it would be the
        # largest allocation of the whole run, and charged to the job's peak memory
        "trajectories": lake.scan_partition("trajectories", key).select(pl.len()).collect().item(),
        "steps": lake.scan_partition("steps", key).select(pl.len()).collect().item(),
        "baseline_rss_mb": baseline,
    }


# -- the benchmark -------------------------------------------------------------------------------
def bytes_per_step(records: list[dict]) -> float:
    """Mean canonical-JSONL bytes per step of ``records`` (what a replicated batch will weigh)."""
    total = sum(len(orjson.dumps(r)) + 1 for r in records)
    return total / max(1, sum(len(r["steps"]) for r in records))


def disk_shortfall(records: list[dict], steps: int, scratch: Path) -> str | None:
    """Why ``scratch``'s disk cannot hold a batch of ``steps`` steps (input, snapshot, lake:
    :data:`DISK_FACTOR` times the JSON), or ``None`` when it can."""
    need = DISK_FACTOR * bytes_per_step(records) * steps
    free = shutil.disk_usage(scratch).free
    if free >= need:
        return None
    return f"needs ~{need / 2**30:.1f} GiB of disk, {free / 2**30:.1f} GiB free under {scratch}"


def measure_size(records: list[dict], steps: int, repeats: int, scratch: Path) -> dict:
    """One size: write the replicated batch, run the job ``repeats`` times (fresh child each),
    time the floor on the same bytes, delete the batch. Returns every figure of this size (see
    :func:`run`)."""
    landing = scratch / f"landing-{steps}"
    batch = write_replicated(records, steps, landing / SOURCE / f"batch-{steps}.jsonl")
    runs, peaks = [], []
    timeout = 300.0 + CHILD_SECONDS_PER_MILLION_STEPS * steps / 1e6
    for r in range(repeats):
        work = scratch / f"run-{steps}-{r}"
        result, peak = run_child(
            "benchmarks.data_plane:job_child", {"landing": str(landing), "work": str(work)}, timeout=timeout
        )
        if result["steps"] != batch["steps"] or result["trajectories"] != batch["trajectories"]:
            raise RuntimeError(f"job lost rows: wrote {batch}, lake holds {result}")
        runs.append(result)
        peaks.append(peak)
        shutil.rmtree(work, ignore_errors=True)
    floor = floor_seconds(landing / SOURCE / f"batch-{steps}.jsonl", repeats)
    copy = copy_rates(landing / SOURCE / f"batch-{steps}.jsonl", scratch)
    shutil.rmtree(landing, ignore_errors=True)
    job = summarize([r["job_seconds"] for r in runs])
    asset_names = sorted(runs[0]["asset_seconds"])
    return {
        "steps": batch["steps"],
        "trajectories": batch["trajectories"],
        "megabytes": batch["bytes"] / 2**20,
        "job_seconds": job,
        "register_seconds": summarize([r["register_seconds"] for r in runs]),
        "asset_seconds": {a: summarize([r["asset_seconds"][a] for r in runs]) for a in asset_names},
        "dagster_overhead_seconds": summarize([r["dagster_overhead_seconds"] for r in runs]),
        "trajectories_per_second": batch["trajectories"] / job["median"],
        "steps_per_second": batch["steps"] / job["median"],
        "seconds_per_million_steps": job["median"] / batch["steps"] * 1e6,
        "peak_rss_mb": summarize(peaks),
        "baseline_rss_mb": summarize([r["baseline_rss_mb"] for r in runs]),
        "floor": floor,
        "ratio_to_floor": ratio(job["median"], floor["seconds"]["median"]),
        "copy_mb_per_second": copy,
    }


def sizes_note(per_size: list[dict], skipped: list[dict]) -> str:
    """Which sizes ran (and how often) and which were skipped and why, in one sentence."""
    ran = ", ".join(f"{p['steps']:,} steps x{p['job_seconds']['n']}" for p in per_size)
    note = f"data plane ran {ran} (each run a fresh process on a fresh instance and lake)"
    if skipped:
        note += "; skipped: " + "; ".join(f"{s['steps']:,} steps ({s['reason']})" for s in skipped)
    return note


def run(quick: bool = False, sizes: tuple[int, ...] | None = None, repeats: tuple[int, ...] | None = None) -> dict:
    """The data-plane benchmark (module docstring).

    Returns:
        ``sizes`` (per size: steps, trajectories, MB of JSON, job seconds with spread, register and
        per-asset seconds, Dagster overhead, trajectories/s, steps/s, seconds per million steps,
        peak RSS MB, the floor and ``ratio_to_floor``, the snapshot copy's MB/s plain and
        redacting), ``skipped`` (sizes not run, with why),
        ``scaling`` (linear fit of job seconds on steps, log-log exponents over all sizes and
        between the two largest, per asset too, largest/smallest time ratio against the size
        ratio, peak RSS growth), ``headline`` and ``tables`` (one row per size).

    ``sizes`` and ``repeats`` (steps per batch, runs per size) replace the full or quick ones,
    e.g. to measure what fits a busy machine's time (``repeats`` defaults to one run each).

    Raises:
        RuntimeError: fewer than two sizes could run (no growth to report).
    """
    default_sizes, default_repeats = (QUICK_SIZES, QUICK_REPEATS) if quick else (FULL_SIZES, FULL_REPEATS)
    sizes, repeats = sizes or default_sizes, repeats or (default_repeats if sizes is None else (1,) * len(sizes))
    records = real_records()
    scratch = Path(tempfile.mkdtemp(prefix="flowopt-bench-data-plane-"))
    started = time.perf_counter()
    per_size, skipped = [], []
    try:
        for size, reps in zip(sizes, repeats):
            shortfall = disk_shortfall(records, size, scratch)
            if shortfall:
                skipped.append({"steps": size, "reason": shortfall})
                continue
            per_size.append(measure_size(records, size, reps, scratch))
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    if len(per_size) < 2:
        raise RuntimeError(f"data plane: fewer than two sizes ran ({skipped})")
    steps = [p["steps"] for p in per_size]
    seconds = [p["job_seconds"]["median"] for p in per_size]
    peaks = [p["peak_rss_mb"]["median"] for p in per_size]
    fit = linear_fit(steps, seconds)
    top = per_size[-2:]
    scaling = {
        "fit_seconds_per_million_steps": fit["slope"] * 1e6,
        "fit_intercept_seconds": fit["intercept"],
        "fit_r2": fit["r2"],
        "loglog_exponent": scaling_exponent(steps, seconds),
        "exponent_two_largest_sizes": scaling_exponent([p["steps"] for p in top], [p["job_seconds"]["median"] for p in top]),
        "asset_exponent_two_largest_sizes": {
            a: scaling_exponent([p["steps"] for p in top], [p["asset_seconds"][a]["median"] for p in top])
            for a in top[-1]["asset_seconds"]
        },
        "size_ratio_largest_to_smallest": steps[-1] / steps[0],
        "time_ratio_largest_to_smallest": seconds[-1] / seconds[0],
        "peak_rss_ratio_largest_to_smallest": peaks[-1] / peaks[0],
        "peak_rss_exponent": scaling_exponent(steps, peaks),
    }
    largest = per_size[-1]
    headline = [
        {"figure": f"job at {p['steps']:,} steps", "value": p["job_seconds"]["median"], "unit": "s",
         "spread": [p["job_seconds"]["min"], p["job_seconds"]["max"]],
         "note": f"{p['seconds_per_million_steps']:.1f} s per 1M steps, n={p['job_seconds']['n']}"}
        for p in per_size
    ] + [
        {"figure": "steps/s (largest size)", "value": largest["steps_per_second"], "unit": "steps/s"},
        {"figure": "trajectories/s (largest size)", "value": largest["trajectories_per_second"], "unit": "traj/s"},
        {"figure": f"job / floor ({largest['floor']['reader']} decode of the same bytes), smallest -> largest size",
         "value": [p["ratio_to_floor"] for p in per_size], "unit": "x"},
        {"figure": "peak RSS, smallest -> largest size", "value": peaks, "unit": "MB",
         "note": f"size x{scaling['size_ratio_largest_to_smallest']:.0f}, memory x{scaling['peak_rss_ratio_largest_to_smallest']:.2f}"},
        {"figure": "time growth exponent, smallest -> largest / two largest sizes (1.0 = linear)",
         "value": [scaling["loglog_exponent"], scaling["exponent_two_largest_sizes"]], "unit": "",
         "note": "two largest, per asset: " + ", ".join(f"{a} {e:.2f}" for a, e in scaling["asset_exponent_two_largest_sizes"].items())},
        {"figure": "linear fit of job seconds on steps", "value": scaling["fit_seconds_per_million_steps"], "unit": "s per 1M steps",
         "note": f"intercept {fit['intercept']:.2f} s, r2 {fit['r2']:.4f}"},
    ]
    table = {
        "title": "data plane by size (log_batch_job, medians)",
        "columns": ["steps", "trajectories", "JSON MB", "runs", "job s", "s per 1M steps", "steps/s", "traj/s",
                    "peak RSS MB", "floor s", "job / floor", "redacting copy MB/s", "plain copy MB/s"],
        "rows": [[p["steps"], p["trajectories"], p["megabytes"], p["job_seconds"]["n"], p["job_seconds"]["median"],
                  p["seconds_per_million_steps"], p["steps_per_second"], p["trajectories_per_second"],
                  p["peak_rss_mb"]["median"], p["floor"]["seconds"]["median"], p["ratio_to_floor"],
                  p["copy_mb_per_second"]["redacting"], p["copy_mb_per_second"]["plain"]] for p in per_size],
    }
    return {
        "what": "log_batch_job (ingest -> trajectories -> rewards -> advantages) on the real logs replicated",
        "sizes_note": sizes_note(per_size, skipped),
        "sizes": per_size,
        "skipped": skipped,
        "scaling": scaling,
        "seconds": time.perf_counter() - started,
        "headline": headline,
        "tables": [table],
    }
