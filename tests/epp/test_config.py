"""EndpointPickerConfig: both apiVersions, the defaults, and every error path."""

from __future__ import annotations

import logging
import textwrap
from pathlib import Path
from typing import Any

import pytest
from pydantic import BaseModel

from epp.config import (
    ConfigError,
    EndpointPickerConfig,
    PluginSpec,
    ProfilePluginRef,
    SchedulingProfileSpec,
    build_scheduler,
    load_config,
    plugin_roles,
)
from epp.scheduler import Scheduler
from scorers.base import Plugin, PluginContext, register
from scorers.load import QueueScorer
from scorers.pickers import MaxScorePicker
from scorers.precise_prefix import PrecisePrefixCacheScorer
from scorers.prefill_cost import PrefillCostScorer
from scorers.prefix_approx import PrefixCacheScorer
from scorers.profiles import SingleProfileHandler
from tests.scorers.plugin_helpers import context, endpoint, request
from tests.support.llmd_samples import EPP_PRECISE_PREFIX_CACHE_CONFIG, SIM_EPP_CONFIG

HEADER = "apiVersion: inference.networking.x-k8s.io/v1alpha1\nkind: EndpointPickerConfig\n"


def load(body: str, header: str = HEADER) -> EndpointPickerConfig:
    return load_config(text=header + textwrap.dedent(body))


def problems(body: str, header: str = HEADER) -> tuple[str, ...]:
    with pytest.raises(ConfigError) as info:
        load(body, header)
    return info.value.problems


def layout(config: EndpointPickerConfig) -> dict[str, list[tuple[str, float]]]:
    return {
        p.name: [(ref.pluginRef, ref.weight) for ref in p.plugins]
        for p in config.schedulingProfiles
    }


def types(config: EndpointPickerConfig) -> dict[str, str]:
    return {spec.name: spec.type for spec in config.plugins}


def queue_scorer_profile(*entries: str) -> str:
    """A config declaring queue-scorer, and one profile listing ``entries`` (YAML flow mappings)."""
    listed = "".join(f"  - {entry}\n" for entry in entries)
    return (
        "plugins:\n- type: queue-scorer\n"
        f"schedulingProfiles:\n- name: default\n  plugins:\n{listed}"
    )


# ------------------------------------------------------------------------------------------
# Loading and defaults


def test_no_file_gives_the_prefill_cost_default() -> None:
    """The default: the precise scorer as a data producer with predicted entries, and the
    prefill-cost scorer alone in the profile (docs/routing-results.md)."""
    config = load_config()
    assert layout(config) == {"default": [("prefill-cost-scorer", 1.0), ("max-score-picker", 1.0)]}
    assert types(config)["single-profile-handler"] == "single-profile-handler"
    assert types(config)["precise-prefix-cache-scorer"] == "precise-prefix-cache-scorer"
    scheduler = build_scheduler(config, context())
    assert isinstance(scheduler, Scheduler)
    assert scheduler.profile_names == ("default",)
    assert isinstance(scheduler.profile_handler, SingleProfileHandler)
    profile = scheduler.profiles["default"]
    assert [type(w.scorer) for w in profile.scorers] == [PrefillCostScorer]
    assert isinstance(profile.picker, MaxScorePicker)
    precise = scheduler.plugin("precise-prefix-cache-scorer")
    assert isinstance(precise, PrecisePrefixCacheScorer)
    assert precise.p.speculativeIndexing and precise.p.speculativeTTL == 2.0
    assert precise in scheduler.data_producers and precise in scheduler.pre_request_plugins


@pytest.mark.parametrize(
    "api_version", ["inference.networking.x-k8s.io/v1alpha1", "llm-d.ai/v1alpha1"]
)
def test_both_api_versions(api_version: str) -> None:
    config = load(
        "plugins:\n- type: queue-scorer\n",
        f"apiVersion: {api_version}\nkind: EndpointPickerConfig\n",
    )
    assert config.apiVersion == api_version


def test_load_from_a_file(tmp_path: Path) -> None:
    path = tmp_path / "epp.yaml"
    path.write_text(HEADER + "plugins:\n- type: random-picker\n")
    config = load_config(path)
    assert layout(config) == {"default": [("random-picker", 1.0)]}
    assert load_config(str(path)) == config


