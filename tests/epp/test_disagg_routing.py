"""Disaggregated serving end to end: the ext_proc stream (`epp.extproc.ExtProcStream`), a real
`epp.director.Director` and a scheduler built from llm-d-router's P/D, E/P/D and data-parallel
sample configurations; what Envoy is told (header mutation, dynamic metadata), the in-flight
accounting of the prefill and decode pods, and the disaggregation decision metrics."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from envoy.config.core.v3 import base_pb2

from epp.config import build_scheduler, parse_config
from epp.datastore import Datastore, EndpointSpec
from epp.director import Director
from epp.extproc import ExtProcStream
from epp.telemetry import Telemetry
from scorers.base import EndpointLoad, EndpointMetrics, PluginContext
from tests.epp.test_extproc import (
    append_actions,
    request_body,
    request_headers,
    response_body,
    response_headers,
    set_headers,
)
from tests.scorers.test_disagg import DP_CONFIG, EPD_CONFIG, IMAGE, PD_CONFIG

PREFILL, DECODE, PLAIN = "10.0.0.1:8000", "10.0.0.2:8000", "10.0.0.3:8000"
ENCODE = "10.0.1.1:8000"
PD_PODS = [(PREFILL, "prefill", 0), (DECODE, "decode", 0), (PLAIN, None, 5)]

DESTINATION = "x-gateway-destination-endpoint"
PREFILLER = "x-prefiller-host-port"
ENCODERS = "x-encoder-hosts-ports"
DATA_PARALLEL = "x-data-parallel-host-port"

LONG = "long prompt " * 40  # 480 characters: 120 estimated tokens
SHORT = "hi"
HANDLER = {"plugin_name": "disagg-profile-handler", "plugin_type": "disagg-profile-handler"}


@dataclass
class Epp:
    datastore: Datastore
    telemetry: Telemetry
    director: Director

    def load(self, address: str) -> EndpointLoad:
        endpoint = self.datastore.get(address)
        assert endpoint is not None
        return endpoint.load

    def in_flight(self, *addresses: str) -> list[int]:
        return [self.load(a).in_flight_requests for a in addresses]

    def decisions(self, kind: str, model: str = "m") -> float | None:
        return self.telemetry.registry.get_sample_value(
            "llm_d_epp_disagg_decision_total",
            {**HANDLER, "model_name": model, "decision_type": kind},
        )

    def deprecated_decisions(self, kind: str, model: str = "m") -> float | None:
        return self.telemetry.registry.get_sample_value(
            "llm_d_inference_scheduler_disagg_decision_total",
            {"model_name": model, "decision_type": kind},
        )


def epp(config: str, pods: Sequence[tuple[str, str | None, int]] = PD_PODS) -> Epp:
    datastore = Datastore(staleness_threshold=None)
    for address, role, waiting in pods:
        labels = {} if role is None else {"llm-d.ai/role": role}
        datastore.upsert(EndpointSpec(address=address, labels=labels))
        datastore.update_metrics(address, EndpointMetrics(waiting_requests=waiting))
    scheduler = build_scheduler(parse_config(config), PluginContext(endpoints=datastore))
    telemetry = Telemetry()
    return Epp(datastore, telemetry, Director(datastore, scheduler, telemetry))


def completion(prompt: str, model: str = "m") -> bytes:
    return json.dumps({"model": model, "prompt": prompt, "max_tokens": 8}).encode()


async def send(
    server: Epp,
    body: bytes,
    headers: dict[str, str] | None = None,
    path: str = "/v1/completions",
) -> tuple[ExtProcStream, Any]:
    """The request phases; returns the stream and its first reply (the header response)."""
    stream = ExtProcStream(server.director)
    head = {"x-request-id": "rid", **(headers or {})}
    assert await stream.handle(request_headers(path, extra=head)) == []
    replies = await stream.handle(request_body(body))
    return stream, replies[0]


def mutation(reply: Any) -> tuple[dict[str, str], list[str]]:
    common = reply.request_headers.response
    return set_headers(common), list(common.header_mutation.remove_headers)


def metadata_destination(reply: Any) -> str:
    lb = reply.dynamic_metadata.fields["envoy.lb"].struct_value
    return str(lb.fields[DESTINATION].string_value)


# ---------------------------------------------------------------------------------------------
# What Envoy is told


async def test_a_pd_decision_sends_envoy_to_the_decode_pod_with_the_prefiller_header() -> None:
    server = epp(PD_CONFIG)
    _, reply = await send(server, completion(LONG))
    set_, removed = mutation(reply)
    assert set_[DESTINATION] == DECODE
    assert set_[PREFILLER] == PREFILL
    assert metadata_destination(reply) == DECODE
    assert ENCODERS in removed
    assert PREFILLER not in removed


async def test_a_client_prefiller_header_is_overwritten_on_a_pd_decision() -> None:
    server = epp(PD_CONFIG)
    _, reply = await send(server, completion(LONG), {PREFILLER: "169.254.169.254:80"})
    set_, removed = mutation(reply)
    assert set_[PREFILLER] == PREFILL
    assert PREFILLER not in removed
    overwrite = base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD
    assert append_actions(reply.request_headers.response) == {overwrite}


async def test_a_client_prefiller_header_is_removed_on_a_decode_only_decision() -> None:
    server = epp(PD_CONFIG)
    headers = {PREFILLER: "169.254.169.254:80", ENCODERS: "169.254.169.254:80"}
    _, reply = await send(server, completion(SHORT), headers)
    set_, removed = mutation(reply)
    assert set_[DESTINATION] == DECODE
    assert PREFILLER not in set_
    assert ENCODERS not in set_
    assert sorted(removed) == [ENCODERS, PREFILLER]


async def test_no_prefill_pod_routes_decode_only_and_removes_the_header() -> None:
    server = epp(PD_CONFIG, [(DECODE, "decode", 0), (PLAIN, None, 5)])
    _, reply = await send(server, completion(LONG), {PREFILLER: "10.9.9.9:8000"})
    set_, removed = mutation(reply)
    assert set_[DESTINATION] == DECODE
    assert PREFILLER in removed
    assert server.decisions("decode-only") == 1.0
    assert server.decisions("prefill-decode") is None


async def test_no_decode_pod_is_429_and_counts_no_decision() -> None:
    server = epp(PD_CONFIG, [(PREFILL, "prefill", 0), (ENCODE, "encode", 0)])
    stream = ExtProcStream(server.director)
    await stream.handle(request_headers(extra={"x-request-id": "rid"}))
    replies = await stream.handle(request_body(completion(LONG)))
    assert replies[0].immediate_response.status.code == 429
    for kind in ("decode-only", "prefill-decode"):
        assert server.decisions(kind) is None
    assert server.in_flight(PREFILL, ENCODE) == [0, 0]


async def test_an_image_chat_names_the_encoder_and_the_prefiller() -> None:
    server = epp(
        EPD_CONFIG, [(ENCODE, "encode", 0), (PREFILL, "prefill", 0), (DECODE, "decode", 0)]
    )
    content = [{"type": "text", "text": LONG}, IMAGE]
    body = json.dumps({"model": "m", "messages": [{"role": "user", "content": content}]})
    _, reply = await send(server, body.encode(), path="/v1/chat/completions")
    set_, removed = mutation(reply)
    assert (set_[DESTINATION], set_[ENCODERS], set_[PREFILLER]) == (DECODE, ENCODE, PREFILL)
    assert removed == []
    assert server.decisions("encode-prefill-decode") == 1.0


async def test_data_parallel_destination_is_the_primary_port_and_the_header_the_rank() -> None:
    ranks = [("10.0.2.1:8001", None, 4), ("10.0.2.1:8002", None, 0), ("10.0.2.1:8003", None, 7)]
    server = epp(DP_CONFIG, ranks)
    stream, reply = await send(server, completion(LONG), {DATA_PARALLEL: "10.0.2.1:8003"})
    set_, removed = mutation(reply)
    assert set_[DESTINATION] == "10.0.2.1:8000"
    assert metadata_destination(reply) == "10.0.2.1:8000"
    assert set_[DATA_PARALLEL] == "10.0.2.1:8002"
    assert removed == []
    # The rank is what the EPP accounts the request to.
    assert server.in_flight("10.0.2.1:8001", "10.0.2.1:8002", "10.0.2.1:8003") == [0, 1, 0]
    await stream.handle(response_headers())
    await stream.handle(response_body(b"{}", end_of_stream=True))
    assert server.in_flight("10.0.2.1:8002") == [0]
    assert server.decisions("decode-only") is None


# ---------------------------------------------------------------------------------------------
# In-flight accounting


async def test_the_prefill_pod_is_released_at_the_decode_pods_first_byte() -> None:
    server = epp(PD_CONFIG)
    stream, reply = await send(server, completion(LONG))
    assert mutation(reply)[0][PREFILLER] == PREFILL
    prefill, decode = server.load(PREFILL), server.load(DECODE)
    assert (prefill.in_flight_requests, prefill.in_flight_prefill_tokens) == (1, 120)
    # The decode pod only pulls the KV: no prefill work of its own.
    assert (decode.in_flight_requests, decode.in_flight_prefill_tokens) == (1, 0)
    assert server.in_flight(PLAIN) == [0]

    await stream.handle(response_headers(content_type="text/event-stream"))
    assert server.in_flight(PREFILL, DECODE) == [1, 1]
    await stream.handle(response_body(b'data: {"choices":[]}\n\n'))
    assert (prefill.in_flight_requests, prefill.in_flight_prefill_tokens) == (0, 0)
    assert decode.in_flight_requests == 1
    await stream.handle(response_body(b'data: {"choices":[]}\n\n'))
    assert server.in_flight(PREFILL, DECODE) == [0, 1]
    await stream.handle(response_body(b"data: [DONE]\n\n", end_of_stream=True))
    assert server.in_flight(PREFILL, DECODE) == [0, 0]
    assert prefill.in_flight_kv_tokens == 0 and decode.in_flight_kv_tokens == 0


async def test_a_decode_only_request_prefills_on_its_decode_pod() -> None:
    server = epp(PD_CONFIG)
    stream, _ = await send(server, completion("x" * 60))  # 15 tokens < nonCachedTokens
    decode = server.load(DECODE)
    assert (decode.in_flight_requests, decode.in_flight_prefill_tokens) == (1, 15)
    assert server.in_flight(PREFILL) == [0]
    await stream.handle(response_headers())
    await stream.handle(response_body(b"{", end_of_stream=False))
    assert (decode.in_flight_requests, decode.in_flight_prefill_tokens) == (1, 0)
    await stream.handle(response_body(b"}", end_of_stream=True))
    assert decode.in_flight_requests == 0


async def test_one_pod_serving_both_roles_is_counted_once_with_its_prefill() -> None:
    """A ``both`` pod passes both role filters: it is the decode pod and its own prefiller
    (upstream sends the header all the same); the EPP counts one request doing the prefill."""
    server = epp(PD_CONFIG, [(PLAIN, "both", 0)])
    stream, reply = await send(server, completion(LONG))
    set_, _ = mutation(reply)
    assert (set_[DESTINATION], set_[PREFILLER]) == (PLAIN, PLAIN)
    load = server.load(PLAIN)
    assert (load.in_flight_requests, load.in_flight_prefill_tokens) == (1, 120)
    await stream.handle(response_headers())
    await stream.handle(response_body(b"{}", end_of_stream=True))
    assert (load.in_flight_requests, load.in_flight_prefill_tokens) == (0, 0)
    assert server.decisions("prefill-decode") == 1.0


async def test_a_stream_ending_before_the_response_releases_both_pods() -> None:
    server = epp(PD_CONFIG)
    stream, _ = await send(server, completion(LONG))
    assert server.in_flight(PREFILL, DECODE) == [1, 1]
    stream.close()
    assert server.in_flight(PREFILL, DECODE) == [0, 0]
    assert server.load(PREFILL).in_flight_prefill_tokens == 0


async def test_a_header_only_error_response_releases_both_pods() -> None:
    server = epp(PD_CONFIG)
    stream, _ = await send(server, completion(LONG))
    await stream.handle(response_headers(status=503, end_of_stream=True))
    assert server.in_flight(PREFILL, DECODE) == [0, 0]
    stream.close()
    assert server.in_flight(PREFILL, DECODE) == [0, 0]


async def test_an_encode_decode_request_prefills_on_its_decode_pod() -> None:
    server = epp(
        EPD_CONFIG.replace("nonCachedTokens: 16", "nonCachedTokens: 100000"),
        [(ENCODE, "encode", 0), (PREFILL, "prefill", 0), (DECODE, "decode", 0)],
    )
    content = [{"type": "text", "text": LONG}, IMAGE]
    body = json.dumps({"model": "m", "messages": [{"role": "user", "content": content}]})
    _, reply = await send(server, body.encode(), path="/v1/chat/completions")
    set_, _ = mutation(reply)
    assert (set_[DESTINATION], set_[ENCODERS]) == (DECODE, ENCODE)
    assert server.decisions("encode-decode") == 1.0
    # The prompt is prefilled on the decode pod, not on the encoder.
    assert server.load(DECODE).in_flight_prefill_tokens > 0
    assert server.load(ENCODE).in_flight_prefill_tokens == 0


# ---------------------------------------------------------------------------------------------
# Decision metrics


async def test_decisions_are_counted_by_handler_model_and_type() -> None:
    server = epp(PD_CONFIG)
    for prompt in (LONG, SHORT, LONG + "!"):
        stream, _ = await send(server, completion(prompt))
        stream.close()
    assert server.decisions("prefill-decode") == 2.0
    assert server.decisions("decode-only") == 1.0
    assert server.decisions("encode-decode") is None
    assert server.deprecated_decisions("prefill-decode") == 2.0
    assert server.deprecated_decisions("decode-only") == 1.0


async def test_the_decision_model_label_is_the_target_model() -> None:
    server = epp(PD_CONFIG)
    rewrite = {"x-gateway-model-name-rewrite": "m-target"}
    await send(server, completion(LONG, model="m-client"), rewrite)
    assert server.decisions("prefill-decode", model="m-target") == 1.0
    assert server.decisions("prefill-decode", model="m-client") is None
    assert server.deprecated_decisions("prefill-decode", model="m-target") == 1.0


async def test_a_named_handler_labels_its_decisions_with_its_name() -> None:
    server = epp(
        PD_CONFIG.replace(
            "- type: disagg-profile-handler\n", "- name: pd\n  type: disagg-profile-handler\n"
        )
    )
    await send(server, completion(LONG))
    labels = {
        "plugin_name": "pd",
        "plugin_type": "disagg-profile-handler",
        "model_name": "m",
        "decision_type": "prefill-decode",
    }
    assert (
        server.telemetry.registry.get_sample_value("llm_d_epp_disagg_decision_total", labels) == 1.0
    )
    assert server.decisions("prefill-decode") is None
