"""Running the gateway: in a background thread of the calling process (collection, evaluation,
the demo, tests), or in the foreground (``flowopt serve``). Both bind 127.0.0.1 by default and
serve real HTTP with uvicorn."""

from __future__ import annotations

import threading
import time

import uvicorn

from flow_assets.gateway.app import Gateway, create_app


class GatewayServer:
    """A gateway serving HTTP from a background thread, as a context manager.

    ``port=0`` picks a free port; :attr:`url` is the base URL once started (clients use
    ``url + "/v1"``). On exit the server stops, every open rollout lands as an error and every
    open batch is closed (nothing the gateway sampled is dropped).

    Args:
        gateway: what to serve.
        host / port: where.
        startup_timeout_s: how long to wait for the server to accept connections, seconds.

    Raises (on enter):
        RuntimeError: the server did not start in time (e.g. the port is taken).
    """

    def __init__(self, gateway: Gateway, host: str = "127.0.0.1", port: int = 0, startup_timeout_s: float = 30.0):
        self.gateway = gateway
        self.host = host
        self.port = port
        self.startup_timeout_s = startup_timeout_s
        config = uvicorn.Config(create_app(gateway), host=host, port=port, log_level="warning", access_log=False)
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
        self.gateway.batcher.close()


def serve_forever(gateway: Gateway, host: str = "127.0.0.1", port: int = 8000) -> None:
    """Serve in the foreground until interrupted (``flowopt serve``); open rollouts and batches
    land on shutdown."""
    try:
        uvicorn.run(create_app(gateway), host=host, port=port, log_level="info")
    finally:
        gateway.batcher.close()
