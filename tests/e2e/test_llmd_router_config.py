"""llm-d-router's split precise-prefix pipeline, end to end: `epp serve` loaded with our copy of
the shape of its ``deploy/config/epp-precise-prefix-cache-config.yaml`` (``token-producer`` →
``precise-prefix-cache-producer`` → ``prefix-cache-scorer`` with
``prefixMatchInfoProducerName``, its ``dataLayer`` sources, ``llm-d.ai/v1alpha1``) behind real
Envoy, routing to simulated vLLM pods that publish real KV events.  A conversation's follow-up
goes to the pod holding its prefix, and the engine counts the hit."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from launcher.stack import Stack
from tests.e2e.test_gateway import Fleet, assert_follow_up_finds_its_prefix

pytestmark = pytest.mark.slow


def _config(tokenizer_dir: Path) -> str:
    return f"""\
apiVersion: llm-d.ai/v1alpha1
kind: EndpointPickerConfig
plugins:
  - type: token-producer
    parameters:
      modelName: {tokenizer_dir}
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
        blockSize: 16
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


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, llama3_tokenizer_dir: Path) -> Iterator[Fleet]:
    work = tmp_path_factory.mktemp("llmd-config")
    pod_args = ["--speedup", "5", "--max-num-seqs", "2"]
    config = _config(llama3_tokenizer_dir)
    with Stack.start(
        work, llama3_tokenizer_dir, pods=2, pod_args=pod_args, config=config
    ) as started:
        yield Fleet(
            started.gateway, [pod.address for pod in started.pods], started.metrics_url, work
        )


async def test_the_split_precise_pipeline_routes_a_follow_up_to_its_prefix(stack: Fleet) -> None:
    for conversation in range(3):
        await assert_follow_up_finds_its_prefix(
            stack, 100 + conversation, f"conversation {conversation}"
        )
