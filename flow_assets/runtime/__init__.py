"""How flowopt's Dagster runs execute on one machine: ``deployment`` (a local daemon), ``local``
(one sensor tick and its runs in process), ``run_launcher`` (run processes started ahead with the heavy
imports done) and ``recovery`` (runs whose process died: marked failed, cleaned, run again)."""
