"""A uvicorn server for an app in a daemon thread of this process, on a free loopback port bound before
it starts: used by the tests and by the load benchmark (bench/serve_load.py)."""

from __future__ import annotations

import socket
import threading
import time


class BackgroundServer:
    def __init__(self, app, ready_timeout: float = 20.0):
        import httpx

        from .main import uvicorn_server

        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        # As `speculate serve` runs it: its timeouts, connection cap and graceful stop (app.state.config).
        self.server = uvicorn_server(app, app.state.config, log_level="warning", access_log=False, lifespan="on")
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + ready_timeout
        while True:
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError("the server did not become healthy")
            time.sleep(0.05)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(15)
        self.sock.close()
