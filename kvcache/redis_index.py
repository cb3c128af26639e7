"""A KV-block index in a Redis or Valkey server (``kvBlockIndexConfig.redisConfig``).

Layout, under a namespace (``namespace``, default ``kv-epp``) so several pools can share one
server: one hash per endpoint, ``{ns}:e:{endpoint}``, block key (8 bytes, big-endian) → the tiers
the endpoint holds the block on, as bits (GPU 1, CPU 2, STORAGE 4).  A restart or a departure is
one ``UNLINK``; the endpoint's size is ``HLEN``.

Every write is one Lua script (atomic, one round trip, the block keys sent as one string).  A
lookup is two round trips: a script answers each candidate's size and whether it holds block 0,
then one pipelined HMGET of the whole prompt per holder.  Scripts name their keys
in ARGV, so this needs one server (or a primary with replicas), not Redis Cluster.

Writes come from the event path, on the event loop's thread; they are queued and a writer
thread sends them in pipelines, in order, so ingestion never waits for the network.  Lookups are
called from the CPU executor (the backend is ``blocking``).  The self-check of the pods' keys
(`indexer.key_check.KeyCheck`) runs in this process before anything is written, so the store
holds the keys requests will look up.

When the store cannot be reached, lookups answer "nothing held" (routing falls back to load),
writes are dropped and counted, the outage is logged once and exported
(``inference_extension_kv_store_up``), and the writer keeps trying; nothing fails a request.
Entries are not bounded by ``maxIndexEntries`` here: removals keep the store at the fleet's real
cache size; give the server memory for it (``benchmarks.kvstore`` measures the bytes per
(block, endpoint) entry).
"""

from __future__ import annotations

import contextlib
import logging
import queue
import struct
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Final, cast

import valkey

from epp.gauges import GaugeSample
from indexer.errors import IndexerError
from indexer.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch, block_key
from indexer.hashing import HashConfig
from indexer.index import (
    DEFAULT_MAX_ENTRIES,
    TIERS,
    PrefixMatch,
    tier_of,
    validated_tier_weights,
)
from indexer.key_check import EndpointKeyState, KeyCheck
from kvcache.backend import BlockMatch, mismatch_samples

logger = logging.getLogger(__name__)

_UINT64: Final = (1 << 64) - 1
_WRITES_PER_PIPELINE: Final = 256  # queued writes sent in one round trip
_RETRY_S: Final = 1.0  # between connection attempts while the store is down
_STOP: Final = object()

# (script, endpoint, tier bits, block keys), as the writer sends it.
_Write = tuple[Any, str, int, Sequence[int]]

# A write's block keys travel as one string of 8-byte big-endian keys (ARGV[4]): one argument
# instead of hundreds to encode and parse.
_KEYS_OF: Final = """
local function keys_of(blob)
  local out = {}
  for i = 1, #blob, 8 do out[#out + 1] = string.sub(blob, i, i + 7) end
  return out
end
"""

_STORE: Final = (
    _KEYS_OF
    + """
local held, bits = ARGV[1] .. ':e:' .. ARGV[2], tonumber(ARGV[3])
local keys = keys_of(ARGV[4])
local now = redis.call('HMGET', held, unpack(keys))
local set = {}
for i, key in ipairs(keys) do
  local was = tonumber(now[i]) or 0
  local new = bit.bor(was, bits)
  if new ~= was then
    set[#set + 1] = key
    set[#set + 1] = new
  end
end
if #set > 0 then redis.call('HSET', held, unpack(set)) end
return 0
"""
)

_REMOVE: Final = (
    _KEYS_OF
    + """
local held, bits = ARGV[1] .. ':e:' .. ARGV[2], tonumber(ARGV[3])
local keys = keys_of(ARGV[4])
local now = redis.call('HMGET', held, unpack(keys))
local set, gone = {}, {}
for i, key in ipairs(keys) do
  local was = tonumber(now[i]) or 0
  local new = bit.band(was, bit.bnot(bits))
  if was ~= 0 and new == 0 then
    gone[#gone + 1] = key
  elseif new ~= was then
    set[#set + 1] = key
    set[#set + 1] = new
  end
end
if #gone > 0 then redis.call('HDEL', held, unpack(gone)) end
if #set > 0 then redis.call('HSET', held, unpack(set)) end
return 0
"""
)

