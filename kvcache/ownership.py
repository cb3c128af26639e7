"""Which pods' KV-event streams this EPP replica ingests, when replicas share a store.

With a shared index (``kvBlockIndexConfig.redisConfig``) every replica reads everything, but
each pod's events need to be written by one replica only: ingestion then grows with replicas
instead of costing each of them the whole fleet's stream.  Replicas hold leases in the store (a
sorted set of replica → expiry, renewed every third of ``leaseSeconds``, timed by the server's
clock); a pod's stream belongs to the live replica that ranks first for it by rendezvous
hashing, which every replica computes alike from the same live set.  When a replica dies its
lease expires and its pods move to the others within ``leaseSeconds`` plus one renewal; the new
owner subscribes, and its first contact fetches the pod's replay buffer from seq 0, so the
events published meanwhile are applied (writes are idempotent: re-applying what was written
changes nothing).  A replica that stops cleanly leaves at once.  While the store does not answer
(or its renewals time out), a replica keeps the streams it has: a renewal that timed out on
this side has often been applied by the server, so the lease may well be alive and nobody else
would take the pods; if it did lapse, another replica ingests them too for a while, which the
idempotent writes tolerate better than no replica ingesting them.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import socket
import threading
import uuid
from collections.abc import Callable, Iterable
from concurrent.futures import Executor
from typing import TYPE_CHECKING

from epp.gauges import GaugeSample

if TYPE_CHECKING:
    from kvcache.redis_index import RedisStore
    from scorers.base import Endpoint

logger = logging.getLogger(__name__)


def replica_name() -> str:
    """This process's name among the replicas: the pod's name (``POD_NAME``, set by the chart)
    or the host's, with the process id and a random suffix (a restarted process is a new
    replica)."""
    base = os.environ.get("POD_NAME") or socket.gethostname()
    return f"{base}-{os.getpid()}-{uuid.uuid4().hex[:6]}"


def owner(endpoint: str, replicas: Iterable[str]) -> str | None:
    """The replica that ingests ``endpoint``'s events: rendezvous hashing, so a replica joining
    or leaving moves only the pods it gains or held."""

    def rank(replica: str) -> bytes:
        return hashlib.blake2b(f"{replica}\0{endpoint}".encode(), digest_size=8).digest()

    return max(replicas, key=rank, default=None)


class StreamOwnership:
    """Keeps this replica's lease and subscribes to exactly the pods it owns."""

    def __init__(
        self,
        store: RedisStore,
        lease_s: float,
        subscribe: Callable[[Endpoint], None],
        unsubscribe: Callable[[str], None],
        *,
        replica: str | None = None,
    ) -> None:
        self.store = store
        self.replica = replica or replica_name()
        self.lease_s = lease_s
        self._subscribe = subscribe
        self._unsubscribe = unsubscribe
        self._known: dict[str, Endpoint] = {}
        self.owned: set[str] = set()
        self.live: list[str] = [self.replica]
        self._thread: threading.Thread | None = None
        self._stopping = threading.Event()
        self._executor: Executor | None = None
        self.moves_total = 0

    async def start(self, executor: Executor | None) -> None:
        """Take the lease (before SERVING, so the first streams are already shared out), then
        keep it from a thread of its own: an event loop busy with a flood of events must not
        let the lease lapse and the streams flap between replicas."""
        loop = asyncio.get_running_loop()
        self._executor = executor
        self._apply(await loop.run_in_executor(executor, self._renew_once))
        self._stopping.clear()
        self._thread = threading.Thread(
            target=self._keep, args=(loop,), name="kv-lease", daemon=True
        )
        self._thread.start()

    async def stop(self) -> None:
        self._stopping.set()
        thread, self._thread = self._thread, None
        loop = asyncio.get_running_loop()
        if thread is not None:
            await loop.run_in_executor(self._executor, thread.join, 5.0)
        await loop.run_in_executor(self._executor, self.store.leave, self.replica)

    def _keep(self, loop: asyncio.AbstractEventLoop) -> None:
        while not self._stopping.wait(self.lease_s / 3):
            live = self._renew_once()
            if live is not None and not loop.is_closed():
                loop.call_soon_threadsafe(self._apply, live)

    def _renew_once(self) -> list[str] | None:
        return self.store.renew(self.replica, self.lease_s)

    def endpoint_added(self, endpoint: Endpoint) -> None:
        self._known[endpoint.address] = endpoint
        self._reassign()

    def endpoint_removed(self, address: str) -> None:
        self._known.pop(address, None)
        self.owned.discard(address)

    def _apply(self, live: list[str] | None) -> None:
        """A renewal's answer (on the event loop): the streams follow the live replicas."""
        if live is None:
            return  # the store does not answer: keep the streams this replica has
        if self.replica not in live:
            live.append(self.replica)
        if sorted(live) != sorted(self.live):
            logger.info("KV-event replicas now: %s (this one: %s)", ", ".join(live), self.replica)
        self.live = live
        self._reassign()

    def _reassign(self) -> None:
        mine = {a for a in self._known if owner(a, self.live) == self.replica}
        for address in sorted(mine - self.owned):
            self._subscribe(self._known[address])
            self.moves_total += 1
        for address in sorted(self.owned - mine):
            self._unsubscribe(address)
            self.moves_total += 1
        self.owned = mine

    def telemetry_samples(self) -> Iterable[GaugeSample]:
        yield GaugeSample(
            "inference_extension_kv_replicas_live",
            "EPP replicas holding a live lease on the shared KV-cache store.",
            len(self.live),
        )
        yield GaugeSample(
            "inference_extension_kv_stream_moves",
            "KV-event streams this replica took over or handed over (cumulative).",
            self.moves_total,
        )
        for address in self._known:
            yield GaugeSample(
                "inference_extension_kv_stream_owned",
                "1 while this replica ingests the endpoint's KV events into the shared store.",
                1.0 if address in self.owned else 0.0,
                (("endpoint", address),),
            )
