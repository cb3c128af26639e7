"""inflight-load-producer's output estimate (upstream inflightload/token_estimator_test.go,
producer_test.go) and what its consumers read: token-load-scorer, concurrency-detector,
prefix-cache-affinity-filter."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from epp.cli import main
from epp.config import ConfigError, build_scheduler, load_config
from epp.datastore import Datastore, EndpointSpec
from epp.director import Director
from scorers.base import (
    Endpoint,
    EndpointLoad,
    LLMRequest,
    NoEndpoints,
    PluginConfigError,
    PluginContext,
    ProfileResult,
    SchedulingResult,
)
from scorers.inflight_load import (
    InFlightLoadProducer,
    client_max_output_tokens,
    estimate_output_tokens,
)
from scorers.request_data import RESPONSE_TIMING, ResponseTiming
from tests.scorers.plugin_helpers import endpoint, make, request, result_for

ESTIMATING = {"addEstimatedOutputTokens": True}


def prompt(n: int, **fields: Any) -> LLMRequest:
    """A request whose prompt is ``n`` tokens, as a token producer leaves it."""
    return request(prompt_token_ids=list(range(n)), **fields)


def with_load(address: str, *, prefill: int = 0, kv: int = 0) -> Endpoint:
    ep = endpoint(address)
    ep.load = EndpointLoad(in_flight_prefill_tokens=prefill, in_flight_kv_tokens=kv)
    return ep


# ---------------------------------------------------------------------------------------------
# Parameters


def test_defaults_take_no_estimate() -> None:
    producer = make("inflight-load-producer")
    assert isinstance(producer, InFlightLoadProducer)
    assert (producer.estimates_output, producer.output_ratio) == (False, 1.5)
    assert producer.estimated_output(prompt(100)) == 0
    assert producer.experimental is False  # Beta upstream


@pytest.mark.parametrize(
    ("parameters", "message"),
    [
        ({"outputRatio": -1.0}, r"parameters\.outputRatio: .*must be non-negative, got -1"),
        ({"maxEstimatedOutputTokens": -1}, r"maxEstimatedOutputTokens: .*non-negative, got -1"),
        ({"addEstimatedOutputTokens": "true"}, r"parameters\.addEstimatedOutputTokens"),
        ({"outputRatio": "1.5"}, r"parameters\.outputRatio"),
        ({"maxEstimatedOutputTokens": 1.5}, r"parameters\.maxEstimatedOutputTokens"),
        # Upstream's prefix discount source is not offered here: the key is named.
        ({"prefixMatchInfoProducerName": "p"}, r"parameters\.prefixMatchInfoProducerName"),
    ],
)
def test_bad_parameters_are_refused(parameters: dict[str, Any], message: str) -> None:
    with pytest.raises(PluginConfigError, match=message):
        make("inflight-load-producer", parameters)


def test_ratio_cap_and_sync_flag_are_accepted() -> None:
    producer = make(
        "inflight-load-producer",
        {**ESTIMATING, "outputRatio": 2, "maxEstimatedOutputTokens": 40},
    )
    assert producer.estimated_output(prompt(10)) == 20
    assert producer.estimated_output(prompt(100)) == 40
    zero = make("inflight-load-producer", {**ESTIMATING, "outputRatio": 0.0})
    assert zero.estimated_output(prompt(100)) == 0
    make("inflight-load-producer", {"syncCrossReplicaState": False})


# ---------------------------------------------------------------------------------------------
# The estimate (TestSimpleTokenEstimator_EstimateOutput)


@pytest.mark.parametrize(
    ("ratio", "operator_cap", "prompt_tokens", "client_cap", "expected"),
    [
        (2.0, None, 0, None, 0),
        (2.0, None, -5, None, 0),
        (2.0, None, 8, None, 16),
        (0.0, None, 100, None, 0),
        (1.5, None, 100, 50, 50),
        (1.5, None, 100, 500, 150),
        (1.5, None, 100, 0, 0),
        (1.5, 40, 100, None, 40),
        (1.5, 80, 100, 30, 30),
        (1.5, 30, 100, 80, 30),
        (1.5, 500, 100, 500, 150),
        (1.5, None, 1, None, 2),  # round(1.5) = 2: Go rounds halves away from zero
        (1.5, None, 5, None, 8),  # round(7.5) = 8
        (0.5, None, 5, None, 3),  # round(2.5) = 3, not banker's 2
    ],
)
def test_estimate(
    ratio: float,
    operator_cap: int | None,
    prompt_tokens: int,
    client_cap: int | None,
    expected: int,
) -> None:
    assert estimate_output_tokens(prompt_tokens, ratio, client_cap, operator_cap) == expected


@pytest.mark.parametrize(
    ("kind", "body", "expected"),
    [
        ("chat", {"max_completion_tokens": 7, "max_tokens": 9}, 7),
        ("chat", {"max_completion_tokens": -1, "max_tokens": 9}, 9),  # invalid: the next key
        ("chat", {"max_completion_tokens": 2.5, "max_tokens": 9}, 9),
        ("chat", {"max_tokens": 12.0}, 12),
        ("chat", {"max_tokens": True}, None),
        ("chat", {"max_tokens": "12"}, None),
        ("chat", {}, None),
        ("completions", {"max_tokens": 0}, 0),
        ("completions", {"max_completion_tokens": 5}, None),  # not the completions API's key
        ("responses", {"max_output_tokens": 64}, 64),
        ("responses", {"max_tokens": 64}, None),
        ("messages", {"max_tokens": 1024}, 1024),
        ("embeddings", {"max_tokens": 5}, None),
        ("completions", {"token_ids": [1], "sampling_params": {"max_tokens": 33}}, 33),
        ("completions", {"input_ids": [1], "sampling_params": {"max_new_tokens": 44}}, 44),
        ("completions", {"input_ids": [1], "sampling_params": {"max_new_tokens": 44.0}}, None),
    ],
)
def test_client_cap_by_api(kind: str, body: dict[str, Any], expected: int | None) -> None:
    assert client_max_output_tokens(request(kind=kind, body=body)) == expected


def test_the_clients_cap_bounds_the_estimate() -> None:
    producer = make("inflight-load-producer", ESTIMATING)
    assert producer.estimated_output(prompt(10, kind="chat", body={"max_tokens": 3})) == 3
    assert producer.estimated_output(prompt(10, kind="chat")) == 15
    # Without token ids the prompt is 4 characters a token.
    assert producer.estimated_output(request(prompt="x" * 40)) == 15


# ---------------------------------------------------------------------------------------------
# Counting (TestInFlightLoadProducer_Lifecycle, _MultiPodLifecycle, _BalancedAddRelease)

A, B = endpoint("10.0.0.1:8000"), endpoint("10.0.0.2:8000")


def test_estimates_count_from_the_decision_to_the_end() -> None:
    producer = make("inflight-load-producer", ESTIMATING)
    first, second = prompt(4), prompt(10)
    producer.pre_request(first, result_for(A))
    producer.pre_request(second, result_for(A))
    assert producer.output_in_flight(A.address) == 6 + 15
    producer.response_complete(first, A.address, None)
    assert producer.output_in_flight(A.address) == 15
    producer.response_complete(first, A.address, None)  # twice: no double release
    producer.response_complete(second, A.address, None)
    assert producer.output_in_flight(A.address) == 0


def test_without_the_estimate_nothing_is_counted() -> None:
    producer = make("inflight-load-producer")
    producer.pre_request(prompt(100), result_for(A))
    assert producer.output_in_flight(A.address) == 0


def pd_result(prefill: Endpoint, decode: Endpoint, primary: str = "decode") -> SchedulingResult:
    return SchedulingResult(
        primary_profile=primary,
        profiles={
            "prefill": ProfileResult(targets=(prefill,), scores={}),
            "decode": ProfileResult(targets=(decode,), scores={}),
        },
    )


@pytest.mark.parametrize("primary", ["decode", "prefill"])
def test_the_prefill_profiles_share_goes_at_the_first_byte(primary: str) -> None:
    producer = make("inflight-load-producer", ESTIMATING)
    req = prompt(4)
    producer.pre_request(req, pd_result(A, B, primary))
    assert (producer.output_in_flight(A.address), producer.output_in_flight(B.address)) == (6, 6)
    timing = req.data[RESPONSE_TIMING] = ResponseTiming(routed_at=0.0)  # the director's
    assert producer.output_in_flight(A.address) == 6
    timing.first_byte_at = 0.5
    assert (producer.output_in_flight(A.address), producer.output_in_flight(B.address)) == (0, 6)
    producer.response_complete(req, B.address, None)
    assert (producer.output_in_flight(A.address), producer.output_in_flight(B.address)) == (0, 0)


def test_two_profiles_on_one_endpoint_count_twice_and_drain_to_zero() -> None:
    producer = make("inflight-load-producer", ESTIMATING)
    req = prompt(4)
    producer.pre_request(req, pd_result(A, A))
    assert producer.output_in_flight(A.address) == 12
    req.data[RESPONSE_TIMING] = ResponseTiming(routed_at=0.0, first_byte_at=0.1)
    assert producer.output_in_flight(A.address) == 6
    producer.response_complete(req, A.address, None)
    assert producer.output_in_flight(A.address) == 0


def test_a_response_ending_before_its_first_byte_releases_everything() -> None:
    producer = make("inflight-load-producer", ESTIMATING)
    req = prompt(4)
    producer.pre_request(req, pd_result(A, B))
    producer.response_complete(req, B.address, None)
    assert (producer.output_in_flight(A.address), producer.output_in_flight(B.address)) == (0, 0)


def test_a_recreated_endpoint_is_not_charged_for_its_predecessor() -> None:
    # TestInFlightLoadProducer_FlapDoesNotUnderflow: a late release of the old pod's request
    # must not take tokens off the new pod at the same address.
    producer = make("inflight-load-producer", ESTIMATING)
    old = prompt(10)
    producer.pre_request(old, result_for(A))
    producer.endpoint_removed(A)
    assert producer.output_in_flight(A.address) == 0
    producer.endpoint_added(A)
    new = prompt(4)
    producer.pre_request(new, result_for(A))
    producer.response_complete(old, A.address, None)
    assert producer.output_in_flight(A.address) == 6


# ---------------------------------------------------------------------------------------------
# Consumers


def bound(type_name: str, parameters: dict[str, Any], plugins: dict[str, object]) -> Any:
    consumer = make(type_name, parameters)
    consumer.bind(plugins)
    return consumer


def test_token_load_scorer_reads_the_estimate() -> None:
    producer = make("inflight-load-producer", ESTIMATING)
    producer.pre_request(prompt(100), result_for(A))  # 150 estimated output on A
    plugins = {"inflight-load-producer": producer}
    scorer = bound("token-load-scorer", {"queueThresholdTokens": 1000}, plugins)
    # A: 200 prompt tokens in flight (until the end) + 150 output + this request's 10 + 15.
    a, b = with_load(A.address, prefill=0, kv=200), with_load(B.address)
    scores = scorer.score(prompt(10), [a, b])
    assert scores[a.address] == pytest.approx(1 - (200 + 150 + 10 + 15) / 1000)
    assert scores[b.address] == pytest.approx(1 - 25 / 1000)
    # Without the estimate: the prefill tokens waiting for a first byte, and the prompt.
    plain = bound("token-load-scorer", {"queueThresholdTokens": 1000}, {})
    a.load.in_flight_prefill_tokens = 50
    assert plain.score(prompt(10), [a])[a.address] == pytest.approx(1 - 60 / 1000)


def test_unnamed_consumers_read_only_the_default_named_producer() -> None:
    other = make("inflight-load-producer", ESTIMATING, name="mine")
    other.pre_request(prompt(100), result_for(A))
    detector_params = {"concurrencyMode": "tokens", "maxTokenConcurrency": 1000}
    unnamed = bound("concurrency-detector", detector_params, {"mine": other})
    named = bound(
        "concurrency-detector",
        {**detector_params, "inFlightLoadProducerName": "mine"},
        {"mine": other},
    )
    a = with_load(A.address, kv=100)
    assert unnamed.saturation([a]) == pytest.approx(0.1)
    assert named.saturation([a]) == pytest.approx(0.25)  # 100 + 150 estimated


def test_concurrency_detector_filters_and_measures_with_the_estimate() -> None:
    producer = make("inflight-load-producer", ESTIMATING)
    producer.pre_request(prompt(400), result_for(A))  # 600 estimated on A
    detector = bound(
        "concurrency-detector",
        {"concurrencyMode": "hybrid", "maxConcurrency": 10, "maxTokenConcurrency": 1000},
        {"inflight-load-producer": producer},
    )
    a, b = with_load(A.address, kv=400), with_load(B.address, kv=400)
    assert detector.saturation([a, b]) == pytest.approx((1.0 + 0.4) / 2)
    assert [e.address for e in detector.filter(request(), [a, b])] == [B.address]


def test_prefix_affinity_filters_load_gate_reads_the_estimate() -> None:
    producer = make("inflight-load-producer", ESTIMATING)
    producer.pre_request(prompt(1000), result_for(A))
    gate = bound(
        "prefix-cache-affinity-filter",
        {"peakPrefillThroughput": 1000.0},
        {"inflight-load-producer": producer},
    )
    ttft = gate._ttft_ms(request())
    assert ttft(with_load(A.address, prefill=0, kv=1000)) == pytest.approx(2500.0)


def test_a_consumer_naming_no_declared_producer_is_refused() -> None:
    with pytest.raises(PluginConfigError, match="'x' names no declared inflight-load-producer"):
        bound("token-load-scorer", {"inFlightLoadProducerName": "x"}, {})


# ---------------------------------------------------------------------------------------------
# End to end: a configuration, the director's accounting

CONFIG = """\
apiVersion: llm-d.ai/v1alpha1
kind: EndpointPickerConfig
plugins:
- type: inflight-load-producer
  name: inflight-load
  parameters:
    addEstimatedOutputTokens: true
    outputRatio: 2
    maxEstimatedOutputTokens: 1000
