"""llm-d-router's request-attribute-reporter integration tests
(``test/integration/epp/request_attribute_reporter_test.go`` and
``request_attribute_reporter_streaming_test.go``), reproduced over this EPP's real ext_proc gRPC
server: upstream's configuration loaded verbatim, a real `epp.director.Director` over one pod,
and upstream's request and response messages.  The request cost must reach Envoy as
``dynamic_metadata["envoy.lb"]["x-gateway-inference-request-cost"]`` on the reply to the
response's last body chunk, and nowhere before it."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import grpc
import pytest
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc

import scorers.attribute_reporter  # noqa: F401  (registers request-attribute-reporter)
from epp.config import ConfigError, build_scheduler, parse_config
from epp.datastore import Datastore, EndpointSpec
from epp.director import Director
from epp.extproc import ExtProcStream
from epp.extproc_server import start_extproc_server
from epp.scheduler import Scheduler
from scorers.attribute_reporter import RequestAttributeReporter
from scorers.base import EndpointMetrics, PluginContext
from tests.epp.test_extproc import header_map, request_body, response_body, response_headers
from tests.support.llmd_samples import REQUEST_ATTRIBUTE_REPORTER_CONFIG as UPSTREAM_CONFIG
from tests.support.mock_metrics_source import mock_metrics_source

COST = "x-gateway-inference-request-cost"
POD = "192.168.1.1:8000"  # upstream's P(0, 0, 0.1, modelMyModelTarget)

# Upstream's response bodies, byte for byte.
JSON_RESPONSE = (
    '{"choices":[{"finish_reason":"stop","index":0,"logprobs":null,"message":{"content":'
    '"Hello! How can I help you today?","role":"assistant"}}],"created":1773675992,"id":'
    '"chatcmpl-63a9a231-a267-4d15-a799-39e9dceef8a5","model":"modelName","object":'
    '"chat.completion","usage":{"completion_tokens":10,"prompt_tokens":32,"total_tokens":42}}'
)
SSE_RESPONSE = (
    'data: {"choices":[{"delta":{"content":"Hello! "},"index":0,"finish_reason":null}],"id":'
    '"123","created":1,"model":"modelName","object":"chat.completion.chunk"}\n',
    'data: {"choices":[{"delta":{},"index":0,"finish_reason":"stop"}],"id":"123","created":1,'
    '"model":"modelName","object":"chat.completion.chunk","usage":{"completion_tokens":10,'
    '"prompt_tokens":32,"total_tokens":42}}\n',
    "data: [DONE]\n",
)


@pytest.fixture
def director() -> Iterator[Director]:
    """Upstream's harness: its config, one pod whose metrics the test sets (the mock source)."""
    datastore = Datastore(staleness_threshold=None)
    datastore.upsert(EndpointSpec(address=POD))
    datastore.update_metrics(
        POD, EndpointMetrics(kv_cache_usage=0.1, running_lora_adapters=frozenset({"modelName"}))
    )
    with mock_metrics_source():
        scheduler = build(UPSTREAM_CONFIG, datastore)
    yield Director(datastore, scheduler)


def build(text: str, datastore: Datastore) -> Scheduler:
    return build_scheduler(parse_config(text), PluginContext(endpoints=datastore))


def upstream_request() -> list[Any]:
    """integration.ReqLLM(logger, "hello", "modelName", "modelName"): upstream's headers (no
    ``:path``) and its completion body, in one chunk."""
    headers = {
        "hi": "mom",
        "x-request-id": "test-request-id",
        "x-gateway-inference-objective": "modelName",
        "x-gateway-model-name-rewrite": "modelName",
    }
    body = {"max_tokens": 100, "model": "modelName", "prompt": "hello", "temperature": 0}
    return [
        pb.ProcessingRequest(request_headers=pb.HttpHeaders(headers=header_map(headers))),
        request_body(json.dumps(body).encode()),
    ]


