"""After `make demo`, the README's commands find the demo's state with nothing exported: the demo
records it in the project settings file `.flowopt.toml` of its working directory, and every
command run from there reads it (environment > file > default). Here a small demo-like state
(tiny policy with a challenger in live A/B, one real FireAct log) stands in for the demo's, and
each command runs as a user runs it: the console scripts, from that directory, with no
DAGSTER_HOME / FLOWOPT_* in the environment."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from flow_assets.demo.state import DemoState
from flow_assets.settings import DEMO_FILE_HEADER, PROJECT_FILE, Settings, is_demo_file, read_project_file, write_demo_file
from resources.registry import AdapterRegistry
from tests.conftest import SHARED_DATA, make_policy_dir

BIN = Path(sys.executable).parent
FIREACT = next((SHARED_DATA / "fireact").glob("*llama-2-7b*.json"))  # the log whose `reflect` tool always fails


def _clean_env(**extra: str) -> dict[str, str]:
    """This process's environment without any flowopt or Dagster location variable: only the
    settings file can point the commands at the state."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLOWOPT_") and k != "DAGSTER_HOME"}
    return {**env, **extra}


def _run(cwd: Path, *argv: str, env: dict | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([str(a) for a in argv], cwd=cwd, env=env or _clean_env(), capture_output=True, text=True, timeout=timeout)


def _port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_health(port: int, process: subprocess.Popen, timeout: float = 120) -> httpx.Response:
    deadline = time.monotonic() + timeout
    while True:
        try:
            return httpx.get(f"http://127.0.0.1:{port}/health", timeout=5)
        except httpx.TransportError:
            assert process.poll() is None, process.stdout.read()
            assert time.monotonic() < deadline, "no /health in time"
            time.sleep(0.3)


@pytest.fixture(scope="module")
def demo_dir(tmp_path_factory):
    """A working directory as `make demo` leaves the repository root: `.demo/` with a tiny policy
    (champion v0, challenger v1 in live A/B) and the settings file naming it."""
    root = tmp_path_factory.mktemp("after_demo")
    state = DemoState(*(root / ".demo" / n for n in ("dagster_home", "lake", "landing", "models", "workflows")))
    state.prepare()
    make_policy_dir(state.models)
    registry = AdapterRegistry(root=str(state.models))
    v0 = registry.champion()
    shutil.copytree(v0["adapter_path"], state.models / "adapters" / "v1")
    registry.start_challenger("v1", str(state.models / "adapters" / "v1"), {}, 0.5, by="test", reason="on trial")
    assert state.record(root) == root / PROJECT_FILE
    return root, state


def test_the_settings_file_names_the_state_relative_to_its_directory(demo_dir):
    root, state = demo_dir
    text = (root / PROJECT_FILE).read_text()
    assert text.startswith(DEMO_FILE_HEADER) and 'lake = ".demo/lake"' in text and str(root) not in text
    settings = Settings.load({}, root)
    assert Path(settings.lake).resolve() == state.lake and Path(settings.workflows).resolve() == state.workflows
    assert settings.source("models") == "file" and settings.source("tasks") == "default"
    # what `make ui` gives the webserver as DAGSTER_HOME
    done = _run(root, BIN / "python", "-m", "flow_assets.settings", "dagster_home")
    assert done.returncode == 0 and Path(root, done.stdout.strip()).resolve() == state.home


def test_ingest_then_the_documented_dagster_command_then_proposals_find_the_demos_state(demo_dir):
    root, state = demo_dir
    done = _run(root, BIN / "flowopt", "ingest", FIREACT)
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads(done.stdout)
    assert Path(root, report["lake"]).resolve() == state.lake and Path(report["dagster_home"]).resolve() == state.home
    assert not (root / ".lake").exists() and not (root / ".dagster_home").exists()

    done = _run(root, BIN / "dagster", "job", "execute", "-m", "flow_assets.definitions", "-j", "workflow_proposals_job")
    assert done.returncode == 0, done.stderr[-3000:]
    done = _run(root, BIN / "flowopt", "proposals", "list")
    assert done.returncode == 0 and "fireact:llama-2-7b-lora" in done.stdout and "remove_broken_step  reflect" in done.stdout, done.stderr
    proposal_id = done.stdout.split()[0]
    done = _run(root, BIN / "flowopt", "proposals", "show", proposal_id)
    assert done.returncode == 0 and json.loads(done.stdout)["applies_now"] is True
    assert (state.workflows / "proposals" / f"{proposal_id}.json").is_file()
    # a variable set by the user still wins over the file
    done = _run(root, BIN / "flowopt", "proposals", "list", env=_clean_env(FLOWOPT_WORKFLOWS=str(root / "elsewhere")))
    assert done.returncode == 0 and done.stdout == "" and "no open proposals" in done.stderr


def test_the_demos_workflow_proposals_phase_reports_what_proposals_list_shows(demo_dir):
    """The demo's last phase (run_demo calls it after the live A/B): workflow_proposals_job in
    process, on the demo's instance, and the report's ``workflows`` section."""
    from flow_assets.demo.phases import run_workflow_proposals
    from flow_assets.runtime.local import local_instance

    root, state = demo_dir
    instance = local_instance(state.home)
    report = run_workflow_proposals(state, instance, Settings())
    assert instance.get_run_by_id(report["run_id"]).job_name == "workflow_proposals_job"
    assert report["agents"] == {"fireact:llama-2-7b-lora": 1} and report["open"] == 1 and Path(report["directory"]) == state.workflows
    (proposal,) = report["proposals"]
    assert (proposal["rule"], proposal["step_id"]) == ("remove_broken_step", "reflect") and proposal["interval"][0] <= proposal["effect"]
    done = _run(root, BIN / "flowopt", "proposals", "list")
    assert done.stdout.split()[0] == proposal["id"]


def test_promote_and_rollback_find_the_champion_and_record_it_in_the_demos_instance(demo_dir):
    root, state = demo_dir
    done = _run(root, BIN / "flowopt", "promote", "--by", "alice")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["previous_champion"] == "v0" and json.loads(done.stdout)["champion"] == "v1"
    assert "not recorded" not in done.stderr
    done = _run(root, BIN / "flowopt", "rollback", "--by", "alice")
    assert done.returncode == 0, done.stderr
    assert (json.loads(done.stdout)["previous_champion"], json.loads(done.stdout)["champion"]) == ("v1", "v0")
    assert AdapterRegistry(root=str(state.models)).champion()["version"] == "v0"

    from dagster import AssetKey

    from flow_assets.runtime.local import local_instance

    event = local_instance(state.home).get_latest_materialization_event(AssetKey("champion"))
    assert event is not None and event.asset_materialization.metadata["version"].value == "v0"


def test_serve_and_the_api_answer_on_the_demos_state(demo_dir):
    root, state = demo_dir
    gateway_port, api_port = _port(), _port()
    serve = subprocess.Popen([BIN / "flowopt", "serve", "--port", str(gateway_port), "--max-tokens", "2"], cwd=root, env=_clean_env(),
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)  # fmt: skip
    api = subprocess.Popen([BIN / "flowopt", "api", "--port", str(api_port)], cwd=root, env=_clean_env(FLOWOPT_API_TOKENS="t"),
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)  # fmt: skip
    try:
        assert _wait_health(gateway_port, serve).status_code == 200
        reply = httpx.post(f"http://127.0.0.1:{gateway_port}/v1/chat/completions", json={"model": "policy", "messages": [{"role": "user", "content": "2+2"}]},
                           timeout=60).json()  # fmt: skip
        assert reply["system_fingerprint"] in ("v0", "v1")  # the demo's registry: champion or challenger
        assert _wait_health(api_port, api).status_code == 200
        rpc = httpx.post(f"http://127.0.0.1:{api_port}/rpc", headers={"Authorization": "Bearer t"},
                         json={"jsonrpc": "2.0", "id": 1, "method": "training.list_jobs"}, timeout=30).json()  # fmt: skip
        assert "result" in rpc, rpc
    finally:
        for process in (serve, api):
            process.send_signal(signal.SIGINT)
        out = serve.communicate(timeout=60)[0]
        api.communicate(timeout=60)
    assert f"rollouts land in {Path('.demo/landing/gateway')}" in out, out[-2000:]


def test_a_person_s_settings_file_wins_over_nothing_and_is_never_replaced(tmp_path):
    mine = tmp_path / PROJECT_FILE
    mine.write_text('lake = "data/lake"\nsettle_seconds = 2\nlive_ab = true\n')
    settings = Settings.load({"FLOWOPT_SETTLE_SECONDS": "5"}, tmp_path)
    assert (settings.lake, settings.settle_seconds, settings.live_ab) == (str(tmp_path / "data" / "lake"), 5.0, True)
    assert (settings.source("lake"), settings.source("settle_seconds"), settings.source("landing")) == ("file", "environment", "default")
    assert write_demo_file(tmp_path, {"lake": tmp_path / ".demo" / "lake"}) is None and not is_demo_file(mine)
    assert read_project_file(mine)["live_ab"] is True


@pytest.mark.parametrize(
    ("text", "message"),
    [("lake = [1]", "expected a string"), ("api_tokens = \"x\"", "is a secret"), ("no_such = 1", "not a flowopt setting"),
     ("settle_seconds = -1", "settle_seconds"), ("lake = ", "not a settings file")],
)  # fmt: skip
def test_a_bad_settings_file_names_itself_and_the_key(tmp_path, text, message):
    (tmp_path / PROJECT_FILE).write_text(text + "\n")
    with pytest.raises(ValueError, match=message) as raised:
        Settings.load({}, tmp_path)
    assert PROJECT_FILE in str(raised.value)


def test_make_clean_removes_the_demos_settings_file_only(tmp_path):
    repo = Path(__file__).resolve().parents[2]
    shutil.copy(repo / "Makefile", tmp_path / "Makefile")
    write_demo_file(tmp_path, {"lake": tmp_path / ".demo" / "lake"})
    (tmp_path / ".demo").mkdir()
    assert subprocess.run(["make", "-s", "clean"], cwd=tmp_path, capture_output=True).returncode == 0
    assert not (tmp_path / PROJECT_FILE).exists() and not (tmp_path / ".demo").exists()
    (tmp_path / PROJECT_FILE).write_text('lake = "mine"\n')
    assert subprocess.run(["make", "-s", "clean"], cwd=tmp_path, capture_output=True).returncode == 0
    assert (tmp_path / PROJECT_FILE).read_text() == 'lake = "mine"\n'
