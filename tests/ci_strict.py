"""A pytest plugin for CI: every test must run there, so a skip fails.

A test that skips because a service is down (PostgreSQL, RabbitMQ), Chromium is missing or the
``smollm2`` extra is not installed would hide a test that never ran. With ``CI`` set (``1``,
``true`` or ``yes``; ``.ci/run`` sets it) such a skip is reported as a failure naming its reason.
Only the tests marked ``gpu`` (vLLM and CUDA, which CI never has) may skip there.
"""

import os

import pytest


def in_ci(environ=os.environ) -> bool:
    """Whether ``CI`` asks for every test to run (``1``, ``true`` or ``yes``, any case)."""
    return environ.get("CI", "").lower() in ("1", "true", "yes")


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    """Report a skipped test as failed under :func:`in_ci` (tests marked ``gpu`` excepted)."""
    report = yield
    if in_ci() and report.skipped and not hasattr(report, "wasxfail") and item.get_closest_marker("gpu") is None:
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        report.outcome = "failed"
        report.longrepr = f"skipped in CI (CI={os.environ.get('CI')}), which must run every test but the GPU ones: {reason}"
    return report
