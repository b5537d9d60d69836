"""Settings every sensor reads when the code location loads."""

from flow_assets.settings import process_settings


def sensor_interval() -> int:
    """Least seconds between two evaluations of a flowopt sensor: ``FLOWOPT_SENSOR_INTERVAL_SECONDS``
    (default 30; the demo uses 1). A sensor is evaluated no more often than the daemon's sensor
    loop comes round: Dagster's 5 s, or ``FLOWOPT_SENSOR_LOOP_SECONDS`` under ``flowopt daemon``,
    which also wakes the loop when a run finishes (``FLOWOPT_RUN_WATCH_SECONDS``) and then lets each sensor tick
    at once, even within this interval (one such early tick per interval at most). Read from the process's settings
    (:func:`flow_assets.settings.process_settings`): the sensors' decorators call it once, on import.

    Raises:
        ValueError: the variable is not a positive integer (the message names it).
    """
    return process_settings().sensor_interval_seconds
