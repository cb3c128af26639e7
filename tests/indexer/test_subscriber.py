"""The KV-event subscriber against real ZMQ sockets on loopback.

`FakeVLLMPod` publishes exactly what vLLM's ``ZmqEventPublisher`` sends (``[topic, seq8, payload]``
on a PUB) and answers replay requests on a ROUTER as ``_service_replay`` does, in the >= 0.26 and
the <= 0.25 reply layouts (docs/vllm-interop.md §4.2, §4.4).  Batch identity travels in the
payload: the first block hash is ``generation * 1_000_000 + seq``, so the sink can tell what it
got and a restarted pod's seq 0 from the old one's.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Literal

import msgpack
import pytest
import zmq
import zmq.asyncio

from indexer.event_topic import EventTopic, parse_topic
from indexer.events import BlockStored, KVEventBatch, encode_batch
from indexer.subscriber import CentralSubscriber, SubscriberPool
from indexer.subscriber_config import FeedStats, SubscriberConfig, SubscriberConfigError

Layout = Literal["0.26", "0.25"]
_END_SEQ = b"\xff" * 8
_WAIT_S = 5.0
# Fast reconnects so a pod restarted on the same address is picked up within the test budget.
_CONFIG = SubscriberConfig(reconnect_ivl_ms=20, reconnect_ivl_max_ms=100)


def make_batch(seq: int, generation: int = 0) -> KVEventBatch:
    stored = BlockStored(
        block_hashes=(generation * 1_000_000 + seq,),
        parent_block_hash=None,
        token_ids=tuple(range(16)),
        block_size=16,
        medium="GPU",
    )
    return KVEventBatch(ts=1_767_225_600.0 + seq, events=(stored,), data_parallel_rank=0)


class RecordingSink:
    """Records every call in order: ("apply", endpoint, (generation, seq)) or ("clear", ...)."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str, tuple[int, int] | None]] = []

    def apply(self, endpoint: str, batch: KVEventBatch) -> None:
        first = batch.events[0]
        assert isinstance(first, BlockStored)
        ident = first.block_hashes[0]
        assert isinstance(ident, int)
        generation, seq = divmod(ident, 1_000_000)
        self.calls.append(("apply", endpoint, (generation, seq)))

    def clear_endpoint(self, endpoint: str) -> None:
        self.calls.append(("clear", endpoint, None))

    def applied(self, endpoint: str, generation: int = 0) -> list[int]:
        return [
            ident[1]
            for kind, ep, ident in self.calls
            if kind == "apply" and ep == endpoint and ident is not None and ident[0] == generation
        ]


async def wait_until(condition: Callable[[], bool], what: str, timeout: float = _WAIT_S) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not condition():
        if loop.time() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        await asyncio.sleep(0.005)


