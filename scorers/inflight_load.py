"""``inflight-load-producer``: llm-d-router's per-endpoint count of the requests and tokens in
flight (upstream ``pkg/epp/framework/plugins/requestcontrol/dataproducer/inflightload``; Beta).

The counts themselves are the EPP's own (`epp.datastore`): every routed request counts on its
endpoint until its response ends, and its uncached prompt tokens until the first response byte
(``EndpointLoad.in_flight_prefill_tokens``) or the end (``in_flight_kv_tokens``).  Declaring the
producer is accepted without parameters; what it adds is upstream's output estimate:

* ``addEstimatedOutputTokens`` (default false): the token counts its consumers read include the
  output the requests in flight are expected to generate, held until each response ends;
* ``outputRatio`` (≥ 0, default 1.5): the estimate is ``round(prompt × outputRatio)``, on the
  whole prompt (cached or not: the answer is generated either way);
* ``maxEstimatedOutputTokens`` (≥ 0, default none): a cap on it.  The request's own
  ``max_tokens`` / ``max_completion_tokens`` / ``max_output_tokens`` (by API, as upstream's
  parsers read them) caps it too.

With the estimate on, a consumer's tokens on an endpoint are, as upstream's: the uncached prompt
tokens of the requests there until they end (not only until their first byte) plus their
estimated output.  The consumers: ``token-load-scorer`` (which also adds this request's own
estimate), ``concurrency-detector`` in ``tokens`` and ``hybrid`` modes, and
``prefix-cache-affinity-filter``'s load gate; each reads the producer its
``inFlightLoadProducerName`` names, or, naming none, the one declared under upstream's default
name ``inflight-load-producer``.  In a P/D decision the estimate also counts on the pod of the
``prefill`` profile until the decode pod's first byte, as upstream releases that profile's
share at the start of the stream.

Upstream's ``prefixMatchInfoProducerName`` (which prefix producer's match discounts the prompt)
is not offered: the discount here is the precise prefix plugins' exact match
(`epp.director.uncached_prompt_tokens`).  ``syncCrossReplicaState`` is accepted: there is no
cross-replica syncer here, so each replica counts its own requests whatever it says.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final

from pydantic import BaseModel, ConfigDict, Field, field_validator

from scorers.base import (
    Endpoint,
    LLMRequest,
    Plugin,
    PluginConfigError,
    PluginContext,
    SchedulingResult,
    Usage,
    register,
)
from scorers.request_data import RESPONSE_TIMING, ResponseTiming

IN_FLIGHT_PRODUCER_TYPE: Final = "inflight-load-producer"
DEFAULT_OUTPUT_RATIO: Final = 1.5
# Upstream releases this profile's share when the response starts: the prefill pod's part of a
# P/D request is over once the decode pod answers.
PREFILL_PROFILE: Final = "prefill"


def _cap(value: Any, *, integral_only: bool = False) -> int | None:
    """A client's output-token cap as upstream's parsers accept it: a non-negative whole number
    (``5.0`` too, except where upstream decodes into an integer); anything else is no cap."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    if isinstance(value, float) and (integral_only or not value.is_integer()):
        return None
    return int(value) if value >= 0 else None


def client_max_output_tokens(request: LLMRequest) -> int | None:
    """The output cap the request itself sets, by API (upstream's ``MaxOutputTokens``); None
    when it sets none.  vLLM's gRPC ``SamplingParams`` are not read here."""
    body = request.body
    params = body.get("sampling_params")
    if request.kind == "completions" and isinstance(params, dict):
        if "input_ids" in body:  # SGLang's /generate: its own key, decoded into an integer
            return _cap(params.get("max_new_tokens"), integral_only=True)
        return _cap(params.get("max_tokens"))  # vLLM's /inference/v1/generate
    keys: tuple[str, ...] = {
        "chat": ("max_completion_tokens", "max_tokens"),
        "completions": ("max_tokens",),
        "responses": ("max_output_tokens",),
        "messages": ("max_tokens",),
    }.get(request.kind, ())
    for key in keys:  # the first valid one wins, as upstream
        cap = _cap(body.get(key))
        if cap is not None:
            return cap
    return None


