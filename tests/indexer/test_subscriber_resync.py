"""Fetching a pod's replay buffer outside the live stream: on the SUB's first connection (with
live batches arriving meanwhile), on demand (`SubscriberPool.resync`, for a publisher that was
silent), and a pod restarted before it ever published live.  Real ZMQ sockets; the fake pod
answers replays as vLLM's ROUTER does."""

from __future__ import annotations

import asyncio

from indexer.subscriber import SubscriberPool
from tests.indexer import test_subscriber as _subscriber_tests
from tests.indexer.test_subscriber import (
    PodFactory,
    RecordingSink,
    publish_and_wait,
    wait_until,
)

# The real-ZMQ fixtures of the subscriber tests (a fake vLLM pod, a recording sink, a pool).
context = _subscriber_tests.context
new_pod = _subscriber_tests.new_pod
sink = _subscriber_tests.sink
pool = _subscriber_tests.pool


async def test_live_batches_during_the_first_connections_fetch_are_applied_once_in_order(
    pool: SubscriberPool, sink: RecordingSink, new_pod: PodFactory
) -> None:
    pod = await new_pod()
    for _ in range(5):
        await pod.publish(live=False)  # cached before the EPP started
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
    stats = pool.endpoint_stats("pod-a")
    assert stats is not None
    assert (stats.resyncs, stats.restarts_detected, stats.gaps_unrecovered) == (1, 0, 0)


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
    pod = await new_pod()
    for _ in range(10):
        await pod.publish(live=False)
    pool.add_endpoint("pod-a", pod.pub_url, pod.replay_url)
    await wait_until(lambda: sink.applied("pod-a") == list(range(10)), "the first fetch")
    await pod.close()
    reborn = await new_pod(pub_port=pod.pub_port, replay_port=pod.replay_port)
    reborn.generation = 1
    for _ in range(3):
        await reborn.publish(live=False)
    await wait_until(lambda: sink.applied("pod-a", generation=1) == [0, 1, 2], "the new cache")
    ops = [ident for _, ep, ident in sink.calls if ep == "pod-a"]
    assert ops[10] is None  # cleared before the new process's batches
    stats = pool.endpoint_stats("pod-a")
    assert stats is not None
    assert stats.restarts_detected == 1