class FakeVLLMPod:
    """vLLM's KV-event publisher: a PUB (bound like ``tcp://*:5557``, or connected to a central
    subscriber) and a replay ROUTER with a buffer of the last ``buffer_steps`` batches."""

    def __init__(
        self,
        context: zmq.asyncio.Context,
        *,
        topic: bytes = b"",
        layout: Layout = "0.26",
        buffer_steps: int = 10_000,
        connect_to: str | None = None,
        replay: bool = True,
        pub_port: int | None = None,
        replay_port: int | None = None,
    ) -> None:
        self.topic = topic
        self.layout = layout
        self.generation = 0
        self.seq = 0
        self.buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self.replay_requests: list[int] = []
        self.answer_replays = True
        self.reply_delay_s = 0.0
        self.pub = context.socket(zmq.PUB)
        self.pub.setsockopt(zmq.LINGER, 0)
        if connect_to is not None:
            self.pub.connect(connect_to)
            self.pub_url = connect_to
        else:
            if pub_port is None:
                pub_port = self.pub.bind_to_random_port("tcp://127.0.0.1")
            else:
                _bind_again(self.pub, pub_port)
            self.pub_url = f"tcp://127.0.0.1:{pub_port}"
        self.pub_port = pub_port
        self.router: zmq.asyncio.Socket | None = None
        self.replay_url: str | None = None
        self.replay_port = replay_port
        self._server: asyncio.Task[None] | None = None
        if replay:
            self.router = context.socket(zmq.ROUTER)
            self.router.setsockopt(zmq.LINGER, 0)
            self.router.setsockopt(zmq.SNDHWM, 2 * (buffer_steps + 1))  # as vLLM does
            if replay_port is None:
                self.replay_port = self.router.bind_to_random_port("tcp://127.0.0.1")
            else:
                _bind_again(self.router, replay_port)
            self.replay_url = f"tcp://127.0.0.1:{self.replay_port}"
            self._server = asyncio.get_running_loop().create_task(self._service_replay())

    async def publish(self, *, live: bool = True, payload: bytes | None = None) -> int:
        """Publish the next batch (vLLM: send, then append to the replay buffer).  ``live=False``
        keeps it only in the buffer, as if the PUB had dropped it."""
        seq = self.seq
        self.seq += 1
        if payload is None:
            payload = encode_batch(make_batch(seq, self.generation))
        if live:
            await self.pub.send_multipart([self.topic, seq.to_bytes(8, "big"), payload])
        self.buffer.append((seq, payload))
        return seq

    async def send_raw(self, frames: list[bytes]) -> None:
        await self.pub.send_multipart(frames)

    def restart_in_place(self) -> None:
        """A new vLLM process: seq from 0, empty buffer, blocks of a new generation."""
        self.generation += 1
        self.seq = 0
        self.buffer.clear()

    async def _service_replay(self) -> None:
        assert self.router is not None
        while True:
            frame = await self.router.recv_multipart()
            if len(frame) != 3:
                continue
            client_id, _, start_seq_bytes = frame
            start_seq = int.from_bytes(start_seq_bytes, "big")
            self.replay_requests.append(start_seq)
            if not self.answer_replays:
                continue
            if self.reply_delay_s:
                await asyncio.sleep(self.reply_delay_s)
            for seq, buf in list(self.buffer):
                if seq >= start_seq:
                    await self.router.send_multipart(
                        self._reply(client_id, seq.to_bytes(8, "big"), buf)
                    )
            await self.router.send_multipart(self._reply(client_id, _END_SEQ, b""))

    def _reply(self, client_id: bytes, seq8: bytes, payload: bytes) -> list[bytes]:
        if self.layout == "0.26":
            topic = b"" if seq8 == _END_SEQ else self.topic
            return [client_id, b"", topic, seq8, payload]
        return [client_id, b"", seq8, payload]

    async def close(self) -> None:
        if self._server is not None:
            self._server.cancel()
            await asyncio.gather(self._server, return_exceptions=True)
        self.pub.close(linger=0)
        if self.router is not None:
            self.router.close(linger=0)


def _bind_again(sock: zmq.asyncio.Socket, port: int) -> None:
    """Bind a port a closed socket just held: libzmq releases it in its I/O thread, shortly
    after close() returns."""
    deadline = time.monotonic() + _WAIT_S
    while True:
        try:
            sock.bind(f"tcp://127.0.0.1:{port}")
            return
        except zmq.ZMQError as exc:
            if exc.errno != zmq.EADDRINUSE or time.monotonic() > deadline:
                raise
            time.sleep(0.005)


PodFactory = Callable[..., Awaitable[FakeVLLMPod]]


@pytest.fixture
async def context() -> AsyncIterator[zmq.asyncio.Context]:
    ctx = zmq.asyncio.Context()
    yield ctx
    ctx.destroy(linger=0)


@pytest.fixture
async def new_pod(context: zmq.asyncio.Context) -> AsyncIterator[PodFactory]:
    pods: list[FakeVLLMPod] = []

    async def factory(**kwargs: object) -> FakeVLLMPod:
        pod = FakeVLLMPod(context, **kwargs)  # type: ignore[arg-type]
        pods.append(pod)
        return pod

    yield factory
    for pod in pods:
        await pod.close()


@pytest.fixture
def sink() -> RecordingSink:
    return RecordingSink()


@pytest.fixture
async def pool(sink: RecordingSink) -> AsyncIterator[SubscriberPool]:
    subscriber = SubscriberPool(sink, _CONFIG)
    yield subscriber
    await subscriber.close()


