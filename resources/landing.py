"""Where agent logs land: the directory ``new_logs_sensor`` watches."""

from __future__ import annotations

from fnmatch import fnmatch

from dagster import ConfigurableResource
from pydantic import Field


class LogLanding(ConfigurableResource):
    """The landing directory and, optionally, the parser to use per file pattern.

    Attributes:
        directory: the directory writers drop complete log files into (write ``*.tmp``, rename).
        formats: glob pattern over the path relative to ``directory`` -> parser name
            (``canonical``, ``flat``, ``tau-bench``, ``tau2``, ``fireact``); unmatched files are
            detected by content (``auto``).
    """

    directory: str = Field(default=".landing", description="Landing directory for log files.")
    formats: dict[str, str] = Field(default_factory=dict, description="glob -> parser name")

    def format_for(self, relpath: str) -> str:
        """The parser name for a file at ``relpath`` (first matching glob), else ``"auto"``."""
        for pattern, fmt in self.formats.items():
            if fnmatch(relpath, pattern):
                return fmt
        return "auto"