def estimate_output_tokens(
    prompt_tokens: int, ratio: float, client_cap: int | None, operator_cap: int | None
) -> int:
    """``min(round(prompt × ratio), client_cap, operator_cap)``, 0 for an empty prompt; Go's
    rounding (halves away from zero)."""
    if prompt_tokens <= 0:
        return 0
    estimate = math.floor(prompt_tokens * ratio + 0.5)
    for cap in (client_cap, operator_cap):
        if cap is not None and cap < estimate:
            estimate = cap
    return estimate


class InFlightLoadParameters(BaseModel):
    # Strict, as upstream's Go decoding: "true" is not a boolean, "1.5" not a number.
    model_config = ConfigDict(extra="forbid", strict=True)

    addEstimatedOutputTokens: bool = Field(
        default=False, description="Count the expected output of the requests in flight."
    )
    outputRatio: float | None = Field(
        default=None, allow_inf_nan=False, description="Output per prompt token (unset: 1.5)."
    )
    maxEstimatedOutputTokens: int | None = Field(
        default=None, description="Cap on one request's estimated output (unset: none)."
    )
    syncCrossReplicaState: bool | None = Field(
        default=None, description="Accepted; no cross-replica syncer here."
    )

    @field_validator("outputRatio", "maxEstimatedOutputTokens")
    @classmethod
    def _non_negative(cls, value: float | None) -> float | None:
        if value is not None and value < 0:
            raise ValueError(f"must be non-negative, got {value:g}")
        return value


@dataclass(slots=True)
class _Counter:
    """One endpoint's estimated output tokens in flight.  A request's release goes to the
    counter it added to, so an endpoint removed and re-added at the same address (a new pod)
    starts from zero and is never decremented for its predecessor's requests."""

    tokens: int = 0


@dataclass(slots=True, eq=False)
class _Entry:
    """One request's estimate on one endpoint."""

    counter: _Counter
    tokens: int
    # A prefill profile's share is released at the request's first byte, which the director
    # stamps on its timeline (RESPONSE_TIMING) once the request is routed.
    waits_for_first_byte: LLMRequest | None = None

    def release(self) -> None:
        if self.tokens:
            self.counter.tokens = max(0, self.counter.tokens - self.tokens)
            self.tokens = 0

    def done(self) -> bool:
        if not self.tokens:
            return True
        request = self.waits_for_first_byte
        timing = request.data.get(RESPONSE_TIMING) if request is not None else None
        return isinstance(timing, ResponseTiming) and timing.first_byte_at is not None