async def publish_until_delivered(pod: FakeVLLMPod, sink: RecordingSink, endpoint: str) -> int:
    """Publish until the subscription is live (PUB/SUB slow joiner); returns the last seq."""
    before = len(sink.applied(endpoint, pod.generation))
    loop = asyncio.get_running_loop()
    deadline = loop.time() + _WAIT_S
    while True:
        seq = await pod.publish()
        for _ in range(10):
            if len(sink.applied(endpoint, pod.generation)) > before:
                return seq
            await asyncio.sleep(0.005)
        if loop.time() > deadline:
            raise AssertionError(f"no batch from {endpoint} reached the sink")


async def publish_and_wait(pod: FakeVLLMPod, sink: RecordingSink, endpoint: str, n: int) -> int:
    last = -1
    for _ in range(n):
        last = await pod.publish()
    await wait_until(
        lambda: last in sink.applied(endpoint, pod.generation), f"seq {last} from {endpoint}"
    )
    return last


async def subscribe(pool: SubscriberPool, sink: RecordingSink, pod: FakeVLLMPod) -> int:
    """Add ``pod`` to ``pool`` as "pod-a" (with its replay socket, if it has one) and publish
    until the subscription is live; returns the last seq published."""
    pool.add_endpoint("pod-a", pod.pub_url, pod.replay_url)
    return await publish_until_delivered(pod, sink, "pod-a")


async def pod_with_history(new_pod: PodFactory, batches: int) -> FakeVLLMPod:
    """A new pod that published ``batches`` batches before anyone subscribed: they are in its
    replay buffer only (a pod that was serving before the EPP started)."""
    pod = await new_pod()
    for _ in range(batches):
        await pod.publish(live=False)
    return pod


def stats_of(pool: SubscriberPool, endpoint: str = "pod-a") -> FeedStats:
    stats = pool.endpoint_stats(endpoint)
    assert stats is not None, f"no stats for {endpoint}"
    return stats


def assert_counts(pool: SubscriberPool, endpoint: str = "pod-a", **expected: int) -> None:
    """The endpoint's `FeedStats` counters named in ``expected`` have exactly those values."""
    stats = stats_of(pool, endpoint)
    assert {name: getattr(stats, name) for name in expected} == expected


@pytest.fixture
async def pod(pool: SubscriberPool, sink: RecordingSink, new_pod: PodFactory) -> FakeVLLMPod:
    """A fake pod (with replay) that ``pool`` subscribes to as "pod-a", its stream live."""
    pod = await new_pod()
    await subscribe(pool, sink, pod)
    return pod


# ---------------------------------------------------------------------------------------------
# Per-endpoint mode.


@pytest.mark.parametrize("layout", ["0.26", "0.25"])
async def test_in_order_delivery_with_history_from_replay(
    pool: SubscriberPool, sink: RecordingSink, new_pod: PodFactory, layout: Layout
) -> None:
    pod = await new_pod(layout=layout)
    for _ in range(3):
        await pod.publish()  # before anyone subscribed: lost on the PUB, kept in the buffer
    await subscribe(pool, sink, pod)
    last = await publish_and_wait(pod, sink, "pod-a", 20)

    # What was published before the subscription came from the first-contact replay.
    assert sink.applied("pod-a") == list(range(last + 1))
    assert pod.replay_requests == [0]
    stats = stats_of(pool)
    assert stats.batches_applied == stats.events == last + 1
    assert stats.batches_replayed >= 4
    assert stats.gaps_detected == stats.decode_errors == stats.malformed_frames == 0
    assert stats.last_message_time is not None


async def test_an_idle_pods_history_is_fetched_when_the_sub_connects(
    pool: SubscriberPool, sink: RecordingSink, new_pod: PodFactory
) -> None:
    """A pod that cached blocks before the EPP started and then stays idle: its buffer is fetched
    as soon as the SUB connects, not at its next batch (which may never come)."""
    pod = await pod_with_history(new_pod, 5)
    pool.add_endpoint("pod-a", pod.pub_url, pod.replay_url)
    await wait_until(lambda: sink.applied("pod-a") == [0, 1, 2, 3, 4], "the buffer fetched")
    assert pod.replay_requests == [0]
    # The live stream then continues from there, each batch once.
    last = await publish_and_wait(pod, sink, "pod-a", 3)
    assert sink.applied("pod-a") == list(range(last + 1))
    assert_counts(pool, resyncs=1, gaps_detected=0, restarts_detected=0)


