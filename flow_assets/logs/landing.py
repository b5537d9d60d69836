"""Finding new log files in the landing directory (plain functions, no Dagster).

Landing convention (docs/log-format.md): a writer writes ``name.ext.tmp`` (or any name starting
with ``.``) and renames it when complete; rename is atomic, so a file that is still being written
is never seen under its final name. (A file written in place waits for the sensor's settle time.)
Symbolic links are never followed: a link in the landing directory could point anywhere on the
machine, and what it points to would be copied into the lake. Hard links are refused for the same
reason (a regular file with more than one link may be another name of any file its creator could
link, e.g. one outside the landing directory): they are skipped, named in ``refused``, and left
untouched. ``flowopt ingest`` copies into the landing directory through a hidden temporary file
(:func:`ingest_temporary`) that it holds locked while it writes; a copy killed midway leaves it
behind, and the next ingest removes every such temporary that is unlocked and older than
:data:`STALE_TEMPORARY_SECONDS` (:func:`remove_stale_temporaries`). Files directly in the landing directory belong to the source
named after the file's stem; files in a sub-directory belong to the source named after that
sub-directory (``landing/tau2-bench/**/*.json`` -> source ``tau2-bench``).
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import re
import time
from stat import S_ISREG
from dataclasses import dataclass
from pathlib import Path

_HASH_CHUNK = 1 << 20
#: the hidden temporary ``flowopt ingest`` copies a file through: ``.<16 hex>.<pid>.tmp``
_INGEST_TEMPORARY = re.compile(r"\.[0-9a-f]{16}\.[0-9]+\.tmp")
#: an unlocked ingest temporary at least this old (mtime, seconds) belongs to a dead copy
STALE_TEMPORARY_SECONDS = 60.0


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


def list_landed(landing_dir: Path, refused: list[tuple[Path, str]] | None = None) -> list[LandedFile]:
    """Complete regular files under ``landing_dir`` (recursive), sorted by relative path;
    symbolic links (to files or directories) are skipped, and so is a file removed while listing.
    A hard-linked file (more than one link) is skipped too, and ``(path, why)`` appended to
    ``refused`` when given; it is never opened, moved or changed.

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
            if stat.st_nlink > 1:  # another name of a file that may live anywhere: never read
                if refused is not None:
                    refused.append((path, f"a hard link ({stat.st_nlink} names of one file): refused, never read; land a copy instead"))
                continue
            rel = path.relative_to(landing_dir)
            source = rel.parts[0] if len(rel.parts) > 1 else path.stem
            files.append(LandedFile(path, rel.as_posix(), source, stat.st_size, stat.st_mtime_ns, stat.st_ctime_ns, stat.st_ino))
    return sorted(files, key=lambda f: f.relpath)


def ingest_temporary(dest: Path) -> Path:
    """The hidden temporary ``flowopt ingest`` writes ``dest`` through, beside it: short and
    hidden whatever the name's length (``name + ".tmp"`` may pass the 255-byte limit), and
    marked with this process's id."""
    return dest.with_name(f".{hashlib.sha256(os.fsencode(dest.name)).hexdigest()[:16]}.{os.getpid()}.tmp")


def remove_stale_temporaries(landing_dir: Path, min_age_s: float = STALE_TEMPORARY_SECONDS) -> list[Path]:
    """Remove the temporaries of ``flowopt ingest`` copies that died (``kill -9``) under
    ``landing_dir``: only names of :func:`ingest_temporary`'s form, only when no process holds
    their lock (a live copy does: :func:`flow_assets.logs.ingest.land`) and their mtime is at least
    ``min_age_s`` seconds old (a copy that has just created its file may not hold the lock yet).
    Other hidden or ``.tmp`` files (a gateway's open batch, a writer's) are never touched.

    Returns:
        The paths removed.
    """
    removed: list[Path] = []
    if not landing_dir.is_dir():
        return removed
    now = time.time()
    for root, dirs, names in os.walk(landing_dir):  # never into linked directories
        dirs[:] = [d for d in dirs if not os.path.islink(os.path.join(root, d))]
        for name in names:
            path = Path(root, name)
            if not _INGEST_TEMPORARY.fullmatch(name):
                continue
            try:
                stat = path.lstat()
                if not S_ISREG(stat.st_mode) or now - stat.st_mtime < min_age_s:
                    continue
                fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
            except OSError:
                continue  # gone meanwhile, or not ours to open
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                continue  # a live copy holds it
            try:
                path.unlink(missing_ok=True)
                removed.append(path)
            finally:
                os.close(fd)
    return removed


def grown_from(landed: LandedFile, manifests) -> list[str]:
    """Keys of the registered batches (``manifests``: :class:`resources.lake.BatchManifest` s)
    that came from ``landed``'s landing name and whose bytes are a strict prefix of the file now:
    the file was registered while its writer paused (past the settle time) and has grown since.
    Such a batch's records are all in the file again, so landing both would land them twice.
    A file that cannot be read (removed since listing) has none.
    """
    earlier = [m for m in manifests if m.landing_relpath == landed.relpath and 0 < m.size_bytes < landed.size_bytes]
    grown = []
    for manifest in earlier:
        digest, left = hashlib.sha256(), manifest.size_bytes
        try:
            with landed.path.open("rb") as fh:
                while left and (chunk := fh.read(min(_HASH_CHUNK, left))):
                    digest.update(chunk)
                    left -= len(chunk)
        except OSError:
            return []  # gone or unreadable since listing: its own run reports it
        if not left and digest.hexdigest() == manifest.sha256:
            grown.append(manifest.key)
    return grown


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
