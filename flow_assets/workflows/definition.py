"""An agent's workflow definition (format ``flowopt.workflow/v1``) and the versioned store of them.

A workflow is the ordered list of steps an agent is meant to take, each naming the tool it calls,
its fixed parameters, an optional condition and whether it may be skipped (``docs/workflows.md``
documents every field). :class:`WorkflowStore` keeps one file per agent in a directory
(``FLOWOPT_WORKFLOWS``, default ``.workflows``)::

    <root>/<agent file>.json                     the current definition of one agent
    <root>/history/<agent file>/v000001.json     every version ever saved, the current one included
    <root>/.lock                                 held by every read-modify-write (filelock)

Every change is a new version; earlier versions are never rewritten. Each file is written to a
temporary name in its directory, fsync'ed and moved over the old one with ``os.replace``, so a
reader sees the old or the new definition, never half of one.
"""

from __future__ import annotations

import hashlib
import os
import re
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Literal

from filelock import FileLock
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from flow_assets.core.atomic import write_json_atomic
from flow_assets.settings import DEFAULT_WORKFLOWS

WORKFLOW_FORMAT = "flowopt.workflow/v1"
#: where the workflow directory is when no argument names one (``FLOWOPT_WORKFLOWS``, :mod:`flow_assets.settings`)
DEFAULT_ROOT = DEFAULT_WORKFLOWS


class WorkflowError(RuntimeError):
    """The store cannot do what was asked: an unknown agent or version, an unreadable file."""


class StaleVersion(WorkflowError):
    """A change was based on a version that is no longer the current one."""


class WorkflowStep(BaseModel):
    """One step of a workflow: a call of ``tool`` with fixed ``parameters``, taken when
    ``condition`` holds (``None``: always), skippable when ``optional``.

    Raises:
        pydantic.ValidationError: an empty ``id`` or ``tool``, an unknown field.
    """

    model_config = ConfigDict(extra="forbid")

    id: str = Field(min_length=1, description="unique within the workflow; JSON Patch paths address steps by position, proposals test this id first")
    tool: str = Field(min_length=1, description="the tool the step calls, as logged in steps.tool")
    parameters: dict[str, Any] = Field(default_factory=dict, description="arguments the workflow fixes for every call (any JSON)")
    condition: str | None = Field(None, description="when the step is taken, as the agent's own text or expression; null: always")
    optional: bool = Field(False, description="the agent may skip the step")
    description: str | None = Field(None, description="free text for people; derived definitions say what the logs showed")


class WorkflowChange(BaseModel):
    """Why a version exists: who saved it, when (ISO 8601 UTC), why, and the approved proposal it
    applies (``None`` for a definition registered directly)."""

    model_config = ConfigDict(extra="forbid")

    at: str
    by: str
    reason: str
    proposal_id: str | None = None
    previous_version: int | None = None


class WorkflowDefinition(BaseModel):
    """The workflow of one agent at one version (format :data:`WORKFLOW_FORMAT`).

    ``version`` and ``change`` are set by :class:`WorkflowStore` when a version is saved; a
    definition built by hand or derived from logs carries ``version=1`` until then.

    Raises:
        pydantic.ValidationError: two steps with the same ``id``, a ``version`` below 1, an
            unknown field or format.
    """

    model_config = ConfigDict(extra="forbid")

    format: Literal["flowopt.workflow/v1"] = WORKFLOW_FORMAT
    agent_id: str = Field(min_length=1)
    version: int = Field(1, ge=1)
    steps: list[WorkflowStep]
    metadata: dict[str, Any] = Field(default_factory=dict, description="free provenance, e.g. what a derived definition was derived from")
    change: WorkflowChange | None = None

    @model_validator(mode="after")
    def _unique_step_ids(self) -> WorkflowDefinition:
        seen: set[str] = set()
        for step in self.steps:
            if step.id in seen:
                raise ValueError(f"two steps have the id {step.id!r}")
            seen.add(step.id)
        return self

    def document(self) -> dict[str, Any]:
        """The definition as the JSON document its file holds (and JSON Patch paths address)."""
        return self.model_dump(mode="json")

    def step_position(self, step_id: str) -> int:
        """0-based position of the step ``step_id``.

        Raises:
            KeyError: no step has that id.
        """
        for position, step in enumerate(self.steps):
            if step.id == step_id:
                return position
        raise KeyError(step_id)


def utc_now() -> str:
    """The current time as ISO 8601 UTC with seconds (``2026-03-01T12:00:00Z``)."""
    return datetime.now(timezone.utc).replace(microsecond=0).isoformat().replace("+00:00", "Z")


_UNSAFE = re.compile(r"[^A-Za-z0-9._-]+")


def agent_file_stem(agent_id: str) -> str:
    """The file name (without ``.json``) of ``agent_id``'s workflow: the id itself where it is a
    safe file name, else its safe characters plus 8 hex of its sha256 (so ``a:b`` and ``a/b`` do
    not share a file)."""
    safe = _UNSAFE.sub("_", agent_id).strip("._") or "agent"
    if safe == agent_id:
        return agent_id
    return f"{safe[:100]}~{hashlib.sha256(agent_id.encode()).hexdigest()[:8]}"


