"""vLLM's gRPC API (service ``vllm.grpc.engine.VllmEngine``), as the ``vllmgrpc-parser`` reads
it: the request's prompt and stream flag for scheduling, and the response's token counts.

vLLM serves it with ``python -m vllm.entrypoints.launchers.grpc_server`` (vLLM 0.32), whose
messages come from the ``smg-grpc-proto`` package; the same package is used here, so the field
numbers are vLLM's by construction.

The wire format is gRPC over HTTP/2 (grpc/grpc ``doc/PROTOCOL-HTTP2.md``): ``content-type:
application/grpc``, ``:path`` = ``/<service>/<method>``, and a body made of length-prefixed
messages, each ``[compressed flag: 1 byte][length: uint32 big-endian][protobuf message]``.  A
call's end (and its ``grpc-status``) comes in the response trailers.

Requests are recognised by the end of ``:path``, as llm-d-router's parser does (the Inference
Extension v1.5.0 matches the whole path; a gateway route prefix is allowed here):

- ``…/vllm.grpc.engine.VllmEngine/Generate``: a ``GenerateRequest``; the prompt is its ``text``,
  or its ``tokenized`` input's token ids (its ``original_text`` when it carries none); ``stream``
  as sent.
- ``…/vllm.grpc.engine.VllmEngine/Embed``: an ``EmbedRequest``, which must carry ``tokenized``.

The body is never re-encoded: the model server gets the client's bytes.  Only the first message
of a body is read (a unary call has one), as upstream.  What cannot be read is a
`VllmGrpcError` whose message is the Inference Extension's (``parsing gRPC payload for
Generate: not able to parse payload``, ...).

Responses: `ResponseUsage` reads the messages as the body passes, chunk by chunk, without
holding the body.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Final, Literal

from google.protobuf.message import DecodeError
from smg_grpc_proto import vllm_engine_pb2

from scorers.base import Usage

logger = logging.getLogger(__name__)

Method = Literal["Generate", "Embed"]
SERVICE: Final = "vllm.grpc.engine.VllmEngine"
METHODS: Final[tuple[Method, ...]] = ("Generate", "Embed")
GRPC_CONTENT_TYPE: Final = "application/grpc"
# [compressed flag: 1 byte][message length: 4 bytes, big-endian]
FRAME_HEADER_BYTES: Final = 5
_UNCOMPRESSED, _COMPRESSED = 0, 1


class VllmGrpcError(ValueError):
    """A request body the parser cannot read; the message is what the client is told (400)."""


def vllm_method(path: str) -> Method | None:
    """The vLLM method a ``:path`` calls (``…/vllm.grpc.engine.VllmEngine/Generate``), or None."""
    route = path.split("?", 1)[0]
    for method in METHODS:
        if route.endswith(f"{SERVICE}/{method}"):
            return method
    return None


def is_grpc(content_type: str) -> bool:
    """Whether a ``content-type`` is gRPC's (``application/grpc``, ``application/grpc+proto``)."""
    return content_type.strip().lower().startswith(GRPC_CONTENT_TYPE)


# gRPC's own mapping of its status codes onto HTTP's (grpc/grpc doc/http-grpc-status-mapping.md,
# read the other way), so a failed call counts in the error metrics under the status an HTTP
# client would have seen; codes without an HTTP twin count as 500.
_GRPC_TO_HTTP: Final = {
    1: 499,  # CANCELLED: the client went away
    3: 400,  # INVALID_ARGUMENT
    4: 504,  # DEADLINE_EXCEEDED
    5: 404,  # NOT_FOUND
    7: 403,  # PERMISSION_DENIED
    8: 429,  # RESOURCE_EXHAUSTED
    9: 400,  # FAILED_PRECONDITION
    11: 400,  # OUT_OF_RANGE
    12: 501,  # UNIMPLEMENTED
    14: 503,  # UNAVAILABLE
    16: 401,  # UNAUTHENTICATED
}


def grpc_http_status(grpc_status: str | None, http_status: int) -> int:
    """The status a gRPC call ended with, as HTTP: ``http_status`` (the response's ``:status``)
    unless the call's ``grpc-status`` (in its trailers, or its headers for a trailers-only
    answer) says it failed."""
    if grpc_status is None:
        return http_status
    try:
        code = int(grpc_status)
    except ValueError:
        return 500  # not a status at all: a broken answer
    if code == 0:
        return http_status
    return _GRPC_TO_HTTP.get(code, 500)


