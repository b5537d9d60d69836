"""The data plane, per log batch: interaction_logs -> trajectories -> rewards -> advantages.

``assets`` (the Dagster assets, thin wrappers of :mod:`flow_assets.logs` and :mod:`flow_assets.rl`),
``checks`` (the blocking data checks every path to training reads), ``summary`` (per-batch and
per-source summaries of the lake, as ``flowopt ingest`` and the demo print them)."""
