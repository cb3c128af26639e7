"""vLLM pods' KV-cache events over ZMQ: received in order, gaps replayed, restarts noticed.

Two topologies, the two that vLLM's publisher supports (``docs/vllm-interop.md`` §4.1, §5; the
bare § numbers below refer to that page too):

* `SubscriberPool`: each pod binds its PUB (``"endpoint": "tcp://*:5557"``) and the EPP connects one
  SUB per pod (`SubscriberPool.add_endpoint`).  The socket says which pod a message came from.
* `CentralSubscriber`: the EPP binds one SUB (``tcp://*:5557``) and every pod connects to it
  (``"endpoint": "tcp://<epp>:5557"``).  The topic ``kv@<ip:port>@<model>`` says which pod sent a
  message (`parse_topic`); see `CentralSubscriber` for what happens to topics of unknown pods.

Either way a message is ``[topic, seq (8 bytes, big-endian), payload]`` (§4.2), and each endpoint's
messages go through one `_EndpointFeed`, which keeps them in sequence:

* ``seq == expected``: decode and deliver to the sink.
* ``seq > expected``: a gap (PUB drops silently when a subscriber falls behind).  Ask the pod's
  replay ROUTER (``"replay_endpoint": "tcp://*:5558"``) for everything from ``expected``, hold live
  messages meanwhile, apply the replayed batches, then the held ones, skipping duplicates.  Without
  replay the gap is counted and the stream continues from the live seq; when the replay times
  out, the stream continues too and one later replay repairs the hole (see ``repair`` below).
  When the pod's buffer (the last 10,000 batches) no longer reaches back to ``expected``,
  the lost batches may have removed blocks: the endpoint's entries are dropped and rebuilt from
  the whole buffer (a *full resync*, ``full_resyncs``), so nothing stale is kept; this applies
  to every fetch below too (a deferred repair, a reconnection's resync).
* ``seq`` at or below a seq already seen live: the pod restarted (vLLM's seq restarts at 0 and no
  ``AllBlocksCleared`` is sent, §4.2), so the sink drops the endpoint's blocks first.  A restarted
  pod whose new seq overtook the old one before the EPP heard from it looks like a gap on the wire;
  the caller, which sees pods come and go, should call ``clear_endpoint`` itself in that case.
* The first message from an endpoint (and the first after a restart), when replay is configured,
  fetches the pod's buffer from seq 0, so blocks cached before the EPP connected are known too.
  This also covers PUB/SUB's slow joiner: messages published before the subscription reached the
  pod are lost (§4.5).
* Connection (per-endpoint SUBs): an idle pod may publish nothing for a long time, so waiting
  for its first message would leave what it cached before the EPP started unknown.  The first
  connection of a SUB therefore fetches the pod's buffer from seq 0 at once, unless a live
  message came first.  When a SUB connects again after losing its pod (the pod was
  killed and started again, or the network dropped), the batches published meanwhile were lost
  and the pod may be a new process whose seq restarted below what was seen: its next batch may
  come much later, or show as a plain gap.  So each reconnection fetches the pod's buffer from
  seq 0 at once too (``resync``): a buffer that ends below the last seq seen live means the pod
  restarted (its blocks are dropped, then the buffer applied), and so does an empty buffer
  where one was seen non-empty (vLLM's buffer never shrinks; a restarted vLLM binds its
  sockets before it serves, so this is the usual way a restart shows); otherwise whatever is
  new in it fills the hole.  A fetch that fails is tried once more after
  ``replay_interval_s`` (the replay socket reconnects on its own timer, often just after the
  SUB).  Without a replay URL nothing can be told until the next batch arrives.

Malformed frames and undecodable payloads are counted and dropped; nothing a pod sends stops the
receive loops.  The sink (the KV index) never sees a socket: it gets decoded `KVEventBatch` values.

Hostile or broken pods are bounded: a payload larger than ``max_batch_bytes`` is dropped without
being decoded (counted in ``oversized_batches``; its seq is consumed), so one batch cannot stall
the event loop for long (decoding costs about 0.1 s per MB of one-block events); a message over
``max_message_bytes`` is refused by ZMQ itself before it is buffered (libzmq then drops the
connection and does not reconnect it: that pod's events stop, as for a pod that stopped
publishing, until it is re-added); and replays are
rate-limited per endpoint (a burst of ``replay_burst``, then one per ``replay_interval_s``), so a
pod sending forged sequence numbers (jumps, or seqs going back, which look like restarts) cannot
make the EPP replay its buffer in a loop.  Gaps beyond the budget do not stop the stream: it
continues from the live seq, and once the budget allows, one replay from the earliest seq
missed since re-applies everything from there in order (``repair``), so a lossy link costs one
replay per ``replay_interval_s`` and the index still converges.  A gap replay that gets no
answer in time is repaired the same way; until a replay is answered again, later gaps go
straight to the pending repair, so live batches are not held behind a replay socket that may
never answer (a repair with no answer either is counted unrecovered, not retried).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import ipaddress
import logging
import time
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass
from typing import Any, Final, Protocol, Self

import zmq
import zmq.asyncio
from zmq.utils import monitor as zmq_monitor

from indexer.errors import EventDecodeError, IndexerError
from indexer.events import KVEventBatch, decode_batch

__all__ = [
    "END_OF_REPLAY",
    "CentralSubscriber",
    "EventTopic",
    "FeedStats",
    "KVEventSink",
    "SubscriberConfig",
    "SubscriberConfigError",
    "SubscriberPool",
    "SubscriberStats",
    "parse_topic",
]

log = logging.getLogger(__name__)

# vLLM's ``END_SEQ = (-1).to_bytes(8, "big", signed=True)``: the seq frame of the replay end marker.
END_OF_REPLAY: Final = (1 << 64) - 1
_SEQ_BYTES: Final = 8
# After an unexpected socket error, wait this long before receiving again (no busy loop).
_ERROR_BACKOFF_S: Final = 0.1


class KVEventSink(Protocol):
    """Where decoded batches go (the KV index implements it).  Calls for one endpoint arrive in
    that endpoint's sequence order, from the event loop's thread.  Return values are ignored
    (typed ``object`` so that, e.g., a ``clear_endpoint`` returning a count still fits)."""

    def apply(self, endpoint: str, batch: KVEventBatch) -> object: ...

    def clear_endpoint(self, endpoint: str) -> object:
        """The pod restarted: drop every block it was known to hold."""
        ...


class SubscriberConfigError(IndexerError, ValueError):
    """A subscriber setting or address that cannot work (bad URL, bad endpoint, bad number)."""


@dataclass(slots=True, frozen=True)
class SubscriberConfig:
    """Knobs shared by both topologies; the defaults suit vLLM's defaults (docs/vllm-interop.md
    §5)."""

    # Frame-0 prefix to subscribe to; "" receives every topic.
    topic_prefix: str = ""
    # Longest wait for each frame of a replay (the request, the first reply, each next reply):
    # an idle timeout, so a long replay that keeps making progress is not cut short.
    replay_timeout_s: float = 1.0
    # Fetch the pod's replay buffer from seq 0 on first contact (needs a replay URL).
    replay_on_first_contact: bool = True
    # Live messages held per endpoint while its replay runs; beyond this they are dropped (counted
    # in `FeedStats.held_messages_dropped`) and show up as a new gap once the replay ends.
    max_held_messages: int = 100_000
    # Matches vLLM's PUB hwm (docs/vllm-interop.md §5): a burst of steps is queued, not dropped.
    rcvhwm: int = 100_000
    reconnect_ivl_ms: int = 100
    reconnect_ivl_max_ms: int = 5_000
    # ZMTP heartbeats notice a pod that vanished without closing TCP (node loss) so the SUB
    # reconnects; 0 disables them.
    heartbeat_ivl_ms: int = 5_000
    heartbeat_timeout_ms: int = 15_000
    # Central mode only: deliver messages whose topic names an endpoint nobody registered (it is
    # then registered on the fly, without replay) instead of counting and dropping them.
    accept_unregistered: bool = False
    # Messages handled back to back before yielding to the event loop, so a flood of events
    # cannot stall request handling; and, whatever the count, at most `yield_after_s` of work
    # (a batch of a long prefill takes milliseconds to decode and index), followed by a pause of
    # `yield_pause_s`: sleeping releases the GIL, which the request path's threads (tokenizers,
    # gRPC's poller) need; a bare yield would hand it back to ingestion at once.  A flood is
    # thus held to about two thirds of one core and requests keep flowing (benchmarks.overhead).
    yield_every: int = 256
    yield_after_s: float = 0.002
    yield_pause_s: float = 0.001
    # Largest payload decoded; larger ones are dropped unread.  A vLLM step's batch is far
    # smaller (a step schedules at most max_num_batched_tokens: typically well under 1 MB).
    max_batch_bytes: int = 4 * 1024 * 1024
    # ZMQ's MAXMSGSIZE on the SUB and replay sockets, a memory guard: a larger message makes
    # libzmq drop the connection for good.
    max_message_bytes: int = 256 * 1024 * 1024
    # Replays per endpoint: up to `replay_burst` at once, then one per `replay_interval_s`.
    replay_burst: int = 4
    replay_interval_s: float = 1.0

    def __post_init__(self) -> None:
        for name in ("replay_timeout_s", "replay_interval_s", "yield_after_s", "yield_pause_s"):
            if not getattr(self, name) > 0:
                raise SubscriberConfigError(
                    f"{name} must be > 0 seconds, got {getattr(self, name)!r}"
                )
        for name in (
            "max_held_messages",
            "rcvhwm",
            "reconnect_ivl_ms",
            "yield_every",
            "max_message_bytes",
            "max_batch_bytes",
            "replay_burst",
        ):
            value = getattr(self, name)
            if type(value) is not int or value < 1:
                raise SubscriberConfigError(f"{name} must be an integer >= 1, got {value!r}")
        for name in ("reconnect_ivl_max_ms", "heartbeat_ivl_ms", "heartbeat_timeout_ms"):
            value = getattr(self, name)
            if type(value) is not int or value < 0:
                raise SubscriberConfigError(f"{name} must be an integer >= 0, got {value!r}")


@dataclass(slots=True)
class FeedStats:
    """Counters for one endpoint (or, in `SubscriberStats`, summed over all of them)."""

    messages: int = 0  # live messages received, well-formed or not
    batches_applied: int = 0  # delivered to the sink, live or replayed
    batches_replayed: int = 0  # of which came from a replay
    events: int = 0  # events in the delivered batches
    decode_errors: int = 0  # payloads that are not a KVEventBatch (the seq is consumed)
    oversized_batches: int = 0  # payloads over max_batch_bytes, dropped unread (seq consumed)
    malformed_frames: int = 0  # wrong frame count, seq not 8 bytes, bad replay reply
    duplicates_dropped: int = 0  # seqs already applied (live copies of replayed batches)
    gaps_detected: int = 0
    gaps_recovered: int = 0
    gaps_unrecovered: int = 0
    replays_requested: int = 0
    replays_failed: int = 0  # timed out or failed on the socket
    replays_rate_limited: int = 0  # gaps or first contacts not replayed (replay budget spent)
    restarts_detected: int = 0
    resyncs: int = 0  # buffer fetches on (re)connection (see the module docstring)
    # The buffer no longer reached back to a gap: entries dropped, rebuilt from the whole buffer.
    full_resyncs: int = 0
    sink_errors: int = 0  # the sink raised; the batch is lost to it
    held_messages_dropped: int = 0  # see SubscriberConfig.max_held_messages
    # time.monotonic() of the last live message; None until one arrives.  For the caller's
    # "pod stopped publishing" check.
    last_message_time: float | None = None


@dataclass(slots=True)
class SubscriberStats(FeedStats):
    """Totals over all endpoints, including removed ones, plus what no endpoint can own."""

    endpoints: int = 0
    # Central mode: a topic that is not kv@<ip:port>@<model> of a registered endpoint.  (Messages
    # of the wrong frame count, which cannot be attributed, count in malformed_frames.)
    unroutable_messages: int = 0


_COUNTERS: Final = tuple(
    f.name for f in dataclasses.fields(FeedStats) if f.name != "last_message_time"
)


def _accumulate(total: FeedStats, part: FeedStats) -> None:
    for name in _COUNTERS:
        setattr(total, name, getattr(total, name) + getattr(part, name))
    if part.last_message_time is not None and (
        total.last_message_time is None or part.last_message_time > total.last_message_time
    ):
        total.last_message_time = part.last_message_time


def _log_spaced(count: int) -> bool:
    """True for counts 1, 2, 4, 8, ...: log a recurring problem without flooding the log."""
    return count & (count - 1) == 0


# ---------------------------------------------------------------------------------------------
# Topics and endpoint names (central mode).


@dataclass(slots=True, frozen=True)
class EventTopic:
    """What a ``kv@<host[:port]>@<model>`` topic says (llm-d's convention, docs/vllm-interop.md
    §4.1)."""

    host: str  # canonical: IP addresses normalized (IPv6 compressed, no brackets), names lower-case
    port: int | None  # llm-d's own topics carry only the pod IP
    model: str

    @property
    def endpoint(self) -> str:
        return _join_host_port(self.host, self.port)


def _join_host_port(host: str, port: int | None) -> str:
    if port is None:
        return host
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _split_host_port(text: str) -> tuple[str, int | None] | None:
    """``ip``, ``ip:port``, ``[ipv6]:port``, ``[ipv6]``, bare ``ipv6`` or ``name:port`` → canonical
    (host, port), or None.  An IPv6 address with a port must be in brackets."""
    port_text: str | None = None
    if text.startswith("["):
        host, bracket, rest = text[1:].partition("]")
        if not bracket or (rest and not rest.startswith(":")):
            return None
        port_text = rest[1:] if rest else None
        if port_text is not None and not port_text:
            return None
    elif text.count(":") == 1:
        host, _, port_text = text.partition(":")
    else:
        host = text  # no port, or a bare IPv6 address
    port: int | None = None
    if port_text is not None:
        if not port_text.isascii() or not port_text.isdigit() or not 0 < int(port_text) < 65536:
            return None
        port = int(port_text)
    try:
        return str(ipaddress.ip_address(host)), port
    except ValueError:
        pass
    if not host or not host.isascii() or any(c in host for c in "@/[]: \t"):
        return None
    return host.lower(), port


def parse_topic(topic: bytes) -> EventTopic | None:
    """Parse ``kv@<host[:port]>@<model>``; None for any other topic.  The model may itself
    contain ``@``; the host part cannot."""
    try:
        text = topic.decode("utf-8")
    except UnicodeDecodeError:
        return None
    prefix, sep1, rest = text.partition("@")
    address, sep2, model = rest.partition("@")
    if prefix != "kv" or not sep1 or not sep2:
        return None
    parsed = _split_host_port(address)
    if parsed is None:
        return None
    return EventTopic(host=parsed[0], port=parsed[1], model=model)


# ---------------------------------------------------------------------------------------------
# Frames.


def _as_bytes(frames: Sequence[bytes | zmq.Frame]) -> list[bytes]:
    return [f if isinstance(f, bytes) else f.bytes for f in frames]


def _parse_replay_reply(frames: list[bytes]) -> tuple[int, bytes] | None:
    """A DEALER-side replay reply → (seq, payload); seq is `END_OF_REPLAY` for the end marker.

    vLLM >= 0.26 sends ``[b"", topic, seq8, payload]`` (end: ``[b"", b"", ff*8, b""]``), vLLM <= 0.25
    ``[b"", seq8, payload]`` (end: ``[b"", ff*8, b""]``), docs/vllm-interop.md §4.4.
    """
    if len(frames) == 4:
        delimiter, _topic, seq_bytes, payload = frames
    elif len(frames) == 3:
        delimiter, seq_bytes, payload = frames
    else:
        return None
    if delimiter or len(seq_bytes) != _SEQ_BYTES:
        return None
    return int.from_bytes(seq_bytes, "big"), payload


def _configure_receiver(sock: zmq.asyncio.Socket, config: SubscriberConfig) -> None:
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVHWM, config.rcvhwm)
    sock.setsockopt(zmq.RECONNECT_IVL, config.reconnect_ivl_ms)
    sock.setsockopt(zmq.RECONNECT_IVL_MAX, config.reconnect_ivl_max_ms)
    sock.setsockopt(zmq.MAXMSGSIZE, config.max_message_bytes)
    if config.heartbeat_ivl_ms:
        sock.setsockopt(zmq.HEARTBEAT_IVL, config.heartbeat_ivl_ms)
        sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, config.heartbeat_timeout_ms)


def _open_sub(context: zmq.asyncio.Context, config: SubscriberConfig) -> zmq.asyncio.Socket:
    sock = context.socket(zmq.SUB)
    _configure_receiver(sock, config)
    sock.setsockopt(zmq.SUBSCRIBE, config.topic_prefix.encode("utf-8"))
    return sock


# ---------------------------------------------------------------------------------------------
# One endpoint's stream.


class _EndpointFeed:
    """Sequencing, replay and restart detection for one endpoint.

    Invariants: ``_expected`` is the next seq to deliver (None before first contact);
    ``_last_live`` is the last seq seen on the live stream, which a pod only ever increases, so a
    seq at or below it means a restart; while ``_replay_task`` runs, live messages wait in
    ``_held`` in arrival order.  Everything runs on the event loop's thread, so no locks.
    """

    def __init__(
        self,
        endpoint: str,
        replay_url: str | None,
        sink: KVEventSink,
        config: SubscriberConfig,
        context: zmq.asyncio.Context,
        spawn: _Spawn,
    ) -> None:
        self.endpoint = endpoint
        self.replay_url = replay_url
        self.stats = FeedStats()
        self._sink = sink
        self._config = config
        self._context = context
        self._spawn = spawn
        self._expected: int | None = None
        self._last_live: int | None = None
        self._held: list[tuple[int, bytes]] = []
        self._replay_task: asyncio.Task[None] | None = None
        self._dealer: zmq.asyncio.Socket | None = None
        self._closed = False
        # The pod's buffer was found non-empty since its last restart: vLLM's buffer (a deque)
        # never shrinks, so finding it empty later means a new process that has not published.
        self._buffer_seen = False
        # A reconnection's fetch failed (the replay socket reconnects on its own timer, often
        # just after the SUB): it is tried once more (`_retry_resync`).
        self._resync_retry: asyncio.TimerHandle | None = None
        # The last replay or fetch got no answer in time; the next one that does clears it.
        self._replay_unanswered = False
        # Gaps met while the replay budget was spent: the earliest seq missed since, how many
        # gaps, and the timer that repairs them when the budget allows (see `_defer_repair`).
        self._repair_from: int | None = None
        self._repair_gaps = 0
        self._repair_timer: asyncio.TimerHandle | None = None
        # Replay budget (token bucket): tokens left and when they were last topped up.
        self._replay_tokens = float(config.replay_burst)
        self._replay_refilled = time.monotonic()
        if replay_url is not None:
            self._dealer = self._open_dealer()

    def _open_dealer(self) -> zmq.asyncio.Socket:
        assert self.replay_url is not None
        dealer = self._context.socket(zmq.DEALER)
        try:
            _configure_receiver(dealer, self._config)
            dealer.connect(self.replay_url)
        except zmq.ZMQError as exc:
            dealer.close(linger=0)
            raise SubscriberConfigError(
                f"endpoint {self.endpoint!r}: cannot connect to replay_url {self.replay_url!r} "
                f"({exc}); expected the pod's replay_endpoint as tcp://<pod-ip>:<port>, "
                "e.g. tcp://10.0.0.7:5558"
            ) from exc
        return dealer

    def close(self) -> None:
        self._closed = True
        self._cancel_repair()
        if self._resync_retry is not None:
            self._resync_retry.cancel()
            self._resync_retry = None
        if self._replay_task is not None:
            self._replay_task.cancel()
            self._replay_task = None
        if self._dealer is not None:
            self._dealer.close(linger=0)
            self._dealer = None
        self._held.clear()

    # Live messages ---------------------------------------------------------------------------

    def on_message(self, frames: list[bytes]) -> None:
        """One live multipart message from this endpoint."""
        if self._closed:
            return
        self.stats.messages += 1
        self.stats.last_message_time = time.monotonic()
        if len(frames) != 3 or len(frames[1]) != _SEQ_BYTES:
            self.stats.malformed_frames += 1
            if _log_spaced(self.stats.malformed_frames):
                log.warning(
                    "KV events from %s: malformed message (%d frames, seq frame of %d bytes; "
                    "expected [topic, 8-byte seq, payload]); dropped (%d so far)",
                    self.endpoint,
                    len(frames),
                    len(frames[1]) if len(frames) > 1 else 0,
                    self.stats.malformed_frames,
                )
            return
        self._handle_live(int.from_bytes(frames[1], "big"), frames[2])

    def _handle_live(self, seq: int, payload: bytes) -> None:
        if self._replay_task is not None:
            if len(self._held) >= self._config.max_held_messages:
                self.stats.held_messages_dropped += 1
            else:
                self._held.append((seq, payload))
            return
        expected = self._expected
        if expected is None:
            self._first_contact(seq, payload)
        elif seq == expected:
            self._last_live = seq
            self._apply(seq, payload)
        elif seq > expected:
            self.stats.gaps_detected += 1
            # After a replay got no answer, gaps go to the pending repair (one replay for all,
            # and live batches are not held behind a socket that may never answer).
            if (
                self._dealer is not None
                and not self._replay_unanswered
                and self._take_replay_token()
            ):
                log.info(
                    "KV events from %s: gap, expected seq %d, got %d; replaying",
                    self.endpoint,
                    expected,
                    seq,
                )
                self._start_replay(expected, seq, payload, gap=True)
            elif self._dealer is not None:
                self._defer_repair(expected)
                self._last_live = seq
                self._apply(seq, payload)
            else:
                self.stats.gaps_unrecovered += 1
                if self.stats.gaps_unrecovered == 1 or _log_spaced(self.stats.gaps_unrecovered):
                    log.warning(
                        "KV events from %s: %d batches lost (seq %d-%d) and %s; the index may "
                        "keep blocks the pod evicted (%d such gaps so far)",
                        self.endpoint,
                        seq - expected,
                        expected,
                        seq - 1,
                        "no replay endpoint is configured",
                        self.stats.gaps_unrecovered,
                    )
                self._last_live = seq
                self._apply(seq, payload)
        elif self._last_live is None or seq > self._last_live:
            # Already delivered by a replay that ran ahead of the live stream.
            self._last_live = seq
            self.stats.duplicates_dropped += 1
        else:
            self.stats.restarts_detected += 1
            log.warning(
                "KV events from %s: seq went back from %d to %d; the pod restarted, dropping "
                "what the index held for it",
                self.endpoint,
                self._last_live,
                seq,
            )
            self._clear()
            self._expected = None
            self._last_live = None
            self._buffer_seen = False
            self._first_contact(seq, payload)

    def _take_replay_token(self) -> bool:
        """Spend one replay from the budget; False (counted) when it is spent."""
        config = self._config
        now = time.monotonic()
        self._replay_tokens = min(
            float(config.replay_burst),
            self._replay_tokens + (now - self._replay_refilled) / config.replay_interval_s,
        )
        self._replay_refilled = now
        if self._replay_tokens >= 1.0:
            self._replay_tokens -= 1.0
            return True
        self.stats.replays_rate_limited += 1
        if _log_spaced(self.stats.replays_rate_limited):
            log.warning(
                "KV events from %s: replay budget spent (%d replays at once, then one per "
                "%g s); not replaying (%d times so far)",
                self.endpoint,
                config.replay_burst,
                config.replay_interval_s,
                self.stats.replays_rate_limited,
            )
        return False

    def _first_contact(self, seq: int, payload: bytes) -> None:
        if (
            seq > 0
            and self._dealer is not None
            and self._config.replay_on_first_contact
            and self._take_replay_token()
        ):
            self._expected = 0
            self._start_replay(0, seq, payload, gap=False)
        else:
            self._last_live = seq
            self._apply(seq, payload)

    # Resync after a reconnection ---------------------------------------------------------------

    def connected(self, *, first: bool, retry: bool = False) -> None:
        """The SUB connected to the pod (``first``) or connected again: fetch its buffer, to
        learn what it cached before the EPP listened or what was missed while disconnected.
        ``retry``: this is the one retry of a reconnection fetch that failed."""
        if self._closed or self._dealer is None or self._replay_task is not None:
            return
        if first and (self._expected is not None or not self._config.replay_on_first_contact):
            return  # a live message arrived first and its first-contact replay did the work
        if not self._take_replay_token():
            return
        self.stats.replays_requested += 1
        self.stats.resyncs += 1
        self._replay_task = self._spawn(
            self._resync(retry=not first and not retry), f"kv-events-resync:{self.endpoint}"
        )

    def _retry_resync(self) -> None:
        self._resync_retry = None
        self.connected(first=False, retry=True)

    async def _resync(self, *, retry: bool = False) -> None:
        buffered: list[tuple[int, bytes]] | None
        try:
            buffered = await self._fetch_buffer()
        except (TimeoutError, zmq.ZMQError) as exc:
            self.stats.replays_failed += 1
            log.warning(
                "KV events from %s: fetching its replay buffer after connecting failed (%s)%s",
                self.endpoint,
                "no reply in time" if isinstance(exc, TimeoutError) else exc,
                "; trying once more" if retry else "",
            )
            self._reset_dealer()
            buffered = None
        except Exception:
            self.stats.replays_failed += 1
            log.exception("KV events from %s: resync failed unexpectedly", self.endpoint)
            self._reset_dealer()
            buffered = None
        self._replay_unanswered = buffered is None
        if buffered is None:
            if retry and not self._closed and self._resync_retry is None:
                self._resync_retry = asyncio.get_running_loop().call_later(
                    self._config.replay_interval_s, self._retry_resync
                )
        elif not buffered:
            if self._buffer_seen and self._expected is not None:
                # A buffer seen non-empty is empty now: the pod is a new process that has not
                # published yet (vLLM binds its sockets before it serves).  Its first batch will
                # be seq 0, which nothing else could tell from a live copy of a batch seen.
                self.stats.restarts_detected += 1
                log.warning(
                    "KV events from %s: after reconnecting, the pod's replay buffer is empty "
                    "where it held batches up to seq %d; the pod restarted, dropping what the "
                    "index held for it",
                    self.endpoint,
                    self._expected - 1,
                )
                self._clear()
                self._expected = None
                self._last_live = None
                self._buffer_seen = False
        else:
            self._buffer_seen = True
            top = buffered[-1][0]
            if self._expected is None:  # first connection, nothing live yet
                self._expected = buffered[0][0]
            elif top < self._expected - 1:
                # Below the last seq applied, live or from an earlier fetch (a pod's buffer ends
                # at the newest seq it published): a new process.
                self.stats.restarts_detected += 1
                log.warning(
                    "KV events from %s: after reconnecting, the pod's events end at seq %d, "
                    "below the %d seen before; the pod restarted, dropping what the index held "
                    "for it",
                    self.endpoint,
                    top,
                    self._expected - 1,
                )
                self._clear()
                self._expected = buffered[0][0]
                self._last_live = None
            elif buffered[0][0] > self._expected:
                self._rebuild_from(buffered[0][0], "fetching the buffer after reconnecting")
            for seq, payload in buffered:
                assert self._expected is not None
                if seq < self._expected:
                    continue
                self._apply(seq, payload)
                self.stats.batches_replayed += 1
        self._replay_task = None
        self._release_held()

    async def _fetch_buffer(self) -> list[tuple[int, bytes]]:
        """The pod's whole replay buffer, in seq order."""
        dealer = await self._request_replay(0)
        out: list[tuple[int, bytes]] = []
        while (reply := await self._next_replay_reply(dealer))[0] != END_OF_REPLAY:
            out.append(reply)
        out.sort(key=lambda item: item[0])
        return out

    async def _request_replay(self, from_seq: int) -> zmq.asyncio.Socket:
        """Ask the pod's replay ROUTER for its buffer from ``from_seq``; returns the DEALER the
        replies come on (read them with `_next_replay_reply`, on that socket even if
        `_reset_dealer` replaces ``self._dealer`` meanwhile)."""
        dealer = self._dealer
        assert dealer is not None
        async with asyncio.timeout(self._config.replay_timeout_s):
            await dealer.send_multipart([b"", from_seq.to_bytes(_SEQ_BYTES, "big")])
        return dealer

    async def _next_replay_reply(self, dealer: zmq.asyncio.Socket) -> tuple[int, bytes]:
        """The next well-formed reply to `_request_replay`, seq `END_OF_REPLAY` at the end;
        malformed replies are counted and skipped.  Each wait is bounded by the replay
        timeout, so a pod that stops answering mid-replay raises `TimeoutError`."""
        while True:
            async with asyncio.timeout(self._config.replay_timeout_s):
                frames = _as_bytes(await dealer.recv_multipart())
            reply = _parse_replay_reply(frames)
            if reply is not None:
                return reply
            self.stats.malformed_frames += 1

    # Repair of gaps the budget could not replay at once ------------------------------------------

    def _defer_repair(self, missed_from: int) -> None:
        """A gap while the replay budget is spent: the live stream goes on with the hole, and
        once the budget allows, one replay from the earliest missed seq re-applies everything
        since in order.  Re-applying batches already applied is safe in order: each block ends
        in the state its last event gave it, as on the pod.  Many gaps at once (a lossy
        network) thus cost one replay, and the index converges instead of keeping the holes."""
        if self._repair_from is None or missed_from < self._repair_from:
            self._repair_from = missed_from
        self._repair_gaps += 1
        if self._repair_gaps == 1 or _log_spaced(self._repair_gaps):
            log.warning(
                "KV events from %s: %d gap(s) since seq %d not replayed (replay budget spent, "
                "or no answer in time); repairing them with one replay when the budget allows",
                self.endpoint,
                self._repair_gaps,
                self._repair_from,
            )
        self._schedule_repair()

    def _schedule_repair(self) -> None:
        if self._repair_timer is None and not self._closed:
            # One token is back within replay_interval_s at the latest.
            self._repair_timer = asyncio.get_running_loop().call_later(
                self._config.replay_interval_s, self._start_repair
            )

    def _cancel_repair(self) -> None:
        if self._repair_timer is not None:
            self._repair_timer.cancel()
            self._repair_timer = None
        if self._repair_gaps:
            self.stats.gaps_unrecovered += self._repair_gaps
        self._repair_from = None
        self._repair_gaps = 0

    def _start_repair(self) -> None:
        self._repair_timer = None
        if self._closed or self._repair_from is None:
            return
        if self._replay_task is not None or not self._take_replay_token():
            self._schedule_repair()
            return
        from_seq, gaps = self._repair_from, self._repair_gaps
        self._repair_from, self._repair_gaps = None, 0
        self.stats.replays_requested += 1
        self._replay_task = self._spawn(
            self._repair(from_seq, gaps), f"kv-events-repair:{self.endpoint}"
        )

    async def _repair(self, from_seq: int, gaps: int) -> None:
        progress = _ReplayProgress()
        failed = False
        try:
            await self._fetch_replay(from_seq, progress, reapply_from=from_seq)
        except (TimeoutError, zmq.ZMQError) as exc:
            self.stats.replays_failed += 1
            progress.hole = True
            failed = True
            log.warning(
                "KV events from %s: repair replay from seq %d stopped (%s)",
                self.endpoint,
                from_seq,
                "no reply in time" if isinstance(exc, TimeoutError) else exc,
            )
            self._reset_dealer()
        except Exception:
            self.stats.replays_failed += 1
            progress.hole = True
            failed = True
            log.exception("KV events from %s: repair replay failed unexpectedly", self.endpoint)
            self._reset_dealer()
        self._replay_unanswered = failed
        if progress.hole:
            self.stats.gaps_unrecovered += gaps
            log.warning(
                "KV events from %s: the replay buffer no longer holds all of seq %d and later; "
                "the index may keep blocks the pod evicted",
                self.endpoint,
                from_seq,
            )
        else:
            self.stats.gaps_recovered += gaps
        self._replay_task = None
        self._release_held()

    # Replay -----------------------------------------------------------------------------------

    def _start_replay(self, from_seq: int, seq: int, payload: bytes, *, gap: bool) -> None:
        """Replay from ``from_seq``; the live message (seq, payload) that revealed the need for
        it is held first, ahead of whatever arrives during the replay."""
        self.stats.replays_requested += 1
        self._held.append((seq, payload))  # nothing is held when no replay is running
        self._replay_task = self._spawn(
            self._replay(from_seq, seq, gap=gap), f"kv-events-replay:{self.endpoint}"
        )

    async def _replay(self, from_seq: int, live_seq: int, *, gap: bool) -> None:
        progress = _ReplayProgress()
        failed = False
        try:
            await self._fetch_replay(from_seq, progress)
        except (TimeoutError, zmq.ZMQError) as exc:
            failed = True
            self.stats.replays_failed += 1
            log.warning(
                "KV events from %s: replay from seq %d via %s stopped (%s) after %d batches",
                self.endpoint,
                from_seq,
                self.replay_url,
                "no reply in time" if isinstance(exc, TimeoutError) else exc,
                progress.delivered,
            )
            self._reset_dealer()
        except Exception:
            failed = True
            self.stats.replays_failed += 1
            log.exception("KV events from %s: replay failed unexpectedly", self.endpoint)
            self._reset_dealer()
        self._replay_unanswered = failed
        assert self._expected is not None
        # Recovered: every seq from from_seq up to the live message was delivered, in order.
        recovered = not progress.hole and self._expected >= live_seq
        if gap:
            if recovered:
                self.stats.gaps_recovered += 1
            elif failed:
                # No answer in time (a loaded EPP, a blip on the way to the pod): the hole is
                # repaired by one later replay, counted when that ends.  A repair is never
                # retried, so a replay socket that never answers costs two timeouts per gap.
                self._defer_repair(from_seq)
            else:
                self.stats.gaps_unrecovered += 1
                log.warning(
                    "KV events from %s: could not recover all of seq %d-%d from the replay "
                    "buffer; the index may keep blocks the pod evicted",
                    self.endpoint,
                    from_seq,
                    live_seq - 1,
                )
        elif not recovered:
            log.info(
                "KV events from %s: the replay did not reach back to seq 0; blocks the pod "
                "cached earlier are unknown until it stores them again",
                self.endpoint,
            )
        if self._expected < live_seq:
            self._expected = live_seq  # accept the hole: continue with the held live message
        self._replay_task = None
        self._release_held()

    def _release_held(self) -> None:
        """Live messages held during a replay, in arrival order.  A new gap among them starts
        another replay; `_handle_live` then holds the rest again, in order."""
        held, self._held = self._held, []
        for seq, payload in held:
            self._handle_live(seq, payload)

    async def _fetch_replay(
        self, from_seq: int, progress: _ReplayProgress, *, reapply_from: int | None = None
    ) -> None:
        """Request the pod's buffer from ``from_seq`` and deliver each batch that extends
        ``_expected``, until the end marker.  With ``reapply_from`` (a repair), batches from
        that seq up to ``_expected`` are delivered again too, in order; a missing one is a
        hole.

        When the buffer no longer reaches back to ``from_seq`` (it holds the last 10,000 batches)
        and the index already holds entries of this pod, what was lost may include removals, so
        the entries are dropped and rebuilt from the whole buffer instead (`_rebuild_from`):
        blocks the pod cached before the buffer's first batch are then unknown until it stores
        them again, but no entry is stale."""
        reapply_upto = self._expected if reapply_from is not None else None
        next_reapplied = reapply_from
        first_reply = True
        dealer = await self._request_replay(from_seq)
        while True:
            seq, payload = await self._next_replay_reply(dealer)
            if seq == END_OF_REPLAY:
                if next_reapplied is not None and reapply_upto is not None:
                    progress.hole |= next_reapplied < reapply_upto  # the buffer ended early
                return
            assert self._expected is not None
            if first_reply:
                first_reply = False
                self._buffer_seen = True
                if from_seq > 0 and seq > from_seq:
                    self._rebuild_from(seq, f"a replay from seq {from_seq}")
                    next_reapplied = reapply_upto = None
            if next_reapplied is not None and reapply_upto is not None and seq < reapply_upto:
                if seq < next_reapplied:
                    continue
                progress.hole |= seq > next_reapplied  # evicted from the buffer meanwhile
                next_reapplied = seq + 1
                self._deliver(seq, payload)
            elif seq < self._expected:
                self.stats.duplicates_dropped += 1
                continue
            else:
                if seq > self._expected:
                    progress.hole = True  # the buffer starts after what we need, or skips seqs
                self._apply(seq, payload)
            self.stats.batches_replayed += 1
            progress.delivered += 1
            if progress.delivered % self._config.yield_every == 0 or (
                asyncio.get_running_loop().time() > progress.budget_end
            ):
                await asyncio.sleep(0)
                progress.budget_end = asyncio.get_running_loop().time() + self._config.yield_after_s

    def _rebuild_from(self, first_buffered: int, what: str) -> None:
        """The pod's buffer starts at ``first_buffered``, after seqs this feed missed: drop the
        pod's entries and apply the whole buffer from there (a full resync)."""
        self.stats.full_resyncs += 1
        log.warning(
            "KV events from %s: %s found the pod's replay buffer starting at seq %d, after "
            "batches that were missed; dropping what the index held for it and rebuilding it "
            "from the whole buffer",
            self.endpoint,
            what,
            first_buffered,
        )
        self._clear()
        self._expected = first_buffered

    def _reset_dealer(self) -> None:
        """A fresh DEALER after a failed replay, so late replies to the abandoned request cannot
        be mistaken for replies to the next one."""
        if self._dealer is None or self._closed:
            return
        self._dealer.close(linger=0)
        self._dealer = None
        try:
            self._dealer = self._open_dealer()
        except SubscriberConfigError:
            log.exception("KV events from %s: cannot reopen the replay socket", self.endpoint)

    # Delivery ---------------------------------------------------------------------------------

    def _apply(self, seq: int, payload: bytes) -> None:
        self._expected = seq + 1
        self._deliver(seq, payload)

    def _deliver(self, seq: int, payload: bytes) -> None:
        if len(payload) > self._config.max_batch_bytes:
            self.stats.oversized_batches += 1
            if _log_spaced(self.stats.oversized_batches):
                log.warning(
                    "KV events from %s: seq %d dropped unread, its %d bytes exceed the %d-byte "
                    "limit (%d so far)",
                    self.endpoint,
                    seq,
                    len(payload),
                    self._config.max_batch_bytes,
                    self.stats.oversized_batches,
                )
            return
        try:
            batch = decode_batch(payload)
        except EventDecodeError as exc:
            self.stats.decode_errors += 1
            if _log_spaced(self.stats.decode_errors):
                log.warning(
                    "KV events from %s: seq %d dropped, payload is not a KVEventBatch: %s "
                    "(%d so far)",
                    self.endpoint,
                    seq,
                    exc,
                    self.stats.decode_errors,
                )
            return
        except Exception:
            self.stats.decode_errors += 1
            log.exception("KV events from %s: decoder failed on seq %d", self.endpoint, seq)
            return
        try:
            self._sink.apply(self.endpoint, batch)
        except Exception:
            self.stats.sink_errors += 1
            log.exception("KV events from %s: the sink failed on seq %d", self.endpoint, seq)
            return
        self.stats.batches_applied += 1
        self.stats.events += len(batch.events)

    def _clear(self) -> None:
        self._cancel_repair()  # whatever was missed belonged to the old cache
        try:
            self._sink.clear_endpoint(self.endpoint)
        except Exception:
            self.stats.sink_errors += 1
            log.exception("KV events from %s: the sink failed to clear it", self.endpoint)


