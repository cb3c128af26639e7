"""Admission control: per-endpoint in-flight limits, fast 429s or a bounded FIFO queue."""

from __future__ import annotations

import asyncio

import pytest

from epp.admission import (
    DROPPED_REASON_HEADER,
    REJECTED_QUEUE_FULL,
    REJECTED_SATURATED,
    REJECTED_TTL_EXPIRED,
    AdmissionController,
    AdmissionSettings,
    PoolSaturatedError,
    endpoint_load,
)
from epp.datastore import Datastore, EndpointSpec
from epp.director import Director
from epp.extproc import ExtProcStream
from epp.scheduler import Scheduler, SchedulerProfile
from scorers.base import Endpoint, EndpointMetrics, LLMRequest, PluginContext
from scorers.pickers import MaxScorePicker
from scorers.profiles import SingleProfileHandler
from tests.epp.test_extproc import request_body, request_headers


def _director(admission: AdmissionSettings, endpoints: int = 2) -> tuple[Director, Datastore]:
    ds = Datastore(staleness_threshold=None)
    for i in range(endpoints):
        ds.upsert(EndpointSpec(address=f"10.0.0.{i + 1}:8000"))
    context = PluginContext(endpoints=ds)
    picker = MaxScorePicker("picker", MaxScorePicker.Parameters(), context)
    handler = SingleProfileHandler("handler", SingleProfileHandler.Parameters(), context)
    scheduler = Scheduler([SchedulerProfile("default", [], [], picker)], handler)
    return Director(ds, scheduler, admission=AdmissionController(admission)), ds


def _request(i: int) -> LLMRequest:
    return LLMRequest(request_id=str(i), model="m", prompt="hello")


def test_settings_are_validated() -> None:
    assert not AdmissionSettings().enabled
    with pytest.raises(ValueError, match="max_in_flight_per_endpoint"):
        AdmissionSettings(max_in_flight_per_endpoint=0)
    with pytest.raises(ValueError, match="mode"):
        AdmissionSettings(mode="drop")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="max_queue_wait"):
        AdmissionSettings(max_queue_wait=0)


def test_load_is_the_larger_of_routed_and_reported() -> None:
    ep = Endpoint(address="10.0.0.1:8000")
    ep.load.in_flight_requests = 2
    ep.metrics = EndpointMetrics(running_requests=3, waiting_requests=4)
    assert endpoint_load(ep) == 7
    ep.metrics_stale = True  # a stale report says nothing about now
    assert endpoint_load(ep) == 2


async def test_disabled_admission_routes_everything() -> None:
    director, ds = _director(AdmissionSettings())
    decisions = [await director.route(_request(i), None) for i in range(50)]
    assert ds.pool_stats().in_flight_requests == 50
    for d in decisions:
        director.response_complete(d, None, 200)


async def test_reject_mode_answers_429_once_every_endpoint_is_full() -> None:
    director, ds = _director(AdmissionSettings(max_in_flight_per_endpoint=2))
    decisions = [await director.route(_request(i), None) for i in range(4)]
    loads = sorted(ep.load.in_flight_requests for ep in ds.endpoints())
    assert loads == [2, 2]  # full endpoints are not offered to the scheduler
    with pytest.raises(PoolSaturatedError) as caught:
        await director.route(_request(99), None)
    assert caught.value.http_status == 429
    assert caught.value.response_headers == ((DROPPED_REASON_HEADER, REJECTED_SATURATED),)
    director.response_complete(decisions[0], None, 200)
    freed = decisions[0].targets[0]
    again = await director.route(_request(100), None)
    assert again.targets == (freed,)
    assert director.admission.rejected_total[REJECTED_SATURATED] == 1


async def test_reported_load_counts_against_the_limit() -> None:
    director, ds = _director(AdmissionSettings(max_in_flight_per_endpoint=4))
    ds.update_metrics("10.0.0.1:8000", EndpointMetrics(running_requests=4))
    decision = await director.route(_request(0), None)
    assert decision.targets == ("10.0.0.2:8000",)


async def test_queue_mode_waits_for_room_in_fifo_order() -> None:
    director, _ = _director(
        AdmissionSettings(max_in_flight_per_endpoint=1, mode="queue", max_queue_wait=5.0),
        endpoints=1,
    )
    first = await director.route(_request(0), None)
    waiting = [asyncio.create_task(director.route(_request(i), None)) for i in (1, 2)]
    await asyncio.sleep(0.1)
    assert director.admission.queued == 2
    assert not any(t.done() for t in waiting)
    director.response_complete(first, None, 200)
    second = await asyncio.wait_for(waiting[0], 2)
    assert second.request.request_id == "1"
    assert not waiting[1].done()
    director.response_complete(second, None, 200)
    third = await asyncio.wait_for(waiting[1], 2)
    assert third.request.request_id == "2"
    director.response_complete(third, None, 200)
    assert director.admission.queued == 0


