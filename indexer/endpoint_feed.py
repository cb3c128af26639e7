"""One endpoint's KV events kept in sequence: gaps replayed, restarts noticed, reconnections
resynced.

Both topologies in `indexer.subscriber` hand each endpoint's live messages,
``[topic, seq (8 bytes, big-endian), payload]`` (``docs/vllm-interop.md`` §4.2; the bare § numbers
below refer to that page too), to one `_EndpointFeed`, which keeps them in sequence:

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
* Connection (per-endpoint SUBs; `SubscriberPool` calls `_EndpointFeed.connected`): an idle pod may
  publish nothing for a long time, so waiting for its first message would leave what it cached
  before the EPP started unknown.  The first connection of a SUB therefore fetches the pod's buffer
  from seq 0 at once, unless a live message came first.  When a SUB connects again after losing its
  pod (the pod was killed and started again, or the network dropped), the batches published
  meanwhile were lost and the pod may be a new process whose seq restarted below what was seen: its
  next batch may come much later, or show as a plain gap.  So each reconnection fetches the pod's
  buffer from seq 0 at once too (``resync``): a buffer that ends below the last seq seen live means
  the pod restarted (its blocks are dropped, then the buffer applied), and so does an empty buffer
  where one was seen non-empty (vLLM's buffer never shrinks; a restarted vLLM binds its sockets
  before it serves, so this is the usual way a restart shows); otherwise whatever is new in it fills
  the hole.  A fetch that fails is tried once more after ``replay_interval_s`` (the replay socket
  reconnects on its own timer, often just after the SUB).  Without a replay URL nothing can be told
  until the next batch arrives.

Undecodable payloads are counted and dropped.  The sink (the KV index) gets decoded
`KVEventBatch` values, in each endpoint's sequence order.

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
import logging
import time
from collections.abc import Coroutine, Sequence
from dataclasses import dataclass
from typing import Any, Final, Protocol

import zmq
import zmq.asyncio

from indexer.errors import EventDecodeError
from indexer.events import decode_batch
from indexer.subscriber_config import (
    FeedStats,
    KVEventSink,
    SubscriberConfig,
    SubscriberConfigError,
    _log_spaced,
)

__all__ = ["END_OF_REPLAY"]

log = logging.getLogger(__name__)

# vLLM's ``END_SEQ = (-1).to_bytes(8, "big", signed=True)``: the seq frame of the replay end marker.
END_OF_REPLAY: Final = (1 << 64) - 1
_SEQ_BYTES: Final = 8


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

    def rebuild(self) -> bool:
        """Drop what the sink holds for the pod and apply its whole replay buffer again: for a
        sink that lost writes (a shared store that was unreachable).  False when it cannot start
        now (closed, no replay socket, a replay running, or the replay budget spent); the
        caller tries again later."""
        if self._closed or self._dealer is None or self._replay_task is not None:
            return False
        if not self._take_replay_token():
            return False
        self._clear()
        self._expected = None  # the resync then applies the buffer from its first seq
        self.stats.replays_requested += 1
        self.stats.resyncs += 1
        self._replay_task = self._spawn(self._resync(), f"kv-events-rebuild:{self.endpoint}")
        return True

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
