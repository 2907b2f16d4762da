"""Serving an app from a background thread: :class:`ServerThread` (benchmarks, tests, notebooks)."""

from __future__ import annotations

import threading
import time

__all__ = ["ServerThread"]


class ServerThread:
    """Runs an app with uvicorn in a background thread (benchmarks, tests).

    ``with ServerThread(app) as s: httpx.get(s.url + "/health")``; leaving the block
    shuts uvicorn down (graceful drain, then the app's lifespan stops the engine loop).
    ``port=0`` picks a free port.
    """

    def __init__(
        self, app, host: str = "127.0.0.1", port: int = 0, log_level: str = "warning", graceful_timeout: float = 10.0
    ):
        import socket

        import uvicorn

        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((host, port))
        self.host, self.port = host, self.sock.getsockname()[1]
        # log_config=None: uvicorn's own config would bind handlers to the sys.stderr of the
        # moment (a test's capture buffer, closed later); the caller's logging setup applies.
        self.server = uvicorn.Server(
            uvicorn.Config(
                app,
                log_level=log_level,
                timeout_graceful_shutdown=graceful_timeout,  # pyright: ignore[reportArgumentType]  # seconds, float
                access_log=False,
                lifespan="on",
                log_config=None,
            )
        )
        self.thread = threading.Thread(
            target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True, name="uvicorn"
        )

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self, timeout: float = 60.0) -> ServerThread:
        self.thread.start()
        t0 = time.monotonic()
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() - t0 > timeout:
                raise RuntimeError("the HTTP server did not start")
            time.sleep(0.02)
        return self

    def stop(self, timeout: float = 60.0) -> None:
        self.server.should_exit = True
        self.thread.join(timeout)
        self.sock.close()

    def __enter__(self) -> ServerThread:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
