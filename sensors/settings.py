"""Settings every sensor reads when the code location loads."""

import os


def sensor_interval() -> int:
    """Least seconds between two evaluations of a flowopt sensor: ``FLOWOPT_SENSOR_INTERVAL_SECONDS``
    (default 30; the demo uses 1, and the daemon's sensor loop itself runs every 5 s).

    Raises:
        ValueError: the variable is not a positive integer (the message names it).
    """
    raw = os.environ.get("FLOWOPT_SENSOR_INTERVAL_SECONDS", "30")
    if not raw.isdigit() or int(raw) < 1:
        raise ValueError(f"FLOWOPT_SENSOR_INTERVAL_SECONDS must be a positive integer, got {raw!r}")
    return int(raw)
