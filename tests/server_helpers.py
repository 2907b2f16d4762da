"""Helpers shared by the server tests (real engine: test_server.py; fake engine: test_server_http.py)."""

from __future__ import annotations

import time


def metric(text: str, name: str, **labels) -> float:
    """Sum of the Prometheus samples of ``name`` in ``text`` whose labels include ``labels``."""
    total = 0.0
    for line in text.splitlines():
        if (line.startswith(name + "{") or line.startswith(name + " ")) and all(
            f'{k}="{v}"' in line for k, v in labels.items()
        ):
            total += float(line.rsplit(" ", 1)[1])
    return total


def wait_idle(client, timeout: float = 10.0, poll: float = 0.01) -> dict:
    """Polls ``/health`` until no request runs or waits (or ``timeout`` seconds); returns it."""
    t0 = time.monotonic()
    while True:
        h = client.get("/health").json()
        if (h["running"] == 0 and h["waiting"] == 0) or time.monotonic() - t0 > timeout:
            return h
        time.sleep(poll)