async def test_live_messages_during_a_replay_are_held_and_applied_once_in_order(
    pool: SubscriberPool, sink: RecordingSink, pod: FakeVLLMPod
) -> None:
    await publish_and_wait(pod, sink, "pod-a", 2)

    pod.reply_delay_s = 0.1
    requests = len(pod.replay_requests)
    await pod.publish(live=False)
    await pod.publish()  # reveals the gap
    await wait_until(lambda: len(pod.replay_requests) > requests, "the replay request")
    last = await publish_and_wait(pod, sink, "pod-a", 5)  # published while the reply waits

    assert sink.applied("pod-a") == list(range(last + 1))
    stats = stats_of(pool)
    assert stats.gaps_recovered == 1
    assert stats.duplicates_dropped >= 6  # the held live copies of replayed batches


async def test_in_order_delivery_without_replay(
    pool: SubscriberPool, sink: RecordingSink, new_pod: PodFactory
) -> None:
    pod = await new_pod(replay=False)
    first = await subscribe(pool, sink, pod)
    last = await publish_and_wait(pod, sink, "pod-a", 20)

    applied = sink.applied("pod-a")
    assert applied == list(range(applied[0], last + 1))
    assert applied[0] <= first
    assert pool.stats.gaps_detected == 0


@pytest.mark.parametrize("layout", ["0.26", "0.25"])
async def test_dropped_batch_is_recovered_by_replay_in_order(
    pool: SubscriberPool, sink: RecordingSink, new_pod: PodFactory, layout: Layout
) -> None:
    pod = await new_pod(layout=layout)
    await subscribe(pool, sink, pod)
    await publish_and_wait(pod, sink, "pod-a", 3)

    dropped = await pod.publish(live=False)
    await pod.publish(live=False)
    last = await publish_and_wait(pod, sink, "pod-a", 5)

    assert sink.applied("pod-a") == list(range(last + 1))
    assert pod.replay_requests[-1] == dropped
    stats = stats_of(pool)
    assert (stats.gaps_detected, stats.gaps_recovered, stats.gaps_unrecovered) == (1, 1, 0)
    assert stats.batches_replayed >= 2


async def test_gaps_beyond_the_replay_budget_are_repaired_by_one_later_replay(
    sink: RecordingSink, new_pod: PodFactory
) -> None:
    """A lossy network: more gaps at once than the replay budget allows.  The stream goes on
    with holes, then one replay from the earliest missed seq re-applies everything since, in
    order, so the index converges instead of keeping the holes."""
    config = SubscriberConfig(reconnect_ivl_ms=20, replay_burst=1, replay_interval_s=0.3)
    async with SubscriberPool(sink, config) as pool:
        pod = await new_pod()
        await subscribe(pool, sink, pod)
        await asyncio.sleep(0.35)  # one token back
        lost = []
        for _ in range(5):  # each gap seen on its own, faster than the budget refills
            lost.append(await pod.publish(live=False))
            await publish_and_wait(pod, sink, "pod-a", 1)
        last = pod.seq - 1
        await wait_until(lambda: set(lost) <= set(sink.applied("pod-a")), "every hole repaired")
        applied = sink.applied("pod-a")
        assert set(applied) == set(range(last + 1))
        # The repair re-applied, in order, everything from the first seq it had to repair.
        deferred = [seq for seq in lost if applied.index(seq) > applied.index(seq + 1)]
        assert deferred, "no gap waited for the budget"
        assert applied[-(last + 1 - deferred[0]) :] == list(range(deferred[0], last + 1))
        stats = stats_of(pool)
        assert stats.gaps_detected == 5
        assert (stats.gaps_recovered, stats.gaps_unrecovered) == (5, 0)
        assert stats.replays_rate_limited >= 1
        assert len(pod.replay_requests) <= 4  # first contact + at most one per budget token


