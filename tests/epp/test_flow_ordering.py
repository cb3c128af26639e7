"""Flow control's ordering policies (`epp.flow_ordering`): their keys, with llm-d-router's cases
for ``slo-deadline-ordering-policy`` (``slodeadline/slo_deadline_test.go``), and the order the
flow controller really dispatches a flow's queued requests in."""

from __future__ import annotations

import asyncio
import math
from pathlib import Path
from typing import Any, cast

import pytest

from epp.cli import main
from epp.config import ConfigError, load_config
from epp.flow_control import FlowController, FlowObserver, Item, build_flow_controller
from epp.flow_ordering import MAX_SLO_MS, SLODeadlineOrdering, slo_ttft_ms
from scorers.base import LLMRequest
from tests.epp.test_flow_control import Pool
from tests.scorers.plugin_helpers import make

NEW, OLD = "x-llm-d-slo-ttft-ms", "x-slo-ttft-ms"
NOW = 1000.0  # seconds; whole milliseconds stay exact as floats


def item(received: float | None, headers: dict[str, str] | None, enqueued: float = NOW) -> Item:
    request = None
    if headers is not None:
        request = LLMRequest(request_id="r", model="m", headers=headers)
        request.received_at = received
    return Item(0, 0, enqueued, cast(Any, None), request)


def less(policy: Any, a: Item, b: Item) -> bool:
    """Upstream's ``Less(a, b)``: ``a`` leaves before ``b``."""
    return bool(policy.order_key(a, 60.0) < policy.order_key(b, 60.0))


def test_slo_deadline_orders_as_upstreams_less() -> None:
    policy = make("slo-deadline-ordering-policy")
    a = item(NOW, {NEW: "100"})  # deadline +100 ms
    b = item(NOW, {NEW: "50"})  # +50 ms
    c = item(NOW + 0.020, {NEW: "50"})  # received later, +70 ms
    d = item(NOW, {})  # no SLO: far future
    e = item(NOW - 1.0, {NEW: "1050"})  # the same deadline as b, received earlier
    f = item(NOW, {NEW: str(2**63 - 1)})  # too large for a Go duration: far future
    none = item(None, None)  # upstream's nil item
    cases = [
        (b, a, True), (a, b, False), (c, a, True), (a, d, True), (d, a, False),
        (e, b, True), (b, e, False), (a, f, True), (f, a, False),
        (none, a, False), (a, none, True), (none, none, False),
    ]  # fmt: skip
    for first, second, expected in cases:
        assert less(policy, first, second) is expected


@pytest.mark.parametrize(
    ("headers", "expected_ms"),
    [
        ({NEW: "200"}, 200),
        ({OLD: "150"}, 150),  # the deprecated alias
        ({NEW: "200", OLD: "50"}, 200),  # the current header wins
        ({NEW: " 75 "}, 75),  # trimmed, as Go's strings.TrimSpace
        ({NEW: "+75"}, 75),  # strconv.ParseInt takes a sign
        ({NEW: str(MAX_SLO_MS)}, MAX_SLO_MS),
        ({}, None),
        ({"x-some-header": "200"}, None),
        ({NEW: "x"}, None),
        ({NEW: "1_000"}, None),
        ({NEW: "-5"}, None),
        ({NEW: "2.5"}, None),
        ({NEW: str(MAX_SLO_MS + 1)}, None),  # would overflow time.Duration
        ({NEW: str(2**63 - 1)}, None),
        ({NEW: "", OLD: "50"}, None),  # upstream stops at the first header present
    ],
)
def test_slo_header_values(headers: dict[str, str], expected_ms: int | None) -> None:
    assert slo_ttft_ms(headers) == expected_ms
    key = SLODeadlineOrdering.order_key(cast(Any, None), item(NOW, headers), 60.0)
    deadline = NOW * 1000 + expected_ms if expected_ms is not None else math.inf
    assert key == (deadline, NOW)


def test_slo_deadline_counts_from_the_receive_time_and_falls_back_to_arrival() -> None:
    policy = make("slo-deadline-ordering-policy")
    # Received at the headers, queued later (a slow body): the SLO runs from the headers.
    assert policy.order_key(item(NOW, {NEW: "10"}, enqueued=NOW + 5), 60.0)[0] == NOW * 1000 + 10
    # Built outside an ext_proc stream: its arrival in flow control stands for it.
    assert policy.order_key(item(None, {NEW: "10"}, enqueued=NOW + 5), 60.0)[0] == (
        (NOW + 5) * 1000 + 10
    )


def test_fcfs_and_edf_keys() -> None:
    fcfs, edf = make("fcfs-ordering-policy"), make("edf-ordering-policy")
    early, late = item(NOW, {}, enqueued=NOW), item(NOW, {}, enqueued=NOW + 1)
    assert less(fcfs, early, late) and not less(fcfs, late, early)
    # One TTL for every request: EDF is FCFS.
    assert less(edf, early, late) and not less(edf, late, early)
    assert edf.order_key(early, 60.0) == (NOW + 60.0, NOW)
    assert edf.order_key(early, 0.0) == (math.inf, NOW)  # no TTL: no deadline


