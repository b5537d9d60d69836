"""``new_logs_sensor``: one dynamic partition and one run per new log file in the landing dir."""


import json
import time
from pathlib import Path

from dagster import DefaultSensorStatus, RunRequest, SensorEvaluationContext, SensorResult, SkipReason, sensor

from flow_assets.jobs import log_batch_job
from flow_assets.partitions import log_batches
from resources.lake import BatchManifest, TrajectoryLake
from resources.landing import LogLanding
from sensors.landing import batch_key, list_landed, sha256_file


def _load_cursor(raw: str | None) -> dict[str, list]:
    # relpath -> [size_bytes, mtime_ns, sha256]: lets a tick skip re-hashing unchanged files
    return json.loads(raw) if raw else {}


@sensor(job=log_batch_job, minimum_interval_seconds=30, default_status=DefaultSensorStatus.RUNNING)
def new_logs_sensor(context: SensorEvaluationContext, lake: TrajectoryLake, landing: LogLanding):
    """Registers every new or rewritten file in the landing directory as a log batch.

    Idempotent across ticks and restarts: the cursor remembers each file's size, mtime and
    sha256, and a key that is already a partition is never requested again (so a lost cursor
    costs only re-hashing). A tick only hashes and writes manifests; the copy into the lake is
    made by the batch's run (``interaction_logs``), which checks the bytes against the hash.
    Hashing stops for the tick once ``landing.tick_budget_seconds`` are spent (after at least
    one file), so a tick stays far from Dagster's 60 s sensor timeout whatever arrives at once;
    the files left are not in the cursor yet and are taken up by the next tick.
    """
    cursor = _load_cursor(context.cursor)
    new_keys: list[str] = []
    started, hashed, left = time.monotonic(), 0, 0
    for landed in list_landed(Path(landing.directory)):
        known = cursor.get(landed.relpath)
        if known and known[0] == landed.size_bytes and known[1] == landed.mtime_ns:
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
        cursor[landed.relpath] = [landed.size_bytes, landed.mtime_ns, digest]
        key = batch_key(landed, digest)
        if key in new_keys or context.instance.has_dynamic_partition(log_batches.name, key):
            continue
        lake.register_batch(
            BatchManifest(
                key=key,
                source=landed.source,
                original_path=str(landed.path),
                file_name=landed.path.name,
                sha256=digest,
                size_bytes=landed.size_bytes,
                fmt=landing.format_for(landed.relpath),
                landing_relpath=landed.relpath,
            )
        )
        new_keys.append(key)
    if left:
        context.log.info(f"{left} new file(s) left for the next tick (hashing budget {landing.tick_budget_seconds} s spent)")
    new_cursor = json.dumps(cursor, sort_keys=True)
    if not new_keys:
        reason = f"{left} file(s) left for the next tick" if left else "no new log files"
        return SensorResult(skip_reason=SkipReason(reason), cursor=new_cursor)
    return SensorResult(
        run_requests=[RunRequest(run_key=key, partition_key=key) for key in new_keys],
        dynamic_partitions_requests=[log_batches.build_add_request(new_keys)],
        cursor=new_cursor,
    )
