"""deploy/docker-compose.yml, deploy/Dockerfile and deploy/dagster.yaml checked against the code,
without a Docker engine (none runs here or in CI; the Docker client has no compose plugin either):
every flowopt command parses with the real command line, every dagster command with Dagster's,
every variable is a setting the code reads, every file the image copies exists, and the instance
configuration opens on a real PostgreSQL server and migrates its schema."""

import os
import re
import subprocess
import sys
from pathlib import Path

import click
import yaml

from flow_assets.cli import build_parser
from flow_assets.settings import variables
from tests.conftest import PG_HOST, PG_PORT, PG_USER, postgres_database

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
STACK = {"postgres", "rabbitmq", "webserver", "daemon", "gateway", "api", "bus"}
# read by deploy/dagster.yaml (the instance's storage), not by flowopt's settings
INSTANCE_VARIABLES = {"FLOWOPT_PG_HOST", "FLOWOPT_PG_USER", "FLOWOPT_PG_PASSWORD", "FLOWOPT_PG_DB"}


def _compose() -> dict:
    return yaml.safe_load((DEPLOY / "docker-compose.yml").read_text())


def _dagster_command(argv: list[str]) -> None:
    """Parse ``argv`` with Dagster's own click commands (raises click's error on a bad option)."""
    from dagster._daemon.cli import run_command
    from dagster_webserver.cli import dagster_webserver

    command = {"dagster-webserver": dagster_webserver, "dagster-daemon": run_command}[argv[0]]
    args = argv[2:] if argv[0] == "dagster-daemon" else argv[1:]
    assert argv[0] != "dagster-daemon" or argv[1] == "run"
    command.make_context(argv[0], list(args))


def test_the_stack_runs_the_documented_commands_with_known_settings():
    compose = _compose()
    services = compose["services"]
    assert set(services) == STACK
    flowopt = {name: s for name, s in services.items() if s.get("image") == "flowopt:latest"}
    assert set(flowopt) == {"webserver", "daemon", "gateway", "api", "bus"}
    known = set(variables()) | INSTANCE_VARIABLES
    for name, service in flowopt.items():
        command = service["command"]
        if command[0] == "flowopt":
            args = build_parser().parse_args(command[1:])  # exits (SystemExit) on an unknown option
            assert callable(args.fn), name
        else:
            _dagster_command(command)
            assert command[command.index("-w") + 1] == "workspace.yaml" and (ROOT / "workspace.yaml").is_file()
        unknown = {v for v in service["environment"] if v.startswith("FLOWOPT_") and v not in known}
        assert unknown == set(), (name, unknown)
        # one volume for the lake, landing and models, where the image's settings point
        assert service["volumes"] == ["flowopt-data:/data"], name
        assert service["depends_on"]["postgres"]["condition"] == "service_healthy"
    # the processes that open the instance get the database the instance configuration names
    assert all(services[s]["environment"]["FLOWOPT_PG_HOST"] == "postgres" for s in ("webserver", "daemon", "api"))
    assert services["gateway"]["environment"]["FLOWOPT_GATEWAY_TOKENS"].startswith("${FLOWOPT_GATEWAY_TOKENS:?")
    assert services["api"]["command"][services["api"]["command"].index("--dagster-url") + 1] == "http://webserver:3000"
    assert "rabbitmq:5672" in services["bus"]["environment"]["FLOWOPT_AMQP_URL"]
    assert services["bus"]["depends_on"]["rabbitmq"]["condition"] == "service_healthy"
    assert set(compose["volumes"]) == {"flowopt-data", "postgres-data"}


def test_the_image_copies_files_that_exist_and_points_its_settings_at_the_volume():
    text = (DEPLOY / "Dockerfile").read_text()
    copied = [line.split()[1:-1] for line in text.splitlines() if line.startswith("COPY ")]
    assert copied and all((ROOT / src).exists() for sources in copied for src in sources), copied
    env = dict(re.findall(r"(FLOWOPT_[A-Z_]+|DAGSTER_HOME)=(\S+)", text))
    assert {k for k in env if k.startswith("FLOWOPT_")} <= set(variables())
    assert all(env[k].startswith("/data/") for k in ("FLOWOPT_LAKE", "FLOWOPT_LANDING", "FLOWOPT_MODELS"))
    assert "COPY deploy/dagster.yaml " + env["DAGSTER_HOME"] + "/dagster.yaml" in text
    assert '"torch==2.13.0"' in text  # the version the tests run, CPU wheel unless a GPU index is given


def test_the_instance_configuration_opens_on_postgres_and_keeps_the_repositorys_settings(tmp_path):
    deployed = yaml.safe_load((DEPLOY / "dagster.yaml").read_text())
    local = yaml.safe_load((ROOT / "dagster.yaml").read_text())
    # everything the repository's instance sets, the deployment sets alike (storage apart)
    assert {k: v for k, v in deployed.items() if k not in ("storage", "run_monitoring")} == local
    assert deployed["run_monitoring"]["enabled"] is True
    home = tmp_path / "home"
    home.mkdir()
    (home / "dagster.yaml").write_text((DEPLOY / "dagster.yaml").read_text())
    with postgres_database() as db:
        env = {**os.environ, "DAGSTER_HOME": str(home), "FLOWOPT_PG_HOST": PG_HOST, "FLOWOPT_PG_USER": PG_USER,
               "FLOWOPT_PG_PASSWORD": "", "FLOWOPT_PG_DB": db["db_name"]}  # fmt: skip
        assert str(PG_PORT) == "5432"  # the port deploy/dagster.yaml names
        # a real Dagster process opens the instance: the config is valid and the schema migrates
        done = subprocess.run([str(Path(sys.executable).with_name("dagster")), "instance", "migrate"], env=env, cwd=ROOT,
                              capture_output=True, text=True, timeout=300)  # fmt: skip
        assert done.returncode == 0, done.stdout + done.stderr
        info = subprocess.run([str(Path(sys.executable).with_name("dagster")), "instance", "info"], env=env, cwd=ROOT,
                              capture_output=True, text=True, timeout=300)  # fmt: skip
        assert info.returncode == 0 and "PostgresRunStorage" in info.stdout, info.stdout + info.stderr
        assert "WarmRunLauncher" in info.stdout


def test_click_refuses_a_wrong_dagster_option():
    # the check above would catch a mistyped option: Dagster's parser refuses it
    try:
        _dagster_command(["dagster-webserver", "-w", "workspace.yaml", "--hots", "0.0.0.0"])
    except click.UsageError:
        return
    raise AssertionError("a wrong option was accepted")
