"""``endpoint-attribute-filter`` and ``endpoint-attribute-scorer`` (`scorers.endpoint_attribute`):
their parameters as llm-d-router validates them, each threshold operator, the missing-value
policies, both normalizations, and llm-d-router's ``deploy/config/sim-epp-gpu-config.yaml``
routing on GPU utilization published by a real ``dcgm-extractor``."""

from __future__ import annotations

import logging
import random
from collections.abc import Mapping, Sequence
from typing import Any

import pytest

from epp.config import ConfigError, build_scheduler, load_config
from scorers.base import Endpoint, PluginConfigError, PluginContext
from scorers.endpoint_attribute import CORE_METRICS_EXTRACTOR, DataKey, configured_key
from scorers.gpu_metrics import GPU_UTILIZATION_KEY, DcgmExtractor
from tests.scorers.plugin_helpers import StaticEndpoints, endpoint, make, request
from tests.support.llmd_samples import SIM_EPP_GPU_CONFIG

KEY = DataKey("queue_depth", "my-producer")


class Published:
    """An attribute producer whose values the test sets (what an extractor publishes)."""

    name = "my-producer"

    def __init__(self, values: Mapping[str, float], key: DataKey = KEY) -> None:
        self.values = dict(values)
        self.key = key

    def produced_keys(self) -> frozenset[DataKey]:
        return frozenset({self.key})

    def attribute(self, key: DataKey, endpoint: Endpoint) -> float | None:
        return self.values.get(endpoint.address) if key == self.key else None


A, B, C, MISSING = (endpoint(f"10.0.0.{i}:8000") for i in (1, 2, 3, 4))
FLEET = [A, B, C, MISSING]


def threshold_filter(
    operator: str = "LessThan",
    value: float = 10,
    values: Mapping[str, float] | None = None,
    **extra: Any,
) -> Any:
    params = {
        "attribute": "queue_depth",
        "producer": "my-producer",
        "algorithm": {"type": "threshold", "threshold": {"operator": operator, "value": value}},
        **extra,
    }
    plugin = make("endpoint-attribute-filter", params)
    default = {A.address: 5.0, B.address: 10.0, C.address: 15.0}
    plugin.bind({"my-producer": Published(default if values is None else values)})
    return plugin


def kept(plugin: Any, endpoints: Sequence[Endpoint] = FLEET) -> list[str]:
    return [e.address for e in plugin.filter(request(), endpoints)]


# ---------------------------------------------------------------------------------------------
# The filter


@pytest.mark.parametrize(
    ("operator", "survivors"),
    [
        ("LessThan", [A]),
        ("LessThanOrEqual", [A, B]),
        ("GreaterThan", [C]),
        ("GreaterThanOrEqual", [B, C]),
        ("Equal", [B]),
        ("NotEqual", [A, C]),
    ],
)
def test_each_operator_compares_the_value_with_the_threshold(
    operator: str, survivors: list[Endpoint]
) -> None:
    # onMissing: Fail, so only the comparison decides.
    plugin = threshold_filter(operator, 10, onMissing="Fail")
    assert kept(plugin) == [e.address for e in survivors]


@pytest.mark.parametrize("on_missing", ["Pass", "", None])
def test_an_endpoint_without_the_value_is_kept_by_default(on_missing: str | None) -> None:
    extra: dict[str, Any] = {} if on_missing is None else {"onMissing": on_missing}
    assert kept(threshold_filter("LessThan", 10, **extra)) == [A.address, MISSING.address]


def test_on_missing_fail_drops_an_endpoint_without_the_value() -> None:
    assert kept(threshold_filter("LessThan", 10, onMissing="Fail")) == [A.address]


def test_fallback_on_empty_gives_back_every_candidate() -> None:
    everyone_busy = {A.address: 50.0, B.address: 60.0}
    strict = threshold_filter("LessThan", 10, everyone_busy, onMissing="Fail")
    assert kept(strict, [A, B]) == []
    lenient = threshold_filter(
        "LessThan", 10, everyone_busy, onMissing="Fail", fallbackOnEmpty=True
    )
    assert kept(lenient, [A, B]) == [A.address, B.address]


def test_fallback_is_not_taken_when_something_survives() -> None:
    plugin = threshold_filter("LessThan", 10, onMissing="Fail", fallbackOnEmpty=True)
    assert kept(plugin) == [A.address]


