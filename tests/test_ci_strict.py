"""In CI a skipped test fails (tests/ci_strict.py); elsewhere it skips; GPU tests skip anywhere."""

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PROBE = """
import pytest

def test_service_down():
    pytest.skip("no broker at 127.0.0.1:5672")

@pytest.mark.skipif(True, reason="needs a Chromium binary")
def test_no_browser():
    pass

@pytest.mark.gpu
def test_needs_a_gpu():
    pytest.skip("no CUDA")

def test_runs():
    assert True
"""


def _run(tmp_path: Path, ci: str | None) -> subprocess.CompletedProcess:
    (tmp_path / "test_probe.py").write_text(PROBE)
    (tmp_path / "pytest.ini").write_text("[pytest]\nmarkers =\n    gpu: needs CUDA\n")
    env = {k: v for k, v in os.environ.items() if k != "CI"}
    if ci is not None:
        env["CI"] = ci
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-rA", "-p", "tests.ci_strict", "-p", "no:cacheprovider", str(tmp_path)],
                          capture_output=True, text=True, timeout=120, cwd=tmp_path, env=env)  # fmt: skip


def test_in_ci_a_skip_fails_naming_its_reason_but_gpu_tests_skip(tmp_path):
    result = _run(tmp_path, "true")
    assert result.returncode == 1, result.stdout
    assert "FAILED test_probe.py::test_service_down" in result.stdout and "no broker at 127.0.0.1:5672" in result.stdout
    # a skip at setup (a skipif marker) fails as an error of that test
    assert "ERROR test_probe.py::test_no_browser" in result.stdout and "needs a Chromium binary" in result.stdout
    assert "SKIPPED" in result.stdout and "no CUDA" in result.stdout
    assert "1 failed, 1 passed, 1 skipped, 1 error" in result.stdout


def test_outside_ci_a_missing_service_skips(tmp_path):
    result = _run(tmp_path, None)
    assert result.returncode == 0, result.stdout
    assert "1 passed, 3 skipped" in result.stdout