@dataclass(slots=True)
class _ReplayProgress:
    delivered: int = 0
    hole: bool = False
    budget_end: float = 0.0  # loop time by which to yield (SubscriberConfig.yield_after_s)


class _Spawn(Protocol):
    def __call__(self, coro: Coroutine[Any, Any, None], name: str) -> asyncio.Task[None]: ...


# ---------------------------------------------------------------------------------------------
# The two topologies.


class _Subscriber:
    """What both topologies share: the endpoints' feeds, their tasks, stats and shutdown."""

    def __init__(
        self,
        sink: KVEventSink,
        config: SubscriberConfig | None,
        context: zmq.asyncio.Context | None,
    ) -> None:
        self._sink = sink
        self._config = config or SubscriberConfig()
        self._owns_context = context is None
        self._context = zmq.asyncio.Context() if context is None else context
        self._feeds: dict[str, _EndpointFeed] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        # Counts of removed endpoints and of messages no endpoint owns, kept for the totals.
        self._retired = FeedStats()
        self._unroutable = 0
        self._unattributed_malformed = 0
        self._closed = False

    @property
    def endpoints(self) -> tuple[str, ...]:
        return tuple(self._feeds)

    def endpoint_stats(self, endpoint: str) -> FeedStats | None:
        """A snapshot of one endpoint's counters, or None if it is not registered."""
        feed = self._feeds.get(endpoint)
        return None if feed is None else dataclasses.replace(feed.stats)

    @property
    def stats(self) -> SubscriberStats:
        """A snapshot of the totals, including endpoints removed since."""
        total = SubscriberStats(
            endpoints=len(self._feeds),
            unroutable_messages=self._unroutable,
            malformed_frames=self._unattributed_malformed,
        )
        _accumulate(total, self._retired)
        for feed in self._feeds.values():
            _accumulate(total, feed.stats)
        return total

    def resync(self, endpoint: str) -> bool:
        """Fetch ``endpoint``'s replay buffer now, as after a reconnection (see ``resync`` in the
        module docstring): for a caller that has other evidence the stream missed something, such
        as a publisher that was silent.  Within the replay budget; nothing happens while a replay
        of that endpoint runs or without a replay URL.  False if it is not registered."""
        feed = self._feeds.get(endpoint)
        if feed is None:
            return False
        feed.connected(first=False)
        return True

    def remove_endpoint(self, endpoint: str) -> bool:
        """Stop receiving for ``endpoint``: its sockets close and its tasks are cancelled at once
        (`close` waits for them to finish).  The sink is not cleared: the caller owns the
        index's lifetime.  False if it was not registered."""
        feed = self._feeds.pop(endpoint, None)
        if feed is None:
            return False
        feed.close()
        _accumulate(self._retired, feed.stats)
        return True

    async def close(self) -> None:
        """Close every socket and wait for every task to finish; idempotent."""
        if self._closed:
            return
        self._closed = True
        for endpoint in list(self._feeds):
            self.remove_endpoint(endpoint)
        self._close_own_sockets()
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self._owns_context:
            self._context.term()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    def _close_own_sockets(self) -> None:
        """Close the topology's own sockets (each feed closes its replay socket)."""

    def _check_open(self) -> None:
        if self._closed:
            raise SubscriberConfigError("the subscriber is closed; create a new one")

    def _spawn(self, coro: Coroutine[Any, Any, None], name: str) -> asyncio.Task[None]:
        task = asyncio.get_running_loop().create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    def _new_feed(self, endpoint: str, replay_url: str | None) -> _EndpointFeed:
        return _EndpointFeed(
            endpoint, replay_url, self._sink, self._config, self._context, self._spawn
        )

    async def _receive_loop(
        self, sock: zmq.asyncio.Socket, dispatch: Callable[[list[bytes]], None], what: str
    ) -> None:
        handled = 0
        loop = asyncio.get_running_loop()
        budget_end = loop.time() + self._config.yield_after_s
        while True:
            try:
                frames = _as_bytes(await sock.recv_multipart())
            except zmq.ZMQError as exc:
                if sock.closed:
                    return
                log.warning("KV events (%s): receive failed: %s", what, exc)
                await asyncio.sleep(_ERROR_BACKOFF_S)
                continue
            try:
                dispatch(frames)
            except Exception:  # a bug, not bad input (that is counted): keep receiving
                log.exception("KV events (%s): failed to handle a message", what)
            handled += 1
            # A queued message is returned without yielding: give the loop its turn here.
            if loop.time() > budget_end:
                await asyncio.sleep(self._config.yield_pause_s)
                budget_end = loop.time() + self._config.yield_after_s
            elif handled % self._config.yield_every == 0:
                await asyncio.sleep(0)


