"""The adapter registry: which LoRA adapter is the champion, and how it got there.

One JSON file (``<root>/registry.json``) holds the champion, the full history of promotions and
rollbacks, and the latest round's candidate. Every write goes to a temporary file in the same
directory, is fsync'ed, and is moved over the old file with ``os.replace``; a crash at any point
leaves either the old registry or the new one, never a torn file.

Every read-modify-write holds an inter-process lock (``<root>/registry.json.lock``, ``filelock``),
so concurrent promotions from several processes all land in the history. Each history event is
also written, before ``registry.json``, as its own file ``<root>/history/<seq>.json``: if
``registry.json`` is lost or damaged (edited by hand, a foreign file), :meth:`AdapterRegistry.rebuild`
(``flowopt registry rebuild``) replays those files into a new one.
"""

from __future__ import annotations

import getpass
import json
from contextlib import contextmanager
import os
import time
from pathlib import Path
from typing import Any, Iterator

from dagster import ConfigurableResource
from filelock import FileLock
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from flow_assets.core.atomic import write_json_atomic
from flow_assets.settings import DEFAULT_MODELS
from flow_assets.policy.prompt import ADAPTER_CONFIG, PromptPolicy, PromptPolicyError, is_prompt_policy

#: files that make a directory a PEFT LoRA adapter: the config (ADAPTER_CONFIG) and one of the weight files
ADAPTER_WEIGHTS = ("adapter_model.safetensors", "adapter_model.bin")
#: history actions that make their version the champion
_CHAMPION_ACTIONS = ("register", "promote", "rollback")


class RegistryError(RuntimeError):
    """The registry cannot do what was asked (e.g. roll back with no previous champion)."""


def adapter_problem(adapter_path: str | os.PathLike) -> str | None:
    """Why ``adapter_path`` is not a LoRA adapter directory that can serve, or ``None``: it must
    be a directory holding :data:`ADAPTER_CONFIG` and one of :data:`ADAPTER_WEIGHTS`, non-empty,
    or a prompt policy directory whose ``prompt_policy.json`` loads (:mod:`flow_assets.policy.prompt`),
    or both (an adapter served under a prompt policy: each must pass)."""
    path = Path(adapter_path)
    if not path.is_dir():
        return f"its adapter {path} is gone" if not path.exists() else f"its adapter {path} is not a directory"
    if is_prompt_policy(path):  # a prompt policy version (flow_assets.policy.prompt): loadable is enough
        try:
            PromptPolicy.load(path)
        except (OSError, PromptPolicyError) as exc:
            return f"its prompt policy cannot be read: {exc}"
        if not (path / ADAPTER_CONFIG).is_file():  # a prompt policy alone (served by the proxy)
            return None
    if not (path / ADAPTER_CONFIG).is_file():
        return f"its adapter directory {path} has no {ADAPTER_CONFIG}"
    weights = [path / name for name in ADAPTER_WEIGHTS if (path / name).is_file()]
    if not weights:
        return f"its adapter directory {path} has no {' or '.join(ADAPTER_WEIGHTS)}"
    if all(w.stat().st_size == 0 for w in weights):
        return f"its adapter weights {weights[0]} are empty"
    return None


class _Entry(BaseModel):
    """A champion entry as registry.json keeps it (strict: a number is not a version)."""

    model_config = ConfigDict(extra="allow", strict=True)
    version: str
    adapter_path: str
    metrics: dict[str, Any]


class _Event(BaseModel):
    """One history event as registry.json and the event files keep it."""

    model_config = ConfigDict(extra="allow", strict=True)
    action: str
    version: str
    previous: str | None = None
    adapter_path: str
    metrics: dict[str, Any] = {}


class _Challenger(_Entry):
    share: float
    champion: str


class _Candidate(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)
    adapter_path: str


class _Content(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)
    champion: _Entry | None
    history: list[_Event]
    challenger: _Challenger | None = None
    candidate: _Candidate | None = None


def _first_error(error: ValidationError) -> str:
    """The first problem pydantic found, as ``field.path: message`` on one line."""
    first = error.errors()[0]
    where = ".".join(str(part) for part in first["loc"]) or "the document"
    got = first.get("input")
    shown = f" (got {type(got).__name__} {str(got)[:40]!r})" if first["type"] != "missing" and not isinstance(got, dict) else ""
    return f"{where}: {first['msg'].lower()}{shown}"