def test_a_value_nobody_publishes_is_missing_and_said_once_at_load(
    caplog: pytest.LogCaptureFixture,
) -> None:
    plugin = make(
        "endpoint-attribute-filter",
        {
            "attribute": "num_requests_running",  # core-metrics-extractor's custom metric
            "onMissing": "Fail",
            "algorithm": {"type": "threshold", "threshold": {"operator": "LessThan", "value": 1}},
        },
    )
    with caplog.at_level(logging.WARNING, "scorers.endpoint_attribute"):
        plugin.bind({"my-producer": Published({A.address: 0.0})})
    assert "num_requests_running/core-metrics-extractor" in caplog.text
    assert kept(plugin) == []


def test_the_key_follows_upstreams_producer_rules() -> None:
    assert configured_key("GPUUtilization", "dcgm-extractor") == GPU_UTILIZATION_KEY
    assert configured_key("custom", None) == DataKey("custom", CORE_METRICS_EXTRACTOR)
    agnostic = configured_key("llm-d.ai/multicluster-queue-size", "")
    assert str(agnostic) == "llm-d.ai/multicluster-queue-size/"
    with pytest.raises(ValueError, match="write 'GPUUtilization' and producer 'dcgm-extractor'"):
        configured_key("GPUUtilization/dcgm-extractor", None)


def test_the_filter_reads_only_its_own_key() -> None:
    other = Published({A.address: 1.0}, key=DataKey("queue_depth", "someone-else"))
    plugin = threshold_filter("LessThan", 10, onMissing="Fail")
    plugin.bind({"other": other})
    assert kept(plugin) == []


FILTER_OK: dict[str, Any] = {
    "attribute": "x",
    "algorithm": {"type": "threshold", "threshold": {"operator": "LessThan", "value": 1}},
}


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"attribute": ""}, "parameters.attribute: String should have at least 1 character"),
        ({"attribute": None}, "parameters.attribute"),
        ({"onMissing": "Maybe"}, "parameters.onMissing: Input should be 'Pass', 'Fail' or ''"),
        ({"algorithm": {"type": "percentile"}}, "parameters.algorithm.type"),
        ({"algorithm": {"type": "threshold"}}, "algorithm.threshold is required"),
        (
            {"algorithm": {"type": "threshold", "threshold": {"operator": "Around", "value": 1}}},
            "parameters.algorithm.threshold.operator",
        ),
        (
            {"algorithm": {"type": "threshold", "threshold": {"operator": "Equal", "value": "1"}}},
            "parameters.algorithm.threshold.value: Input should be a valid number",
        ),
        ({"fallbackOnEmpty": "yes"}, "parameters.fallbackOnEmpty"),
        ({"attribute": "GPUUtilization/dcgm-extractor"}, "producer is not set"),
        ({"threshold": 1}, "parameters.threshold: Extra inputs are not permitted"),
    ],
)
def test_bad_filter_parameters_are_refused_naming_the_key(
    change: dict[str, Any], message: str
) -> None:
    params = {**FILTER_OK, **change}
    if change.get("attribute") is None and "attribute" in change:
        del params["attribute"]
    with pytest.raises(PluginConfigError) as err:
        make("endpoint-attribute-filter", params)
    assert message in str(err.value)


def test_a_missing_algorithm_is_refused() -> None:
    with pytest.raises(PluginConfigError, match=r"parameters\.algorithm: Field required"):
        make("endpoint-attribute-filter", {"attribute": "x"})


# ---------------------------------------------------------------------------------------------
# The scorer


def scorer(algorithm_type: str, values: Mapping[str, float], normalization: Any = None) -> Any:
    algorithm: dict[str, Any] = {"type": algorithm_type}
    if normalization is not None:
        algorithm["normalization"] = normalization
    plugin = make(
        "endpoint-attribute-scorer",
        {"attributeKey": "queue_depth", "producer": "my-producer", "algorithm": algorithm},
    )
    plugin.bind({"my-producer": Published(values)})
    return plugin


def scores(plugin: Any, endpoints: Sequence[Endpoint] = FLEET) -> list[float]:
    out = plugin.score(request(), endpoints)
    return [round(out[e.address], 6) for e in endpoints]


