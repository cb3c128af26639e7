"""dynamo-cost-scorer: Dynamo's w·prefill blocks + active decode blocks, argmin."""

from __future__ import annotations

from scorers.base import Endpoint, EndpointLoad
from scorers.request_data import PREFIX_BLOCK_KEYS, PREFIX_MATCHED_TOKENS
from tests.scorers.plugin_helpers import make, request, result_for


def ep(address: str, queued: int = 0) -> Endpoint:
    return Endpoint(address=address, load=EndpointLoad(in_flight_prefill_tokens=queued))


def req(request_id: str, keys: list[int], matched: dict[str, int] | None = None) -> object:
    r = request(request_id, prompt=list(range(16 * len(keys))))
    r.data[PREFIX_BLOCK_KEYS] = keys
    r.data[PREFIX_MATCHED_TOKENS] = matched or {}
    return r


def test_cost_is_prefill_blocks_plus_active_blocks() -> None:
    scorer = make("dynamo-cost-scorer")
    a, b = ep("a", queued=160), ep("b")
    first = req("r1", [1, 2, 3, 4])
    scorer.pre_request(first, result_for(a))  # a now has 4 active blocks
    second = req("r2", [1, 2, 5, 6, 7, 8], {"a": 32})
    # a: prefill (96 - 32 + 160) / 16 = 14, decode 4 active + 4 new (blocks 1, 2 shared) = 8
    # b: prefill 96 / 16 = 6, decode 0 + 6 = 6
    assert scorer.costs(second, [a, b]) == {"a": 22.0, "b": 12.0}
    assert scorer.score(second, [a, b]) == {"a": 0.0, "b": 1.0}


def test_active_blocks_are_released_when_the_response_completes() -> None:
    scorer = make("dynamo-cost-scorer")
    a = ep("a")
    r1, r2 = req("r1", [1, 2, 3]), req("r2", [1, 2, 9])
    scorer.pre_request(r1, result_for(a))
    scorer.pre_request(r2, result_for(a))
    assert scorer.active_blocks("a") == 4  # 1, 2 shared; 3; 9
    scorer.response_complete(r1, "a", None)
    assert scorer.active_blocks("a") == 3
    scorer.response_complete(r2, "a", None)
    assert scorer.active_blocks("a") == 0


def test_overlap_weight_zero_is_pure_load_balancing() -> None:
    scorer = make("dynamo-cost-scorer", {"overlapScoreWeight": 0})
    a, b = ep("a"), ep("b")
    scorer.pre_request(req("r1", [7, 8]), result_for(a))
    costs = scorer.costs(req("r2", [1, 2, 3], {"a": 48}), [a, b])
    assert costs == {"a": 5.0, "b": 3.0}
