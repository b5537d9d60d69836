"""Log formats from outside flowopt: a parser registered as an entry point (or in code).

A format is an object (a module, a class, an instance) with two functions:

- ``detect(path: Path) -> bool``: whether the file is in this format (read as little as needed;
  :func:`flow_assets.logs.formats.common.open_log` opens gzip and skips a BOM for you);
- ``parse(path: Path, *, max_record_bytes: int) -> RecordStream``: its records as canonical
  trajectories, bad ones quarantined; build the stream with
  :func:`~flow_assets.logs.formats.common.stream_jsonl` (one record per line) or
  :func:`~flow_assets.logs.formats.common.load_document` +
  :func:`~flow_assets.logs.formats.common.stream_elements` (one JSON document), giving each a
  converter from one raw record to a :class:`~flow_assets.logs.schema.Trajectory`.

A package makes it available to every flowopt command and to the code location by declaring an
entry point in the group :data:`ENTRY_POINT_GROUP`; its name is the format's name (usable with
``--format`` and in the landing resource's ``formats``)::

    [project.entry-points."flowopt.log_formats"]
    swe-agent = "my_package.swe_agent_format"

Detection tries the built-in formats first, then each plug-in's ``detect`` in name order.
docs/log-format.md, section 7, has a worked example (SWE-agent ``.traj`` files).

Three formats that ship with flowopt use this same protocol (:data:`BUILTIN_PLUGINS`: OpenAI
chat messages, Anthropic Messages, OpenTelemetry GenAI spans). They are declared here, in code,
not as entry points of flowopt's own ``pyproject.toml``: an entry point exists only once the
package's metadata is reinstalled, so an environment installed before they were added (or a
checkout run from ``PYTHONPATH``) would silently lack them; declared here, they load exactly as an
entry point is loaded (import the module, check ``detect``/``parse``) wherever flowopt runs.
"""

from __future__ import annotations

import importlib
import importlib.metadata
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ENTRY_POINT_GROUP = "flowopt.log_formats"

BUILTIN_PLUGINS: dict[str, str] = {
    "anthropic-messages": "flow_assets.logs.formats.anthropic_messages",
    "openai-chat": "flow_assets.logs.formats.openai_messages",
    "otel-genai": "flow_assets.logs.formats.otel_genai",
}
"""Formats shipped with flowopt through the plug-in protocol: name -> module with ``detect`` and
``parse`` (module docstring says why they are not entry points). Their ``detect`` functions
exclude one another, so name order does not decide between them."""


class PluginFormatError(RuntimeError):
    """A plug-in format cannot be loaded or does not have ``detect`` and ``parse``; the message
    names the entry point and what is wrong."""


@dataclass(frozen=True)
class LogFormat:
    """A log format from outside flowopt: ``name``, ``detect(path) -> bool`` and
    ``parse(path, *, max_record_bytes) -> RecordStream`` (module docstring); ``origin`` says where
    it came from (the entry point's value, or ``"registered in code"``)."""

    name: str
    detect: Callable[[Path], bool]
    parse: Callable[..., Any]
    origin: str
    builtin: bool = False


_REGISTERED: dict[str, LogFormat] = {}


def _as_format(name: str, obj: Any, origin: str, builtin: bool = False) -> LogFormat:
    detect, parse = getattr(obj, "detect", None), getattr(obj, "parse", None)
    if not callable(detect) or not callable(parse):
        raise PluginFormatError(f"log format {name!r} ({origin}) needs callable 'detect' and 'parse'")
    return LogFormat(name, detect, parse, origin, builtin)


def register_format(name: str, detect: Callable[[Path], bool], parse: Callable[..., Any]) -> LogFormat:
    """Make a format available in this process without packaging it (tests, notebooks).

    Raises:
        PluginFormatError: ``detect`` or ``parse`` is not callable.
    """
    fmt = _as_format(name, type("Format", (), {"detect": staticmethod(detect), "parse": staticmethod(parse)}), "registered in code")
    _REGISTERED[name] = fmt
    return fmt


def unregister_format(name: str) -> None:
    """Forget a format :func:`register_format` added (no error if absent)."""
    _REGISTERED.pop(name, None)


def plugin_formats() -> dict[str, LogFormat]:
    """Every plug-in format, by name, sorted: flowopt's :data:`BUILTIN_PLUGINS`, the entry
    points of :data:`ENTRY_POINT_GROUP` installed in this environment, then those registered in
    code (later ones win on a name clash, so a package may replace a built-in one).

    Raises:
        PluginFormatError: an entry point does not import or lacks ``detect``/``parse``.
    """
    found: dict[str, LogFormat] = {
        name: _as_format(name, importlib.import_module(module), f"built in: {module}", builtin=True)
        for name, module in BUILTIN_PLUGINS.items()
    }
    for entry in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
        try:
            obj = entry.load()
        except Exception as exc:  # a third party's import error: say which plug-in
            raise PluginFormatError(f"log format plug-in {entry.name!r} ({entry.value}) failed to load: {exc!r}") from exc
        found[entry.name] = _as_format(entry.name, obj, entry.value)
    found.update(_REGISTERED)
    return dict(sorted(found.items()))
