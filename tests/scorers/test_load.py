"""Load scorers on hand-built endpoint states; expected scores computed by hand."""

from __future__ import annotations

import pytest

from tests.scorers.plugin_helpers import endpoint, make, request


def test_queue_scorer_min_max_over_candidates() -> None:
    scorer = make("queue-scorer")
    eps = [endpoint("a:1", waiting=0), endpoint("b:1", waiting=5), endpoint("c:1", waiting=10)]
    assert scorer.score(request(), eps) == {"a:1": 1.0, "b:1": 0.5, "c:1": 0.0}


def test_queue_scorer_all_equal_scores_one() -> None:
    scorer = make("queue-scorer")
    eps = [endpoint("a:1", waiting=3), endpoint("b:1", waiting=3)]
    assert scorer.score(request(), eps) == {"a:1": 1.0, "b:1": 1.0}


def test_queue_scorer_stale_counts_as_most_loaded() -> None:
    scorer = make("queue-scorer")
    eps = [
        endpoint("a:1", waiting=2),
        endpoint("b:1", waiting=6),
        endpoint("s:1", waiting=0, stale=True),  # its reported 0 is not trusted
    ]
    assert scorer.score(request(), eps) == {"a:1": 1.0, "b:1": 0.0, "s:1": 0.0}
    # Fresh endpoints all equal: they score 1, the stale one still 0.
    eps = [endpoint("a:1", waiting=4), endpoint("s:1", stale=True)]
    assert scorer.score(request(), eps) == {"a:1": 1.0, "s:1": 0.0}


def test_running_requests_size_scorer() -> None:
    scorer = make("running-requests-size-scorer")
    eps = [endpoint("a:1", running=4), endpoint("b:1", running=8), endpoint("c:1", running=5)]
    assert scorer.score(request(), eps) == {"a:1": 1.0, "b:1": 0.0, "c:1": 0.75}


def test_kv_cache_utilization_scorer() -> None:
    scorer = make("kv-cache-utilization-scorer")
    eps = [
        endpoint("a:1", kv=0.25),
        endpoint("b:1", kv=1.0),
        endpoint("c:1", kv=1.5),  # clamped
        endpoint("s:1", kv=0.0, stale=True),
    ]
    assert scorer.score(request(), eps) == {"a:1": 0.75, "b:1": 0.0, "c:1": 0.0, "s:1": 0.0}


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
        endpoint("s:1", stale=True),
    ]
    assert scorer.score(request(), eps) == {
        "a:1": 0.5,
        "b:1": 0.375,  # 0.5 * (1 - 32/128)
        "c:1": 0.0,
        "d:1": 0.0,
        "s:1": 0.0,
    }


def test_load_aware_scorer_threshold_parameter() -> None:
    scorer = make("load-aware-scorer", {"threshold": 10})
    assert scorer.score(request(), [endpoint("a:1", waiting=5)]) == {"a:1": 0.25}


def test_active_request_scorer() -> None:
    scorer = make("active-request-scorer")
    eps = [endpoint("a:1", in_flight=0), endpoint("b:1", in_flight=4), endpoint("c:1", in_flight=1)]
    assert scorer.score(request(), eps) == {"a:1": 1.0, "b:1": 0.0, "c:1": 0.75}


def test_active_request_scorer_all_idle() -> None:
    scorer = make("active-request-scorer")
    assert scorer.score(request(), [endpoint("a:1"), endpoint("b:1")]) == {"a:1": 1.0, "b:1": 1.0}
