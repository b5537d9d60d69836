"""Finding new log files in the landing directory (plain functions, no Dagster).

Landing convention (docs/log-format.md): a writer writes ``name.ext.tmp`` (or any name starting
with ``.``) and renames it when complete; rename is atomic, so a file that is still being written
is never seen under its final name. (A file written in place waits for the sensor's settle time.)
Symbolic links are never followed: a link in the landing directory could point anywhere on the
machine, and what it points to would be copied into the lake. Files directly in the landing directory belong to the source
named after the file's stem; files in a sub-directory belong to the source named after that
sub-directory (``landing/tau2-bench/**/*.json`` -> source ``tau2-bench``).
"""

from __future__ import annotations

import hashlib
import os
import re
from stat import S_ISREG
from dataclasses import dataclass
from pathlib import Path

_HASH_CHUNK = 1 << 20


@dataclass(frozen=True)
class LandedFile:
    """A complete file in the landing directory. ``size_bytes`` in bytes, ``mtime_ns`` and
    ``ctime_ns`` (status change: any write, even one that restores the mtime) in ns, ``inode``
    its inode number (a file renamed over it has another)."""

    path: Path
    relpath: str
    source: str
    size_bytes: int
    mtime_ns: int
    ctime_ns: int = 0
    inode: int = 0

    def fingerprint(self) -> list[int]:
        """What says the file may have changed since it was hashed: size, mtime, ctime, inode."""
        return [self.size_bytes, self.mtime_ns, self.ctime_ns, self.inode]


def is_in_progress(name: str) -> bool:
    """True for names a writer uses while writing: ``*.tmp`` and hidden (``.``-prefixed) files."""
    return name.startswith(".") or name.endswith(".tmp")


def list_landed(landing_dir: Path) -> list[LandedFile]:
    """Complete regular files under ``landing_dir`` (recursive), sorted by relative path;
    symbolic links (to files or directories) are skipped, and so is a file removed while listing.

    Returns an empty list when the directory does not exist yet.
    """
    if not landing_dir.is_dir():
        return []
    files = []
    for root, dirs, names in os.walk(landing_dir):  # does not descend into linked directories
        dirs[:] = sorted(d for d in dirs if not is_in_progress(d) and not os.path.islink(os.path.join(root, d)))
        for name in sorted(names):
            path = Path(root, name)
            if is_in_progress(name):
                continue
            try:
                stat = path.lstat()
            except FileNotFoundError:
                continue
            if not S_ISREG(stat.st_mode):  # a link, fifo, socket: never read
                continue
            rel = path.relative_to(landing_dir)
            source = rel.parts[0] if len(rel.parts) > 1 else path.stem
            files.append(LandedFile(path, rel.as_posix(), source, stat.st_size, stat.st_mtime_ns, stat.st_ctime_ns, stat.st_ino))
    return sorted(files, key=lambda f: f.relpath)


def sha256_file(path: Path) -> str:
    """Hex sha256 of a file's bytes, read in 1 MiB chunks."""
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        while chunk := fh.read(_HASH_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


#: characters a partition key component keeps as they are; every other byte is encoded
_KEPT = frozenset(b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_-")
#: longest encoded component kept whole; a longer one is cut and ends with a hash of the whole
KEY_COMPONENT_LIMIT = 64


def key_component(text: str, limit: int = KEY_COMPONENT_LIMIT) -> str:
    """``text`` as one component of a partition key: letters, digits, ``_`` and ``-`` kept, every
    other byte of its file-system encoding written ``~XX`` (hex), so two different names never give
    the same component (``team a`` -> ``team~20a``, ``team-a`` stays; ``.`` and ``/`` are encoded
    too, which keeps the ``.``-separated key unambiguous). A component longer than ``limit`` is cut
    and ends ``~~`` + 10 hex of the sha256 of the whole name (``~~`` never occurs otherwise).

    Names that are not valid UTF-8 (``os.fsencode``'s surrogate escapes) are encoded from their bytes.
    """
    raw = os.fsencode(text)
    out = "".join(chr(b) if b in _KEPT else f"~{b:02X}" for b in raw)
    if len(out) > limit:
        cut = out[: limit - 12]
        tilde = cut.rfind("~", len(cut) - 2)
        cut = cut[:tilde] if tilde >= 0 else cut  # never half an escape
        out = cut + "~~" + hashlib.sha256(raw).hexdigest()[:10]
    return out


#: a training round's rollout batch: ``r<round>-<rest>`` directly in its agent's source folder
_ROUND_STEM = re.compile(r"r(\d{4,})-([A-Za-z0-9_-]+)")


def batch_key(landed: LandedFile, sha256: str) -> str:
    """Partition key of a landed file: ``<source>.<path inside the source, no extension>.<first 12
    hex of sha256>`` (``<source>.<sha>`` for a file directly in the landing directory), each name
    through :func:`key_component`.

    A training round's rollout batch (``<source>/r0018-<rest>.jsonl``, as ``collect_batch`` names
    it) gets ``r0018.<source>.<rest>.<sha>``: the round comes first, because the Dagster UI cuts
    long keys in the middle and the round is what a reader looks for. The four components tell it
    apart from every other key (two or three components), so keys stay injective.

    The hash makes the key follow the content: the same bytes give the same key (idempotent
    across sensor ticks and restarts); a rewritten file gives a new key, i.e. a new batch. The
    encoding makes it injective: different (source, path, bytes) never share a key.
    """
    parts = Path(landed.relpath).parts
    inside = Path(*parts[1:]) if len(parts) > 1 else Path(parts[0])
    stem = inside.with_suffix("").as_posix()
    if len(parts) == 1 and stem == landed.source:
        return f"{key_component(landed.source)}.{sha256[:12]}"
    round_stem = _ROUND_STEM.fullmatch(stem) if len(parts) == 2 else None
    if round_stem is not None:
        return f"r{round_stem[1]}.{key_component(landed.source)}.{round_stem[2]}.{sha256[:12]}"
    return f"{key_component(landed.source)}.{key_component(stem)}.{sha256[:12]}"


def key_source(key: str) -> str:
    """The (encoded) source component of a partition key made by :func:`batch_key`
    (``r0018.flowopt-calculator.v3-ab.0123456789ab`` -> ``flowopt-calculator``,
    ``tau-bench.gpt-4o.0123456789ab`` -> ``tau-bench``)."""
    return key.split(".")[1] if key_round(key) is not None else key.split(".")[0]


def key_round(key: str) -> int | None:
    """The round number of a rollout batch's key (``r0018.…`` -> 18), else ``None``."""
    parts = key.split(".")
    if len(parts) == 4 and re.fullmatch(r"r\d{4,}", parts[0]):
        return int(parts[0][1:])
    return None
