"""`scorers.new_content`: the share of new content later requests share; and the prefill-cost
scorer placing new content that will be shared on the emptier cache, and one-off content by
load alone."""

from __future__ import annotations

import pytest

from scorers.base import Endpoint, EndpointLoad, EndpointMetrics
from scorers.new_content import NewContentReuse
from scorers.request_data import KV_CACHED_TOKENS, PREFIX_BLOCK_KEYS, PREFIX_COMPUTED_TOKENS
from tests.scorers.plugin_helpers import make, request, result_for


def test_one_off_content_is_never_reused() -> None:
    reuse = NewContentReuse()
    for i in range(50):
        reuse.observe([1000 * i + block for block in range(10)], 16, continues=False)
    assert reuse.rate == 0.0


def test_a_shared_prefix_is_reused_and_its_questions_are_not() -> None:
    reuse = NewContentReuse()
    system = list(range(30))  # 30 blocks shared by every question
    reuse.observe([*system, 100], 16, continues=False)  # the group's first request
    for question in range(101, 110):  # nine more questions, each asked once
        reuse.observe([*system, question], 16, continues=False)
    # New: 31 blocks, then one per question (40 in all, before decay); reused: the 30 shared.
    assert reuse.rate == pytest.approx(30 / 40, rel=0.03)
    # Named a third time, a block counts once.
    reuse.observe([*system, 101], 16, continues=False)
    assert reuse.rate == pytest.approx(31 / 40, rel=0.03)


def test_a_conversation_continued_is_the_sessions_terms_business() -> None:
    reuse = NewContentReuse()
    for conversation in range(20):
        turn = [10_000 * conversation + block for block in range(4)]
        reuse.observe(turn, 16, continues=False)  # its first turn: new content
        for more in range(1, 5):  # later turns resend it and add their own
            turn = [*turn, 10_000 * conversation + 100 * more]
            reuse.observe(turn, 16, continues=True)
    assert reuse.rate == 0.0


def test_memory_is_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("scorers.new_content._KEYS", 100)
    reuse = NewContentReuse()
    reuse.observe(list(range(250)), 16, continues=False)
    reuse.observe([0, 1, 2], 16, continues=False)  # forgotten: new again, not a reuse
    assert reuse.rate == 0.0
    reuse.observe([249], 16, continues=False)  # remembered
    assert reuse.rate > 0.0


def _pod(address: str, in_flight: int) -> Endpoint:
    return Endpoint(
        address=address,
        metrics=EndpointMetrics(block_size=16, num_gpu_blocks=1001),  # 16,000 tokens
        load=EndpointLoad(in_flight_requests=in_flight),
    )


def _route(scorer: object, keys: list[int], pod: Endpoint) -> None:
    req = request(f"r{keys[0]}-{keys[-1]}", prompt=list(range(16 * len(keys))), stream=True)
    req.data[PREFIX_BLOCK_KEYS] = keys
    scorer.pre_request(req, result_for(pod))  # type: ignore[attr-defined]
    scorer.response_complete(req, pod.address, None)  # type: ignore[attr-defined]


def _new_prompt(first_key: int) -> object:
    req = request("new", prompt=list(range(1600)), stream=True)
    req.data[PREFIX_BLOCK_KEYS] = list(range(first_key, first_key + 100))
    req.data[PREFIX_COMPUTED_TOKENS] = 0  # no pod computed any of it
    # "fuller" holds 12,000 tokens, "emptier" 4,000: both have room for it.
    req.data[KV_CACHED_TOKENS] = {"fuller": 12_000, "emptier": 4000}
    return req


def test_new_content_later_shared_goes_to_the_emptier_cache() -> None:
    """Shared system prompts: a new one brings its questions where it lands, so it goes to the
    pod whose cache is emptier even when that pod is busier at the moment."""
    scorer = make("prefill-cost-scorer")
    fuller, emptier = _pod("fuller", in_flight=0), _pod("emptier", in_flight=2)
    for group in range(4):
        system = list(range(10_000 * group, 10_000 * group + 90))
        for question in range(6):
            _route(scorer, [*system, 10_000 * group + 500 + question], fuller)
    assert scorer.new_content.rate > 0.5
    terms = scorer.cost_terms(_new_prompt(90_000), [fuller, emptier])
    # 2 (the eviction premium) × the rate × 1,600 new tokens × (0.75 − 0.25) of the cache.
    assert terms["fuller"].placement == pytest.approx(
        2 * scorer.new_content.rate * 1600 * (12_000 - 4000) / 16_000
    )
    assert terms["emptier"].placement == 0
    scores = scorer.score(_new_prompt(90_000), [fuller, emptier])
    assert scores["emptier"] > scores["fuller"]


def test_one_off_content_goes_by_load_alone() -> None:
    """Unique prompts: nothing follows them, so the cache's fill does not place them and the
    idle pod takes the next one."""
    scorer = make("prefill-cost-scorer")
    fuller, emptier = _pod("fuller", in_flight=0), _pod("emptier", in_flight=2)
    for i in range(24):
        _route(scorer, list(range(1000 * i, 1000 * i + 100)), fuller)
    assert scorer.new_content.rate == 0.0
    terms = scorer.cost_terms(_new_prompt(90_000), [fuller, emptier])
    assert terms["fuller"].placement == 0 and terms["emptier"].placement == 0
    scores = scorer.score(_new_prompt(90_000), [fuller, emptier])
    assert scores["fuller"] > scores["emptier"]
