"""Building and reading ext_proc messages: headers in and out, the gateway's metadata (its
subset hint and ``envoy.lb`` fields), a body re-sent in chunks, and the ``ImmediateResponse``
that answers a request in Envoy's place.  `epp.extproc` drives the protocol with them."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Final

from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ext_proc_pb2
from envoy.type.v3 import http_status_pb2

DESTINATION_NAMESPACE: Final = "envoy.lb"
SUBSET_HINT_NAMESPACE: Final = "envoy.lb.subset_hint"
SUBSET_HINT_KEY: Final = "x-gateway-destination-endpoint-subset"
REQUEST_ID_HEADER: Final = "x-request-id"
# The Inference Extension's pkg/common/envoy/chunking.go: "Certain envoy implementations set a
# max limit of 64Kb per streamed chunk".
BODY_CHUNK_BYTES: Final = 62_000


def decode_headers(header_map: Any) -> dict[str, str]:
    """Envoy's ``HeaderMap`` as a dict (keys lower-case, repeated headers joined by commas).
    Envoy sends values in ``raw_value`` (bytes); older versions used ``value``."""
    headers: dict[str, str] = {}
    for header in header_map.headers:
        value = (
            header.raw_value.decode("utf-8", errors="replace") if header.raw_value else header.value
        )
        key = header.key.lower()
        headers[key] = f"{headers[key]},{value}" if key in headers else value
    return headers


def lb_metadata(metadata_context: Any) -> dict[str, str]:
    """The string fields of the ``envoy.lb`` namespace (the gateway's load-balancing
    metadata, where it reports the endpoint that served)."""
    namespace = metadata_context.filter_metadata.get(DESTINATION_NAMESPACE)
    if namespace is None:
        return {}
    return {
        key: value.string_value
        for key, value in namespace.fields.items()
        if value.WhichOneof("kind") == "string_value"
    }


def subset_hint(metadata_context: Any) -> frozenset[str] | None:
    """IPs of the proxy's subset hint, None when there is no hint.  The hint lists
    ``ip:port`` (or bare IPs); matching is by IP only, as in the Inference Extension."""
    namespace = metadata_context.filter_metadata.get(SUBSET_HINT_NAMESPACE)
    if namespace is None or SUBSET_HINT_KEY not in namespace.fields:
        return None
    value = namespace.fields[SUBSET_HINT_KEY]
    kind = value.WhichOneof("kind")
    if kind == "list_value":
        entries = [v.string_value for v in value.list_value.values if v.string_value]
    elif kind == "string_value":
        entries = [part for part in value.string_value.split(",") if part.strip()]
    else:
        entries = []
    return frozenset(_ip_of(entry.strip()) for entry in entries)


def _ip_of(address: str) -> str:
    if address.startswith("["):  # [v6]:port or [v6]
        return address[1:].split("]", 1)[0]
    if address.count(":") == 1:  # v4:port
        return address.rsplit(":", 1)[0]
    return address  # bare v4 or bare v6


def set_header(key: str, value: str) -> Any:
    return base_pb2.HeaderValueOption(
        header=base_pb2.HeaderValue(key=key, raw_value=value.encode()),
        append_action=base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD,
    )


def streamed_body_responses(body: bytes, *, end_of_stream: bool, request: bool) -> list[Any]:
    """``body`` as ``BodyResponse``s carrying ``streamed_response`` chunks of at most
    `BODY_CHUNK_BYTES`; only the last carries ``end_of_stream``.  An empty body is one empty
    chunk (Envoy still needs to see the end of stream)."""
    pieces = [body[i : i + BODY_CHUNK_BYTES] for i in range(0, len(body), BODY_CHUNK_BYTES)]
    pieces = pieces or [b""]
    responses = []
    for index, piece in enumerate(pieces):
        last = index == len(pieces) - 1
        body_response = ext_proc_pb2.BodyResponse(
            response=ext_proc_pb2.CommonResponse(
                body_mutation=ext_proc_pb2.BodyMutation(
                    streamed_response=ext_proc_pb2.StreamedBodyResponse(
                        body=piece, end_of_stream=end_of_stream and last
                    )
                )
            )
        )
        if request:
            responses.append(ext_proc_pb2.ProcessingResponse(request_body=body_response))
        else:
            responses.append(ext_proc_pb2.ProcessingResponse(response_body=body_response))
    return responses


def immediate_response(
    status: int,
    message: str,
    request_id: str | None,
    details: str,
    extra_headers: Sequence[tuple[str, str]] = (),
) -> Any:
    """An ``ImmediateResponse`` (Envoy answers the client itself) with a plain-text body."""
    set_headers = [set_header("content-type", "text/plain; charset=utf-8")]
    set_headers.extend(set_header(key, value) for key, value in extra_headers)
    if request_id:
        set_headers.append(set_header(REQUEST_ID_HEADER, request_id))
    return ext_proc_pb2.ProcessingResponse(
        immediate_response=ext_proc_pb2.ImmediateResponse(
            status=http_status_pb2.HttpStatus(code=status),
            headers=ext_proc_pb2.HeaderMutation(set_headers=set_headers),
            body=(message + "\n").encode(),
            details=details,
        )
    )
