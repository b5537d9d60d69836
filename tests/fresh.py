"""Calling a test's pure function in a fresh interpreter, for work that CPython 3.11 does not do
safely beside other threads.

CPython 3.11's AST constructor keeps its recursion depth in state that another thread's compile
can move (python/cpython#106905). In a pytest worker a thread left by an earlier test may be
importing a module at any moment, and so compiling it (no ``.pyc`` under
``PYTHONDONTWRITEBYTECODE``): a scan of the code location with ``ast.parse`` failed once with
"SystemError: AST constructor recursion depth mismatch" in a clean clone's ``.ci/run``
(2026-11-29). A fresh interpreter runs the scan with one thread.
"""

import json
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
#: the packages of the code location, which the scans of the tests read
CODE_LOCATION = ("flow_assets", "resources", "sensors")


def code_location_modules() -> Iterator[tuple[Path, str]]:
    """Every module of :data:`CODE_LOCATION` as ``(path relative to the repository, source)``,
    in path order."""
    for package in CODE_LOCATION:
        for path in sorted((ROOT / package).rglob("*.py")):
            yield path.relative_to(ROOT), path.read_text(encoding="utf-8")


def call_in_fresh_interpreter(func: Callable[[], object], timeout: float = 120):
    """``func()`` computed by a new Python process that imports ``func``'s module: its return
    value, which must be JSON (lists, dicts, strings, numbers).

    Raises:
        AssertionError: the process failed (its stderr is the message).
        subprocess.TimeoutExpired: it ran longer than ``timeout`` seconds.
    """
    code = f"import json, {func.__module__} as m; print(json.dumps(m.{func.__qualname__}()))"
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)
