"""SessionTracker: continuations recognised from block keys, and the pods' shares of routing."""

from __future__ import annotations

import pytest

from scorers.sessions import SessionTracker


def _conversation(first: int, turns: int, blocks_per_turn: int = 3) -> list[list[int]]:
    """Block keys of a conversation's prompts: each turn resends the previous ones."""
    keys: list[int] = []
    prompts = []
    for turn in range(turns):
        keys = keys + [first * 1000 + turn * blocks_per_turn + b for b in range(blocks_per_turn)]
        prompts.append(list(keys))
    return prompts


def test_every_turn_after_the_first_continues_its_conversation() -> None:
    tracker = SessionTracker()
    turns = _conversation(1, 5)
    assert [tracker.observe(keys, "a", pods=2) for keys in turns] == [False, True, True, True, True]
    # A later turn is recognised before it is routed, on any pod.
    tracker2 = SessionTracker()
    tracker2.observe(turns[0], "a", pods=2)
    assert tracker2.continues(turns[1])
    assert not tracker2.continues(_conversation(2, 2)[1])


def test_one_off_prompts_and_exact_repeats_continue_nothing() -> None:
    tracker = SessionTracker()
    shared = [1, 2, 3, 4]
    for question in range(100):
        assert not tracker.observe([*shared, 10_000 + question], "a", pods=1)
        assert not tracker.observe([*shared, 10_000 + question], "a", pods=1)  # a repeat


def test_unknown_keys_continue_nothing_and_leave_the_tips() -> None:
    tracker = SessionTracker()
    first, second = _conversation(1, 2)
    tracker.observe(first, "a", pods=1)
    assert not tracker.observe(None, "a", pods=1)
    assert tracker.continues(second)


def test_a_tip_inside_a_shared_prefix_continues_once() -> None:
    """A prompt whose own text ends inside its first block after a shared system prompt leaves
    the system prompt's last block as its tip; the many prompts that share that block do not
    all continue a conversation."""
    tracker = SessionTracker()
    system = [1, 2, 3, 4]
    tracker.observe(system, "a", pods=10)  # the short prompt: tip = block 4
    continued = [tracker.observe([*system, 10_000 + q], "a", pods=10) for q in range(100)]
    assert sum(continued) == 1


def test_a_prompt_ending_in_a_block_some_pod_holds_leaves_no_tip() -> None:
    tracker = SessionTracker()
    system = [1, 2, 3, 4]
    for question in range(100):
        tracker.observe(system, "a", pods=10, new_tip=False)  # held already
        assert not tracker.observe([*system, 10_000 + question], "a", pods=10)


def test_shares_follow_where_requests_went() -> None:
    tracker = SessionTracker()
    for i in range(300):
        tracker.observe([i], "a" if i % 3 else "b", pods=2)
    assert tracker.share("a") == pytest.approx(2 / 3, abs=0.1)
    assert tracker.share("b") == pytest.approx(1 / 3, abs=0.1)
    assert tracker.share("a") + tracker.share("b") == pytest.approx(1.0, abs=0.01)
    tracker.forget("a")
    assert tracker.share("a") == 0.0


def test_a_few_requests_at_start_are_no_imbalance_yet() -> None:
    tracker = SessionTracker()
    for keys in _conversation(1, 2):
        tracker.observe(keys, "a", pods=2)
    assert tracker.share("a") < 0.1
