"""``session-affinity-filter``: llm-d-router's hard pin of a session to the pod that served it
(upstream ``pkg/epp/framework/plugins/scheduling/filter/sessionaffinity`` and the shared
``scheduling/util/sessionaffinity``; Alpha there and here: it needs
``--allow-experimental-plugins``).

The filter keeps the session's pod alone when it is a candidate, and every candidate otherwise
(no session, an unknown one, or its pod gone), so it never empties a non-empty list.  Two
``strategy`` values:

* ``encoded_endpoint_header`` (default, stateless): the session is a token in a request header
  (``encodedEndpointHeaderConfig.header``, default ``x-session-token``), the one this EPP's
  ``session-affinity-scorer`` uses: base64 of the pod's address (`scorers.affinity`; upstream
  encodes the pod's ``namespace/name``, the address is what identifies a pod here).  When the
  model server's response headers arrive, the filter sets that header on the response to the
  serving pod's token (or, with ``profileName``, the token of that profile's pod, none when the
  profile did not run), for the client to send back.  An undecodable token pins nothing.
* ``session_id`` (stateful): the client names its session; the identifier is read from
  ``sessionIdConfig.sources`` in order, each a request ``header`` or a request ``attribute``
  another plugin published (``agent-identity``'s, in ``request.data["agent-identity"]``; an
  attribute with a ``producer`` is read from ``request.data["<attribute>/<producer>"]``), the
  first non-blank one winning (default: the header ``x-session-id``).  After the decision the
  session is bound to the chosen pod (``profileName``'s, or the primary profile's); a bound
  session is pinned to its pod while that pod is a candidate, and moves to the pod chosen
  instead only when its pod was not among this request's candidates (the picker choosing
  another pod despite the pin, when other filters ran first, does not move it).  Bindings unused
  for ``evictionTtlSeconds`` (default 300) are dropped by a sweep every
  ``evictionSweepSeconds`` (default 10), run here when the filter is next used rather than on a
  timer (the same bindings go, at the same sweep times).  Nothing is written to the response.

One instance pins one profile's pod: a P/D configuration declares one for decode and one with
``profileName: prefill`` (and its own header).  Parameters are validated as upstream: only the
configuration of the chosen strategy is checked.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final, Literal, Self

from pydantic import BaseModel, ConfigDict, Field, model_validator

from scorers.affinity import (
    SESSION_TOKEN_HEADER,
    decode_session_token,
    encode_session_token,
    header_value,
)
from scorers.base import (
    Endpoint,
    LLMRequest,
    Plugin,
    PluginContext,
    SchedulingResult,
    register,
)
from scorers.request_data import RESPONSE_HEADERS

ENCODED_ENDPOINT_HEADER: Final = "encoded_endpoint_header"
SESSION_ID: Final = "session_id"
DEFAULT_SESSION_ID_HEADER: Final = "x-session-id"
DEFAULT_EVICTION_TTL_S: Final = 300.0
DEFAULT_EVICTION_SWEEP_S: Final = 10.0


def normalized_header(name: str) -> str:
    """A configured header name as requests carry it: lower case, trimmed; blank → the
    default ``x-session-token``."""
    return name.strip().lower() or SESSION_TOKEN_HEADER


class _Strict(BaseModel):
    # Strict, as upstream's Go decoding: "300" is not a number.
    model_config = ConfigDict(extra="forbid", strict=True)


class EncodedEndpointHeaderConfig(_Strict):
    header: str = Field(default="", description="Header carrying the token ('': x-session-token).")


class SessionIdSource(_Strict):
    header: str = ""
    attribute: str = ""
    producer: str = ""


class SessionIdConfig(_Strict):
    sources: list[SessionIdSource] = Field(default_factory=list)
    # 0 (or unset) means the default, as upstream applies its defaults to zero values.
    evictionTtlSeconds: float = Field(default=0.0, allow_inf_nan=False)
    evictionSweepSeconds: float = Field(default=0.0, allow_inf_nan=False)


class SessionAffinityFilterParameters(_Strict):
    strategy: str = ENCODED_ENDPOINT_HEADER
    profileName: str = Field(default="", description="The profile whose pod is pinned.")
    encodedEndpointHeaderConfig: EncodedEndpointHeaderConfig = Field(
        default_factory=EncodedEndpointHeaderConfig
    )
    sessionIdConfig: SessionIdConfig = Field(default_factory=SessionIdConfig)

    @model_validator(mode="after")
    def _strategy_config(self) -> Self:
        if self.strategy == ENCODED_ENDPOINT_HEADER:
            return self
        if self.strategy != SESSION_ID:
            raise ValueError(
                f"strategy must be {ENCODED_ENDPOINT_HEADER!r} or {SESSION_ID!r}, "
                f"got {self.strategy!r}"
            )
        config = self.sessionIdConfig
        for i, source in enumerate(config.sources):
            if bool(source.header) == bool(source.attribute):
                raise ValueError(
                    f"sessionIdConfig.sources[{i}]: set exactly one of header or attribute"
                )
        for key in ("evictionTtlSeconds", "evictionSweepSeconds"):
            value = getattr(config, key)
            if value < 0:
                raise ValueError(f"sessionIdConfig.{key} must be > 0, got {value:g}")
        return self


@dataclass(slots=True)
class _Binding:
    address: str
    last_seen: float


class SessionBindings:
    """Session identifier → pod, dropped when unused for ``ttl`` seconds, by sweeps due every
    ``sweep`` seconds from creation (upstream's ticker), each run at the first use after it is
    due: a binding is only used or refreshed at a use, so between two uses the sweeps that were
    due drop exactly what one sweep at the latest of them drops."""

    def __init__(self, ttl: float, sweep: float, now: float) -> None:
        self.ttl = ttl
        self.sweep = sweep
        self._next_sweep = now + sweep
        self._bindings: dict[str, _Binding] = {}

    def _sweep_due(self, now: float) -> None:
        if now < self._next_sweep:
            return
        ticks = math.floor((now - self._next_sweep) / self.sweep)
        at = self._next_sweep + ticks * self.sweep  # the latest sweep time passed
        self._next_sweep = at + self.sweep
        expired = [s for s, b in self._bindings.items() if at - b.last_seen > self.ttl]
        for session in expired:
            del self._bindings[session]

    def pod(self, session: str, now: float) -> str | None:
        self._sweep_due(now)
        binding = self._bindings.get(session)
        return binding.address if binding is not None else None

    def bind(self, session: str, address: str, now: float, *, may_move: bool) -> None:
        """Bind (or refresh) ``session`` on ``address``; an existing binding to another pod
        moves only when ``may_move``."""
        self._sweep_due(now)
        binding = self._bindings.get(session)
        if binding is None:
            self._bindings[session] = _Binding(address, now)
        elif binding.address == address or may_move:
            binding.address, binding.last_seen = address, now

    def __len__(self) -> int:
        return len(self._bindings)


def attribute_value(request: LLMRequest, attribute: str, producer: str) -> str | None:
    """A request attribute another plugin published, when it is a string (module docstring)."""
    value = request.data.get(f"{attribute}/{producer}" if producer else attribute)
    return value if isinstance(value, str) else None


@register("session-affinity-filter")
class SessionAffinityFilter(Plugin[SessionAffinityFilterParameters]):
    """Pins a session's requests to its pod (module docstring)."""

    experimental = True

    def __init__(self, name: str, params: BaseModel, context: PluginContext) -> None:
        super().__init__(name, params, context)
        p = self.p
        self.strategy: Literal["encoded_endpoint_header", "session_id"] = (
            SESSION_ID if p.strategy == SESSION_ID else ENCODED_ENDPOINT_HEADER
        )
        self.profile = p.profileName
        self.header = normalized_header(p.encodedEndpointHeaderConfig.header)
        config = p.sessionIdConfig
        self.sources: tuple[SessionIdSource, ...] = tuple(config.sources) or (
            SessionIdSource(header=DEFAULT_SESSION_ID_HEADER),
        )
        self.bindings = SessionBindings(
            config.evictionTtlSeconds or DEFAULT_EVICTION_TTL_S,
            config.evictionSweepSeconds or DEFAULT_EVICTION_SWEEP_S,
            context.clock(),
        )
        # Per request: whether its session's pod was among the candidates (session_id), and
        # the pod of profileName whose token goes in the response (encoded_endpoint_header).
        self._present_key = f"{self.type_name}/{name}/bound-pod-present"
        self._token_pod_key = f"{self.type_name}/{name}/token-pod"

    # -- the session ------------------------------------------------------------------------------

    def session_id(self, request: LLMRequest) -> str:
        """The request's session identifier from the first source that has one ('' if none)."""
        for source in self.sources:
            if source.header:
                value = header_value(request.headers, normalized_header(source.header))
            else:
                value = attribute_value(request, source.attribute, source.producer)
            if value is not None and value.strip():
                return value.strip()
        return ""

    def _wanted(self, request: LLMRequest, endpoints: Sequence[Endpoint]) -> str | None:
        if self.strategy == ENCODED_ENDPOINT_HEADER:
            token = header_value(request.headers, self.header)
            return decode_session_token(token) if token else None
        session = self.session_id(request)
        if not session:
            return None
        pod = self.bindings.pod(session, self.context.clock())
        if pod is not None:
            # Read back after the decision: only a pod missing from here moves the session.
            request.data[self._present_key] = any(e.address == pod for e in endpoints)
        return pod

    # -- Filter -------------------------------------------------------------------------------

    def filter(self, request: LLMRequest, endpoints: Sequence[Endpoint]) -> list[Endpoint]:
        if not endpoints:
            return []
        wanted = self._wanted(request, endpoints)
        pinned = [e for e in endpoints if e.address == wanted] if wanted else []
        return pinned[:1] or list(endpoints)

    # -- PreRequest: bind the session (session_id), note the profile's pod (header) ---------------

    def _chosen(self, result: SchedulingResult) -> str | None:
        outcome = result.profiles.get(self.profile or result.primary_profile)
        return outcome.targets[0].address if outcome is not None and outcome.targets else None

    def pre_request(self, request: LLMRequest, result: SchedulingResult) -> None:
        if self.strategy == ENCODED_ENDPOINT_HEADER:
            if self.profile:
                request.data[self._token_pod_key] = self._chosen(result)
            return
        session = self.session_id(request)
        chosen = self._chosen(result)
        if not session or chosen is None:
            return
        # No record (the filter did not run, or found no binding then) is no evidence that
        # the pod left: only a recorded absence moves the session.
        may_move = request.data.get(self._present_key) is False
        self.bindings.bind(session, chosen, self.context.clock(), may_move=may_move)

    # -- ResponseHeader: the token for the client (encoded_endpoint_header) --------------------

    def response_header(self, request: LLMRequest, endpoint: Endpoint | None) -> None:
        if self.strategy != ENCODED_ENDPOINT_HEADER:
            return
        if self.profile:
            address = request.data.get(self._token_pod_key)
        else:
            address = endpoint.address if endpoint is not None else None
        if isinstance(address, str):
            headers: dict[str, str] = request.data.setdefault(RESPONSE_HEADERS, {})
            headers[self.header] = encode_session_token(address)
