"""Our copies of the EndpointPickerConfigs of llm-d-router's end-to-end and performance tests:
every constant of ``test/e2e/configs_test.go`` (less ``kvConfig()`` and
``kvExternalTokenizerConfig()``, which format a port into their text), the one of
``test/coordinator/e2e/coordinator/configs_test.go`` that uses ``header-profile-handler``, and
the ``router.epp.pluginsCustomConfig`` of each Helm values file in
``test/perf/config/router-configs/`` (whose ``router.epp.flags`` are in `PERF_EPP_FLAGS`).  The
YAML is upstream's; the two ``requestHandler.parsers`` entries upstream ends with a space lose
it."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Final

# test/e2e/configs_test.go: simpleConfig
E2E_SIMPLE: Final = """\
apiVersion: llm-d.ai/v1alpha1
kind: EndpointPickerConfig
plugins:
- type: approx-prefix-cache-producer
  parameters:
    maxPrefixTokensToMatch: 16384
    lruCapacityPerServer: 256
- type: prefix-cache-scorer
- type: decode-filter
- type: max-score-picker
- type: single-profile-handler
schedulingProfiles:
- name: default
  plugins:
  - pluginRef: decode-filter
  - pluginRef: max-score-picker
  - pluginRef: prefix-cache-scorer
    weight: 2
"""

# test/e2e/configs_test.go: deprecatedPdConfig
E2E_DEPRECATED_PD: Final = """\
apiVersion: llm-d.ai/v1alpha1
kind: EndpointPickerConfig
plugins:
- type: prefill-header-handler
- type: approx-prefix-cache-producer
  parameters:
    blockSizeTokens: 16
    maxPrefixTokensToMatch: 16384
    lruCapacityPerServer: 256
- type: prefix-cache-scorer
- type: prefill-filter
- type: decode-filter
- type: max-score-picker
- type: prefix-based-pd-decider
  parameters:
    nonCachedTokens: 16
- type: pd-profile-handler
  parameters:
    deciderPluginName: prefix-based-pd-decider
schedulingProfiles:
- name: prefill
  plugins:
  - pluginRef: prefill-filter
  - pluginRef: max-score-picker
  - pluginRef: prefix-cache-scorer
    weight: 2
- name: decode
  plugins:
  - pluginRef: decode-filter
  - pluginRef: max-score-picker
  - pluginRef: prefix-cache-scorer
    weight: 2
"""

# test/e2e/configs_test.go: epdEncodeDecodeConfig
E2E_EPD_ENCODE_DECODE: Final = """\
apiVersion: llm-d.ai/v1alpha1
kind: EndpointPickerConfig
plugins:
- type: encode-filter
- type: decode-filter
- type: max-score-picker
- type: disagg-profile-handler
  parameters:
    deciders:
      encode: always-disagg-multimodal-decider
- type: always-disagg-multimodal-decider
schedulingProfiles:
- name: encode
  plugins:
  - pluginRef: encode-filter
- name: decode
  plugins:
  - pluginRef: decode-filter
"""

# test/e2e/configs_test.go: epdConfig
E2E_EPD: Final = """\
apiVersion: llm-d.ai/v1alpha1
kind: EndpointPickerConfig
plugins:
- type: encode-filter
- type: prefill-filter
- type: decode-filter
- type: approx-prefix-cache-producer
  parameters:
    blockSizeTokens: 16
    maxPrefixTokensToMatch: 16384
    lruCapacityPerServer: 256
- type: prefix-cache-scorer
- type: max-score-picker
- type: disagg-profile-handler
  parameters:
    deciders:
      encode: always-disagg-multimodal-decider
      prefill: prefix-based-pd-decider
- type: always-disagg-multimodal-decider
- type: prefix-based-pd-decider
  parameters:
    nonCachedTokens: 16
schedulingProfiles:
- name: encode
  plugins:
  - pluginRef: encode-filter
- name: prefill
  plugins:
  - pluginRef: prefill-filter
  - pluginRef: max-score-picker
  - pluginRef: prefix-cache-scorer
    weight: 2
- name: decode
  plugins:
  - pluginRef: decode-filter
  - pluginRef: max-score-picker
  - pluginRef: prefix-cache-scorer
    weight: 2
