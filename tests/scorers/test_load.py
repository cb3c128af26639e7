"""Load scorers on hand-built endpoint states; expected scores computed by hand."""

from __future__ import annotations

from typing import Any

import pytest

from tests.scorers.plugin_helpers import endpoint, make, request


@pytest.mark.parametrize(
    ("scorer_type", "load", "loads", "scores"),
    [
        ("queue-scorer", "waiting", [0, 5, 10], [1.0, 0.5, 0.0]),
        ("queue-scorer", "waiting", [3, 3], [1.0, 1.0]),
        ("running-requests-size-scorer", "running", [4, 8, 5], [1.0, 0.0, 0.75]),
        ("active-request-scorer", "in_flight", [0, 4, 1], [1.0, 0.0, 0.75]),
        ("active-request-scorer", "in_flight", [0, 0], [1.0, 1.0]),
    ],
    ids=[
        "queue-scorer-min-max-over-candidates",
        "queue-scorer-all-equal-scores-one",
        "running-requests-size-scorer",
        "active-request-scorer",
        "active-request-scorer-all-idle",
    ],
)
def test_least_loaded_scores_one_most_loaded_zero(
    scorer_type: str, load: str, loads: list[Any], scores: list[float]
) -> None:
    """Min-max over the candidates (a:1, b:1, … carrying ``loads``); all equal all score 1."""
    eps = [endpoint(f"{'abc'[i]}:1", **{load: value}) for i, value in enumerate(loads)]
    expected = {e.address: score for e, score in zip(eps, scores, strict=True)}
    assert make(scorer_type).score(request(), eps) == expected


def test_queue_scorer_leaves_a_never_scraped_endpoint_out_and_reads_old_metrics() -> None:
    scorer = make("queue-scorer")
    eps = [
        endpoint("a:1", waiting=2),
        endpoint("b:1", waiting=6),
        endpoint("n:1", scraped=False),  # nothing known: 0, outside the min and max
    ]
    assert scorer.score(request(), eps) == {"a:1": 1.0, "b:1": 0.0, "n:1": 0.0}
    # Old metrics still describe the pod (a busy pod answers its /metrics late): scored on them.
    eps = [endpoint("a:1", waiting=4), endpoint("s:1", waiting=0, stale=True)]
    assert scorer.score(request(), eps) == {"a:1": 0.0, "s:1": 1.0}
    eps = [endpoint("a:1", waiting=4), endpoint("n:1", scraped=False)]
    assert scorer.score(request(), eps) == {"a:1": 1.0, "n:1": 0.0}


def test_kv_cache_utilization_scorer() -> None:
    scorer = make("kv-cache-utilization-scorer")
    eps = [
        endpoint("a:1", kv=0.25),
        endpoint("b:1", kv=1.0),
        endpoint("c:1", kv=1.5),  # clamped
        endpoint("s:1", kv=0.5, stale=True),
        endpoint("n:1", scraped=False),
    ]
    assert scorer.score(request(), eps) == {
        "a:1": 0.75,
        "b:1": 0.0,
        "c:1": 0.0,
        "s:1": 0.5,
        "n:1": 0.0,
    }


def test_kv_cache_scorer_is_the_old_name() -> None:
    assert make("kv-cache-scorer").score(request(), [endpoint("a:1", kv=0.4)]) == {
        "a:1": pytest.approx(0.6)
    }


def test_load_aware_scorer_default_threshold() -> None:
    scorer = make("load-aware-scorer")
    eps = [
        endpoint("a:1", waiting=0),
        endpoint("b:1", waiting=32),
        endpoint("c:1", waiting=128),
        endpoint("d:1", waiting=500),
        endpoint("s:1", waiting=32, stale=True),
        endpoint("n:1", scraped=False),
    ]
    assert scorer.score(request(), eps) == {
        "a:1": 0.5,
        "b:1": 0.375,  # 0.5 * (1 - 32/128)
        "c:1": 0.0,
        "d:1": 0.0,
        "s:1": 0.375,
        "n:1": 0.0,
    }


def test_load_aware_scorer_threshold_parameter() -> None:
    scorer = make("load-aware-scorer", {"threshold": 10})
    assert scorer.score(request(), [endpoint("a:1", waiting=5)]) == {"a:1": 0.25}


def test_token_load_scores_the_prefill_in_flight_plus_what_the_request_adds() -> None:
    from scorers.request_data import PREFIX_MATCHED_TOKENS

    scorer = make("token-load-scorer", {"queueThresholdTokens": 10_000})
    idle, busy, holder = endpoint("a:1"), endpoint("b:1"), endpoint("c:1")
    busy.load.in_flight_prefill_tokens = 6_000
    holder.load.in_flight_prefill_tokens = 1_000
    req = request(prompt_token_ids=list(range(2_000)))
    req.data[PREFIX_MATCHED_TOKENS] = {"c:1": 1_500}  # c holds 1,500 of its 2,000 tokens
    assert scorer.score(req, [idle, busy, holder]) == pytest.approx(
        {"a:1": 1 - 2_000 / 10_000, "b:1": 1 - 8_000 / 10_000, "c:1": 1 - 1_500 / 10_000}
    )
    busy.load.in_flight_prefill_tokens = 50_000  # past the threshold: 0, never negative
    assert scorer.score(req, [busy])["b:1"] == 0.0


def test_token_load_threshold_defaults_as_upstream_and_checks_its_producer() -> None:
    from scorers.base import PluginConfigError

    for params in ({}, {"queueThresholdTokens": 0}, {"queueThresholdTokens": -5}):
        assert make("token-load-scorer", params).threshold == 4_194_304
    scorer = make("token-load-scorer", {"inFlightLoadProducerName": "load"})
    with pytest.raises(PluginConfigError, match="names no declared inflight-load-producer"):
        scorer.bind({})
    scorer.bind({"load": make("inflight-load-producer", name="load")})
    with pytest.raises(Exception, match="unknownKey"):
        make("token-load-scorer", {"unknownKey": 1})
