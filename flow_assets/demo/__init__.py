"""The demos: ``run`` (``flowopt demo``: real logs, then two trainable agents under the daemon,
and the report), ``real`` (``flowopt demo-real``: SmolLM2-135M-Instruct as a tool-using agent) and
``ui_tour`` (the Dagster UI checked in headless Chromium)."""
