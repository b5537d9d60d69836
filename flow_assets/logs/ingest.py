"""``flowopt ingest``: exactly the named log files into the lake, with a result per file that
says what happened.

What a call does (docs/ingest.md and ``flowopt ingest --help`` say the
same for users):

1. Every argument is checked before anything lands (all-or-nothing for argument errors): a
   missing path, an unreadable file or a bad ``--source`` stops the call with exit code
   :data:`EXIT_USAGE` and nothing written. A directory stands for the log files under it
   (recursively; hidden names, ``*.tmp`` and symbolic links are skipped).
2. Each file is copied into the landing directory (``<landing>/<source>/<name>``, written as
   a hidden, locked ``.tmp`` then renamed; the temporaries of copies killed midway are removed
   first, :func:`flow_assets.logs.landing.remove_stale_temporaries`) and registered as its own log batch, keyed by content
   (:func:`flow_assets.logs.landing.batch_key`). Only these batches run: other files in the landing
   directory are the sensor's business.
3. A batch whose bytes were ingested before and went through the whole data plane is not run
   again ("already ingested", :data:`EXIT_ALREADY_INGESTED`) unless ``force``; one whose earlier
   run failed or never finished runs again, with the format named now. A run whose process died
   (``kill -9``) is first marked failed and its half-written files removed
   (:mod:`flow_assets.runtime.recovery`). A per-batch lock makes a second process that ingests the same
   bytes at the same time wait and report the first one's figures. A file landed under a
   name that an earlier batch with other bytes came from keeps both batches, unless ``replace``
   retires the earlier one (its partition and its lake rows).

Exit codes (the most severe over the files wins): :data:`EXIT_OK` every file gave at least one
valid trajectory; :data:`EXIT_FAILED` a file could not be read; :data:`EXIT_USAGE` argument
error, nothing done; :data:`EXIT_ALL_QUARANTINED` a file was read but every record was
quarantined; :data:`EXIT_ALREADY_INGESTED` a file's bytes were already ingested and nothing ran.
"""

from __future__ import annotations

import fcntl
import os
import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path

from dagster import AssetKey, DagsterInstance

from flow_assets.runtime.local import failure_messages, run_job
from flow_assets.logs.records import display_path
from flow_assets.core.partitions import log_batches
from flow_assets.runtime.recovery import recover_dead_runs
from flow_assets.core.run_tags import LAUNCHED_BY_TAG
from flow_assets.data_plane.summary import batch_summary
from resources.lake import BatchManifest, TrajectoryLake
from flow_assets.logs.landing import LandedFile, batch_key, ingest_temporary, is_in_progress, remove_stale_temporaries, sha256_file

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USAGE = 2
EXIT_ALL_QUARANTINED = 3
EXIT_ALREADY_INGESTED = 4

_SEVERITY = {"failed": EXIT_FAILED, "all_quarantined": EXIT_ALL_QUARANTINED, "already_ingested": EXIT_ALREADY_INGESTED}
_ORDER = (EXIT_FAILED, EXIT_ALL_QUARANTINED, EXIT_ALREADY_INGESTED)
_EXCEPTION_PREFIX = re.compile(r"^[A-Za-z_][\w.]*(?:Error|Exception): ")
_LAST_ASSET = AssetKey("advantages")  # a batch is ingested when the data plane's last asset is
FORMAT_HELP = "see `flowopt schema` and docs/log-format.md for the canonical format, or name one with --format"


class IngestUsageError(ValueError):
    """Arguments that cannot be ingested; ``problems`` lists one line per bad argument."""

    def __init__(self, problems: list[str]):
        super().__init__("; ".join(problems))
        self.problems = problems


@dataclass(frozen=True)
class IngestFile:
    """One file to ingest: ``path`` as the user named it (or found under a named directory),
    ``source`` its landing sub-directory, ``name`` its path inside it (``/``-separated)."""

    path: Path
    source: str
    name: str


@dataclass
class FileResult:
    """What happened to one file. ``status``: ``ingested``, ``already_ingested``, ``failed`` or
    ``all_quarantined``; ``summary``: the batch's row of :func:`flow_assets.data_plane.summary.batch_summary`
    (absent when the file failed before any record was read)."""

    file: str
    partition_key: str
    status: str
    message: str = ""
    summary: dict = field(default_factory=dict)
    replaced: list[str] = field(default_factory=list)
    traceback: str = ""

    def row(self) -> dict:
        """The JSON row ``flowopt ingest`` prints for this file."""
        out = {"file": self.file, "partition_key": self.partition_key, "status": self.status, **self.summary}
        if self.message:
            out["message"] = self.message
        if self.replaced:
            out["replaced"] = self.replaced
        return out