def test_fixed_range_is_linear_and_clamped() -> None:
    values = {A.address: 0.2, B.address: 0.5, C.address: 1.2, MISSING.address: -0.1}
    fixed = {"fixedRange": {"min": 0.0, "max": 1.0}}
    assert scores(scorer("linear_lower_is_better", values, fixed)) == [0.8, 0.5, 0.0, 1.0]
    assert scores(scorer("linear_higher_is_better", values, fixed)) == [0.2, 0.5, 1.0, 0.0]


def test_fixed_range_min_defaults_to_zero_as_gos_zero_value() -> None:
    values = {A.address: 2.0, B.address: 8.0}
    plugin = scorer("linear_higher_is_better", values, {"fixedRange": {"max": 10}})
    assert scores(plugin, [A, B]) == [0.2, 0.8]


@pytest.mark.parametrize("normalization", [None, {}, {"adaptiveRange": {}}])
def test_adaptive_range_spans_the_candidates_values(normalization: Any) -> None:
    values = {A.address: 2.0, B.address: 4.0, C.address: 6.0}
    lower = scorer("linear_lower_is_better", values, normalization)
    assert scores(lower) == [1.0, 0.5, 0.0, 0.0]  # the missing one scores 0, outside the range
    higher = scorer("linear_higher_is_better", values, normalization)
    assert scores(higher) == [0.0, 0.5, 1.0, 0.0]
    # The range is the candidates': without C, B is the worst.
    assert scores(lower, [A, B]) == [1.0, 0.0]


def test_adaptive_range_of_equal_values_is_neutral() -> None:
    plugin = scorer("linear_lower_is_better", {A.address: 3.0, B.address: 3.0})
    assert scores(plugin, [A, B, MISSING]) == [1.0, 1.0, 0.0]


def test_without_any_value_every_candidate_scores_zero() -> None:
    assert scores(scorer("linear_lower_is_better", {})) == [0.0, 0.0, 0.0, 0.0]


SCORER_OK: dict[str, Any] = {"attributeKey": "x", "algorithm": {"type": "linear_lower_is_better"}}


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"attributeKey": ""}, "parameters.attributeKey"),
        ({"algorithm": {"type": "linear"}}, "parameters.algorithm.type"),
        (
            {
                "algorithm": {
                    "type": "linear_lower_is_better",
                    "normalization": {"fixedRange": {"min": 0, "max": 1}, "adaptiveRange": {}},
                }
            },
            "at most one of fixedRange and adaptiveRange",
        ),
        (
            {
                "algorithm": {
                    "type": "linear_lower_is_better",
                    "normalization": {"fixedRange": {"min": 1, "max": 1}},
                }
            },
            "fixedRange needs min < max, got min 1.0, max 1.0",
        ),
        (
            {"algorithm": {"type": "linear_lower_is_better", "normalization": {"fixedRange": {}}}},
            "fixedRange needs min < max",
        ),
        (
            {
                "algorithm": {
                    "type": "linear_lower_is_better",
                    "normalization": {"percentile": {}},
                }
            },
            "parameters.algorithm.normalization.percentile: Extra inputs are not permitted",
        ),
        ({"attributeKey": "a/b"}, "producer is not set"),
        ({"attribute": "x"}, "parameters.attribute: Extra inputs are not permitted"),
    ],
)
def test_bad_scorer_parameters_are_refused_naming_the_key(
    change: dict[str, Any], message: str
) -> None:
    with pytest.raises(PluginConfigError) as err:
        make("endpoint-attribute-scorer", {**SCORER_OK, **change})
    assert message in str(err.value)


# ---------------------------------------------------------------------------------------------
# llm-d-router's GPU sample, scheduling on utilization a dcgm-extractor published


def sidecar_page(*percent: float) -> str:
    """A DCGM exporter sidecar's GPU-utilization family (labels as the exporter writes them)."""
    lines = [
        "# HELP DCGM_FI_DEV_GPU_UTIL GPU utilization (in %).",
        "# TYPE DCGM_FI_DEV_GPU_UTIL gauge",
    ]
    for gpu, value in enumerate(percent):
        lines.append(
            f'DCGM_FI_DEV_GPU_UTIL{{gpu="{gpu}",UUID="GPU-{gpu:08d}",device="nvidia{gpu}",'
            f'modelName="NVIDIA H100 80GB HBM3",Hostname="node-1"}} {value:g}'
        )
    return "\n".join(lines) + "\n"


def gpu_scheduler(fleet: Sequence[Endpoint]) -> Any:
    context = PluginContext(endpoints=StaticEndpoints(fleet), rng=random.Random(0))
    return build_scheduler(
        load_config(text=SIM_EPP_GPU_CONFIG), context, allow_experimental_plugins=True
    )


