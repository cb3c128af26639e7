"""The ext_proc stream state machine, fed ProcessingRequest messages without any socket, and
the gRPC servicer around it over a real grpc.aio server on loopback."""

from __future__ import annotations

import asyncio
import gc
import json
import logging
from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest
from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from google.protobuf import struct_pb2

from epp.extproc import (
    BUFFERED,
    FULL_DUPLEX_STREAMED,
    STATUS_UNKNOWN,
    ExtProcSettings,
    ExtProcStream,
    RoutingDecision,
)
from epp.extproc_messages import BODY_CHUNK_BYTES, subset_hint
from epp.extproc_server import start_extproc_server
from epp.usage_scan import UsageScanner, parse_usage
from scorers.base import (
    AllEndpointsFilteredError,
    LLMRequest,
    NoReadyEndpointsError,
    Usage,
)

STREAMED = processing_mode_pb2.ProcessingMode.STREAMED
A, B, C = "10.0.0.1:8000", "10.0.0.2:8000", "10.0.0.3:8000"
USAGE = {"prompt_tokens": 12, "completion_tokens": 5, "prompt_tokens_details": {"cached_tokens": 8}}


# ---------------------------------------------------------------------------------------------
# A router that records every call


class RecordingRouter:
    def __init__(self, targets: tuple[str, ...] = (A,), error: Exception | None = None) -> None:
        self.targets = targets
        self.error = error
        self.calls: list[tuple[Any, ...]] = []
        self.requests: list[LLMRequest] = []
        self.subsets: list[frozenset[str] | None] = []
        self.fail_hooks = False

    async def route(self, request: LLMRequest, subset: frozenset[str] | None) -> RoutingDecision:
        return self._decide("route", request, subset)

    def route_without_body(
        self, request: LLMRequest, subset: frozenset[str] | None
    ) -> RoutingDecision:
        return self._decide("route_without_body", request, subset)

    def _decide(
        self, how: str, request: LLMRequest, subset: frozenset[str] | None
    ) -> RoutingDecision:
        self.calls.append((how, request.request_id))
        self.requests.append(request)
        self.subsets.append(subset)
        if subset is not None and not subset:
            raise NoReadyEndpointsError("no endpoint in the subset hint is ready")
        if self.error is not None:
            raise self.error
        return RoutingDecision(request=request, targets=self.targets)

    def response_headers(self, decision: RoutingDecision, status: int) -> None:
        self.calls.append(("response_headers", status))
        if self.fail_hooks:
            raise RuntimeError("hook failure")

    def response_chunk(self, decision: RoutingDecision) -> None:
        self.calls.append(("response_chunk",))
        if self.fail_hooks:
            raise RuntimeError("hook failure")

    def response_complete(
        self, decision: RoutingDecision, usage: Usage | None, status: int
    ) -> None:
        self.calls.append(("response_complete", usage, status))

    def request_failed(self, request: LLMRequest | None, status: int, reason: str) -> None:
        self.calls.append(("request_failed", request is not None, status, reason))

    def completions(self) -> list[tuple[Any, ...]]:
        return [c for c in self.calls if c[0] == "response_complete"]


# ---------------------------------------------------------------------------------------------
# Message builders


def header_map(headers: dict[str, str]) -> Any:
    return base_pb2.HeaderMap(
        headers=[base_pb2.HeaderValue(key=k, raw_value=v.encode()) for k, v in headers.items()]
    )


def request_headers(
    path: str = "/v1/completions",
    *,
    end_of_stream: bool = False,
    extra: dict[str, str] | None = None,
    modes: tuple[int, int] | None = (FULL_DUPLEX_STREAMED, FULL_DUPLEX_STREAMED),
    subset: list[str] | None = None,
) -> Any:
    headers = {":method": "POST", ":path": path, ":authority": "gw", **(extra or {})}
    message = pb.ProcessingRequest(
        request_headers=pb.HttpHeaders(headers=header_map(headers), end_of_stream=end_of_stream)
    )
    if modes is not None:
        message.protocol_config.request_body_mode = modes[0]
        message.protocol_config.response_body_mode = modes[1]
    if subset is not None:
        hint = struct_pb2.Struct()
        hint.update({"x-gateway-destination-endpoint-subset": subset})
        message.metadata_context.filter_metadata["envoy.lb.subset_hint"].CopyFrom(hint)
    return message