def test_no_profiles_means_one_default_profile_with_every_filter_scorer_picker() -> None:
    config = load(
        """
        plugins:
        - type: decode-filter
        - type: prefix-cache-scorer
          parameters: {blockSize: 32}
        - name: q
          type: queue-scorer
        - type: weighted-random-picker
        """
    )
    assert layout(config) == {
        "default": [
            ("decode-filter", 1.0),
            ("prefix-cache-scorer", 1.0),
            ("q", 1.0),
            ("weighted-random-picker", 1.0),
        ]
    }
    assert types(config)["single-profile-handler"] == "single-profile-handler"
    assert types(config)["q"] == "queue-scorer"


def test_profile_without_picker_gets_max_score_picker() -> None:
    config = load(
        """
        plugins:
        - type: queue-scorer
        schedulingProfiles:
        - name: main
          plugins:
          - pluginRef: queue-scorer
            weight: 0.5
        """
    )
    assert layout(config) == {"main": [("queue-scorer", 0.5), ("max-score-picker", 1.0)]}
    assert types(config) == {
        "queue-scorer": "queue-scorer",
        "max-score-picker": "max-score-picker",
        "single-profile-handler": "single-profile-handler",
    }


def test_declared_max_score_picker_is_reused_when_a_profile_lists_none() -> None:
    config = load(
        """
        plugins:
        - name: best
          type: max-score-picker
          parameters: {maxNumOfEndpoints: 3}
        - type: queue-scorer
        schedulingProfiles:
        - name: main
          plugins: [{pluginRef: queue-scorer}]
        """
    )
    assert layout(config) == {"main": [("queue-scorer", 1.0), ("best", 1.0)]}
    assert build_scheduler(config, context()).profiles["main"].picker.max_endpoints == 3


def test_same_type_twice_with_distinct_names() -> None:
    config = load(
        """
        plugins:
        - {name: short, type: prefix-cache-scorer, parameters: {blockSize: 16}}
        - {name: long, type: prefix-cache-scorer, parameters: {hashBlockSize: 256}}
        schedulingProfiles:
        - name: default
          plugins: [{pluginRef: short, weight: 1}, {pluginRef: long, weight: 2}]
        """
    )
    scheduler = build_scheduler(config, context())
    short, long = (w.scorer for w in scheduler.profiles["default"].scorers)
    assert isinstance(short, PrefixCacheScorer) and isinstance(long, PrefixCacheScorer)
    assert (short.block_size, long.block_size) == (16, 256)


def test_empty_lists_and_null_parameters_are_accepted() -> None:
    config = load("plugins:\n- type: queue-scorer\n  parameters:\nschedulingProfiles:\n")
    assert layout(config) == {"default": [("queue-scorer", 1.0), ("max-score-picker", 1.0)]}


def test_resolving_is_idempotent() -> None:
    config = load_config()
    scheduler = build_scheduler(config, context())  # resolves again
    assert len(scheduler.plugins) == len(config.plugins)


