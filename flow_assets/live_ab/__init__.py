"""The live A/B of champion and challenger: ``stats`` (the always-valid sequential test, pure
numpy), ``evidence`` (outcomes per arm from the lake, plain functions), ``assets`` (``ab_test_report``).
Its settings are ``resources/live_ab.py``; ``sensors/ab_monitor.py`` acts on its decision."""
