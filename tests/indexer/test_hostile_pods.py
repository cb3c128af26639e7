"""Pods that misbehave on purpose or by bug: hash floods, forged sequence numbers, enormous
batches.  None of them may evict another pod's entries, replay in a loop or stall the loop."""

from __future__ import annotations

import random

from indexer.events import BlockStored, KVEventBatch, encode_batch
from indexer.index import KVBlockIndex
from indexer.subscriber import SubscriberPool
from indexer.subscriber_config import SubscriberConfig
from tests.indexer import test_subscriber as _subscriber_tests
from tests.indexer.test_subscriber import (
    PodFactory,
    RecordingSink,
    assert_counts,
    make_batch,
    publish_and_wait,
    publish_until_delivered,
    wait_until,
)

# The real-ZMQ fixtures of the subscriber tests (a fake vLLM pod, a recording sink).
context = _subscriber_tests.context
new_pod = _subscriber_tests.new_pod
sink = _subscriber_tests.sink

HONEST, OTHER, FLOODER = "10.0.0.1:8000", "10.0.0.2:8000", "10.0.0.66:8000"


def test_a_hash_flood_from_one_pod_evicts_only_its_own_entries() -> None:
    index = KVBlockIndex(max_entries=10_000)
    honest = list(range(1, 2_001))
    index.store(HONEST, honest)
    index.store(OTHER, range(5_000, 6_000))
    rng = random.Random(1)
    for _ in range(500):  # 500k bogus keys, 50 times the whole index
        index.store(FLOODER, [rng.getrandbits(64) for _ in range(1_000)])
    assert index.entries <= index.max_entries
    assert index.longest_prefix(honest, [HONEST]) == {HONEST: 2_000}
    assert index.endpoint_stats(OTHER).blocks == 1_000
    # It keeps only what the others leave free: its excess went, not their blocks.
    assert index.endpoint_stats(FLOODER).blocks <= index.max_entries - 3_000
    assert index.share_evictions_total > 400_000
    assert index.consistency_errors() == []


def test_a_flood_of_blocks_others_hold_only_adds_the_flooders_bit() -> None:
    index = KVBlockIndex(max_entries=1_000)
    index.store(HONEST, range(300))
    for _ in range(20):
        index.store(FLOODER, range(300))  # claims the honest pod's blocks, over and over
        index.remove(FLOODER, range(300))  # and removes them: only its own bit goes
    assert index.longest_prefix(list(range(300)), [HONEST, FLOODER]) == {HONEST: 300, FLOODER: 0}
    assert index.consistency_errors() == []


async def test_forged_sequence_jumps_do_not_cause_a_replay_storm(
    sink: RecordingSink, new_pod: PodFactory
) -> None:
    config = SubscriberConfig(
        reconnect_ivl_ms=20, reconnect_ivl_max_ms=100, replay_burst=2, replay_interval_s=60
    )
    pool = SubscriberPool(sink, config)
    try:
        pod = await new_pod()
        pool.add_endpoint("pod-a", pod.pub_url, pod.replay_url)
        await publish_until_delivered(pod, sink, "pod-a")
        requests_before = len(pod.replay_requests)
        seq = pod.seq
        for jump in range(1, 41):  # forged seqs far ahead of anything the pod buffered: 40 gaps
            seq += 1_000 * jump
            await pod.send_raw([b"", seq.to_bytes(8, "big"), encode_batch(make_batch(seq))])

        def gaps() -> int:
            stats = pool.endpoint_stats("pod-a")
            return 0 if stats is None else stats.gaps_detected

        await wait_until(lambda: gaps() >= 40, "40 gaps")
        stats = pool.endpoint_stats("pod-a")
        assert stats is not None
        assert len(pod.replay_requests) - requests_before <= 2  # the budget, not 40
        assert stats.replays_rate_limited >= 38
        # Forged seqs going backwards look like restarts: each clears only this pod, and the
        # restart's first-contact replay is under the same budget.
        for back in range(10):
            await pod.send_raw(
                [b"", (5 + back % 2).to_bytes(8, "big"), encode_batch(make_batch(5))]
            )
        await wait_until(
            lambda: (pool.endpoint_stats("pod-a") or stats).restarts_detected >= 5, "restarts"
        )
        assert len(pod.replay_requests) - requests_before <= 2
    finally:
        await pool.close()


