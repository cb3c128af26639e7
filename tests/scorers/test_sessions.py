"""SessionTracker: continuations counted from block keys, and the pods' shares of routing."""

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


def test_sessions_of_five_turns_bring_four_followups() -> None:
    tracker = SessionTracker()
    for conversation in range(200):
        for keys in _conversation(conversation, 5):
            tracker.observe(keys, "a", pods=10, uncached=10)  # averaged over 200
    assert tracker.expected_followups == pytest.approx(4.0, rel=0.1)


def test_one_off_prompts_and_exact_repeats_bring_none() -> None:
    tracker = SessionTracker()
    shared = [1, 2, 3, 4]
    for question in range(100):
        tracker.observe([*shared, 10_000 + question], "a", pods=1, uncached=1)
        tracker.observe([*shared, 10_000 + question], "a", pods=1, uncached=1)  # a repeat
    assert tracker.expected_followups == 0.0


def test_unknown_keys_leave_the_fraction_alone() -> None:
    tracker = SessionTracker()
    for keys in _conversation(1, 3):
        tracker.observe(keys, "a", pods=1, uncached=0)
    before = tracker.expected_followups
    tracker.observe(None, "a", pods=1, uncached=0)
    assert tracker.expected_followups == before > 0


def test_shares_follow_where_requests_went() -> None:
    tracker = SessionTracker()
    for i in range(300):
        tracker.observe([i], "a" if i % 3 else "b", pods=2, uncached=0)
    assert tracker.share("a") == pytest.approx(2 / 3, abs=0.1)
    assert tracker.share("b") == pytest.approx(1 / 3, abs=0.1)
    assert tracker.share("a") + tracker.share("b") == pytest.approx(1.0, abs=0.01)
    tracker.forget("a")
    assert tracker.share("a") == 0.0


def test_uncached_tokens_per_request_are_averaged() -> None:
    tracker = SessionTracker()
    for i in range(400):
        tracker.observe([i], "a", pods=10, uncached=100 if i % 2 else 300)
    assert tracker.uncached == pytest.approx(200.0, rel=0.1)


def test_a_few_requests_at_start_are_no_imbalance_yet() -> None:
    tracker = SessionTracker()
    for keys in _conversation(1, 2):
        tracker.observe(keys, "a", pods=2, uncached=8)
    assert tracker.share("a") < 0.1
    assert tracker.expected_followups < 0.1


def test_a_tip_inside_a_shared_prefix_counts_once() -> None:
    """A prompt whose own text ends inside its first block after a shared system prompt leaves
    the system prompt's last block as its tip; the many prompts that share that block do not
    continue a conversation."""
    tracker = SessionTracker()
    system = [1, 2, 3, 4]
    tracker.observe(system, "a", pods=10, uncached=1)  # the short prompt: tip = block 4
    for question in range(100):
        tracker.observe([*system, 10_000 + question], "a", pods=10, uncached=1)
    assert tracker.expected_followups < 0.05


def test_a_prompt_ending_in_a_block_some_pod_holds_leaves_no_tip() -> None:
    tracker = SessionTracker()
    system = [1, 2, 3, 4]
    for question in range(100):
        tracker.observe(system, "a", pods=10, uncached=1, new_tip=False)  # held already
        tracker.observe([*system, 10_000 + question], "a", pods=10, uncached=1)
    assert tracker.expected_followups == 0.0


def test_a_pods_footprint_is_what_its_live_conversations_wrote_there() -> None:
    """A conversation's turns add their uncached tokens on the pod that holds it; a turn that
    moves it starts over on the new pod; a conversation not continued for three times the
    usual distance between turns has ended and no longer counts."""
    tracker = SessionTracker()
    # Two conversations take turns on "a" and "b": each turn writes 100 tokens.
    first = _conversation(1, 4)
    second = _conversation(2, 4)
    for turn in range(3):
        tracker.observe(first[turn], "a", pods=2, uncached=100)
        tracker.observe(second[turn], "b", pods=2, uncached=100)
    assert tracker.footprint("a") == 300
    assert tracker.footprint("b") == 300
    # The second moves to "a": the whole conversation is written there, "b" keeps nothing.
    tracker.observe(second[3], "a", pods=2, uncached=450)
    assert tracker.footprint("a") == 300 + 450
    assert tracker.footprint("b") == 0
    assert tracker.footprint_shares({"a": 1000, "b": 1000}) == {"a": 1.0, "b": 0.0}
    # Relative to capacity: the same tokens claim more of a smaller cache.
    tracker.observe(_conversation(3, 1)[0], "b", pods=2, uncached=375)
    shares = tracker.footprint_shares({"a": 4000, "b": 1000})
    assert shares["b"] == pytest.approx(2 * shares["a"])
    # Turns came every 2 requests: after more than 6 requests without a turn they have ended.
    for question in range(8):
        tracker.observe([50_000 + question], "b", pods=2, uncached=1)
    assert tracker.footprint("a") == 0
    # A turn after a long pause still continues its conversation, which is whole again on
    # the pod that kept it.
    assert tracker.continues(first[3])
    tracker.observe(first[3], "a", pods=2, uncached=100)
    assert tracker.footprint("a") == 400
    tracker.forget("b")
    assert tracker.footprint("b") == 0
