"""Our copies of llm-d-router's ``deploy/config/`` sample EndpointPickerConfigs that the tests
load unchanged (header comments left out where noted), in one place."""

from __future__ import annotations

from typing import Final

# deploy/config/pd-epp-config.yaml
PD_EPP_CONFIG: Final = """\
# Sample EPP configuration for running with P/D
apiVersion: llm-d.ai/v1alpha1
kind: EndpointPickerConfig
plugins:
- type: approx-prefix-cache-producer
  parameters:
    maxPrefixTokensToMatch: 16384
    lruCapacityPerServer: 31250
- type: prefix-cache-scorer
- type: queue-scorer
- type: prefill-filter
- type: decode-filter
- type: max-score-picker
- type: disagg-profile-handler
  parameters:
    deciders:
      prefill: prefix-based-pd-decider
- type: prefix-based-pd-decider
  parameters:
    nonCachedTokens: 16
schedulingProfiles:
- name: prefill
  plugins:
  - pluginRef: prefill-filter
  - pluginRef: max-score-picker
  - pluginRef: prefix-cache-scorer
    weight: 2
  - pluginRef: queue-scorer
    weight: 1
- name: decode
  plugins:
  - pluginRef: decode-filter
  - pluginRef: max-score-picker
  - pluginRef: prefix-cache-scorer
    weight: 2
  - pluginRef: queue-scorer
    weight: 1
"""

# deploy/config/sim-e-p-d-epp-config.yaml
SIM_E_P_D_EPP_CONFIG: Final = """\
# Sample EPP configuration for running with E/P/D
apiVersion: llm-d.ai/v1alpha1
kind: EndpointPickerConfig
plugins:
- type: queue-scorer
- type: encode-filter
- type: prefill-filter
- type: decode-filter
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
  - pluginRef: queue-scorer
    weight: 1
- name: decode
  plugins:
  - pluginRef: decode-filter
  - pluginRef: queue-scorer
    weight: 1
"""

# deploy/config/pd-topology-epp-config.yaml (comments left out)
PD_TOPOLOGY_EPP_CONFIG: Final = """\
apiVersion: llm-d.ai/v1alpha1
kind: EndpointPickerConfig
plugins:
- type: approx-prefix-cache-producer
  parameters:
    maxPrefixTokensToMatch: 16384
    lruCapacityPerServer: 31250
- type: prefix-cache-scorer
- type: queue-scorer
- type: prefill-filter
- type: decode-filter
- type: max-score-picker
- type: topology-extractor
- type: topology-affinity-filter
- type: topology-affinity-scorer
- type: disagg-profile-handler
  parameters:
    deciders:
      prefill: prefix-based-pd-decider
- type: prefix-based-pd-decider
  parameters:
    nonCachedTokens: 16
schedulingProfiles:
- name: prefill
  plugins:
  - pluginRef: prefill-filter
  - pluginRef: topology-affinity-filter
  - pluginRef: max-score-picker
  - pluginRef: prefix-cache-scorer
    weight: 2
  - pluginRef: queue-scorer
    weight: 1
  - pluginRef: topology-affinity-scorer
    weight: 1
- name: decode
  plugins:
  - pluginRef: decode-filter
  - pluginRef: max-score-picker
  - pluginRef: prefix-cache-scorer
    weight: 2
  - pluginRef: queue-scorer
    weight: 1
"""

# deploy/config/probabilistic-admitter-epp-config.yaml (comments left out)
PROBABILISTIC_ADMITTER_EPP_CONFIG: Final = """\
apiVersion: inference.networking.x-k8s.io/v1alpha1
kind: EndpointPickerConfig
plugins:
- type: probabilistic-admitter
- type: random-picker
- type: utilization-detector
  parameters:
    queueDepthThreshold: 999999999
    kvCacheUtilThreshold: 1.0
flowControl:
  saturationDetector:
    pluginRef: utilization-detector
schedulingProfiles:
- name: default
  plugins:
  - pluginRef: random-picker
"""