async def test_an_enormous_batch_is_dropped_unread_and_the_stream_goes_on(
    sink: RecordingSink, new_pod: PodFactory
) -> None:
    config = SubscriberConfig(
        reconnect_ivl_ms=20, reconnect_ivl_max_ms=100, max_batch_bytes=64 * 1024
    )
    pool = SubscriberPool(sink, config)
    try:
        pod = await new_pod(replay=False)
        pool.add_endpoint("pod-a", pod.pub_url)
        await publish_until_delivered(pod, sink, "pod-a")
        huge = KVEventBatch(
            ts=0.0,
            events=tuple(
                BlockStored(
                    block_hashes=(i,), parent_block_hash=None, token_ids=(1,) * 16, block_size=16
                )
                for i in range(2_000)
            ),
        )
        payload = encode_batch(huge)
        assert len(payload) > 64 * 1024
        big_seq = await pod.publish(payload=payload)
        last = await publish_and_wait(pod, sink, "pod-a", 3)
        assert sink.applied("pod-a")[-3:] == [big_seq + 1, big_seq + 2, last]
        assert_counts(pool, oversized_batches=1, gaps_detected=0)
    finally:
        await pool.close()


async def test_a_pod_restarted_while_unheard_is_noticed_on_reconnection(
    sink: RecordingSink, new_pod: PodFactory
) -> None:
    """The new process published a few batches before the SUB reconnected (lost: PUB/SUB has
    no backlog) and then goes quiet: without the reconnection resync, its old blocks would stay
    in the index until its next batch, however long that takes."""
    pool = SubscriberPool(sink, SubscriberConfig(reconnect_ivl_ms=20, reconnect_ivl_max_ms=50))
    try:
        pod = await new_pod()
        pool.add_endpoint("pod-a", pod.pub_url, pod.replay_url)
        await publish_until_delivered(pod, sink, "pod-a")
        await publish_and_wait(pod, sink, "pod-a", 30)
        before = pool.endpoint_stats("pod-a")
        assert before is not None
        resyncs_before = before.resyncs  # 0, or 1 if the first connection's fetch ran first
        await pod.close()
        reborn = await new_pod(pub_port=pod.pub_port, replay_port=pod.replay_port)
        reborn.generation = 1
        for _ in range(3):
            await reborn.publish(live=False)  # published before anyone listened
        await wait_until(lambda: ("clear", "pod-a", None) in sink.calls, "restart noticed")
        await wait_until(lambda: sink.applied("pod-a", generation=1) == [0, 1, 2], "resynced")
        stats = pool.endpoint_stats("pod-a")
        assert stats is not None
        assert (stats.resyncs - resyncs_before, stats.restarts_detected) == (1, 1)
        # Live batches continue after the resync, once each.
        last = await publish_and_wait(reborn, sink, "pod-a", 3)
        assert sink.applied("pod-a", generation=1) == list(range(last + 1))
    finally:
        await pool.close()


async def test_a_network_blip_is_filled_on_reconnection(
    sink: RecordingSink, new_pod: PodFactory
) -> None:
    pool = SubscriberPool(sink, SubscriberConfig(reconnect_ivl_ms=20, reconnect_ivl_max_ms=50))
    try:
        pod = await new_pod()
        pool.add_endpoint("pod-a", pod.pub_url, pod.replay_url)
        await publish_until_delivered(pod, sink, "pod-a")
        last = await publish_and_wait(pod, sink, "pod-a", 5)
        # Same process, the connection drops: what it published meanwhile is only in its buffer.
        buffer = list(pod.buffer)
        await pod.close()
        same = await new_pod(pub_port=pod.pub_port, replay_port=pod.replay_port)
        same.seq, same.buffer = pod.seq, type(pod.buffer)(buffer, maxlen=pod.buffer.maxlen)
        missed = [await same.publish(live=False) for _ in range(4)]
        await wait_until(lambda: sink.applied("pod-a")[-1:] == missed[-1:], "hole filled")
        assert sink.applied("pod-a") == list(range(missed[-1] + 1))
        assert ("clear", "pod-a", None) not in sink.calls
        assert last < missed[0]
    finally:
        await pool.close()