async def test_queue_mode_bounds_the_queue_and_the_wait() -> None:
    director, _ = _director(
        AdmissionSettings(
            max_in_flight_per_endpoint=1, mode="queue", max_queued=2, max_queue_wait=0.2
        ),
        endpoints=1,
    )
    held = await director.route(_request(0), None)
    waiting = [asyncio.create_task(director.route(_request(i), None)) for i in (1, 2)]
    await asyncio.sleep(0.02)
    with pytest.raises(PoolSaturatedError) as full:
        await director.route(_request(3), None)
    assert full.value.dropped_reason == REJECTED_QUEUE_FULL
    results = await asyncio.gather(*waiting, return_exceptions=True)
    assert all(
        isinstance(r, PoolSaturatedError) and r.dropped_reason == REJECTED_TTL_EXPIRED
        for r in results
    )
    assert director.admission.queued == 0
    director.response_complete(held, None, 200)


async def test_a_cancelled_waiter_leaves_the_queue() -> None:
    director, _ = _director(
        AdmissionSettings(max_in_flight_per_endpoint=1, mode="queue"), endpoints=1
    )
    held = await director.route(_request(0), None)
    waiter = asyncio.create_task(director.route(_request(1), None))
    await asyncio.sleep(0.02)
    waiter.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiter
    assert director.admission.queued == 0
    director.response_complete(held, None, 200)
    assert (await director.route(_request(2), None)).targets == ("10.0.0.1:8000",)


async def test_the_ext_proc_reply_carries_the_dropped_reason() -> None:
    director, _ = _director(AdmissionSettings(max_in_flight_per_endpoint=1), endpoints=1)
    await director.route(_request(0), None)
    stream = ExtProcStream(director)
    assert await stream.handle(request_headers("/v1/completions")) == []
    (reply,) = await stream.handle(request_body(b'{"model": "m", "prompt": "hi"}'))
    immediate = reply.immediate_response
    assert immediate.status.code == 429
    headers = {h.header.key: h.header.raw_value.decode() for h in immediate.headers.set_headers}
    assert headers[DROPPED_REASON_HEADER] == REJECTED_SATURATED


async def test_a_sheddable_request_is_refused_rather_than_queued() -> None:
    # An InferenceObjective with a negative priority: dropped at once when the pool is full,
    # as the Inference Extension drops sheddable requests; a normal one waits in the queue.
    from epp.request_rules import RequestRules

    director, _ = _director(
        AdmissionSettings(max_in_flight_per_endpoint=1, mode="queue", max_queue_wait=5.0),
        endpoints=1,
    )
    rules = RequestRules(("inference.networking.k8s.io", "pool"))
    rules.set_objectives(
        [{"metadata": {"name": "batch"}, "spec": {"poolRef": {"name": "pool"}, "priority": -1}}]
    )
    director.rules = rules
    held = await director.route(_request(0), None)
    sheddable = LLMRequest(
        request_id="s",
        model="m",
        prompt="hello",
        headers={"x-gateway-inference-objective": "batch"},
    )
    with pytest.raises(PoolSaturatedError) as dropped:
        await director.route(sheddable, None)
    assert dropped.value.dropped_reason == REJECTED_SATURATED
    assert director.admission.queued == 0
    waiting = asyncio.create_task(director.route(_request(1), None))
    await asyncio.sleep(0.05)
    assert director.admission.queued == 1
    director.response_complete(held, None, 200)
    director.response_complete(await asyncio.wait_for(waiting, 2), None, 200)


async def test_without_limits_a_sheddable_request_is_dropped_when_the_pool_is_saturated() -> None:
    # Admission limits off (the default): upstream's utilization-detector rule decides.
    from epp.request_rules import RequestRules

    director, ds = _director(AdmissionSettings(), endpoints=2)
    rules = RequestRules(("inference.networking.k8s.io", "pool"))
    rules.set_objectives(
        [{"metadata": {"name": "batch"}, "spec": {"poolRef": {"name": "pool"}, "priority": -1}}]
    )
    director.rules = rules

    def sheddable() -> LLMRequest:
        headers = {"x-llm-d-inference-objective": "batch"}
        return LLMRequest(request_id="s", model="m", prompt="hello", headers=headers)

    ds.update_metrics("10.0.0.1:8000", EndpointMetrics(waiting_requests=2))
    ds.update_metrics("10.0.0.2:8000", EndpointMetrics(kv_cache_usage=0.5))
    decision = await director.route(sheddable(), None)  # mean of 0.4 and 0.625: not saturated
    director.response_complete(decision, None, 200)
    ds.update_metrics("10.0.0.2:8000", EndpointMetrics(kv_cache_usage=0.9))
    ds.update_metrics("10.0.0.1:8000", EndpointMetrics(waiting_requests=0, kv_cache_usage=0.7))
    # mean of 0.875 and 1.125 = 1.0: saturated
    with pytest.raises(PoolSaturatedError, match="sheddable request dropped"):
        await director.route(sheddable(), None)
    normal = await director.route(_request(1), None)  # only sheddable requests are dropped
    director.response_complete(normal, None, 200)


def test_pool_saturation_follows_the_utilization_detector() -> None:
    from epp.admission import pool_saturated

    fresh = Endpoint(address="10.0.0.1:8000", metrics=EndpointMetrics(waiting_requests=1))
    stale = Endpoint(address="10.0.0.2:8000", metrics_stale=True)
    assert not pool_saturated([fresh])  # 1/5 = 0.2
    assert pool_saturated([stale])  # stale metrics count as saturated
    assert not pool_saturated([fresh, stale])  # mean 0.6
    assert pool_saturated([])  # an empty pool is saturated, as upstream (429, not 503)