# deploy/config/dp-epp-config.yaml
DP_EPP_CONFIG: Final = """\
# Sample EPP configuration for running with Data Parallel
#
apiVersion: llm-d.ai/v1alpha1
kind: EndpointPickerConfig
plugins:
- type: prefix-cache-scorer
- type: decode-filter
- type: max-score-picker
- type: data-parallel-profile-handler
  parameters:
    primaryPort: 8000
schedulingProfiles:
- name: default
  plugins:
  - pluginRef: decode-filter
  - pluginRef: max-score-picker
  - pluginRef: prefix-cache-scorer
    weight: 2
"""

# deploy/config/sim-pd-epp-config.yaml
SIM_PD_EPP_CONFIG: Final = """\
# Sample EPP configuration for tunning with P/D
# Use with small hash block size for simulation purposes
apiVersion: llm-d.ai/v1alpha1
kind: EndpointPickerConfig
plugins:
- type: approx-prefix-cache-producer
  parameters:
    blockSizeTokens: 16
    autoTune: false
    maxPrefixTokensToMatch: 16384
    lruCapacityPerServer: 31250
- type: prefix-cache-scorer
- type: queue-scorer
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
  - pluginRef: queue-scorer
    weight: 1
- name: decode
  plugins:
  - pluginRef: decode-filter
  - pluginRef: max-score-picker
  - pluginRef: prefix-cache-scorer
    weight: 2
  - pluginRef: queue-scorer
    weight: 1
"""

# deploy/config/sim-e-pd-epp-config.yaml
SIM_E_PD_EPP_CONFIG: Final = """\
# EPP configuration for E/PD (encode + prefill-decode) using disagg-profile-handler.
# The encode stage is triggered only for multimodal requests (image_url / video_url / input_audio).
apiVersion: llm-d.ai/v1alpha1
kind: EndpointPickerConfig
plugins:
- type: encode-filter
- type: decode-filter
- type: max-score-picker
- type: always-disagg-multimodal-decider
- type: disagg-profile-handler
  parameters:
    deciders:
      encode: always-disagg-multimodal-decider
schedulingProfiles:
- name: encode
  plugins:
  - pluginRef: encode-filter
- name: decode
  plugins:
  - pluginRef: decode-filter
"""

# deploy/config/epp-burst-prefix-cache-config.yaml
EPP_BURST_PREFIX_CACHE_CONFIG: Final = """\
# Sample EPP config: burst prefix cache pipeline
#   token-producer -> burst-prefix-cache-producer -> prefix-cache-scorer
#
# Co-locates bursts of prompt-sharing requests (e.g. RL rollout group samples)
# onto shared replicas so a shared prefix is prefilled once instead of scattered
# across replicas on a cold cache.
apiVersion: llm-d.ai/v1alpha1
kind: EndpointPickerConfig
plugins:
  - type: token-producer
    parameters:
      modelName: hf-repo/model-name           # set to the model used in the vLLM deployment
      vllm:
        url: http://<vllm-service>.<namespace>.svc.cluster.local:8000
  - type: single-profile-handler
  - type: decode-filter
  - type: burst-prefix-cache-producer
    parameters:
      windowDurationMs: 100       # batch window T
      maxPerReplica: -1           # k; -1 sends all samples of a group to one replica
      minColocateBlocks: 0        # >0 co-locates distinct groups sharing >= N leading blocks; 0 = load-balanced
  - type: prefix-cache-scorer
    parameters:
      prefixMatchInfoProducerName: burst-prefix-cache-producer
  - type: load-aware-scorer
  - type: max-score-picker
schedulingProfiles:
  - name: default
    plugins:
      - pluginRef: decode-filter
      - pluginRef: prefix-cache-scorer
        weight: 2.0
      - pluginRef: load-aware-scorer
        weight: 1.0
      - pluginRef: max-score-picker
"""

# deploy/config/sim-program-aware-config.yaml
SIM_PROGRAM_AWARE_CONFIG: Final = """\
apiVersion: inference.networking.x-k8s.io/v1alpha1
kind: EndpointPickerConfig
plugins:
- type: program-aware-fairness
- type: queue-scorer
- type: max-score-picker
- type: single-profile-handler

featureGates:
- flowControl

flowControl:
  defaultPriorityBand:
    fairnessPolicyRef: program-aware-fairness

schedulingProfiles:
- name: default
  plugins:
  - pluginRef: queue-scorer
  - pluginRef: max-score-picker
"""