def request_body(body: bytes, end_of_stream: bool = True) -> Any:
    return pb.ProcessingRequest(request_body=pb.HttpBody(body=body, end_of_stream=end_of_stream))


def response_headers(
    status: int = 200, content_type: str = "application/json", end_of_stream: bool = False
) -> Any:
    headers = header_map({":status": str(status), "content-type": content_type})
    return pb.ProcessingRequest(
        response_headers=pb.HttpHeaders(headers=headers, end_of_stream=end_of_stream)
    )


def response_body(body: bytes, end_of_stream: bool = False) -> Any:
    return pb.ProcessingRequest(response_body=pb.HttpBody(body=body, end_of_stream=end_of_stream))


def completion_body(prompt: str = "hello", **extra: Any) -> bytes:
    return json.dumps({"model": "m", "prompt": prompt, **extra}).encode()


def set_headers(common: Any) -> dict[str, str]:
    return {h.header.key: h.header.raw_value.decode() for h in common.header_mutation.set_headers}


def append_actions(common: Any) -> set[int]:
    return {h.append_action for h in common.header_mutation.set_headers}


def streamed(responses: list[Any], field: str = "request_body") -> list[tuple[bytes, bool]]:
    chunks = []
    for response in responses:
        assert response.WhichOneof("response") == field
        mutation = getattr(response, field).response.body_mutation
        assert mutation.WhichOneof("mutation") == "streamed_response"
        chunks.append((mutation.streamed_response.body, mutation.streamed_response.end_of_stream))
    return chunks


def make_stream(router: RecordingRouter, **settings: Any) -> ExtProcStream:
    return ExtProcStream(router, ExtProcSettings(**settings), new_request_id=lambda: "generated")


async def routed_stream(router: RecordingRouter, body: bytes | None = None) -> ExtProcStream:
    stream = make_stream(router)
    assert await stream.handle(request_headers(extra={"x-request-id": "rid"})) == []
    responses = await stream.handle(request_body(body or completion_body()))
    assert responses[0].WhichOneof("response") == "request_headers"
    return stream


# ---------------------------------------------------------------------------------------------
# Request phases, FULL_DUPLEX_STREAMED


async def test_headers_wait_for_the_body_then_headers_and_body_are_answered_in_order() -> None:
    router = RecordingRouter(targets=(A, B, C))
    stream = make_stream(router)
    body = completion_body("x" * 140_000, stream=True)
    assert await stream.handle(request_headers(extra={"x-request-id": "rid-1"})) == []
    # Envoy streams the body in pieces of its own choosing; nothing is answered until the end.
    pieces = [body[:1000], body[1000:70_000], body[70_000:]]
    for piece in pieces:
        assert await stream.handle(request_body(piece, end_of_stream=False)) == []
    responses = await stream.handle(request_body(b"", end_of_stream=True))

    headers_reply, *body_replies = responses
    assert headers_reply.WhichOneof("response") == "request_headers"
    common = headers_reply.request_headers.response
    assert common.clear_route_cache is True
    assert common.status == pb.CommonResponse.CONTINUE
    assert set_headers(common) == {
        "x-gateway-destination-endpoint": f"{A},{B},{C}",
        "content-length": str(len(body)),
    }
    assert append_actions(common) == {base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD}
    metadata = headers_reply.dynamic_metadata
    assert (
        metadata.fields["envoy.lb"]
        .struct_value.fields["x-gateway-destination-endpoint"]
        .string_value
        == f"{A},{B},{C}"
    )

    chunks = streamed(body_replies)
    assert len(body) > 2 * BODY_CHUNK_BYTES
    assert [len(c) for c, _ in chunks] == [62_000, 62_000, len(body) - 124_000]
    assert [eos for _, eos in chunks] == [False, False, True]
    assert b"".join(c for c, _ in chunks) == body

    (request,) = router.requests
    assert (request.request_id, request.model, request.stream) == ("rid-1", "m", True)
    assert request.headers[":path"] == "/v1/completions"
    assert router.subsets == [None]
    assert stream.decision is not None and stream.decision.destination == f"{A},{B},{C}"


