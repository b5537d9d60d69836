"""Plug-in log formats: the worked example of docs/log-format.md (section 7), installed as a real
entry point of a package on the path, read by detection, by name, and by `flowopt ingest`."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from flow_assets.logs.plugins import PluginFormatError, plugin_formats, register_format, unregister_format
from flow_assets.logs.reader import detect_format, known_formats, parse_file
from flow_assets.logs.records import UnreadableLogError
from tests.conftest import TAU_BENCH

REPO = Path(__file__).resolve().parents[2]
FLOWOPT = str(Path(sys.executable).with_name("flowopt"))


def _docs_example() -> str:
    section = (REPO / "docs" / "log-format.md").read_text().split("## 7. Plug-in formats", 1)[1]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


@pytest.fixture
def plugin_site(tmp_path, monkeypatch):
    """A site directory holding ``my_package`` (the docs' example, verbatim) and its dist-info
    with the entry point, on ``sys.path`` for this process and ``PYTHONPATH`` for children."""
    site = tmp_path / "site"
    (site / "my_package").mkdir(parents=True)
    (site / "my_package" / "__init__.py").write_text("")
    (site / "my_package" / "swe_agent_format.py").write_text(_docs_example())
    dist = site / "my_package-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: my-package\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text("[flowopt.log_formats]\nswe-agent = my_package.swe_agent_format\n")
    monkeypatch.syspath_prepend(str(site))
    return site


def _swe_agent_run(path: Path, element: int = 0) -> Path:
    """A SWE-agent-shaped ``.traj`` made from a real tau-bench run: each tool call becomes a
    thought, an action and its observation."""
    runs = [r for r in json.loads(TAU_BENCH.read_bytes()) if any(m.get("tool_calls") for m in r["traj"])]
    run = runs[element]  # a SWE-agent run always acts
    messages = run["traj"]
    outputs = {m["tool_call_id"]: m["content"] for m in messages if m["role"] == "tool"}
    turns = [
        {"thought": m.get("content") or "", "action": f"{c['function']['name']} {c['function']['arguments']}",
         "observation": outputs.get(c["id"], ""), "execution_time": 0.25}
        for m in messages if m.get("tool_calls") for c in m["tool_calls"]
    ]  # fmt: skip
    doc = {"environment": "tau-bench", "trajectory": turns, "history": messages,
           "info": {"exit_status": "submitted" if run["reward"] >= 1 else "exit_cost", "submission": messages[-1].get("content")}}  # fmt: skip
    path.write_text(json.dumps(doc, indent=2))
    return path


def test_an_entry_point_format_is_detected_and_parsed(plugin_site, tmp_path):
    assert "swe-agent" in plugin_formats() and "swe-agent" in known_formats()
    traj = _swe_agent_run(tmp_path / "airline-0.traj")
    assert detect_format(traj) == "swe-agent"
    result = parse_file(traj)
    (record,) = result.valid
    calls = len(json.loads(traj.read_text())["trajectory"])
    assert calls > 0 and len(record.trajectory.steps) == 2 * calls
    assert record.trajectory.steps[1].duration_ms == 250.0 and record.trajectory.task_id == "airline-0"
    # a run without its "info" is quarantined with the reason, not a crash
    broken = tmp_path / "broken.traj"
    doc = json.loads(traj.read_text())
    del doc["info"]
    broken.write_text(json.dumps(doc))
    result = parse_file(broken, "swe-agent")
    assert not result.valid and "info" in result.quarantined[0].reason


def test_ingest_reads_a_plug_in_format_end_to_end(plugin_site, tmp_path):
    logs = tmp_path / "swe-runs"
    logs.mkdir()
    for i in range(3):
        _swe_agent_run(logs / f"run-{i}.traj", element=i)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(plugin_site), str(REPO)])}
    done = subprocess.run([FLOWOPT, "ingest", str(logs), "--lake", str(tmp_path / "lake"), "--landing", str(tmp_path / "landing"),
                           "--home", str(tmp_path / "home")], capture_output=True, text=True, timeout=300, env=env)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    rows = json.loads(done.stdout)["files"]
    assert [r["trajectories"] for r in rows] == [1, 1, 1] and all(r["status"] == "ingested" for r in rows)


def test_the_unrecognised_format_error_lists_plug_ins_and_a_broken_plug_in_is_named(tmp_path):
    odd = tmp_path / "odd.json"
    odd.write_text(json.dumps({"rows": [1, 2, 3]}))
    register_format("never", lambda path: False, lambda path, **_: None)
    try:
        with pytest.raises(UnreadableLogError, match=r"nor any plug-in format \(never\).*section 7"):
            detect_format(odd)
    finally:
        unregister_format("never")
    register_format("crashes", lambda path: 1 / 0, lambda path, **_: None)
    try:
        with pytest.raises(UnreadableLogError, match="plug-in 'crashes'.*ZeroDivisionError"):
            detect_format(odd)
    finally:
        unregister_format("crashes")
    with pytest.raises(PluginFormatError, match="callable 'detect' and 'parse'"):
        register_format("bad", None, None)
