"""sglang-cache-aware-scorer: SGLang's cache_aware rule on constructed states."""

from __future__ import annotations

from scorers.base import Endpoint, EndpointLoad
from tests.scorers.plugin_helpers import make, request, result_for


def ep(address: str, in_flight: int = 0) -> Endpoint:
    return Endpoint(address=address, load=EndpointLoad(in_flight_requests=in_flight))


def prompt(request_id: str, tokens: list[int]) -> object:
    return request(request_id, prompt=tokens)


def test_match_above_threshold_follows_the_tree_else_smallest_tree() -> None:
    scorer = make("sglang-cache-aware-scorer")
    a, b, c = ep("a"), ep("b"), ep("c")
    shared = list(range(1000))
    scorer.pre_request(prompt("r0", shared + [7] * 64), result_for(a))
    scorer.pre_request(prompt("r1", list(range(5000, 5100))), result_for(b))
    # 1000 of 1200 tokens held by a (> 30 %): a.
    assert scorer.choose(prompt("r2", shared + [9] * 200), [a, b, c]) == ["a"]
    # 10 % match: the smallest tree (c has none).
    assert scorer.choose(prompt("r3", shared[:96] + [3] * 900), [a, b, c]) == ["c"]


def test_imbalanced_load_routes_to_the_least_loaded() -> None:
    scorer = make("sglang-cache-aware-scorer")
    busy, idle = ep("busy", in_flight=100), ep("idle", in_flight=10)
    scorer.pre_request(prompt("r0", list(range(800))), result_for(busy))
    # spread 90 > 64 and 100 > 1.5 × 10: load wins over the cache.
    assert scorer.score(prompt("r1", list(range(800))), [busy, idle]) == {"busy": 0.0, "idle": 1.0}
    # spread 60: balanced, the cache wins.
    busy.load.in_flight_requests = 70
    assert scorer.score(prompt("r2", list(range(800))), [busy, idle]) == {"busy": 1.0, "idle": 0.0}
