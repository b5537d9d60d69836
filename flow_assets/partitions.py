"""Partitions: one dynamic partition per log batch (a landed log file)."""

from dagster import DynamicPartitionsDefinition

#: Keys are added by ``new_logs_sensor`` (or ``flowopt ingest``), one per landed file; see
#: ``sensors/landing.py`` for how a key is derived from the file's source, name and sha256.
log_batches = DynamicPartitionsDefinition(name="log_batches")
