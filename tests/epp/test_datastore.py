"""The datastore: membership and listeners, in-flight accounting, staleness, pool gauges."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from epp.datastore import Datastore, EndpointSpec, InFlightRequest
from scorers.base import Endpoint, EndpointMetrics, EndpointSource
from tests.support.clock import ManualClock


class Recorder:
    name = "recorder"

    def __init__(self) -> None:
        self.events: list[tuple[str, str]] = []

    def endpoint_added(self, endpoint: Endpoint) -> None:
        self.events.append(("added", endpoint.address))

    def endpoint_removed(self, endpoint: Endpoint) -> None:
        self.events.append(("removed", endpoint.address))


A = "10.0.0.1:8000"
B = "10.0.0.2:8000"


def test_is_an_endpoint_source() -> None:
    ds: EndpointSource = Datastore()
    assert ds.endpoints() == []
    assert ds.get(A) is None


def test_spec_defaults() -> None:
    spec = EndpointSpec(address="[fd00::1]:8000")
    assert spec.metrics_url == "http://[fd00::1]:8000/metrics"
    assert spec.name == "[fd00::1]:8000"
    assert spec.kv_events_url is None and spec.replay_url is None


def test_listeners_hear_adds_removes_and_url_changes() -> None:
    ds = Datastore()
    rec = Recorder()
    ds.add_listener(rec)
    ds.upsert(EndpointSpec(address=A, name="a", labels={"app": "x"}))
    ds.upsert(EndpointSpec(address=A, name="a", labels={"app": "x"}))  # no change: silent
    ds.upsert(EndpointSpec(address=A, name="a2", labels={"app": "y"}))  # name/labels: silent
    ep = ds.get(A)
    assert ep is not None and ep.name == "a2" and ep.labels == {"app": "y"}
    assert rec.events == [("added", A)]
    ds.upsert(
        EndpointSpec(address=A, name="a2", labels={"app": "y"}, kv_events_url="tcp://10.0.0.1:5557")
    )
    assert rec.events[1:] == [("removed", A), ("added", A)]
    ep2 = ds.get(A)
    assert ep2 is ep  # same pod, same view: metrics and load carry over
    assert ep2 is not None and ep2.kv_events_url == "tcp://10.0.0.1:5557"
    assert ds.remove(A) is ep
    assert ds.remove(A) is None
    assert rec.events[3:] == [("removed", A)]


def test_apply_specs_is_a_diff() -> None:
    ds = Datastore()
    rec = Recorder()
    ds.add_listener(rec)
    ds.apply_specs([EndpointSpec(address=A), EndpointSpec(address=B)])
    ds.apply_specs([EndpointSpec(address=B), EndpointSpec(address="10.0.0.3:8000")])
    assert sorted(e.address for e in ds.endpoints()) == [B, "10.0.0.3:8000"]
    assert rec.events == [("added", A), ("added", B), ("removed", A), ("added", "10.0.0.3:8000")]
    ds.clear()
    assert ds.endpoints() == [] and len(ds) == 0


def test_late_listener_gets_current_endpoints_and_can_be_removed() -> None:
    ds = Datastore()
    ds.upsert(EndpointSpec(address=A))
    rec = Recorder()
    ds.add_listener(rec)
    ds.add_listener(rec)  # idempotent
    assert rec.events == [("added", A)]
    ds.remove_listener(rec)
    ds.remove(A)
    assert rec.events == [("added", A)]


def test_a_failing_listener_does_not_stop_the_others() -> None:
    class Broken:
        name = "broken"

        def endpoint_added(self, endpoint: Endpoint) -> None:
            raise RuntimeError("boom")

        def endpoint_removed(self, endpoint: Endpoint) -> None:
            raise RuntimeError("boom")

    ds = Datastore()
    rec = Recorder()
    ds.add_listener(Broken())
    ds.add_listener(rec)
    ds.upsert(EndpointSpec(address=A))
    ds.remove(A)
    assert rec.events == [("added", A), ("removed", A)]


async def test_synced_flag() -> None:
    ds = Datastore()
    assert not ds.synced
    ds.mark_synced()
    assert ds.synced
    await ds.wait_synced()
    ds.mark_synced(False)
    assert not ds.synced


# -- in-flight accounting -----------------------------------------------------------------------


def test_in_flight_lifecycle() -> None:
    ds = Datastore()
    ds.upsert(EndpointSpec(address=A))
    ep = ds.get(A)
    assert ep is not None
    r1 = ds.request_started(A, prefill_tokens=1000)
    r2 = ds.request_started(A, prefill_tokens=300)
    assert (ep.load.in_flight_requests, ep.load.in_flight_prefill_tokens) == (2, 1300)
    r1.first_token()
    r1.first_token()  # idempotent
    assert (ep.load.in_flight_requests, ep.load.in_flight_prefill_tokens) == (2, 300)
    r1.finish()
    r1.finish()
    assert (ep.load.in_flight_requests, ep.load.in_flight_prefill_tokens) == (1, 300)
    with r2:  # finishing without a first token (error, disconnect) releases the prefill too
        pass
    assert (ep.load.in_flight_requests, ep.load.in_flight_prefill_tokens) == (0, 0)
    assert r2.finished and not r2.prefill_pending
    assert "finished" in repr(r2)


def test_request_outliving_its_endpoint_does_not_touch_the_new_one() -> None:
    ds = Datastore()
    ds.upsert(EndpointSpec(address=A))
    old = ds.request_started(A, 500)
    ds.remove(A)
    ds.upsert(EndpointSpec(address=A))  # pod re-created at the same IP
    new_ep = ds.get(A)
    assert new_ep is not None
    assert (new_ep.load.in_flight_requests, new_ep.load.in_flight_prefill_tokens) == (0, 0)
    fresh = ds.request_started(A, 10)
    old.finish()
    assert (new_ep.load.in_flight_requests, new_ep.load.in_flight_prefill_tokens) == (1, 10)
    fresh.finish()


def test_unknown_address_gives_a_detached_handle() -> None:
    ds = Datastore()
    handle = ds.request_started("10.9.9.9:1", 50)
    handle.finish()
    assert ds.get("10.9.9.9:1") is None


def test_kv_tokens_stay_until_the_request_finishes_and_count_from_the_last_scrape() -> None:
    ds = Datastore()
    ds.upsert(EndpointSpec(address=A))
    ep = ds.get(A)
    assert ep is not None
    first = ds.request_started(A, 300)
    ds.update_metrics(A, EndpointMetrics(kv_cache_usage=0.1))
    assert ep.load.kv_tokens_since_scrape == 0  # the scrape already sees the first request
    second = ds.request_started(A, 200)
    first.first_token()
    # Its prefill is done, its blocks stay: 500 tokens in flight, 200 of them since the scrape.
    assert (ep.load.in_flight_prefill_tokens, ep.load.in_flight_kv_tokens) == (200, 500)
    assert ep.load.kv_tokens_since_scrape == 200
    first.finish()  # counted by the scrape and gone since: the pod holds 300 fewer
    assert (ep.load.in_flight_kv_tokens, ep.load.kv_tokens_since_scrape) == (200, -100)
    second.finish()
    assert (ep.load.in_flight_kv_tokens, ep.load.kv_tokens_since_scrape) == (0, -300)


def test_negative_prefill_is_treated_as_zero() -> None:
    ds = Datastore()
    ds.upsert(EndpointSpec(address=A))
    ds.request_started(A, -5).finish()
    ep = ds.get(A)
    assert ep is not None and ep.load.in_flight_prefill_tokens == 0


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.sampled_from(["start", "first", "finish"]), st.integers(0, 7), st.integers(0, 5000)
        ),
        max_size=60,
    )
)
def test_counts_never_negative_and_return_to_zero(ops: list[tuple[str, int, int]]) -> None:
    ds = Datastore()
    ds.upsert(EndpointSpec(address=A))
    ep = ds.get(A)
    assert ep is not None
    handles: list[InFlightRequest] = []
    for op, index, tokens in ops:
        if op == "start" or not handles:
            handles.append(ds.request_started(A, tokens))
        elif op == "first":
            handles[index % len(handles)].first_token()
        else:
            handles[index % len(handles)].finish()
        assert ep.load.in_flight_requests >= 0 and ep.load.in_flight_prefill_tokens >= 0
        open_ = [h for h in handles if not h.finished]
        assert ep.load.in_flight_requests == len(open_)
        assert ep.load.in_flight_prefill_tokens == sum(
            h.prefill_tokens for h in handles if h.prefill_pending
        )
    for h in handles:
        h.finish()
    assert (ep.load.in_flight_requests, ep.load.in_flight_prefill_tokens) == (0, 0)


# -- staleness ----------------------------------------------------------------------------------


def test_never_scraped_is_stale_then_fresh_then_stale_again() -> None:
    clock = ManualClock()
    ds = Datastore(staleness_threshold=0.25, clock=clock)  # binary-exact steps below
    ds.upsert(EndpointSpec(address=A))
    assert ds.endpoints()[0].metrics_stale
    assert ds.update_metrics(A, EndpointMetrics(waiting_requests=3))
    ep = ds.get(A)
    assert ep is not None and not ep.metrics_stale and ep.metrics.updated_at == clock.now
    clock.now += 0.25
    assert not ds.endpoints()[0].metrics_stale  # exactly at the threshold: still fresh
    clock.now += 0.125
    assert ds.endpoints()[0].metrics_stale  # recomputed on read
    assert ep.metrics.waiting_requests == 3  # old values kept, only flagged
    ds.update_metrics(A, EndpointMetrics(waiting_requests=4))
    assert not ep.metrics_stale


def test_update_for_unknown_endpoint_is_refused() -> None:
    assert not Datastore().update_metrics(A, EndpointMetrics())


def test_staleness_can_be_disabled() -> None:
    ds = Datastore(staleness_threshold=None)
    ds.upsert(EndpointSpec(address=A))
    assert not ds.endpoints()[0].metrics_stale


def test_bad_threshold_is_rejected() -> None:
    with pytest.raises(ValueError, match="staleness_threshold"):
        Datastore(staleness_threshold=0)


# -- pool gauges --------------------------------------------------------------------------------


def test_pool_stats_average_only_fresh_endpoints() -> None:
    clock = ManualClock()
    ds = Datastore(clock=clock)
    ds.apply_specs(
        [EndpointSpec(address=A), EndpointSpec(address=B), EndpointSpec(address="10.0.0.3:8000")]
    )
    assert ds.pool_stats().average_kv_cache_usage is None
    ds.update_metrics(A, EndpointMetrics(kv_cache_usage=0.2, waiting_requests=2))
    clock.now += 5  # A is now older than the 2 s gauge threshold
    ds.update_metrics(B, EndpointMetrics(kv_cache_usage=0.4, waiting_requests=4))
    ds.update_metrics("10.0.0.3:8000", EndpointMetrics(kv_cache_usage=0.6, waiting_requests=0))
    ds.request_started(B, 10)
    stats = ds.pool_stats()
    assert stats.ready_endpoints == 3 and ds.ready_count() == 3
    assert stats.fresh_endpoints == 2
    assert stats.average_kv_cache_usage == pytest.approx(0.5)
    assert stats.average_waiting_requests == pytest.approx(2.0)
    assert stats.in_flight_requests == 1
    assert ds.average_kv_cache_usage(max_age=10) == pytest.approx(0.4)
    assert ds.average_waiting_requests(max_age=10) == pytest.approx(2.0)
