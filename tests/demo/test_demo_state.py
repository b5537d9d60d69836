"""`flowopt demo` never deletes what it did not create: its state is its own (marked), or the
user's paths from DAGSTER_HOME / FLOWOPT_*, which it clears only with --reset."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from flow_assets.demo.state import MARKER, DemoState, DemoStateError

from flow_assets.demo.run import run_demo
from flow_assets.settings import Settings


def _state(root: Path) -> DemoState:
    return DemoState(root / "home", root / "lake", root / "landing", root / "models")


def test_state_comes_from_the_environment_else_the_demo_directory(tmp_path):
    settings = Settings.from_environ({"FLOWOPT_LAKE": str(tmp_path / "my-lake"), "FLOWOPT_LANDING": ""})  # empty: unset
    state = DemoState.from_settings(settings, tmp_path / ".demo")
    assert state.lake == tmp_path / "my-lake"
    assert (state.home, state.landing, state.models) == tuple(tmp_path / ".demo" / n for n in ("dagster_home", "landing", "models"))


def test_someone_elses_data_stops_the_demo_before_anything_is_deleted(tmp_path):
    state = _state(tmp_path)
    (state.lake / "trajectories" / "batch=mine").mkdir(parents=True)
    (state.lake / "trajectories" / "batch=mine" / "data.parquet").write_bytes(b"user data")
    with pytest.raises(DemoStateError, match=r"lake \(1 entries\).*--reset"):
        state.prepare()
    assert (state.lake / "trajectories" / "batch=mine" / "data.parquet").read_bytes() == b"user data"
    assert not state.home.exists() and not (state.lake / MARKER).exists()


def test_the_demos_own_state_is_cleared_and_inputs_kept(tmp_path):
    state = _state(tmp_path)
    state.prepare()  # fresh: creates and marks every directory
    assert all((d / MARKER).exists() for d in state.directories())
    (state.models / "presets" / "smollm2").mkdir(parents=True)
    (state.models / "registry.json").write_text("{}")
    (state.home / "dagster.yaml").write_text("telemetry: {enabled: false}\n")
    (state.home / "history").mkdir()
    (state.landing / "tau-bench").mkdir()
    state.prepare()
    assert sorted(p.name for p in state.models.iterdir()) == [MARKER, "presets"]
    assert sorted(p.name for p in state.home.iterdir()) == [MARKER, "dagster.yaml"]
    assert [p.name for p in state.landing.iterdir()] == [MARKER]


def test_reset_clears_foreign_state_when_asked(tmp_path):
    state = _state(tmp_path)
    state.landing.mkdir(parents=True)
    (state.landing / "old.jsonl").write_text("{}\n")
    state.prepare(reset=True)
    assert [p.name for p in state.landing.iterdir()] == [MARKER]


def test_missing_logs_fail_before_the_state_is_touched(tmp_path):
    state = _state(tmp_path)
    state.models.mkdir(parents=True)
    (state.models / "registry.json").write_text("{}")
    with pytest.raises(FileNotFoundError, match="nothing was changed"):
        run_demo(state, data_dir=tmp_path / "no-such-data", reset=True)
    assert (state.models / "registry.json").exists() and not (state.models / MARKER).exists()


def test_cli_exits_2_with_the_listing_and_changes_nothing(tmp_path):
    lake = tmp_path / "lake"
    (lake / "advantages").mkdir(parents=True)
    env = {**os.environ, "FLOWOPT_LAKE": str(lake)}
    for var in ("DAGSTER_HOME", "FLOWOPT_LANDING", "FLOWOPT_MODELS"):
        env.pop(var, None)
    flowopt = str(Path(sys.executable).with_name("flowopt"))
    done = subprocess.run([flowopt, "demo", "--state", str(tmp_path / "demo")], capture_output=True, text=True, env=env)
    assert done.returncode == 2, done.stderr
    assert f"not the demo's state: {lake} (1 entries)" in done.stderr and "--reset" in done.stderr
    assert [p.name for p in lake.iterdir()] == ["advantages"] and not (tmp_path / "demo").exists()