def test_inference_extension_helm_default_loads_unchanged(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """GIE-final `config/charts/epplib/templates/_config.yaml` (docs/design.md, "Configuration")."""
    with caplog.at_level(logging.WARNING):
        config = load(
            """
            plugins:
            - type: queue-scorer
            - type: kv-cache-utilization-scorer
            - type: prefix-cache-scorer
            - type: metrics-data-source
              parameters: { scheme: "http", path: "/metrics", insecureSkipVerify: true }
            - type: core-metrics-extractor
            schedulingProfiles:
            - name: default
              plugins:
              - pluginRef: queue-scorer
                weight: 2
              - pluginRef: kv-cache-utilization-scorer
                weight: 2
              - pluginRef: prefix-cache-scorer
                weight: 3
            """
        )
    assert layout(config) == {
        "default": [
            ("queue-scorer", 2.0),
            ("kv-cache-utilization-scorer", 2.0),
            ("prefix-cache-scorer", 3.0),
            ("max-score-picker", 1.0),
        ]
    }
    assert types(config)["single-profile-handler"] == "single-profile-handler"
    assert types(config)["metrics-data-source"] == "metrics-data-source"
    assert "ignoring" not in caplog.text  # built in here: declared, not dropped


def test_llm_d_style_config_with_old_names() -> None:
    """llm-d v0.3's precise example (docs/design.md, "Configuration") with the approximate
    scorer in place of the precise one: old type names, float weights, handler and picker
    declared."""
    config = load(
        """
        plugins:
          - type: single-profile-handler
          - type: decode-filter
          - type: prefix-cache-scorer
          - type: kv-cache-scorer # kv-cache-utilization
          - type: queue-scorer
          - type: max-score-picker
        schedulingProfiles:
          - name: default
            plugins:
              - pluginRef: decode-filter
              - pluginRef: prefix-cache-scorer
                weight: 2.0
              - pluginRef: kv-cache-scorer
                weight: 1.0
              - pluginRef: queue-scorer
                weight: 1.0
              - pluginRef: max-score-picker
        """,
        "apiVersion: llm-d.ai/v1alpha1\nkind: EndpointPickerConfig\n",
    )
    scheduler = build_scheduler(config, context())
    profile = scheduler.profiles["default"]
    assert [f.name for f in profile.filters] == ["decode-filter"]
    assert [(w.scorer.name, w.weight) for w in profile.scorers] == [
        ("prefix-cache-scorer", 2.0),
        ("kv-cache-scorer", 1.0),
        ("queue-scorer", 1.0),
    ]


def test_an_inline_saturation_detector_becomes_a_utilization_detector() -> None:
    # The Inference Extension v1.2-v1.4 wrote the detector's thresholds inline.
    config = load(
        """
        saturationDetector: {queueDepthThreshold: 7, metricsStalenessThreshold: 500ms}
        plugins:
        - type: queue-scorer
        """
    )
    assert layout(config)["default"][0] == ("queue-scorer", 1.0)
    assert config.saturation_detector == "utilization-detector"
    (detector,) = [p for p in config.plugins if p.type == "utilization-detector"]
    assert detector.parameters == {"queueDepthThreshold": 7, "metricsStalenessThreshold": "500ms"}
    assert problems(
        "saturationDetector: {pluginRef: d, kvCacheUtilThreshold: 0.9}\n"
        "plugins: [{type: utilization-detector, name: d}, {type: queue-scorer}]"
    ) == ("saturationDetector: give pluginRef or the thresholds (kvCacheUtilThreshold), not both",)


def test_feature_gates_are_llm_d_routers() -> None:
    config = load(
        "featureGates: [haPopulateNonLeaderDatastore=false]\nplugins: [{type: queue-scorer}]"
    )
    assert config.featureGates == ["haPopulateNonLeaderDatastore=false"]
    assert problems("featureGates: [prepareDataPlugins]\nplugins: [{type: queue-scorer}]") == (
        "featureGates[0]: feature gate 'prepareDataPlugins' is unknown; known: flowControl, "
        "haPopulateNonLeaderDatastore",
    )
    assert load("featureGates: [flowControl]\nplugins: [{type: queue-scorer}]").flow_control_enabled


def test_data_layer_sources_and_extractors_must_be_what_runs_here() -> None:
    declared = """
        plugins:
        - type: metrics-data-source
        - type: core-metrics-extractor
        - type: endpoint-notification-source
        - type: precise-prefix-cache-producer
        - type: queue-scorer
        """
    good = load(
        declared
        + """
        dataLayer:
          sources:
          - pluginRef: metrics-data-source
            extractors: [{pluginRef: core-metrics-extractor}]
          - pluginRef: endpoint-notification-source
            extractors: [{pluginRef: precise-prefix-cache-producer}]
        """
    )
    assert good.dataLayer is not None and len(good.dataLayer.sources) == 2
    assert problems(
        declared
        + """
        dataLayer:
          discovery: {pluginRef: file-discovery}
          sources:
          - pluginRef: metrics-data-source
            extractors: [{pluginRef: precise-prefix-cache-producer}]
          - pluginRef: queue-scorer
          - pluginRef: nowhere
        """
    ) == (
        "dataLayer.discovery: endpoints come from the InferencePool (--pool-name), --endpoints "
        "or --endpoints-file here",
        "dataLayer.sources[0].extractors[0].pluginRef: 'precise-prefix-cache-producer' "
        "(precise-prefix-cache-producer) does not read metrics-data-source; it reads: "
        "core-metrics-extractor",
        "dataLayer.sources[1].pluginRef: 'queue-scorer' (queue-scorer) is not a data source "
        "here; sources: metrics-data-source, endpoint-notification-source, dcgm-data-source, "
        "models-data-source",
        "dataLayer.sources[2].pluginRef: 'nowhere' is not a declared plugin",
    )
    (problem,) = problems("plugins:\n- type: metrics-data-source\n  parameters: {path: /stats}")
    assert problem.startswith("plugins[0].parameters.path:")


def test_request_handler_chooses_the_parsers() -> None:
    config = load(
        """
        plugins:
        - type: openai-parser
        - type: queue-scorer
        requestHandler:
          parsers: [{pluginRef: openai-parser}]
        """
    )
    assert config.parser_types == ("openai-parser",)
    assert load("plugins: [{type: queue-scorer}]").parser_types == (  # llm-d-router's defaults
        "openai-parser",
        "anthropic-parser",
        "vllmhttp-parser",
        "passthrough-parser",
    )
    deprecated = load(
        "plugins: [{type: passthrough-parser}, {type: queue-scorer}]\n"
        "parser: {pluginRef: passthrough-parser}"
    )
    assert deprecated.parser_types == ("passthrough-parser",)
    both = load(
        "plugins: [{type: openai-parser}, {type: passthrough-parser}, {type: queue-scorer}]\n"
        "requestHandler: {parsers: [{pluginRef: openai-parser}]}\n"
        "parser: {pluginRef: passthrough-parser}"
    )
    assert both.parser_types == ("openai-parser",)  # the new field wins, as upstream
    assert problems(
        "plugins: [{type: queue-scorer}]\nrequestHandler: {parsers: [{pluginRef: queue-scorer}]}"
    ) == (
        "requestHandler.parsers[0].pluginRef: 'queue-scorer' (queue-scorer) is not a parser; "
        "parsers: openai-parser, anthropic-parser, vllmhttp-parser, passthrough-parser, "
        "vllmgrpc-parser, sglanghttp-parser, vertexai-parser",
    )


def test_llm_d_router_split_precise_pipeline_loads_and_wires() -> None:
    """llm-d-router's deploy/config/epp-precise-prefix-cache-config.yaml shape (our copy):
    token-producer → precise-prefix-cache-producer → prefix-cache-scorer."""
    config = load(
        """
        plugins:
          - type: token-producer
            parameters:
              modelName: /models/llama
              vllm: {url: "http://localhost:8000"}
          - type: endpoint-notification-source
          - type: metrics-data-source
          - type: core-metrics-extractor
          - type: single-profile-handler
          - type: decode-filter
          - type: precise-prefix-cache-producer
            parameters:
              tokenProcessorConfig: {blockSize: 64, hashSeed: "42"}
              indexerConfig:
                kvBlockIndexConfig: {enableMetrics: true}
                kvCacheBackendConfigs: [{name: gpu, weight: 1.0}, {name: cpu, weight: 0.8}]
          - type: prefix-cache-scorer
            parameters:
              prefixMatchInfoProducerName: precise-prefix-cache-producer
          - type: kv-cache-utilization-scorer
          - type: queue-scorer
          - type: max-score-picker
        dataLayer:
          sources:
            - pluginRef: metrics-data-source
              extractors: [{pluginRef: core-metrics-extractor}]
            - pluginRef: endpoint-notification-source
              extractors: [{pluginRef: precise-prefix-cache-producer}]
        schedulingProfiles:
          - name: default
            plugins:
              - pluginRef: decode-filter
              - pluginRef: prefix-cache-scorer
                weight: 2.0
              - pluginRef: kv-cache-utilization-scorer
                weight: 1.0
              - pluginRef: queue-scorer
                weight: 1.0
              - pluginRef: max-score-picker
        """,
        "apiVersion: llm-d.ai/v1alpha1\nkind: EndpointPickerConfig\n",
    )
    producer = next(s for s in config.plugins if s.type == "precise-prefix-cache-producer")
    assert producer.parameters["tokenizer"] == "/models/llama"  # from the token producer
    scheduler = build_scheduler(config, context())
    view = scheduler.plugin("precise-prefix-cache-producer").view  # type: ignore[attr-defined]
    assert (view.settings.blockSize, view.settings.hashSeed) == (64, "42")
    assert view.settings.tierWeights == {"GPU": 1.0, "CPU": 0.8}
    assert problems(
        "plugins:\n- type: prefix-cache-scorer\n  parameters: {prefixMatchInfoProducerName: x}"
    ) == ("plugins[0].parameters.prefixMatchInfoProducerName: 'x' is not a declared plugin",)
    # llm-d's hashAlgorithm names its internal request-key hash: accepted, it has no
    # counterpart here (blocks are keyed by the pods' own hashes).
    load(
        "plugins:\n- type: precise-prefix-cache-producer\n  parameters:\n"
        "    tokenProcessorConfig: {hashAlgorithm: cbor-fnv}"
    )
    # Without profiles, the default one takes the scorers, not the producer (upstream's is a
    # data producer only): the prefix is weighed once.
    synthesized = load(
        """
        plugins:
        - type: precise-prefix-cache-producer
        - type: prefix-cache-scorer
          parameters: {prefixMatchInfoProducerName: precise-prefix-cache-producer}
        - type: queue-scorer
        """
    )
    assert [name for name, _ in layout(synthesized)["default"]] == [
        "prefix-cache-scorer",
        "queue-scorer",
        "max-score-picker",
    ]


async def test_built_scheduler_schedules() -> None:
    """Without a tokenizer the default degrades to least work: before the pods' speeds are
    learned, the pod whose requests in flight hold the least KV."""
    scheduler = build_scheduler(load_config(), context())
    eps = [endpoint("a:1", in_flight=3), endpoint("b:1", in_flight=0), endpoint("c:1", in_flight=1)]
    for ep in eps:
        ep.load.in_flight_kv_tokens = 500 * ep.load.in_flight_requests
    result = await scheduler.schedule(request(prompt="hello " * 40), eps)
    assert [e.address for e in result.targets] == ["b:1"]


def test_config_built_in_code_gets_defaults() -> None:
    config = EndpointPickerConfig(
        apiVersion="llm-d.ai/v1alpha1",
        kind="EndpointPickerConfig",
        plugins=[PluginSpec(name="q", type="queue-scorer")],
        schedulingProfiles=[
            SchedulingProfileSpec(name="p", plugins=[ProfilePluginRef(pluginRef="q", weight=2)])
        ],
    )
    scheduler = build_scheduler(config, context())
    assert isinstance(scheduler.profiles["p"].scorers[0].scorer, QueueScorer)
    assert isinstance(scheduler.profiles["p"].picker, MaxScorePicker)


def test_plugin_roles() -> None:
    assert plugin_roles(QueueScorer) == {"scorer"}
    assert plugin_roles(MaxScorePicker) == {"picker"}
    assert plugin_roles(SingleProfileHandler) == {"profile-handler"}
    assert plugin_roles(PrefixCacheScorer) == {"scorer"}


# ------------------------------------------------------------------------------------------
# Errors: one exception type, every problem with the path of the field


def test_yaml_syntax_error_gives_line_and_column() -> None:
    with pytest.raises(ConfigError) as info:
        load_config(text=HEADER + "plugins:\n- type: queue-scorer\n   name: x\n")
    (problem,) = info.value.problems
    assert problem == "YAML syntax error at line 5, column 8: mapping values are not allowed here"
    assert str(info.value).startswith("<config text>: invalid EndpointPickerConfig: YAML")


def test_duplicate_yaml_key_is_an_error() -> None:
    (problem,) = problems("plugins:\n- type: queue-scorer\n  type: kv-cache-scorer\n")
    assert problem == (
        "YAML syntax error at line 5, column 3: found duplicate key 'type' "
        "(while constructing a mapping)"
    )


def test_unknown_plugin_type() -> None:
    found = problems(
        "plugins:\n- type: queue-scorer\n- type: precise-prefix-cache-scorerz\n- type: zzz\n"
    )
    first, last = found
    assert first == (
        "plugins[1].type: unknown plugin type 'precise-prefix-cache-scorerz' (did you mean "
        "'precise-prefix-cache-scorer' or 'precise-prefix-cache-producer' or "
        "'prefix-cache-scorer'?)"
    )
    # The known types are listed once, on the last problem they explain.
    assert last.startswith("plugins[2].type: unknown plugin type 'zzz'; known types: ")
    assert "queue-scorer" in last


def test_bad_parameter_names_its_path() -> None:
    found = problems(
        """
        plugins:
        - type: queue-scorer
        - type: max-score-picker
        - type: load-aware-scorer
          parameters:
            threshold: 0
        """
    )
    assert found == ("plugins[2].parameters.threshold: Input should be greater than 0 (got 0)",)


def test_nested_parameter_errors_name_their_paths() -> None:
    found = problems(
        """
        plugins:
        - type: label-selector-filter
          parameters:
            matchExpressions:
            - {key: tier, operator: In}
            - {key: gpu, operator: Maybe}
            matchLabel: {a: b}
        """
    )
    assert found == (
        "plugins[0].parameters.matchExpressions[0]: operator In needs a non-empty 'values' list",
        "plugins[0].parameters.matchExpressions[1].operator: Input should be 'In', 'NotIn', "
        "'Exists' or 'DoesNotExist' (got 'Maybe')",
        "plugins[0].parameters.matchLabel: unknown key; expected one of: matchLabels, "
        "matchExpressions",
    )


def test_parameter_of_wrong_type() -> None:
    (problem,) = problems("plugins:\n- type: prefix-cache-scorer\n  parameters: {blockSize: big}\n")
    assert problem.startswith("plugins[0].parameters.blockSize: Input should be a valid integer")


def test_undeclared_plugin_ref() -> None:
    found = problems(queue_scorer_profile("{pluginRef: queue-scorer}", "{pluginRef: foo}"))
    assert found == (
        "schedulingProfiles[0].plugins[1].pluginRef: 'foo' is not a declared plugin; "
        "declared plugins: queue-scorer",
    )


def test_duplicate_plugin_names() -> None:
    found = problems(
        """
        plugins:
        - type: queue-scorer
        - type: kv-cache-scorer
        - type: queue-scorer
        """
    )
    assert found == (
        "plugins[2].name: duplicate plugin name 'queue-scorer' (also plugins[0]); give each "
        "instance of a type its own name",
    )


def test_negative_weight() -> None:
    found = problems(queue_scorer_profile("{pluginRef: queue-scorer, weight: -1}"))
    assert found == (
        "schedulingProfiles[0].plugins[0].weight: Input should be greater than or equal to 0 "
        "(got -1)",
    )


@pytest.mark.parametrize("weight", [".nan", ".inf", "heavy"])
def test_weight_must_be_a_finite_number(weight: str) -> None:
    found = problems(queue_scorer_profile(f"{{pluginRef: queue-scorer, weight: {weight}}}"))
    assert len(found) == 1
    assert found[0].startswith("schedulingProfiles[0].plugins[0].weight: ")


def test_unknown_keys_are_rejected_with_what_is_allowed() -> None:
    found = problems(
        """
        plugin:
        - type: queue-scorer
        plugins:
        - type: queue-scorer
          params: {}
        schedulingProfiles:
        - name: default
          plugins:
          - pluginRef: queue-scorer
            wieght: 2
        """
    )
    assert found == (
        "plugins[0].params: unknown key; expected one of: name, type, parameters",
        "schedulingProfiles[0].plugins[0].wieght: unknown key; expected one of: pluginRef, weight",
        "plugin: unknown key; expected one of: apiVersion, kind, plugins, schedulingProfiles, "
        "featureGates, dataLayer, requestHandler, parser, flowControl, saturationDetector",
    )


@pytest.mark.parametrize(
    ("header", "expected"),
    [
        (
            "apiVersion: v1\nkind: EndpointPickerConfig\n",
            "apiVersion: Input should be 'inference.networking.x-k8s.io/v1alpha1' or "
            "'llm-d.ai/v1alpha1' (got 'v1')",
        ),
        (
            "apiVersion: llm-d.ai/v1alpha1\nkind: InferencePool\n",
            "kind: Input should be 'EndpointPickerConfig' (got 'InferencePool')",
        ),
        ("kind: EndpointPickerConfig\n", "apiVersion: required field is missing"),
    ],
)
def test_api_version_and_kind(header: str, expected: str) -> None:
    assert problems("plugins: []\n", header) == (expected,)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("", "the document is empty"),
        ("# only a comment\n", "the document is empty"),
        ("- a\n- b\n", "the document must be a mapping"),
        ("plugins", "the document must be a mapping"),
    ],
)
def test_not_a_config_document(text: str, expected: str) -> None:
    with pytest.raises(ConfigError, match=expected):
        load_config(text=text)


