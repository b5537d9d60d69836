"""One config per component: Dagster run configs generated from the pure dataclasses.

Every component's settings are one frozen dataclass in its pure module (``GRPOTrainerConfig``,
``GateConfig``, ``CreditConfig`` ...), the single source of each field's name, type, default and
description. The description is the field's ``metadata["description"]``, the standard library's
place for data about a field (``dataclasses.field(metadata=...)``)::

    epsilon: float = field(default=0.2, metadata={"description": "lower clip range ..."})

:func:`dagster_config` turns such a dataclass into a Dagster ``Config`` class with the same
fields, types (``Literal`` choices stay enums in the launchpad), defaults and descriptions. The
class derives from :class:`PureConfig`, whose :meth:`PureConfig.to_pure` (a plain method, no
arguments) gives the dataclass back; an asset adds only the fields that are not the component's
(e.g. a round's ``negate_advantages``) by subclassing it. :func:`run_config_values` goes the other
way, from a dataclass to the run-config values that differ from its defaults (the builders of run
configs, e.g. :func:`flow_assets.training.run_config.round_run_config`, use it).

Why generated classes rather than frozen pydantic models as the pure configs: a ``Config`` field
must be a Dagster-resolvable type, and a nested model must itself subclass ``Config`` (Dagster's
"Advanced config types" guide nests ``Config`` classes; with Dagster 1.13.27 a plain pydantic
``BaseModel`` field fails with ``DagsterInvalidConfigDefinitionError: ... cannot be resolved``,
"Custom data classes extending dagster.Config"), so pydantic pure configs would have to import
Dagster, which the pure modules (``rl/``, ``policy/``, ``workflows/``) must not; and the training
code compares, hashes and ``dataclasses.replace``-s them. Generating the ``Config`` side from the
dataclass keeps the pure side free of Dagster with one declaration per field.

Renamed fields: a dataclass may declare ``RENAMED: ClassVar[dict[str, str]]`` (old name -> new
name). A run config that still uses an old name is refused with a ``ValueError`` that names the
new field (not silently mapped: a saved config is then fixed once, and no alias lives on).
"""

from __future__ import annotations

import dataclasses
import typing
from collections.abc import Mapping
from typing import Any, ClassVar, Generic, Literal, TypeVar

from dagster import Config
from pydantic import ConfigDict, Field, create_model, model_validator

P = TypeVar("P")

#: the key of a field's description in ``dataclasses.field(metadata=...)``
DESCRIPTION = "description"


def description(f: dataclasses.Field) -> str:
    """The documented description of dataclass field ``f``.

    Raises:
        TypeError: the field has no ``metadata["description"]`` (every config field is documented).
    """
    text = f.metadata.get(DESCRIPTION)
    if not text:
        raise TypeError(f"config field {f.name!r} has no metadata['description']")
    return text


def renamed_fields(cls: type, values: Mapping[str, Any], path: str = "") -> list[str]:
    """``"old -> new"`` for each old field name in ``values`` (nested configs included), from the
    ``RENAMED`` tables of ``cls`` and its nested dataclasses; ``path`` prefixes the names."""
    found = [f"{path}{old} -> {path}{new}" for old, new in getattr(cls, "RENAMED", {}).items() if old in values]
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        nested = values.get(f.name)
        if dataclasses.is_dataclass(hints[f.name]) and isinstance(nested, Mapping):
            found += renamed_fields(hints[f.name], nested, f"{path}{f.name}.")
    return found


def refuse_renamed(cls: type, values: Mapping[str, Any], where: str = "run config") -> None:
    """Raise if ``values`` (run-config data of ``cls``) uses a renamed field.

    Raises:
        ValueError: naming each old field and its new name.
    """
    if found := renamed_fields(cls, values):
        raise ValueError(f"{where}: renamed field(s) {', '.join(found)} (TRL's names); use the new name(s)")


class PureConfig(Config, Generic[P]):
    """Base of the generated Dagster configs: the fields of the dataclass ``__pure__`` and
    :meth:`to_pure`, which builds it. Fields a subclass adds (not the dataclass's) are ignored by
    :meth:`to_pure`; fields left out of the generated class get the dataclass's default."""

    # unknown fields are refused, not dropped: a client's typo must not train with a default
    model_config = ConfigDict(extra="forbid")

    __pure__: ClassVar[type]

    @model_validator(mode="before")
    @classmethod
    def _refuse_renamed(cls, data: Any) -> Any:
        if isinstance(data, Mapping) and hasattr(cls, "__pure__"):
            refuse_renamed(cls.__pure__, data, cls.__name__)
        return data

    def to_pure(self) -> P:
        """The pure config these fields describe.

        Raises:
            ValueError: the dataclass refuses the values (its ``__post_init__`` checks).
        """
        return _to_pure(type(self).__pure__, {k: getattr(self, k) for k in type(self).model_fields})


