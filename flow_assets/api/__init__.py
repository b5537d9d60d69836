"""The training API: JSON-RPC 2.0 over HTTP on Dagster runs (``flowopt api``)."""
