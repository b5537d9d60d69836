"""The adapter registry: promotion history, rollback, and crash safety of its writes."""

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import pytest

from resources.registry import AdapterRegistry, RegistryError
from tests.conftest import run_cli


def _adapters(root, *versions):
    """Adapter directories as PEFT writes them (config and weights), one per version."""
    for v in versions:
        (root / "adapters" / v).mkdir(parents=True)
        (root / "adapters" / v / "adapter_config.json").write_text("{}")
        (root / "adapters" / v / "adapter_model.safetensors").write_bytes(b"weights")
    return {v: str(root / "adapters" / v) for v in versions}


def test_promotions_keep_history_and_rollback_restores_the_previous_champion(tmp_path):
    reg = AdapterRegistry(root=str(tmp_path))
    a = _adapters(tmp_path, "v0", "v1", "v2")
    reg.promote("v0", a["v0"], {"success": 0.4}, by="test", reason="base")
    reg.promote("v1", a["v1"], {"success": 0.5}, by="test", reason="round 1")
    reg.promote("v2", a["v2"], {"success": 0.6}, by="test", reason="round 2")
    assert reg.champion()["version"] == "v2"
    back = reg.rollback(by="oncall", reason="A/B regression")
    assert back == {"version": "v1", "adapter_path": a["v1"], "metrics": {"success": 0.5}}
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
    assert not [p for p in tmp_path.rglob("*.tmp")]


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



PROMOTER = """
import sys
from resources.registry import AdapterRegistry
reg = AdapterRegistry(root=sys.argv[1])
for i in range(int(sys.argv[3])):
    reg.promote(f"{sys.argv[2]}-{i}", "/a", {}, by=sys.argv[2], reason="race")
"""


def test_concurrent_promotions_from_two_processes_all_land_in_the_history(tmp_path):
    procs = [subprocess.Popen([sys.executable, "-c", PROMOTER, str(tmp_path), name, "60"]) for name in ("p", "q")]
    assert [p.wait(timeout=300) for p in procs] == [0, 0]
    history = AdapterRegistry(root=str(tmp_path)).load()["history"]
    assert len(history) == 120  # without the lock, read-modify-write races lost entries
    assert sorted(e["version"] for e in history) == sorted(f"{n}-{i}" for n in "pq" for i in range(60))
    assert len(list((tmp_path / "history").glob("*.json"))) == 120


@pytest.mark.parametrize("damage", ["truncated", "empty object", "list", "directory"])
def test_a_damaged_registry_is_reported_in_one_line_and_rebuilt_from_its_event_files(tmp_path, damage):
    reg = AdapterRegistry(root=str(tmp_path))
    a = _adapters(tmp_path, "v0", "v1")
    reg.promote("v0", a["v0"], {"success": 0.4}, by="t", reason="base")
    reg.promote("v1", a["v1"], {"success": 0.5}, by="t", reason="round 1")
    good = reg.load()
    if damage == "directory":
        reg.path.unlink()
        reg.path.mkdir()
    else:
        reg.path.write_text({"truncated": reg.path.read_text()[:40], "empty object": "{}", "list": "[]"}[damage])
    with pytest.raises(RegistryError) as info:
        reg.champion()
    message = str(info.value)
    assert "\n" not in message and str(reg.path) in message and "flowopt registry rebuild" in message
    cli = subprocess.run([sys.executable, "-m", "flow_assets.cli", "rollback", "--models", str(tmp_path)], capture_output=True, text=True)
    assert cli.returncode == 1 and "Traceback" not in cli.stderr and "flowopt registry rebuild" in cli.stderr
    cli = subprocess.run([sys.executable, "-m", "flow_assets.cli", "registry", "rebuild", "--models", str(tmp_path)], capture_output=True, text=True)
    assert cli.returncode == 0, cli.stderr
    assert json.loads(cli.stdout) == {"champion": "v1", "events": 2}
    assert reg.load() == good


def test_rollback_refuses_a_target_whose_adapter_is_gone(tmp_path):
    reg = AdapterRegistry(root=str(tmp_path))
    a = _adapters(tmp_path, "v0", "v1")
    reg.promote("v0", a["v0"], {}, by="t", reason="base")
    reg.promote("v1", a["v1"], {}, by="t", reason="round 1")
    shutil.rmtree(a["v0"])
    cli = subprocess.run([sys.executable, "-m", "flow_assets.cli", "rollback", "--models", str(tmp_path)], capture_output=True, text=True)
    assert cli.returncode == 1 and "its adapter" in cli.stderr and "is gone" in cli.stderr
    assert reg.champion()["version"] == "v1" and len(reg.load()["history"]) == 2