async def test_request_id_is_generated_and_added_when_the_client_sent_none() -> None:
    router = RecordingRouter()
    stream = make_stream(router)
    await stream.handle(request_headers())
    (reply, _) = await stream.handle(request_body(completion_body()))
    assert set_headers(reply.request_headers.response)["x-request-id"] == "generated"
    assert router.requests[0].request_id == "generated"


async def test_a_small_body_in_one_message_is_one_chunk() -> None:
    router = RecordingRouter()
    stream = make_stream(router)
    body = completion_body()
    await stream.handle(request_headers(extra={"x-request-id": "r"}))
    _, *body_replies = await stream.handle(request_body(body, end_of_stream=True))
    assert streamed(body_replies) == [(body, True)]


async def test_request_trailers_end_the_body() -> None:
    router = RecordingRouter()
    stream = make_stream(router)
    body = completion_body()
    await stream.handle(request_headers(extra={"x-request-id": "r"}))
    assert await stream.handle(request_body(body, end_of_stream=False)) == []
    trailers = pb.ProcessingRequest(request_trailers=pb.HttpTrailers())
    headers_reply, body_reply, trailers_reply = await stream.handle(trailers)
    assert headers_reply.WhichOneof("response") == "request_headers"
    assert streamed([body_reply]) == [(body, False)]  # the trailers end the stream
    assert trailers_reply.WhichOneof("response") == "request_trailers"


async def test_body_less_request_is_routed_by_load_at_the_headers() -> None:
    router = RecordingRouter(targets=(B,))
    stream = make_stream(router)
    (reply,) = await stream.handle(request_headers("/v1/models", end_of_stream=True))
    common = reply.request_headers.response
    assert set_headers(common) == {
        "x-gateway-destination-endpoint": B,
        "x-request-id": "generated",
    }
    assert common.clear_route_cache
    assert (
        reply.dynamic_metadata.fields["envoy.lb"]
        .struct_value.fields["x-gateway-destination-endpoint"]
        .string_value
        == B
    )
    assert router.calls == [("route_without_body", "generated")]
    assert router.requests[0].kind == "other"


async def test_empty_body_on_an_other_path_is_routed_by_load() -> None:
    router = RecordingRouter()
    stream = make_stream(router)
    await stream.handle(request_headers("/v1/models", extra={"x-request-id": "r"}))
    headers_reply, body_reply = await stream.handle(request_body(b""))
    assert router.calls == [("route_without_body", "r")]
    assert set_headers(headers_reply.request_headers.response)["content-length"] == "0"
    assert streamed([body_reply]) == [(b"", True)]


async def test_mode_defaults_come_from_settings_when_envoy_does_not_announce_them() -> None:
    router = RecordingRouter()
    stream = make_stream(router, request_body_mode=BUFFERED)
    (reply,) = await stream.handle(request_headers(modes=None))
    assert reply.WhichOneof("response") == "request_headers"
    assert stream.request_body_mode == BUFFERED


# ---------------------------------------------------------------------------------------------
# BUFFERED request bodies


async def test_buffered_mode_answers_headers_at_once_and_routes_on_the_body_reply() -> None:
    router = RecordingRouter(targets=(A, B))
    stream = make_stream(router)
    (headers_reply,) = await stream.handle(request_headers(modes=(BUFFERED, FULL_DUPLEX_STREAMED)))
    # Envoy sends a buffered body only once the headers are answered: an empty CONTINUE.
    assert headers_reply.WhichOneof("response") == "request_headers"
    assert not headers_reply.request_headers.response.HasField("header_mutation")
    assert router.calls == []

    # In BUFFERED mode the one body message is the whole body, trailers or not.
    (body_reply,) = await stream.handle(request_body(completion_body(), end_of_stream=False))
    common = body_reply.request_body.response
    assert set_headers(common) == {
        "x-gateway-destination-endpoint": f"{A},{B}",
        "x-request-id": "generated",
    }
    assert common.clear_route_cache
    assert not common.HasField("body_mutation")  # the buffered body goes on unchanged
    assert (
        body_reply.dynamic_metadata.fields["envoy.lb"]
        .struct_value.fields["x-gateway-destination-endpoint"]
        .string_value
        == f"{A},{B}"
    )


