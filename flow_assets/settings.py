"""flowopt's settings: every environment variable flowopt reads, parsed in one place.

:class:`Settings` is a frozen object read once at start-up (the CLI's ``main``, the code
location's ``defs``, a test's own mapping) and passed to what needs it. This module is the only
one in ``flow_assets``, ``resources`` and ``sensors`` that touches ``os.environ``
(``tests/test_settings.py`` enforces it); the variables, their types and defaults are listed in
``docs/settings.md``. Each default is stated here once: resources and CLI options that have the
same default import the constant.

A variable that is unset or empty takes its default. A value that does not parse raises
``ValueError`` naming the variable and the value, when the settings are read, not later in a run.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
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

#: the judge's bearer key; Dagster reads it itself (``EnvVar``) so that it never enters run config
JUDGE_API_KEY_VAR = "FLOWOPT_JUDGE_API_KEY"

_TRUE, _FALSE = ("1", "true", "on", "yes"), ("0", "false", "off", "no")


def _text(var: str, raw: str) -> str:
    return raw


def _tokens(var: str, raw: str) -> tuple[str, ...]:
    return tuple(t.strip() for t in raw.split(",") if t.strip())


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


def _var(name: str, default: Any, parse: Callable[[str, str], Any] = _text, **kwargs) -> Any:
    """A settings field read from environment variable ``name``."""
    return field(default=default, metadata={"env": name, "parse": parse}, **kwargs)


@dataclass(frozen=True)
class Settings:
    """Every setting flowopt reads from the environment (``docs/settings.md`` says what each
    changes and who reads it). Build it with :meth:`from_environ`; a test or a caller that wants
    other values builds it with keywords (the defaults are the same) or :meth:`replace`.

    Attributes (variable in brackets; paths relative to the working directory):
        lake: the Parquet lake [FLOWOPT_LAKE].
        landing: the landing directory of log files [FLOWOPT_LANDING].
        models: base model, adapters, checkpoints, registry [FLOWOPT_MODELS].
        workflows: workflow definitions, proposals, review audit log [FLOWOPT_WORKFLOWS].
        exports: where the API writes trajectory exports [FLOWOPT_EXPORTS].
        dagster_home: the Dagster instance's directory [DAGSTER_HOME].
        base_model: a local model directory to train instead of the tiny one [FLOWOPT_BASE_MODEL].
        tasks: the task-source kind of the trainable agent [FLOWOPT_TASKS].
        settle_seconds: seconds a landed file must stay unmodified before the sensor reads it
            [FLOWOPT_SETTLE_SECONDS], >= 0.
        sensor_interval_seconds: least seconds between two evaluations of a sensor
            [FLOWOPT_SENSOR_INTERVAL_SECONDS], >= 1.
        self_play_rounds: rounds the self-play sensor runs on its own, 0 = off
            [FLOWOPT_SELF_PLAY_ROUNDS].
        run_config: JSON file ``{job name: run config}`` the sensors launch runs with
            [FLOWOPT_RUN_CONFIG].
        tracking: experiment tracking target, ``""`` = off [FLOWOPT_TRACKING].
        live_ab: whether a gated candidate enters live A/B as challenger [FLOWOPT_LIVE_AB].
        live_ab_share: the challenger's share of sessions, in (0, 1) [FLOWOPT_LIVE_AB_SHARE].
        judge_url, judge_model, judge_mode, judge_cache: the scoring agent [FLOWOPT_JUDGE_*].
        judge_api_key: the judge's bearer key [FLOWOPT_JUDGE_API_KEY]; kept out of ``repr``.
        amqp_url: the RabbitMQ broker [FLOWOPT_AMQP_URL].
        api_tokens: bearer tokens of ``flowopt api`` [FLOWOPT_API_TOKENS, comma-separated].
        gateway_tokens: bearer tokens of ``flowopt serve`` [FLOWOPT_GATEWAY_TOKENS, comma-separated].
        dagster_url: the webserver ``flowopt api`` submits runs through [FLOWOPT_DAGSTER_URL].
        policy_input_usd_per_mtok / policy_output_usd_per_mtok: what the policy's prompt /
            completion tokens cost, USD per million, >= 0 [FLOWOPT_POLICY_*_USD_PER_MTOK].
        monthly_budget_usd: an API job's default budget, USD per agent per calendar month, >= 0
            [FLOWOPT_MONTHLY_BUDGET_USD].
        chromium: a Chromium-family browser for ``flowopt ui-tour`` [FLOWOPT_CHROMIUM].
        given: the fields whose variable was set (non-empty), e.g. to tell "unset" from "set to
            the default" (:meth:`is_set`).
    """

    lake: str = _var("FLOWOPT_LAKE", DEFAULT_LAKE)
    landing: str = _var("FLOWOPT_LANDING", DEFAULT_LANDING)
    models: str = _var("FLOWOPT_MODELS", DEFAULT_MODELS)
    workflows: str = _var("FLOWOPT_WORKFLOWS", DEFAULT_WORKFLOWS)
    exports: str = _var("FLOWOPT_EXPORTS", DEFAULT_EXPORTS)
    dagster_home: str = _var("DAGSTER_HOME", DEFAULT_DAGSTER_HOME)
    base_model: str | None = _var("FLOWOPT_BASE_MODEL", None)
    tasks: str = _var("FLOWOPT_TASKS", "calculator")
    settle_seconds: float = _var("FLOWOPT_SETTLE_SECONDS", DEFAULT_SETTLE_SECONDS, _number(0.0, unit="seconds"))
    sensor_interval_seconds: int = _var("FLOWOPT_SENSOR_INTERVAL_SECONDS", DEFAULT_SENSOR_INTERVAL_SECONDS, _count(1))
    self_play_rounds: int = _var("FLOWOPT_SELF_PLAY_ROUNDS", 0, _count(0))
    run_config: str | None = _var("FLOWOPT_RUN_CONFIG", None)
    tracking: str = _var("FLOWOPT_TRACKING", "")
    live_ab: bool = _var("FLOWOPT_LIVE_AB", False, _flag)
    live_ab_share: float = _var("FLOWOPT_LIVE_AB_SHARE", 0.1, _number(0.0, 1.0, open_low=True))
    judge_url: str = _var("FLOWOPT_JUDGE_URL", "")
    judge_model: str = _var("FLOWOPT_JUDGE_MODEL", "")
    judge_mode: str = _var("FLOWOPT_JUDGE_MODE", "relative", _choice("relative", "absolute"))
    judge_cache: str = _var("FLOWOPT_JUDGE_CACHE", DEFAULT_JUDGE_CACHE)
    judge_api_key: str | None = _var(JUDGE_API_KEY_VAR, None, repr=False)
    amqp_url: str = _var("FLOWOPT_AMQP_URL", DEFAULT_AMQP_URL)
    api_tokens: tuple[str, ...] = _var("FLOWOPT_API_TOKENS", (), _tokens, repr=False)
    gateway_tokens: tuple[str, ...] = _var("FLOWOPT_GATEWAY_TOKENS", (), _tokens, repr=False)
    dagster_url: str = _var("FLOWOPT_DAGSTER_URL", DEFAULT_DAGSTER_URL)
    policy_input_usd_per_mtok: float = _var("FLOWOPT_POLICY_INPUT_USD_PER_MTOK", 0.0, _number(0.0, unit="USD per million tokens"))
    policy_output_usd_per_mtok: float = _var("FLOWOPT_POLICY_OUTPUT_USD_PER_MTOK", 0.0, _number(0.0, unit="USD per million tokens"))
    monthly_budget_usd: float = _var("FLOWOPT_MONTHLY_BUDGET_USD", DEFAULT_MONTHLY_BUDGET_USD, _number(0.0, unit="USD"))
    chromium: str | None = _var("FLOWOPT_CHROMIUM", None)
    given: frozenset[str] = field(default=frozenset(), compare=False, repr=False)

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] | None = None) -> Settings:
        """The settings in ``environ`` (default: this process's environment). Variables flowopt
        does not know are ignored; unset or empty ones take their defaults.

        Raises:
            ValueError: a value does not parse (the message names the variable and the value).
        """
        environ = os.environ if environ is None else environ
        values: dict[str, Any] = {}
        for f in dataclasses.fields(cls):
            if "env" in f.metadata and (raw := environ.get(f.metadata["env"], "")):
                values[f.name] = f.metadata["parse"](f.metadata["env"], raw)
        return cls(**values, given=frozenset(values))

    def replace(self, **changes: Any) -> Settings:
        """A copy with ``changes`` (field name to value); ``None`` values are ignored, so a caller
        can pass its optional overrides as they are. A changed field counts as set."""
        changes = {k: v for k, v in changes.items() if v is not None}
        return dataclasses.replace(self, **changes, given=self.given | frozenset(changes))

    def is_set(self, name: str) -> bool:
        """Whether field ``name`` came from a set variable (or :meth:`replace`), not its default."""
        return name in self.given


def variables() -> dict[str, str]:
    """``{environment variable: Settings field}`` for every variable :class:`Settings` reads."""
    return {f.metadata["env"]: f.name for f in dataclasses.fields(Settings) if "env" in f.metadata}


@functools.cache
def process_settings() -> Settings:
    """This process's settings, read from its environment the first time they are asked for.

    For what is fixed when a module is imported (the sensors' ``minimum_interval_seconds``, set
    by their decorators) and the code location's ``defs``: both then see the same read. Anything
    that can take a :class:`Settings` argument takes one instead.

    Raises:
        ValueError: a value does not parse (:meth:`Settings.from_environ`).
    """
    return Settings.from_environ()


def child_environ(*overrides: Mapping[str, str], **more: str) -> dict[str, str]:
    """The environment for a child process: this process's environment with ``overrides`` and
    ``more`` laid over it (later wins). The process's own environment is never changed (other
    threads read it at any moment; ``tests/test_process_state.py``)."""
    env = dict(os.environ)
    for mapping in (*overrides, more):
        env.update(mapping)
    return env
