"""Vertex AI's prediction gRPC API (`epp.vertex_ai`, the ``vertexai-parser``): the cases of
llm-d-router's ``vertexai_test.go`` (snapshot of 2026-08-22), with its error messages, and the
usage of its responses.

The request messages are built here from their wire layout (``endpoint = 1``, ``http_body =
2``), checked below against googleapis' field numbers byte for byte.  Upstream's response cases
that expect an error (a short frame, a message that is no ``HttpBody``) report no usage here:
the EPP reads usage best-effort and never fails a response for it.
"""

from __future__ import annotations

import json
import struct

import pytest
from google.api import httpbody_pb2

from epp.requests import BadRequestError, parse_request
from epp.vertex_ai import (
    HttpBodyRequest,
    VertexAIError,
    VertexUsage,
    grpc_payload,
    openai_usage,
    parse_call,
    vertex_method,
)
from scorers.base import Usage

SERVICE = "/google.cloud.aiplatform.v1beta1.PredictionService"
CHAT = f"{SERVICE}/ChatCompletions"
STREAM_RAW = f"{SERVICE}/StreamRawPredict"
RAW = f"{SERVICE}/RawPredict"
VERTEX_ONLY = frozenset({"vertexai-parser"})


def frame(payload: bytes, flag: int = 0) -> bytes:
    return bytes([flag]) + struct.pack(">I", len(payload)) + payload


def wrapped(data: bytes, endpoint: str = "") -> bytes:
    message = HttpBodyRequest()
    message.endpoint = endpoint  # type: ignore[attr-defined]
    message.http_body.data = data  # type: ignore[attr-defined]
    return frame(message.SerializeToString())


def test_the_request_layout_is_googleapis() -> None:
    # endpoint (field 1, string) then http_body (field 2, HttpBody whose data is field 2).
    body = wrapped(b"{}", endpoint="e")
    assert body[5:].hex() == "0a016512" + "04" + "1202" + b"{}".hex()


def test_the_method_is_known_by_the_end_of_the_path() -> None:
    assert vertex_method(CHAT) == "PredictionService/ChatCompletions"
    assert vertex_method(STREAM_RAW) == "PredictionService/StreamRawPredict"
    assert vertex_method(RAW) == "PredictionService/RawPredict"
    assert vertex_method("/unsupported/path") is None
    assert vertex_method(CHAT + "?x=1") is None  # as sent: upstream passes it through unread


def test_chat_completions_is_read_as_a_chat() -> None:
    data = b'{"messages":[{"role":"user","content":"Hello"}],"stream":true}'
    call = parse_call("PredictionService/ChatCompletions", wrapped(data))
    assert call.kind == "chat"
    assert call.document == json.loads(data)
    request = parse_request(
        wrapped(data), path=CHAT, headers={}, request_id="r", parsers=VERTEX_ONLY
    )
    assert (request.kind, request.model, request.stream) == ("chat", "", True)
    assert request.messages == [{"role": "user", "content": "Hello"}]


@pytest.mark.parametrize(
    ("path", "text"),
    [(STREAM_RAW, "Hello from stream raw predict"), (RAW, "Hello from raw predict")],
)
def test_raw_predict_is_read_as_a_responses_request(path: str, text: str) -> None:
    body = wrapped(json.dumps({"input": text, "model": "m", "cache_salt": "s"}).encode())
    request = parse_request(body, path=path, headers={}, request_id="r", parsers=VERTEX_ONLY)
    assert (request.kind, request.model, request.cache_salt) == ("responses", "m", "s")
    assert request.messages == [{"role": "user", "content": text}]


def test_an_unclaimed_method_passes_through_unread() -> None:
    # The registry claims the path by its ending (query ignored); the parser, reading the
    # path as sent, finds no method and lets the request through unparsed, as upstream.
    request = parse_request(
        b"\x00\x00", path=CHAT + "?x=1", headers={}, request_id="r", parsers=VERTEX_ONLY
    )
    assert (request.kind, request.model) == ("other", "")