def _dagster_type(annotation: Any) -> Any:
    origin = typing.get_origin(annotation)
    if origin is tuple:
        args = typing.get_args(annotation)
        if args and typing.get_origin(args[0]) is Literal:
            # Dagster resolves a Literal field but not a list of them: the dataclass checks the values
            return list[str]
        return list[args[0]] if args else list
    if origin in (Mapping, dict) or annotation is Mapping:
        args = typing.get_args(annotation)
        return dict[args[0], _dagster_type(args[1])] if args else dict
    return annotation


def _to_pure(cls: type, values: Mapping[str, Any]) -> Any:
    hints = typing.get_type_hints(cls)
    kwargs = {}
    for f in dataclasses.fields(cls):
        if f.name not in values:
            continue
        value = values[f.name]
        hint = hints[f.name]
        if dataclasses.is_dataclass(hint):
            value = _to_pure(hint, value if isinstance(value, Mapping) else {k: getattr(value, k) for k in type(value).model_fields})
        elif typing.get_origin(hint) is tuple and isinstance(value, list):
            value = tuple(value)
        elif isinstance(value, Mapping) and typing.get_origin(hint) in (Mapping, dict):
            value = {k: tuple(v) if isinstance(v, list) else v for k, v in value.items()}
        kwargs[f.name] = value
    return cls(**kwargs)


def _run_config_value(value: Any) -> Any:
    if isinstance(value, tuple):
        return list(value)
    if isinstance(value, Mapping):
        return {k: _run_config_value(v) for k, v in value.items()}
    return value


def run_config_values(pure: Any, exclude: tuple[str, ...] = ()) -> dict[str, Any]:
    """The run-config data of dataclass instance ``pure``: the fields whose value differs from the
    dataclass's default (nested configs: only their changed fields; tuples as lists), so a run
    config names what was chosen and every default stays in the dataclass.

    Raises:
        TypeError: ``pure`` is not a dataclass instance.
        ValueError: an ``exclude``-d field is not at its default (the run config cannot carry it).
    """
    if not dataclasses.is_dataclass(pure) or isinstance(pure, type):
        raise TypeError(f"{pure!r} is not a dataclass instance")
    hints = typing.get_type_hints(type(pure))
    out: dict[str, Any] = {}
    for f in dataclasses.fields(pure):
        value = getattr(pure, f.name)
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        if value == default:
            continue
        if f.name in exclude:
            raise ValueError(f"{type(pure).__name__}.{f.name} is not part of the run config (got {value!r})")
        out[f.name] = run_config_values(value) if dataclasses.is_dataclass(hints[f.name]) else _run_config_value(value)
    return out


def dagster_config(cls: type[P], name: str | None = None, exclude: tuple[str, ...] = (), doc: str | None = None) -> type[PureConfig[P]]:
    """A :class:`PureConfig` subclass mirroring the dataclass ``cls`` (module docstring).

    Nested dataclass fields become nested generated classes; tuples become lists; ``exclude``-d
    fields are left out (``to_pure`` gives them the dataclass's default).

    Raises:
        TypeError: ``cls`` is not a dataclass, or a field has no description.
    """
    if not dataclasses.is_dataclass(cls):
        raise TypeError(f"{cls!r} is not a dataclass")
    hints = typing.get_type_hints(cls)
    fields: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        if f.name in exclude:
            continue
        hint = hints[f.name]
        text = description(f)
        if dataclasses.is_dataclass(hint):
            nested = dagster_config(hint)
            fields[f.name] = (nested, Field(default_factory=nested, description=text))
            continue
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        if isinstance(default, tuple):
            default = list(default)
        if isinstance(default, Mapping):
            default = {k: list(v) if isinstance(v, tuple) else v for k, v in default.items()}
            fields[f.name] = (_dagster_type(hint), Field(default_factory=lambda d=default: dict(d), description=text))
        elif isinstance(default, list):
            fields[f.name] = (_dagster_type(hint), Field(default_factory=lambda d=default: list(d), description=text))
        else:
            fields[f.name] = (_dagster_type(hint), Field(default, description=text))
    model = create_model(name or f"{cls.__name__}Config", __base__=PureConfig, __doc__=doc or cls.__doc__, **fields)
    model.__pure__ = cls
    return model
