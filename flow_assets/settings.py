"""flowopt's settings: every environment variable flowopt reads, and the project settings file,
parsed in one place.

:class:`Settings` is a frozen object read once at start-up (the CLI's ``main``, the code
location's ``defs``, a test's own mapping) and passed to what needs it. This module is the only
one in ``flow_assets``, ``resources`` and ``sensors`` that touches ``os.environ`` or reads the
project settings file (``tests/test_settings.py`` enforces the first); the variables, their
types and defaults are listed in ``docs/settings.md``. Each default is stated here once:
resources and CLI options that have the same default import the constant.

Layers, first wins: an environment variable, then the project settings file ``.flowopt.toml`` in
the working directory (:data:`PROJECT_FILE`; ``flowopt demo`` writes one saying where its state
is), then the built-in default. A variable that is unset or empty takes the next layer. A value
that does not parse raises ``ValueError`` naming the variable (or the file and key) and the
value, when the settings are read, not later in a run.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
import tomllib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

#: default directories, relative to the working directory of the process that reads them
DEFAULT_LAKE = ".lake"
DEFAULT_LANDING = ".landing"
DEFAULT_MODELS = ".models"
DEFAULT_WORKFLOWS = ".workflows"
DEFAULT_EXPORTS = ".exports"
DEFAULT_DAGSTER_HOME = ".dagster_home"
DEFAULT_JUDGE_CACHE = ".judge-cache"
DEFAULT_AMQP_URL = "amqp://guest:guest@127.0.0.1:5672/%2F"
DEFAULT_DAGSTER_URL = "http://127.0.0.1:3000"
DEFAULT_MONTHLY_BUDGET_USD = 100.0
DEFAULT_SETTLE_SECONDS = 10.0
DEFAULT_SENSOR_INTERVAL_SECONDS = 30
#: Dagster's own sensor-loop time (``flowopt daemon`` changes it; flow_assets/runtime/daemon.py)
DEFAULT_SENSOR_LOOP_SECONDS = 5.0
#: how often ``flowopt daemon`` reads the run table for finished and queued runs, to wake its
#: sensor loop and run queue (flow_assets/runtime/daemon.py); 0: never (Dagster's timers only)
DEFAULT_RUN_WATCH_SECONDS = 0.1

#: the project settings file, looked up in the working directory (the directory relative default
#: paths are relative to, and the one every documented command runs from: the repository root)
PROJECT_FILE = ".flowopt.toml"
#: the first line of a project settings file ``flowopt demo`` wrote (and may replace or delete)
DEMO_FILE_HEADER = "# written by flowopt demo"

#: the judge's bearer key; Dagster reads it itself (``EnvVar``) so that it never enters run config
JUDGE_API_KEY_VAR = "FLOWOPT_JUDGE_API_KEY"
#: the upstream model server\'s key (proxy mode, prompt rounds): read by Dagster through an EnvVar, never stored
UPSTREAM_API_KEY_VAR = "FLOWOPT_UPSTREAM_API_KEY"
#: the reflection model's key (prompt rounds' GEPA rewriting): read by Dagster through an EnvVar
REFLECTION_API_KEY_VAR = "FLOWOPT_REFLECTION_API_KEY"

_TRUE, _FALSE = ("1", "true", "on", "yes"), ("0", "false", "off", "no")


def _text(var: str, raw: str) -> str:
    return raw


def _tokens(var: str, raw: str) -> tuple[str, ...]:
    return tuple(t.strip() for t in raw.split(",") if t.strip())


#: how the flows of an agent other than the policy's own train it (``FLOWOPT_TRAINING_SOURCES``)
UPDATE_RULES = ("grpo", "awr")


def _sources(var: str, raw: str) -> tuple[tuple[str, str], ...]:
    """``"agent=awr,agent2=grpo"`` -> ``(("agent", "awr"), ("agent2", "grpo"))``."""
    pairs = []
    for item in (part.strip() for part in raw.split(",")):
        if not item:
            continue
        agent, sep, rule = (p.strip() for p in item.rpartition("="))
        if not sep or not agent or rule not in UPDATE_RULES:
            raise ValueError(f"{var}: {item!r} is not <agent_id>=<update rule> with a rule among {', '.join(UPDATE_RULES)}")
        pairs.append((agent, rule))
    return tuple(pairs)


def _schedule(var: str, raw: str) -> tuple[str, ...]:
    """``"prompt,adapter"`` -> ``("prompt", "adapter")``: the kinds of round a hosted policy
    cycles through (:func:`flow_assets.policy.prompt.next_round_kind`)."""
    kinds = tuple(k.strip() for k in raw.split(",") if k.strip())
    if not kinds or set(kinds) - {"adapter", "prompt"}:
        raise ValueError(f"{var}={raw!r}: expected a comma-separated list of adapter / prompt, e.g. prompt,adapter")
    return kinds


def _flag(var: str, raw: str) -> bool:
    if raw.lower() in _TRUE:
        return True
    if raw.lower() in _FALSE:
        return False
    raise ValueError(f"{var}={raw!r}: expected one of {', '.join(_TRUE + _FALSE)}")


def _count(minimum: int) -> Callable[[str, str], int]:
    def parse(var: str, raw: str) -> int:
        if not raw.isdigit() or int(raw) < minimum:
            kind = "a positive integer" if minimum == 1 else f"an integer >= {minimum}"
            raise ValueError(f"{var} must be {kind}, got {raw!r}")
        return int(raw)

    return parse


def _number(low: float, high: float = math.inf, open_low: bool = False, unit: str = "") -> Callable[[str, str], float]:
    def parse(var: str, raw: str) -> float:
        try:
            value = float(raw)
        except ValueError:
            raise ValueError(f"{var}={raw!r} is not a number" + (f" ({unit})" if unit else "")) from None
        inside = (value > low if open_low else value >= low) and value < high
        if not inside or math.isnan(value):
            bounds = f"{'>' if open_low else '>='} {low:g}" + (f" and < {high:g}" if high != math.inf else "")
            raise ValueError(f"{var}={raw!r} must be {bounds}")
        return value

    return parse


def _choice(*allowed: str) -> Callable[[str, str], str]:
    def parse(var: str, raw: str) -> str:
        if raw not in allowed:
            raise ValueError(f"{var}={raw!r}: expected one of {', '.join(allowed)}")
        return raw

    return parse


def _var(name: str, default: Any, parse: Callable[[str, str], Any] = _text, path: bool = False, secret: bool = False, **kwargs) -> Any:
    """A settings field read from environment variable ``name`` (else the project file's key of
    the field's name). ``path``: a relative value in the project file is relative to the file's
    directory. ``secret``: never read from the project file (a file in a working tree gets
    committed; tokens and keys come from the environment only)."""
    return field(default=default, metadata={"env": name, "parse": parse, "path": path, "secret": secret}, **kwargs)


@dataclass(frozen=True)
class Settings:
    """Every setting flowopt reads from the environment (``docs/settings.md`` says what each
    changes and who reads it). Build it with :meth:`load` (environment over the project settings
    file) or :meth:`from_environ` (a mapping of variables alone); a test or a caller that wants
    other values builds it with keywords (the defaults are the same) or :meth:`replace`.

    Attributes (variable in brackets; the project file's key is the attribute's name; paths
    relative to the working directory, or in the project file to the file's directory):
        lake: the Parquet lake [FLOWOPT_LAKE].
        landing: the landing directory of log files [FLOWOPT_LANDING].
        models: base model, adapters, checkpoints, registry [FLOWOPT_MODELS].
        workflows: workflow definitions, proposals, review audit log [FLOWOPT_WORKFLOWS].
        exports: where the API writes trajectory exports [FLOWOPT_EXPORTS].
        dagster_home: the Dagster instance's directory [DAGSTER_HOME].
        project_file: the project settings file :meth:`load` reads, relative to the working
            directory [FLOWOPT_PROJECT_FILE]; ``none`` reads none (the test suite sets it, so a
            demo's ``.flowopt.toml`` in the repository never points a test at the demo's state).
        base_model: a local model directory to train instead of the tiny one [FLOWOPT_BASE_MODEL].
        tasks: the task-source kind of the trainable agent [FLOWOPT_TASKS].
        agent: the agent that works on those tasks, ``module:function`` [FLOWOPT_AGENT]; unset:
            the kind's built-in agent.
        settle_seconds: seconds a landed file must stay unmodified before the sensor reads it
            [FLOWOPT_SETTLE_SECONDS], >= 0.
        sensor_interval_seconds: least seconds between two evaluations of a sensor
            [FLOWOPT_SENSOR_INTERVAL_SECONDS], >= 1 (Dagster reads 0 as its default, 30).
        sensor_loop_seconds: least seconds between two iterations of the daemon's sensor loop
            under ``flowopt daemon`` [FLOWOPT_SENSOR_LOOP_SECONDS], in (0, 61); the default is
            Dagster's own 5 s (``dagster-daemon`` itself always uses that). A sensor ticks at most
            this often whatever its interval.
        run_watch_seconds: how often ``flowopt daemon`` reads the run table to wake its sensor
            loop when a run finishes and its run queue when a run is queued or finishes
            [FLOWOPT_RUN_WATCH_SECONDS], >= 0; 0: never (the loops keep Dagster's timers). A
            sensor then also ticks right after a run that finished since its last tick, even
            within ``sensor_interval_seconds`` (one such early tick per interval at most).
        self_play_rounds: rounds the self-play sensor runs on its own, 0 = off
            [FLOWOPT_SELF_PLAY_ROUNDS].
        run_config: JSON file ``{job name: run config}`` the sensors launch runs with
            [FLOWOPT_RUN_CONFIG].
        training_sources: agents other than the task source's own whose logged flows train the
            policy, each with its update rule: ``awr`` (another model's flows) or ``grpo`` (text
            the policy itself wrote, logged under another agent id)
            [FLOWOPT_TRAINING_SOURCES, ``agent_id=rule`` comma-separated]; empty (the default):
            only the policy's own agent trains it.
        round_schedule: the kinds of round a hosted policy (a LoRA adapter, with or without a
            prompt policy) cycles through, one change per round [FLOWOPT_ROUND_SCHEDULE,
            comma-separated ``adapter`` / ``prompt``]; ``adapter`` (the default): LoRA rounds
            only; ``prompt,adapter``: optimise the prompt, then train the adapter under it. A
            prompt policy alone always gets prompt rounds.
        training_workers: data-parallel Ray Train workers a LoRA round's update runs on
            [FLOWOPT_TRAINING_WORKERS]; 0 (the default): in the run's own process.
        rollout_workers: Ray rollout workers (each a gateway replica) a LoRA round's collection and
            held-out evaluation run on [FLOWOPT_ROLLOUT_WORKERS]; 0 (the default): in the run's process.
        ray_address: the Ray cluster those workers run on [FLOWOPT_RAY_ADDRESS]; empty: a local
            cluster started by the run.
        tracking: experiment tracking target, ``""`` = off [FLOWOPT_TRACKING].
        live_ab: whether a gated candidate enters live A/B as challenger [FLOWOPT_LIVE_AB].
        live_ab_share: the challenger's share of sessions, in (0, 1) [FLOWOPT_LIVE_AB_SHARE].
        judge_url, judge_model, judge_mode, judge_cache: the scoring agent [FLOWOPT_JUDGE_*].
        judge_api_key: the judge's bearer key [FLOWOPT_JUDGE_API_KEY]; kept out of ``repr``.
        amqp_url: the RabbitMQ broker [FLOWOPT_AMQP_URL].
        api_tokens: bearer tokens of ``flowopt api`` [FLOWOPT_API_TOKENS, comma-separated].
        gateway_tokens: bearer tokens of ``flowopt serve`` [FLOWOPT_GATEWAY_TOKENS, comma-separated].
        upstream_api_key: the key ``flowopt serve --upstream`` sends its upstream model server
            [FLOWOPT_UPSTREAM_API_KEY]; kept out of ``repr``, never read from the project file.
        upstream_url / upstream_model: the upstream model server the prompt rounds call, and the
            model name sent to it [FLOWOPT_UPSTREAM_URL, FLOWOPT_UPSTREAM_MODEL]; empty URL (the
            default): no prompt rounds.
        reflection_url / reflection_model: the reflection model of the prompt rounds' GEPA
            rewriting [FLOWOPT_REFLECTION_URL, FLOWOPT_REFLECTION_MODEL]; empty URL: none.
        reflection_api_key: its bearer key [FLOWOPT_REFLECTION_API_KEY]; kept out of ``repr``.
        dagster_url: the webserver ``flowopt api`` submits runs through [FLOWOPT_DAGSTER_URL].
        policy_input_usd_per_mtok / policy_output_usd_per_mtok: what the policy's prompt /
            completion tokens cost, USD per million, >= 0 [FLOWOPT_POLICY_*_USD_PER_MTOK].
        monthly_budget_usd: an API job's default budget, USD per agent per calendar month, >= 0
            [FLOWOPT_MONTHLY_BUDGET_USD].
        chromium: a Chromium-family browser for ``flowopt ui-tour`` [FLOWOPT_CHROMIUM].
        given: the fields whose variable was set (non-empty) or that the project settings file
            sets, e.g. to tell "unset" from "set to the default" (:meth:`is_set`).
        from_file: the fields of ``given`` that came from the project settings file (no
            variable set; :meth:`source`).
    """

    lake: str = _var("FLOWOPT_LAKE", DEFAULT_LAKE, path=True)
    landing: str = _var("FLOWOPT_LANDING", DEFAULT_LANDING, path=True)
    models: str = _var("FLOWOPT_MODELS", DEFAULT_MODELS, path=True)
    workflows: str = _var("FLOWOPT_WORKFLOWS", DEFAULT_WORKFLOWS, path=True)
    exports: str = _var("FLOWOPT_EXPORTS", DEFAULT_EXPORTS, path=True)
    dagster_home: str = _var("DAGSTER_HOME", DEFAULT_DAGSTER_HOME, path=True)
    # which project settings file load() reads: environment only (it names the file itself)
    project_file: str = _var("FLOWOPT_PROJECT_FILE", PROJECT_FILE, secret=True)
    base_model: str | None = _var("FLOWOPT_BASE_MODEL", None, path=True)
    tasks: str = _var("FLOWOPT_TASKS", "calculator")
    agent: str | None = _var("FLOWOPT_AGENT", None)
    settle_seconds: float = _var("FLOWOPT_SETTLE_SECONDS", DEFAULT_SETTLE_SECONDS, _number(0.0, unit="seconds"))
    sensor_interval_seconds: int = _var("FLOWOPT_SENSOR_INTERVAL_SECONDS", DEFAULT_SENSOR_INTERVAL_SECONDS, _count(1))
    sensor_loop_seconds: float = _var("FLOWOPT_SENSOR_LOOP_SECONDS", DEFAULT_SENSOR_LOOP_SECONDS, _number(0.0, 61.0, open_low=True, unit="seconds"))
    run_watch_seconds: float = _var("FLOWOPT_RUN_WATCH_SECONDS", DEFAULT_RUN_WATCH_SECONDS, _number(0.0, 61.0, unit="seconds"))
    self_play_rounds: int = _var("FLOWOPT_SELF_PLAY_ROUNDS", 0, _count(0))
    run_config: str | None = _var("FLOWOPT_RUN_CONFIG", None, path=True)
    training_sources: tuple[tuple[str, str], ...] = _var("FLOWOPT_TRAINING_SOURCES", (), _sources)
    round_schedule: tuple[str, ...] = _var("FLOWOPT_ROUND_SCHEDULE", ("adapter",), _schedule)
    training_workers: int = _var("FLOWOPT_TRAINING_WORKERS", 0, _count(0))
    rollout_workers: int = _var("FLOWOPT_ROLLOUT_WORKERS", 0, _count(0))
    ray_address: str = _var("FLOWOPT_RAY_ADDRESS", "")
    tracking: str = _var("FLOWOPT_TRACKING", "")
    live_ab: bool = _var("FLOWOPT_LIVE_AB", False, _flag)
    live_ab_share: float = _var("FLOWOPT_LIVE_AB_SHARE", 0.1, _number(0.0, 1.0, open_low=True))
    judge_url: str = _var("FLOWOPT_JUDGE_URL", "")
    judge_model: str = _var("FLOWOPT_JUDGE_MODEL", "")
    judge_mode: str = _var("FLOWOPT_JUDGE_MODE", "relative", _choice("relative", "absolute"))
    judge_cache: str = _var("FLOWOPT_JUDGE_CACHE", DEFAULT_JUDGE_CACHE, path=True)
    judge_api_key: str | None = _var(JUDGE_API_KEY_VAR, None, secret=True, repr=False)
    amqp_url: str = _var("FLOWOPT_AMQP_URL", DEFAULT_AMQP_URL)
    api_tokens: tuple[str, ...] = _var("FLOWOPT_API_TOKENS", (), _tokens, secret=True, repr=False)
    gateway_tokens: tuple[str, ...] = _var("FLOWOPT_GATEWAY_TOKENS", (), _tokens, secret=True, repr=False)
    upstream_api_key: str | None = _var(UPSTREAM_API_KEY_VAR, None, secret=True, repr=False)
    upstream_url: str = _var("FLOWOPT_UPSTREAM_URL", "")
    upstream_model: str = _var("FLOWOPT_UPSTREAM_MODEL", "")
    reflection_url: str = _var("FLOWOPT_REFLECTION_URL", "")
    reflection_model: str = _var("FLOWOPT_REFLECTION_MODEL", "")
    reflection_api_key: str | None = _var(REFLECTION_API_KEY_VAR, None, secret=True, repr=False)
    dagster_url: str = _var("FLOWOPT_DAGSTER_URL", DEFAULT_DAGSTER_URL)
    policy_input_usd_per_mtok: float = _var("FLOWOPT_POLICY_INPUT_USD_PER_MTOK", 0.0, _number(0.0, unit="USD per million tokens"))
    policy_output_usd_per_mtok: float = _var("FLOWOPT_POLICY_OUTPUT_USD_PER_MTOK", 0.0, _number(0.0, unit="USD per million tokens"))
    monthly_budget_usd: float = _var("FLOWOPT_MONTHLY_BUDGET_USD", DEFAULT_MONTHLY_BUDGET_USD, _number(0.0, unit="USD"))
    chromium: str | None = _var("FLOWOPT_CHROMIUM", None, path=True)
    given: frozenset[str] = field(default=frozenset(), compare=False, repr=False)
    from_file: frozenset[str] = field(default=frozenset(), compare=False, repr=False)

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] | None = None) -> Settings:
        """The settings in ``environ`` (default: this process's environment) alone, no project
        settings file (:meth:`load` adds it). Variables flowopt does not know are ignored; unset
        or empty ones take their defaults.

        Raises:
            ValueError: a value does not parse (the message names the variable and the value).
        """
        environ = os.environ if environ is None else environ
        values: dict[str, Any] = {}
        for f in dataclasses.fields(cls):
            if "env" in f.metadata and (raw := environ.get(f.metadata["env"], "")):
                values[f.name] = f.metadata["parse"](f.metadata["env"], raw)
        return cls(**values, given=frozenset(values))

    @classmethod
    def load(cls, environ: Mapping[str, str] | None = None, directory: str | os.PathLike | None = None) -> Settings:
        """The settings of a process started in ``directory`` (default: the working directory):
        each field from its variable in ``environ`` (default: this process's environment) where
        set and non-empty, else from the project settings file ``directory/.flowopt.toml``
        (:func:`read_project_file`) where it has the field's key, else the default.

        Raises:
            ValueError: a variable or a key of the file does not parse, the file is not TOML, or
                it has a key that is no setting or a secret (the message names file and key).
        """
        env = cls.from_environ(environ)
        if env.project_file.lower() == "none":
            return env
        file_values = read_project_file(Path(directory or ".") / env.project_file)
        from_file = {k: v for k, v in file_values.items() if k not in env.given}
        return dataclasses.replace(env, **from_file, given=env.given | frozenset(from_file), from_file=frozenset(from_file))

    def replace(self, **changes: Any) -> Settings:
        """A copy with ``changes`` (field name to value); ``None`` values are ignored, so a caller
        can pass its optional overrides as they are. A changed field counts as set."""
        changes = {k: v for k, v in changes.items() if v is not None}
        return dataclasses.replace(self, **changes, given=self.given | frozenset(changes), from_file=self.from_file - frozenset(changes))

    def is_set(self, name: str) -> bool:
        """Whether field ``name`` came from a set variable, the project settings file or
        :meth:`replace`, not its default."""
        return name in self.given

    def source(self, name: str) -> str:
        """Where field ``name`` came from: ``"environment"`` (a variable, or :meth:`replace`),
        ``"file"`` (the project settings file) or ``"default"``."""
        return "file" if name in self.from_file else "environment" if name in self.given else "default"


def variables() -> dict[str, str]:
    """``{environment variable: Settings field}`` for every variable :class:`Settings` reads."""
    return {f.metadata["env"]: f.name for f in dataclasses.fields(Settings) if "env" in f.metadata}


def read_project_file(path: str | os.PathLike) -> dict[str, Any]:
    """``{field: value}`` of the project settings file at ``path`` (``{}`` when there is none):
    TOML, one ``key = value`` per setting, the key a :class:`Settings` field name (``lake =
    ".demo/lake"``), the value a string, number or boolean parsed as the field's variable would
    be. A relative path is relative to the file's directory.

    Raises:
        ValueError: the file is not TOML; a key is no setting, or a secret (tokens and keys come
            from the environment only); a value does not parse (the message names file and key).
    """
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return {}
    try:
        table = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ValueError(f"{path}: not a settings file (TOML): {exc}") from None
    fields = {f.name: f for f in dataclasses.fields(Settings) if "env" in f.metadata}
    values: dict[str, Any] = {}
    for key, value in table.items():
        f = fields.get(key)
        if f is None:
            allowed = sorted(n for n, g in fields.items() if not g.metadata["secret"])  # what a file may set
            raise ValueError(f"{path}: {key!r} is not a flowopt setting (a file may set: {', '.join(allowed)})")
        if key == "project_file":
            raise ValueError(f"{path}: 'project_file' names the settings file itself; set FLOWOPT_PROJECT_FILE in the environment instead")
        if f.metadata["secret"]:
            raise ValueError(f"{path}: {key!r} is a secret; set {f.metadata['env']} in the environment instead")
        if isinstance(value, bool):
            raw = "true" if value else "false"
        elif isinstance(value, (str, int, float)):
            raw = str(value)
        else:
            raise ValueError(f"{path}: {key} = {value!r}: expected a string, a number or a boolean")
        if raw == "":
            continue  # as an empty variable: the default
        if f.metadata["path"]:
            raw = str(path.parent / Path(raw).expanduser())
        values[key] = f.metadata["parse"](f"{path}: {key}", raw)
    return values


def write_demo_file(directory: str | os.PathLike, values: Mapping[str, str | os.PathLike]) -> Path | None:
    """Write the project settings file of ``flowopt demo`` into ``directory``: ``values`` (field
    name to path) under :data:`DEMO_FILE_HEADER`, each path relative to ``directory`` where it
    lies under it (the checkout can move). Returns the file, or ``None`` when ``directory``
    already holds a project settings file the demo did not write (a person's: left as it is).
    """
    path = Path(directory) / PROJECT_FILE
    if path.exists() and not is_demo_file(path):
        return None
    base = Path(directory).resolve()
    lines = [
        f"{DEMO_FILE_HEADER}: where its state is, for the flowopt and dagster commands run from this directory.",
        "# A variable set in the environment wins over a line here; `make clean` deletes this file,",
        "# the next `flowopt demo` rewrites it. docs/settings.md lists the keys.",
    ]
    for name, value in values.items():
        resolved = Path(value).resolve()
        shown = resolved.relative_to(base) if resolved.is_relative_to(base) else resolved
        lines.append(f"{name} = {json.dumps(str(shown))}")  # a JSON string of a path is a TOML basic string
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("\n".join(lines) + "\n", encoding="utf-8")
    tmp.replace(path)
    return path


def is_demo_file(path: str | os.PathLike) -> bool:
    """Whether the project settings file at ``path`` is one ``flowopt demo`` wrote (its header)."""
    try:
        with open(path, encoding="utf-8") as handle:
            return handle.readline().startswith(DEMO_FILE_HEADER)
    except FileNotFoundError:
        return False


@functools.cache
def process_settings() -> Settings:
    """This process's settings (:meth:`Settings.load`: its environment over the project settings
    file of its working directory), read the first time they are asked for.

    For what is fixed when a module is imported (the sensors' ``minimum_interval_seconds``, set
    by their decorators) and the code location's ``defs``: both then see the same read. Anything
    that can take a :class:`Settings` argument takes one instead.

    Raises:
        ValueError: a value does not parse (:meth:`Settings.load`).
    """
    return Settings.load()


def child_environ(*overrides: Mapping[str, str], **more: str) -> dict[str, str]:
    """The environment for a child process: this process's environment with ``overrides`` and
    ``more`` laid over it (later wins). The process's own environment is never changed (other
    threads read it at any moment; ``tests/test_process_state.py``)."""
    env = dict(os.environ)
    for mapping in (*overrides, more):
        env.update(mapping)
    return env


def main(argv: list[str] | None = None) -> int:
    """``python -m flow_assets.settings [FIELD]``: this directory's settings (:meth:`Settings.load`)
    as JSON ``{field: {"value", "source"}}``, secrets left out; with ``FIELD``, its value alone
    (what ``make ui`` gives Dagster as ``DAGSTER_HOME``). Exit code 2: a bad setting or field."""
    import sys

    argv = sys.argv[1:] if argv is None else argv
    try:
        settings = Settings.load()
    except ValueError as exc:
        print(f"flowopt settings: {exc}", file=sys.stderr)
        return 2
    shown = {f.name: f for f in dataclasses.fields(Settings) if "env" in f.metadata and not f.metadata["secret"]}
    if argv:
        if argv[0] not in shown:
            print(f"flowopt settings: no setting {argv[0]!r} (known: {', '.join(shown)})", file=sys.stderr)
            return 2
        print(getattr(settings, argv[0]) if getattr(settings, argv[0]) is not None else "")
        return 0
    print(json.dumps({name: {"value": getattr(settings, name), "source": settings.source(name)} for name in shown}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