async def test_gap_without_replay_is_counted_and_processing_continues(
    pool: SubscriberPool, sink: RecordingSink, new_pod: PodFactory
) -> None:
    pod = await new_pod(replay=False)
    await subscribe(pool, sink, pod)

    dropped = await pod.publish(live=False)
    last = await publish_and_wait(pod, sink, "pod-a", 3)

    applied = sink.applied("pod-a")
    assert dropped not in applied
    assert applied[-3:] == [dropped + 1, dropped + 2, last]
    assert_counts(pool, gaps_detected=1, gaps_unrecovered=1, replays_requested=0)


async def test_a_replay_that_times_out_is_repaired_by_one_later_replay(
    sink: RecordingSink, new_pod: PodFactory
) -> None:
    """A replay with no answer in time does not stop the stream, nor leave the hole for good:
    one later replay re-applies everything from the missed seq in order.  A repair that gets
    no answer either is given up (counted unrecovered), not retried forever."""
    config = SubscriberConfig(replay_timeout_s=0.2, replay_interval_s=1.0, reconnect_ivl_ms=20)
    async with SubscriberPool(sink, config) as pool:
        pod = await new_pod()
        await subscribe(pool, sink, pod)

        pod.answer_replays = False
        lost = await pod.publish(live=False)
        last = await publish_and_wait(pod, sink, "pod-a", 3)
        assert lost not in sink.applied("pod-a")
        assert sink.applied("pod-a")[-3:] == [lost + 1, lost + 2, last]
        assert_counts(pool, gaps_unrecovered=0, replays_failed=1)

        pod.answer_replays = True  # answers again (the replay socket was replaced meanwhile)

        def repaired() -> bool:
            # The repair's batches arrive one by one: wait for the whole run, in order, rather
            # than for its first batch (which a loaded machine shows alone for a while).
            applied = sink.applied("pod-a")
            return lost in applied and applied[applied.index(lost) :] == list(range(lost, last + 1))

        await wait_until(repaired, "the repair, every batch from the lost one in order")
        assert_counts(pool, gaps_detected=1, gaps_recovered=1, gaps_unrecovered=0)

        # Once a replay got no answer, a later gap goes to the pending repair, not a replay
        # of its own (live batches are not held behind another timeout).
        pod.answer_replays = False
        requests_before = stats_of(pool).replays_requested
        lost = await pod.publish(live=False)
        await publish_and_wait(pod, sink, "pod-a", 1)
        await wait_until(
            lambda: (pool.endpoint_stats("pod-a") or FeedStats()).replays_failed == 2,
            "the gap's replay timing out",
        )
        lost_too = await pod.publish(live=False)
        await publish_and_wait(pod, sink, "pod-a", 1)
        await wait_until(
            lambda: (pool.endpoint_stats("pod-a") or FeedStats()).gaps_unrecovered == 2,
            "the repair given up",
        )
        stats = stats_of(pool)
        assert (stats.replays_failed, stats.gaps_recovered) == (3, 1)
        assert stats.replays_requested - requests_before == 2  # the first gap's, one repair
        assert lost not in sink.applied("pod-a") and lost_too not in sink.applied("pod-a")


async def test_gap_older_than_the_replay_buffer_rebuilds_the_pods_entries_from_it(
    pool: SubscriberPool, sink: RecordingSink, new_pod: PodFactory
) -> None:
    pod = await new_pod(buffer_steps=4)
    await subscribe(pool, sink, pod)
    before = len(sink.calls)

    first_lost = await pod.publish(live=False)
    for _ in range(5):
        await pod.publish(live=False)
    last = await publish_and_wait(pod, sink, "pod-a", 1)

    # The buffer held only the last 4 batches: the lost ones may have removed blocks, so the
    # pod's entries are dropped first (full resync), then those 4 applied, in order, once each.
    assert sink.calls[before:] == [
        ("clear", "pod-a", None),
        *(("apply", "pod-a", (0, seq)) for seq in range(last - 3, last + 1)),
    ]
    assert pod.replay_requests[-1] == first_lost
    assert_counts(pool, gaps_detected=1, gaps_recovered=1, gaps_unrecovered=0, full_resyncs=1)


