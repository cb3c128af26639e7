"""llm-d-router's ``utilization-detector`` and ``probabilistic-admitter`` (`scorers.saturation`),
their configuration sections, and what they do to sheddable requests."""

from __future__ import annotations

import logging
import math
import random

import pytest

from epp.admission import AdmissionController, PoolSaturatedError
from epp.config import ConfigError, build_scheduler, load_config
from scorers.base import AdmissionDeniedError, Endpoint, PluginContext
from scorers.saturation import parse_duration, utilization
from tests.scorers.plugin_helpers import StaticEndpoints, endpoint, make, request
from tests.support.llmd_samples import PROBABILISTIC_ADMITTER_EPP_CONFIG

ADMITTER_SAMPLE = PROBABILISTIC_ADMITTER_EPP_CONFIG


def fresh(address: str, *, waiting: int = 0, kv: float = 0.0, age: float = 0.0) -> Endpoint:
    ep = endpoint(address, waiting=waiting, kv=kv)
    ep.metrics.updated_at = 100.0
    ep.metrics_age = age
    return ep


def test_utilization_is_the_mean_of_each_endpoints_worse_ratio() -> None:
    pods = [fresh("a:1", waiting=5), fresh("b:1", kv=0.4), fresh("c:1", waiting=1, kv=0.8)]
    # a: max(5/5, 0) = 1; b: max(0, 0.4/0.8) = 0.5; c: max(1/5, 0.8/0.8) = 1.
    assert utilization(pods, 5, 0.8, 0.2) == (pytest.approx(2.5 / 3), 0)
    # Stale (older than 0.2 s) or never scraped counts as full, and as stale; no endpoint at
    # all is full and none is stale.
    assert utilization([fresh("a:1", age=0.3), fresh("b:1")], 5, 0.8, 0.2) == (0.5, 1)
    assert utilization([endpoint("a:1", scraped=False)], 5, 0.8, None) == (1.0, 1)
    assert utilization([], 5, 0.8, 0.2) == (1.0, 0)


def test_the_detector_counts_its_stale_endpoints_in_a_gauge_and_warns_once_in_30_s(
    caplog: pytest.LogCaptureFixture,
) -> None:
    now = [100.0]
    ctx = PluginContext(endpoints=StaticEndpoints(), clock=lambda: now[0])
    detector = make("utilization-detector", {}, ctx=ctx)
    pods = [fresh("a:1"), fresh("b:1", age=1.0), endpoint("c:1")]
    assert detector.saturation(pods) == pytest.approx(2 / 3)  # type: ignore[attr-defined]
    (sample,) = detector.telemetry_samples()  # type: ignore[attr-defined]
    assert sample.name == "llm_d_epp_flow_control_stale_endpoints"
    assert (sample.value, sample.labels) == (2, (("detector", "utilization-detector"),))
    assert "2 of 3 endpoints have no metrics newer than 200ms" in caplog.text
    caplog.clear()
    now[0] += 29.0
    detector.saturation(pods[1:])  # type: ignore[attr-defined]
    assert caplog.text == ""  # not again within 30 s
    detector.saturation(pods[:1])  # type: ignore[attr-defined]
    assert next(detector.telemetry_samples()).value == 0  # type: ignore[attr-defined]
    now[0] += 2.0
    detector.saturation(pods)  # type: ignore[attr-defined]
    assert "2 of 3 endpoints" in caplog.text