def upstream_response(content_type: str, *chunks: str) -> list[Any]:
    """ReqResponseOnly: upstream's response headers (``status``, not ``:status``) and body
    chunks, the last with end_of_stream."""
    headers = header_map({"content-type": content_type, "status": "200"})
    return [
        pb.ProcessingRequest(response_headers=pb.HttpHeaders(headers=headers)),
        *(
            response_body(c.encode(), end_of_stream=i == len(chunks) - 1)
            for i, c in enumerate(chunks)
        ),
    ]


async def exchange(director: Director, messages: list[Any]) -> list[Any]:
    """``messages`` sent over a real gRPC stream to the EPP's ext_proc server; its replies."""
    server = await start_extproc_server(director, port=0, host="127.0.0.1")
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            stub = pb_grpc.ExternalProcessorStub(channel)
            return [reply async for reply in stub.Process(iter(messages))]
    finally:
        await server.stop(0)


def cost(reply: Any) -> float | None:
    metadata = reply.dynamic_metadata
    if "envoy.lb" not in metadata.fields or COST not in metadata["envoy.lb"]:
        return None
    value = metadata["envoy.lb"][COST]
    assert isinstance(value, float)
    return value


# ---------------------------------------------------------------------------------------------


def test_upstream_config_loads_in_tests_and_the_mock_source_stays_out_of_the_product() -> None:
    datastore = Datastore(staleness_threshold=None)
    with mock_metrics_source():
        scheduler = build(UPSTREAM_CONFIG, datastore)
    (plugin,) = scheduler.response_complete_plugins
    assert isinstance(plugin, RequestAttributeReporter)
    assert plugin.name == "total-tokens-cost-reporter"
    (attribute,) = plugin.attributes
    assert (attribute.namespace, attribute.name) == ("envoy.lb", COST)
    assert attribute.condition_source == "has(usage.completion_tokens)"
    # Outside the test harness, the mock is no data source (as upstream's production binary).
    with pytest.raises(ConfigError, match=r"dataLayer.sources\[0\].pluginRef: 'mock-metrics-"):
        parse_config(UPSTREAM_CONFIG)


async def test_json_response_reports_the_cost_on_the_last_body_reply(director: Director) -> None:
    messages = upstream_request() + upstream_response("application/json", JSON_RESPONSE)
    replies = await exchange(director, messages)
    # request headers, request body, response headers, response body: 4, as upstream.
    assert [r.WhichOneof("response") for r in replies] == [
        "request_headers",
        "request_body",
        "response_headers",
        "response_body",
    ]
    assert cost(replies[3]) == 10.0
    assert [cost(r) for r in replies[:3]] == [None, None, None]
    # The routing metadata of the request phase is untouched.
    assert replies[0].dynamic_metadata["envoy.lb"]["x-gateway-destination-endpoint"] == POD


async def test_streamed_response_reports_the_cost_on_the_last_chunk_reply(
    director: Director,
) -> None:
    messages = upstream_request() + upstream_response("text/event-stream", *SSE_RESPONSE)
    replies = await exchange(director, messages)
    assert len(replies) == 6
    assert [r.WhichOneof("response") for r in replies[3:]] == ["response_body"] * 3
    assert cost(replies[5]) == 10.0
    assert [cost(r) for r in replies[:5]] == [None] * 5
    assert replies[5].response_body.response.body_mutation.streamed_response.end_of_stream


async def test_a_response_without_usage_sends_no_metadata(director: Director) -> None:
    messages = upstream_request() + upstream_response(
        "application/json", '{"choices":[{"text":"hi"}]}'
    )
    replies = await exchange(director, messages)
    assert len(replies) == 4
    assert not replies[3].HasField("dynamic_metadata")


async def test_a_response_ended_by_trailers_gets_the_cost_on_the_trailers_reply(
    director: Director,
) -> None:
    stream = ExtProcStream(director)
    for message in upstream_request():
        await stream.handle(message)
    await stream.handle(response_headers(200, "application/json"))
    (body,) = await stream.handle(response_body(JSON_RESPONSE.encode(), end_of_stream=False))
    assert cost(body) is None
    (trailers,) = await stream.handle(pb.ProcessingRequest(response_trailers=pb.HttpTrailers()))
    assert trailers.WhichOneof("response") == "response_trailers"
    assert cost(trailers) == 10.0
    stream.close()