def test_missing_file(tmp_path: Path) -> None:
    missing = tmp_path / "nope.yaml"
    with pytest.raises(ConfigError) as info:
        load_config(missing)
    assert str(info.value) == (
        f"{missing}: invalid EndpointPickerConfig: cannot read the file: No such file or directory"
    )


def test_file_errors_name_the_file(tmp_path: Path) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text(HEADER + "plugins:\n- type: nope\n")
    with pytest.raises(ConfigError, match=rf"^{path}: invalid EndpointPickerConfig: plugins\[0\]"):
        load_config(path)


def test_path_and_text_together() -> None:
    with pytest.raises(ConfigError, match="not both"):
        load_config("x.yaml", text=HEADER)


def test_every_problem_is_reported_at_once() -> None:
    with pytest.raises(ConfigError) as info:
        load(
            """
            plugins:
            - type: nope
            - type: load-aware-scorer
              parameters: {threshold: -3}
            - type: queue-scorer
            - {name: queue-scorer, type: kv-cache-scorer}
            schedulingProfiles:
            - name: default
              plugins: [{pluginRef: missing}]
            """
        )
    assert len(info.value.problems) == 4
    assert "(4 problems):\n  plugins[0].type" in str(info.value)


@pytest.mark.parametrize(
    ("profiles", "expected"),
    [
        pytest.param(
            "schedulingProfiles:\n- name: default\n"
            "  plugins: [{pluginRef: max-score-picker}, {pluginRef: random-picker}]\n",
            "schedulingProfiles[0].plugins: 2 pickers (max-score-picker, random-picker); a profile "
            "uses exactly one",
            id="in-a-profile",
        ),
        pytest.param(
            "",
            "schedulingProfiles: none given, so every declared filter, scorer and picker goes into "
            "one 'default' profile, but 2 pickers are declared (max-score-picker, random-picker); "
            "declare one picker or write the profiles",
            id="and-no-profiles",
        ),
    ],
)
def test_two_pickers(profiles: str, expected: str) -> None:
    plugins = "plugins:\n- type: max-score-picker\n- type: random-picker\n"
    assert problems(plugins + profiles) == (expected,)


