"""The pod's KV-event publisher: a thread owning the ZMQ sockets, as vLLM's ``ZmqEventPublisher``.

PUB frames are ``[topic, seq (8 bytes BE), payload]`` with seq from 0.  A ROUTER answers replay
requests as vLLM ≥ 0.26 does: ``[client, b"", start_seq (8 bytes BE)]`` gets every buffered batch
with seq >= start as ``[client, b"", topic, seq, payload]``, then the end marker
``[client, b"", b"", END_SEQ, b""]``.  The buffer holds the last ``buffer_steps`` batches.
The consumer's side of this protocol is in docs/vllm-interop.md ("KV events on the wire").
"""

from __future__ import annotations

import contextlib
import logging
import queue
import random
import threading
import uuid
from collections import deque
from dataclasses import dataclass
from typing import Final

import zmq

from indexer.events import KVEventBatch, encode_batch
from simulator.server_config import FaultConfig, SimulatorError

logger = logging.getLogger("simulator")

END_SEQ: Final = (-1).to_bytes(8, "big", signed=True)
_STOP: Final = object()
_RESTART: Final = object()


@dataclass(slots=True, frozen=True)
class PublisherStats:
    published: int
    dropped: int
    replay_requests: int
    next_seq: int
    buffered: int


class KVEventPublisher:
    """vLLM's ``ZmqEventPublisher`` semantics in a thread, so encoding and sending never run on
    the event loop: `publish` only enqueues.  Faults decide which batches skip the PUB socket;
    every batch is buffered for replay regardless."""

    def __init__(
        self,
        endpoint: str | None,
        replay_endpoint: str | None,
        topic: str,
        *,
        buffer_steps: int = 10_000,
        hwm: int = 100_000,
        faults: FaultConfig | None = None,
        bind: bool | None = None,
    ) -> None:
        if endpoint is None and replay_endpoint is None:
            raise SimulatorError("a publisher needs a PUB endpoint or a replay endpoint")
        if buffer_steps < 1:
            raise SimulatorError(f"buffer_steps must be >= 1, got {buffer_steps}")
        self._endpoint = endpoint
        self._bind = _binds(endpoint) if bind is None and endpoint is not None else bool(bind)
        self._replay_endpoint = replay_endpoint
        self._topic = topic.encode()
        self._buffer_steps = buffer_steps
        self._hwm = hwm
        self._faults = faults or FaultConfig()
        self._rng = random.Random(self._faults.seed)
        self._ctx = zmq.Context()
        self._queue: queue.SimpleQueue[object] = queue.SimpleQueue()
        self._wake_address = f"inproc://simulator-publisher-{uuid.uuid4().hex}"
        self._wake: zmq.Socket[bytes] | None = None
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="kv-event-publisher", daemon=True)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self._seq = 0
        self._published = 0
        self._dropped = 0
        self._replays = 0

    def start(self) -> None:
        """Bind/connect the sockets in the publisher thread; raises if that fails."""
        self._thread.start()
        self._ready.wait()
        if self._error is not None:
            raise SimulatorError(f"KV-event sockets: {self._error}") from self._error
        wake: zmq.Socket[bytes] = self._ctx.socket(zmq.PAIR)
        wake.connect(self._wake_address)
        self._wake = wake

    def publish(self, batch: KVEventBatch) -> None:
        self._send(batch)

    def restart(self) -> None:
        """What a vLLM restart looks like on the wire: seq back to 0, replay buffer empty, and
        no AllBlocksCleared."""
        self._send(_RESTART)

    def set_faults(self, faults: FaultConfig) -> None:
        self._send(faults)

    def stats(self) -> PublisherStats:
        return PublisherStats(
            published=self._published,
            dropped=self._dropped,
            replay_requests=self._replays,
            next_seq=self._seq,
            buffered=len(self._buffer),
        )

    def close(self) -> None:
        if self._thread.is_alive():
            self._send(_STOP)
            self._thread.join(timeout=5)
        if self._wake is not None:
            self._wake.close(linger=0)
            self._wake = None
        self._ctx.term()

    def _send(self, item: object) -> None:
        self._queue.put(item)
        if self._wake is not None:
            with contextlib.suppress(zmq.Again):  # a wake-up is already pending
                self._wake.send(b"", zmq.NOBLOCK)

    # -- publisher thread ---------------------------------------------------------------------

    def _run(self) -> None:
        sockets: list[zmq.Socket[bytes]] = []
        try:
            wake = self._ctx.socket(zmq.PAIR)
            sockets.append(wake)
            wake.bind(self._wake_address)
            pub: zmq.Socket[bytes] | None = None
            if self._endpoint is not None:
                pub = self._ctx.socket(zmq.PUB)
                sockets.append(pub)
                pub.setsockopt(zmq.SNDHWM, self._hwm)
                pub.setsockopt(zmq.LINGER, 0)
                if self._bind:
                    pub.bind(self._endpoint)
                else:
                    pub.connect(self._endpoint)
            replay: zmq.Socket[bytes] | None = None
            if self._replay_endpoint is not None:
                replay = self._ctx.socket(zmq.ROUTER)
                sockets.append(replay)
                replay.setsockopt(zmq.SNDHWM, 2 * (self._buffer_steps + 1))
                replay.setsockopt(zmq.LINGER, 0)
                replay.bind(self._replay_endpoint)
        except zmq.ZMQError as exc:
            self._error = exc
            for socket in sockets:
                socket.close(linger=0)
            self._ready.set()
            return
        self._ready.set()
        poller = zmq.Poller()
        poller.register(wake, zmq.POLLIN)
        if replay is not None:
            poller.register(replay, zmq.POLLIN)
        try:
            while True:
                ready = dict(poller.poll())
                if replay is not None and replay in ready:
                    self._serve_replays(replay)
                if wake in ready:
                    with contextlib.suppress(zmq.Again):
                        while True:
                            wake.recv(zmq.NOBLOCK)
                    if not self._drain_queue(pub):
                        return
        finally:
            for socket in sockets:
                socket.close(linger=0)

    def _drain_queue(self, pub: zmq.Socket[bytes] | None) -> bool:
        while True:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                return True
            if item is _STOP:
                return False
            if item is _RESTART:
                self._seq = 0
                self._buffer.clear()
            elif isinstance(item, FaultConfig):
                self._faults = item
                self._rng = random.Random(item.seed)
            elif isinstance(item, KVEventBatch):
                payload = encode_batch(item)
                seq = self._seq
                self._seq += 1
                self._buffer.append((seq, payload))
                if pub is not None and self._should_send(seq):
                    pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload))
                    self._published += 1
                else:
                    self._dropped += 1

    def _should_send(self, seq: int) -> bool:
        faults = self._faults
        if faults.stop_publishing_after is not None and seq >= faults.stop_publishing_after:
            return False
        if seq in faults.drop_seqs:
            return False
        return not (faults.drop_batch_prob and self._rng.random() < faults.drop_batch_prob)

    def _serve_replays(self, replay: zmq.Socket[bytes]) -> None:
        # vLLM's `_service_replay`: [client, b"", start_seq] → every buffered batch with
        # seq >= start as [client, b"", topic, seq, payload], then the end marker.
        while True:
            try:
                frames = replay.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            if len(frames) != 3 or len(frames[2]) != 8:
                logger.warning("ignoring a malformed replay request of %d frames", len(frames))
                continue
            client, _, start_bytes = frames
            start = int.from_bytes(start_bytes, "big")
            self._replays += 1
            for seq, payload in self._buffer:
                if seq >= start:
                    replay.send_multipart(
                        (client, b"", self._topic, seq.to_bytes(8, "big"), payload)
                    )
            replay.send_multipart((client, b"", b"", END_SEQ, b""))


def _binds(endpoint: str) -> bool:
    """vLLM's rule (``ZmqEventPublisher``): bind for wildcards and local transports."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))
