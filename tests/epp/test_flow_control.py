"""llm-d-router's flow control (`epp.flow_control`): its configuration, and requests waiting in
priority bands until the pool's saturation lets them through."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Sequence

import pytest

from epp.config import ConfigError, load_config
from epp.flow_control import (
    FlowControlNoEndpoints,
    FlowControlRejected,
    FlowObserver,
    build_flow_controller,
    duration,
    quantity,
)
from scorers.base import Endpoint, LLMRequest
from tests.scorers.plugin_helpers import endpoint

# llm-d-router's test/integration/epp/wellknown_configs_test.go "flow-control" case.
FLOW_CONTROL_CONFIG = """\
apiVersion: llm-d.ai/v1alpha1
kind: EndpointPickerConfig
featureGates: [flowControl]
plugins:
- type: queue-scorer
- type: round-robin-fairness-policy
- type: fcfs-ordering-policy
- type: concurrency-detector
  parameters: {maxConcurrency: 132, concurrencyMode: requests, headroom: 0.0}
flowControl:
  saturationDetector: {pluginRef: concurrency-detector}
  maxBytes: "10Gi"
  maxRequests: "1k"
  defaultRequestTTL: "60s"
  priorityBands:
  - {priority: 100, maxRequests: "500", fairnessPolicyRef: round-robin-fairness-policy,
     orderingPolicyRef: fcfs-ordering-policy}
  - {priority: 0, maxRequests: "200", fairnessPolicyRef: round-robin-fairness-policy}
  - {priority: -10, maxRequests: "50"}
schedulingProfiles:
- name: default
  plugins:
  - pluginRef: queue-scorer
