"""The Envoy ext_proc server: one gRPC stream per HTTP request, answered by a `Router`.

Protocol (Envoy ``envoy.service.ext_proc.v3.ExternalProcessor/Process``, as the Gateway API
Inference Extension's EPP uses it; summarized in ``docs/design.md``, "Envoy ext_proc contract"):

1. ``request_headers`` are recorded.  With ``end_of_stream`` (no body: GET /v1/models, ...)
   the request is routed at once by load (`Router.route_without_body`) and the headers are
   answered.  Otherwise the answer waits for the body (see below for BUFFERED mode).
2. ``request_body`` chunks are accumulated up to ``max_body_bytes`` (over it: 400 at once,
   nothing more is buffered).  When the body is complete it is parsed (`epp.requests`), the
   `Router` picks targets, and the EPP answers, in this order (Envoy requires
   headers → body → trailers):

   - a ``HeadersResponse`` whose header mutation sets ``x-gateway-destination-endpoint:
     ip:port[,ip:port...]`` (primary first, then fallbacks), ``content-length`` (the body is
     re-sent) and ``x-request-id`` when the client sent none, with ``clear_route_cache``; the
     same destination goes in ``dynamic_metadata["envoy.lb"]``;
   - the body, re-sent as ``streamed_response`` chunks of at most 62,000 bytes (Envoy
     implementations cap a streamed chunk at 64 KiB), the last with ``end_of_stream``.

   Envoy 1.40 drops ``content-length`` in FULL_DUPLEX_STREAMED mode whatever the mutation
   says and forwards the body chunked (verified end to end); it is set anyway, as the
   Inference Extension does, for proxies that honour it.

   In ``BUFFERED`` request-body mode Envoy does not send the body until the headers are
   answered (holding them stalls the request until ``message_timeout``, then Envoy answers
   504: verified), so the headers get an empty CONTINUE at once and the routing mutation and
   metadata ride on the ``BodyResponse`` instead (Envoy applies header mutations and
   ``clear_route_cache`` from a buffered body reply); the body itself is left unmutated
   unless a model rewrite changed it.
   A model rewrite header (``x-llm-d-model-name-rewrite``, or the Inference Extension's
   ``x-gateway-model-name-rewrite``) sends the request to another model: the forwarded body
   names it (`epp.requests.rewrite_model`), the `Router` sees it, and the response's
   ``"model":"<target>"`` is written back as the client's name in every chunk.
   The mode comes from ``ProcessingRequest.protocol_config`` (Envoy sends it on the first
   message of each stream), else from `ExtProcSettings`.
3. Errors become an ``ImmediateResponse``: `BadRequestError` → 400, `SchedulingError` →
   its ``http_status`` (503 no ready endpoint, 429 every endpoint filtered / saturated), any
   other exception → 500, logged with the request id.  The stream never crashes.
4. Response phases are observed and passed through unchanged (but for a rewritten model's
   name): the status, whether it is a
   ``text/event-stream``, every body chunk (echoed immediately), and the ``usage`` of a JSON
   body or of the last SSE ``data:`` event carrying one.  A vLLM gRPC call's response
   (``application/grpc``, `epp.vllm_grpc`) has its token counts read from its messages; when
   the call did not ask to stream, its body is held and sent on in one piece at its end or
   at its trailers (which end every gRPC response), as the Inference Extension does.  SGLang's
   ``/generate`` and Vertex AI's responses are read their own way (`epp.parser_claims`).
   `Router.response_complete` is called exactly once per routed request: at the response's
   end of stream, at its trailers, or when the gRPC stream ends or is cancelled first.  What
   its ResponseComplete plugins report for Envoy (``request-attribute-reporter``'s request
   cost) goes out as ``dynamic_metadata`` of the reply to that last message, as llm-d-router
   sends it.

The subset hint (``metadata_context.filter_metadata["envoy.lb.subset_hint"]
["x-gateway-destination-endpoint-subset"]``) restricts candidates; the Inference Extension
matches it by IP only, so the `Router` receives the set of IPs.

`ExtProcStream` is the per-stream state machine (no sockets: feed it ``ProcessingRequest``s,
get ``ProcessingResponse``s back); `epp.extproc_messages` builds and reads the messages,
`epp.usage_scan` reads a response's usage, and `epp.extproc_server` serves the stream over
gRPC.
"""

from __future__ import annotations

import enum
import logging
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Final, Protocol

from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ext_proc_pb2
from google.protobuf import struct_pb2

