"""Running the gateway: in a background thread of the calling process (collection, evaluation,
the demo, tests), or in the foreground (``flowopt serve``). Both bind 127.0.0.1 by default and
serve real HTTP with uvicorn. Neither binds an address beyond loopback without bearer tokens
(:func:`check_bind`): anyone who reaches an open gateway could finish rollouts with any score,
and those scores become training data."""

from __future__ import annotations

import ipaddress
import socket
import threading
import time
from collections.abc import Sequence
from pathlib import Path

import uvicorn

from flow_assets.serving.gateway.app import Gateway, create_app
from flow_assets.settings import Settings


def gateway_tokens(tokens_file: str | Path | None = None, settings: Settings | None = None) -> list[str]:
    """The gateway's bearer tokens: ``settings.gateway_tokens`` (``$FLOWOPT_GATEWAY_TOKENS``,
    comma-separated; default settings: the environment, read now) and the lines of
    ``tokens_file`` (one token a line; blank lines and ``#`` comments skipped).

    Raises:
        OSError: ``tokens_file`` cannot be read.
        ValueError: the environment or the project settings file holds a bad flowopt setting (:meth:`Settings.load`).
    """
    tokens = list((settings or Settings.load()).gateway_tokens)
    if tokens_file is not None:
        lines = Path(tokens_file).read_text(encoding="utf-8").splitlines()
        tokens += [line.strip() for line in lines if line.strip() and not line.lstrip().startswith("#")]
    return tokens


def is_loopback(host: str) -> bool:
    """Whether binding ``host`` listens on loopback only (``127.0.0.1``, ``::1``, ``localhost``
    or a name that resolves to loopback addresses only); ``0.0.0.0``, ``::`` and ``""`` are every
    interface, not loopback."""
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        pass
    if not host:
        return False
    try:
        infos = socket.getaddrinfo(host, None)
    except socket.gaierror:
        return False
    return bool(infos) and all(ipaddress.ip_address(info[4][0].split("%")[0]).is_loopback for info in infos)


def check_bind(host: str, tokens: Sequence[str]) -> None:
    """Refuse to serve beyond loopback without tokens.

    Raises:
        ValueError: ``host`` is not loopback and ``tokens`` is empty (the message says what to set).
    """
    if not is_loopback(host) and not any(tokens):
        raise ValueError(
            f"refusing to listen on {host!r} without bearer tokens: anyone reaching it could finish rollouts "
            "with any score; set FLOWOPT_GATEWAY_TOKENS (comma-separated) or --tokens-file, or bind 127.0.0.1"
        )


class GatewayServer:
    """A gateway serving HTTP from a background thread, as a context manager.

    ``port=0`` picks a free port; :attr:`url` is the base URL once started (clients use
    ``url + "/v1"``). On exit the server stops, every open rollout lands as an error and every
    open batch is closed (nothing the gateway sampled is dropped).

    Args:
        gateway: what to serve.
        host / port: where.
        startup_timeout_s: how long to wait for the server to accept connections, seconds.
        tokens: bearer tokens asked for on every route but ``/health`` (required beyond loopback).

    Raises:
        ValueError: ``host`` is not loopback and there are no ``tokens``.
        RuntimeError (on enter): the server did not start in time (e.g. the port is taken).
    """

    def __init__(
        self, gateway: Gateway, host: str = "127.0.0.1", port: int = 0, startup_timeout_s: float = 30.0, tokens: Sequence[str] = ()
    ):
        check_bind(host, tokens)
        self.gateway = gateway
        self.host = host
        self.port = port
        self.startup_timeout_s = startup_timeout_s
        config = uvicorn.Config(create_app(gateway, tokens), host=host, port=port, log_level="warning", access_log=False)
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, name="flowopt-gateway", daemon=True)

    @property
    def url(self) -> str:
        """``http://host:port`` of the running server."""
        return f"http://{self.host}:{self.port}"

    def __enter__(self) -> GatewayServer:
        self._thread.start()
        deadline = time.monotonic() + self.startup_timeout_s
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                self._server.should_exit = True
                raise RuntimeError(f"the gateway did not start on {self.host}:{self.port}")
            time.sleep(0.01)
        self.port = self._server.servers[0].sockets[0].getsockname()[1]
        return self

    def __exit__(self, *exc) -> None:
        self._server.should_exit = True
        self._thread.join()
        self.gateway.close()


def serve_forever(gateway: Gateway, host: str = "127.0.0.1", port: int = 8000, tokens: Sequence[str] = ()) -> None:
    """Serve in the foreground until interrupted (``flowopt serve``); open rollouts and batches
    land on shutdown. ``tokens``: as :class:`GatewayServer`.

    Raises:
        ValueError: ``host`` is not loopback and there are no ``tokens``.
    """
    check_bind(host, tokens)
    try:
        uvicorn.run(create_app(gateway, tokens), host=host, port=port, log_level="info")
    finally:
        gateway.close()