async def test_unsupported_body_modes_route_at_the_headers_and_pass_the_body() -> None:
    router = RecordingRouter()
    stream = make_stream(router)
    (reply,) = await stream.handle(request_headers(modes=(STREAMED, FULL_DUPLEX_STREAMED)))
    assert set_headers(reply.request_headers.response)["x-gateway-destination-endpoint"] == A
    assert router.calls[0][0] == "route_without_body"
    (body_reply,) = await stream.handle(request_body(b"{}", end_of_stream=False))
    assert body_reply.WhichOneof("response") == "request_body"
    assert not body_reply.request_body.response.HasField("body_mutation")


# ---------------------------------------------------------------------------------------------
# Subset hint


async def test_subset_hint_is_passed_as_ips() -> None:
    router = RecordingRouter()
    stream = make_stream(router)
    await stream.handle(request_headers(subset=[A, "10.0.0.9:9000", "[fd00::1]:8000"]))
    await stream.handle(request_body(completion_body()))
    assert router.subsets == [frozenset({"10.0.0.1", "10.0.0.9", "fd00::1"})]


async def test_present_but_empty_subset_hint_means_no_candidates_503() -> None:
    router = RecordingRouter()
    stream = make_stream(router)
    await stream.handle(request_headers(subset=[], extra={"x-request-id": "r"}))
    (reply,) = await stream.handle(request_body(completion_body()))
    assert router.subsets == [frozenset()]
    assert reply.immediate_response.status.code == 503


def test_subset_hint_parsing() -> None:
    assert subset_hint(base_pb2.Metadata()) is None
    metadata = base_pb2.Metadata()
    metadata.filter_metadata["envoy.lb.subset_hint"].update({"other": 1})
    assert subset_hint(metadata) is None
    metadata.filter_metadata["envoy.lb.subset_hint"].update(
        {"x-gateway-destination-endpoint-subset": "10.1.1.1:80, 10.1.1.2"}
    )
    assert subset_hint(metadata) == frozenset({"10.1.1.1", "10.1.1.2"})
    metadata.filter_metadata["envoy.lb.subset_hint"].update(
        {"x-gateway-destination-endpoint-subset": ["fd00::2", "[fd00::3]"]}
    )
    assert subset_hint(metadata) == frozenset({"fd00::2", "fd00::3"})


# ---------------------------------------------------------------------------------------------
# Errors → ImmediateResponse


def immediate(responses: list[Any]) -> tuple[int, str, dict[str, str]]:
    (response,) = responses
    assert response.WhichOneof("response") == "immediate_response"
    reply = response.immediate_response
    headers = {h.header.key: h.header.raw_value.decode() for h in reply.headers.set_headers}
    return reply.status.code, reply.body.decode(), headers


async def test_invalid_body_is_400_with_the_reason() -> None:
    router = RecordingRouter()
    stream = make_stream(router)
    await stream.handle(request_headers(extra={"x-request-id": "rid-7"}))
    status, body, headers = immediate(await stream.handle(request_body(b"{nope")))
    assert status == 400
    assert "not valid JSON" in body
    assert headers == {"content-type": "text/plain; charset=utf-8", "x-request-id": "rid-7"}
    assert router.calls == [("request_failed", False, 400, body.strip())]
    # Envoy tears the stream down after an ImmediateResponse; anything more is ignored.
    assert await stream.handle(response_headers()) == []
    stream.close()
    assert router.completions() == []