from epp.extproc_messages import (
    DESTINATION_NAMESPACE,
    REQUEST_ID_HEADER,
    decode_headers,
    immediate_response,
    lb_metadata,
    set_header,
    streamed_body_responses,
    subset_hint,
)
from epp.generate_requests import SGLangUsage
from epp.parser_claims import response_usage_reader
from epp.requests import (
    ALL_PARSERS,
    DEFAULT_MAX_BODY_BYTES,
    BadRequestError,
    check_body_size,
    forwarded_body,
    model_rewrite,
    parse_request,
    request_without_body,
    restore_model_name,
    rewrite_model,
    vllm_grpc_method,
)
from epp.usage_scan import UsageScanner
from epp.vertex_ai import VertexUsage
from epp.vllm_grpc import ResponseUsage, grpc_http_status, is_grpc
from scorers.base import LLMRequest, SchedulingError, Usage
from scorers.request_data import LB_METADATA, RESPONSE_HEADERS, RESPONSE_METADATA

logger = logging.getLogger(__name__)

DESTINATION_HEADER: Final = "x-gateway-destination-endpoint"
# Status reported to `Router.response_complete` when the stream ended before the upstream
# answered (client went away, upstream reset).
STATUS_UNKNOWN: Final = 0

_Mode = processing_mode_pb2.ProcessingMode
FULL_DUPLEX_STREAMED: Final[int] = _Mode.FULL_DUPLEX_STREAMED
BUFFERED: Final[int] = _Mode.BUFFERED
_BODY_MODE_NONE: Final[int] = _Mode.NONE

# One message of the stream, in either direction (the xds-protos stubs are untyped).
ProcessingRequest = Any
ProcessingResponse = Any


# ---------------------------------------------------------------------------------------------
# The contract with the scheduler


@dataclass(slots=True)
class RoutingDecision:
    """Where one request goes: ``targets`` are ``"ip:port"``, primary first, then fallbacks."""

    request: LLMRequest
    targets: tuple[str, ...]
    # What Envoy is sent to when it is not the targets themselves (a data-parallel rank's
    # request goes to its pod's primary port; the targets stay the ranks).
    destinations: tuple[str, ...] | None = None

    @property
    def destination(self) -> str:
        """The ``x-gateway-destination-endpoint`` value: the destinations (by default the
        targets) joined by commas."""
        return ",".join(self.destinations or self.targets)


class Router(Protocol):
    """What the ext_proc server needs from the scheduler.  Implemented by ``epp.scheduler``.

    ``subset`` is the proxy's subset hint as a set of IPs (the hint lists ``ip:port`` but is
    matched by IP only): ``None`` when there is no hint (every endpoint is a candidate), an
    empty set when the hint is present but empty (no candidate: raise
    `NoReadyEndpointsError`).  ``route``/``route_without_body`` must leave no state behind
    when they raise or are cancelled; once they return, the server guarantees exactly one
    ``response_complete`` for the decision.  The other hooks must not block: they run on the
    event loop between a response chunk and its echo.
    """

    async def route(self, request: LLMRequest, subset: frozenset[str] | None) -> RoutingDecision:
        """Pick targets for a parsed request; raise a `SchedulingError` subclass if none."""
        ...

    def route_without_body(
        self, request: LLMRequest, subset: frozenset[str] | None
    ) -> RoutingDecision:
        """Pick the least-loaded ready endpoint for a body-less request (GET /v1/models)."""
        ...

    def response_headers(self, decision: RoutingDecision, status: int) -> None:
        """The upstream answered with ``status``."""
        ...

    def response_chunk(self, decision: RoutingDecision) -> None:
        """A non-empty response body chunk passed; the first call is the first byte (TTFT)."""
        ...

    def response_complete(
        self, decision: RoutingDecision, usage: Usage | None, status: int
    ) -> None:
        """The response ended (or the stream was aborted: ``status`` may be `STATUS_UNKNOWN`).
        Called exactly once per decision, so in-flight counts never leak."""
        ...

    def request_failed(self, request: LLMRequest | None, status: int, reason: str) -> None:
        """The EPP answered the request itself with an error ``status`` (for error metrics);
        ``request`` is None when the body could not be parsed."""
        ...