def test_several_profiles_need_a_handler() -> None:
    profiles = (
        "schedulingProfiles:\n"
        "- {name: prefill, plugins: [{pluginRef: queue-scorer}]}\n"
        "- {name: decode, plugins: [{pluginRef: queue-scorer}]}\n"
    )
    assert problems("plugins: [{type: queue-scorer}]\n" + profiles) == (
        "plugins: 2 scheduling profiles need a profile handler to choose between them; "
        "declare one (single-profile-handler runs a single profile)",
    )
    with_handler = "plugins: [{type: queue-scorer}, {type: single-profile-handler}]\n" + profiles
    assert problems(with_handler) == (
        "schedulingProfiles: 2 profiles, but the profile handler 'single-profile-handler' "
        "(single-profile-handler) runs at most 1",
    )


@pytest.mark.parametrize(
    ("plugin_type", "why"),
    [
        (
            "single-profile-handler",
            "(single-profile-handler) is not a filter, scorer or picker, so it cannot be part of "
            "a profile; profile handlers are declared in plugins only",
        ),
        (
            "metrics-data-source",
            "(metrics-data-source) is not a filter, scorer or picker, so it cannot be part of a "
            "profile; it runs for every request once declared in plugins",
        ),
    ],
    ids=["profile-handler", "data-layer-plugin"],
)
def test_plugin_type_that_cannot_be_in_a_profile(plugin_type: str, why: str) -> None:
    (problem,) = problems(
        f"plugins:\n- type: {plugin_type}\n"
        f"schedulingProfiles:\n- name: default\n  plugins: [{{pluginRef: {plugin_type}}}]\n"
    )
    assert problem == f"schedulingProfiles[0].plugins[0].pluginRef: '{plugin_type}' {why}"


