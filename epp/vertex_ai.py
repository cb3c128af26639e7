"""Vertex AI's prediction gRPC API, as llm-d-router's ``vertexai-parser`` reads it
(``pkg/epp/framework/plugins/requesthandling/parsers/vertexai``, snapshot of 2026-08-22).

Vertex AI wraps an OpenAI-compatible JSON body in a gRPC message: ``ChatCompletionsRequest``,
``RawPredictRequest`` and ``StreamRawPredictRequest`` of
``google.cloud.aiplatform.v1beta1.PredictionService`` all hold ``endpoint = 1`` (a string) and
``http_body = 2`` (a ``google.api.HttpBody`` whose ``data`` is the JSON).  The parser reads the
first gRPC frame, decodes the message, and reads the JSON as the OpenAI parser would read
``/chat/completions`` (ChatCompletions) or ``/responses`` (RawPredict, StreamRawPredict).  The
body is forwarded as sent: there is no model to rewrite in it.

- Claimed: paths ending in ``PredictionService/ChatCompletions``, ``.../StreamRawPredict`` or
  ``.../RawPredict``.  A claimed path matching none of them in full (a query string after the
  method) is passed through unread, as upstream does.
- What cannot be read is a `VertexAIError` with upstream's message: ``invalid or unsupported
  gRPC payload: ...``, ``unmarshaling ChatCompletionsRequest: ...``, ``ChatCompletionsRequest
  has no HttpBody``, ``parsing ChatCompletionsRequest: invalid chat completions request: must
  have valid messages field``.  Unlike this EPP's own OpenAI parser, the JSON need not name a
  model (upstream's Vertex parser never requires one).

Responses (`VertexUsage`): each gRPC message is an ``HttpBody`` whose ``data`` is an OpenAI
response; its ``usage`` is read as upstream reads it (``prompt_tokens`` or ``input_tokens``, and
so on).
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from typing import Any, Final, Literal

from google.api import httpbody_pb2
from google.protobuf import descriptor_pb2, descriptor_pool, message_factory
from google.protobuf.message import DecodeError, Message

from epp.vllm_grpc import FRAME_HEADER_BYTES, FrameReader
from scorers.base import Usage

logger = logging.getLogger(__name__)

VERTEX_AI_PARSER: Final = "vertexai-parser"
# gRPC method → (the request message's name in errors, the OpenAI path its JSON is read as).
METHODS: Final[dict[str, tuple[str, Literal["chat", "responses"]]]] = {
    "PredictionService/ChatCompletions": ("ChatCompletionsRequest", "chat"),
    "PredictionService/StreamRawPredict": ("StreamRawPredictRequest", "responses"),
    "PredictionService/RawPredict": ("RawPredictRequest", "responses"),
}


class VertexAIError(ValueError):
    """A request the parser cannot read; the message is what the client is told (400)."""


def _request_message_class() -> type[Message]:
    """The layout the three request messages share (field numbers from googleapis'
    ``google/cloud/aiplatform/v1beta1/prediction_service.proto``), declared under a name of
    our own so that it cannot clash with Google's generated classes if they are installed."""
    proto = descriptor_pb2.FileDescriptorProto(
        name="kv_epp/vertex_ai_request.proto",
        package="kv_epp.vertex_ai",
        syntax="proto3",
        dependency=[httpbody_pb2.DESCRIPTOR.name],
    )
    message = proto.message_type.add(name="HttpBodyRequest")
    message.field.add(
        name="endpoint",
        number=1,
        type=descriptor_pb2.FieldDescriptorProto.TYPE_STRING,
        label=descriptor_pb2.FieldDescriptorProto.LABEL_OPTIONAL,
    )
    message.field.add(
        name="http_body",
        number=2,
        type=descriptor_pb2.FieldDescriptorProto.TYPE_MESSAGE,
        type_name=".google.api.HttpBody",
        label=descriptor_pb2.FieldDescriptorProto.LABEL_OPTIONAL,
    )
    pool = descriptor_pool.Default()
    try:
        found = pool.FindMessageTypeByName("kv_epp.vertex_ai.HttpBodyRequest")
    except KeyError:
        pool.Add(proto)
        found = pool.FindMessageTypeByName("kv_epp.vertex_ai.HttpBodyRequest")
    cls: type[Message] = message_factory.GetMessageClass(found)
    return cls


HttpBodyRequest: Final = _request_message_class()


def vertex_method(path: str) -> str | None:
    """The method a ``:path`` calls, by the end of the path as sent, or None."""
    return next((m for m in METHODS if path.endswith(m)), None)


@dataclass(slots=True, frozen=True)
class VertexCall:
    """The OpenAI request inside a Vertex AI call."""

    method: str
    kind: Literal["chat", "responses"]
    document: dict[str, Any]


