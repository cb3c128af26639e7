"""Fetching a pod's replay buffer outside the live stream: on the SUB's first connection (with
live batches arriving meanwhile), on demand (`SubscriberPool.resync`, for a publisher that was
silent), and a pod restarted before it ever published live.  Real ZMQ sockets; the fake pod
answers replays as vLLM's ROUTER does."""

from __future__ import annotations

import asyncio

from indexer.subscriber import SubscriberPool
from indexer.subscriber_config import FeedStats, SubscriberConfig
from tests.indexer import test_subscriber as _subscriber_tests
from tests.indexer.test_subscriber import (
    FakeVLLMPod,
    PodFactory,
    RecordingSink,
    assert_counts,
    pod_with_history,
    publish_and_wait,
    subscribe,
    wait_until,
)

# The real-ZMQ fixtures of the subscriber tests (a fake vLLM pod, a recording sink, a pool).
context = _subscriber_tests.context
new_pod = _subscriber_tests.new_pod
sink = _subscriber_tests.sink
pool = _subscriber_tests.pool


async def restarted_after_the_first_fetch(
    pool: SubscriberPool, sink: RecordingSink, new_pod: PodFactory
) -> FakeVLLMPod:
    """A pod that cached 10 batches before ``pool`` subscribed to it as "pod-a", all applied from
    the first connection's fetch; then its process restarted on the same ports.  Returns the new
    process (generation 1), which has published nothing yet."""
    pod = await pod_with_history(new_pod, 10)
    pool.add_endpoint("pod-a", pod.pub_url, pod.replay_url)
    await wait_until(lambda: sink.applied("pod-a") == list(range(10)), "the first fetch")
    await pod.close()
    reborn = await new_pod(pub_port=pod.pub_port, replay_port=pod.replay_port)
    reborn.generation = 1
    return reborn


async def test_live_batches_during_the_first_connections_fetch_are_applied_once_in_order(
    pool: SubscriberPool, sink: RecordingSink, new_pod: PodFactory
) -> None:
    pod = await pod_with_history(new_pod, 5)
    pod.reply_delay_s = 0.2  # the fetch is still under way while the pod keeps publishing
    pool.add_endpoint("pod-a", pod.pub_url, pod.replay_url)
    await wait_until(lambda: len(pod.replay_requests) == 1, "the first connection's fetch")
    last = -1
    for _ in range(20):
        last = await pod.publish()
        await asyncio.sleep(0.01)
    await wait_until(lambda: last in sink.applied("pod-a"), "the live stream after the fetch")
    # Whatever came both live and in the buffer was applied once; nothing was skipped.
    assert sink.applied("pod-a") == list(range(last + 1))
    assert_counts(pool, resyncs=1, restarts_detected=0, gaps_unrecovered=0)


async def test_resync_on_demand_applies_what_a_silent_publisher_missed(
    pool: SubscriberPool, sink: RecordingSink, new_pod: PodFactory
) -> None:
    pod = await new_pod()
    pool.add_endpoint("pod-a", pod.pub_url, pod.replay_url)
    await wait_until(lambda: len(pod.replay_requests) == 1, "the first connection's fetch")
    await _subscriber_tests.publish_until_delivered(pod, sink, "pod-a")
    seen = await publish_and_wait(pod, sink, "pod-a", 3)
    for _ in range(4):
        await pod.publish(live=False)  # the PUB is silent, the buffer is not
    assert pool.resync("pod-a")
    await wait_until(lambda: sink.applied("pod-a")[-1] == seen + 4, "the missed batches")
    last = await publish_and_wait(pod, sink, "pod-a", 2)
    assert sink.applied("pod-a") == list(range(last + 1))
    assert not pool.resync("nobody")


async def test_a_pod_restarted_before_it_published_live_is_noticed_on_reconnection(
    pool: SubscriberPool, sink: RecordingSink, new_pod: PodFactory
) -> None:
    """Everything known about the pod came from the first connection's fetch (no live seq
    yet): a reborn pod whose buffer ends below it is still a restart."""
    reborn = await restarted_after_the_first_fetch(pool, sink, new_pod)
    for _ in range(3):
        await reborn.publish(live=False)
    await wait_until(lambda: sink.applied("pod-a", generation=1) == [0, 1, 2], "the new cache")
    ops = [ident for _, ep, ident in sink.calls if ep == "pod-a"]
    assert ops[10] is None  # cleared before the new process's batches
    assert_counts(pool, restarts_detected=1)


def _after_last_clear(sink: RecordingSink, endpoint: str) -> list[tuple[int, int] | None]:
    ops = [ident for _, ep, ident in sink.calls if ep == endpoint]
    assert None in ops, "the pod's entries were never dropped"
    return ops[len(ops) - ops[::-1].index(None) :]