- type: concurrency-detector
  parameters:
    concurrencyMode: tokens
    maxTokenConcurrency: 1000
    inFlightLoadProducerName: inflight-load
- type: token-load-scorer
  parameters:
    inFlightLoadProducerName: inflight-load
- type: max-score-picker
schedulingProfiles:
- name: default
  plugins:
  - pluginRef: token-load-scorer
  - pluginRef: max-score-picker
flowControl:
  saturationDetector:
    pluginRef: concurrency-detector
"""


def test_the_readme_example_loads(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "inflight-load.yaml"
    path.write_text(CONFIG)
    assert main(["check-config", str(path)]) == 0
    assert ": OK (" in capsys.readouterr().out
    bad = tmp_path / "bad.yaml"
    bad.write_text(CONFIG.replace("outputRatio: 2", "outputRatio: -2"))
    assert main(["check-config", str(bad)]) == 2
    assert "parameters.outputRatio" in capsys.readouterr().err


def test_a_bad_ratio_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="must be non-negative"):
        load_config(text=CONFIG.replace("outputRatio: 2", "outputRatio: -2"))


async def test_routed_requests_count_their_estimate_until_they_end() -> None:
    datastore = Datastore(staleness_threshold=None)
    datastore.upsert(EndpointSpec(address=A.address))
    context = PluginContext(endpoints=datastore)
    scheduler = build_scheduler(load_config(text=CONFIG), context)
    director = Director(datastore, scheduler)
    detector = scheduler.plugin("concurrency-detector")
    assert detector is not None
    pods = datastore.endpoints
    req = prompt(100, kind="completions", body={"max_tokens": 150})
    decision = await director.route(req, None)
    # 100 prompt tokens and min(200, 150) estimated output, over 1000.
    assert detector.saturation(pods()) == pytest.approx(0.25)  # type: ignore[attr-defined]
    director.response_chunk(decision)  # the first byte: the prompt still counts (KV held)
    assert detector.saturation(pods()) == pytest.approx(0.25)  # type: ignore[attr-defined]
    director.response_complete(decision, None, 200)
    assert detector.saturation(pods()) == 0.0  # type: ignore[attr-defined]


def test_the_producer_needs_no_endpoints_to_build() -> None:
    build_scheduler(load_config(text=CONFIG), PluginContext(endpoints=NoEndpoints()))
