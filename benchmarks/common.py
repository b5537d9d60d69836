"""Timing helpers shared by the benchmarks: medians with their spread, ratios, linear fits, child
processes with their own peak memory, and a snapshot of how loaded the machine is.

Units: seconds for times, MB (2**20 bytes) for memory.

A benchmark that needs an honest peak memory runs its work in a child process
(:func:`run_child`): a process's peak RSS only ever grows, so measuring several sizes in one
process would report the largest size for all of them. The child measures its own peak
(``VmHWM`` and its waited-for descendants' ``ru_maxrss``) before it exits.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
SHARED_DATA = REPO_ROOT.parent / "shared" / "data"


# -- statistics --------------------------------------------------------------------------------
def summarize(values: Sequence[float]) -> dict:
    """Median and spread of repeated measurements.

    Returns:
        ``median``, ``q1``, ``q3`` (quartiles, inclusive method), ``iqr`` (``q3 - q1``), ``min``,
        ``max``, ``n`` and the raw ``values`` (rounded to 6 digits). With one value every statistic
        is that value and the spread is 0.

    Raises:
        ValueError: no values.
    """
    values = [float(v) for v in values]
    if not values:
        raise ValueError("summarize needs at least one value")
    if len(values) == 1:
        q1 = q3 = values[0]
    else:
        q1, _, q3 = statistics.quantiles(values, n=4, method="inclusive")
    return {
        "median": statistics.median(values),
        "q1": q1,
        "q3": q3,
        "iqr": q3 - q1,
        "min": min(values),
        "max": max(values),
        "n": len(values),
        "values": [round(v, 6) for v in values],
    }


def ratio(numerator: float, denominator: float) -> float:
    """``numerator / denominator``; ``nan`` when the denominator is 0 or either side is not finite."""
    if not (math.isfinite(numerator) and math.isfinite(denominator)) or denominator == 0:
        return float("nan")
    return numerator / denominator


def linear_fit(xs: Sequence[float], ys: Sequence[float]) -> dict:
    """Least-squares line ``y = intercept + slope * x`` and its ``r2``.

    Returns:
        ``slope``, ``intercept`` and ``r2`` (1.0 when the points are exactly on a line).

    Raises:
        ValueError: fewer than two points, or all ``xs`` equal.
    """
    n = len(xs)
    if n < 2 or len(ys) != n:
        raise ValueError("linear_fit needs at least two (x, y) points")
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    if sxx == 0:
        raise ValueError("linear_fit needs at least two distinct x")
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx
    intercept = my - slope * mx
    ss_tot = sum((y - my) ** 2 for y in ys)
    ss_res = sum((y - intercept - slope * x) ** 2 for x, y in zip(xs, ys))
    return {"slope": slope, "intercept": intercept, "r2": 1.0 if ss_tot == 0 else 1.0 - ss_res / ss_tot}


def scaling_exponent(xs: Sequence[float], ys: Sequence[float]) -> float:
    """Slope of ``log y`` against ``log x``: 1.0 means ``y`` grows linearly with ``x``, 2.0
    quadratically, below 1 sub-linearly (fixed costs being amortised)."""
    return linear_fit([math.log(x) for x in xs], [math.log(y) for y in ys])["slope"]


# -- timing ------------------------------------------------------------------------------------
def time_call(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> tuple[float, Any]:
    """``(seconds, result)`` of one call, wall clock (``time.perf_counter``)."""
    start = time.perf_counter()
    result = fn(*args, **kwargs)
    return time.perf_counter() - start, result


def repeat_timed(fn: Callable[[int], Any], repeats: int, warmup: int = 1) -> list[float]:
    """Seconds of ``repeats`` calls ``fn(i)`` after ``warmup`` untimed calls (``i`` counts all calls
    from 0, so a seed derived from it differs between calls)."""
    for i in range(warmup):
        fn(i)
    return [time_call(fn, warmup + i)[0] for i in range(repeats)]


# -- child processes ---------------------------------------------------------------------------
class ChildError(RuntimeError):
    """A benchmark child process failed; the message holds its exit code and the end of its output."""


def run_child(target: str, kwargs: dict, timeout: float = 600.0) -> tuple[dict, float]:
    """Run ``target(**kwargs)`` in a fresh Python process and return ``(result, peak_rss_mb)``.

    Args:
        target: ``"package.module:function"``; the function returns a JSON-serialisable dict.
        kwargs: JSON-serialisable keyword arguments.
        timeout: seconds before the child is killed.

    Returns:
        The function's dict and the child's peak resident set size in MB: the larger of its own
        peak (``VmHWM``) and that of the descendants it waited for, as the child measured them
        (:func:`_peak_rss_mb`). Not ``os.wait4``'s ``ru_maxrss``: Linux carries the parent's
        peak across fork and exec into it, so a child started by a benchmark process that had
        loaded SmolLM2 reported 5,142 MB at every data-plane size.

    Raises:
        ChildError: the child exited non-zero, was killed, or wrote no result.
    """
    with tempfile.TemporaryDirectory(prefix="flowopt-bench-child-") as tmp:
        out, log = Path(tmp) / "result.json", Path(tmp) / "output.log"
        cmd = [sys.executable, "-m", "benchmarks.common", target, json.dumps(kwargs), str(out)]
        with open(log, "wb") as log_file:
            proc = subprocess.Popen(cmd, cwd=REPO_ROOT, stdout=log_file, stderr=subprocess.STDOUT)
            timer = threading.Timer(timeout, proc.kill)
            timer.start()
            try:
                _, status, _ = os.wait4(proc.pid, 0)
            finally:
                timer.cancel()
            proc.returncode = os.waitstatus_to_exitcode(status)
        if proc.returncode != 0 or not out.exists():
            tail = log.read_text(errors="replace")[-3000:]
            raise ChildError(f"{target} exited with {proc.returncode}:\n{tail}")
        result = json.loads(out.read_text())
        return result["result"], result["peak_rss_mb"]


def _child_main(argv: list[str]) -> None:
    target, kwargs_json, out = argv
    module_name, _, function_name = target.partition(":")
    function = getattr(importlib.import_module(module_name), function_name)
    result = function(**json.loads(kwargs_json))
    Path(out).write_text(json.dumps({"result": result, "peak_rss_mb": _peak_rss_mb()}))


def _peak_rss_mb() -> float:
    """This process's peak resident set size (``VmHWM``: its own address space since exec) or
    that of the largest descendant it waited for (``RUSAGE_CHILDREN``), whichever is larger, MB."""
    import resource

    own = 0.0
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            own = int(line.split()[1]) / 1024.0
    return max(own, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024.0)


def rss_mb() -> float:
    """This process's current resident set size in MB (psutil)."""
    import psutil

    return psutil.Process().memory_info().rss / 2**20


