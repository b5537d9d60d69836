"""``new_logs_sensor``: one dynamic partition and one run per new log file in the landing dir."""


import json
import time
from pathlib import Path

from dagster import DefaultSensorStatus, RunRequest, SensorEvaluationContext, SensorResult, SkipReason, sensor

from flow_assets.jobs import log_batch_job
from flow_assets.core.partitions import log_batches
from flow_assets.runtime.recovery import batches_to_rerun, recover_dead_runs, retire_grown_batches
from resources.lake import BatchManifest, TrajectoryLake
from resources.landing import LogLanding
from flow_assets.logs.landing import batch_key, list_landed, sha256_file
from sensors.settings import sensor_interval


def _load_cursor(raw: str | None) -> dict[str, list]:
    # relpath -> [size_bytes, mtime_ns, ctime_ns, inode, sha256]: lets a tick skip re-hashing
    # unchanged files (an entry of an older layout never matches, so costs one re-hash)
    return json.loads(raw) if raw else {}


@sensor(
    job=log_batch_job,
    minimum_interval_seconds=sensor_interval(),
    default_status=DefaultSensorStatus.RUNNING,
    description=(
        "Each new or rewritten log file in the landing directory (settled, not a symlink or hard link) "
        "becomes one log batch partition and one run of log_batch_job. Files already registered are "
        "never requested again; a batch whose run died is re-run once."
    ),
)
def new_logs_sensor(context: SensorEvaluationContext, lake: TrajectoryLake, landing: LogLanding):
    """Registers every new or rewritten file in the landing directory as a log batch.

    Idempotent across ticks and restarts: the cursor remembers each file's size, mtime, ctime,
    inode and sha256 (a rewrite that keeps size and mtime still moves the ctime), and a key that is already a partition is never requested again (so a lost cursor
    costs only re-hashing). A tick only hashes and writes manifests; the copy into the lake is
    made by the batch's run (``interaction_logs``), which checks the bytes against the hash.
    Hashing stops for the tick once ``landing.tick_budget_seconds`` are spent (after at least
    one file), so a tick stays far from Dagster's 60 s sensor timeout whatever arrives at once;
    the files left are not in the cursor yet and are taken up by the next tick. A file modified
    within ``landing.settle_seconds`` waits too (it may be written in place); symbolic links are
    never followed (:func:`flow_assets.logs.landing.list_landed`).
    """
    cursor = _load_cursor(context.cursor)
    new_keys: list[str] = []
    started, hashed, left, settling = time.monotonic(), 0, 0, 0
    refused: list[tuple[Path, str]] = []
    for landed in list_landed(Path(landing.directory), refused):
        known = cursor.get(landed.relpath)
        if known and known[:-1] == landed.fingerprint():
            continue
        if time.time_ns() - landed.mtime_ns < landing.settle_seconds * 1e9:
            settling += 1  # maybe still being written in place: a later tick takes it
            continue
        if hashed and time.monotonic() - started >= landing.tick_budget_seconds:
            left += 1
            continue
        try:
            digest = sha256_file(landed.path)
        except OSError as error:  # removed or unreadable since listing: not this tick's business
            context.log.warning(f"{landed.path}: skipped this tick ({error.strerror or error})")
            continue
        hashed += 1
        cursor[landed.relpath] = [*landed.fingerprint(), digest]
        key = batch_key(landed, digest)
        if key in new_keys or context.instance.has_dynamic_partition(log_batches.name, key):
            continue
        # a file registered while its writer paused, grown since: its early batch goes, or the
        # records of its first part would land twice; while that batch's run runs, wait. Only
        # a name seen before can have one (reading every manifest for each new name would not scale)
        retired, busy = retire_grown_batches(context.instance, lake, landed) if known else ([], [])
        if busy:
            cursor[landed.relpath] = known  # still "changed" next tick, so looked at again
            settling += 1
            context.log.info(f"{landed.path}: grew after batch {busy[0]} was registered from it; waits for that run to finish")
            continue
        for old in retired:
            context.log.info(f"batch {old}: retired, its file {landed.relpath} grew; batch {key} holds every record of it")
        lake.register_batch(BatchManifest.of_landed(key, landed, digest, landing.format_for(landed.relpath)))
        new_keys.append(key)
    for path, why in refused:
        context.log.warning(f"{path}: {why}")
    if left:
        context.log.info(f"{left} new file(s) left for the next tick (hashing budget {landing.tick_budget_seconds} s spent)")
    if settling:
        context.log.info(f"{settling} file(s) modified in the last {landing.settle_seconds} s wait for a later tick")
    new_cursor = json.dumps(cursor, sort_keys=True)
    # batches whose run died (kill -9, lost machine) run again; the run key names the dead run,
    # so each death is retried once however many ticks see it
    recover_dead_runs(context.instance, lake)
    retries = [RunRequest(run_key=f"{key}:after-{run_id[:8]}", partition_key=key) for key, run_id in batches_to_rerun(context.instance).items()]
    for retry in retries:
        context.log.info(f"batch {retry.partition_key}: its last run died; running it again")
    if not new_keys and not retries:
        waiting = left + settling
        reason = f"{waiting} file(s) left for a later tick" if waiting else "no new log files"
        return SensorResult(skip_reason=SkipReason(reason), cursor=new_cursor)
    return SensorResult(
        run_requests=[RunRequest(run_key=key, partition_key=key) for key in new_keys] + retries,
        dynamic_partitions_requests=[log_batches.build_add_request(new_keys)] if new_keys else [],
        cursor=new_cursor,
    )