# ---------------------------------------------------------------------------------------------
# Through the flow controller

SLO_CONFIG = """\
apiVersion: llm-d.ai/v1alpha1
kind: EndpointPickerConfig
featureGates: [flowControl]
plugins:
- type: queue-scorer
- type: slo-deadline-ordering-policy
flowControl:
  defaultRequestTTL: "60s"
  defaultPriorityBand:
    orderingPolicyRef: slo-deadline-ordering-policy
schedulingProfiles:
- name: default
  plugins:
  - pluginRef: queue-scorer
"""


def controller(pool: Pool, text: str = SLO_CONFIG) -> tuple[FlowController, list[str]]:
    outcomes: list[str] = []

    class Outcomes(FlowObserver):
        def flow_control_outcome(
            self, request: LLMRequest | None, outcome: str, priority: int, waited: float
        ) -> None:
            outcomes.append(outcome)

    config = load_config(text=text)
    fc = build_flow_controller(
        config.flow_control_settings, {}, lambda e: pool.saturation, pool, observer=Outcomes()
    )
    return fc, outcomes


def slo_request(name: str, slo_ms: str | None, flow: str | None = None) -> LLMRequest:
    headers = {NEW: slo_ms} if slo_ms is not None else {}
    if flow is not None:
        headers["x-llm-d-inference-fairness-id"] = flow
    request = LLMRequest(request_id=name, model="m", headers=headers)
    request.body_bytes = 10
    return request


async def dispatch_order(fc: FlowController, pool: Pool, requests: list[LLMRequest]) -> list[str]:
    """Queue ``requests`` in this order on a saturated pool, then let one through per release."""
    order: list[str] = []

    async def one(request: LLMRequest) -> None:
        await fc.admit(pool, request=request)
        order.append(request.request_id)
        pool.saturation = 1.0  # the dispatched request fills the pool again

    pool.saturation = 1.0
    tasks = []
    for request in requests:
        tasks.append(asyncio.ensure_future(one(request)))
        await asyncio.sleep(0.002)
    assert fc.queued == len(requests)
    for _ in requests:
        pool.saturation = 0.0
        fc.release()
        await asyncio.sleep(0.02)
    await asyncio.gather(*tasks)
    await fc.stop()
    return order


async def test_slo_deadlines_reorder_the_requests_of_one_flow() -> None:
    pool = Pool()
    fc, _ = controller(pool)
    arrivals = [
        slo_request("loose", "5000"),
        slo_request("none", None),
        slo_request("tight", "500"),
    ]
    assert await dispatch_order(fc, pool, arrivals) == ["tight", "loose", "none"]
    # The same arrivals under FCFS leave as they came.
    fcfs = SLO_CONFIG.replace("orderingPolicyRef: slo-deadline-ordering-policy", "")
    fc, _ = controller(pool, fcfs.replace("  defaultPriorityBand:\n", ""))
    arrivals = [
        slo_request("loose", "5000"),
        slo_request("none", None),
        slo_request("tight", "500"),
    ]
    assert await dispatch_order(fc, pool, arrivals) == ["loose", "none", "tight"]


async def test_global_strict_fairness_compares_flows_by_their_ordering() -> None:
    pool = Pool()
    fc, _ = controller(pool)
    arrivals = [slo_request("a-loose", "5000", "a"), slo_request("b-tight", "100", "b")]
    assert await dispatch_order(fc, pool, arrivals) == ["b-tight", "a-loose"]


async def test_a_request_sorted_behind_others_still_leaves_at_its_ttl() -> None:
    pool = Pool()
    pool.saturation = 1.0
    fc, outcomes = controller(pool, SLO_CONFIG.replace('"60s"', '"300ms"'))
    old = asyncio.ensure_future(fc.admit(pool, request=slo_request("old", None)))
    await asyncio.sleep(0.25)
    young = asyncio.ensure_future(fc.admit(pool, request=slo_request("young", "10")))
    await asyncio.sleep(0.15)  # old waited 400 ms (its TTL is 300), young 150 ms
    assert old.done() and not young.done()
    assert outcomes == ["EvictedTTL"]
    young.cancel()
    with pytest.raises(asyncio.CancelledError):
        await young
    await fc.stop()


def test_an_ordering_ref_must_name_an_ordering_policy() -> None:
    text = SLO_CONFIG.replace(
        "orderingPolicyRef: slo-deadline-ordering-policy", "orderingPolicyRef: queue-scorer"
    )
    with pytest.raises(ConfigError, match="orderingPolicyRef: 'queue-scorer' is not a declared"):
        load_config(text=text)


def test_the_slo_config_loads_through_check_config(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "slo-deadline.yaml"
    path.write_text(SLO_CONFIG)
    assert main(["check-config", str(path)]) == 0  # Beta: no flag needed
    assert f"{path}: OK" in capsys.readouterr().out
