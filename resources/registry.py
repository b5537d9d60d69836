"""The adapter registry: which LoRA adapter is the champion, and how it got there.

One JSON file (``<root>/registry.json``) holds the champion, the full history of promotions and
rollbacks, and the latest round's candidate. Every write goes to a temporary file in the same directory, is fsync'ed, and is moved
over the old file with ``os.replace``; a crash at any point leaves either the old registry or the
new one, never a torn file.
"""

from __future__ import annotations

import getpass
import json
import os
import tempfile
import time
from pathlib import Path
from typing import Any

from dagster import ConfigurableResource
from pydantic import Field


class RegistryError(RuntimeError):
    """The registry cannot do what was asked (e.g. roll back with no previous champion)."""


def _empty() -> dict[str, Any]:
    return {"champion": None, "history": []}


class AdapterRegistry(ConfigurableResource):
    """Champion and history of the policy's LoRA adapters.

    A version is a string (``"v0"``, ``"v1"``, ...) naming an adapter directory. History entries
    are dicts with ``action`` (``register``/``promote``/``rollback``), ``version``, ``previous``,
    ``adapter_path``, ``metrics``, ``by`` (user or sensor/run that did it), ``reason`` and
    ``at`` (UNIX seconds).
    """

    root: str = Field(default=".models", description="Directory of adapters and registry.json.")

    @property
    def path(self) -> Path:
        """The registry file."""
        return Path(self.root) / "registry.json"

    def load(self) -> dict[str, Any]:
        """The registry content (``{"champion": {...} | None, "history": [...]}``)."""
        if not self.path.exists():
            return _empty()
        return json.loads(self.path.read_text())

    def _write(self, content: dict[str, Any]) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".registry.", suffix=".tmp", dir=self.path.parent)
        try:
            with os.fdopen(fd, "w") as fh:
                json.dump(content, fh, indent=2, sort_keys=True)
                fh.flush()
                os.fsync(fh.fileno())
            os.replace(tmp, self.path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise

    def champion(self) -> dict[str, Any] | None:
        """The current champion entry (``version``, ``adapter_path``, ``metrics``) or ``None``."""
        return self.load()["champion"]

    def candidate(self) -> dict[str, Any] | None:
        """The adapter the latest training round produced (``adapter_path``, ``batch``,
        ``parent_version``), which the gateway serves as ``model="candidate"``; or ``None``."""
        return self.load().get("candidate")

    def set_candidate(self, adapter_path: str, batch: str, parent_version: str) -> None:
        """Record the latest round's candidate (not a promotion: the champion is unchanged)."""
        content = self.load()
        content["candidate"] = {"adapter_path": adapter_path, "batch": batch, "parent_version": parent_version, "at": time.time()}
        self._write(content)

    def promote(
        self, version: str, adapter_path: str, metrics: dict[str, Any], by: str, reason: str, action: str = "promote"
    ) -> dict[str, Any]:
        """Make ``version`` the champion and append the event to the history.

        Returns:
            The new champion entry.
        """
        content = self.load()
        previous = content["champion"]
        entry = {"version": version, "adapter_path": adapter_path, "metrics": metrics}
        content["champion"] = entry
        content["history"].append(
            {
                "action": action,
                "version": version,
                "previous": previous["version"] if previous else None,
                "adapter_path": adapter_path,
                "metrics": metrics,
                "by": by,
                "reason": reason,
                "at": time.time(),
            }
        )
        self._write(content)
        return entry

    def rollback(self, by: str | None = None, reason: str = "manual rollback") -> dict[str, Any]:
        """Restore the champion that preceded the current one.

        The previous champion is the ``previous`` of the event that made the current champion;
        rolling back twice walks further back. The rollback itself is recorded in the history.

        Raises:
            RegistryError: there is no champion, or the champion has no predecessor.
        """
        content = self.load()
        current = content["champion"]
        if current is None:
            raise RegistryError(f"{self.path}: no champion to roll back")
        made_by = next(
            (e for e in reversed(content["history"]) if e["version"] == current["version"] and e["action"] != "rollback"),
            None,
        )
        prev_version = made_by["previous"] if made_by else None
        if prev_version is None:
            raise RegistryError(f"{self.path}: champion {current['version']} has no previous champion")
        prev = next(e for e in reversed(content["history"]) if e["version"] == prev_version and e["action"] != "rollback")
        return self.promote(
            prev_version,
            prev["adapter_path"],
            prev["metrics"],
            by or getpass.getuser(),
            reason,
            action="rollback",
        )