def check_source(source: str) -> str | None:
    """Why ``source`` is not one safe directory name inside the landing directory, or ``None``."""
    why = None
    if not source or source in (".", ".."):
        why = "is empty, '.' or '..'"
    elif "/" in source or "\\" in source or os.path.isabs(source):
        why = "holds a path separator"
    elif any(ord(c) < 32 or ord(c) == 127 for c in source):
        why = "holds a control character"
    elif is_in_progress(source):
        why = "starts with '.' or ends with '.tmp' (names the sensor treats as still being written)"
    elif len(os.fsencode(source)) > 200:
        why = "is longer than 200 bytes"
    return f"--source {source!r} {why}: a source is one directory name inside the landing directory" if why else None


def _files_under(directory: Path) -> list[Path]:
    files = []
    for path in sorted(directory.rglob("*")):
        rel = path.relative_to(directory)
        if path.is_symlink() or any(is_in_progress(part) for part in rel.parts) or not path.is_file():
            continue
        files.append(path)
    return files


def resolve_arguments(paths: list[str | os.PathLike], source: str | None = None) -> list[IngestFile]:
    """The files a call names, each with its landing source and name; checks every argument
    before returning, so a call with any bad argument lands nothing.

    A file's source is ``source`` or its parent directory's name; a directory's files take
    ``source`` or the directory's name, and keep their path below it as their name.

    Raises:
        IngestUsageError: an argument is missing, unreadable or a directory without log files,
            or ``source`` is not a single directory name; every problem is listed.
    """
    problems: list[str] = []
    if source is not None and (bad := check_source(source)):
        problems.append(bad)
    found: list[IngestFile] = []
    for raw in paths:
        path = Path(raw)
        if path.is_dir():
            inside = _files_under(path)
            if not inside:
                problems.append(f"{path}: directory holds no log files")
            name = source or path.resolve().name
            if source is None and (bad := check_source(name)):
                problems.append(f"{path}: its name cannot be the source ({bad.removeprefix('--source ')}); name one with --source")
            found.extend(IngestFile(f, name, f.relative_to(path).as_posix()) for f in inside)
        elif path.is_file():
            if not os.access(path, os.R_OK):
                problems.append(f"{path}: not readable (permission denied)")
                continue
            name = source or path.resolve().parent.name
            if source is None and (bad := check_source(name)):
                problems.append(f"{path}: its directory's name cannot be the source ({bad.removeprefix('--source ')}); name one with --source")
            found.append(IngestFile(path, name, path.name))
        else:
            problems.append(f"{path}: no such file or directory")
    if problems:
        raise IngestUsageError(problems)
    return found


def land(file: IngestFile, landing: Path) -> tuple[LandedFile, str]:
    """Copy ``file`` into ``landing`` under the landing convention (a hidden temporary, held
    locked while it is written, then renamed) and return it as a landed file with the sha256 of
    the landed bytes (hex). The source file is only read.

    Raises:
        OSError: the file cannot be read or the landing directory written.
    """
    dest = landing / file.source / file.name
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = ingest_temporary(dest)
    # the lock tells remove_stale_temporaries that this copy is alive; a kill releases it
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        with open(file.path, "rb") as source, open(fd, "wb", closefd=False) as target:
            shutil.copyfileobj(source, target, 1 << 20)
        tmp.rename(dest)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    finally:
        os.close(fd)
    stat = dest.stat()
    rel = f"{file.source}/{file.name}"
    return LandedFile(dest, rel, file.source, stat.st_size, stat.st_mtime_ns), sha256_file(dest)


def earlier_batches(lake: TrajectoryLake, landed: LandedFile, key: str) -> list[str]:
    """Keys of registered batches (other than ``key``) that came from the same landing name."""
    out = []
    for manifest in lake.registered_batches():
        same_name = manifest.landing_relpath == landed.relpath if manifest.landing_relpath else (
            manifest.source == landed.source and manifest.file_name == landed.path.name
        )
        if same_name and manifest.key != key:
            out.append(manifest.key)
    return out


def retire_batch(instance: DagsterInstance, lake: TrajectoryLake, key: str) -> None:
    """Remove batch ``key``: its dynamic partition, its rows in every lake table and its snapshot."""
    if instance.has_dynamic_partition(log_batches.name, key):
        instance.delete_dynamic_partition(log_batches.name, key)
    lake.drop_batch(key)


def _quarantine_reasons(lake: TrajectoryLake, key: str, top: int = 3) -> str:
    try:
        quarantine = lake.read_partition("quarantine", key)
    except FileNotFoundError:
        return ""
    if quarantine.is_empty():
        return ""
    counts = quarantine.group_by("reason").len().sort("len", descending=True).head(top)
    return "; ".join(f"{r['len']}× {r['reason'][:160]}" for r in counts.to_dicts())


