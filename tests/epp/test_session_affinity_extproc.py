"""Session affinity over this EPP's real ext_proc gRPC server: the token a session-affinity
plugin hands out reaches the client as a header of the model server's response, and sent back
it pins the next request (llm-d-router's ResponseHeader step, `epp.director` /
`epp.extproc`)."""

from __future__ import annotations

from typing import Any

import grpc
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc

from epp.config import build_scheduler, load_config
from epp.datastore import Datastore, EndpointSpec
from epp.director import Director
from epp.extproc_server import start_extproc_server
from scorers.affinity import decode_session_token
from scorers.base import EndpointMetrics, PluginContext
from tests.epp.test_extproc import (
    completion_body,
    request_body,
    request_headers,
    response_body,
    response_headers,
    set_headers,
)

PODS = ("10.0.0.1:8000", "10.0.0.2:8000")

FILTER_CONFIG = """\
apiVersion: llm-d.ai/v1alpha1
kind: EndpointPickerConfig
plugins:
- type: session-affinity-filter
  parameters:
    encodedEndpointHeaderConfig:
      header: X-Chat-Session
- type: queue-scorer
- type: max-score-picker
schedulingProfiles:
- name: default
  plugins:
  - pluginRef: session-affinity-filter
  - pluginRef: queue-scorer
  - pluginRef: max-score-picker
"""

SCORER_CONFIG = """\
apiVersion: llm-d.ai/v1alpha1
kind: EndpointPickerConfig
plugins:
- type: session-affinity-scorer
- type: queue-scorer
- type: max-score-picker
schedulingProfiles:
- name: default
  plugins:
  - pluginRef: session-affinity-scorer
    weight: 10
  - pluginRef: queue-scorer
  - pluginRef: max-score-picker
"""


def director(text: str) -> tuple[Director, Datastore]:
    datastore = Datastore(staleness_threshold=None)
    for address, waiting in zip(PODS, (0, 5), strict=True):
        datastore.upsert(EndpointSpec(address=address))
        datastore.update_metrics(address, EndpointMetrics(waiting_requests=waiting))
    context = PluginContext(endpoints=datastore)
    scheduler = build_scheduler(load_config(text=text), context, allow_experimental_plugins=True)
    return Director(datastore, scheduler), datastore


async def exchange(router: Director, extra: dict[str, str]) -> tuple[str, dict[str, str]]:
    """One request and its response over a gRPC stream: the pod chosen and the headers the
    EPP set on the response."""
    messages = [
        request_headers(extra=extra),
        request_body(completion_body()),
        response_headers(),
        response_body(b'{"usage": {"prompt_tokens": 1, "completion_tokens": 1}}', True),
    ]
    server = await start_extproc_server(router, port=0, host="127.0.0.1")
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            stub = pb_grpc.ExternalProcessorStub(channel)
            replies: list[Any] = [r async for r in stub.Process(iter(messages))]
    finally:
        await server.stop(0)
    routed = next(r for r in replies if r.HasField("request_body") or r.HasField("request_headers"))
    common = (
        routed.request_body.response
        if routed.HasField("request_body")
        else routed.request_headers.response
    )
    pod = set_headers(common)["x-gateway-destination-endpoint"]
    answer = next(r for r in replies if r.HasField("response_headers"))
    return pod, set_headers(answer.response_headers.response)


async def test_the_filters_token_comes_back_and_pins_the_session() -> None:
    router, datastore = director(FILTER_CONFIG)
    pod, headers = await exchange(router, {})
    assert pod == PODS[0]  # the idle pod
    token = headers["x-chat-session"]  # the configured header, lower-cased
    assert decode_session_token(token) == PODS[0]
    # The first pod gets busy; the session stays on it, a new one goes elsewhere.
    datastore.update_metrics(PODS[0], EndpointMetrics(waiting_requests=50))
    assert (await exchange(router, {"x-chat-session": token}))[0] == PODS[0]
    assert (await exchange(router, {}))[0] == PODS[1]


async def test_the_scorers_token_reaches_the_client_too() -> None:
    router, _ = director(SCORER_CONFIG)
    pod, headers = await exchange(router, {})
    assert decode_session_token(headers["x-session-token"]) == pod == PODS[0]
