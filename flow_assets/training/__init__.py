"""Training rounds: ``rounds`` (a round as plain functions with typed hand-offs), ``assets``
(their thin Dagster assets), ``run_config`` (the one builder of a round's run config),
``adapter_evaluation``, ``champion`` (the registry as an asset), ``history`` (one row per round),
``budget`` (token and cost accounting) and ``tracking`` (optional export to an experiment tracker)."""
