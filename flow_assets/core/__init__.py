"""Foundations every domain shares, with no flowopt import of their own: the pure-config to
Dagster-config bridge (``config``), run tags and gate decisions (``run_tags``), partitions, code
versions, UI metadata helpers, atomic file writes, user-code imports (``imports``), what the servers
do with untrusted input (``untrusted``), and worker processes that die with their owner."""
