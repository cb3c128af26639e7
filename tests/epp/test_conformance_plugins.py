"""The two plugins the Inference Extension's conformance runs configure llm-d-router's EPP with
(`scorers.conformance`), here through this EPP's real ext_proc gRPC server: the test header
picks the pod, and the endpoint the gateway reports having served (``envoy.lb`` metadata on
the response's message) comes back in the conformance header."""

from __future__ import annotations

from typing import Any

import grpc
import pytest
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from google.protobuf import struct_pb2

from epp.config import build_scheduler, load_config
from epp.datastore import Datastore, EndpointSpec
from epp.director import Director
from epp.extproc_server import start_extproc_server
from scorers.base import PluginContext
from tests.epp.test_extproc import (
    completion_body,
    request_body,
    request_headers,
    response_body,
    response_headers,
    set_headers,
)
from tests.scorers.plugin_helpers import endpoint, make, request

PODS = ("10.0.0.1:8000", "10.0.0.2:8000", "10.0.0.3:9000")

CONFIG = """\
apiVersion: llm-d.ai/v1alpha1
kind: EndpointPickerConfig
plugins:
- type: header-based-testing-filter
- type: destination-endpoint-served-verifier
- type: max-score-picker
schedulingProfiles:
- name: default
  plugins:
  - pluginRef: header-based-testing-filter
  - pluginRef: max-score-picker
"""


@pytest.mark.parametrize(
    ("header", "kept"),
    [
        ("10.0.0.2", ["10.0.0.2:8000"]),
        ("10.0.0.3:9000, 10.0.0.1", ["10.0.0.3:9000", "10.0.0.1:8000"]),  # the header's order
        ("10.0.0.3:8000", []),  # a port must match exactly
        ("10.0.0.1,10.0.0.1:8000", ["10.0.0.1:8000"]),  # one per IP
        ("10.9.9.9", []),
        (" ", []),
        (None, []),
    ],
)
def test_the_filter_keeps_the_endpoints_the_header_names(
    header: str | None, kept: list[str]
) -> None:
    pods = [endpoint(a) for a in PODS]
    headers = {"test-epp-endpoint-selection": header} if header is not None else {}
    chosen = make("header-based-testing-filter").filter(request(headers=headers), pods)
    assert [e.address for e in chosen] == kept


def test_the_filter_reads_bracketed_ipv6() -> None:
    pods = [endpoint("[fd00::1]:8000"), endpoint("[fd00::2]:8000")]
    for header in ("[fd00::2]", "[fd00::2]:8000"):
        req = request(headers={"test-epp-endpoint-selection": header})
        assert [e.address for e in make("header-based-testing-filter").filter(req, pods)] == [
            "[fd00::2]:8000"
        ]


def lb_metadata(served: str | None) -> Any:
    fields = struct_pb2.Struct()
    if served is not None:
        fields.update({"x-gateway-destination-endpoint-served": served})
    message = response_headers()
    message.metadata_context.filter_metadata["envoy.lb"].CopyFrom(fields)
    return message


async def exchange(selection: str, served_headers: Any) -> tuple[str, dict[str, str]]:
    datastore = Datastore(staleness_threshold=None)
    for address in PODS:
        datastore.upsert(EndpointSpec(address=address))
    scheduler = build_scheduler(load_config(text=CONFIG), PluginContext(endpoints=datastore))
    messages = [
        request_headers(extra={"test-epp-endpoint-selection": selection}),
        request_body(completion_body()),
        served_headers,
        response_body(b'{"usage": {"prompt_tokens": 1, "completion_tokens": 1}}', True),
    ]
    server = await start_extproc_server(Director(datastore, scheduler), port=0, host="127.0.0.1")
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            stub = pb_grpc.ExternalProcessorStub(channel)
            replies: list[Any] = [r async for r in stub.Process(iter(messages))]
    finally:
        await server.stop(0)
    routed = next(r for r in replies if r.HasField("request_headers"))
    pod = set_headers(routed.request_headers.response)["x-gateway-destination-endpoint"]
    answer = next(r for r in replies if r.HasField("response_headers"))
    return pod, set_headers(answer.response_headers.response)


async def test_the_served_endpoint_comes_back_in_the_conformance_header() -> None:
    pod, headers = await exchange("10.0.0.2", lb_metadata("10.0.0.2:8000"))
    assert pod == "10.0.0.2:8000"
    assert headers["x-conformance-test-served-endpoint"] == "10.0.0.2:8000"


async def test_missing_metadata_is_reported_as_a_failure() -> None:
    _, headers = await exchange("10.0.0.1", lb_metadata(None))
    assert headers["x-conformance-test-served-endpoint"] == "fail: missing envoy lb metadata"
    _, headers = await exchange("10.0.0.1", response_headers())
    assert headers["x-conformance-test-served-endpoint"] == "fail: missing envoy lb metadata"
