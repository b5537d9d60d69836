"""The adapter registry: promotion history, rollback, and crash safety of its writes."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from resources.registry import AdapterRegistry, RegistryError


def test_promotions_keep_history_and_rollback_restores_the_previous_champion(tmp_path):
    reg = AdapterRegistry(root=str(tmp_path))
    reg.promote("v0", "/a/v0", {"success": 0.4}, by="test", reason="base")
    reg.promote("v1", "/a/v1", {"success": 0.5}, by="test", reason="round 1")
    reg.promote("v2", "/a/v2", {"success": 0.6}, by="test", reason="round 2")
    assert reg.champion()["version"] == "v2"
    back = reg.rollback(by="oncall", reason="A/B regression")
    assert back == {"version": "v1", "adapter_path": "/a/v1", "metrics": {"success": 0.5}}
    assert reg.champion()["version"] == "v1"
    assert reg.rollback(by="oncall")["version"] == "v0"
    with pytest.raises(RegistryError, match="no previous champion"):
        reg.rollback()
    actions = [(e["action"], e["version"], e["previous"]) for e in reg.load()["history"]]
    assert actions == [
        ("promote", "v0", None), ("promote", "v1", "v0"), ("promote", "v2", "v1"),
        ("rollback", "v1", "v2"), ("rollback", "v0", "v1"),
    ]
    assert reg.load()["history"][3]["by"] == "oncall"


def test_failed_write_leaves_the_old_registry_and_no_temp_file(tmp_path, monkeypatch):
    reg = AdapterRegistry(root=str(tmp_path))
    reg.promote("v0", "/a/v0", {}, by="t", reason="r")
    before = reg.path.read_bytes()

    def boom(fd):
        raise OSError("disk full")

    monkeypatch.setattr(os, "fsync", boom)
    with pytest.raises(OSError, match="disk full"):
        reg.promote("v1", "/a/v1", {}, by="t", reason="r")
    assert reg.path.read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == ["registry.json"]


WRITER = """
import pathlib, sys
from resources.registry import AdapterRegistry
reg = AdapterRegistry(root=sys.argv[1])
i = len(reg.load()["history"]) - 1
while True:
    i += 1
    reg.promote(f"v{i}", f"/a/v{i}", {"payload": "x" * 20000, "i": i}, by="writer", reason="stress")
    pathlib.Path(sys.argv[2]).touch()  # writing has begun: the kill may come
"""


def wait_for(path, timeout=60.0):
    # the writer's imports take seconds on a loaded machine; the kill must land mid-writing
    deadline = time.monotonic() + timeout
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"writer never started writing ({path})")
        time.sleep(0.01)


def test_registry_survives_sigkill_during_writes(tmp_path):
    reg = AdapterRegistry(root=str(tmp_path))
    reg.promote("v0", "/a/v0", {}, by="t", reason="seed")
    for n, kill_after in enumerate((0.0, 0.05, 0.25)):
        started = tmp_path / f"started-{n}"
        proc = subprocess.Popen([sys.executable, "-c", WRITER, str(tmp_path), str(started)])
        wait_for(started)
        time.sleep(kill_after)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        content = json.loads(reg.path.read_text())  # never torn
        champ = content["champion"]["version"]
        assert content["history"][-1]["version"] == champ
        # versions are numbered by history position, so a lost or duplicated entry would show
        assert len(content["history"]) == int(champ.removeprefix("v")) + 1
    assert reg.champion()["version"] != "v0"  # the writer did get writes in
