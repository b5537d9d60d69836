"""Shared fixtures: the real agent logs beside the repo, and a real Dagster instance."""

from pathlib import Path

import pytest
from dagster import instance_for_test

SHARED_DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data"
TAU_BENCH = SHARED_DATA / "tau-bench" / "gpt-4o-airline.json"


@pytest.fixture(scope="session")
def shared_data() -> Path:
    """``../shared/data``: real agent logs nobody here wrote, used as they are."""
    assert SHARED_DATA.is_dir(), f"real logs expected at {SHARED_DATA}"
    return SHARED_DATA


@pytest.fixture
def dagster_instance(tmp_path):
    """A real (SQLite, on disk) Dagster instance in a temporary DAGSTER_HOME."""
    home = tmp_path / "dagster_home"
    home.mkdir()
    with instance_for_test(temp_dir=str(home)) as instance:
        yield instance