@pytest.mark.parametrize(
    ("error", "status"),
    [
        (NoReadyEndpointsError("no ready endpoint for model m"), 503),
        (AllEndpointsFilteredError("every endpoint is saturated"), 429),
    ],
)
async def test_scheduling_errors_map_to_their_status(error: Exception, status: int) -> None:
    router = RecordingRouter(error=error)
    stream = make_stream(router)
    await stream.handle(request_headers())
    got_status, body, _ = immediate(await stream.handle(request_body(completion_body())))
    assert got_status == status
    assert body.strip() == str(error)
    assert router.calls[-1] == ("request_failed", True, status, str(error))


async def test_scheduling_errors_on_body_less_requests() -> None:
    router = RecordingRouter(error=NoReadyEndpointsError("pool is empty"))
    stream = make_stream(router)
    status, body, _ = immediate(await stream.handle(request_headers(end_of_stream=True)))
    assert (status, body.strip()) == (503, "pool is empty")


async def test_unexpected_errors_are_500_and_logged_with_the_request_id(
    caplog: pytest.LogCaptureFixture,
) -> None:
    router = RecordingRouter(error=RuntimeError("index exploded"))
    stream = make_stream(router)
    await stream.handle(request_headers(extra={"x-request-id": "rid-500"}))
    with caplog.at_level(logging.ERROR, logger="epp.extproc"):
        status, body, _ = immediate(await stream.handle(request_body(completion_body())))
    assert status == 500
    assert "index exploded" not in body  # internals stay in the log
    (record,) = caplog.records
    assert "rid-500" in record.getMessage()
    assert record.exc_info is not None and "index exploded" in str(record.exc_info[1])
    assert router.calls[-1] == ("request_failed", True, 500, body.strip())


async def test_a_decision_without_targets_is_an_internal_error() -> None:
    router = RecordingRouter(targets=())
    stream = make_stream(router)
    await stream.handle(request_headers())
    status, _, _ = immediate(await stream.handle(request_body(completion_body())))
    assert status == 500
    stream.close()
    assert router.completions() == []


async def test_body_over_the_limit_is_400_without_buffering_more() -> None:
    router = RecordingRouter()
    stream = make_stream(router, max_body_bytes=100)
    await stream.handle(request_headers())
    assert await stream.handle(request_body(b"x" * 60, end_of_stream=False)) == []
    status, body, _ = immediate(await stream.handle(request_body(b"x" * 60, end_of_stream=False)))
    assert status == 400 and "larger than the limit of 100 bytes" in body
    assert stream._body.size == 0
    assert await stream.handle(request_body(b"x" * 60, end_of_stream=True)) == []
    assert [c[0] for c in router.calls] == ["request_failed"]


async def test_request_failed_raising_does_not_break_the_error_reply() -> None:
    router = RecordingRouter()

    def broken(request: LLMRequest | None, status: int, reason: str) -> None:
        raise RuntimeError("metrics down")

    router.request_failed = broken  # type: ignore[method-assign]
    stream = make_stream(router)
    await stream.handle(request_headers())
    status, _, _ = immediate(await stream.handle(request_body(b"[]")))
    assert status == 400


# ---------------------------------------------------------------------------------------------
# Response phases


async def test_sse_response_is_echoed_unchanged_and_usage_comes_from_the_last_event() -> None:
    router = RecordingRouter()
    stream = await routed_stream(router, completion_body(stream=True))
    (reply,) = await stream.handle(response_headers(200, "text/event-stream; charset=utf-8"))
    assert reply.WhichOneof("response") == "response_headers"
    assert not reply.response_headers.response.HasField("header_mutation")

    events = [
        b'data: {"choices":[{"text":"a"}],"usage":null}\n\n',
        b'data: {"choices":[{"text":"b"}]}\n\n',
        b'data: {"choices":[],"usage":' + json.dumps(USAGE).encode() + b"}\n\n",
        b"data: [DONE]\n\n",
    ]
    wire = b"".join(events)
    # Split at awkward places: mid-line, mid-JSON, mid-UTF-8 is irrelevant for bytes.
    pieces = [wire[:7], wire[7:60], wire[60:150], wire[150:]]
    echoed = []
    for piece in pieces:
        echoed += streamed(await stream.handle(response_body(piece)), "response_body")
    echoed += streamed(await stream.handle(response_body(b"", True)), "response_body")
    assert echoed == [(p, False) for p in pieces] + [(b"", True)]

    expected_usage = Usage(prompt_tokens=12, completion_tokens=5, cached_tokens=8)
    assert router.calls[1:] == [
        ("response_headers", 200),
        ("response_chunk",),
        ("response_chunk",),
        ("response_chunk",),
        ("response_chunk",),
        ("response_complete", expected_usage, 200),
    ]
    stream.close()
    assert len(router.completions()) == 1


