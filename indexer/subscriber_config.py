"""What the KV-event subscribers (`indexer.subscriber`) and their per-endpoint feeds
(`indexer.endpoint_feed`) share: the settings, the error a bad setting or address raises, the
sink that decoded batches go to, and the counters.

Kept apart so that the topologies and the feed both import them without importing each other.
Nothing here touches a socket.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Final, Protocol

from indexer.errors import IndexerError
from indexer.events import KVEventBatch

__all__ = [
    "FeedStats",
    "KVEventSink",
    "SubscriberConfig",
    "SubscriberConfigError",
    "SubscriberStats",
]


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
    resyncs: int = 0  # buffer fetches on (re)connection (see indexer.endpoint_feed)
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