"""

# test/e2e/configs_test.go: generateEncodeConfig
E2E_GENERATE_ENCODE: Final = """\
apiVersion: llm-d.ai/v1alpha1
kind: EndpointPickerConfig
plugins:
- type: vllmhttp-parser
- type: encode-filter
- type: max-score-picker
- type: single-profile-handler
requestHandler:
  parsers:
   - pluginRef: vllmhttp-parser
schedulingProfiles:
- name: default
  plugins:
  - pluginRef: encode-filter
  - pluginRef: max-score-picker
"""

# test/e2e/configs_test.go: generatePrefillConfig
E2E_GENERATE_PREFILL: Final = """\
apiVersion: llm-d.ai/v1alpha1
kind: EndpointPickerConfig
plugins:
- type: vllmhttp-parser
- type: prefill-filter
- type: max-score-picker
- type: single-profile-handler
requestHandler:
  parsers:
   - pluginRef: vllmhttp-parser
schedulingProfiles:
- name: default
  plugins:
  - pluginRef: prefill-filter
  - pluginRef: max-score-picker
"""

# test/e2e/configs_test.go: pdConfig
E2E_PD: Final = """\
apiVersion: llm-d.ai/v1alpha1
kind: EndpointPickerConfig
plugins:
- type: vllmhttp-parser
- type: approx-prefix-cache-producer
  parameters:
    blockSizeTokens: 16
    maxPrefixTokensToMatch: 16384
    lruCapacityPerServer: 256
- type: prefix-cache-scorer
- type: prefill-filter
- type: decode-filter
- type: max-score-picker
- type: prefix-based-pd-decider
  parameters:
    nonCachedTokens: 16
- type: disagg-profile-handler
  parameters:
    deciders:
      prefill: prefix-based-pd-decider
schedulingProfiles:
- name: prefill
  plugins:
  - pluginRef: prefill-filter
  - pluginRef: max-score-picker
  - pluginRef: prefix-cache-scorer
    weight: 2
- name: decode
  plugins:
  - pluginRef: decode-filter
  - pluginRef: max-score-picker
  - pluginRef: prefix-cache-scorer
    weight: 2
"""

# test/e2e/configs_test.go: decodeOnlyConfig
E2E_DECODE_ONLY: Final = """\
apiVersion: llm-d.ai/v1alpha1
kind: EndpointPickerConfig
plugins:
- type: approx-prefix-cache-producer
  parameters:
    maxPrefixTokensToMatch: 16384
    lruCapacityPerServer: 256
- type: prefix-cache-scorer
- type: encode-filter
- type: prefill-filter
- type: decode-filter
- type: max-score-picker
- type: disagg-profile-handler
schedulingProfiles:
- name: decode
  plugins:
  - pluginRef: decode-filter
  - pluginRef: max-score-picker
  - pluginRef: prefix-cache-scorer
    weight: 2
"""

# test/e2e/configs_test.go: scaleConfig
E2E_SCALE: Final = """\
apiVersion: llm-d.ai/v1alpha1
kind: EndpointPickerConfig
plugins:
- type: max-score-picker
- type: single-profile-handler
schedulingProfiles:
- name: default
  plugins:
  - pluginRef: max-score-picker
"""

# test/e2e/configs_test.go: dataParallelConfig
E2E_DATA_PARALLEL: Final = """\
apiVersion: llm-d.ai/v1alpha1
kind: EndpointPickerConfig
plugins:
- type: decode-filter
- type: max-score-picker
- type: data-parallel-profile-handler
schedulingProfiles:
- name: default
  plugins:
  - pluginRef: decode-filter
  - pluginRef: max-score-picker
"""

# test/coordinator/e2e/coordinator/configs_test.go: eppConfig
COORDINATOR_EPP: Final = """\
apiVersion: llm-d.ai/v1alpha1
kind: EndpointPickerConfig
plugins:
- type: openai-parser
- type: vllmhttp-parser
- type: encode-filter
- type: prefill-filter
- type: label-selector-filter
  name: decode-filter
  parameters:
    matchExpressions:
    - key: llm-d.ai/role
      operator: In
      values: ["decode", "prefill-decode", "both", "encode-prefill-decode"]
- type: queue-scorer
- type: max-score-picker
- type: header-profile-handler
requestHandler:
  parsers:
  - pluginRef: openai-parser
  - pluginRef: vllmhttp-parser
schedulingProfiles:
- name: encode
  plugins:
  - pluginRef: encode-filter
  - pluginRef: max-score-picker
- name: prefill
  plugins:
  - pluginRef: prefill-filter
  - pluginRef: queue-scorer
    weight: 1
  - pluginRef: max-score-picker