_CLEAR: Final = """
local held = ARGV[1] .. ':e:' .. ARGV[2]
local count = redis.call('HLEN', held)
redis.call('UNLINK', held)
return count
"""

# The first round trip of a lookup: ARGV = namespace, block 0's key, then the endpoints.  Per
# endpoint, its entries (HLEN) and its tier bits for block 0 (false when it does not hold it).
_CANDIDATES: Final = """
local ns, first = ARGV[1], ARGV[2]
local out = {}
for e = 3, #ARGV do
  local held = ns .. ':e:' .. ARGV[e]
  out[#out + 1] = redis.call('HLEN', held)
  out[#out + 1] = redis.call('HGET', held, first)
end
return out
"""

# Renew a replica's lease, drop expired ones, return the live replicas (the server's clock).
_RENEW: Final = """
local replicas, id, lease = ARGV[1] .. ':replicas', ARGV[2], tonumber(ARGV[3])
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
redis.call('ZADD', replicas, now + lease, id)
redis.call('ZREMRANGEBYSCORE', replicas, '-inf', now)
return redis.call('ZRANGE', replicas, 0, -1)
"""

_ADDRESS_SCHEMES: Final = ("redis://", "rediss://", "valkey://", "valkeys://", "unix://")


def _packed(keys: Sequence[int]) -> bytes:
    return struct.pack(f">{len(keys)}Q", *keys)


class KVStoreError(IndexerError, ValueError):
    """The configured store cannot be used (a malformed address, a server that does not answer
    at start)."""


