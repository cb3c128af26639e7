"""The Gateway API Inference Extension's hermetic ext_proc scenarios (v1.5.0,
``test/integration/epp/hermetic_test.go`` and ``common_tests.go``), reproduced with this
project's own fixtures: the same pods (queue, KV usage, active LoRA adapters), objectives,
rewrites, requests and expected destinations, driven through the ext_proc stream
(`epp.extproc.ExtProcStream`) and a real `epp.director.Director` with the Inference
Extension's default profile (queue, KV utilization, prefix, LoRA affinity scorers, weight 1).

What differs from upstream, and is not checked: the bytes of a re-serialized body (upstream
sorts keys; here the client's order is kept, so bodies are compared as JSON) and the echo of
the client's headers in the header mutation.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from epp.config import build_scheduler, parse_config
from epp.datastore import Datastore, EndpointSpec
from epp.director import Director
from epp.extproc import ExtProcStream
from epp.request_rules import RequestRules
from epp.telemetry import Telemetry
from scorers.base import EndpointMetrics, PluginContext
from tests.epp.test_extproc import request_body, request_headers, set_headers, streamed

CONFIG = """\
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
parser: {pluginRef: openai-parser}
"""
POOL = ("inference.networking.k8s.io", "vllm-qwen3-32b-pool")
OBJECTIVES = {"sql-lora": 2, "sql-lora-sheddable": None, "my-model": 2, "direct-model": 2}
REWRITE = {
    "metadata": {"name": "rewrite-test", "creationTimestamp": "2026-01-01T00:00:00Z"},
    "spec": {
        "poolRef": {"name": POOL[1]},
        "rules": [
            {
                "matches": [{"model": {"value": "model-to-be-rewritten"}}],
                "targets": [{"modelRewrite": "rewritten-model"}],
            }
        ],
    },
}


def pod(index: int, queue: int, kv: float, models: tuple[str, ...] = ()) -> tuple[str, Any]:
    return f"192.168.1.{index + 1}:8000", EndpointMetrics(
        waiting_requests=queue, kv_cache_usage=kv, running_lora_adapters=frozenset(models)
    )


def body(model: str, prompt: str) -> bytes:
    doc = {"max_tokens": 100, "model": model, "prompt": prompt, "temperature": 0}
    return json.dumps(doc).encode()


async def run(
    pods: list[tuple[str, Any]],
    headers: dict[str, str],
    chunks: list[bytes],
    subset: list[str] | None = None,
) -> tuple[list[Any], Telemetry]:
    datastore = Datastore(staleness_threshold=None)
    for address, metrics in pods:
        datastore.upsert(EndpointSpec(address=address))
        datastore.update_metrics(address, metrics)
    scheduler = build_scheduler(parse_config(CONFIG), PluginContext(endpoints=datastore))
    telemetry = Telemetry()
    rules = RequestRules(POOL)
    rules.set_objectives(
        [
            {
                "metadata": {"name": name},
                "spec": {"poolRef": {"name": POOL[1]}, **({"priority": p} if p else {})},
            }
            for name, p in OBJECTIVES.items()
        ]
    )
    rules.set_rewrites([REWRITE])
    stream = ExtProcStream(Director(datastore, scheduler, telemetry, rules=rules))
    head = {"hi": "mom", "x-request-id": "test-request-id", **headers}
    replies = await stream.handle(request_headers(extra=head, subset=subset))
    for i, chunk in enumerate(chunks):
        replies += await stream.handle(request_body(chunk, end_of_stream=i == len(chunks) - 1))
    return replies, telemetry


def destination(replies: list[Any]) -> str:
    return set_headers(replies[0].request_headers.response)["x-gateway-destination-endpoint"]


def forwarded(replies: list[Any]) -> Any:
    return json.loads(b"".join(chunk for chunk, _ in streamed(replies[1:])))


def llm(model: str, target: str) -> dict[str, str]:
    """The upstream ReqLLM headers: the objective named after the model, a rewrite header."""
    return {"x-gateway-inference-objective": model, "x-gateway-model-name-rewrite": target}


@pytest.mark.parametrize(
    ("name", "pods", "model", "target", "prompt", "expected"),
    [
        (
            "select lower queue and kv cache",
            [pod(0, 3, 0.2), pod(1, 0, 0.1), pod(2, 10, 0.2)],
            "my-model",
            "my-model-12345",
            "test1",
            "192.168.1.2:8000",
        ),
        (
            "do not shed requests by default",
            [
                pod(0, 6, 0.2, ("foo", "bar", "sql-lora-1fdg2")),
                pod(1, 0, 0.85, ("foo",)),
                pod(2, 10, 0.9, ("foo",)),
            ],
            "sql-lora",
            "sql-lora-1fdg2",
            "test4",
            "192.168.1.1:8000",
        ),
        (
            "select active lora, low queue",
            [
                pod(0, 0, 0.2, ("foo", "bar")),
                pod(1, 0, 0.1, ("foo", "sql-lora-1fdg2")),
                pod(2, 10, 0.2, ("foo", "bar")),
            ],
            "sql-lora",
            "sql-lora-1fdg2",
            "test2",
            "192.168.1.2:8000",
        ),
        (
            "select lora despite higher kv cache",
            [
                pod(0, 10, 0.2, ("foo", "bar")),
                pod(1, 10, 0.4, ("foo", "sql-lora-1fdg2")),
                pod(2, 10, 0.3, ("foo",)),
            ],
            "sql-lora",
            "sql-lora-1fdg2",
            "test3",
            "192.168.1.2:8000",
        ),
    ],
)
async def test_queue_kv_and_lora_selection(
    name: str, pods: list[tuple[str, Any]], model: str, target: str, prompt: str, expected: str
) -> None:
    replies, telemetry = await run(pods, llm(model, target), [body(model, prompt)])
    assert destination(replies) == expected, name
    assert forwarded(replies)["model"] == target
    assert telemetry.registry.get_sample_value(
        "llm_d_epp_request_total",
        {"model_name": model, "target_model_name": target, "fairness_id": "default-flow",
         "priority": str(OBJECTIVES[model] or 0)},
    ) == 1.0  # fmt: skip


SUBSET_PODS = [
    pod(0, 0, 0.2, ("foo",)),
    pod(1, 0, 0.1, ("foo", "sql-lora-1fdg2")),
    pod(2, 10, 0.2, ("foo",)),
]


@pytest.mark.parametrize(
    ("subset", "expected"),
    [
        (["192.168.1.1:8000", "192.168.1.2:8000", "192.168.1.3:8000"], "192.168.1.2:8000"),
        (["192.168.1.3:8000"], "192.168.1.3:8000"),  # the only candidate, despite its load
    ],
)
async def test_subsetting(subset: list[str], expected: str) -> None:
    replies, _ = await run(
        SUBSET_PODS, llm("sql-lora", "sql-lora-1fdg2"), [body("sql-lora", "test2")], subset
    )
    assert destination(replies) == expected


async def test_subsetting_with_no_pod_in_the_hint_is_503() -> None:
    replies, _ = await run(
        SUBSET_PODS[:2], llm("sql-lora", "sql-lora-1fdg2"), [body("sql-lora", "test2")],
        ["192.168.1.99:8000"],
    )  # fmt: skip
    assert replies[0].immediate_response.status.code == 503


async def test_a_body_split_across_chunks() -> None:
    pods = [
        pod(0, 4, 0.2, ("foo", "bar", "sql-lora-1fdg3")),
        pod(1, 4, 0.85, ("foo", "sql-lora-1fdg3")),
    ]
    whole = body("sql-lora-sheddable", "test6")
    cut = whole.index(b"ra-sheddable")
    replies, telemetry = await run(
        pods, llm("sql-lora-sheddable", "sql-lora-1fdg3"), [whole[:cut], whole[cut:]]
    )
    assert destination(replies) == "192.168.1.1:8000"
    assert forwarded(replies) == json.loads(body("sql-lora-1fdg3", "test6"))
    labels = {"model_name": "sql-lora-sheddable", "target_model_name": "sql-lora-1fdg3",
              "fairness_id": "default-flow", "priority": "0"}  # fmt: skip
    assert telemetry.registry.get_sample_value("llm_d_epp_request_total", labels) == 1.0


async def test_an_inference_model_rewrite_overrides_the_header() -> None:
    pods = [pod(0, 0, 0.1, ("foo", "rewritten-model"))]
    replies, telemetry = await run(
        pods,
        llm("model-to-be-rewritten", "model-to-be-rewritten"),
        [body("model-to-be-rewritten", "test-rewrite")],
    )
    assert destination(replies) == "192.168.1.1:8000"
    assert forwarded(replies) == json.loads(body("rewritten-model", "test-rewrite"))
    assert telemetry.registry.get_sample_value(
        "inference_extension_model_rewrite_decisions_total",
        {"model_rewrite_name": "rewrite-test", "model_name": "model-to-be-rewritten",
         "target_model": "rewritten-model"},
    ) == 1.0  # fmt: skip


async def test_a_model_that_names_no_objective_passes_through_unchanged() -> None:
    replies, _ = await run(
        [pod(0, 4, 0.2, ("foo", "bar", "sql-lora-1fdg3"))],
        llm("direct-model", "direct-model"),
        [body("direct-model", "test6")],
    )
    assert destination(replies) == "192.168.1.1:8000"
    assert forwarded(replies) == json.loads(body("direct-model", "test6"))