async def test_json_response_usage_is_read_at_the_end() -> None:
    router = RecordingRouter()
    stream = await routed_stream(router)
    await stream.handle(response_headers(200, "application/json"))
    document = json.dumps({"choices": [{"text": "hi"}], "usage": {"prompt_tokens": 3}}).encode()
    await stream.handle(response_body(document[:10]))
    assert router.completions() == []
    echoed = streamed(await stream.handle(response_body(document[10:], True)), "response_body")
    assert echoed == [(document[10:], True)]
    assert router.completions() == [
        ("response_complete", Usage(prompt_tokens=3, completion_tokens=0), 200)
    ]


async def test_large_response_chunks_are_echoed_in_pieces_of_at_most_62000_bytes() -> None:
    router = RecordingRouter()
    stream = await routed_stream(router)
    await stream.handle(response_headers())
    chunk = b"y" * 130_000
    echoed = streamed(await stream.handle(response_body(chunk, True)), "response_body")
    assert [len(c) for c, _ in echoed] == [62_000, 62_000, 6_000]
    assert [eos for _, eos in echoed] == [False, False, True]
    assert router.calls.count(("response_chunk",)) == 1


async def test_error_status_and_non_json_body_report_no_usage() -> None:
    router = RecordingRouter()
    stream = await routed_stream(router)
    await stream.handle(response_headers(503, "text/plain"))
    await stream.handle(response_body(b"upstream connect error", True))
    assert router.completions() == [("response_complete", None, 503)]


async def test_response_trailers_complete_the_response_once() -> None:
    router = RecordingRouter()
    stream = await routed_stream(router)
    await stream.handle(response_headers())
    await stream.handle(response_body(b'{"usage": {"prompt_tokens": 1, "completion_tokens": 2}}'))
    (reply,) = await stream.handle(pb.ProcessingRequest(response_trailers=pb.HttpTrailers()))
    assert reply.WhichOneof("response") == "response_trailers"
    stream.close()
    assert router.completions() == [
        ("response_complete", Usage(prompt_tokens=1, completion_tokens=2), 200)
    ]


async def test_header_only_response_completes_at_the_headers() -> None:
    router = RecordingRouter()
    stream = await routed_stream(router)
    await stream.handle(response_headers(204, end_of_stream=True))
    stream.close()
    assert router.completions() == [("response_complete", None, 204)]


async def test_stream_ending_early_completes_the_request_exactly_once() -> None:
    router = RecordingRouter()
    stream = await routed_stream(router)
    await stream.handle(response_headers(200, "text/event-stream"))
    await stream.handle(response_body(b'data: {"choices":[{"text":"a"}]}\n\n'))
    stream.close()
    stream.close()
    assert router.completions() == [("response_complete", None, 200)]
    assert await stream.handle(response_body(b"late", True)) == []
    assert len(router.completions()) == 1


async def test_stream_ending_before_the_response_reports_unknown_status() -> None:
    router = RecordingRouter()
    stream = await routed_stream(router)
    stream.close()
    assert router.completions() == [("response_complete", None, STATUS_UNKNOWN)]


async def test_stream_ending_before_routing_completes_nothing() -> None:
    router = RecordingRouter()
    stream = make_stream(router)
    await stream.handle(request_headers())
    await stream.handle(request_body(b'{"model"', end_of_stream=False))
    stream.close()
    assert router.calls == []


