"""Where agent logs land: the directory ``new_logs_sensor`` watches."""

from __future__ import annotations

from fnmatch import fnmatch

from dagster import ConfigurableResource
from pydantic import Field

from flow_assets.settings import DEFAULT_LANDING, DEFAULT_SETTLE_SECONDS


class LogLanding(ConfigurableResource):
    """The landing directory and, optionally, the parser to use per file pattern.

    Attributes:
        directory: the directory writers drop complete log files into (write ``*.tmp``, rename).
        formats: glob pattern over the path relative to ``directory`` -> parser name
            (``canonical``, ``flat``, ``tau-bench``, ``tau2``, ``fireact``); unmatched files are
            detected by content (``auto``).
        tick_budget_seconds: seconds one ``new_logs_sensor`` tick may spend hashing new files
            (it always hashes at least one); the rest wait for the next tick. Dagster stops a
            sensor evaluation after 60 s, and a stopped tick saves no cursor.
        settle_seconds: a file modified less than this many seconds ago is left for a later
            tick, so a file written in place (not ``.tmp`` then rename) is not read half-written.
            A writer that pauses longer and then appends is caught anyway: the batch registered
            from the file's first part is retired when the whole file is registered
            (:func:`flow_assets.runtime.recovery.retire_grown_batches`), so no record lands twice.
    """

    directory: str = Field(default=DEFAULT_LANDING, description="Landing directory for log files.")
    formats: dict[str, str] = Field(default_factory=dict, description="glob -> parser name")
    tick_budget_seconds: float = Field(
        default=20.0, ge=0.0, description="seconds a sensor tick may spend hashing new files (at least one file)"
    )

    settle_seconds: float = Field(
        default=DEFAULT_SETTLE_SECONDS, ge=0.0, description="a file modified more recently than this waits for a later tick"
    )

    def format_for(self, relpath: str) -> str:
        """The parser name for a file at ``relpath`` (first matching glob), else ``"auto"``."""
        for pattern, fmt in self.formats.items():
            if fnmatch(relpath, pattern):
                return fmt
        return "auto"