async def test_seq_going_back_means_restart_and_clears_before_new_batches(
    pool: SubscriberPool, sink: RecordingSink, pod: FakeVLLMPod
) -> None:
    await publish_and_wait(pod, sink, "pod-a", 5)

    pod.restart_in_place()
    await publish_and_wait(pod, sink, "pod-a", 3)

    kinds = [(kind, ident) for kind, ep, ident in sink.calls if ep == "pod-a"]
    clear_at = kinds.index(("clear", None))
    assert all(ident is not None and ident[0] == 0 for _, ident in kinds[:clear_at])
    assert [ident for _, ident in kinds[clear_at + 1 :]] == [(1, 0), (1, 1), (1, 2)]
    assert_counts(pool, restarts_detected=1, gaps_detected=0)


async def test_pod_restarted_on_the_same_address_is_picked_up_again(
    pool: SubscriberPool, sink: RecordingSink, pod: FakeVLLMPod, new_pod: PodFactory
) -> None:
    await publish_and_wait(pod, sink, "pod-a", 30)

    await pod.close()
    reborn = await new_pod(pub_port=pod.pub_port, replay_port=pod.replay_port)
    reborn.generation = 1
    await publish_until_delivered(reborn, sink, "pod-a")
    last = await publish_and_wait(reborn, sink, "pod-a", 3)

    ops = [ident for _, ep, ident in sink.calls if ep == "pod-a"]
    clear_at = ops.index(None)
    assert all(ident is not None and ident[0] == 0 for ident in ops[:clear_at])
    # What the new process published before the SUB reconnected came from its replay buffer.
    assert sink.applied("pod-a", generation=1) == list(range(last + 1))
    assert ops[clear_at + 1 :] == [(1, seq) for seq in range(last + 1)]


async def test_malformed_frames_and_bad_payloads_are_counted_and_dropped(
    pool: SubscriberPool, sink: RecordingSink, pod: FakeVLLMPod
) -> None:
    next_seq = (pod.seq).to_bytes(8, "big")
    good_payload = encode_batch(make_batch(pod.seq))

    await pod.send_raw([b"", next_seq])  # two frames
    await pod.send_raw([b"", next_seq[:4], good_payload])  # 4-byte seq
    await pod.send_raw([b"", next_seq, good_payload, b"extra"])  # four frames
    bad_msgpack = await pod.publish(payload=b"\xc1")
    not_a_batch = await pod.publish(payload=msgpack.packb({"ts": 1.0}))
    last = await publish_and_wait(pod, sink, "pod-a", 2)

    applied = sink.applied("pod-a")
    assert bad_msgpack not in applied and not_a_batch not in applied
    assert applied[-2:] == [last - 1, last]
    assert_counts(pool, malformed_frames=3, decode_errors=2, gaps_detected=0)


async def test_a_failing_sink_is_counted_and_delivery_continues(new_pod: PodFactory) -> None:
    class FlakySink(RecordingSink):
        def apply(self, endpoint: str, batch: KVEventBatch) -> None:
            super().apply(endpoint, batch)
            if len(self.calls) == 2:
                raise RuntimeError("index full")

    sink = FlakySink()
    async with SubscriberPool(sink, _CONFIG) as pool:
        pod = await new_pod()
        await subscribe(pool, sink, pod)
        last = await publish_and_wait(pod, sink, "pod-a", 3)
        assert sink.applied("pod-a") == list(range(last + 1))
        assert pool.stats.sink_errors == 1