def parse_call(method: str, body: bytes) -> VertexCall:
    """The OpenAI request a complete body carries, or `VertexAIError`."""
    name, kind = METHODS[method]
    try:
        payload = grpc_payload(body)
    except VertexAIError as exc:
        raise VertexAIError(f"invalid or unsupported gRPC payload: {exc}") from None
    request: Any = HttpBodyRequest()
    try:
        request.ParseFromString(payload)
    except DecodeError:
        # Go's protobuf wording, which upstream's message carries.
        raise VertexAIError(
            f"unmarshaling {name}: proto: cannot parse invalid wire-format data"
        ) from None
    if not request.HasField("http_body"):
        raise VertexAIError(f"{name} has no HttpBody")
    try:
        document = _openai_document(request.http_body.data, kind)
    except VertexAIError as exc:
        raise VertexAIError(f"parsing {name}: {exc}") from None
    return VertexCall(method=method, kind=kind, document=document)


def grpc_payload(body: bytes) -> bytes:
    """The first message of a gRPC body, as upstream's ``ParseGrpcPayload`` reads it: a
    compressed one is refused; a flag byte other than 0 and 1 is not checked."""
    if len(body) < FRAME_HEADER_BYTES:
        raise VertexAIError(
            f"invalid gRPC frame: expected at least {FRAME_HEADER_BYTES} bytes for header, "
            f"got {len(body)}"
        )
    if body[0] == 1:
        raise VertexAIError("compressed gRPC payload is not supported")
    length = int.from_bytes(body[1:FRAME_HEADER_BYTES], "big")
    if len(body) < FRAME_HEADER_BYTES + length:
        raise VertexAIError(
            f"incomplete gRPC payload: header indicates {length} bytes, but only "
            f"{len(body) - FRAME_HEADER_BYTES} bytes are available"
        )
    return body[FRAME_HEADER_BYTES : FRAME_HEADER_BYTES + length]


def _openai_document(data: bytes, kind: Literal["chat", "responses"]) -> dict[str, Any]:
    """The JSON as upstream's OpenAI parser checks it for ``/chat/completions`` (a non-empty
    list of message objects) or ``/responses`` (an ``input``)."""
    try:
        document = json.loads(data)
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise VertexAIError(f"error unmarshaling request bodyMap: {exc}") from None
    if not isinstance(document, dict):
        raise VertexAIError("error unmarshaling request bodyMap: the body is not a JSON object")
    if kind == "chat":
        messages = document.get("messages")
        if (
            not isinstance(messages, list)
            or not messages
            or not all(isinstance(m, dict) and isinstance(m.get("role", ""), str) for m in messages)
        ):
            raise VertexAIError("invalid chat completions request: must have valid messages field")
    elif document.get("input") is None:
        raise VertexAIError("invalid responses request: must have input field")
    return document


@dataclass(slots=True)
class VertexUsage:
    """The token counts of a Vertex AI response, fed chunk by chunk: every gRPC message is an
    ``HttpBody`` holding an OpenAI JSON response, and the last one with a ``usage`` wins.
    Compressed messages, messages over ``limit`` bytes and data that is not JSON (an event
    stream's lines) are passed over, as upstream's JSON reading fails on them."""

    limit: int
    _reader: FrameReader = field(init=False)
    _usage: Usage | None = None

    def __post_init__(self) -> None:
        self._reader = FrameReader(self.limit)

    def feed(self, chunk: bytes) -> None:
        for frame in self._reader.feed(chunk):
            if frame.compressed:
                continue
            try:
                data = httpbody_pb2.HttpBody.FromString(frame.message).data
                document = json.loads(data)
            except (DecodeError, UnicodeDecodeError, ValueError, RecursionError):
                logger.debug("Vertex AI response: a message that is not an HttpBody of JSON")
                continue
            usage = openai_usage(document.get("usage")) if isinstance(document, dict) else None
            if usage is not None:
                self._usage = usage

    def result(self) -> Usage | None:
        return self._usage


def openai_usage(value: Any) -> Usage | None:
    """An OpenAI ``usage`` object as upstream's OpenAI parser reads it: chat and completions
    name the counts ``prompt_tokens`` / ``completion_tokens`` (cached tokens under
    ``prompt_tokens_details``), the Responses API ``input_tokens`` / ``output_tokens`` (under
    ``input_tokens_details``)."""
    if not isinstance(value, dict):
        return None

    def count(*keys: str) -> int:
        for key in keys:
            v = value.get(key)
            if v is not None:
                return v if isinstance(v, int) and not isinstance(v, bool) and v >= 0 else 0
        return 0

    cached = None
    for key in ("prompt_tokens_details", "input_tokens_details"):
        details = value.get(key)
        if isinstance(details, dict) and "cached_tokens" in details:
            found = details["cached_tokens"]
            cached = found if isinstance(found, int) and not isinstance(found, bool) else 0
    return Usage(
        prompt_tokens=count("prompt_tokens", "input_tokens"),
        completion_tokens=count("completion_tokens", "output_tokens"),
        cached_tokens=cached,
    )