# ---------------------------------------------------------------------------------------------
# Frames


@dataclass(slots=True, frozen=True)
class Frame:
    """One length-prefixed message of a gRPC body."""

    compressed: bool
    message: bytes


def first_frame(body: bytes) -> Frame:
    """The first message of a complete body; `VllmGrpcError` when the body is shorter than the
    5-byte prefix or than the length it declares, or its flag is neither 0 nor 1."""
    if len(body) < FRAME_HEADER_BYTES or body[0] not in (_UNCOMPRESSED, _COMPRESSED):
        raise VllmGrpcError("not able to parse payload")
    length = int.from_bytes(body[1:FRAME_HEADER_BYTES], "big")
    if len(body) < FRAME_HEADER_BYTES + length:
        raise VllmGrpcError("not able to parse payload")
    return Frame(
        compressed=body[0] == _COMPRESSED,
        message=body[FRAME_HEADER_BYTES : FRAME_HEADER_BYTES + length],
    )


class FrameReader:
    """The messages of a gRPC body fed in chunks of any size (a message may span chunks, a
    chunk may hold several).

    A message longer than ``max_message_bytes`` is skipped as it passes rather than held
    (`skipped` counts them).  A prefix whose flag is neither 0 nor 1 means the body is not gRPC
    framing (an HTML error page from a proxy, ...): nothing more is read (`invalid`).
    """

    def __init__(self, max_message_bytes: int) -> None:
        self._max = max_message_bytes
        self._buffer = bytearray()
        self._to_skip = 0
        self.skipped = 0
        self.invalid = False

    @property
    def pending(self) -> int:
        """Bytes of a message not complete yet (at the end of the body: a truncated one)."""
        return len(self._buffer) + self._to_skip

    def feed(self, chunk: bytes) -> list[Frame]:
        """The messages ``chunk`` completes, in order."""
        if self.invalid or not chunk:
            return []
        if self._to_skip:
            dropped = min(self._to_skip, len(chunk))
            self._to_skip -= dropped
            chunk = chunk[dropped:]
        self._buffer += chunk
        return list(self._complete_frames())

    def _complete_frames(self) -> Iterator[Frame]:
        buffer = self._buffer
        start = 0
        while len(buffer) - start >= FRAME_HEADER_BYTES:
            flag = buffer[start]
            if flag not in (_UNCOMPRESSED, _COMPRESSED):
                self.invalid = True
                buffer.clear()
                return
            length = int.from_bytes(buffer[start + 1 : start + FRAME_HEADER_BYTES], "big")
            end = start + FRAME_HEADER_BYTES + length
            if length > self._max:
                self.skipped += 1
                if end > len(buffer):
                    self._to_skip = end - len(buffer)
                    buffer.clear()
                    return
                start = end
                continue
            if end > len(buffer):
                break
            yield Frame(
                compressed=flag == _COMPRESSED,
                message=bytes(buffer[start + FRAME_HEADER_BYTES : end]),
            )
            start = end
        del buffer[:start]


# ---------------------------------------------------------------------------------------------
# Requests


@dataclass(slots=True, frozen=True)
class VllmGrpcCall:
    """What scheduling needs from a vLLM gRPC request."""

    method: Method
    text: str
    token_ids: tuple[int, ...] = ()
    stream: bool = False


def parse_call(method: Method, body: bytes) -> VllmGrpcCall:
    """The call a complete request body makes; `VllmGrpcError` worded as the Inference
    Extension's ``vllmgrpc`` parser words it (``parsing gRPC payload for <method>: ...``)."""
    try:
        return _parse_call(method, body)
    except VllmGrpcError as exc:
        raise VllmGrpcError(f"parsing gRPC payload for {method}: {exc}") from None