def _two_champions(tmp_path) -> AdapterRegistry:
    reg = AdapterRegistry(root=str(tmp_path))
    a = _adapters(tmp_path, "v0", "v1")
    reg.promote("v0", a["v0"], {}, by="t", reason="base", action="register")
    reg.promote("v1", a["v1"], {"success": 0.5}, by="t", reason="round 1")
    return reg


def _corrupt(text: str, shape: str) -> bytes:
    good = json.loads(text)
    if shape == "wrong types":
        return json.dumps({**good, "history": [1, "promote"]}).encode()
    if shape == "missing keys":
        return json.dumps({**good, "history": [{k: v for k, v in e.items() if k != "version"} for e in good["history"]]}).encode()
    if shape == "version pointing nowhere":
        return json.dumps({**good, "champion": {**good["champion"], "version": "v9"}}).encode()
    return {
        "empty": b"",
        "truncated": text.encode()[:40],
        "array": b"[]",
        "parquet": b"PAR1\x15\x04\x15\x10\x15\x14L\x15\x02\x15\x00\x12\x00\x00PAR1",
        "not utf-8": b'{"champion": "\xff\xfe", "history": []}',
    }[shape]


SHAPES = ["empty", "truncated", "array", "wrong types", "missing keys", "parquet", "version pointing nowhere", "not utf-8"]


@pytest.mark.parametrize("shape", SHAPES)
def test_every_corruption_shape_is_one_line_naming_the_file_on_every_command(tmp_path, shape):
    reg = _two_champions(tmp_path)
    good = reg.load()
    damaged = _corrupt(reg.path.read_text(), shape)
    reg.path.write_bytes(damaged)
    for command in (["rollback"], ["promote"], ["registry", "show"]):
        rc, out, err = run_cli([*command, "--models", tmp_path])
        # "wrong types" and "missing keys" raised TypeError / KeyError from rollback before
        assert rc == 1 and "Traceback" not in err and len(err.strip().splitlines()) == 1, (command, err)
        assert str(reg.path) in err and "flowopt registry rebuild" in err and out == "", (command, err)
    assert reg.path.read_bytes() == damaged  # nothing wrote over it
    rc, out, err = run_cli(["registry", "rebuild", "--models", tmp_path])
    assert rc == 0 and reg.load() == good, err
    rc, out, _ = run_cli(["registry", "show", "--models", tmp_path])
    assert rc == 0 and json.loads(out)["champion"]["version"] == "v1"


def test_the_messages_say_what_is_wrong(tmp_path):
    reg = _two_champions(tmp_path)
    text = reg.path.read_text()
    expected = {"empty": "an empty file", "parquet": "binary content", "not utf-8": "not UTF-8 text (byte 0xff",
                "wrong types": "history.0: input should be a valid dictionary", "missing keys": "history.0.version: field required",
                "version pointing nowhere": "champion.version 'v9' points nowhere", "array": "a JSON list"}  # fmt: skip
    for shape, why in expected.items():
        reg.path.write_bytes(_corrupt(text, shape))
        with pytest.raises(RegistryError, match=re.escape(why)):
            reg.load()


def test_rollback_and_promote_refuse_an_adapter_directory_without_its_adapter_files(tmp_path):
    reg = _two_champions(tmp_path)
    v0 = tmp_path / "adapters" / "v0"
    shutil.rmtree(v0)
    v0.mkdir()  # empty: the old check (the path exists) rolled back to it
    rc, _, err = run_cli(["rollback", "--models", tmp_path])
    assert rc == 1 and "has no adapter_config.json" in err and reg.champion()["version"] == "v1"
    (v0 / "adapter_config.json").write_text("{}")
    rc, _, err = run_cli(["rollback", "--models", tmp_path])
    assert rc == 1 and "has no adapter_model.safetensors or adapter_model.bin" in err and len(reg.load()["history"]) == 2
    (v0 / "adapter_model.bin").write_bytes(b"w")
    rc, out, err = run_cli(["rollback", "--models", tmp_path])
    assert rc == 0 and json.loads(out)["champion"] == "v0", err
    # a challenger whose directory is empty is not promoted; the champion stays
    (tmp_path / "adapters" / "v2").mkdir()
    reg.start_challenger("v2", str(tmp_path / "adapters" / "v2"), {}, 0.5, by="t", reason="trial")
    rc, _, err = run_cli(["promote", "--models", tmp_path])
    assert rc == 1 and "cannot promote v2" in err and "has no adapter_config.json" in err
    assert reg.champion()["version"] == "v0" and reg.challenger()["version"] == "v2"