async def test_remove_endpoint_stops_delivery_and_keeps_totals(
    pool: SubscriberPool, sink: RecordingSink, new_pod: PodFactory
) -> None:
    pod_a, pod_b = await new_pod(replay=False), await new_pod(replay=False)
    pool.add_endpoint("pod-a", pod_a.pub_url)
    pool.add_endpoint("pod-b", pod_b.pub_url)
    await publish_until_delivered(pod_a, sink, "pod-a")
    await publish_until_delivered(pod_b, sink, "pod-b")
    delivered_a = len(sink.applied("pod-a"))

    assert pool.remove_endpoint("pod-a") is True
    assert pool.remove_endpoint("pod-a") is False
    assert pool.endpoints == ("pod-b",)
    assert pool.endpoint_stats("pod-a") is None
    await wait_until(lambda: not _tasks("kv-events-sub:pod-a"), "the receive task to end")

    await pod_a.publish()
    await publish_and_wait(pod_b, sink, "pod-b", 3)
    assert len(sink.applied("pod-a")) == delivered_a
    assert pool.stats.batches_applied == delivered_a + len(sink.applied("pod-b"))
    assert pool.stats.endpoints == 1


async def test_add_endpoint_again_is_idempotent_and_rejects_bad_urls(
    pool: SubscriberPool, sink: RecordingSink, new_pod: PodFactory
) -> None:
    pod = await new_pod()
    pool.add_endpoint("pod-a", pod.pub_url, pod.replay_url)
    await subscribe(pool, sink, pod)
    assert pool.endpoints == ("pod-a",)
    with pytest.raises(SubscriberConfigError, match="pub_url"):
        pool.add_endpoint("pod-b", "not a url")
    with pytest.raises(SubscriberConfigError, match="replay_url"):
        pool.add_endpoint("pod-b", pod.pub_url, "nope://x")
    assert pool.endpoints == ("pod-a",)


async def test_close_leaves_no_tasks_even_during_a_replay(
    sink: RecordingSink, new_pod: PodFactory
) -> None:
    pool = SubscriberPool(sink, SubscriberConfig(replay_timeout_s=30.0, reconnect_ivl_ms=20))
    pod = await new_pod()
    await subscribe(pool, sink, pod)
    pod.answer_replays = False
    await pod.publish(live=False)
    await pod.publish()
    await wait_until(lambda: bool(pod.replay_requests and _tasks("kv-events-replay")), "replay")

    await pool.close()
    await pool.close()
    assert _tasks("kv-events") == []
    with pytest.raises(SubscriberConfigError, match="closed"):
        pool.add_endpoint("pod-b", pod.pub_url)


def _tasks(prefix: str) -> list[asyncio.Task[object]]:
    return [t for t in asyncio.all_tasks() if t.get_name().startswith(prefix) and not t.done()]


# ---------------------------------------------------------------------------------------------
# Central mode.


async def test_central_bind_routes_by_topic_and_drops_unknown_endpoints(
    sink: RecordingSink, new_pod: PodFactory
) -> None:
    async with CentralSubscriber(sink, "tcp://127.0.0.1:0", _CONFIG) as central:
        url = central.bound_url
        pod_a = await new_pod(topic=b"kv@127.0.0.1:8001@model", connect_to=url)
        pod_b = await new_pod(topic=b"kv@127.0.0.1:8002@model", connect_to=url, replay=False)
        llmd = await new_pod(topic=b"kv@127.0.0.9@org/model@v2", connect_to=url, replay=False)
        stranger = await new_pod(topic=b"kv@127.0.0.1:8003@model", connect_to=url)
        for _ in range(3):
            await pod_a.publish()  # before registration: dropped, later replayed
        central.add_endpoint("127.0.0.1:8001", pod_a.replay_url)
        central.add_endpoint("127.0.0.1:8002")
        central.add_endpoint("127.0.0.9:8000")

        await publish_until_delivered(pod_a, sink, "127.0.0.1:8001")
        await publish_until_delivered(pod_b, sink, "127.0.0.1:8002")
        await publish_until_delivered(llmd, sink, "127.0.0.9:8000")
        await stranger.publish()
        await stranger.send_raw([b"not-a-kv-topic", b"\x00" * 8, b""])
        await stranger.send_raw([b"kv@127.0.0.1:8001@model", b"\x00" * 8])
        for _ in range(5):
            await pod_a.publish()
            await pod_b.publish()
        last_a = await publish_and_wait(pod_a, sink, "127.0.0.1:8001", 1)
        last_b = await publish_and_wait(pod_b, sink, "127.0.0.1:8002", 1)

        assert sink.applied("127.0.0.1:8001") == list(range(last_a + 1))  # history via replay
        applied_b = sink.applied("127.0.0.1:8002")
        assert applied_b == list(range(applied_b[0], last_b + 1))
        assert sink.applied("127.0.0.9:8000")
        await wait_until(lambda: central.stats.unroutable_messages >= 2, "unroutable counted")
        await wait_until(lambda: central.stats.malformed_frames == 1, "malformed counted")
        assert not [call for call in sink.calls if call[1].endswith(":8003")]
        assert central.stats.gaps_detected == 0


