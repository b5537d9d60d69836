"""The demos. ``run`` is ``flowopt demo``: real logs, then two trainable agents under the daemon,
and the report; ``phases`` holds what it watches the daemon do (rounds, the live A/B, workflow
proposals), ``in_process`` the rounds driven from this process (as ``demo-real`` and the
``training_round`` benchmark run them), ``state`` where the demo's state lives and its marker.
``real`` is ``flowopt demo-real`` (SmolLM2-135M-Instruct as a tool-using agent) and ``ui_tour``
checks the Dagster UI in headless Chromium."""