async def test_non_full_duplex_response_bodies_get_continue() -> None:
    router = RecordingRouter()
    stream = make_stream(router)
    await stream.handle(request_headers(modes=(FULL_DUPLEX_STREAMED, STREAMED)))
    await stream.handle(request_body(completion_body()))
    await stream.handle(response_headers())
    (reply,) = await stream.handle(response_body(b"{}", True))
    assert reply.WhichOneof("response") == "response_body"
    assert not reply.response_body.response.HasField("body_mutation")
    assert len(router.completions()) == 1


async def test_failing_router_hooks_never_break_the_response(
    caplog: pytest.LogCaptureFixture,
) -> None:
    router = RecordingRouter()
    stream = await routed_stream(router)
    router.fail_hooks = True
    with caplog.at_level(logging.ERROR, logger="epp.extproc"):
        assert len(await stream.handle(response_headers())) == 1
        echoed = streamed(await stream.handle(response_body(b"{}", True)), "response_body")
    assert echoed == [(b"{}", True)]
    assert len(router.completions()) == 1
    assert any("response_chunk" in r.getMessage() for r in caplog.records)


# ---------------------------------------------------------------------------------------------
# Usage parsing


def test_parse_usage() -> None:
    assert parse_usage(USAGE) == Usage(12, 5, 8)
    assert parse_usage({"prompt_tokens": 4}) == Usage(4, 0, None)
    assert parse_usage({"prompt_tokens": 4, "prompt_tokens_details": None}) == Usage(4, 0, None)
    assert parse_usage(None) is None
    assert parse_usage({"completion_tokens": 4}) is None
    assert parse_usage({"prompt_tokens": "4"}) is None
    assert parse_usage({"prompt_tokens": True}) is None
    assert parse_usage({"prompt_tokens": 1, "completion_tokens": -1}) is None


def test_usage_scanner_limits_and_odd_input() -> None:
    scanner = UsageScanner(streaming=False, limit=10)
    scanner.feed(b'{"usage": {"prompt_tokens": 1}}')
    assert scanner.result() is None  # too large to keep: usage unknown, body still passed

    scanner = UsageScanner(streaming=True, limit=1000)
    scanner.feed(b'data: {"usage": {"prompt_tokens": 2}}\r\n\r\ndata: {"usage": ')
    scanner.feed(b"garbage\n\n")
    scanner.feed(b'data: {"usage": {"prompt_tokens": 3, "completion_tokens": 1}}')
    assert scanner.result() == Usage(3, 1)  # last event without a newline still counts

    scanner = UsageScanner(streaming=True, limit=1000)
    scanner.feed(b"data: [DONE]\n\n: keep-alive comment\n\n")
    assert scanner.result() is None

    scanner = UsageScanner(streaming=False, limit=1000)
    scanner.feed(b"[1, 2]")
    assert scanner.result() is None


# ---------------------------------------------------------------------------------------------
# The gRPC servicer over a real grpc.aio server


async def _messages(queue: asyncio.Queue[Any]) -> AsyncIterator[Any]:
    while (message := await queue.get()) is not None:
        yield message