# deploy/config/epp-mm-embeddings-cache-config.yaml (it passes cacheSizeInMB, a key upstream's
# strict parameter decoding rejects: the producer's only parameter is cacheSizeInMBPerServer)
EPP_MM_EMBEDDINGS_CACHE_CONFIG: Final = """\
# Sample EPP configuration with multimodal embeddings cache affinity.
apiVersion: llm-d.ai/v1alpha1
kind: EndpointPickerConfig
plugins:
  - type: token-producer
    parameters:
      modelName: hf-repo/model-name           # set to the model used in the vLLM deployment
      vllm:
        url: http://localhost:8000
  - type: endpoint-notification-source
  - type: metrics-data-source
  - type: core-metrics-extractor
  - type: mm-embeddings-cache-producer
    parameters:
      cacheSizeInMB: 2048
  - type: mm-embeddings-cache-scorer
  - type: precise-prefix-cache-producer
    parameters:
      tokenProcessorConfig:
        blockSize: 64
      indexerConfig:
        kvBlockIndexConfig:
          enableMetrics: true
  - type: prefix-cache-scorer
    parameters:
      prefixMatchInfoProducerName: precise-prefix-cache-producer
  - type: queue-scorer
  - type: max-score-picker
  - type: single-profile-handler
  - type: decode-filter
dataLayer:
  sources:
    - pluginRef: metrics-data-source
      extractors:
        - pluginRef: core-metrics-extractor
    - pluginRef: endpoint-notification-source
      extractors:
        - pluginRef: mm-embeddings-cache-producer
        - pluginRef: precise-prefix-cache-producer
schedulingProfiles:
  - name: default
    plugins:
      - pluginRef: decode-filter
      - pluginRef: prefix-cache-scorer
        weight: 10
      - pluginRef: mm-embeddings-cache-scorer
        weight: 4
      - pluginRef: queue-scorer
        weight: 1
      - pluginRef: max-score-picker
"""

# deploy/config/sim-epp-gpu-config.yaml
SIM_EPP_GPU_CONFIG: Final = """\
# Sample EPP configuration: GPU utilization-aware routing
# Routes requests to pods with lower GPU utilization, filtering out overloaded endpoints.
apiVersion: llm-d.ai/v1alpha1
kind: EndpointPickerConfig
plugins:
- type: dcgm-data-source
  name: dcgm-source
  parameters:
    port: 9400
    interval: "1s"
- type: dcgm-extractor
  name: dcgm-extractor
- type: endpoint-attribute-filter
  name: gpu-utilization-filter
  parameters:
    attribute: "GPUUtilization"
    producer: "dcgm-extractor"
    onMissing: "Pass"
    fallbackOnEmpty: true
    algorithm:
      type: "threshold"
      threshold:
        operator: "LessThanOrEqual"
        value: 0.90
- type: endpoint-attribute-scorer
  name: gpu-utilization-scorer
  parameters:
    attributeKey: "GPUUtilization"
    producer: "dcgm-extractor"
    algorithm:
      type: "linear_lower_is_better"
      normalization:
        fixedRange:
          min: 0.0
          max: 1.0
- type: kv-cache-utilization-scorer
- type: max-score-picker
- type: single-profile-handler
- type: decode-filter
dataLayer:
  sources:
  - pluginRef: dcgm-source
    extractors:
    - pluginRef: dcgm-extractor
schedulingProfiles:
- name: default
  plugins:
  - pluginRef: decode-filter
  - pluginRef: gpu-utilization-filter
  - pluginRef: gpu-utilization-scorer
    weight: 2.0
  - pluginRef: kv-cache-utilization-scorer
    weight: 1.0
  - pluginRef: max-score-picker
"""

