"""llm-d-router's ``prefix-cache-affinity-filter`` (`scorers.prefix_affinity_filter`): sticky
endpoints, exploration, the TTFT load gate from in-flight tokens or from predictions."""

from __future__ import annotations

from typing import Any

import pytest

from scorers.base import Endpoint, LLMRequest, PluginConfigError
from scorers.request_data import (
    LatencyPredictionInfo,
    PrefixMatchInfo,
    latency_prediction_info_key,
    prefix_match_info_key,
)
from tests.scorers.plugin_helpers import endpoint, make, request


def pods(*queued: int) -> list[Endpoint]:
    """Endpoints a:1, b:1, ... with these prefill tokens in flight."""
    out = []
    for i, tokens in enumerate(queued):
        ep = endpoint(f"{chr(ord('a') + i)}:1")
        ep.load.in_flight_prefill_tokens = tokens
        out.append(ep)
    return out


def matched(shares: dict[str, float], producer: str = "approx-prefix-cache-producer") -> LLMRequest:
    """A request of 100 blocks, each endpoint holding its share of them."""
    req = request()
    req.data[prefix_match_info_key(producer)] = PrefixMatchInfo(
        {a: int(100 * s) for a, s in shares.items()},
        {a: 100 * s for a, s in shares.items()},
        100,
        16,
    )
    return req


def names(endpoints: list[Endpoint]) -> list[str]:
    return [e.address for e in endpoints]


def test_keeps_the_endpoints_holding_the_prefix_or_all_when_none_does() -> None:
    flt = make("prefix-cache-affinity-filter")
    candidates = pods(0, 0, 0)
    req = matched({"a:1": 0.9, "b:1": 0.8, "c:1": 0.5})
    assert names(flt.filter(req, candidates)) == ["a:1", "b:1"]
    strict = make("prefix-cache-affinity-filter", {"affinityThreshold": 0.99})
    assert strict.filter(req, candidates) == candidates  # nobody sticky: no-op
    assert flt.filter(request(), candidates) == candidates  # no prefix match at all
    off = make("prefix-cache-affinity-filter", {"affinityThreshold": 0})
    assert off.filter(req, candidates) == candidates
    explore = make("prefix-cache-affinity-filter", {"explorationProbability": 1.0})
    assert explore.filter(req, candidates) == candidates


def test_reads_the_producer_it_names() -> None:
    flt = make("prefix-cache-affinity-filter", {"prefixMatchInfoProducerName": "precise"})
    req = matched({"b:1": 1.0}, producer="precise")
    assert names(flt.filter(req, pods(0, 0))) == ["b:1"]


def test_the_load_gate_breaks_stickiness_past_the_ttft_penalty() -> None:
    flt = make(
        "prefix-cache-affinity-filter",
        {"maxTTFTPenaltyMs": 1000, "peakPrefillThroughput": 10000},
    )
    req = matched({"a:1": 1.0})
    # a has 5,000 tokens queued (500 ms at 10k tokens/s) more than b: within the penalty.
    assert names(flt.filter(req, pods(5000, 0))) == ["a:1"]
    # 20,000 more (2 s): past it, every endpoint is kept.
    assert names(flt.filter(req, pods(20000, 0))) == ["a:1", "b:1"]
    always = make("prefix-cache-affinity-filter", {"maxTTFTPenaltyMs": 0})
    assert names(always.filter(req, pods(10**9, 0))) == ["a:1"]


def _prediction(ttft_ms: float) -> LatencyPredictionInfo:
    return LatencyPredictionInfo(True, True, 0.0, 0.0, ttft_ms, 0.0, 0)


def test_the_load_gate_can_read_the_predicted_ttft() -> None:
    flt = make(
        "prefix-cache-affinity-filter",
        {"ttftSource": "latencyPredictor", "maxTTFTPenaltyMs": 300},
    )
    flt.bind({})  # the default producer is not declared: it reads request.data
    key = latency_prediction_info_key("predicted-latency-producer")
    req = matched({"a:1": 1.0})
    req.data[key] = {"a:1": _prediction(900), "b:1": _prediction(100)}
    assert names(flt.filter(req, pods(0, 0))) == ["a:1", "b:1"]  # 800 ms worse
    req.data[key] = {"a:1": _prediction(350), "b:1": _prediction(100)}
    assert names(flt.filter(req, pods(0, 0))) == ["a:1"]
    # No prediction at all: nothing says the sticky endpoints are slower.
    assert names(flt.filter(matched({"a:1": 1.0}), pods(0, 0))) == ["a:1"]


@pytest.mark.parametrize(
    ("parameters", "message"),
    [
        ({"affinityThreshold": 1.5}, "affinityThreshold"),
        ({"explorationProbability": 2}, "explorationProbability"),
        ({"maxTTFTPenaltyMs": -1}, "maxTTFTPenaltyMs"),
        ({"ttftSource": "sidecar"}, "ttftSource"),
        ({"peakPrefillThroughput": 0}, "peakPrefillThroughput must be > 0"),
        ({"stickiness": 1}, "stickiness"),
    ],
)
def test_bad_parameters_are_errors(parameters: dict[str, Any], message: str) -> None:
    with pytest.raises(PluginConfigError, match=message):
        make("prefix-cache-affinity-filter", parameters)


def test_a_zero_throughput_is_fine_when_it_is_not_used() -> None:
    make("prefix-cache-affinity-filter", {"peakPrefillThroughput": 0, "maxTTFTPenaltyMs": 0})
    make(
        "prefix-cache-affinity-filter",
        {"peakPrefillThroughput": 0, "ttftSource": "latencyPredictor"},
    )


def test_producer_names_must_name_declared_plugins() -> None:
    flt = make("prefix-cache-affinity-filter", {"inFlightLoadProducerName": "load"})
    with pytest.raises(PluginConfigError, match="inflight-load-producer"):
        flt.bind({})
    flt.bind({"load": make("inflight-load-producer", name="load")})
    gate = make(
        "prefix-cache-affinity-filter",
        {"ttftSource": "latencyPredictor", "latencyPredictionInfoProducerName": "p"},
    )
    with pytest.raises(PluginConfigError, match="latencyPredictionInfoProducerName 'p'"):
        gate.bind({})