class SubscriberPool(_Subscriber):
    """One SUB socket per pod, connected to the pod's publisher (pods run vLLM with
    ``"endpoint": "tcp://*:5557"``).  ZMQ reconnects by itself, also to a pod that restarts on
    the same address.  Use it inside the running event loop."""

    def __init__(
        self,
        sink: KVEventSink,
        config: SubscriberConfig | None = None,
        *,
        context: zmq.asyncio.Context | None = None,
    ) -> None:
        super().__init__(sink, config, context)
        self._subs: dict[
            str, tuple[str, zmq.asyncio.Socket, asyncio.Task[None], zmq.asyncio.Socket]
        ] = {}

    def add_endpoint(self, endpoint: str, pub_url: str, replay_url: str | None = None) -> None:
        """Subscribe to ``endpoint``'s events at ``pub_url`` (e.g. ``tcp://10.0.0.7:5557``), with
        gap recovery through ``replay_url`` (e.g. ``tcp://10.0.0.7:5558``) when given.  Adding an
        endpoint again with the same URLs does nothing; with other URLs it resubscribes."""
        self._check_open()
        current = self._subs.get(endpoint)
        if current is not None:
            if current[0] == pub_url and self._feeds[endpoint].replay_url == replay_url:
                return
            self.remove_endpoint(endpoint)
        feed = self._new_feed(endpoint, replay_url)
        try:
            self._subscribe(endpoint, pub_url, feed, connections_before=0)
        except SubscriberConfigError:
            feed.close()
            raise
        self._feeds[endpoint] = feed

    def reconnect(self, endpoint: str) -> bool:
        """Replace ``endpoint``'s SUB socket by a new one connected to the same URL, keeping its
        sequence state: for a caller with evidence that the stream stopped (a silent
        publisher).  libzmq does not reconnect a connection it dropped over a protocol error
        (a message over ``max_message_bytes``), so only a new socket hears the pod again; its
        connection fetches the pod's buffer as any reconnection does.  False if ``endpoint``
        is not registered."""
        entry = self._subs.pop(endpoint, None)
        feed = self._feeds.get(endpoint)
        if entry is None or feed is None:
            return False
        pub_url = entry[0]
        self._close_sub(entry)
        try:
            self._subscribe(endpoint, pub_url, feed, connections_before=1)
        except SubscriberConfigError:
            log.exception("KV events from %s: cannot subscribe again", endpoint)
            return False
        return True

    def _subscribe(
        self, endpoint: str, pub_url: str, feed: _EndpointFeed, *, connections_before: int
    ) -> None:
        sub = _open_sub(self._context, self._config)
        # Watch connections before connecting, so the first one is never missed.
        monitor = sub.get_monitor_socket(zmq.EVENT_CONNECTED)
        try:
            sub.connect(pub_url)
        except zmq.ZMQError as exc:
            monitor.close(linger=0)
            sub.close(linger=0)
            raise SubscriberConfigError(
                f"endpoint {endpoint!r}: cannot connect to pub_url {pub_url!r} ({exc}); expected "
                "the pod's KV-events endpoint as tcp://<pod-ip>:<port>, e.g. tcp://10.0.0.7:5557"
            ) from exc
        task = self._spawn(
            self._receive_loop(sub, feed.on_message, endpoint), f"kv-events-sub:{endpoint}"
        )
        self._spawn(
            self._watch_connections(monitor, feed, connections_before),
            f"kv-events-monitor:{endpoint}",
        )
        self._subs[endpoint] = (pub_url, sub, task, monitor)

    async def _watch_connections(
        self, monitor: zmq.asyncio.Socket, feed: _EndpointFeed, connections: int
    ) -> None:
        """Tell the feed about every connection (see ``resync``); ``connections`` made before
        this socket's (a replaced socket's connection is a reconnection)."""
        try:
            while True:
                frames = await monitor.recv_multipart()
                event = zmq_monitor.parse_monitor_message(frames)
                if event["event"] != zmq.EVENT_CONNECTED:
                    continue
                connections += 1
                feed.connected(first=connections == 1)
        except zmq.ZMQError:
            return  # the monitor was closed with its socket

    @staticmethod
    def _close_sub(
        entry: tuple[str, zmq.asyncio.Socket, asyncio.Task[None], zmq.asyncio.Socket],
    ) -> None:
        _, sub, task, monitor = entry
        task.cancel()
        with contextlib.suppress(zmq.ZMQError):
            sub.disable_monitor()
        monitor.close(linger=0)
        sub.close(linger=0)

    def remove_endpoint(self, endpoint: str) -> bool:
        entry = self._subs.pop(endpoint, None)
        if entry is not None:
            self._close_sub(entry)
        return super().remove_endpoint(endpoint)


