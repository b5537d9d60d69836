"""Files written whole or not at all: what the registry, the rounds' JSON and the workflow store
share, so that a crash mid-write never leaves a torn file for the next reader."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any


def write_json_atomic(path: str | Path, content: Any, sort_keys: bool = False) -> None:
    """``content`` as indented UTF-8 JSON at ``path`` (parent directories created): a temporary
    file in the same directory, fsync, then ``os.replace`` (atomic on POSIX), so a reader sees the
    old file or the new one.

    Raises:
        TypeError: ``content`` is not JSON-serialisable (nothing is written).
        OSError: the directory is not writable.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            json.dump(content, fh, indent=2, sort_keys=sort_keys, ensure_ascii=False)
            fh.write("\n")
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
