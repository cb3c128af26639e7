"""Loopback ports for the processes a local stack starts, chosen so nothing else takes them.

Asking the kernel for a free port (bind to port 0) and handing the number to a child that binds
it later leaves a window: the kernel hands out the same ephemeral range to every outgoing
connection on the machine, and one of them can take the port before the child binds it (the
demo once failed at start that way).  So ports come from below the kernel's ephemeral range,
where no outgoing connection lands, and each is claimed with an exclusive lock file that lives
as long as this process: two launchers on one machine (parallel test workers, a benchmark beside
the tests) never hand out the same port.  A port some server already listens on is skipped.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import random
import socket
import tempfile
from pathlib import Path
from typing import IO, Final

LOOPBACK: Final = "127.0.0.1"
# Below this, ports are the well-known and commonly configured ones (databases, dev servers).
_LOWEST: Final = 20_000
_LOCK_DIR: Final = Path(tempfile.gettempdir()) / "kv-epp-ports"
# Claimed ports' lock files, held open until this process exits (the kernel drops the locks).
_claimed: dict[int, IO[bytes]] = {}
_random = random.Random()


def _ephemeral_start() -> int:
    """The first port of the kernel's ephemeral range (32768 when it cannot be read)."""
    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32_768
    return low


def _bindable(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind((LOOPBACK, port))
        except OSError:
            return False
    return True


def _claim(port: int) -> bool:
    """An exclusive lock on ``port``'s file, kept open; False when another process holds it."""
    _LOCK_DIR.mkdir(mode=0o777, parents=True, exist_ok=True)
    path = _LOCK_DIR / f"{port}.lock"
    handle = path.open("ab")
    with contextlib.suppress(OSError):
        os.chmod(path, 0o666)  # another user's launcher may claim it after we exit
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        handle.close()
        return False
    _claimed[port] = handle
    return True


def reserve_port() -> int:
    """A loopback port no other launcher holds, outside the kernel's ephemeral range, that
    nothing listens on now; this process keeps it until it exits (ports are plentiful: some
    12,000 below the usual ephemeral range)."""
    high = _ephemeral_start()
    if high - _LOWEST < 100:
        raise RuntimeError(
            f"the kernel's ephemeral ports start at {high}: too few ports below it for a "
            "local stack (widen net.ipv4.ip_local_port_range's lower bound)"
        )
    for _ in range(1000):
        port = _random.randrange(_LOWEST, high)
        if port in _claimed or not _claim(port):
            continue
        if _bindable(port):
            return port
        # Something listens there: leave the claim (it keeps us from retrying the port).
    raise RuntimeError(f"no free port found between {_LOWEST} and {high} after 1000 tries")


def reserve_ports(count: int) -> int:
    """``count`` consecutive loopback ports, reserved as `reserve_port` does; returns the first.
    What data-parallel ranks need: vLLM offsets a rank's ports by its index."""
    for _ in range(200):
        first = reserve_port()
        rest = range(first + 1, first + count)
        claimed = []
        for port in rest:
            if port in _claimed or not _claim(port):
                break
            claimed.append(port)
            if not _bindable(port):
                break
        else:
            return first
        # A run with a taken port: the claims stay (this process will not retry those ports).
    raise RuntimeError(f"no run of {count} free loopback ports found after 200 tries")
