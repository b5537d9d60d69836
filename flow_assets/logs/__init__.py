"""Agent logs, from bytes on disk to canonical trajectories: ``formats`` (one parser per log
family, and the plug-in protocol in ``plugins``), ``reader`` (detection, streaming, quarantine),
``redact``, ``schema`` (the canonical trajectory), ``tables`` (the lake's rows), ``landing`` (landing
keys), and ``ingest`` (``flowopt ingest``: named files into the lake, one result per file)."""