def resolve_root(root: str | os.PathLike | None = None) -> Path:
    """The workflow directory: ``root`` when given, else :data:`DEFAULT_ROOT`, relative to the
    working directory (as the models directory is). ``FLOWOPT_WORKFLOWS`` reaches it through the
    caller's settings (``Settings.workflows``)."""
    return Path(root or DEFAULT_ROOT)


class WorkflowStore:
    """The versioned workflow definitions of a directory (module docstring for the layout).

    Args:
        root: the directory; created on the first write.
    """

    def __init__(self, root: str | os.PathLike | None = None):
        self.root = resolve_root(root)
        self._lock: FileLock | None = None

    @contextmanager
    def locked(self) -> Iterator[None]:
        """Hold the directory's inter-process lock (re-entrant in this object): every
        read-modify-write of definitions, proposals and the audit log runs under it."""
        if self._lock is None:
            self.root.mkdir(parents=True, exist_ok=True)
            self._lock = FileLock(str(self.root / ".lock"))
        with self._lock:
            yield

    def path(self, agent_id: str) -> Path:
        """The current definition file of ``agent_id``."""
        return self.root / f"{agent_file_stem(agent_id)}.json"

    def _history_dir(self, agent_id: str) -> Path:
        return self.root / "history" / agent_file_stem(agent_id)

    def _read(self, path: Path) -> WorkflowDefinition:
        try:
            return WorkflowDefinition.model_validate_json(path.read_bytes())
        except (OSError, ValidationError) as error:
            raise WorkflowError(f"{path}: not a {WORKFLOW_FORMAT} definition: {error}") from None

    def agents(self) -> list[str]:
        """The agent ids with a definition, sorted.

        Raises:
            WorkflowError: a definition file is unreadable (named).
        """
        if not self.root.is_dir():
            return []
        return sorted(self._read(p).agent_id for p in self.root.glob("*.json"))

    def current(self, agent_id: str) -> WorkflowDefinition | None:
        """``agent_id``'s current definition, ``None`` if it has none.

        Raises:
            WorkflowError: the file is unreadable or holds another agent's workflow.
        """
        path = self.path(agent_id)
        if not path.exists():
            return None
        definition = self._read(path)
        if definition.agent_id != agent_id:
            raise WorkflowError(f"{path}: holds the workflow of {definition.agent_id!r}, not {agent_id!r}")
        return definition

    def versions(self, agent_id: str) -> list[int]:
        """The versions kept for ``agent_id``, ascending (empty if none)."""
        folder = self._history_dir(agent_id)
        return sorted(int(p.stem[1:]) for p in folder.glob("v*.json")) if folder.is_dir() else []

    def get(self, agent_id: str, version: int) -> WorkflowDefinition:
        """``agent_id``'s definition at ``version``.

        Raises:
            WorkflowError: no such version, or its file is unreadable.
        """
        path = self._history_dir(agent_id) / f"v{version:06d}.json"
        if not path.exists():
            raise WorkflowError(f"{agent_id!r} has no workflow version {version} (kept: {self.versions(agent_id)})")
        return self._read(path)

    def save(
        self,
        definition: WorkflowDefinition,
        *,
        by: str,
        reason: str,
        base_version: int | None,
        proposal_id: str | None = None,
    ) -> WorkflowDefinition:
        """Save ``definition``'s steps and metadata as the next version of its agent and return
        what was saved (``version`` and ``change`` filled in).

        ``base_version`` is the version the change was made against (``None``: the agent has no
        definition yet); the save is refused unless it is still the current one, so two reviews
        cannot silently overwrite each other.

        Raises:
            StaleVersion: the current version is not ``base_version``.
            WorkflowError: the current file is unreadable.
        """
        with self.locked():
            current = self.current(definition.agent_id)
            now = current.version if current else None
            if now != base_version:
                raise StaleVersion(
                    f"{definition.agent_id!r}: the change was made against "
                    f"{'version ' + str(base_version) if base_version else 'no definition'}, "
                    f"but the current version is {now if now is not None else 'none'}"
                )
            version = (now or 0) + 1
            change = WorkflowChange(at=utc_now(), by=by, reason=reason, proposal_id=proposal_id, previous_version=now)
            saved = definition.model_copy(update={"version": version, "change": change})
            document = saved.document()
            # the history file first: a crash between the two leaves the old current version,
            # and the next save writes this version number again
            write_json_atomic(self._history_dir(definition.agent_id) / f"v{version:06d}.json", document)
            write_json_atomic(self.path(definition.agent_id), document)
            return saved

    def register(self, definition: WorkflowDefinition, *, by: str, reason: str) -> tuple[WorkflowDefinition, bool]:
        """``definition`` as version 1 of its agent if the agent has no definition yet.

        Returns:
            ``(the current definition, whether this call created it)``; an existing definition is
            returned untouched.

        Raises:
            WorkflowError: the current file is unreadable.
        """
        with self.locked():
            current = self.current(definition.agent_id)
            if current is not None:
                return current, False
            return self.save(definition, by=by, reason=reason, base_version=None), True