async def test_central_accept_unregistered_registers_on_first_sight(
    sink: RecordingSink, new_pod: PodFactory
) -> None:
    config = SubscriberConfig(accept_unregistered=True)
    async with CentralSubscriber(sink, "tcp://127.0.0.1:0", config) as central:
        pod = await new_pod(topic=b"kv@[FD00:0::7]:8000@m", connect_to=central.bound_url)
        await publish_until_delivered(pod, sink, "[fd00::7]:8000")
        assert central.endpoints == ("[fd00::7]:8000",)
        # Registering it explicitly (another spelling, with replay) takes over the address.
        central.add_endpoint("[fd00:0:0::7]:8000", pod.replay_url)
        assert central.endpoints == ("[fd00:0:0::7]:8000",)
        await publish_until_delivered(pod, sink, "[fd00:0:0::7]:8000")


async def test_central_rejects_bad_endpoints_and_busy_addresses(sink: RecordingSink) -> None:
    async with CentralSubscriber(sink, "tcp://127.0.0.1:0") as central:
        central.add_endpoint("10.0.0.7:8000")
        with pytest.raises(SubscriberConfigError, match="host:port"):
            central.add_endpoint("10.0.0.7")
        with pytest.raises(SubscriberConfigError, match="address of the registered endpoint"):
            central.add_endpoint("10.0.0.7:08000")
        with pytest.raises(SubscriberConfigError, match="cannot bind"):
            CentralSubscriber(sink, central.bound_url)


# ---------------------------------------------------------------------------------------------
# Pure parts.


@pytest.mark.parametrize(
    ("topic", "expected"),
    [
        (b"kv@127.0.0.1:8001@model", EventTopic("127.0.0.1", 8001, "model")),
        (b"kv@10.0.0.7@Qwen/Qwen3-0.6B", EventTopic("10.0.0.7", None, "Qwen/Qwen3-0.6B")),
        (b"kv@[FD00::1]:8000@m@v2", EventTopic("fd00::1", 8000, "m@v2")),
        (b"kv@fd00::1@m", EventTopic("fd00::1", None, "m")),
        (b"kv@Pod-A.ns.svc:8000@", EventTopic("pod-a.ns.svc", 8000, "")),
        (b"", None),
        (b"kv@127.0.0.1:8001", None),
        (b"xx@127.0.0.1:8001@m", None),
        (b"kv@127.0.0.1:0@m", None),
        (b"kv@127.0.0.1:99999@m", None),
        (b"kv@[fd00::1]8000@m", None),
        (b"kv@[fd00::1@m", None),
        (b"kv@@m", None),
        (b"kv@\xff\xfe@m", None),
    ],
)
def test_parse_topic(topic: bytes, expected: EventTopic | None) -> None:
    assert parse_topic(topic) == expected


def test_event_topic_endpoint_brackets_ipv6() -> None:
    assert EventTopic("fd00::1", 8000, "m").endpoint == "[fd00::1]:8000"
    assert EventTopic("10.0.0.7", 8000, "m").endpoint == "10.0.0.7:8000"


@pytest.mark.parametrize(
    "kwargs",
    [{"replay_timeout_s": 0}, {"rcvhwm": 0}, {"yield_every": 0}, {"heartbeat_ivl_ms": -1}],
)
def test_config_rejects_bad_numbers(kwargs: dict[str, float]) -> None:
    with pytest.raises(SubscriberConfigError, match=next(iter(kwargs))):
        SubscriberConfig(**kwargs)  # type: ignore[arg-type]