def dagster_step_seconds(instance, run_id: str) -> dict[str, float]:
    """Seconds from ``STEP_START`` to ``STEP_SUCCESS`` or ``STEP_FAILURE`` of each step (asset or
    op) of a Dagster run, by step key (a blocking asset check that fails ends its asset's step with
    a failure after the asset's work is done, so failed steps count too)."""
    from dagster import DagsterEventType

    ends = {DagsterEventType.STEP_SUCCESS, DagsterEventType.STEP_FAILURE}
    starts, seconds = {}, {}
    for entry in instance.all_logs(run_id, of_type={DagsterEventType.STEP_START, *ends}):
        if entry.dagster_event_type == DagsterEventType.STEP_START:
            starts[entry.step_key] = entry.timestamp
        elif entry.step_key in starts:
            seconds[entry.step_key] = entry.timestamp - starts[entry.step_key]
    return seconds


# -- environment -------------------------------------------------------------------------------
def set_torch_threads(threads: int) -> None:
    """Use ``threads`` intra-op threads in torch.

    The benchmarks default to 1: the tiny model's matrices are far too small to gain from more,
    and on a machine shared with other CPU-heavy processes extra OpenMP threads make a step tens
    of times slower (threads spin waiting for each other) instead of faster.
    """
    import torch

    torch.set_num_threads(threads)


@contextlib.contextmanager
def real_model_threads(threads: int = 2):
    """Torch intra-op threads for a real model's rows (restored after): SmolLM2-135M's matrices
    do gain from both cores (the demo runs with them), and a step with one thread takes minutes."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(max(before, threads))
    try:
        yield
    finally:
        torch.set_num_threads(before)


def quiet_libraries() -> None:
    """Silence progress bars, info logs and deprecation warnings of transformers, TRL and Dagster."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    warnings.filterwarnings("ignore")
    try:
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()
        hf_logging.disable_progress_bar()
    except ImportError:  # pragma: no cover - transformers is a dependency
        pass
    try:
        import datasets

        datasets.disable_progress_bars()
        datasets.logging.set_verbosity_error()
    except ImportError:  # pragma: no cover
        pass


def machine_snapshot() -> dict:
    """How loaded the machine is right now: 1/5/15-minute load averages, CPU count, available
    memory (MB) and the wall-clock time (ISO 8601)."""
    import psutil

    load1, load5, load15 = os.getloadavg()
    return {
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "loadavg_1_5_15": [round(load1, 2), round(load5, 2), round(load15, 2)],
        "cpu_count": os.cpu_count(),
        "memory_available_mb": round(psutil.virtual_memory().available / 2**20),
    }


def versions() -> dict:
    """Versions of Python and of the libraries the benchmarks compare or depend on."""
    found = {"python": platform.python_version(), "platform": platform.platform()}
    for name in ("torch", "transformers", "trl", "peft", "dagster", "polars", "orjson", "msgspec"):
        try:
            found[name] = importlib.import_module(name).__version__
        except ImportError:
            found[name] = None
    return found


if __name__ == "__main__":
    _child_main(sys.argv[1:])
