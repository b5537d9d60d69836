"""Settings every sensor reads when the code location loads."""

from flow_assets.settings import process_settings


def sensor_interval() -> int:
    """Least seconds between two evaluations of a flowopt sensor: ``FLOWOPT_SENSOR_INTERVAL_SECONDS``
    (default 30; the demo uses 1, and the daemon's sensor loop itself runs every 5 s), from the
    process's settings (:func:`flow_assets.settings.process_settings`): the sensors' decorators
    call it once, on import.

    Raises:
        ValueError: the variable is not a positive integer (the message names it).
    """
    return process_settings().sensor_interval_seconds