class RedisStore:
    """The connection to one Redis/Valkey server, its scripts and the writer thread."""

    def __init__(
        self,
        address: str,
        namespace: str,
        *,
        timeout_s: float = 0.5,
        write_timeout_s: float = 5.0,
    ) -> None:
        """``timeout_s`` bounds a lookup and a lease renewal (the request path must not wait
        long for a store); ``write_timeout_s`` the writer's wait for a pipeline's answers.  A
        timeout is "busy", not "down": only the writer's, after ``write_timeout_s``, or a refused
        or reset connection counts as an outage (which drops writes)."""
        if not address.startswith(_ADDRESS_SCHEMES):
            raise KVStoreError(
                f"KV-cache store address {address!r} must start with one of "
                f"{', '.join(_ADDRESS_SCHEMES)} (e.g. redis://valkey.kv.svc:6379)"
            )
        if "decode_responses" in address or "protocol=3" in address:
            raise KVStoreError(
                f"KV-cache store address {address!r}: decode_responses and protocol=3 are not "
                "supported (the index reads raw bytes over RESP2); remove them"
            )
        self.address = address
        self.namespace = namespace
        self._timeout_s = timeout_s
        try:
            self._client = valkey.Valkey.from_url(
                address, socket_timeout=timeout_s, socket_connect_timeout=timeout_s
            )
            self._writes = valkey.Valkey.from_url(
                address, socket_timeout=write_timeout_s, socket_connect_timeout=timeout_s
            )
        except ValueError as exc:
            raise KVStoreError(f"KV-cache store address {address!r}: {exc}") from exc
        self._store = self._client.register_script(_STORE)
        self._remove = self._client.register_script(_REMOVE)
        self._clear = self._client.register_script(_CLEAR)
        self._candidates = self._client.register_script(_CANDIDATES)
        self._renew = self._client.register_script(_RENEW)
        self._queue: queue.SimpleQueue[object] = queue.SimpleQueue()
        self._writer: threading.Thread | None = None
        self.up = True
        self.outages_total = 0
        self.writes_total = 0
        self.dropped_writes_total = 0
        self.lookup_errors_total = 0
        self.lookup_timeouts_total = 0
        self.renew_timeouts_total = 0
        self._writes_down = False  # the writer's last pipeline failed to reach the server
        self.write_errors_total = 0
        self._slow = False  # the last lookup timed out (logged once until one answers)
        # Endpoints some of whose writes were dropped during an outage, and who is told (from
        # the thread that sees the store answer again) so their entries can be rebuilt.
        self._dirty: set[str] = set()
        self._dirty_lock = threading.Lock()
        self.on_recovered: Callable[[set[str]], None] | None = None

    def check(self) -> None:
        """Raise `KVStoreError` unless the server answers (at start, before SERVING)."""
        try:
            self._client.ping()
        except valkey.ValkeyError as exc:
            raise KVStoreError(
                f"KV-cache store {self.address} does not answer ({exc}); check "
                "kvBlockIndexConfig.redisConfig.address and that the server is running"
            ) from exc

    def start(self) -> None:
        if self._writer is None:
            self._writer = threading.Thread(target=self._write_loop, name="kv-store-writer")
            self._writer.daemon = True
            self._writer.start()

    def stop(self) -> None:
        """Send what is queued, then stop the writer."""
        writer, self._writer = self._writer, None
        if writer is not None:
            self._queue.put(_STOP)
            writer.join(timeout=5.0)
        self._client.close()  # type: ignore[no-untyped-call]
        self._writes.close()  # type: ignore[no-untyped-call]

    # -- writes (any thread; sent by the writer in order) --------------------------------------

    def store(self, endpoint: str, keys: Sequence[int], tier_bits: int) -> None:
        self._queue.put((self._store, endpoint, tier_bits, keys))

    def remove(self, endpoint: str, keys: Sequence[int], tier_bits: int) -> None:
        self._queue.put((self._remove, endpoint, tier_bits, keys))

    def clear(self, endpoint: str) -> None:
        self._queue.put((self._clear, endpoint, 0, ()))

    def flush(self, timeout_s: float = 5.0) -> bool:
        """Wait until every write queued so far was sent (tests and benchmarks)."""
        done = threading.Event()
        self._queue.put(done)
        return done.wait(timeout_s)

    def _write_loop(self) -> None:
        while True:
            first = self._queue.get()
            batch = [first]
            while len(batch) < _WRITES_PER_PIPELINE:
                try:
                    batch.append(self._queue.get_nowait())
                except queue.Empty:
                    break
            writes = [cast(_Write, w) for w in batch if isinstance(w, tuple)]
            if writes:
                self._send(writes)
            for item in batch:
                if isinstance(item, threading.Event):
                    item.set()
            if any(item is _STOP for item in batch):
                return
            if self._writes_down:
                self._wait_until_up()

    def _send(self, writes: list[_Write]) -> None:
        """One pipeline; on failure the writes are dropped and counted (a connection failure
        also marks the store down, and the writer waits for it)."""
        ns = self.namespace
        try:
            pipe = self._writes.pipeline(transaction=False)
            for script, endpoint, bits, keys in writes:
                script(args=[ns, endpoint, bits, _packed(keys)], client=pipe)
            pipe.execute()  # type: ignore[no-untyped-call]
        except (valkey.ConnectionError, valkey.TimeoutError) as exc:
            self.dropped_writes_total += len(writes)
            self._lost(endpoint for _, endpoint, _, _ in writes)
            self._writes_down = True
            self._went_down(exc)
            return
        except valkey.ValkeyError as exc:
            # The server answered with an error (out of memory, a script refused): the store
            # is up, these writes are lost.
            self.dropped_writes_total += len(writes)
            self.write_errors_total += 1
            logger.error("KV-cache store %s refused writes: %s", self.address, exc)
            return
        self.writes_total += len(writes)
        self._writes_recovered()

    def _went_down(self, exc: Exception) -> None:
        if self.up:
            self.up = False
            self.outages_total += 1
            logger.error(
                "KV-cache store %s unreachable (%s): routing uses load only, KV events are not "
                "recorded until it answers again",
                self.address,
                exc,
            )

    def _lost(self, endpoints: Iterable[str]) -> None:
        with self._dirty_lock:
            self._dirty.update(endpoints)

    def _came_back(self) -> None:
        """The store answered a lookup or a renewal (nothing to do unless it had not).  Only
        the writer's own success ends its outage (`_writes_recovered`): a quick read while
        writes still time out must not set off the rebuilds that would feed the timeouts."""
        if not self.up:
            self.up = True
            logger.warning("KV-cache store %s answers again", self.address)

    def _writes_recovered(self) -> None:
        """The writer's pipeline or ping went through: rebuild what its outage lost."""
        self._writes_down = False
        self._came_back()
        if not self._dirty:
            return
        with self._dirty_lock:
            dirty, self._dirty = self._dirty, set()
        if dirty and self.on_recovered is not None:
            self.on_recovered(dirty)

    def _wait_until_up(self) -> None:
        """Ping until the store answers (or the writer is stopped).  Writes queued while it
        does not are dropped and counted: they describe a view the store will not have, and
        the pods' later events carry on from whatever it holds."""
        while True:
            try:
                self._writes.ping()
            except (valkey.ConnectionError, valkey.TimeoutError):
                pass
            else:
                self._writes_recovered()
                return
            while True:
                try:
                    item = self._queue.get_nowait()
                except queue.Empty:
                    break
                if isinstance(item, threading.Event):
                    item.set()
                elif item is _STOP:
                    self._queue.put(_STOP)
                    return
                else:
                    self.dropped_writes_total += 1
                    self._lost([cast(_Write, item)[1]])
            time.sleep(_RETRY_S)

    # -- replicas' leases (kvcache.ownership) --------------------------------------------------

    def renew(self, replica: str, lease_s: float) -> list[str] | None:
        """Renew ``replica``'s lease; the replicas whose leases are live, or None when the store
        does not answer."""
        try:
            live = self._renew(args=[self.namespace, replica, int(lease_s * 1000)])
        except valkey.TimeoutError:
            # Busy: the next renewal, a third of the lease later, tries again; this replica
            # keeps its streams meanwhile (`kvcache.ownership`).
            self.renew_timeouts_total += 1
            if self.renew_timeouts_total == 1 or self.renew_timeouts_total % 100 == 0:
                logger.warning(
                    "KV-cache store %s: a lease renewal timed out (%d so far)",
                    self.address,
                    self.renew_timeouts_total,
                )
            return None
        except valkey.ValkeyError as exc:
            self._went_down(exc)
            return None
        self._came_back()
        return [name.decode() if isinstance(name, bytes) else str(name) for name in live]

    def leave(self, replica: str) -> None:
        """Give the lease up (a clean stop): the others take its streams at their next renewal."""
        with contextlib.suppress(valkey.ValkeyError):  # unreachable: the lease expires anyway
            self._client.zrem(f"{self.namespace}:replicas", replica)

    # -- reads (the CPU executor) -------------------------------------------------------------

    def match(
        self, keys: Sequence[int], endpoints: Sequence[str]
    ) -> tuple[dict[str, list[bytes | None]], dict[str, int]] | None:
        """Per endpoint holding block 0 of ``keys``: its tier bits (as digits) for every block,
        None where it does not hold it; per endpoint: its blocks held.  None (counted, logged)
        when the store fails.

        Two round trips: a script answers each candidate's size and block 0, then one HMGET
        of the whole prompt per holder, pipelined.  The HMGETs are packed here from the keys'
        bytes, once for all holders: the client's per-argument encoding cost more than the
        server's lookups (1 ms for four holders of an 8k-token prompt), and a script reading
        the same fields costs the server twice what HMGET does."""
        packed = _packed(keys)
        try:
            first = self._candidates(args=[self.namespace, packed[:8], *endpoints])
            holders = [i for i in range(len(endpoints)) if first[2 * i + 1] is not None]
            runs = self._hmget([endpoints[i] for i in holders], packed) if holders else []
        except valkey.TimeoutError:
            self.lookup_errors_total += 1
            self.lookup_timeouts_total += 1
            if not self._slow:
                self._slow = True
                logger.warning(
                    "KV-cache store %s is slow: a lookup took over %.1f s and was routed by "
                    "load (further timeouts are counted, not logged, until one answers)",
                    self.address,
                    self._timeout_s,
                )
            return None
        except valkey.ConnectionError as exc:
            self.lookup_errors_total += 1
            self._went_down(exc)
            return None
        except valkey.ValkeyError as exc:
            self.lookup_errors_total += 1
            logger.error("KV-cache store %s failed a lookup: %s", self.address, exc)
            return None
        self._slow = False
        self._came_back()
        held = {endpoint: int(first[2 * i]) for i, endpoint in enumerate(endpoints)}
        return {endpoints[i]: run for i, run in zip(holders, runs, strict=True)}, held

    def _hmget(self, endpoints: Sequence[str], packed: bytes) -> list[list[bytes | None]]:
        """``HMGET {ns}:e:{endpoint} key...`` for each endpoint, in one round trip, with the
        fields encoded once (RESP: ``$8``, the key's 8 bytes, CRLF)."""
        count = len(packed) // 8
        fields = bytearray(b"$8\r\n\0\0\0\0\0\0\0\0\r\n" * count)
        for byte in range(8):  # the keys' bytes into their slots, one strided copy per byte
            fields[4 + byte :: 14] = packed[byte::8]
        head = b"*%d\r\n$5\r\nHMGET\r\n" % (count + 2)
        commands = bytearray()
        for endpoint in endpoints:
            name = f"{self.namespace}:e:{endpoint}".encode()
            commands += b"%s$%d\r\n%s\r\n%s" % (head, len(name), name, fields)
        pool = self._client.connection_pool
        conn = pool.get_connection("HMGET")
        try:
            conn.send_packed_command([commands])
            return [cast(list[bytes | None], conn.read_response()) for _ in endpoints]
        except BaseException:
            conn.disconnect()  # replies may be left unread: the connection is not reusable
            raise
        finally:
            pool.release(conn)


