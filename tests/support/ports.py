"""Waiting for a listener, for tests that start real servers (ports: `launcher.ports`)."""

from __future__ import annotations

import socket
import time


def wait_for_port(host: str, port: int, *, timeout: float = 30.0) -> None:
    """Poll until something accepts TCP connections on host:port."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            with socket.create_connection((host, port), timeout=1.0):
                return
        except OSError as exc:
            if time.monotonic() > deadline:
                raise TimeoutError(f"nothing listening on {host}:{port} after {timeout}s") from exc
            time.sleep(0.05)