async def test_a_deferred_repair_the_buffer_no_longer_covers_rebuilds_from_the_whole_buffer(
    sink: RecordingSink, new_pod: PodFactory
) -> None:
    """Gaps beyond the replay budget are repaired later; when by then the pod's buffer no longer
    reaches back to them, the pod's entries are dropped and rebuilt from the whole buffer, so no
    entry the lost batches removed survives."""
    config = SubscriberConfig(reconnect_ivl_ms=20, replay_burst=1, replay_interval_s=1.0)
    async with SubscriberPool(sink, config) as pool:
        pod = await new_pod(buffer_steps=4)
        await subscribe(pool, sink, pod)
        await asyncio.sleep(1.1)  # the first connection's fetch may have spent the token
        await pod.publish(live=False)
        await publish_and_wait(pod, sink, "pod-a", 1)  # this gap spends the token
        lost = await pod.publish(live=False)
        await publish_and_wait(pod, sink, "pod-a", 5)  # repair deferred; the buffer moves on
        await wait_until(
            lambda: (pool.endpoint_stats("pod-a") or FeedStats()).full_resyncs == 1,
            "the deferred repair",
        )
        last = await publish_and_wait(pod, sink, "pod-a", 2)
        assert lost not in sink.applied("pod-a")
        assert _after_last_clear(sink, "pod-a") == [(0, s) for s in range(lost + 2, last + 1)]


async def test_a_reconnection_after_more_batches_than_the_buffer_holds_rebuilds_from_it(
    pool: SubscriberPool, sink: RecordingSink, new_pod: PodFactory
) -> None:
    pod = await new_pod(buffer_steps=4)
    await subscribe(pool, sink, pod)
    seen = await publish_and_wait(pod, sink, "pod-a", 3)
    await pod.close()
    # The same process, reachable again after a long partition: its seq went on.
    back = await new_pod(pub_port=pod.pub_port, replay_port=pod.replay_port, buffer_steps=4)
    back.reply_delay_s = 0.3  # the resync reads the buffer once the batches below are in it
    back.seq = seen + 1
    for _ in range(10):
        await back.publish(live=False)
    await wait_until(lambda: sink.applied("pod-a")[-1] == seen + 10, "the resync")
    assert _after_last_clear(sink, "pod-a") == [(0, s) for s in range(seen + 7, seen + 11)]
    assert_counts(pool, full_resyncs=1, restarts_detected=0)


async def test_a_pod_reborn_with_an_empty_buffer_is_a_restart_before_it_publishes(
    pool: SubscriberPool, sink: RecordingSink, new_pod: PodFactory
) -> None:
    """A restarted vLLM binds its sockets before it serves, so the reconnection's fetch finds
    its buffer empty (it never empties otherwise): the old entries go at once, and the new
    process's seq 0, 1, 2 are applied, not taken for live copies of the old batches."""
    reborn = await restarted_after_the_first_fetch(pool, sink, new_pod)
    await wait_until(lambda: len(reborn.replay_requests) >= 1, "the reconnection's fetch")
    await wait_until(
        lambda: (pool.endpoint_stats("pod-a") or FeedStats()).restarts_detected == 1,
        "the restart noticed from the empty buffer",
    )
    assert [ident for _, ep, ident in sink.calls if ep == "pod-a"][10] is None  # cleared
    await _subscriber_tests.publish_until_delivered(reborn, sink, "pod-a")
    last = await publish_and_wait(reborn, sink, "pod-a", 2)
    assert sink.applied("pod-a", generation=1) == list(range(last + 1))


async def test_a_reconnection_fetch_that_fails_is_tried_once_more(
    sink: RecordingSink, new_pod: PodFactory
) -> None:
    config = SubscriberConfig(reconnect_ivl_ms=20, replay_timeout_s=0.3, replay_interval_s=0.3)
    async with SubscriberPool(sink, config) as pool:
        reborn = await restarted_after_the_first_fetch(pool, sink, new_pod)
        reborn.answer_replays = False  # the first fetch after reconnecting gets no answer
        for _ in range(3):
            await reborn.publish(live=False)
        await wait_until(lambda: len(reborn.replay_requests) >= 1, "the reconnection's fetch")
        reborn.answer_replays = True
        await wait_until(lambda: sink.applied("pod-a", generation=1) == [0, 1, 2], "the retry")
        assert_counts(pool, restarts_detected=1, replays_failed=1)


async def test_reconnect_hears_a_pod_again_after_libzmq_dropped_its_connection(
    sink: RecordingSink, new_pod: PodFactory
) -> None:
    """A message over max_message_bytes makes libzmq drop the connection and never reconnect
    it (libzmq 4.3): the pod looks silent.  `reconnect` opens a new SUB; its connection fetches
    what was missed meanwhile, and the live stream flows again."""
    config = SubscriberConfig(reconnect_ivl_ms=20, max_message_bytes=4096)
    async with SubscriberPool(sink, config) as pool:
        pod = await new_pod()
        await subscribe(pool, sink, pod)
        seen = await publish_and_wait(pod, sink, "pod-a", 2)
        await pod.send_raw([b"", (seen + 1).to_bytes(8, "big"), b"x" * 10_000])
        pod.seq = seen + 2  # vLLM would have buffered that batch; it is not needed here
        for _ in range(5):
            await pod.publish()
        await asyncio.sleep(0.5)
        assert sink.applied("pod-a")[-1] == seen  # nothing arrives any more
        fetches = len(pod.replay_requests)
        assert pool.reconnect("pod-a")
        await wait_until(lambda: sink.applied("pod-a")[-1] == seen + 6, "the reconnection")
        assert len(pod.replay_requests) == fetches + 1
        last = await publish_and_wait(pod, sink, "pod-a", 3)
        assert sink.applied("pod-a")[-8:] == list(range(seen + 2, last + 1))
        assert not pool.reconnect("nobody")
