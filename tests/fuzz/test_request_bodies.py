"""Fuzzing `epp.requests.parse_request` and the ext_proc stream that calls it: any body on any
path is either a request or a `BadRequestError` (an HTTP 400 that says why), and the ext_proc
state machine answers every stream, whatever its messages, without raising."""

from __future__ import annotations

import asyncio
import json
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from epp.extproc import ExtProcStream
from epp.requests import BadRequestError, parse_request
from scorers.base import LLMRequest, NoReadyEndpointsError
from tests.epp.test_extproc import request_body, request_headers
from tests.fuzz.conftest import EXAMPLES

PATHS = st.sampled_from(
    [
        "/v1/completions",
        "/v1/chat/completions",
        "/v1/models",
        "/v1/embeddings",
        "/",
        "/v1/chat/completions?x=1",
        "/inference/v1/generate",  # vLLM's pre-tokenized API, a default parser
    ]
)
_json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=30),
    lambda children: (
        st.lists(children, max_size=5) | st.dictionaries(st.text(max_size=10), children, max_size=5)
    ),
    max_leaves=30,
)
# Documents shaped like requests, with every field possibly of the wrong type.
_requestish = st.fixed_dictionaries(
    {},
    optional={
        "model": _json_values | st.text(max_size=20),
        "prompt": _json_values
        | st.lists(st.integers(min_value=-5, max_value=200_000), max_size=20),
        "messages": _json_values
        | st.lists(
            st.fixed_dictionaries(
                {},
                optional={
                    "role": _json_values | st.sampled_from(["user", "system"]),
                    "content": _json_values,
                },
            ),
            max_size=4,
        ),
        "stream": _json_values,
        "cache_salt": _json_values,
    },
)


def _parse(body: bytes, path: str) -> LLMRequest | None:
    try:
        return parse_request(body, path=path, headers={}, request_id="fuzz", max_body_bytes=1 << 20)
    except BadRequestError as exc:
        assert exc.http_status == 400 and exc.message
        return None


@settings(settings.get_profile("fuzz"))
@given(body=st.binary(max_size=2048), path=PATHS)
def test_arbitrary_bytes_are_a_request_or_a_400(body: bytes, path: str) -> None:
    _parse(body, path)


@settings(settings.get_profile("fuzz"))
@given(document=_requestish, path=PATHS)
def test_wrongly_typed_fields_are_a_request_or_a_400(document: dict[str, Any], path: str) -> None:
    body = json.dumps(document, allow_nan=True).encode()
    request = _parse(body, path)
    if request is not None and request.kind != "other":
        assert isinstance(request.model, str) and request.model
        if request.kind == "chat":
            assert isinstance(request.messages, list) and request.messages
        else:
            assert isinstance(request.prompt, str | list)


@settings(settings.get_profile("fuzz"), max_examples=max(20, EXAMPLES // 10))
@given(depth=st.integers(min_value=1, max_value=200_000), opener=st.sampled_from(["[", '{"a":']))
def test_deep_nesting_is_a_400_not_a_crash(depth: int, opener: str) -> None:
    closer = "]" if opener == "[" else "}"
    _parse((opener * depth + "1" + closer * depth).encode(), "/v1/chat/completions")


class _RefusingRouter:
    """Routes nothing (503): the fuzz is about the stream, not the scheduler."""

    async def route(self, request: LLMRequest, subset: frozenset[str] | None) -> Any:
        raise NoReadyEndpointsError("fuzz")

    def route_without_body(self, request: LLMRequest, subset: frozenset[str] | None) -> Any:
        raise NoReadyEndpointsError("fuzz")

    def response_headers(self, decision: Any, status: int) -> None: ...

    def response_chunk(self, decision: Any) -> None: ...

    def response_complete(self, decision: Any, usage: Any, status: int) -> None: ...

    def request_failed(self, request: LLMRequest | None, status: int, reason: str) -> None: ...


@settings(settings.get_profile("fuzz"), max_examples=max(20, EXAMPLES // 3))
@given(
    path=PATHS,
    chunks=st.lists(st.binary(max_size=300), max_size=5),
    headers=st.dictionaries(
        st.text("abcdefghijklmnopqrstuvwxyz-", min_size=1, max_size=20),
        st.text(max_size=50),
        max_size=20,
    ),
    end_with_trailers=st.booleans(),
)
def test_the_ext_proc_stream_answers_any_sequence_of_messages(
    path: str, chunks: list[bytes], headers: dict[str, str], end_with_trailers: bool
) -> None:
    asyncio.run(_one_stream(path, chunks, headers, end_with_trailers))


async def _one_stream(
    path: str, chunks: list[bytes], headers: dict[str, str], end_with_trailers: bool
) -> None:
    from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

    stream = ExtProcStream(_RefusingRouter())  # type: ignore[arg-type]
    replies = await stream.handle(request_headers(path, extra=headers, end_of_stream=not chunks))
    for i, chunk in enumerate(chunks):
        last = i == len(chunks) - 1 and not end_with_trailers
        replies += await stream.handle(request_body(chunk, end_of_stream=last))
    if end_with_trailers:
        replies += await stream.handle(pb.ProcessingRequest(request_trailers=pb.HttpTrailers()))
    stream.close()
    kinds = [r.WhichOneof("response") for r in replies]
    if chunks or not end_with_trailers:
        # Every request that ended got exactly one answer: the 503, or a 400 for its body.
        assert kinds.count("immediate_response") == 1, kinds
        (immediate,) = [r.immediate_response for r in replies if r.HasField("immediate_response")]
        assert immediate.status.code in (400, 503)
