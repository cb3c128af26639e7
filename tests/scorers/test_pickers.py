"""Pickers: tie-breaking, weighted sampling and fallbacks, with seeded randomness."""

from __future__ import annotations

from collections import Counter

import pytest

from scorers.base import PluginConfigError, ScoredEndpoint
from tests.scorers.plugin_helpers import endpoint, make, request


def scored(*pairs: tuple[str, float]) -> list[ScoredEndpoint]:
    return [ScoredEndpoint(endpoint(address), score) for address, score in pairs]


def test_max_score_picker_picks_the_best() -> None:
    picker = make("max-score-picker")
    picked = picker.pick(request(), scored(("a:1", 0.2), ("b:1", 2.5), ("c:1", 1.0)))
    assert [e.address for e in picked] == ["b:1"]


def test_max_score_picker_returns_fallbacks_in_score_order() -> None:
    picker = make("max-score-picker", {"maxNumOfEndpoints": 3})
    picked = picker.pick(request(), scored(("a:1", 0.2), ("b:1", 2.5), ("c:1", 1.0), ("d:1", 0)))
    assert [e.address for e in picked] == ["b:1", "c:1", "a:1"]


def test_max_score_picker_breaks_ties_at_random_and_reproducibly() -> None:
    items = scored(("a:1", 1.0), ("b:1", 1.0), ("c:1", 1.0), ("d:1", 0.5))
    picker = make("max-score-picker", seed=42)
    wins = Counter(picker.pick(request(), items)[0].address for _ in range(3000))
    assert set(wins) == {"a:1", "b:1", "c:1"}
    assert all(800 < n < 1200 for n in wins.values())
    again = make("max-score-picker", seed=42)
    replay = Counter(again.pick(request(), items)[0].address for _ in range(3000))
    assert replay == wins


def test_max_score_picker_tied_fallbacks_come_before_lower_scores() -> None:
    picker = make("max-score-picker", {"maxNumOfEndpoints": 2}, seed=3)
    items = scored(("a:1", 1.0), ("b:1", 1.0), ("c:1", 0.9))
    firsts = set()
    for _ in range(50):
        picked = [e.address for e in picker.pick(request(), items)]
        assert sorted(picked) == ["a:1", "b:1"]
        firsts.add(picked[0])
    assert firsts == {"a:1", "b:1"}


def test_random_picker_is_uniform_and_distinct() -> None:
    picker = make("random-picker", {"maxNumOfEndpoints": 2}, seed=7)
    items = scored(("a:1", 9.0), ("b:1", 0.0), ("c:1", 0.0))
    counts: Counter[str] = Counter()
    for _ in range(3000):
        picked = [e.address for e in picker.pick(request(), items)]
        assert len(set(picked)) == 2
        counts[picked[0]] += 1
    assert all(850 < n < 1150 for n in counts.values())


def test_random_picker_with_fewer_candidates_than_asked() -> None:
    picker = make("random-picker", {"maxNumOfEndpoints": 5})
    assert len(picker.pick(request(), scored(("a:1", 1), ("b:1", 1)))) == 2


def test_weighted_random_picker_is_proportional_to_score() -> None:
    picker = make("weighted-random-picker", seed=11)
    items = scored(("a:1", 1.0), ("b:1", 2.0), ("c:1", 5.0), ("z:1", 0.0))
    draws = 16000
    counts = Counter(picker.pick(request(), items)[0].address for _ in range(draws))
    assert "z:1" not in counts  # weight 0 is never the primary while others are positive
    for address, weight in (("a:1", 1.0), ("b:1", 2.0), ("c:1", 5.0)):
        assert counts[address] / draws == pytest.approx(weight / 8.0, abs=0.015)


def test_weighted_random_picker_fallbacks_are_distinct_zero_weights_last() -> None:
    picker = make("weighted-random-picker", {"maxNumOfEndpoints": 4}, seed=5)
    items = scored(("a:1", 1.0), ("b:1", 3.0), ("y:1", 0.0), ("z:1", -1.0))
    for _ in range(100):
        picked = [e.address for e in picker.pick(request(), items)]
        assert sorted(picked[:2]) == ["a:1", "b:1"]
        assert sorted(picked[2:]) == ["y:1", "z:1"]


def test_weighted_random_picker_all_zero_is_uniform() -> None:
    picker = make("weighted-random-picker", seed=9)
    items = scored(("a:1", 0.0), ("b:1", 0.0), ("c:1", 0.0), ("d:1", 0.0))
    counts = Counter(picker.pick(request(), items)[0].address for _ in range(4000))
    assert all(850 < n < 1150 for n in counts.values())


@pytest.mark.parametrize("picker", ["max-score-picker", "random-picker", "weighted-random-picker"])
@pytest.mark.parametrize("value", [0, 17])
def test_max_num_of_endpoints_range(picker: str, value: int) -> None:
    with pytest.raises(PluginConfigError, match=r"parameters\.maxNumOfEndpoints"):
        make(picker, {"maxNumOfEndpoints": value})


def test_round_robin_picker_cycles_through_candidates_ignoring_scores() -> None:
    endpoints = [endpoint(f"10.0.0.{i}:80") for i in (3, 1, 2)]
    scored = [
        ScoredEndpoint(ep, score) for ep, score in zip(endpoints, (0.0, 5.0, 1.0), strict=True)
    ]
    picker = make("round-robin-picker", {"maxNumOfEndpoints": 2})
    picks = [[ep.address for ep in picker.pick(request(), scored)] for _ in range(4)]
    assert picks == [
        ["10.0.0.1:80", "10.0.0.2:80"],
        ["10.0.0.2:80", "10.0.0.3:80"],
        ["10.0.0.3:80", "10.0.0.1:80"],
        ["10.0.0.1:80", "10.0.0.2:80"],
    ]