def _parse_call(method: Method, body: bytes) -> VllmGrpcCall:
    frame = first_frame(body)
    if frame.compressed:
        # grpc-encoding (gzip, ...) would need decompressing; clients send uncompressed unless
        # told otherwise, and upstream rejects it the same way.
        raise VllmGrpcError("compressed vllmgrpc payload is not supported")
    if method == "Generate":
        generate: Any = _decode(vllm_engine_pb2.GenerateRequest, frame.message)
        which = generate.WhichOneof("input")
        if which == "text":
            return VllmGrpcCall(method, text=generate.text, stream=generate.stream)
        if which == "tokenized":
            tokenized = generate.tokenized
            return VllmGrpcCall(
                method,
                text=tokenized.original_text,
                token_ids=tuple(tokenized.input_ids),
                stream=generate.stream,
            )
        raise VllmGrpcError("not supported request inputType")
    embed: Any = _decode(vllm_engine_pb2.EmbedRequest, frame.message)
    if not embed.HasField("tokenized"):
        raise VllmGrpcError("missing tokenized input in EmbedRequest")
    return VllmGrpcCall(
        method, text=embed.tokenized.original_text, token_ids=tuple(embed.tokenized.input_ids)
    )


def _decode(message_type: Any, data: bytes) -> Any:
    try:
        return message_type.FromString(data)
    except DecodeError:
        # Go's protobuf wording, which upstream's message carries.
        raise VllmGrpcError("proto: cannot parse invalid wire-format data") from None


# ---------------------------------------------------------------------------------------------
# Responses


@dataclass(slots=True)
class _Counts:
    """One choice's completion tokens (``index``: n > 1 samples stream side by side)."""

    streamed: int = 0  # the sum of its chunks' counts
    final: int = 0  # its GenerateComplete's count


@dataclass(slots=True)
class ResponseUsage:
    """The token counts of a ``Generate`` or ``Embed`` response, fed chunk by chunk.

    vLLM's servicer (``smg_grpc_servicer.vllm.servicer``) sends, for each choice: when
    streaming, a ``chunk`` per step whose ``completion_tokens`` counts that step's new tokens,
    then a ``complete`` repeating the last step's; when not streaming, a single ``complete``
    with the whole count.  A choice's completion tokens are therefore the larger of its chunks'
    sum and its ``complete``'s count, and the response's are the sum over choices.  Every
    message carries the prompt's tokens (and the prefix-cache hits) again.  A message with
    neither prompt nor completion tokens reports nothing, as upstream.  ``Embed``: the
    ``EmbedResponse``'s prompt tokens.

    Compressed messages, messages over ``limit`` bytes and bodies that are not gRPC framing
    are passed over (usage unknown rather than wrong).
    """

    method: Method
    limit: int
    _reader: FrameReader = field(init=False)
    _prompt: int = 0
    _cached: int | None = None
    _choices: dict[int, _Counts] = field(default_factory=dict)
    _seen: bool = False

    def __post_init__(self) -> None:
        self._reader = FrameReader(self.limit)

    def feed(self, chunk: bytes) -> None:
        for frame in self._reader.feed(chunk):
            if frame.compressed:
                logger.debug("vLLM gRPC response: a compressed message; its usage is not read")
                continue
            try:
                self._read(frame.message)
            except DecodeError:
                logger.debug("vLLM gRPC response: a message that is not a %s reply", self.method)

    def _read(self, data: bytes) -> None:
        if self.method == "Embed":
            embed: Any = vllm_engine_pb2.EmbedResponse.FromString(data)
            if embed.prompt_tokens:
                self._seen = True
                self._prompt = embed.prompt_tokens
            return
        response: Any = vllm_engine_pb2.GenerateResponse.FromString(data)
        which = response.WhichOneof("response")
        if which is None:
            return
        message = getattr(response, which)
        if not (message.prompt_tokens or message.completion_tokens):
            return
        self._seen = True
        self._prompt = message.prompt_tokens or self._prompt
        if message.cached_tokens:
            self._cached = message.cached_tokens
        counts = self._choices.setdefault(message.index, _Counts())
        if which == "chunk":
            counts.streamed += message.completion_tokens
        else:
            counts.final = message.completion_tokens

    def result(self) -> Usage | None:
        if not self._seen:
            return None
        completion = sum(max(c.streamed, c.final) for c in self._choices.values())
        return Usage(
            prompt_tokens=self._prompt, completion_tokens=completion, cached_tokens=self._cached
        )