# test/integration/epp/testdata/datalayer-config.yaml (its mock-metrics-source exists only in
# tests: tests/support/mock_metrics_source.py)
DATALAYER_CONFIG: Final = """\
apiVersion: inference.networking.x-k8s.io/v1alpha1
kind: EndpointPickerConfig
plugins:
  - type: queue-scorer
  - type: kv-cache-utilization-scorer
  - type: prefix-cache-scorer
  - type: lora-affinity-scorer
  - type: openai-parser
  - type: mock-metrics-source
schedulingProfiles:
  - name: default
    plugins:
      - pluginRef: queue-scorer
      - pluginRef: kv-cache-utilization-scorer
      - pluginRef: prefix-cache-scorer
      - pluginRef: lora-affinity-scorer
requestHandler:
  parsers:
  - pluginRef: openai-parser
dataLayer:
  sources:
  - pluginRef: mock-metrics-source
"""

# deploy/config/default-config.yaml (comments left out)
DEFAULT_CONFIG: Final = """\
apiVersion: inference.networking.x-k8s.io/v1alpha1
kind: EndpointPickerConfig
plugins:
  - type: queue-scorer
  - type: kv-cache-utilization-scorer
  - type: prefix-cache-scorer
  - type: lora-affinity-scorer
  - type: openai-parser
schedulingProfiles:
  - name: default
    plugins:
      - pluginRef: queue-scorer
      - pluginRef: kv-cache-utilization-scorer
      - pluginRef: prefix-cache-scorer
      - pluginRef: lora-affinity-scorer
requestHandler:
  parsers:
  - pluginRef: openai-parser
"""

# deploy/config/epp-config.yaml (comments left out)
EPP_CONFIG: Final = """\
apiVersion: llm-d.ai/v1alpha1
kind: EndpointPickerConfig
plugins:
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

# deploy/config/epp-estimate-prefix-cache-config.yaml (comments left out)
EPP_ESTIMATE_PREFIX_CACHE_CONFIG: Final = """\
apiVersion: llm-d.ai/v1alpha1
kind: EndpointPickerConfig
plugins:
- type: single-profile-handler
- type: decode-filter
- type: prefix-cache-scorer
- type: load-aware-scorer
- type: max-score-picker
schedulingProfiles:
- name: default
  plugins:
  - pluginRef: decode-filter
  - pluginRef: prefix-cache-scorer
    weight: 1.0
  - pluginRef: load-aware-scorer
    weight: 1.0
  - pluginRef: max-score-picker
"""

# deploy/config/epp-precise-prefix-cache-config.yaml (comments left out)
EPP_PRECISE_PREFIX_CACHE_CONFIG: Final = """\
apiVersion: llm-d.ai/v1alpha1
kind: EndpointPickerConfig
plugins:
  - type: token-producer
    parameters:
      modelName: hf-repo/model-name
      vllm:
        url: http://localhost:8000
  - type: endpoint-notification-source
  - type: metrics-data-source
  - type: core-metrics-extractor
  - type: single-profile-handler
  - type: decode-filter
  - type: precise-prefix-cache-producer
    parameters:
      tokenProcessorConfig:
        blockSize: 64
      indexerConfig:
        kvBlockIndexConfig:
          enableMetrics: true
  - type: prefix-cache-scorer
    parameters:
      prefixMatchInfoProducerName: precise-prefix-cache-producer
  - type: kv-cache-utilization-scorer
  - type: queue-scorer
  - type: max-score-picker
dataLayer:
  sources:
    - pluginRef: metrics-data-source
      extractors:
        - pluginRef: core-metrics-extractor
    - pluginRef: endpoint-notification-source
      extractors:
        - pluginRef: precise-prefix-cache-producer
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
"""

# deploy/config/sim-epp-config.yaml (comments left out)
SIM_EPP_CONFIG: Final = """\
apiVersion: llm-d.ai/v1alpha1
kind: EndpointPickerConfig
plugins:
- type: approx-prefix-cache-producer
  parameters:
    maxPrefixTokensToMatch: 16384
    lruCapacityPerServer: 31250
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