class CentralSubscriber(_Subscriber):
    """One SUB socket bound at ``bind_url``; pods connect to it (``"endpoint":
    "tcp://<epp>:5557"``) and name themselves in the topic ``kv@<ip:port>@<model>``.

    Messages are delivered for registered endpoints only (`add_endpoint`); the rest are counted
    in `SubscriberStats.unroutable_messages` and dropped, unless
    `SubscriberConfig.accept_unregistered` is set, which registers them on first sight (no
    replay).  A topic with only the pod IP (llm-d's ``kv@<ip>@<model>``) matches the endpoint
    registered at that IP if there is exactly one.  Construct it inside the running event loop:
    it starts receiving at once, because a bound SUB's subscription reaches a newly connected pod
    only while the socket is being polled (docs/vllm-interop.md §4.5).
    """

    def __init__(
        self,
        sink: KVEventSink,
        bind_url: str = "tcp://*:5557",
        config: SubscriberConfig | None = None,
        *,
        context: zmq.asyncio.Context | None = None,
    ) -> None:
        asyncio.get_running_loop()  # fail here, not at the first message, outside a loop
        super().__init__(sink, config, context)
        self._routes: dict[str, _EndpointFeed] = {}  # canonical "host:port" → feed
        self._hosts: dict[str, list[str]] = {}  # canonical host → its canonical endpoints
        self._route_of: dict[str, tuple[str, str]] = {}  # endpoint → (host, canonical key)
        self._auto_registered: set[str] = set()
        self._sub = _open_sub(self._context, self._config)
        try:
            self._sub.bind(bind_url)
        except zmq.ZMQError as exc:
            self._sub.close(linger=0)
            if self._owns_context:
                self._context.term()
            raise SubscriberConfigError(
                f"cannot bind the KV-events SUB socket at {bind_url!r} ({exc}); expected a free "
                "local address such as tcp://*:5557"
            ) from exc
        self.bound_url: str = self._sub.getsockopt_string(zmq.LAST_ENDPOINT)
        self._spawn(
            self._receive_loop(self._sub, self._dispatch, self.bound_url), "kv-events-central"
        )

    def add_endpoint(self, endpoint: str, replay_url: str | None = None) -> None:
        """Deliver messages whose topic names ``endpoint`` (``ip:port`` or ``[ipv6]:port``, as in
        the pods' topics), with gap recovery through ``replay_url`` (the pod's replay ROUTER,
        e.g. ``tcp://10.0.0.7:5558``) when given."""
        self._check_open()
        parsed = _split_host_port(endpoint)
        if parsed is None or parsed[1] is None:
            raise SubscriberConfigError(
                f"endpoint {endpoint!r} is not host:port; expected e.g. 10.0.0.7:8000 or "
                "[fd00::7]:8000, as it appears in the pods' kv@<ip:port>@<model> topics"
            )
        host, key = parsed[0], _join_host_port(*parsed)
        current = self._feeds.get(endpoint)
        if current is not None and endpoint not in self._auto_registered:
            if current.replay_url == replay_url:
                return
            self.remove_endpoint(endpoint)
        holder = self._routes.get(key)
        if holder is not None:
            if holder.endpoint not in self._auto_registered:
                raise SubscriberConfigError(
                    f"endpoint {endpoint!r} is the address of the registered endpoint "
                    f"{holder.endpoint!r}; remove that one first"
                )
            self.remove_endpoint(holder.endpoint)
        self._register(endpoint, host, key, self._new_feed(endpoint, replay_url))

    def remove_endpoint(self, endpoint: str) -> bool:
        route = self._route_of.pop(endpoint, None)
        if route is not None:
            host, key = route
            del self._routes[key]
            keys = self._hosts[host]
            keys.remove(key)
            if not keys:
                del self._hosts[host]
        self._auto_registered.discard(endpoint)
        return super().remove_endpoint(endpoint)

    def _register(self, endpoint: str, host: str, key: str, feed: _EndpointFeed) -> None:
        self._feeds[endpoint] = feed
        self._routes[key] = feed
        self._hosts.setdefault(host, []).append(key)
        self._route_of[endpoint] = (host, key)

    def _close_own_sockets(self) -> None:
        self._sub.close(linger=0)

    def _dispatch(self, frames: list[bytes]) -> None:
        if len(frames) != 3:
            self._unattributed_malformed += 1
            if _log_spaced(self._unattributed_malformed):
                log.warning(
                    "KV events at %s: dropped a message of %d frames (expected [topic, seq, "
                    "payload]; %d so far)",
                    self.bound_url,
                    len(frames),
                    self._unattributed_malformed,
                )
            return
        topic = parse_topic(frames[0])
        feed = None if topic is None else self._route(topic)
        if feed is None:
            self._unroutable += 1
            if _log_spaced(self._unroutable):
                log.warning(
                    "KV events at %s: dropped a message with topic %r: not "
                    "kv@<ip:port>@<model> of a registered endpoint (%d so far)",
                    self.bound_url,
                    frames[0][:100],
                    self._unroutable,
                )
            return
        feed.on_message(frames)

    def _route(self, topic: EventTopic) -> _EndpointFeed | None:
        if topic.port is not None:
            feed = self._routes.get(topic.endpoint)
            if feed is None and self._config.accept_unregistered:
                feed = self._new_feed(topic.endpoint, None)
                self._register(topic.endpoint, topic.host, topic.endpoint, feed)
                self._auto_registered.add(topic.endpoint)
            return feed
        keys = self._hosts.get(topic.host, [])
        return self._routes[keys[0]] if len(keys) == 1 else None
