"""Partitions: one dynamic partition per log batch (a landed log file), and one per registry
version evaluated on its own."""

from dagster import DynamicPartitionsDefinition

#: Keys are added by ``new_logs_sensor`` (or ``flowopt ingest``), one per landed file; see
#: ``flow_assets/logs/landing.py`` for how a key is derived from the file's source, name and sha256.
log_batches = DynamicPartitionsDefinition(name="log_batches")

#: Registry versions (``v0``, ``v3``, ...) that ``adapter_evaluation`` evaluated, added by
#: whoever asks for one (``training.evaluate``, the UI's partition dialog).
adapter_versions = DynamicPartitionsDefinition(name="adapter_versions")