def hint(summary: dict) -> str | None:
    """A rule of thumb for a batch's summary row, or ``None``: why a batch that was read gives
    no GRPO signal, or how many trajectories carry no reward."""
    trajectories, groups, with_signal = summary.get("trajectories") or 0, summary.get("groups") or 0, summary.get("groups_with_signal") or 0
    unlabelled = summary.get("unlabelled") or 0
    tips = []
    if unlabelled:
        tips.append(f"{unlabelled} of {trajectories} trajectories carry no outcome (unlabelled): stored, with no reward or "
                    "advantage until a verifier, a judge or later feedback labels them")  # fmt: skip
    labelled = trajectories - unlabelled
    if labelled and with_signal == 0:
        if groups == labelled:
            tips.append("no GRPO groups: each task has one trajectory in this batch; pool the source's batches with "
                        "group_scope=source (advantages config) or log several trials per task")  # fmt: skip
        else:
            tips.append("no group's reward varies (every trial of a task scored the same): nothing to learn from this batch alone")
    return "; ".join(tips) or None


def ingest_files(
    files: list[IngestFile],
    *,
    defs,
    instance: DagsterInstance,
    lake: TrajectoryLake,
    landing: Path,
    fmt: str = "auto",
    force: bool = False,
    replace: bool = False,
    log_level: str = "CRITICAL",
) -> list[FileResult]:
    """Land, register and run exactly ``files`` (module docstring); one result per file, in order.

    ``defs`` is the code location's ``Definitions`` (its ``log_batch_job`` runs each batch on
    ``instance``); ``fmt`` is a parser name or ``"auto"``. Errors of a file's run never stop the
    other files; their messages name the user's file, not the lake's snapshot of it.
    """
    plan: list[tuple[IngestFile, str, bool, list[str]]] = []
    recover_dead_runs(instance, lake)  # a batch whose run died is not done, so it runs again below
    remove_stale_temporaries(landing)  # what copies killed midway left in the landing directory
    done = instance.get_materialized_partitions(_LAST_ASSET)
    for file in files:
        landed, digest = land(file, landing)
        key = batch_key(landed, digest)
        manifest = BatchManifest.of_landed(key, landed, digest, fmt)
        with lake.batch_lock(key):
            registered = instance.has_dynamic_partition(log_batches.name, key)
            run = force or not registered or key not in done
            if run:
                lake.register_batch(manifest)
                if not registered:
                    instance.add_dynamic_partitions(log_batches.name, [key])
        earlier = earlier_batches(lake, landed, key)
        if replace:
            for old in earlier:
                retire_batch(instance, lake, old)
        plan.append((file, key, run, earlier))
    results = []
    for file, key, run, earlier in plan:
        result = FileResult(file=display_path(file.path), partition_key=key, status="ingested")
        if replace:
            result.replaced = earlier
        if run:
            with lake.batch_lock(key):  # another process running this batch now: wait, then use its result
                ran_meanwhile = not force and key in instance.get_materialized_partitions(_LAST_ASSET)
                outcome = None if ran_meanwhile else run_job(
                    defs, instance, "log_batch_job", key, log_level=log_level, tags={LAUNCHED_BY_TAG: "flowopt ingest"}
                )  # fmt: skip
            if ran_meanwhile:
                result.message = "another process ingested these bytes while this one waited; its figures are these"
            elif not outcome.success:
                messages, tracebacks = failure_messages(outcome)
                # "flow_assets.logs.records.UnreadableLogError: <file>: why" -> "<file>: why"
                text = "; ".join(_EXCEPTION_PREFIX.sub("", m) for m in messages) or "run failed"
                for snapshot in {lake.batch_snapshot(key), lake.batch_snapshot(key).resolve()}:
                    text = text.replace(display_path(snapshot), display_path(file.path))
                advice = "" if "flowopt schema" in text else f"; {FORMAT_HELP}"
                result.status, result.message, result.traceback = "failed", f"{text}{advice}", "\n".join(tracebacks)
        else:
            result.status = "already_ingested"
            result.message = (f"these bytes were already ingested as partition {key}; nothing ran "
                              f"(--force materialises it again)")  # fmt: skip
        rows = batch_summary(lake, [key]).to_dicts()
        if rows:
            result.summary = {k: v for k, v in rows[0].items() if k not in ("batch", "file")}
            if result.status == "ingested" and not result.summary["trajectories"]:
                reasons = _quarantine_reasons(lake, key)
                result.status = "all_quarantined"
                result.message = (f"every record ({result.summary['quarantined']}) was quarantined"
                                  f"{': ' + reasons if reasons else ''}; {FORMAT_HELP}")  # fmt: skip
            if tip := hint(result.summary):
                result.summary["hint"] = tip
        if earlier and not replace:
            note = (f"batches from earlier bytes under the same name are kept beside this one ({', '.join(earlier)}); "
                    "trajectory ids may repeat; --replace retires them")  # fmt: skip
            result.message = f"{result.message}; {note}" if result.message else note
        results.append(result)
    return results


def exit_code(results: list[FileResult]) -> int:
    """The call's exit code: the most severe status over ``results`` (module docstring)."""
    codes = {_SEVERITY[r.status] for r in results if r.status in _SEVERITY}
    return next((c for c in _ORDER if c in codes), EXIT_OK)