def test_two_profile_handlers() -> None:
    found = problems(
        """
        plugins:
        - type: single-profile-handler
        - {name: other, type: single-profile-handler}
        """
    )
    assert found == ("plugins: 2 profile handlers (single-profile-handler, other); declare one",)


def test_duplicate_profiles_and_refs() -> None:
    found = problems(
        """
        plugins:
        - type: queue-scorer
        - type: single-profile-handler
        schedulingProfiles:
        - name: default
          plugins: [{pluginRef: queue-scorer}, {pluginRef: queue-scorer, weight: 2}]
        - name: default
        """
    )
    assert found == (
        "schedulingProfiles[0].plugins[1].pluginRef: 'queue-scorer' is listed twice in this "
        "profile",
        "schedulingProfiles[1].name: duplicate profile name 'default' (also schedulingProfiles[0])",
    )


class _ExplodingParameters(BaseModel):
    pass


@register("test-exploding-scorer")
class _ExplodingScorer(Plugin[_ExplodingParameters]):
    def __init__(self, name: str, params: BaseModel, context: PluginContext) -> None:
        raise RuntimeError("no GPU today")

    def score(self, request: Any, endpoints: Any) -> dict[str, float]:
        return {}


def test_plugin_that_fails_to_start() -> None:
    config = load("plugins:\n- type: test-exploding-scorer\n")
    with pytest.raises(ConfigError, match=r"plugins\[0\] \(test-exploding-scorer .*no GPU today"):
        build_scheduler(config, context())