- name: decode
  plugins:
  - pluginRef: decode-filter
  - pluginRef: queue-scorer
    weight: 1
  - pluginRef: max-score-picker
"""

# test/perf/config/router-configs/optimized-baseline.yaml: router.epp.pluginsCustomConfig["optimized-baseline-plugins.yaml"]
PERF_OPTIMIZED_BASELINE: Final = """\
apiVersion: llm-d.ai/v1alpha1
kind: EndpointPickerConfig
plugins:
- type: queue-scorer
- type: kv-cache-utilization-scorer
- type: approx-prefix-cache-producer
  parameters:
    maxPrefixTokensToMatch: 100000
- type: prefix-cache-scorer
- type: no-hit-lru-scorer
schedulingProfiles:
- name: default
  plugins:
  - pluginRef: queue-scorer
    weight: 2
  - pluginRef: kv-cache-utilization-scorer
    weight: 2
  - pluginRef: prefix-cache-scorer
    weight: 3
  - pluginRef: no-hit-lru-scorer
    weight: 2
"""

# test/perf/config/router-configs/precise-prefix.yaml: router.epp.pluginsCustomConfig["precise-baseline-plugins.yaml"]
PERF_PRECISE_PREFIX: Final = """\
apiVersion: llm-d.ai/v1alpha1
kind: EndpointPickerConfig
plugins:
  - type: token-producer
    parameters:
      modelName: Qwen/Qwen3-8B
      vllm:
        url: "http://localhost:8000"
  - type: endpoint-notification-source
  - type: precise-prefix-cache-producer
    parameters:
      tokenProcessorConfig:
        blockSizeTokens: 16
      speculativeIndexing: true
      indexerConfig:
        kvBlockIndexConfig:
          enableMetrics: true
      kvEventsConfig:
        topicFilter: "kv@"
        concurrency: 32
        discoverPods: true
        podDiscoveryConfig:
          socketPort: 5557
  - type: prefix-cache-scorer
    parameters:
      prefixMatchInfoProducerName: precise-prefix-cache-producer
  - type: kv-cache-utilization-scorer
  - type: active-request-scorer
  - type: no-hit-lru-scorer
    parameters:
      prefixMatchInfoProducerName: precise-prefix-cache-producer
dataLayer:
  sources:
    - pluginRef: endpoint-notification-source
      extractors:
        - pluginRef: precise-prefix-cache-producer
schedulingProfiles:
  - name: default
    plugins:
      - pluginRef: active-request-scorer
        weight: 4
      - pluginRef: kv-cache-utilization-scorer
        weight: 2
      - pluginRef: prefix-cache-scorer
        weight: 2
      - pluginRef: no-hit-lru-scorer
        weight: 2
"""

# test/perf/config/router-configs/random-only-default-parsers.yaml: router.epp.pluginsCustomConfig["optimized-baseline-plugins.yaml"]
PERF_RANDOM_ONLY_DEFAULT_PARSERS: Final = """\
apiVersion: llm-d.ai/v1alpha1
kind: EndpointPickerConfig
plugins:
- type: random-picker
schedulingProfiles:
- name: default
  plugins:
  - pluginRef: random-picker
"""

# test/perf/config/router-configs/random-passthrough-parser.yaml: router.epp.pluginsCustomConfig["optimized-baseline-plugins.yaml"]
PERF_RANDOM_PASSTHROUGH_PARSER: Final = """\
apiVersion: llm-d.ai/v1alpha1
kind: EndpointPickerConfig
plugins:
- type: random-picker
- type: passthrough-parser
requestHandler:
  parsers:
  - pluginRef: passthrough-parser
schedulingProfiles:
- name: default
  plugins:
  - pluginRef: random-picker
"""

# test/perf/config/router-configs/*.yaml: router.epp.flags, by file
PERF_EPP_FLAGS: Final[Mapping[str, Mapping[str, object]]] = {
    "optimized-baseline": {"v": 4, "enable-pprof": "true", "tracing": "false"},
    "precise-prefix": {
        "v": 4,
        "health-checking": True,
        "enable-pprof": "true",
        "ha-enable-leader-election": False,
    },
    "random-only-default-parsers": {"v": 4, "enable-pprof": "true", "tracing": "false"},
    "random-passthrough-parser": {"v": 4, "enable-pprof": "true", "tracing": "false"},
}
