"""One typed settings object reads the environment (``flow_assets/settings.py``): no other module
of the code location reads it, every variable parses with a clear error, and a variable set for
the code location reaches the resource and the sensors it configures."""

import ast
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from flow_assets.settings import DEFAULT_LAKE, DEFAULT_LANDING, Settings, child_environ, variables
from tests.fresh import call_in_fresh_interpreter, code_location_modules

REPO = Path(__file__).resolve().parents[1]
SETTINGS_MODULE = Path("flow_assets") / "settings.py"  # as code_location_modules names it


def environment_reads(source: str) -> list[int]:
    """Line numbers of ``os.environ``, ``os.getenv`` / ``os.putenv`` and ``from os import
    environ / getenv`` in ``source`` (code, not text: a docstring may name them)."""
    lines = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and node.attr in ("environ", "getenv", "putenv", "environb") and isinstance(node.value, ast.Name) and node.value.id == "os":
            lines.append(node.lineno)
        elif isinstance(node, ast.ImportFrom) and node.module == "os" and {a.name for a in node.names} & {"environ", "getenv", "putenv", "environb"}:
            lines.append(node.lineno)
    return sorted(lines)


def test_the_detector_finds_every_form_of_reading_the_environment():
    source = '"""os.environ in a docstring is text."""\nimport os\nfrom os import getenv\na = os.environ.get("A")\nb = os.getenv("B")\nc = {**os.environ}\n'
    assert environment_reads(source) == [3, 4, 5, 6]


def environment_readers() -> list[str]:
    """``path:line`` of every environment read (:func:`environment_reads`) in the code location
    outside the settings module."""
    return [
        f"{path}:{line}"
        for path, source in code_location_modules()
        if path != SETTINGS_MODULE
        for line in environment_reads(source)
    ]