# deploy/config/sim-epp-kvcache-config.yaml (comments left out)
SIM_EPP_KVCACHE_CONFIG: Final = """\
apiVersion: llm-d.ai/v1alpha1
kind: EndpointPickerConfig
plugins:
- type: token-producer
  parameters:
    modelName: TinyLlama/TinyLlama-1.1B-Chat-v1.0
    vllm:
      url: http://localhost:8000
- type: precise-prefix-cache-producer
  parameters:
    tokenProcessorConfig:
      blockSize: 16
    kvEventsConfig:
      zmqEndpoint: tcp://0.0.0.0:5557
    indexerConfig:
      kvBlockIndexConfig:
        enableMetrics: false
        metricsLoggingInterval: 60000000000
- type: prefix-cache-scorer
  parameters:
    prefixMatchInfoProducerName: precise-prefix-cache-producer
- type: decode-filter
- type: max-score-picker
- type: single-profile-handler
schedulingProfiles:
- name: default
  plugins:
  - pluginRef: decode-filter
  - pluginRef: max-score-picker
  - pluginRef: prefix-cache-scorer
    weight: 10
"""

# deploy/config/sim-epp-no-hit-lru.yaml (comments left out)
SIM_EPP_NO_HIT_LRU: Final = """\
apiVersion: llm-d.ai/v1alpha1
kind: EndpointPickerConfig
plugins:
- type: precise-prefix-cache-producer
  parameters:
    tokenProcessorConfig:
      blockSizeTokens: 5
- type: prefix-cache-scorer
  parameters:
    prefixMatchInfoProducerName: precise-prefix-cache-producer
- type: no-hit-lru-scorer
  parameters:
    lruSize: 2048
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
  - pluginRef: no-hit-lru-scorer
    weight: 1
"""

# deploy/config/sim-epp-tokenizer-vllm-http-config.yaml (comments left out)
SIM_EPP_TOKENIZER_VLLM_HTTP_CONFIG: Final = """\
apiVersion: llm-d.ai/v1alpha1
kind: EndpointPickerConfig
plugins:
- type: token-producer
  parameters:
    modelName: "${MODEL_NAME}"
    vllm:
      url: "http://localhost:8000"
- type: precise-prefix-cache-producer
  parameters:
    tokenProcessorConfig:
      blockSize: 16
      hashSeed: "42"
    kvEventsConfig:
      zmqEndpoint: tcp://0.0.0.0:5557
    indexerConfig:
      kvBlockIndexConfig:
        enableMetrics: false
- type: prefix-cache-scorer
  parameters:
    prefixMatchInfoProducerName: precise-prefix-cache-producer
- type: decode-filter
- type: max-score-picker
- type: single-profile-handler
schedulingProfiles:
- name: default
  plugins:
  - pluginRef: decode-filter
  - pluginRef: max-score-picker
  - pluginRef: prefix-cache-scorer
    weight: 10
"""

# deploy/config/soft-reflective-ceiling-epp-config.yaml (comments left out)
SOFT_REFLECTIVE_CEILING_EPP_CONFIG: Final = """\
apiVersion: llm-d.ai/v1alpha1
kind: EndpointPickerConfig
featureGates:
- flowControl
plugins:
- type: queue-scorer
- type: kv-cache-utilization-scorer
- type: prefix-cache-scorer
- type: soft-reflective-ceiling-policy
schedulingProfiles:
- name: default
  plugins:
  - pluginRef: queue-scorer
    weight: 2.0
  - pluginRef: kv-cache-utilization-scorer
    weight: 2.0
  - pluginRef: prefix-cache-scorer
    weight: 3.0
flowControl:
  usageLimitPolicyPluginRef: soft-reflective-ceiling-policy
"""

# test/integration/epp/testdata/request-attribute-reporter-config.yaml (its mock-metrics-source
# exists only in tests)
REQUEST_ATTRIBUTE_REPORTER_CONFIG: Final = """\
apiVersion: inference.networking.x-k8s.io/v1alpha1
kind: EndpointPickerConfig
plugins:
  - type: openai-parser
  - type: mock-metrics-source
  - name: total-tokens-cost-reporter
    type: request-attribute-reporter
    parameters:
      attributes:
        - key:
            namespace: envoy.lb
            name: x-gateway-inference-request-cost
          expression: |
            usage.completion_tokens
          condition: "has(usage.completion_tokens)"
schedulingProfiles:
  - name: default
    plugins:
      - pluginRef: openai-parser
      - pluginRef: total-tokens-cost-reporter
requestHandler:
  parsers:
  - pluginRef: openai-parser
dataLayer:
  sources:
  - pluginRef: mock-metrics-source
"""