async def _wait_for(predicate: Any, timeout: float = 10.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not predicate():
        if asyncio.get_running_loop().time() > deadline:
            raise TimeoutError("condition not met in time")
        await asyncio.sleep(0.01)


async def test_grpc_servicer_round_trip_and_cancellation() -> None:
    router = RecordingRouter(targets=(A, B))
    server = await start_extproc_server(router, port=0, host="127.0.0.1")
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            stub = pb_grpc.ExternalProcessorStub(channel)

            # A whole request/response exchange, closed cleanly by the client.
            body = completion_body("z" * 70_000)
            messages = [
                request_headers(extra={"x-request-id": "grpc-1"}),
                request_body(body[:40_000], end_of_stream=False),
                request_body(body[40_000:], end_of_stream=True),
                response_headers(),
                response_body(b'{"usage": {"prompt_tokens": 9}}', end_of_stream=True),
            ]
            replies = [reply async for reply in stub.Process(iter(messages))]
            kinds = [r.WhichOneof("response") for r in replies]
            assert kinds == [
                "request_headers",
                "request_body",
                "request_body",
                "response_headers",
                "response_body",
            ]
            assert (
                set_headers(replies[0].request_headers.response)["x-gateway-destination-endpoint"]
                == f"{A},{B}"
            )
            assert b"".join(c for c, _ in streamed(replies[1:3])) == body
            assert router.completions() == [("response_complete", Usage(9, 0), 200)]

            # A stream cancelled mid-response (client gone, Envoy resets the stream).
            queue: asyncio.Queue[Any] = asyncio.Queue()
            call = stub.Process(_messages(queue))
            await queue.put(request_headers(extra={"x-request-id": "grpc-2"}))
            await queue.put(request_body(completion_body()))
            assert (await call.read()).WhichOneof("response") == "request_headers"
            assert (await call.read()).WhichOneof("response") == "request_body"
            await queue.put(response_headers(200, "text/event-stream"))
            assert (await call.read()).WhichOneof("response") == "response_headers"
            call.cancel()
            await _wait_for(lambda: len(router.completions()) == 2)
            assert router.completions()[1] == ("response_complete", None, 200)

            # An error reply over the wire.
            replies = [
                reply
                async for reply in stub.Process(iter([request_headers(), request_body(b"nope")]))
            ]
            assert [r.immediate_response.status.code for r in replies] == [400]
    finally:
        await server.stop(0)
    assert len(router.completions()) == 2


async def test_serving_freezes_the_start_up_heap_until_the_server_stops() -> None:
    server = await start_extproc_server(RecordingRouter(targets=(A,)), port=0, host="127.0.0.1")
    try:
        assert gc.get_freeze_count() > 0  # start-up objects are out of full collections
    finally:
        await server.stop(grace=None)
    assert gc.get_freeze_count() == 0


async def test_a_rewritten_models_stream_reads_the_clients_name_back() -> None:
    router = RecordingRouter()
    stream = make_stream(router)
    headers = {"x-request-id": "rid", "x-gateway-model-name-rewrite": "llama-lora"}
    assert await stream.handle(request_headers(extra=headers)) == []
    body = json.dumps({"model": "m", "prompt": "hi", "stream": True}).encode()
    sent = streamed((await stream.handle(request_body(body)))[1:])
    assert json.loads(b"".join(c for c, _ in sent)) == {
        "model": "llama-lora",
        "prompt": "hi",
        "stream": True,
    }
    (request,) = router.requests
    assert (request.model, request.incoming_model, request.client_model) == (
        "llama-lora",
        "m",
        "m",
    )
    await stream.handle(response_headers(200, "text/event-stream"))
    chunks = [
        b'data: {"id":"c","model":"llama-lora","choices":[{"text":"a"}]}\n\n',
        b'data: {"id":"c", "model": "llama-lora", "choices":[]}\n\n',
        b'data: {"id":"c","model":"llama-lo',  # split across chunks: left as the server wrote it
        b'ra","choices":[]}\n\ndata: [DONE]\n\n',
    ]
    echoed = []
    for chunk in chunks:
        echoed += streamed(await stream.handle(response_body(chunk)), "response_body")
    assert [c for c, _ in echoed] == [
        b'data: {"id":"c","model":"m","choices":[{"text":"a"}]}\n\n',
        b'data: {"id":"c", "model": "m", "choices":[]}\n\n',
        chunks[2],
        chunks[3],
    ]


async def test_a_rewrite_to_the_same_model_or_on_a_passthrough_path_changes_nothing() -> None:
    for path, body in (
        ("/v1/completions", completion_body()),  # already names "m"
        ("/tokenize", b'{"model": "m", "prompt": "x"}'),
    ):
        router = RecordingRouter()
        stream = make_stream(router)
        extra = {"x-request-id": "rid", "x-llm-d-model-name-rewrite": "m"}
        await stream.handle(request_headers(path, extra=extra))
        sent = streamed((await stream.handle(request_body(body)))[1:])
        assert b"".join(c for c, _ in sent) == body
        assert router.requests[0].incoming_model is None
