"""prefill-cost-scorer: cost in tokens of prefill work, argmin through the ratio score."""

from __future__ import annotations

import pytest

from scorers.base import Endpoint, EndpointLoad, EndpointMetrics, PluginConfigError
from scorers.request_data import PREFIX_COMPUTED_TOKENS, PREFIX_MATCHED_TOKENS
from tests.scorers.plugin_helpers import make, request

PARAMS = {"uncachedTokenWeight": 4, "inFlightRequestTokens": 200, "kvPressureTokens": 0}


def ep(address: str, *, queued: int = 0, in_flight: int = 0, kv: float = 0.0) -> Endpoint:
    return Endpoint(
        address=address,
        metrics=EndpointMetrics(kv_cache_usage=kv),
        load=EndpointLoad(in_flight_requests=in_flight, in_flight_prefill_tokens=queued),
    )


def prompt(tokens: int, matched: dict[str, int] | None = None) -> object:
    req = request(prompt=list(range(tokens)))
    if matched is not None:
        req.data[PREFIX_MATCHED_TOKENS] = matched
    return req


def best(scores: dict[str, float]) -> str:
    return max(scores, key=lambda a: scores[a])


def test_cost_is_weighted_uncached_plus_queued_plus_in_flight() -> None:
    scorer = make("prefill-cost-scorer", PARAMS)
    eps = [ep("a", queued=1000, in_flight=2), ep("b"), ep("c", queued=50)]
    req = prompt(10_000, {"a": 8000, "c": 2000})
    assert scorer.costs(req, eps) == {
        "a": 4 * 2000 + 1000 + 2 * 200,
        "b": 4 * 10_000,
        "c": 4 * 8000 + 50,
    }
    scores = scorer.score(req, eps)
    assert scores["a"] == 1.0
    assert scores["b"] == pytest.approx((9400 + 16) / (40_000 + 16))


def test_tokens_no_pod_has_computed_cost_the_uncomputed_weight() -> None:
    scorer = make("prefill-cost-scorer", {**PARAMS, "uncomputedTokenWeight": 1.5})
    eps = [ep("real"), ep("predicted"), ep("cold")]
    # 10,000 tokens: "real" holds 3,000 per the KV events (so some pod computed 3,000);
    # "predicted" is predicted to hold 6,000 (a routed prefill still running).
    req = prompt(10_000, {"real": 3000, "predicted": 6000})
    req.data[PREFIX_COMPUTED_TOKENS] = 3000
    assert scorer.costs(req, eps) == {
        "real": 1.5 * 7000,
        "predicted": 1.5 * 4000,
        "cold": 4 * 3000 + 1.5 * 7000,
    }
    # Without the fleet-wide fact (no precise scorer), every uncached token is a copy.
    del req.data[PREFIX_COMPUTED_TOKENS]
    assert scorer.costs(req, eps)["cold"] == 4 * 10_000


def test_cache_holder_wins_until_its_queue_outweighs_a_full_prefill() -> None:
    scorer = make("prefill-cost-scorer", PARAMS)
    req = prompt(6000, {"holder": 6000})
    # Holder: 4·0 + queued; idle pod: 4·6000 = 24,000.  A hot prefix spills past that queue.
    assert best(scorer.score(req, [ep("holder", queued=20_000), ep("idle")])) == "holder"
    assert best(scorer.score(req, [ep("holder", queued=30_000), ep("idle")])) == "idle"


def test_without_prefix_information_it_is_least_work_routing() -> None:
    scorer = make("prefill-cost-scorer", PARAMS)
    eps = [ep("a", queued=5000), ep("b", queued=100, in_flight=1), ep("c", queued=400)]
    assert best(scorer.score(prompt(3000), eps)) == "b"
    # Text prompt, no tokenizer: length estimated at 4 characters per token, same ranking.
    assert best(scorer.score(request(prompt="word " * 400), eps)) == "b"


def test_kv_pressure_and_stale_metrics_count_against_a_pod() -> None:
    scorer = make(
        "prefill-cost-scorer",
        {
            "uncachedTokenWeight": 1,
            "inFlightRequestTokens": 0,
            "kvPressureThreshold": 0.9,
            "kvPressureTokens": 10_000,
        },
    )
    full = ep("full", kv=0.95)
    stale = ep("stale")
    stale.metrics_stale = True
    costs = scorer.costs(prompt(1000), [full, stale, ep("ok", kv=0.85)])
    assert costs == {"full": pytest.approx(1000 + 5000), "stale": 11_000, "ok": 1000}


def test_default_kv_term_is_linear_in_usage_and_rarely_beats_a_miss() -> None:
    scorer = make("prefill-cost-scorer", {"inFlightRequestTokens": 0})
    costs = scorer.costs(prompt(1000), [ep("half", kv=0.5), ep("empty")])
    assert costs == {"half": pytest.approx(4 * 1000 + 0.5 * 16_384), "empty": 4000}
    # A pod 20 points fuller that holds a 1,200-token question still wins (3,277 < 4,800).
    req = prompt(7200, {"holder": 7200, "other": 6000})
    assert best(scorer.score(req, [ep("holder", kv=0.8), ep("other", kv=0.6)])) == "holder"


def test_parameters_are_validated() -> None:
    with pytest.raises(PluginConfigError, match="uncachedTokenWeight"):
        make("prefill-cost-scorer", {"uncachedTokenWeight": -1})


def test_scraped_waiting_requests_count_when_configured() -> None:
    scorer = make("prefill-cost-scorer", {**PARAMS, "waitingRequestTokens": 1000})
    waiting = ep("w")
    waiting.metrics.waiting_requests = 3
    assert scorer.costs(prompt(100), [waiting, ep("x")]) == {"w": 400 + 3000, "x": 400}