"""


def test_quantities_and_durations_read_as_kubernetes_writes_them() -> None:
    assert quantity("1k", "x") == 1000
    assert quantity("10Gi", "x") == 10 * 2**30
    assert quantity(500, "x") == 500
    assert duration("60s", "x") == 60.0
    assert duration("1m30s", "x") == 90.0
    assert duration("250ms", "x") == 0.25
    with pytest.raises(ValueError, match="not a quantity"):
        quantity("lots", "flowControl.maxBytes")
    with pytest.raises(ValueError, match="not a duration"):
        duration("soon", "flowControl.defaultRequestTTL")


def test_the_flow_control_section_is_read_whole() -> None:
    config = load_config(text=FLOW_CONTROL_CONFIG)
    assert config.flow_control_enabled
    s = config.flow_control_settings
    assert (s.max_requests, s.max_bytes, s.ttl, s.no_endpoint_ttl) == (1000, 10 * 2**30, 60, 60)
    assert s.band(100).max_requests == 500
    assert s.band(100).fairness == "round-robin-fairness-policy"
    # Band values of 0 or left out are upstream's defaults (5000 requests, 1 GB).
    assert (s.band(-10).max_requests, s.band(-10).max_bytes) == (50, 1_000_000_000)
    assert s.band(-10).fairness == "global-strict-fairness-policy"
    assert s.band(7) == s.default_band  # a priority no band names: the default template


@pytest.mark.parametrize(
    ("old", "new", "message"),
    [
        ('maxRequests: "1k"', "maxRequests: -1", "must be non-negative"),
        ("- {priority: -10", "- {priority: 0", "duplicate priority level 0"),
        ("fairnessPolicyRef: round-robin-fairness-policy}", "fairnessPolicyRef: nope}", "'nope'"),
        ('defaultRequestTTL: "60s"', 'defaultRequestTTL: "a minute"', "not a duration"),
        ('defaultRequestTTL: "60s"', "enableEviction: true", "enableEviction"),
        ('defaultRequestTTL: "60s"', "usageLimitPolicyPluginRef: queue-scorer", "usage limit"),
    ],
)  # fmt: skip
def test_bad_flow_control_settings_are_errors_naming_them(old: str, new: str, message: str) -> None:
    text = FLOW_CONTROL_CONFIG.replace(old, new)
    with pytest.raises(ConfigError, match=message):
        load_config(text=text)


# ---------------------------------------------------------------------------------------------
# The controller


class Pool:
    """Endpoints, and a saturation the test sets."""

    def __init__(self, endpoints: Sequence[Endpoint] = (endpoint("10.0.0.1:8000"),)) -> None:
        self.endpoints = list(endpoints)
        self.saturation = 0.0

    def __call__(self) -> list[Endpoint]:
        return list(self.endpoints)


def controller(pool: Pool, text: str = FLOW_CONTROL_CONFIG) -> object:
    config = load_config(text=text)
    outcomes: list[tuple[str, int]] = []

    class Outcomes(FlowObserver):
        def flow_control_outcome(
            self, request: LLMRequest | None, outcome: str, priority: int, waited: float
        ) -> None:
            outcomes.append((outcome, priority))

    fc = build_flow_controller(
        config.flow_control_settings,
        {},
        lambda endpoints: pool.saturation,
        pool,
        observer=Outcomes(),
    )
    fc.outcomes = outcomes  # type: ignore[attr-defined]
    return fc


def req(priority: int = 0, flow: str | None = None, size: int = 100) -> LLMRequest:
    headers = {"x-llm-d-inference-fairness-id": flow} if flow else {}
    r = LLMRequest(request_id=f"r{random.random()}", model="m", headers=headers)
    r.priority = priority
    r.body_bytes = size
    return r


async def test_an_unsaturated_pool_dispatches_at_once() -> None:
    pool = Pool()
    fc = controller(pool)
    assert await fc.admit(pool, request=req()) == pool.endpoints  # type: ignore[attr-defined]
    assert fc.outcomes == [("Dispatched", 0)]  # type: ignore[attr-defined]


async def test_a_saturated_pool_holds_requests_until_it_has_room() -> None:
    pool = Pool()
    pool.saturation = 1.0
    fc = controller(pool)
    waiting = asyncio.ensure_future(fc.admit(pool, request=req()))  # type: ignore[attr-defined]
    await asyncio.sleep(0.05)
    assert not waiting.done() and fc.queued == 1  # type: ignore[attr-defined]
    pool.saturation = 0.5
    assert await asyncio.wait_for(waiting, 1.0) == pool.endpoints
    assert fc.queued == 0  # type: ignore[attr-defined]


async def test_higher_priority_bands_go_first_one_per_cycle() -> None:
    pool = Pool()
    pool.saturation = 1.0
    fc = controller(pool)
    order: list[str] = []

    async def one(name: str, priority: int) -> None:
        await fc.admit(pool, request=req(priority))  # type: ignore[attr-defined]
        order.append(name)
        pool.saturation = 1.0  # each dispatched request fills the pool again

    tasks = [asyncio.ensure_future(one(n, p)) for n, p in (("low", -10), ("mid", 0), ("high", 100))]
    await asyncio.sleep(0.02)
    for _ in range(3):
        pool.saturation = 0.0
        fc.release()  # type: ignore[attr-defined]
        await asyncio.sleep(0.02)
    await asyncio.gather(*tasks)
    assert order == ["high", "mid", "low"]


async def test_round_robin_serves_flows_in_turn() -> None:
    pool = Pool()
    pool.saturation = 1.0
    fc = controller(pool)
    order: list[str] = []

    async def one(flow: str) -> None:
        await fc.admit(pool, request=req(0, flow))  # type: ignore[attr-defined]
        order.append(flow)
        pool.saturation = 1.0

    tasks = []
    for flow in ("a", "a", "a", "b"):
        tasks.append(asyncio.ensure_future(one(flow)))
        await asyncio.sleep(0.001)
    for _ in range(4):
        pool.saturation = 0.0
        fc.release()  # type: ignore[attr-defined]
        await asyncio.sleep(0.02)
    await asyncio.gather(*tasks)
    assert order == ["a", "b", "a", "a"]


async def test_a_full_band_answers_429_rejected_saturated() -> None:
    pool = Pool()
    pool.saturation = 1.0
    fc = controller(pool, FLOW_CONTROL_CONFIG.replace('maxRequests: "50"', 'maxRequests: "1"'))
    first = asyncio.ensure_future(fc.admit(pool, request=req(-10)))  # type: ignore[attr-defined]
    await asyncio.sleep(0.01)
    with pytest.raises(FlowControlRejected) as err:
        await fc.admit(pool, request=req(-10))  # type: ignore[attr-defined]
    assert err.value.http_status == 429
    assert err.value.response_headers == (("x-llm-d-request-dropped-reason", "rejected-saturated"),)
    first.cancel()
    with pytest.raises(asyncio.CancelledError):
        await first
    assert fc.queued == 0  # type: ignore[attr-defined]
    assert ("EvictedContextCancelled", -10) in fc.outcomes  # type: ignore[attr-defined]


async def test_a_request_waits_its_ttl_then_429_rejected_ttl_expired() -> None:
    pool = Pool()
    pool.saturation = 1.0
    fc = controller(pool, FLOW_CONTROL_CONFIG.replace('"60s"', '"100ms"'))
    with pytest.raises(FlowControlRejected) as err:
        await asyncio.wait_for(fc.admit(pool, request=req()), 2.0)  # type: ignore[attr-defined]
    assert err.value.dropped_reason == "rejected-ttl-expired"
    assert fc.outcomes == [("EvictedTTL", 0)]  # type: ignore[attr-defined]


async def test_with_no_endpoint_a_request_waits_then_503_rejected_no_endpoints() -> None:
    pool = Pool([])
    text = FLOW_CONTROL_CONFIG.replace('defaultRequestTTL: "60s"', 'noEndpointRequestTTL: "100ms"')
    fc = controller(pool, text)
    with pytest.raises(FlowControlNoEndpoints) as err:
        await asyncio.wait_for(fc.admit(pool, request=req()), 2.0)  # type: ignore[attr-defined]
    assert err.value.http_status == 503
    assert err.value.response_headers == (
        ("x-llm-d-request-dropped-reason", "rejected-no-endpoints"),
    )


async def test_soft_reflective_ceilings_close_lower_bands_first() -> None:
    pool = Pool()
    pool.saturation = 0.7  # band 1 of 2 closes at 0.5 (between 0.5 and 1 it opens 1 cycle in 2)
    text = (
        FLOW_CONTROL_CONFIG.replace(
            "- type: fcfs-ordering-policy\n",
            "- type: fcfs-ordering-policy\n- type: soft-reflective-ceiling-policy\n",
        )
        .replace(
            "  maxBytes:",
            "  usageLimitPolicyPluginRef: soft-reflective-ceiling-policy\n  maxBytes:",
        )
        .replace("  - {priority: 100", "  - {priority: 99")
    )
    config = load_config(text=text)
    limit = build_flow_controller(config.flow_control_settings, {}, lambda e: 0.0, pool)._limit
    assert limit.ceilings(0.3, [99, 0]) == [1.0, 1.0]
    assert limit.ceilings(1.0, [99, 0]) == [1.0, 0.0]
    opened = [limit.ceilings(0.7, [99, 0])[1] for _ in range(6)]
    assert opened.count(1.0) == 3 and opened.count(0.0) == 3


def test_the_server_admits_through_flow_control_when_the_gate_is_on() -> None:
    from epp.flow_control import FlowController
    from epp.server import EndpointPicker, ServerOptions

    picker = EndpointPicker(
        ServerOptions(endpoints="127.0.0.1:8000", config_text=FLOW_CONTROL_CONFIG)
    )
    assert isinstance(picker.director.admission, FlowController)
    # Its detector is the configured one (132 requests per endpoint at 100 %).
    saturation = picker.director.admission._saturation
    busy = endpoint("10.0.0.1:8000")
    busy.load.in_flight_requests = 66
    assert saturation([busy]) == 0.5
    with pytest.raises(ValueError, match="--max-in-flight-per-endpoint"):
        EndpointPicker(
            ServerOptions(
                endpoints="127.0.0.1:8000",
                config_text=FLOW_CONTROL_CONFIG,
                max_in_flight_per_endpoint=4,
            )
        )


async def test_flow_control_metrics_follow_the_queue() -> None:
    from epp.telemetry import Telemetry

    telemetry = Telemetry(pool_name="pool")
    pool = Pool()
    pool.saturation = 1.0
    config = load_config(text=FLOW_CONTROL_CONFIG)
    fc = build_flow_controller(
        config.flow_control_settings,
        {},
        lambda endpoints: pool.saturation,
        pool,
        observer=telemetry,
    )
    value = telemetry.registry.get_sample_value
    labels = {
        "fairness_id": "tenant-a",
        "priority": "-10",
        "inference_pool": "pool",
        "model_name": "m",
        "target_model_name": "m",
    }
    waiting = asyncio.ensure_future(fc.admit(pool, request=req(-10, "tenant-a", size=300)))
    await asyncio.sleep(0.02)
    assert value("llm_d_epp_flow_control_queue_size", labels) == 1
    assert value("inference_extension_flow_control_queue_size", labels) == 1
    assert value("llm_d_epp_flow_control_queue_bytes", labels) == 300
    # Band -10 holds 50 requests: one waiting is 2 % of it.
    band = {"priority": "-10", "inference_pool": "pool"}
    assert value("llm_d_epp_flow_control_capacity_utilization_requests", band) == 0.02
    effective = {"inference_pool": "pool", "stage": "effective"}
    assert value("llm_d_epp_flow_control_pool_saturation", effective) == 1.0
    # The global limits (1k requests, 10 GiB) have their own series.
    whole = {"inference_pool": "pool"}
    assert value("llm_d_epp_flow_control_global_capacity_utilization_requests", whole) == 0.001
    assert value("llm_d_epp_flow_control_global_capacity_utilization_bytes", whole) == (
        300 / 2**30 / 10
    )
    queued = {"fairness_id": "tenant-a", "priority": "-10", "outcome": "NotYetFinalized"}
    for prefix in ("llm_d_epp", "inference_extension"):
        assert value(f"{prefix}_flow_control_request_enqueue_duration_seconds_count", queued) == 1
        # Cycles ran while it waited (one on arrival, then every few milliseconds).
        assert value(f"{prefix}_flow_control_dispatch_cycle_duration_seconds_count", {}) >= 2
    pool.saturation = 0.0
    await asyncio.wait_for(waiting, 1.0)
    assert value("llm_d_epp_flow_control_queue_size", labels) == 0
    assert value("llm_d_epp_flow_control_queue_bytes", labels) == 0
    waited = {**labels, "outcome": "Dispatched"}
    for prefix in ("llm_d_epp", "inference_extension"):
        name = f"{prefix}_flow_control_request_queue_duration_seconds_count"
        assert value(name, waited) == 1
    assert (
        value(
            "llm_d_epp_flow_control_requests_total",
            {"outcome": "Dispatched", "priority": "-10", "inference_pool": "pool"},
        )
        == 1
    )


def test_the_gated_sections_detector_reference_is_checked(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # With the gate on, a detector the file does not declare is an error, as with it off.
    text = FLOW_CONTROL_CONFIG.replace("{pluginRef: concurrency-detector}", "{pluginRef: nope}")
    for gated in (text, text.replace("featureGates: [flowControl]\n", "")):
        with pytest.raises(ConfigError, match=r"saturationDetector\.pluginRef: 'nope' is not a"):
            load_config(text=gated)
    # The settings a closed gate leaves unused are named once, when the file loads.
    caplog.clear()
    config = load_config(text=FLOW_CONTROL_CONFIG.replace("featureGates: [flowControl]\n", ""))
    assert config.saturation_detector == "concurrency-detector"
    assert caplog.text.count("not applied: the flowControl feature gate is off") == 1