@dataclass(slots=True, frozen=True)
class ExtProcSettings:
    """Server-side knobs.  The body modes are used only when Envoy does not announce its own
    (``ProcessingRequest.protocol_config``, sent by Envoy ≥ 1.33 on each stream's first
    message); they must then match the filter's ``processing_mode``."""

    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    request_body_mode: int = FULL_DUPLEX_STREAMED
    response_body_mode: int = FULL_DUPLEX_STREAMED
    # How much of a non-streamed response body is kept to read its ``usage``; larger bodies
    # pass through all the same, their usage is reported as unknown.
    max_usage_scan_bytes: int = 4 * 1024 * 1024
    # ``--disable-endpoint-subset-filter``: route over the whole pool whatever the proxy hints.
    ignore_subset_hint: bool = False
    # The configuration's ``requestHandler.parsers`` (`epp.requests.parsed_kind`).
    parsers: frozenset[str] = ALL_PARSERS


# ---------------------------------------------------------------------------------------------
# The per-stream state machine


class Phase(enum.Enum):
    AWAITING_HEADERS = "awaiting request headers"
    READING_BODY = "reading request body"
    ROUTED = "routed; observing the response"
    FINISHED = "finished"


@dataclass(slots=True)
class _ResponseState:
    status: int = STATUS_UNKNOWN
    usage: UsageScanner | ResponseUsage | SGLangUsage | VertexUsage | None = None
    completed: bool = False
    # A unary vLLM gRPC response's body, sent on in one piece at its end (`_release_held`).
    held: _Body | None = None


@dataclass(slots=True)
class _Body:
    chunks: list[bytes] = field(default_factory=list)
    size: int = 0

    def append(self, chunk: bytes) -> None:
        self.chunks.append(chunk)
        self.size += len(chunk)

    def join(self) -> bytes:
        return b"".join(self.chunks)