def settings_file_parsers() -> list[str]:
    """``path:line`` of every import of a TOML parser in the code location outside the settings
    module."""
    parsers = {"tomllib", "tomli", "toml"}
    found = []
    for path, source in code_location_modules():
        if path == SETTINGS_MODULE:
            continue
        for node in ast.walk(ast.parse(source)):
            names = [a.name.split(".")[0] for a in node.names] if isinstance(node, ast.Import) else [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            if parsers & set(names):
                found.append(f"{path}:{node.lineno}")
    return found


def test_only_the_settings_module_reads_the_environment():
    found = call_in_fresh_interpreter(environment_readers)  # ast.parse beside other threads: tests/fresh.py
    assert found == [], f"read the environment through flow_assets.settings.Settings (or child_environ for a subprocess): {found}"


def test_only_the_settings_module_parses_the_project_settings_file():
    found = call_in_fresh_interpreter(settings_file_parsers)
    assert found == [], f"read .flowopt.toml through flow_assets.settings.Settings.load: {found}"


def test_every_variable_named_in_the_code_is_a_setting_and_documented():
    known = set(variables())
    named = {}
    for path, source in code_location_modules():
        for match in re.finditer(r"\bFLOWOPT_[A-Z0-9_]*[A-Z0-9]\b", source):
            named.setdefault(match.group(), str(path))
    assert {v: f for v, f in named.items() if v not in known} == {}, "a FLOWOPT_* variable no Settings field reads"
    table = (REPO / "docs" / "settings.md").read_text(encoding="utf-8")
    assert [v for v in sorted(known) if f"`{v}`" not in table] == [], "docs/settings.md misses these variables"


def test_unset_and_empty_variables_take_the_defaults():
    defaults = Settings.from_environ({})
    assert defaults == Settings() and defaults.given == frozenset()
    assert (defaults.lake, defaults.landing, defaults.models, defaults.settle_seconds, defaults.sensor_interval_seconds) == (DEFAULT_LAKE, DEFAULT_LANDING, ".models", 10.0, 30)
    assert (defaults.base_model, defaults.run_config, defaults.live_ab, defaults.api_tokens, defaults.judge_mode) == (None, None, False, (), "relative")
    assert Settings.from_environ({"FLOWOPT_LAKE": "", "FLOWOPT_SELF_PLAY_ROUNDS": "", "UNRELATED": "x"}) == defaults


def test_set_variables_are_parsed_to_their_types():
    settings = Settings.from_environ({
        "FLOWOPT_LAKE": "/data/lake", "DAGSTER_HOME": "/srv/dagster", "FLOWOPT_SETTLE_SECONDS": "0.5", "FLOWOPT_SENSOR_INTERVAL_SECONDS": "7",
        "FLOWOPT_SELF_PLAY_ROUNDS": "3", "FLOWOPT_LIVE_AB": "On", "FLOWOPT_LIVE_AB_SHARE": "0.25", "FLOWOPT_API_TOKENS": " a, b ,,",
        "FLOWOPT_POLICY_INPUT_USD_PER_MTOK": "2.5", "FLOWOPT_MONTHLY_BUDGET_USD": "40", "FLOWOPT_JUDGE_MODE": "absolute", "FLOWOPT_JUDGE_API_KEY": "sk-secret",
    })  # fmt: skip
    assert (settings.lake, settings.dagster_home, settings.settle_seconds, settings.sensor_interval_seconds) == ("/data/lake", "/srv/dagster", 0.5, 7)
    assert (settings.self_play_rounds, settings.live_ab, settings.live_ab_share, settings.api_tokens) == (3, True, 0.25, ("a", "b"))
    assert (settings.policy_input_usd_per_mtok, settings.monthly_budget_usd, settings.judge_mode) == (2.5, 40.0, "absolute")
    assert settings.is_set("lake") and not settings.is_set("landing")
    assert "sk-secret" not in repr(settings) and settings.judge_api_key == "sk-secret"
    assert Settings.from_environ({"FLOWOPT_LIVE_AB": "off"}).live_ab is False


def test_replace_overrides_only_what_is_given():
    settings = Settings.from_environ({"FLOWOPT_LAKE": "env-lake", "FLOWOPT_LANDING": "env-landing"})
    changed = settings.replace(lake="mine", landing=None, settle_seconds=0)
    assert (changed.lake, changed.landing, changed.settle_seconds) == ("mine", "env-landing", 0)
    assert changed.is_set("settle_seconds") and settings.lake == "env-lake"  # frozen: the original is unchanged
    with pytest.raises(AttributeError):
        settings.lake = "x"


@pytest.mark.parametrize(
    ("variable", "value"),
    [
        ("FLOWOPT_SENSOR_INTERVAL_SECONDS", "0"),
        ("FLOWOPT_SENSOR_INTERVAL_SECONDS", "1.5"),
        ("FLOWOPT_SELF_PLAY_ROUNDS", "many"),
        ("FLOWOPT_SETTLE_SECONDS", "-1"),
        ("FLOWOPT_SETTLE_SECONDS", "nan"),
        ("FLOWOPT_LIVE_AB", "maybe"),
        ("FLOWOPT_LIVE_AB_SHARE", "1"),
        ("FLOWOPT_JUDGE_MODE", "pairwise"),
        ("FLOWOPT_POLICY_OUTPUT_USD_PER_MTOK", "cheap"),
        ("FLOWOPT_MONTHLY_BUDGET_USD", "-5"),
    ],
)
def test_a_bad_value_names_its_variable_and_the_value(variable, value):
    with pytest.raises(ValueError) as raised:
        Settings.from_environ({variable: value})
    assert variable in str(raised.value) and repr(value) in str(raised.value)


def test_a_child_environment_is_this_processs_with_overrides_and_leaves_it_alone():
    before = dict(os.environ)
    env = child_environ({"FLOWOPT_LAKE": "a", "FLOWOPT_LANDING": "b"}, FLOWOPT_LAKE="c")
    assert env["FLOWOPT_LAKE"] == "c" and env["FLOWOPT_LANDING"] == "b" and env.get("PATH") == os.environ.get("PATH")
    assert dict(os.environ) == before


def test_settings_reach_the_resources_of_build_definitions(tmp_path):
    from flow_assets.definitions import build_definitions

    settings = Settings.from_environ({"FLOWOPT_LAKE": str(tmp_path / "lake"), "FLOWOPT_TASKS": "word_problems", "FLOWOPT_LIVE_AB_SHARE": "0.3"})
    resources = build_definitions(settings=settings).resources
    assert resources["lake"].root == str(tmp_path / "lake") and resources["tasks"].kind == "word_problems" and resources["live_ab"].share == 0.3
    # a keyword override wins over the settings; the rest stays as they say
    resources = build_definitions(landing_dir=str(tmp_path / "landing"), settle_seconds=0, settings=settings).resources
    assert (resources["landing"].directory, resources["landing"].settle_seconds, resources["lake"].root) == (str(tmp_path / "landing"), 0, str(tmp_path / "lake"))


def test_the_code_location_loads_its_settings_from_the_environment(tmp_path):
    """The path a daemon or webserver takes: a fresh process imports the code location with
    the variables set; its lake resource and every sensor's interval follow them."""
    probe = (
        "import json; from flow_assets.definitions import defs; "
        "repo = defs.get_repository_def(); "
        "print(json.dumps({'lake': defs.resources['lake'].root, 'live_ab': defs.resources['live_ab'].enabled, "
        "'intervals': sorted({s.minimum_interval_seconds for s in repo.sensor_defs})}))"
    )
    env = {**os.environ, "FLOWOPT_LAKE": str(tmp_path / "lake"), "FLOWOPT_SENSOR_INTERVAL_SECONDS": "7", "FLOWOPT_LIVE_AB": "yes"}
    done = subprocess.run([sys.executable, "-c", probe], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout.strip().splitlines()[-1]) == {"lake": str(tmp_path / "lake"), "live_ab": True, "intervals": [7]}


def test_the_cli_refuses_a_bad_setting_before_doing_anything():
    flowopt = str(Path(sys.executable).with_name("flowopt"))
    env = {**os.environ, "FLOWOPT_SELF_PLAY_ROUNDS": "three"}
    done = subprocess.run([flowopt, "schema"], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 2 and "FLOWOPT_SELF_PLAY_ROUNDS" in done.stderr and "'three'" in done.stderr and not done.stdout


def test_the_project_file_variable_picks_the_file_or_none(tmp_path):
    (tmp_path / ".flowopt.toml").write_text('lake = "demo-lake"\n')
    (tmp_path / "other.toml").write_text('lake = "other-lake"\n')
    assert Settings.load({}, tmp_path).lake == str((tmp_path / "demo-lake").resolve())
    assert Settings.load({"FLOWOPT_PROJECT_FILE": "other.toml"}, tmp_path).lake == str((tmp_path / "other-lake").resolve())
    untouched = Settings.load({"FLOWOPT_PROJECT_FILE": "none"}, tmp_path)
    assert untouched.lake == DEFAULT_LAKE and untouched.source("lake") == "default"
    (tmp_path / ".flowopt.toml").write_text('project_file = "x.toml"\n')
    with pytest.raises(ValueError, match="FLOWOPT_PROJECT_FILE"):
        Settings.load({}, tmp_path)


def test_training_sources_name_agents_and_their_update_rules():
    from resources.loop import TrainingLoop

    settings = Settings.from_environ({"FLOWOPT_TRAINING_SOURCES": "gpt-4o-airline=awr, my-agent-v1 = grpo,"})
    assert settings.training_sources == (("gpt-4o-airline", "awr"), ("my-agent-v1", "grpo"))
    with pytest.raises(ValueError, match="FLOWOPT_TRAINING_SOURCES.*'gpt-4o=sft'"):
        Settings.from_environ({"FLOWOPT_TRAINING_SOURCES": "gpt-4o=sft"})
    loop = TrainingLoop(sources=dict(settings.training_sources))
    assert loop.update_rules("calc") == {"gpt-4o-airline": "awr", "my-agent-v1": "grpo", "calc": "grpo"}
    with pytest.raises(ValueError, match="own agent 'calc' trains with grpo"):
        TrainingLoop(sources={"calc": "awr"}).update_rules("calc")


def test_the_round_schedule_is_a_cycle_of_round_kinds_reaching_the_loop():
    from flow_assets.definitions import build_resources

    assert Settings.from_environ({}).round_schedule == ("adapter",)
    settings = Settings.from_environ({"FLOWOPT_ROUND_SCHEDULE": " prompt, adapter ,"})
    assert settings.round_schedule == ("prompt", "adapter")
    assert build_resources(settings)["loop"].round_schedule == ["prompt", "adapter"]
    with pytest.raises(ValueError, match="FLOWOPT_ROUND_SCHEDULE='prompt,weights'"):
        Settings.from_environ({"FLOWOPT_ROUND_SCHEDULE": "prompt,weights"})