@register(IN_FLIGHT_PRODUCER_TYPE)
class InFlightLoadProducer(Plugin[InFlightLoadParameters]):
    """The in-flight counts its consumers read, with upstream's optional output estimate
    (module docstring).  PreRequest adds each chosen endpoint's estimate; ResponseComplete
    takes it back."""

    def __init__(self, name: str, params: BaseModel, context: PluginContext) -> None:
        super().__init__(name, params, context)
        p = self.p
        self.estimates_output: bool = p.addEstimatedOutputTokens
        self.output_ratio = DEFAULT_OUTPUT_RATIO if p.outputRatio is None else p.outputRatio
        self._counters: dict[str, _Counter] = {}
        # Prefill profiles' shares, by endpoint, until their request's first byte.
        self._until_first_byte: dict[str, list[_Entry]] = {}
        self._entries_key = f"{IN_FLIGHT_PRODUCER_TYPE}/{name}/entries"

    def estimated_output(self, request: LLMRequest) -> int:
        """What this producer expects ``request`` to generate (0 without the estimate)."""
        if not self.estimates_output:
            return 0
        return estimate_output_tokens(
            request.prompt_tokens,
            self.output_ratio,
            client_max_output_tokens(request),
            self.p.maxEstimatedOutputTokens,
        )

    def output_in_flight(self, address: str) -> int:
        """Estimated output tokens of the requests in flight on ``address``."""
        pending = self._until_first_byte.get(address)
        if pending:
            # Released here, lazily: the response path has no per-plugin first-byte hook.
            for entry in [e for e in pending if e.done()]:
                entry.release()
                pending.remove(entry)
            if not pending:
                del self._until_first_byte[address]
        counter = self._counters.get(address)
        return counter.tokens if counter is not None else 0

    # -- PreRequest / ResponseComplete -----------------------------------------------------------

    def pre_request(self, request: LLMRequest, result: SchedulingResult) -> None:
        estimate = self.estimated_output(request)
        if estimate <= 0:
            return
        entries = []
        for profile, outcome in result.profiles.items():
            if outcome is None or not outcome.targets:
                continue
            address = outcome.targets[0].address  # the profile's primary target, as upstream
            counter = self._counters.setdefault(address, _Counter())
            counter.tokens += estimate
            if profile == PREFILL_PROFILE:
                entry = _Entry(counter, estimate, waits_for_first_byte=request)
                self._until_first_byte.setdefault(address, []).append(entry)
            else:
                entry = _Entry(counter, estimate)
            entries.append((address, entry))
        request.data[self._entries_key] = entries

    def response_complete(self, request: LLMRequest, endpoint: str, usage: Usage | None) -> None:
        for address, entry in request.data.pop(self._entries_key, ()):
            entry.release()
            pending = self._until_first_byte.get(address)
            if pending is not None and entry in pending:
                pending.remove(entry)
                if not pending:
                    del self._until_first_byte[address]

    # -- EndpointListener ------------------------------------------------------------------------

    def endpoint_added(self, endpoint: Endpoint) -> None:
        pass

    def endpoint_removed(self, endpoint: Endpoint) -> None:
        self._counters.pop(endpoint.address, None)
        self._until_first_byte.pop(endpoint.address, None)


def bind_in_flight_producer(
    plugin: Plugin[Any], name: str, plugins: Mapping[str, object]
) -> InFlightLoadProducer | None:
    """The producer a consumer reads: the one its ``inFlightLoadProducerName`` names (which
    must be a declared ``inflight-load-producer``), else the one declared under upstream's
    default name, if any (None: the EPP's counts alone)."""
    if name:
        named = plugins.get(name)
        if not isinstance(named, InFlightLoadProducer):
            raise PluginConfigError(
                f"{plugin.type_name} {plugin.name!r}: parameters.inFlightLoadProducerName "
                f"{name!r} names no declared {IN_FLIGHT_PRODUCER_TYPE}"
            )
        return named
    default = plugins.get(IN_FLIGHT_PRODUCER_TYPE)
    return default if isinstance(default, InFlightLoadProducer) else None


def in_flight_tokens(endpoint: Endpoint, producer: InFlightLoadProducer | None) -> int:
    """The tokens in flight on ``endpoint`` as ``producer``'s consumers count them for load:
    prompt tokens until their request ends, plus the producer's output estimate."""
    load = max(0, endpoint.load.in_flight_kv_tokens)
    return load + (producer.output_in_flight(endpoint.address) if producer is not None else 0)


def queued_prefill_tokens(endpoint: Endpoint, producer: InFlightLoadProducer | None) -> int:
    """The token load a prefill-minded consumer reads: the prompt tokens waiting for a first
    byte, or, when ``producer`` estimates output, `in_flight_tokens` (upstream then holds a
    request's tokens until it ends)."""
    if producer is not None and producer.estimates_output:
        return in_flight_tokens(endpoint, producer)
    return max(0, endpoint.load.in_flight_prefill_tokens)


__all__ = [
    "IN_FLIGHT_PRODUCER_TYPE",
    "InFlightLoadProducer",
    "bind_in_flight_producer",
    "client_max_output_tokens",
    "estimate_output_tokens",
    "in_flight_tokens",
    "queued_prefill_tokens",
]