def content_problem(content: Any) -> str | None:
    """Why ``content`` (registry.json, decoded) is not a registry, in one line, or ``None``:
    a JSON object with ``champion`` (an entry with string ``version`` and ``adapter_path`` and a
    ``metrics`` object, or null) and a ``history`` list of events (string ``action``,
    ``version``, ``adapter_path``), whose last register/promote/rollback names the champion."""
    if not isinstance(content, dict):
        return f"a JSON {type(content).__name__}, not an object with \"champion\" and \"history\""
    try:
        checked = _Content.model_validate(content)
    except ValidationError as error:
        return _first_error(error)
    made = [e for e in checked.history if e.action in _CHAMPION_ACTIONS]
    if checked.champion is not None and made and made[-1].version != checked.champion.version:
        return (f"champion.version {checked.champion.version!r} points nowhere: the history's last "
                f"{made[-1].action} made {made[-1].version!r} the champion")  # fmt: skip
    if checked.champion is not None and not made:
        return f"champion.version {checked.champion.version!r} points nowhere: no history event made it the champion"
    return None


def _undecodable(data: bytes) -> str | None:
    """Why ``data`` cannot be JSON text at all (empty, binary, not UTF-8), or ``None``."""
    if not data.strip():
        return "an empty file"
    if data[:4] == b"PAR1" or b"\x00" in data[:4096]:
        return f"binary content, not JSON (it starts {data[:8]!r})"
    try:
        data.decode("utf-8")
    except UnicodeDecodeError as error:
        return f"not UTF-8 text (byte 0x{data[error.start]:02x} at offset {error.start})"
    return None


def _empty() -> dict[str, Any]:
    return {"champion": None, "history": []}


