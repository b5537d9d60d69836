"""flowopt benchmarks: ``make bench`` (``python -m benchmarks``) measures flowopt against its floors and
against TRL, and writes ``benchmarks/results/latest.json`` and ``latest.md``.

One module per benchmark, each with ``run(quick: bool) -> dict``:

- :mod:`benchmarks.data_plane`: log batch job (ingest -> trajectories -> rewards -> advantages) at
  three sizes, against the time to merely decode the same JSON bytes;
- :mod:`benchmarks.trainer_vs_trl`: one GRPO step, flowopt vs TRL's ``GRPOTrainer``;
- :mod:`benchmarks.collection`: rollouts per second, 8 samples vs 1;
- :mod:`benchmarks.training_round`: one Dagster training round, wall time split;
- :mod:`benchmarks.sample_efficiency`: held-out success vs trajectories trained on.

Shared timing helpers are in :mod:`benchmarks.common`. Timings on shared machines are noisy: every
figure that matters is a ratio of two timings taken in the same run, and every timing is a median
with its spread.
"""