def test_the_detector_filter_keeps_endpoints_under_its_thresholds_or_all() -> None:
    detector = make("utilization-detector", {"headroom": 0.2})  # limits: 6 waiting, KV 0.96
    calm, busy, old = fresh("a:1", waiting=5), fresh("b:1", waiting=6), fresh("c:1", age=1.0)
    assert detector.filter(request(), [calm, busy, old]) == [calm]  # type: ignore[attr-defined]
    assert detector.filter(request(), [busy, old]) == [busy, old]  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    ("parameters", "message"),
    [
        ({"queueDepthThreshold": 0}, "queueDepthThreshold"),
        ({"kvCacheUtilThreshold": 1.5}, "kvCacheUtilThreshold"),
        ({"metricsStalenessThreshold": "soon"}, "metricsStalenessThreshold"),
        ({"metricsStalenessThreshold": "0ms"}, "strictly positive"),
        ({"headroom": -1}, "headroom"),
    ],
)
def test_bad_detector_parameters_are_errors(parameters: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        make("utilization-detector", parameters)


def test_durations_read_as_go_writes_them() -> None:
    assert parse_duration("200ms") == pytest.approx(0.2)
    assert parse_duration("1.5s") == 1.5
    assert parse_duration("2m") == 120.0


def test_the_admitter_drops_sheddable_requests_with_the_upstream_probability() -> None:
    admitter = make("probabilistic-admitter")
    admitter.context.rng = random.Random(7)
    # Saturation 0.3 (KV 0.24 of the 0.8 threshold on each pod): rejected with 0.3^5 x 300.
    pods = [fresh("a:1", kv=0.24), fresh("b:1", kv=0.24)]
    assert admitter.rejection_probability(pods) == pytest.approx(0.3**5 * 300)  # type: ignore[attr-defined]
    sheddable = request(priority=-1)
    dropped = sum(admitter.admit(sheddable, pods) is not None for _ in range(2000))  # type: ignore[attr-defined]
    assert abs(dropped / 2000 - 0.729) < 0.04
    # At 0.32 and above every sheddable request is dropped; at 0.1 almost none.
    full = [fresh("a:1", kv=0.26)]
    assert admitter.rejection_probability(full) == 1.0  # type: ignore[attr-defined]
    assert admitter.rejection_probability([fresh("a:1", kv=0.08)]) == pytest.approx(  # type: ignore[attr-defined]
        math.pow(0.1, 5) * 300
    )
    # Requests with a priority of 0 or more always pass.
    assert admitter.admit(request(priority=0), full) is None  # type: ignore[attr-defined]


async def test_a_dropped_request_is_a_429_with_the_admitters_reason() -> None:
    pods = [fresh("a:1", waiting=9)]
    context = PluginContext(endpoints=StaticEndpoints(pods), rng=random.Random(0))
    scheduler = build_scheduler(load_config(text=ADMITTER_SAMPLE), context)
    with pytest.raises(AdmissionDeniedError, match="probabilistic-admitter: sheddable") as err:
        await scheduler.schedule(request(priority=-1), pods)
    assert err.value.http_status == 429
    result = await scheduler.schedule(request(priority=0), pods)
    assert result.targets == (pods[0],)


async def test_the_configured_detector_decides_when_sheddable_requests_are_dropped() -> None:
    config = load_config(text=ADMITTER_SAMPLE)
    assert config.saturation_detector == "utilization-detector"
    scheduler = build_scheduler(config, PluginContext(endpoints=StaticEndpoints([])))
    detector = scheduler.plugin("utilization-detector")
    # KV at 0.9: saturated by the built-in defaults (0.9 / 0.8), not by the sample's
    # thresholds (queue 999999999, KV 1.0).
    pods = [fresh("a:1", kv=0.9)]
    pods[0].metrics_stale = False
    built_in = AdmissionController()
    with pytest.raises(PoolSaturatedError):
        await built_in.admit(lambda: pods, sheddable=True)
    configured = AdmissionController(saturation=detector.saturation)  # type: ignore[union-attr]
    assert await configured.admit(lambda: pods, sheddable=True) == pods
    pods[0].metrics.kv_cache_usage = 1.0
    with pytest.raises(PoolSaturatedError):
        await configured.admit(lambda: pods, sheddable=True)


@pytest.mark.parametrize(
    ("section", "message"),
    [
        ("flowControl:\n  saturationDetector:\n    pluginRef: nope\n", "'nope' is not a declared"),
        (
            "flowControl:\n  saturationDetector:\n    pluginRef: random-picker\n",
            r"'random-picker' \(random-picker\) is not a saturation detector",
        ),
        ("saturationDetector:\n  pluginRef: nope\n", "saturationDetector.pluginRef: 'nope'"),
        ("flowControl:\n  queueing: true\n", "queueing"),
    ],
)
def test_bad_detector_references_are_errors(section: str, message: str) -> None:
    text = (
        ADMITTER_SAMPLE.split("flowControl:")[0]
        + section
        + ADMITTER_SAMPLE.split("pluginRef: utilization-detector\n")[1]
    )
    with pytest.raises(ConfigError, match=message):
        load_config(text=text)


def test_queueing_keys_are_logged_as_not_applied(caplog: pytest.LogCaptureFixture) -> None:
    text = ADMITTER_SAMPLE.replace(
        "flowControl:\n", "flowControl:\n  maxRequests: 100\n  enableEviction: true\n"
    )
    with caplog.at_level(logging.WARNING):
        config = load_config(text=text)
    assert config.saturation_detector == "utilization-detector"
    assert any(
        "flowControl.enableEviction, flowControl.maxRequests: not applied" in r.message
        for r in caplog.records
    )


def loaded(address: str, requests: int, tokens: int = 0) -> Endpoint:
    ep = endpoint(address)
    ep.load.in_flight_requests = requests
    ep.load.in_flight_kv_tokens = tokens
    return ep


def test_the_concurrency_detector_reads_the_epps_own_in_flight_counts() -> None:
    pods = [loaded("a:1", 60, 900_000), loaded("b:1", 20, 100_000)]
    by_requests = make("concurrency-detector")
    assert by_requests.saturation(pods) == pytest.approx(80 / 200)  # type: ignore[attr-defined]
    by_tokens = make("concurrency-detector", {"concurrencyMode": "tokens"})
    assert by_tokens.saturation(pods) == pytest.approx(1_000_000 / 2_000_000)  # type: ignore[attr-defined]
    hybrid = make("concurrency-detector", {"concurrencyMode": "hybrid"})
    # a: max(0.6, 0.9); b: max(0.2, 0.1): mean (0.9 + 0.2) / 2.
    assert hybrid.saturation(pods) == pytest.approx(0.55)  # type: ignore[attr-defined]
    assert by_requests.saturation([]) == 1.0  # type: ignore[attr-defined]


def test_the_concurrency_filter_keeps_endpoints_under_their_limit_and_may_keep_none() -> None:
    detector = make("concurrency-detector", {"maxConcurrency": 10, "headroom": 0.5})  # limit 15
    calm, full = loaded("a:1", 14), loaded("b:1", 15)
    assert detector.filter(request(), [calm, full]) == [calm]  # type: ignore[attr-defined]
    assert detector.filter(request(), [full]) == []  # type: ignore[attr-defined]


def test_the_concurrency_detector_names_a_declared_in_flight_producer() -> None:
    text = """\
apiVersion: llm-d.ai/v1alpha1
kind: EndpointPickerConfig
plugins:
- type: inflight-load-producer
- type: concurrency-detector
  parameters: {maxConcurrency: 132, inFlightLoadProducerName: %s}
- type: queue-scorer
flowControl:
  saturationDetector: {pluginRef: concurrency-detector}
schedulingProfiles:
- name: default
  plugins: [{pluginRef: queue-scorer}]
"""
    config = load_config(text=text % "inflight-load-producer")
    assert config.saturation_detector == "concurrency-detector"
    build_scheduler(config, PluginContext(endpoints=StaticEndpoints([])))
    with pytest.raises(ConfigError, match="names no declared inflight-load-producer"):
        build_scheduler(
            load_config(text=text % "queue-scorer"), PluginContext(endpoints=StaticEndpoints([]))
        )