class RedisIndex:
    """An `IndexBackend` whose entries live in a `RedisStore`; see the module docstring."""

    blocking = True

    def __init__(
        self,
        store: RedisStore,
        *,
        hash_config: HashConfig | None,
        tier_weights: dict[str, float] | None,
        self_check_blocks: int | None,
        verify_cache_blocks: int = 65_536,
    ) -> None:
        self.store = store
        weights = validated_tier_weights(tier_weights)
        self._weights = tuple(weights[tier] for tier in TIERS)
        # A stored value (the tier bits, as the server returns it) → the weight of its best
        # tier, as the in-memory index weighs a block held on several tiers.
        self._weight_of: dict[bytes | None, float] = {
            str(bits).encode(): max(self._weights[t] for t in range(3) if bits >> t & 1)
            for bits in range(1, 8)
        }
        self.key_check = KeyCheck(
            hash_config,
            self_check_blocks=self_check_blocks,
            verify_cache_blocks=verify_cache_blocks,
        )
        self._endpoints: dict[str, EndpointKeyState] = {}

    def _check_state(self, endpoint: str) -> EndpointKeyState:
        state = self._endpoints.get(endpoint)
        if state is None:
            state = self._endpoints[endpoint] = EndpointKeyState(endpoint)
        return state

    def _link_bound(self) -> int:
        return max(1, DEFAULT_MAX_ENTRIES // max(1, len(self._endpoints)))

    def apply(self, endpoint: str, batch: KVEventBatch) -> None:
        state = self._check_state(endpoint)
        check = self.key_check
        store = self.store
        for event in batch.events:
            if type(event) is BlockStored:
                if not event.block_hashes:
                    continue
                keys = [h & _UINT64 if type(h) is int else block_key(h) for h in event.block_hashes]
                stored = check.stored_keys(state, event, keys, self._link_bound)
                if stored is not None:
                    store.store(endpoint, stored, 1 << tier_of(event.medium))
            elif type(event) is BlockRemoved:
                keys = [h & _UINT64 if type(h) is int else block_key(h) for h in event.block_hashes]
                store.remove(endpoint, check.removed_keys(state, keys), 1 << tier_of(event.medium))
                # Links are kept while another tier may still hold their blocks; without the
                # store's answer here, a re-keyed pod's links go with its last tier's removal.
                check.forget_removed(state, keys, ())
            elif type(event) is AllBlocksCleared:
                store.clear(endpoint)
                state.links.clear()

    def clear_endpoint(self, endpoint: str) -> int:
        """Queued like any write, so the count of entries dropped is not known here: 0."""
        self.store.clear(endpoint)
        self._check_state(endpoint).restarted()
        return 0

    def remove_endpoint(self, endpoint: str) -> int:
        self.store.clear(endpoint)
        self._endpoints.pop(endpoint, None)
        return 0

    def match(self, keys: Sequence[int], endpoints: Sequence[str]) -> BlockMatch:
        nothing = PrefixMatch(0, 0.0)
        answer = self.store.match(keys, endpoints) if keys and endpoints else None
        if answer is None:
            return BlockMatch(dict.fromkeys(endpoints, nothing), dict.fromkeys(endpoints, 0))
        runs, held = answer
        prefix = dict.fromkeys(endpoints, nothing)
        for endpoint, run in runs.items():
            prefix[endpoint] = self._leading(run)
        return BlockMatch(prefix, held)

    def _leading(self, run: list[bytes | None]) -> PrefixMatch:
        """The leading blocks of an HMGET answer: up to the first block not held, or the first
        value this EPP does not write.  Counted per best-tier weight, then weighed once per
        tier: the same sum whatever the order of the blocks (equal to the in-memory index's up
        to rounding)."""
        weight_of = self._weight_of
        head = run[: run.index(None)] if None in run else run
        digits = b"".join(cast(list[bytes], head))
        if len(digits) != len(head) or digits.translate(None, b"1234567"):
            # A value this EPP does not write ends the run there.
            head = head[: next(i for i, v in enumerate(head) if v not in weight_of)]
            digits = b"".join(cast(list[bytes], head))
        by_weight: dict[float, int] = {}
        for value, weight in weight_of.items():
            if on := digits.count(cast(bytes, value)):
                by_weight[weight] = by_weight.get(weight, 0) + on
        return PrefixMatch(len(head), sum(w * n for w, n in sorted(by_weight.items())))

    def longest_prefix(self, keys: Sequence[int], endpoints: Iterable[str]) -> dict[str, int]:
        names = list(endpoints)
        return {a: m.blocks for a, m in self.match(keys, names).prefix.items()}

    def telemetry_samples(self) -> Iterable[GaugeSample]:
        store = self.store
        yield GaugeSample(
            "inference_extension_kv_store_up",
            "1 while the shared KV-cache store answers, 0 during an outage (routing then uses "
            "load only).",
            1.0 if store.up else 0.0,
        )
        yield GaugeSample(
            "inference_extension_kv_store_outages",
            "Times the shared KV-cache store stopped answering (cumulative).",
            store.outages_total,
        )
        yield GaugeSample(
            "inference_extension_kv_store_writes",
            "Writes (one per event's blocks) sent to the shared KV-cache store (cumulative).",
            store.writes_total,
        )
        yield GaugeSample(
            "inference_extension_kv_store_dropped_writes",
            "Writes dropped because the shared KV-cache store was unreachable (cumulative).",
            store.dropped_writes_total,
        )
        yield GaugeSample(
            "inference_extension_kv_store_lookup_errors",
            "Lookups the shared KV-cache store failed to answer (cumulative); each was routed "
            "by load.",
            store.lookup_errors_total,
        )
        yield GaugeSample(
            "inference_extension_kv_store_renew_timeouts",
            "Lease renewals that timed out on a busy store (cumulative); the replica keeps its "
            "KV-event streams meanwhile.",
            store.renew_timeouts_total,
        )
        yield GaugeSample(
            "inference_extension_kv_store_lookup_timeouts",
            "Lookups that timed out on a busy store (cumulative; part of lookup_errors): the "
            "store is not marked down for them.",
            store.lookup_timeouts_total,
        )
        yield from mismatch_samples(
            {n: s.mismatch_events for n, s in self._endpoints.items() if s.mismatch_events}
        )
