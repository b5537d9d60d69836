"""Finding new log files in the landing directory (plain functions, no Dagster).

Landing convention (docs/log-format.md): a writer writes ``name.ext.tmp`` (or any name starting
with ``.``) and renames it when complete; rename is atomic, so a file that is still being written
is never seen under its final name. Files directly in the landing directory belong to the source
named after the file's stem; files in a sub-directory belong to the source named after that
sub-directory (``landing/tau2-bench/**/*.json`` -> source ``tau2-bench``).
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from pathlib import Path

_UNSAFE = re.compile(r"[^A-Za-z0-9._-]+")
_HASH_CHUNK = 1 << 20


@dataclass(frozen=True)
class LandedFile:
    """A complete file in the landing directory. ``size_bytes`` in bytes, ``mtime_ns`` in ns."""

    path: Path
    relpath: str
    source: str
    size_bytes: int
    mtime_ns: int


def is_in_progress(name: str) -> bool:
    """True for names a writer uses while writing: ``*.tmp`` and hidden (``.``-prefixed) files."""
    return name.startswith(".") or name.endswith(".tmp")


def list_landed(landing_dir: Path) -> list[LandedFile]:
    """Complete files under ``landing_dir`` (recursive), sorted by relative path.

    Returns an empty list when the directory does not exist yet.
    """
    if not landing_dir.exists():
        return []
    files = []
    for path in sorted(landing_dir.rglob("*")):
        rel = path.relative_to(landing_dir)
        if not path.is_file() or any(is_in_progress(part) for part in rel.parts):
            continue
        stat = path.stat()
        source = rel.parts[0] if len(rel.parts) > 1 else path.stem
        files.append(LandedFile(path, rel.as_posix(), source, stat.st_size, stat.st_mtime_ns))
    return files


def sha256_file(path: Path) -> str:
    """Hex sha256 of a file's bytes, read in 1 MiB chunks."""
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        while chunk := fh.read(_HASH_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def batch_key(landed: LandedFile, sha256: str) -> str:
    """Partition key of a landed file: ``<source>.<file stem>.<first 12 hex of sha256>``.

    The hash makes the key follow the content: the same bytes give the same key (idempotent
    across sensor ticks and restarts); a rewritten file gives a new key, i.e. a new batch.
    """
    parts = Path(landed.relpath).parts
    inside = Path(*parts[1:]) if len(parts) > 1 else Path(parts[0])
    source = _UNSAFE.sub("-", landed.source)[:40].strip("-") or "source"
    stem = _UNSAFE.sub("-", inside.with_suffix("").as_posix())[:48].strip("-") or "file"
    return f"{source}.{stem}.{sha256[:12]}" if stem != source else f"{source}.{sha256[:12]}"
