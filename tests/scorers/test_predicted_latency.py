"""llm-d-router's predicted-latency family (`scorers.predicted_latency`, `scorers.latency_slo`):
the producer's estimate from learned speeds, its SLO headroom, the scorer, the tier filter, the
admitter, their parameters and upstream's integration-test configuration."""

from __future__ import annotations

import asyncio
import math
import random
from pathlib import Path
from typing import Any

import pytest

from epp.cli import main
from epp.config import ConfigError, build_scheduler, load_config, parse_config, resolve_config
from scorers.base import (
    AdmissionDeniedError,
    Endpoint,
    LLMRequest,
    PluginConfigError,
    PluginContext,
    Usage,
)
from scorers.latency_slo import DENIAL
from scorers.predicted_latency import PredictedLatencyProducer
from scorers.request_data import (
    RESPONSE_TIMING,
    LatencyPredictionInfo,
    PrefixMatchInfo,
    ResponseTiming,
    latency_prediction_info_key,
    prefix_match_info_key,
)
from scorers.service_rates import ServiceRates
from tests.scorers.plugin_helpers import StaticEndpoints, endpoint, make, request, result_for
from tests.support.llmd_wellknown import PREDICTED_LATENCY_SLO

# llm-d-router test/integration/epp/wellknown_configs_test.go, "predicted-latency-slo".
UPSTREAM_CONFIG = PREDICTED_LATENCY_SLO

PREFIX_KEY = prefix_match_info_key("approx-prefix-cache-producer")
INFO_KEY = latency_prediction_info_key("predicted-latency-producer")