class ExtProcStream:
    """The life of one HTTP request through the EPP.  Feed every ``ProcessingRequest`` to
    `handle` in order and send back what it returns; call `close` when the gRPC stream ends,
    however it ends."""

    def __init__(
        self,
        router: Router,
        settings: ExtProcSettings | None = None,
        *,
        new_request_id: Callable[[], str] = lambda: str(uuid.uuid4()),
    ) -> None:
        self._router = router
        self._settings = settings or ExtProcSettings()
        self._new_request_id = new_request_id
        self.phase = Phase.AWAITING_HEADERS
        self.request_body_mode = self._settings.request_body_mode
        self.response_body_mode = self._settings.response_body_mode
        self.subset: frozenset[str] | None = None
        self.headers: dict[str, str] = {}
        self.request_id: str | None = None
        self._request_id_generated = False
        self._received_at: float | None = None  # when the request headers arrived
        self._body = _Body()
        self._request: LLMRequest | None = None
        self.decision: RoutingDecision | None = None
        self._response = _ResponseState()
        self._lb_metadata: dict[str, str] = {}  # envoy.lb's string fields, latest of each

    # -- entry points ------------------------------------------------------------------------

    async def handle(self, message: ProcessingRequest) -> list[ProcessingResponse]:
        """Responses to send back for one message from Envoy (possibly none yet)."""
        if message.HasField("protocol_config"):
            self.request_body_mode = message.protocol_config.request_body_mode
            self.response_body_mode = message.protocol_config.response_body_mode
        if message.HasField("metadata_context"):
            self._lb_metadata.update(lb_metadata(message.metadata_context))
            if not self._settings.ignore_subset_hint:
                hint = subset_hint(message.metadata_context)
                if hint is not None:
                    self.subset = hint
        if self.phase is Phase.FINISHED:
            return []  # we already answered with an ImmediateResponse; Envoy is tearing down
        kind = message.WhichOneof("request")
        try:
            if kind == "request_headers":
                return await self._on_request_headers(message.request_headers)
            if kind == "request_body":
                return await self._on_request_body(message.request_body)
            if kind == "request_trailers":
                return await self._on_request_trailers()
        except BadRequestError as exc:
            return self._fail(exc.http_status, exc.message, "epp_bad_request")
        except SchedulingError as exc:
            # A SchedulingError may name extra reply headers (admission's dropped reason).
            headers: Sequence[tuple[str, str]] = getattr(exc, "response_headers", ())
            return self._fail(
                exc.http_status, str(exc) or type(exc).__name__, _details(exc), headers
            )
        except Exception:
            logger.exception(
                "ext_proc: internal error while routing request %s (path %s)",
                self.request_id,
                self.headers.get(":path", "?"),
            )
            return self._fail(500, "internal error in the endpoint picker", "epp_internal_error")
        if kind == "response_headers":
            return self._with_reported_metadata(self._on_response_headers(message.response_headers))
        if kind == "response_body":
            return self._with_reported_metadata(self._on_response_body(message.response_body))
        if kind == "response_trailers":
            ended = decode_headers(message.response_trailers.trailers)
            self._response.status = grpc_http_status(
                ended.get("grpc-status"), self._response.status
            )
            self._complete()
            trailers = ext_proc_pb2.ProcessingResponse(
                response_trailers=ext_proc_pb2.TrailersResponse()
            )
            return self._with_reported_metadata(
                [*self._release_held(end_of_stream=False), trailers]
            )
        logger.warning("ext_proc: ignoring a message without a known phase (%s)", kind)
        return []

    def close(self) -> None:
        """The gRPC stream ended.  A routed request whose response did not finish is completed
        now (status as far as known), so the router's in-flight accounting never leaks."""
        self._complete()
        self.phase = Phase.FINISHED

    # -- request phases ----------------------------------------------------------------------

    async def _on_request_headers(self, message: Any) -> list[ProcessingResponse]:
        if self.phase is not Phase.AWAITING_HEADERS:
            raise RuntimeError(f"request headers received while {self.phase.value}")
        self._received_at = time.monotonic()
        self.headers = decode_headers(message.headers)
        self.request_id = self.headers.get(REQUEST_ID_HEADER) or None
        if self.request_id is None:
            self.request_id = self._new_request_id()
            self._request_id_generated = True
        if message.end_of_stream or self.request_body_mode not in (
            FULL_DUPLEX_STREAMED,
            BUFFERED,
        ):
            # No body will come (or this body mode cannot hold the headers): route by load.
            return [self._headers_response(self._route_without_body(), content_length=None)]
        self.phase = Phase.READING_BODY
        if self.request_body_mode == BUFFERED:
            # Envoy sends a buffered body only after the headers are answered; the routing
            # mutation goes on the body reply instead.
            return [ext_proc_pb2.ProcessingResponse(request_headers=ext_proc_pb2.HeadersResponse())]
        return []  # FULL_DUPLEX_STREAMED: answer once the body is complete

    async def _on_request_body(self, message: Any) -> list[ProcessingResponse]:
        if self.phase is Phase.ROUTED:
            # A body Envoy streams in a mode we do not buffer: let it through as it is.
            return [ext_proc_pb2.ProcessingResponse(request_body=ext_proc_pb2.BodyResponse())]
        if self.phase is not Phase.READING_BODY:
            raise RuntimeError(f"request body received while {self.phase.value}")
        check_body_size(self._body.size + len(message.body), self._settings.max_body_bytes)
        self._body.append(message.body)
        if message.end_of_stream or self.request_body_mode == BUFFERED:
            return await self._route_body(trailers_follow=False)
        return []

    async def _on_request_trailers(self) -> list[ProcessingResponse]:
        trailers = ext_proc_pb2.ProcessingResponse(request_trailers=ext_proc_pb2.TrailersResponse())
        if self.phase is Phase.READING_BODY:
            # Trailers end the body: it is complete without an end_of_stream chunk.
            return [*await self._route_body(trailers_follow=True), trailers]
        return [trailers]

    async def _route_body(self, *, trailers_follow: bool) -> list[ProcessingResponse]:
        body = self._body.join()
        self._body = _Body()
        path = self.headers.get(":path", "")
        request = parse_request(
            body,
            path=path,
            headers=self.headers,
            request_id=self._require_request_id(),
            max_body_bytes=self._settings.max_body_bytes,
            parsers=self._settings.parsers,
        )
        request.body_bytes = len(body)
        request.received_at = self._received_at
        self._request = request
        target = model_rewrite(self.headers)
        if target is not None:
            rewrite_model(request, target)
        if not body.strip() and request.kind == "other":
            decision = self._router.route_without_body(request, self.subset)
        else:
            decision = await self._router.route(request, self.subset)
        self._routed(decision)
        # Rewritten by the header or by an InferenceModelRewrite (the router's): the pod gets
        # the target model's body.
        mutated = request.incoming_model is not None
        if mutated:
            body = forwarded_body(request)
        if self.request_body_mode == BUFFERED:
            return [self._buffered_body_response(decision, body if mutated else None)]
        return [
            self._headers_response(decision, content_length=len(body)),
            *streamed_body_responses(body, end_of_stream=not trailers_follow, request=True),
        ]

    def _route_without_body(self) -> RoutingDecision:
        request = request_without_body(
            path=self.headers.get(":path", ""),
            headers=self.headers,
            request_id=self._require_request_id(),
        )
        self._request = request
        decision = self._router.route_without_body(request, self.subset)
        self._routed(decision)
        return decision

    def _routed(self, decision: RoutingDecision) -> None:
        if not decision.targets:
            # A router bug, not a scheduling outcome: fail loudly rather than let Envoy 503.
            self.decision = None
            raise RuntimeError("the router returned a decision without targets")
        self.decision = decision
        self.phase = Phase.ROUTED

    def _routing_mutation(self, decision: RoutingDecision, content_length: int | None) -> Any:
        set_headers = [set_header(DESTINATION_HEADER, decision.destination)]
        if content_length is not None:
            set_headers.append(set_header("content-length", str(content_length)))
        if self._request_id_generated and self.request_id:
            set_headers.append(set_header(REQUEST_ID_HEADER, self.request_id))
        remove_headers = []
        for key, value in decision.request.set_headers.items():
            if value is None:
                remove_headers.append(key)
            else:
                set_headers.append(set_header(key, value))
        return ext_proc_pb2.CommonResponse(
            header_mutation=ext_proc_pb2.HeaderMutation(
                set_headers=set_headers, remove_headers=remove_headers
            ),
            clear_route_cache=True,
        )

    @staticmethod
    def _destination_metadata(decision: RoutingDecision) -> Any:
        metadata = struct_pb2.Struct()
        metadata.update({DESTINATION_NAMESPACE: {DESTINATION_HEADER: decision.destination}})
        return metadata

    def _headers_response(
        self, decision: RoutingDecision, *, content_length: int | None
    ) -> ProcessingResponse:
        return ext_proc_pb2.ProcessingResponse(
            request_headers=ext_proc_pb2.HeadersResponse(
                response=self._routing_mutation(decision, content_length)
            ),
            dynamic_metadata=self._destination_metadata(decision),
        )

    def _buffered_body_response(
        self, decision: RoutingDecision, body: bytes | None
    ) -> ProcessingResponse:
        """The reply to a BUFFERED body: the routing headers, and ``body`` in place of the
        client's when the EPP changed it (a model rewrite)."""
        common = self._routing_mutation(
            decision, content_length=len(body) if body is not None else None
        )
        if body is not None:
            common.body_mutation.body = body
        return ext_proc_pb2.ProcessingResponse(
            request_body=ext_proc_pb2.BodyResponse(response=common),
            dynamic_metadata=self._destination_metadata(decision),
        )

    def _require_request_id(self) -> str:
        if self.request_id is None:
            raise RuntimeError("request id is not known before the request headers")
        return self.request_id

    def _fail(
        self,
        status: int,
        message: str,
        details: str,
        extra_headers: Sequence[tuple[str, str]] = (),
    ) -> list[ProcessingResponse]:
        if self.decision is not None:
            # Routing succeeded but building the reply failed: release the decision.
            self._complete(status=status)
        self.phase = Phase.FINISHED
        self._body = _Body()
        try:
            self._router.request_failed(self._request, status, message)
        except Exception:
            logger.exception("ext_proc: router.request_failed raised for %s", self.request_id)
        return [immediate_response(status, message, self.request_id, details, extra_headers)]

    # -- response phases ---------------------------------------------------------------------

    def _on_response_headers(self, message: Any) -> list[ProcessingResponse]:
        headers = decode_headers(message.headers)
        try:
            status = int(headers.get(":status", ""))
        except ValueError:
            status = STATUS_UNKNOWN
        # A gRPC error answered "trailers-only" carries its grpc-status in these headers.
        self._response.status = grpc_http_status(headers.get("grpc-status"), status)
        content_type = headers.get("content-type", "").lower()
        request = self.decision.request if self.decision is not None else None
        method = vllm_grpc_method(request) if request is not None else None
        limit = self._settings.max_usage_scan_bytes
        native = (
            response_usage_reader(request, content_type, limit) if request is not None else None
        )
        if request is not None and method is not None and is_grpc(content_type):
            self._response.usage = ResponseUsage(method, limit=limit)
            # As the Inference Extension: a call that did not ask to stream gets its response
            # in one piece, at the body's end or at the trailers that end a gRPC response.
            unary = not request.stream and not message.end_of_stream
            if unary and self.response_body_mode == FULL_DUPLEX_STREAMED:
                self._response.held = _Body()
        elif native is not None:
            # SGLang's meta_info, Vertex AI's gRPC-wrapped JSON (`epp.parser_claims`).
            self._response.usage = native
        else:
            self._response.usage = UsageScanner(
                streaming="text/event-stream" in content_type, limit=limit
            )
        if request is not None:
            request.data[LB_METADATA] = dict(self._lb_metadata)
        if self.decision is not None and not self._response.completed:
            self._notify(
                "response_headers",
                self._router.response_headers,
                self.decision,
                self._response.status,
            )
        if message.end_of_stream:
            self._complete()
        reply = ext_proc_pb2.HeadersResponse()
        # What ResponseHeader plugins stamped for the client (request.data[RESPONSE_HEADERS]).
        stamped = request.data.pop(RESPONSE_HEADERS, None) if request is not None else None
        if stamped:
            reply.response.header_mutation.set_headers.extend(
                set_header(key, value) for key, value in stamped.items()
            )
        return [ext_proc_pb2.ProcessingResponse(response_headers=reply)]

    def _on_response_body(self, message: Any) -> list[ProcessingResponse]:
        chunk: bytes = message.body
        if chunk and self.decision is not None and not self._response.completed:
            self._notify("response_chunk", self._router.response_chunk, self.decision)
            if self._response.usage is not None:
                self._response.usage.feed(chunk)
        if message.end_of_stream:
            self._complete()
        request = self._request
        restored = chunk
        if request is not None and request.incoming_model is not None and chunk:
            restored = restore_model_name(chunk, request.model, request.incoming_model)
        held = self._response.held  # only in FULL_DUPLEX_STREAMED mode
        if held is not None:
            held.append(restored)
            if message.end_of_stream:
                return self._release_held(end_of_stream=True)
            if held.size > self._settings.max_body_bytes:
                # Too large to hold: what is held goes on now, the rest as it comes.
                return self._release_held(end_of_stream=False)
            return []
        if self.response_body_mode == FULL_DUPLEX_STREAMED:
            return streamed_body_responses(
                restored, end_of_stream=message.end_of_stream, request=False
            )
        reply = ext_proc_pb2.BodyResponse()
        if restored is not chunk:
            reply.response.body_mutation.body = restored
        return [ext_proc_pb2.ProcessingResponse(response_body=reply)]

    def _release_held(self, *, end_of_stream: bool) -> list[ProcessingResponse]:
        """The held response body, sent on in one piece (nothing when no body came: Envoy
        expects no body reply then).  Trailers release it without ``end_of_stream``: they end
        the stream, as in the Inference Extension."""
        held, self._response.held = self._response.held, None
        if held is None or not held.chunks:
            return []
        return streamed_body_responses(held.join(), end_of_stream=end_of_stream, request=False)

    def _complete(self, status: int | None = None) -> None:
        if self.decision is None or self._response.completed:
            return
        self._response.completed = True
        usage = self._response.usage.result() if self._response.usage is not None else None
        self._notify(
            "response_complete",
            self._router.response_complete,
            self.decision,
            usage,
            self._response.status if status is None else status,
        )

    def _with_reported_metadata(
        self, replies: list[ProcessingResponse]
    ) -> list[ProcessingResponse]:
        """``replies`` with what ResponseComplete plugins reported for Envoy
        (``request.data[RESPONSE_METADATA]``, filled once the response completed) as the last
        reply's ``dynamic_metadata``.  llm-d-router sends it on the reply to the response's
        last body chunk (``pkg/epp/handlers``, ``generateResponseBodyResponses``); a response
        ended by its trailers or its headers gets it on that reply.  Taken, so sent once."""
        if self.decision is None or not replies:
            return replies
        reported = self.decision.request.data.pop(RESPONSE_METADATA, None)
        if reported:
            replies[-1].dynamic_metadata.update(reported)
        return replies

    def _notify(self, hook: str, callback: Callable[..., None], *args: Any) -> None:
        # Observing the response must never break it: a failing hook is logged and skipped.
        try:
            callback(*args)
        except Exception:
            logger.exception("ext_proc: router.%s raised for request %s", hook, self.request_id)


def _details(exc: SchedulingError) -> str:
    # Envoy's response-code details (access logs): one token, no spaces.
    name = type(exc).__name__.removesuffix("Error")
    snake = "".join(f"_{c.lower()}" if c.isupper() else c for c in name).lstrip("_")
    return f"epp_{snake}"