class AdapterRegistry(ConfigurableResource):
    """Champion and history of the policy's LoRA adapters.

    A version is a string (``"v0"``, ``"v1"``, ...) naming an adapter directory. History entries
    are dicts with ``action`` (``register``/``promote``/``rollback``, and for live A/B
    ``challenge``/``withdraw``), ``version``, ``previous``,
    ``adapter_path``, ``metrics``, ``by`` (user or sensor/run that did it), ``reason`` and
    ``at`` (UNIX seconds).
    """

    root: str = Field(default=DEFAULT_MODELS, description="Directory of adapters and registry.json.")

    @property
    def path(self) -> Path:
        """The registry file."""
        return Path(self.root) / "registry.json"

    @property
    def history_dir(self) -> Path:
        """One file per history event (``<seq>.json``, 6 digits from 1): what :meth:`rebuild` reads."""
        return Path(self.root) / "history"

    @contextmanager
    def _locked(self) -> Iterator[None]:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with FileLock(str(self.path) + ".lock"):
            yield

    def load(self) -> dict[str, Any]:
        """The registry content (``{"champion": {...} | None, "history": [...]}``).

        Raises:
            RegistryError: ``registry.json`` is not a registry (empty, truncated, binary, not UTF-8,
                not JSON, not an object, a field missing or of the wrong type, a champion that no
                history event made, a directory: :func:`content_problem`); one line naming the
                file and what is wrong, and how to rebuild it.
        """
        if not self.path.exists():
            return _empty()
        try:
            data = self.path.read_bytes()
        except OSError as error:
            raise self._damaged(str(error.strerror or error)) from None
        if why := _undecodable(data):
            raise self._damaged(why)
        try:
            content = json.loads(data)
        except (ValueError, RecursionError) as error:
            raise self._damaged(f"not JSON: {error}") from None
        if why := content_problem(content):
            raise self._damaged(why)
        return content

    def _damaged(self, why: str) -> RegistryError:
        events = len(list(self.history_dir.glob("*.json"))) if self.history_dir.is_dir() else 0
        return RegistryError(
            f"{self.path}: not a flowopt adapter registry ({why}); "
            f"`flowopt registry rebuild --models {self.root}` rebuilds it from {events} event file(s) in {self.history_dir}"
        )

    def _append_event(self, content: dict[str, Any], event: dict[str, Any]) -> None:
        # the event file first: a crash between the two writes leaves an event that rebuild replays
        self.history_dir.mkdir(parents=True, exist_ok=True)
        seq = len(content["history"]) + 1
        write_json_atomic(self.history_dir / f"{seq:06d}.json", event, sort_keys=True)
        content["history"].append(event)

    def rebuild(self) -> dict[str, Any]:
        """Replace ``registry.json`` by the registry the event files in :attr:`history_dir`
        describe (the champion is the version of the last register/promote/rollback event, the
        challenger that of an open ``challenge``; the candidate is not kept).
        The damaged file, if any, is kept beside it as ``registry.json.damaged``.

        Returns:
            The rebuilt content.

        Raises:
            RegistryError: there are no event files, or one is not readable JSON (named).
        """
        with self._locked():
            files = sorted(self.history_dir.glob("*.json")) if self.history_dir.is_dir() else []
            if not files:
                raise RegistryError(f"{self.history_dir}: no history event files; nothing to rebuild from")
            content = _empty()
            for file in files:
                try:
                    event = json.loads(file.read_bytes())
                    if not isinstance(event, dict):
                        raise ValueError(f"a JSON {type(event).__name__}, not an object")
                    _Event.model_validate(event)
                except ValidationError as error:
                    raise RegistryError(f"{file}: unreadable history event ({_first_error(error)})") from None
                except (OSError, ValueError, RecursionError) as error:
                    raise RegistryError(f"{file}: unreadable history event ({error})") from None
                content["history"].append(event)
                action = event.get("action")
                if action == "challenge":
                    content["challenger"] = {k: event.get(k) for k in ("version", "adapter_path", "metrics", "share")} | {
                        "champion": event.get("previous"), "since": event.get("at")}
                elif action == "withdraw" or (content.get("challenger") or {}).get("version") == event.get("version"):
                    content.pop("challenger", None)
                if action != "challenge" and action != "withdraw":
                    content["champion"] = {k: event[k] for k in ("version", "adapter_path", "metrics")}
            if self.path.exists() or self.path.is_symlink():
                os.replace(self.path, str(self.path) + ".damaged")
            self._write(content)
            return content

    def _write(self, content: dict[str, Any]) -> None:
        if self.path.is_dir():
            raise self._damaged("a directory")
        write_json_atomic(self.path, content, sort_keys=True)

    def champion(self) -> dict[str, Any] | None:
        """The current champion entry (``version``, ``adapter_path``, ``metrics``) or ``None``."""
        return self.load()["champion"]

    def version(self, version: str) -> dict[str, Any] | None:
        """The newest history entry of ``version`` that names its adapter (``version``,
        ``adapter_path``, ``metrics``, ...), whether it serves now or not; ``None`` for a version
        the registry never held."""
        return next((e for e in reversed(self.load()["history"]) if e.get("version") == version and e.get("adapter_path")), None)

    def candidate(self) -> dict[str, Any] | None:
        """The adapter the latest training round produced (``adapter_path``, ``batch``,
        ``parent_version``), which the gateway serves as ``model="candidate"``; or ``None``."""
        return self.load().get("candidate")

    def set_candidate(self, adapter_path: str, batch: str, parent_version: str) -> None:
        """Record the latest round's candidate (not a promotion: the champion is unchanged)."""
        with self._locked():
            content = self.load()
            content["candidate"] = {"adapter_path": adapter_path, "batch": batch, "parent_version": parent_version, "at": time.time()}
            self._write(content)

    def next_version(self) -> str:
        """The next unused version name: ``v<n+1>`` for the largest ``v<n>`` in the history
        (champions and challengers alike), ``v1`` for a registry with only ``v0`` or nothing."""
        numbers = [int(e["version"][1:]) for e in self.load()["history"] if str(e.get("version", "")).removeprefix("v").isdigit()]
        return f"v{max(numbers, default=0) + 1}"

    def challenger(self) -> dict[str, Any] | None:
        """The adapter in live A/B against the champion (``version``, ``adapter_path``,
        ``metrics``, ``share``, ``champion``, ``since``), or ``None``."""
        return self.load().get("challenger")

    def start_challenger(self, version: str, adapter_path: str, metrics: dict[str, Any], share: float, by: str, reason: str) -> dict[str, Any]:
        """Put ``version`` in live A/B: the gateway then serves it to ``share`` of the sessions
        that ask for ``model="policy"`` (the champion serves the rest). Recorded as a
        ``challenge`` event.

        Returns:
            The challenger entry.

        Raises:
            RegistryError: no champion, a challenger already running, or ``share`` not in (0, 1).
        """
        if not 0.0 < share < 1.0:
            raise RegistryError(f"challenger share must be in (0, 1), got {share}")
        with self._locked():
            content = self.load()
            if content["champion"] is None:
                raise RegistryError(f"{self.path}: no champion to challenge")
            if content.get("challenger"):
                raise RegistryError(f"{self.path}: {content['challenger']['version']} is already in live A/B; conclude it first")
            entry = {"version": version, "adapter_path": adapter_path, "metrics": metrics, "share": share,
                     "champion": content["champion"]["version"], "since": time.time()}  # fmt: skip
            content["challenger"] = entry
            self._append_event(content, {"action": "challenge", "version": version, "previous": entry["champion"],
                                         "adapter_path": adapter_path, "metrics": metrics, "share": share, "by": by,
                                         "reason": reason, "at": entry["since"]})  # fmt: skip
            self._write(content)
            return entry

    def conclude_challenger(self, decision: str, by: str, reason: str, evidence: dict[str, Any] | None = None) -> dict[str, Any]:
        """End the live A/B: ``decision="promote"`` makes the challenger the champion (a
        ``promote`` event), ``"rollback"`` withdraws it and keeps the champion (a ``withdraw``
        event). Either way the evidence (the test's numbers) and who decided are in the event.

        Returns:
            The champion entry after the decision.

        Raises:
            RegistryError: no challenger, an unknown decision, a promotion of a challenger whose
                adapter directory lacks its files (:func:`adapter_problem`), or the champion changed since the
                challenger started (someone promoted or rolled back by hand: the A/B compared
                against another adapter, so its verdict no longer applies).
        """
        if decision not in ("promote", "rollback"):
            raise RegistryError(f"decision must be 'promote' or 'rollback', got {decision!r}")
        with self._locked():
            content = self.load()
            challenger = content.get("challenger")
            if not challenger:
                raise RegistryError(f"{self.path}: no challenger in live A/B")
            champion = content["champion"]
            if champion is None or champion["version"] != challenger["champion"]:
                raise RegistryError(
                    f"{self.path}: the champion is {champion and champion['version']}, not {challenger['champion']} "
                    f"that {challenger['version']} was tested against; conclude by hand (flowopt promote / rollback)"
                )
            if decision == "promote" and (why := adapter_problem(challenger["adapter_path"])):
                raise RegistryError(f"{self.path}: cannot promote {challenger['version']}: {why}; champion stays {champion['version']}")
            del content["challenger"]
            metrics = {**challenger["metrics"], **({"live_ab": evidence} if evidence else {})}
            if decision == "promote":
                return self._promote(content, challenger["version"], challenger["adapter_path"], metrics, by, reason, action="promote")
            self._append_event(content, {"action": "withdraw", "version": challenger["version"], "previous": champion["version"],
                                         "adapter_path": challenger["adapter_path"], "metrics": metrics, "by": by,
                                         "reason": reason, "at": time.time()})  # fmt: skip
            self._write(content)
            return champion

    def promote(
        self, version: str, adapter_path: str, metrics: dict[str, Any], by: str, reason: str, action: str = "promote"
    ) -> dict[str, Any]:
        """Make ``version`` the champion and append the event to the history.

        Returns:
            The new champion entry.

        Raises:
            RegistryError: ``registry.json`` is damaged (:meth:`load`).
        """
        with self._locked():
            return self._promote(self.load(), version, adapter_path, metrics, by, reason, action)

    def _promote(self, content, version, adapter_path, metrics, by, reason, action) -> dict[str, Any]:
        previous = content["champion"]
        entry = {"version": version, "adapter_path": adapter_path, "metrics": metrics}
        content["champion"] = entry
        event = {
            "action": action,
            "version": version,
            "previous": previous["version"] if previous else None,
            "adapter_path": adapter_path,
            "metrics": metrics,
            "by": by,
            "reason": reason,
            "at": time.time(),
        }
        self._append_event(content, event)
        self._write(content)
        return entry

    def rollback(self, by: str | None = None, reason: str = "manual rollback") -> dict[str, Any]:
        """Restore the champion that preceded the current one.

        The previous champion is the ``previous`` of the event that made the current champion;
        rolling back twice walks further back. The rollback itself is recorded in the history.

        Raises:
            RegistryError: there is no champion, the champion has no predecessor, or the
                predecessor's adapter directory is gone or lacks its adapter files
                (:func:`adapter_problem`; nothing changes then).
        """
        with self._locked():
            return self._rollback(self.load(), by, reason)

    def _rollback(self, content, by, reason) -> dict[str, Any]:
        current = content["champion"]
        if current is None:
            raise RegistryError(f"{self.path}: no champion to roll back")
        made_by = next(
            (e for e in reversed(content["history"]) if e["version"] == current["version"] and e["action"] in ("register", "promote")),
            None,
        )
        prev_version = made_by["previous"] if made_by else None
        if prev_version is None:
            raise RegistryError(f"{self.path}: champion {current['version']} has no previous champion")
        prev = next((e for e in reversed(content["history"]) if e["version"] == prev_version and e["action"] in ("register", "promote")), None)
        if prev is None:
            raise RegistryError(f"{self.path}: champion {current['version']} names {prev_version!r} as its previous champion, "
                                "which no register or promote event in the history made")  # fmt: skip
        if why := adapter_problem(prev["adapter_path"]):
            raise RegistryError(f"{self.path}: cannot roll back to {prev_version}: {why}; champion stays {current['version']}")
        return self._promote(
            content,
            prev_version,
            prev["adapter_path"],
            prev["metrics"],
            by or getpass.getuser(),
            reason,
            action="rollback",
        )
