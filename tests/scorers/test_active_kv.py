"""ActiveBlocks: the KV a pod's requests in flight hold, by distinct block."""

from __future__ import annotations

from scorers.active_kv import ActiveBlocks


def test_requests_sharing_a_prefix_hold_its_blocks_once() -> None:
    active = ActiveBlocks()
    system = [1, 2, 3, 4]
    active.start("a", "pod", [*system, 10, 11], extra_tokens=20)
    active.start("b", "pod", [*system, 20], extra_tokens=5)
    assert active.held_tokens("pod", block_size=16) == 16 * 7 + 25
    assert active.missing_blocks("pod", [*system, 10, 99]) == 1
    assert active.missing_blocks("other", [*system]) == 4
    active.finish("a")
    assert active.held_tokens("pod", block_size=16) == 16 * 5 + 5
    assert active.missing_blocks("pod", [*system, 10]) == 1
    active.finish("b")
    active.finish("b")  # twice: nothing more to release
    assert active.held_tokens("pod", block_size=16) == 0
    assert active.in_flight() == 0


def test_a_retried_request_counts_once_where_it_went_last() -> None:
    active = ActiveBlocks()
    active.start("r", "first", [1, 2], extra_tokens=0)
    active.start("r", "second", [1, 2], extra_tokens=0)
    assert active.held_tokens("first", block_size=16) == 0
    assert active.held_tokens("second", block_size=16) == 32
    active.finish("r")
    assert active.held_tokens("second", block_size=16) == 0


def test_a_removed_pod_leaves_nothing_behind() -> None:
    active = ActiveBlocks()
    active.start("a", "gone", [1, 2], extra_tokens=3)
    active.start("b", "kept", [1], extra_tokens=0)
    active.forget("gone")
    assert active.in_flight() == 1
    assert active.held_tokens("gone", block_size=16) == 0
    active.finish("a")  # its response ends after the pod left
    assert active.held_tokens("kept", block_size=16) == 16
