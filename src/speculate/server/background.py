"""A uvicorn server for an app in a daemon thread of this process, on a free loopback port bound before
it starts: used by the tests and by the load benchmark (bench/serve_load.py). And the two helpers every server a
benchmark or test starts needs: a free loopback port, and a wait until its /health answers."""

from __future__ import annotations

import socket
import threading
import time
from typing import Callable


def free_port() -> int:
    """A loopback port that is free now (bound, then released, for a server process started next to bind)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(url: str, timeout: float, alive: Callable[[], bool] = lambda: True, interval: float = 0.05) -> bool:
    """Poll ``url``/health until it answers 200 (True), or until ``alive()`` says the server is gone or ``timeout``
    seconds pass (False)."""
    import httpx

    deadline = time.monotonic() + timeout
    while alive():
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return True
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline:
            return False
        time.sleep(interval)
    return False


class BackgroundServer:
    def __init__(self, app, ready_timeout: float = 20.0):
        from .main import uvicorn_server

        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        # As `speculate serve` runs it: its timeouts, connection cap and graceful stop (app.state.config).
        self.server = uvicorn_server(app, app.state.config, log_level="warning", access_log=False, lifespan="on")
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)
        self.thread.start()
        if not wait_healthy(self.url, ready_timeout, self.thread.is_alive):
            self.stop()
            raise RuntimeError("the server did not become healthy")

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(15)
        self.sock.close()
