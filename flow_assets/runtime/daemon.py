"""``flowopt daemon``: ``dagster-daemon`` whose sensor loop runs every
``FLOWOPT_SENSOR_LOOP_SECONDS`` instead of Dagster's fixed 5 s.

Why: a sensor is evaluated no more often than the daemon's sensor loop comes round, whatever its
``minimum_interval_seconds``, and Dagster fixes that loop at 5 s (``MIN_INTERVAL_LOOP_TIME`` in
``dagster._daemon.sensor``, read at the end of every iteration; no instance or CLI setting exposes
it). A training round is a chain of sensor hops (collection -> data plane -> round -> history,
each started by a sensor seeing the one before it finish), so on the demo's short rounds the wait
for the next loop, 2.5 s on average per hop, was a large part of the round
(``docs/benchmarks.md``, ``training_round``).

The loop time is set once, in this process, before Dagster starts its daemon threads (nothing else
runs yet to read it), then Dagster's own CLI runs unchanged: ``flowopt daemon run -w
workspace.yaml`` takes exactly ``dagster-daemon``'s arguments. A Dagster release without that
constant is run as it is, at its own loop time, with a warning.
"""

from __future__ import annotations

import warnings

from flow_assets.settings import DEFAULT_SENSOR_LOOP_SECONDS


def set_sensor_loop(seconds: float) -> bool:
    """Make this process's Dagster sensor daemon start an iteration at most every ``seconds``
    (an iteration that takes longer is followed at once by the next). Call it before the daemon
    threads start.

    Returns:
        Whether this Dagster release has the loop constant (false: nothing was changed, a
        warning says so).

    Raises:
        ValueError: ``seconds`` is not positive.
    """
    if not seconds > 0:
        raise ValueError(f"the sensor loop time must be positive seconds, got {seconds!r}")
    import dagster._daemon.sensor as sensor_daemon

    if not isinstance(getattr(sensor_daemon, "MIN_INTERVAL_LOOP_TIME", None), (int, float)):
        warnings.warn("this Dagster release has no dagster._daemon.sensor.MIN_INTERVAL_LOOP_TIME: the sensor loop keeps Dagster's own time", stacklevel=2)
        return False
    sensor_daemon.MIN_INTERVAL_LOOP_TIME = seconds
    return True


def run_daemon(argv: list[str], sensor_loop_seconds: float = DEFAULT_SENSOR_LOOP_SECONDS) -> int:
    """Run ``dagster-daemon`` with ``argv`` (e.g. ``["run", "-w", "workspace.yaml"]``) in this
    process, its sensor loop set to ``sensor_loop_seconds`` first (:func:`set_sensor_loop`; the
    default leaves Dagster's own).

    Returns:
        ``dagster-daemon``'s exit status.

    Raises:
        ValueError: ``sensor_loop_seconds`` is not positive.
    """
    if sensor_loop_seconds != DEFAULT_SENSOR_LOOP_SECONDS:
        set_sensor_loop(sensor_loop_seconds)
    from dagster._daemon.cli import create_dagster_daemon_cli

    try:
        create_dagster_daemon_cli().main(args=list(argv), prog_name="dagster-daemon", standalone_mode=True)
    except SystemExit as stop:
        return stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
    return 0