def publish(scheduler: Any, *utilization: tuple[Endpoint, Sequence[float]]) -> None:
    extractor = scheduler.plugin("dcgm-extractor")
    assert isinstance(extractor, DcgmExtractor)
    for ep, percent in utilization:
        extractor.extract(ep, sidecar_page(*percent))


def test_the_gpu_sample_needs_the_experimental_flag_as_upstream() -> None:
    context = PluginContext(endpoints=StaticEndpoints([]))
    with pytest.raises(ConfigError) as err:
        build_scheduler(load_config(text=SIM_EPP_GPU_CONFIG), context)
    for index, (name, kind) in enumerate(
        [
            ("dcgm-source", "dcgm-data-source"),
            ("dcgm-extractor", "dcgm-extractor"),
            ("gpu-utilization-filter", "endpoint-attribute-filter"),
            ("gpu-utilization-scorer", "endpoint-attribute-scorer"),
        ]
    ):
        assert f"plugins[{index}]: plugin {name!r} (type: {kind!r}) is Alpha" in str(err.value)


async def test_the_least_busy_gpu_wins_and_an_overloaded_one_is_filtered_out() -> None:
    idle, half, hot = (endpoint(f"10.0.1.{i}:8000") for i in (1, 2, 3))
    # The hot pod has the emptiest KV cache: only the GPU filter keeps it out.
    idle.metrics.kv_cache_usage, half.metrics.kv_cache_usage = 0.5, 0.1
    fleet = [idle, half, hot]
    scheduler = gpu_scheduler(fleet)
    publish(scheduler, (idle, [10, 20]), (half, [50]), (hot, [30, 95]))  # busiest GPU counts
    result = await scheduler.schedule(request(), fleet)
    assert result.targets[0].address == idle.address
    totals = result.profiles["default"].scores
    assert hot.address not in totals  # 0.95 > 0.90: filtered
    # gpu 2 × (1 − 0.2) + kv 1 × (1 − 0.5)  vs  2 × (1 − 0.5) + 1 × (1 − 0.1)
    assert totals[idle.address] == pytest.approx(2.1)
    assert totals[half.address] == pytest.approx(1.9)


async def test_when_every_gpu_is_overloaded_the_sample_falls_back_to_all() -> None:
    a, b = endpoint("10.0.1.1:8000", kv=0.9), endpoint("10.0.1.2:8000", kv=0.1)
    scheduler = gpu_scheduler([a, b])
    publish(scheduler, (a, [97]), (b, [99]))
    result = await scheduler.schedule(request(), [a, b])
    assert set(result.profiles["default"].scores) == {a.address, b.address}
    assert result.targets[0].address == b.address  # the KV scorer decides between them


async def test_a_pod_without_a_reading_passes_the_filter_but_scores_nothing_for_its_gpu() -> None:
    known, unknown = endpoint("10.0.1.1:8000"), endpoint("10.0.1.2:8000")
    scheduler = gpu_scheduler([known, unknown])
    publish(scheduler, (known, [60]))
    result = await scheduler.schedule(request(), [known, unknown])
    totals = result.profiles["default"].scores
    assert totals[known.address] == pytest.approx(2 * 0.4 + 1.0)
    assert totals[unknown.address] == pytest.approx(1.0)  # onMissing Pass; GPU score 0
    assert result.targets[0].address == known.address


def test_a_renamed_extractor_still_publishes_under_upstreams_fixed_key() -> None:
    text = SIM_EPP_GPU_CONFIG.replace("name: dcgm-extractor", "name: gpu-reader").replace(
        "- pluginRef: dcgm-extractor", "- pluginRef: gpu-reader"
    )
    context = PluginContext(endpoints=StaticEndpoints([]))
    scheduler = build_scheduler(load_config(text=text), context, allow_experimental_plugins=True)
    reader = scheduler.plugin("gpu-reader")
    assert isinstance(reader, DcgmExtractor)
    ep = endpoint("10.0.1.1:8000")
    reader.extract(ep, sidecar_page(95))
    gpu_filter: Any = scheduler.plugin("gpu-utilization-filter")
    assert gpu_filter.filter(request(), [ep]) == [ep]  # fallbackOnEmpty: one overloaded pod
    assert gpu_filter.value(ep) == pytest.approx(0.95)