@pytest.mark.parametrize(
    ("path", "body", "message"),
    [
        (
            CHAT,
            b"\x00\x00\x00\x00",
            "invalid or unsupported gRPC payload: invalid gRPC frame: expected at least 5 bytes "
            "for header, got 4",
        ),
        (
            CHAT,
            b"\x00\x00\x00\x00\x01\xff",
            "unmarshaling ChatCompletionsRequest: proto: cannot parse invalid wire-format data",
        ),
        (
            STREAM_RAW,
            b"\x00\x00\x00\x00\x01\xff",
            "unmarshaling StreamRawPredictRequest: proto: cannot parse invalid wire-format data",
        ),
        (
            RAW,
            b"\x00\x00\x00\x00\x01\xff",
            "unmarshaling RawPredictRequest: proto: cannot parse invalid wire-format data",
        ),
        (
            CHAT,
            frame(b"", flag=1),
            "invalid or unsupported gRPC payload: compressed gRPC payload is not supported",
        ),
        (
            CHAT,
            b"\x00\x00\x00\x00\x09\x0a",
            "invalid or unsupported gRPC payload: incomplete gRPC payload: header indicates 9 "
            "bytes, but only 1 bytes are available",
        ),
        (CHAT, frame(b""), "ChatCompletionsRequest has no HttpBody"),
        (
            CHAT,
            wrapped(b'{"messages": []}'),
            "parsing ChatCompletionsRequest: invalid chat completions request: must have valid "
            "messages field",
        ),
        (
            RAW,
            wrapped(b'{"model": "m"}'),
            "parsing RawPredictRequest: invalid responses request: must have input field",
        ),
    ],
)
def test_errors_are_upstreams(path: str, body: bytes, message: str) -> None:
    with pytest.raises(BadRequestError) as info:
        parse_request(body, path=path, headers={}, request_id="r", parsers=VERTEX_ONLY)
    assert info.value.message == message


def test_json_that_is_not_an_object_is_an_unmarshaling_error() -> None:
    with pytest.raises(VertexAIError, match=r"^parsing ChatCompletionsRequest: error unmarshaling"):
        parse_call("PredictionService/ChatCompletions", wrapped(b"[1]"))


def test_a_flag_byte_other_than_one_is_read_as_uncompressed_as_upstream() -> None:
    assert grpc_payload(b"\x07\x00\x00\x00\x01z") == b"z"


def http_body(data: bytes) -> bytes:
    return frame(httpbody_pb2.HttpBody(data=data).SerializeToString())


def test_response_usage_comes_from_the_json_in_each_http_body() -> None:
    reply = http_body(
        b'{"object":"chat.completion","usage":{"prompt_tokens":10,"completion_tokens":20,'
        b'"total_tokens":30,"prompt_tokens_details":{"cached_tokens":4}}}'
    )
    reader = VertexUsage(limit=1 << 20)
    for i in range(0, len(reply), 5):
        reader.feed(reply[i : i + 5])
    assert reader.result() == Usage(10, 20, 4)


def test_streamed_responses_keep_the_last_usage_and_skip_what_is_not_json() -> None:
    reader = VertexUsage(limit=1 << 20)
    reader.feed(http_body(b'{"usage":{"input_tokens":7,"output_tokens":1}}'))
    reader.feed(http_body(b"data: not json"))
    reader.feed(http_body(b'{"choices":[]}'))
    reader.feed(http_body(b'{"usage":{"input_tokens":7,"output_tokens":9}}'))
    assert reader.result() == Usage(7, 9)


@pytest.mark.parametrize("body", [b"", b"\x00\x00\x00\x00", frame(b"\xff")])
def test_responses_without_usage_report_none(body: bytes) -> None:
    reader = VertexUsage(limit=1 << 20)
    reader.feed(body)
    assert reader.result() is None


def test_openai_usage_reads_both_families_of_names() -> None:
    assert openai_usage({"prompt_tokens": 3, "completion_tokens": 2}) == Usage(3, 2)
    assert openai_usage(
        {"input_tokens": 3, "output_tokens": 2, "input_tokens_details": {"cached_tokens": 1}}
    ) == Usage(3, 2, 1)
    assert openai_usage(None) is None