async def test_llm_d_router_approximate_producer_feeds_the_prefix_scorer() -> None:
    """llm-d-router's deploy/config/sim-epp-config.yaml (our copy): the scorer names no
    producer and reads the approximate one; a prompt routed once is found there again."""
    config = load_config(text=SIM_EPP_CONFIG)
    scorer = next(s for s in config.plugins if s.type == "prefix-cache-scorer")
    assert scorer.parameters["prefixMatchInfoProducerName"] == "approx-prefix-cache-producer"
    scheduler = build_scheduler(config, context())
    eps = [endpoint(f"10.0.0.{i}:8000") for i in (1, 2, 3)]
    prompt = "a long shared system prompt " * 40
    first = await scheduler.schedule(request(prompt=prompt + "first"), eps)
    holder = first.targets[0].address
    for i in range(5):
        again = await scheduler.schedule(request(prompt=prompt + f"follow-up {i}"), eps)
        assert again.targets[0].address == holder
    # No producer declared: the scorer keeps its own approximate index (the GIE's).
    standalone = load("plugins: [{type: prefix-cache-scorer}]")
    assert "prefixMatchInfoProducerName" not in standalone.plugins[0].parameters


def test_a_prefix_scorer_reading_a_producer_refuses_its_own_index_parameters() -> None:
    (problem,) = problems(
        """
        plugins:
        - type: approx-prefix-cache-producer
        - type: prefix-cache-scorer
          parameters: {lruCapacityPerServer: 100}
        """
    )
    assert problem.startswith("plugins[1].parameters: lruCapacityPerServer size the scorer's")
    # A producer under another name is not bound by default (upstream binds by name).
    config = load(
        "plugins: [{type: approx-prefix-cache-producer, name: mine}, {type: prefix-cache-scorer}]"
    )
    scorer = next(s for s in config.plugins if s.type == "prefix-cache-scorer")
    assert "prefixMatchInfoProducerName" not in scorer.parameters


def test_a_token_producer_nothing_reads_is_said_to_be_unused(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO)
    with_precise = EPP_PRECISE_PREFIX_CACHE_CONFIG
    approximate_only = SIM_EPP_CONFIG.replace(
        "plugins:\n", "plugins:\n- type: token-producer\n  parameters: {modelName: some/model}\n", 1
    )
    load_config(text=approximate_only)
    assert "no plugin of this configuration reads token ids" in caplog.text
    assert "some/model is not loaded" in caplog.text
    caplog.clear()
    load_config(text=with_precise)
    assert "prompts are tokenized in this EPP with hf-repo/model-name's tokenizer" in caplog.text
    assert "no plugin of this configuration reads token ids" not in caplog.text