def train(producer: PredictedLatencyProducer, *, slow: str | None = None) -> None:
    """Feed the producer's estimator: TTFT = 20 ms + 0.1 ms per token of work, steps of 10 ms
    + 2 ms per running request, on pods f1-f3 and ``slow``, whose first tokens take three
    times as long (± 10 % on every pod)."""
    pods = ["f1:1", "f2:1", "f3:1", slow or "f4:1"]
    for i in range(200):
        work = (100, 1000, 4000, 16000)[i % 4]
        running = 1 + i % 5
        itl = 0.010 + 0.002 * running
        address = pods[(i // 4) % 4]
        ttft = (0.020 + 1e-4 * work) * (1.1 if (i // 16) % 2 else 0.9)
        if address == slow:
            ttft *= 3.0
        producer.rates.observe(
            work_tokens=work,
            in_flight=0,
            ttft_s=ttft,
            decode_s=itl * 10,
            output_tokens=11,
            running=running,
            endpoint=address,
        )
        producer.steps.observe(itl, running)
    assert producer.rates.rates() is not None


def producer(parameters: dict[str, Any] | None = None, **kwargs: Any) -> PredictedLatencyProducer:
    plugin: PredictedLatencyProducer = make(
        "predicted-latency-producer", parameters, name="predicted-latency-producer", **kwargs
    )
    return plugin


def with_prefix(req: LLMRequest, blocks: dict[str, int], total: int, block: int = 64) -> None:
    req.data[PREFIX_KEY] = PrefixMatchInfo(
        blocks, {a: float(n) for a, n in blocks.items()}, total, block
    )


def predict(
    plugin: PredictedLatencyProducer, req: LLMRequest, endpoints: list[Endpoint]
) -> dict[str, LatencyPredictionInfo]:
    asyncio.run(plugin.prepare(req, endpoints))
    return dict(plugin.predictions(req))


def prompt(tokens: int) -> str:
    return "x" * (4 * tokens)  # 4 characters per estimated token


# ---------------------------------------------------------------------------------------------
# The producer


def test_predicted_ttft_follows_cached_tokens_and_queued_work() -> None:
    plugin = producer()
    train(plugin)
    warm, cold, queued = endpoint("warm:1"), endpoint("cold:1"), endpoint("queued:1")
    queued.load.in_flight_prefill_tokens = 3000
    queued.load.in_flight_requests = 2
    req = request(prompt=prompt(4096))
    with_prefix(req, {"warm:1": 60}, total=64)  # 60 × 64 tokens held of 4096
    infos = predict(plugin, req, [warm, cold, queued])
    assert infos["warm:1"].ttft_ms < infos["cold:1"].ttft_ms < infos["queued:1"].ttft_ms
    rates = plugin.rates.rates()
    assert rates is not None
    # The estimate is ServiceRates' line at each pod's work: queued + uncached tokens.
    expected = {
        "warm:1": ServiceRates.predict_ttft(rates, 4096 - 60 * 64, 0),
        "cold:1": ServiceRates.predict_ttft(rates, 4096, 0),
        "queued:1": ServiceRates.predict_ttft(rates, 3000 + 4096, 2),
    }
    for address, seconds in expected.items():
        assert infos[address].ttft_ms == pytest.approx(1000 * seconds)
    # Published once for the consumers, under the producer's name.
    assert req.data[INFO_KEY] == infos


def test_predicted_ttft_follows_a_pods_learned_slowness() -> None:
    plugin = producer()
    train(plugin, slow="slow:1")
    assert plugin.rates.slowness("slow:1") > 1.5
    infos = predict(plugin, request(prompt=prompt(2000)), [endpoint("f1:1"), endpoint("slow:1")])
    assert infos["slow:1"].ttft_ms > 1.5 * infos["f1:1"].ttft_ms


def test_no_predictions_before_the_speeds_are_learned_or_when_turned_off() -> None:
    req = request(prompt=prompt(100))
    assert predict(producer(), req, [endpoint("a:1")]) == {}
    assert INFO_KEY not in req.data
    off = producer({"predictInProduce": False})
    train(off)
    assert predict(off, request(prompt=prompt(100)), [endpoint("a:1")]) == {}


def test_headroom_is_the_slo_minus_the_prediction_with_either_header_name() -> None:
    plugin = producer({"streamingMode": True})
    train(plugin)
    pods = [endpoint("a:1"), endpoint("b:1", in_flight=4)]
    pods[1].load.in_flight_requests = 4
    for ttft_header, tpot_header in (
        ("x-llm-d-slo-ttft-ms", "x-llm-d-slo-tpot-ms"),
        ("x-slo-ttft-ms", "x-slo-tpot-ms"),
    ):
        req = request(prompt=prompt(1000), headers={ttft_header: "500", tpot_header: "15"})
        infos = predict(plugin, req, pods)
        for info in infos.values():
            assert info.ttft_headroom_ms == pytest.approx(500 - info.ttft_ms)
            assert info.ttft_valid == (info.ttft_ms < 500)
            assert info.tpot_headroom_ms == pytest.approx(15 - info.tpot_ms)
        # More requests running there: longer steps, less TPOT headroom.
        assert 0 < infos["a:1"].tpot_ms < infos["b:1"].tpot_ms
        assert infos["a:1"].tpot_valid and not infos["b:1"].tpot_valid


def test_without_slo_headers_every_prediction_misses_its_zero_slo() -> None:
    plugin = producer({"streamingMode": True})
    train(plugin)
    info = predict(
        plugin, request(prompt=prompt(500), headers={"x-slo-ttft-ms": "soon"}), [endpoint("a:1")]
    )["a:1"]
    assert not info.ttft_valid and info.ttft_headroom_ms == pytest.approx(-info.ttft_ms)
    assert not info.tpot_valid and info.tpot_headroom_ms == pytest.approx(-info.tpot_ms)


def test_tpot_is_neutral_without_streaming_and_on_prefill_pods() -> None:
    headers = {"x-llm-d-slo-ttft-ms": "5000", "x-llm-d-slo-tpot-ms": "1"}
    for parameters, pod in (
        ({}, endpoint("a:1")),
        (
            {"streamingMode": True, "endpointRoleLabel": "llm-d.ai/role"},
            endpoint("a:1", labels={"llm-d.ai/role": "prefill"}),
        ),
    ):
        plugin = producer(parameters)
        train(plugin)
        info = predict(plugin, request(prompt=prompt(100), headers=headers), [pod])["a:1"]
        assert (info.tpot_valid, info.tpot_headroom_ms, info.tpot_ms) == (True, 0.0, 0.0)
        assert info.is_valid == info.ttft_valid


def test_the_tightest_running_tpot_slo_and_the_buffer_bound_the_budget() -> None:
    plugin = producer({"streamingMode": True, "sloBufferFactor": 0.5})
    info = plugin.judge(ttft_ms=10, tpot_ms=4, ttft_slo_ms=100, tpot_slo_ms=20)
    assert info.tpot_headroom_ms == pytest.approx(20 * 0.5 - 4)
    info = plugin.judge(
        ttft_ms=10, tpot_ms=4, ttft_slo_ms=100, tpot_slo_ms=20, tightest_tpot_slo_ms=6, dispatched=3
    )
    assert info.tpot_headroom_ms == pytest.approx(6 * 0.5 - 4) and not info.tpot_valid
    assert info.dispatched_requests == 3


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _route(
    plugin: PredictedLatencyProducer, clock: Clock, req: LLMRequest, target: Endpoint
) -> None:
    asyncio.run(plugin.prepare(req, [target]))
    plugin.pre_request(req, result_for(target))
    req.data[RESPONSE_TIMING] = ResponseTiming(routed_at=clock.now)


def test_the_producer_learns_from_the_answers_it_tracks() -> None:
    clock = Clock()
    ctx = PluginContext(endpoints=StaticEndpoints(), clock=clock, rng=random.Random(0))
    plugin = producer({"streamingMode": True, "contextTTL": 60_000_000_000}, ctx=ctx)
    pod = endpoint("a:1")
    for i in range(40):
        req = request(f"r{i}", prompt=prompt((100, 1000, 4000, 16000)[i % 4]), stream=True)
        _route(plugin, clock, req, pod)
        timing: ResponseTiming = req.data[RESPONSE_TIMING]
        timing.first_byte_at = clock.now + 0.02 + 1e-4 * req.prompt_tokens
        timing.finished_at = timing.first_byte_at + 0.1
        timing.running_while_decoding = 1.0 + i % 3
        plugin.response_complete(req, pod.address, Usage(completion_tokens=11))
    assert plugin.rates.rates() is not None
    assert plugin.steps.itl_s == pytest.approx(0.01)
    # A request still running counts as dispatched there, until it ends or contextTTL passes.
    long = request("long", prompt=prompt(100), stream=True)
    _route(plugin, clock, long, pod)
    assert (
        predict(plugin, request("next", prompt=prompt(100)), [pod])["a:1"].dispatched_requests == 1
    )
    clock.now += 61
    assert (
        predict(plugin, request("later", prompt=prompt(100)), [pod])["a:1"].dispatched_requests == 0
    )


@pytest.mark.parametrize(
    ("parameters", "message"),
    [
        ({"sloBufferFactor": 0}, "sloBufferFactor"),
        ({"contextTTL": "5m"}, "integer of nanoseconds"),
        ({"contextTTL": -1}, "contextTTL"),
        ({"useEncoderCacheFeatures": True}, "no such input"),
        ({"predictorUrl": "http://x"}, "predictorUrl"),
    ],
)
def test_bad_producer_parameters_are_errors(parameters: dict[str, Any], message: str) -> None:
    with pytest.raises(PluginConfigError, match=message):
        producer(parameters)


def test_upstreams_other_producer_parameters_are_accepted() -> None:
    plugin = producer(
        {
            "samplingMean": 50,
            "maxDecodeTokenSamplesForPrediction": 3,
            "contextTTL": 300_000_000_000,
            "encoderCacheMatchInfoProducerName": "mm",
            "prefixMatchInfoProducerName": "",
            "inFlightLoadProducerName": "",
        }
    )
    assert plugin.p.contextTTL == 300_000_000_000


def test_producer_names_must_name_declared_plugins() -> None:
    plugin = producer({"inFlightLoadProducerName": "load"})
    with pytest.raises(PluginConfigError, match="inFlightLoadProducerName 'load'"):
        plugin.bind({})
    plugin.bind({"load": make("inflight-load-producer", name="load")})
    scorer = make("latency-scorer", {"latencyPredictionInfoProducerName": "mine"})
    with pytest.raises(PluginConfigError, match="names no plugin"):
        scorer.bind({})
    with pytest.raises(PluginConfigError, match="names a queue-scorer"):
        scorer.bind({"mine": make("queue-scorer")})


# ---------------------------------------------------------------------------------------------
# The consumers, on predictions put in place


def info(
    ttft_headroom: float, tpot_headroom: float = 0.0, *, dispatched: int = 1
) -> LatencyPredictionInfo:
    return LatencyPredictionInfo(
        ttft_valid=ttft_headroom > 0,
        tpot_valid=tpot_headroom >= 0,
        ttft_headroom_ms=ttft_headroom,
        tpot_headroom_ms=tpot_headroom,
        ttft_ms=100.0,
        tpot_ms=10.0,
        dispatched_requests=dispatched,
    )


def predicted(infos: dict[str, LatencyPredictionInfo], **fields: Any) -> LLMRequest:
    req = request(**fields)
    req.data[INFO_KEY] = infos
    return req


PODS = [endpoint("a:1"), endpoint("b:1"), endpoint("c:1")]


def test_the_tier_filter_keeps_the_endpoints_meeting_the_slo() -> None:
    tier = make("slo-headroom-tier-filter")
    req = predicted({"a:1": info(50), "b:1": info(-5), "c:1": info(10, 2)})
    assert [e.address for e in tier.filter(req, PODS)] == ["a:1", "c:1"]
    # Only the negative tier, or none predicted: keep what there is.
    assert tier.filter(predicted({"a:1": info(-1), "b:1": info(-2)}), PODS) == PODS
    assert tier.filter(request(), PODS) == PODS
    # Exploration keeps the negative tier, which takes the endpoints without a prediction.
    explore = make("slo-headroom-tier-filter", {"epsilonExploreNeg": 1.0})
    assert [e.address for e in explore.filter(predicted({"a:1": info(5)}), PODS)] == [
        "b:1",
        "c:1",
    ]
    with pytest.raises(PluginConfigError, match="epsilonExploreNeg"):
        make("slo-headroom-tier-filter", {"epsilonExploreNeg": 1.5})


def test_the_scorer_packs_onto_the_least_headroom_or_spreads_to_the_most() -> None:
    # Headroom 10, 200, 400 ms: b is (200 − 10) / 390 of the way; hundredths, plus one.
    infos = {"a:1": info(10), "b:1": info(200), "c:1": info(400)}
    least = make("latency-scorer").score(predicted(infos), PODS)
    assert least == pytest.approx({"a:1": 1.0, "b:1": 0.52, "c:1": 0.01})
    most = make("latency-scorer", {"headroomSelectionStrategy": "most"}).score(
        predicted(infos), PODS
    )
    assert most == pytest.approx({"a:1": 0.01, "b:1": 0.49, "c:1": 1.0})
    # A pod missing the SLO scores 0 beside pods meeting it.
    mixed = make("latency-scorer").score(predicted({**infos, "c:1": info(-1)}), PODS)
    assert mixed["c:1"] == 0.0 and mixed["a:1"] > mixed["b:1"] > 0


def test_when_all_miss_the_scorer_prefers_idle_then_the_mildest_miss() -> None:
    scorer = make("latency-scorer")
    idle = {"a:1": info(-50), "b:1": info(-400, dispatched=0), "c:1": info(-10)}
    # A group of one has no spread: the middle score, 0.51, as upstream.
    assert scorer.score(predicted(idle), PODS) == {"a:1": 0.0, "b:1": 0.51, "c:1": 0.0}
    # TPOT missed only beats TTFT missed only, which beats both missed.
    buckets = {"a:1": info(-5, -5), "b:1": info(-50, 1), "c:1": info(5, -80)}
    assert scorer.score(predicted(buckets), PODS) == {"a:1": 0.0, "b:1": 0.0, "c:1": 0.51}
    both = {"a:1": info(-5, -1), "b:1": info(-50, -1), "c:1": info(-500, -1)}
    scores = scorer.score(predicted(both), PODS)
    assert scores["a:1"] > scores["b:1"] > scores["c:1"]


def test_the_scorer_falls_back_to_load_and_prefix_without_predictions() -> None:
    pods = [endpoint("a:1", waiting=4, kv=0.5), endpoint("b:1", waiting=0, kv=0.1)]
    req = request()
    with_prefix(req, {"a:1": 8}, total=8)
    scores = make("latency-scorer").score(req, pods)
    # a: (0.5 free + 0 queue + 1 prefix) / 3; b: (0.9 + 1 + 0) / 3, in hundredths.
    assert scores == {"a:1": 0.5, "b:1": 0.63}
    kv_only = make("latency-scorer", {"compositeQueueWeight": 0, "compositePrefixWeight": 0}).score(
        req, pods
    )
    assert kv_only == {"a:1": 0.5, "b:1": 0.9}


@pytest.mark.parametrize(
    ("parameters", "message"),
    [
        ({"ttftWeight": -1}, "ttftWeight"),
        ({"headroomSelectionStrategy": "middle"}, "headroomSelectionStrategy"),
        ({"compositeKVWeight": -0.5}, "compositeKVWeight"),
        ({"tpotweight": 1}, "tpotweight"),
    ],
)
def test_bad_scorer_parameters_are_errors(parameters: dict[str, Any], message: str) -> None:
    with pytest.raises(PluginConfigError, match=message):
        make("latency-scorer", parameters)


SLO = {"x-llm-d-slo-ttft-ms": "200"}


def busy(address: str) -> Endpoint:
    return endpoint(address, running=3, kv=0.5)


def test_the_admitter_drops_a_sheddable_request_no_endpoint_can_serve_in_time() -> None:
    admitter = make("latency-slo-admitter")
    pods = [busy("a:1"), busy("b:1")]
    late = {"a:1": info(-20), "b:1": info(-5)}
    assert admitter.admit(predicted(late, priority=-1, headers=SLO), pods) == DENIAL
    # Admitted: one endpoint valid, one idle, one cold, a request not sheddable, no SLO header,
    # no predictions.
    assert (
        admitter.admit(predicted({**late, "b:1": info(5)}, priority=-1, headers=SLO), pods) is None
    )
    for spare in (endpoint("b:1", running=0, kv=0.5), endpoint("b:1", running=3, kv=0.01)):
        assert admitter.admit(predicted(late, priority=-1, headers=SLO), [pods[0], spare]) is None
    assert admitter.admit(predicted(late, priority=0, headers=SLO), pods) is None
    assert admitter.admit(predicted(late, priority=-1), pods) is None
    assert admitter.admit(request(priority=-1, headers=SLO), pods) is None


# ---------------------------------------------------------------------------------------------
# Upstream's configuration


def test_upstreams_integration_config_loads_without_the_experimental_flag(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "predicted-latency-slo.yaml"
    path.write_text(UPSTREAM_CONFIG)
    assert main(["check-config", str(path)]) == 0
    out = capsys.readouterr()
    assert ": OK (" in out.out
    assert "ignor" not in (out.out + out.err).lower()


def test_the_loader_creates_the_prefix_producer_upstream_creates() -> None:
    config = resolve_config(parse_config(UPSTREAM_CONFIG))
    types = {spec.name: spec.type for spec in config.plugins}
    assert types["approx-prefix-cache-producer"] == "approx-prefix-cache-producer"
    # As upstream, the prefix-cache-scorer naming no producer reads the one created.
    (scorer,) = [s for s in config.plugins if s.type == "prefix-cache-scorer"]
    assert scorer.parameters["prefixMatchInfoProducerName"] == "approx-prefix-cache-producer"
    # A consumer naming no producer gets the default one created too.
    lone = resolve_config(
        parse_config(
            "apiVersion: llm-d.ai/v1alpha1\nkind: EndpointPickerConfig\n"
            "plugins:\n- type: latency-scorer\n"
        )
    )
    assert {"predicted-latency-producer", "approx-prefix-cache-producer"} <= {
        s.type for s in lone.plugins
    }
    with pytest.raises(ConfigError, match="latencyPredictionInfoProducerName 'nope'"):
        build_scheduler(
            parse_config(
                "apiVersion: llm-d.ai/v1alpha1\nkind: EndpointPickerConfig\nplugins:\n"
                "- type: latency-scorer\n  parameters: {latencyPredictionInfoProducerName: nope}\n"
            ),
            PluginContext(endpoints=StaticEndpoints()),
        )


def test_upstreams_config_schedules_on_learned_predictions(tmp_path: Path) -> None:
    path = tmp_path / "slo.yaml"
    path.write_text(UPSTREAM_CONFIG)
    fast, slow = (
        endpoint("10.0.0.1:8000", running=2, kv=0.3),
        endpoint("10.0.0.2:8000", running=2, kv=0.3),
    )
    slow.load.in_flight_prefill_tokens, slow.load.in_flight_requests = 60_000, 6
    ctx = PluginContext(endpoints=StaticEndpoints([fast, slow]), rng=random.Random(1))
    scheduler = build_scheduler(load_config(path), ctx)
    plugin = scheduler.plugin("predicted-latency-producer")
    assert isinstance(plugin, PredictedLatencyProducer)
    train(plugin)
    chosen = set()
    for i in range(20):
        req = request(
            f"r{i}",
            prompt=prompt(2000),
            priority=-1,
            headers={"x-llm-d-slo-ttft-ms": "1000", "x-llm-d-slo-tpot-ms": "100"},
        )
        result = asyncio.run(scheduler.schedule(req, [fast, slow]))
        chosen.add(result.targets[0].address)
        infos = req.data[INFO_KEY]
        assert infos[fast.address].is_valid and not infos[slow.address].is_valid
    assert chosen == {fast.address}  # the tier filter keeps the one meeting the SLO
    # A sheddable request neither pod can serve in time is shed: 429, upstream's message.
    tight = request("tight", prompt=prompt(2000), priority=-1, headers={"x-slo-ttft-ms": "1"})
    with pytest.raises(AdmissionDeniedError, match=DENIAL) as dropped:
        asyncio.run(scheduler.schedule(tight, [fast, slow]))
    assert dropped.value.http_status == 429
    assert math.isfinite(plugin.rates.slowness(fast.address))
