"""One config per component: Dagster run configs generated from the pure dataclasses.

Every component's settings are one frozen dataclass in its pure module (``GRPOTrainerConfig``,
``GateConfig``, ``CreditConfig`` ...), the single source of each field's type, default and
documentation (its docstring's ``Attributes:`` section). :func:`dagster_config` turns such a
dataclass into a Dagster ``Config`` class with the same fields, types (``Literal`` choices
stay enums in the launchpad), defaults and descriptions, and a ``to_pure()`` method that gives
the dataclass back; an asset adds only the fields that are not the component's (e.g. a round's
``negate_advantages``) by subclassing it.
"""

from __future__ import annotations

import dataclasses
import re
import typing
from collections.abc import Mapping
from typing import Any, Literal

from dagster import Config
from pydantic import Field, create_model

_ATTRIBUTE = re.compile(r"^(\s*)([A-Za-z_][\w]*(?:\s*/\s*[A-Za-z_][\w]*)*):\s+(.*)$")


def field_docs(cls: type) -> dict[str, str]:
    """Field name -> description, from the ``Attributes:`` section of ``cls``'s docstring
    (Google style; ``a / b: text`` documents both ``a`` and ``b``; continuation lines are joined)."""
    doc = cls.__doc__ or ""
    if "Attributes:" not in doc:
        return {}
    docs: dict[str, str] = {}
    current: list[str] = []
    indent = None
    for line in doc.split("Attributes:", 1)[1].splitlines():
        match = _ATTRIBUTE.match(line)
        if match and (indent is None or len(match.group(1)) <= indent):
            indent = len(match.group(1))
            current = [n.strip() for n in match.group(2).split("/")]
            for name in current:
                docs[name] = match.group(3).strip()
        elif line.strip() and current:
            for name in current:
                docs[name] += " " + line.strip()
        elif not line.strip() and docs:
            current = []
    return docs


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
            value = _to_pure(hint, value if isinstance(value, Mapping) else value.model_dump())
        elif typing.get_origin(hint) is tuple and isinstance(value, list):
            value = tuple(value)
        elif isinstance(value, Mapping) and typing.get_origin(hint) in (Mapping, dict):
            value = {k: tuple(v) if isinstance(v, list) else v for k, v in value.items()}
        kwargs[f.name] = value
    return cls(**kwargs)


def dagster_config(cls: type, name: str | None = None, exclude: tuple[str, ...] = (), doc: str | None = None) -> type[Config]:
    """A Dagster ``Config`` class mirroring the dataclass ``cls`` (module docstring).

    Nested dataclass fields become nested ``Config`` classes; tuples become lists. The generated
    class has ``to_pure(**overrides) -> cls``.

    Raises:
        TypeError: ``cls`` is not a dataclass.
    """
    if not dataclasses.is_dataclass(cls):
        raise TypeError(f"{cls!r} is not a dataclass")
    hints = typing.get_type_hints(cls)
    docs = field_docs(cls)
    fields: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        if f.name in exclude:
            continue
        hint = hints[f.name]
        description = docs.get(f.name, "")
        if dataclasses.is_dataclass(hint):
            nested = dagster_config(hint)
            fields[f.name] = (nested, Field(default_factory=nested, description=description))
            continue
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        if isinstance(default, tuple):
            default = list(default)
        if isinstance(default, Mapping):
            default = {k: list(v) if isinstance(v, tuple) else v for k, v in default.items()}
            fields[f.name] = (_dagster_type(hint), Field(default_factory=lambda d=default: dict(d), description=description))
        elif isinstance(default, list):
            fields[f.name] = (_dagster_type(hint), Field(default_factory=lambda d=default: list(d), description=description))
        else:
            fields[f.name] = (_dagster_type(hint), Field(default, description=description))

    def to_pure(self, **overrides: Any):
        """The pure config these fields describe (``overrides`` replace fields)."""
        values = {k: getattr(self, k) for k in type(self).model_fields}
        values.update(overrides)
        return _to_pure(cls, values)

    model = create_model(name or f"{cls.__name__}Config", __base__=Config, __doc__=doc or cls.__doc__, **fields)
    model.to_pure = to_pure
    return model
