"""``predicted-latency-producer``: llm-d-router's per-endpoint TTFT and TPOT predictions, with
the predictor replaced by what this EPP already measures.

Upstream, the producer sends every candidate's features (prompt length, prefix-cache score,
the pod's scraped metrics, the prefill tokens and requests in flight there) to a latency
predictor sidecar: a separate HTTP training and prediction server, addressed by the EPP's
``PREDICTION_SERVER_URL`` / ``TRAINING_SERVER_URL`` environment variables, that fits XGBoost
models on the TTFTs and TPOTs the producer reports after each response.  It publishes the
answers as a ``LatencyPredictionInfo`` per endpoint, with the headroom against the request's
SLO headers, for ``latency-scorer``, ``slo-headroom-tier-filter``, ``latency-slo-admitter``
(`scorers.latency_slo`) and ``prefix-cache-affinity-filter`` (`scorers.prefix_affinity_filter`).

That sidecar cannot run here, and none is called (when those environment variables are set,
a warning says they have no effect).  Instead each endpoint's times are estimated from the
speeds `scorers.service_rates.ServiceRates` learns from the requests this producer saw routed
and answered:

    TTFT_e = slowness_e · (a + p · (queued_e + uncached_e) + s · in_flight_e)
    TPOT_e = itl + s · (in_flight_e + 1 − running)

* ``uncached_e``: the request's prompt tokens minus what ``e`` holds, per the prefix producer's
  match (``prefixMatchInfoProducerName``, default upstream's ``approx-prefix-cache-producer``,
  which the configuration loader creates when it is missing, as upstream's does);
* ``queued_e`` and ``in_flight_e``: the prefill tokens not yet answered and the requests this
  EPP has in flight on ``e`` (upstream's ``inflight-load-producer`` counts, built in here),
  read once when the producer runs, as upstream does;
* ``a``, ``p``, ``s``, ``slowness_e``: the fixed part of a first token, its cost per token of
  prefill, what each running request adds to an engine step, and how many times slower ``e``'s
  recent first tokens were than the fleet's (`ServiceRates`);
* ``itl`` and ``running``: the mean time per output token of recent streamed answers and the
  mean number of requests that ran beside them, so the line goes through what was observed.

Two consequences to know.  `ServiceRates` fits its line through the fastest fifth of the first
tokens of each size (the requests that waited for nothing else), so a prediction is nearer a
good case than a mean.  And until it has seen about 24 answers with prompts of visibly
different costs, it has no line and this producer publishes no predictions: the consumers then
do what upstream's do when the sidecar is down (composite scores, no tiering, admission open).

With ``streamingMode: false`` (the default, as upstream) the "TTFT" learned and predicted is
the whole request's latency, measured at its end, and TPOT is neutral (valid, 0 headroom), as
upstream trains and neutralizes it.  With ``streamingMode: true`` TTFT is learned from streamed
answers' first bytes and TPOT from their decode.  A TPOT not learned yet is neutral too.

Headroom, validity and the tracked requests are upstream's rules: ``headroom = SLO −
prediction`` with the SLO headers ``x-llm-d-slo-ttft-ms`` / ``x-llm-d-slo-tpot-ms`` (or the
deprecated ``x-slo-ttft-ms`` / ``x-slo-tpot-ms``), a missing SLO counting as 0, so that without
SLOs every endpoint is "invalid" by its predicted time; in streaming mode the TPOT budget is the
request's SLO × ``sloBufferFactor``, lowered to the tightest TPOT SLO of the requests this
producer has running on the endpoint (0 there, a request without one, lifts that bound, as
upstream's queue does).  Endpoints labelled ``endpointRoleLabel: prefill`` get a neutral TPOT.
A running request is forgotten when it ends or ``contextTTL`` after it was routed (upstream
refreshes that TTL on each response chunk, which plugins here are not told about).

Predictions are computed when a consumer first asks for them (after every data producer ran,
so the prefix producer's match is there whatever the producers' order), for the candidates the
producer saw, and kept in ``request.data`` under the producer's name
(`scorers.request_data.LATENCY_PREDICTION_INFO`).
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
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
from scorers.inflight_load import bind_in_flight_producer
from scorers.request_data import (
    RESPONSE_TIMING,
    LatencyPredictionInfo,
    PrefixMatchInfo,
    ResponseTiming,
    latency_prediction_info_key,
    prefix_match_info_key,
)
from scorers.service_rates import Rates, ServiceRates

logger = logging.getLogger(__name__)

PRODUCER_TYPE: Final = "predicted-latency-producer"
DEFAULT_PREFIX_PRODUCER: Final = "approx-prefix-cache-producer"
# The current header first, then its deprecated alias (llm-d-router pkg/epp/metadata).
TTFT_SLO_HEADERS: Final = ("x-llm-d-slo-ttft-ms", "x-slo-ttft-ms")
TPOT_SLO_HEADERS: Final = ("x-llm-d-slo-tpot-ms", "x-slo-tpot-ms")
SIDECAR_ENVIRONMENT: Final = ("PREDICTION_SERVER_URL", "TRAINING_SERVER_URL")
_DEFAULT_CONTEXT_TTL_NS: Final = 5 * 60 * 1_000_000_000
_STEP_MEMORY: Final = 300  # requests: half-life of the decode-step means, as ServiceRates'


def slo_ms(request: LLMRequest, names: Sequence[str]) -> float:
    """The SLO a request's header states, in milliseconds; 0 when absent or not a number (as
    upstream, which logs and carries on).  Not finite counts as absent."""
    for name in names:
        value = request.headers.get(name)
        if value is None:
            continue
        try:
            parsed = float(value)
        except ValueError:
            logger.debug("request %s: %s is not a number: %r", request.request_id, name, value)
            return 0.0
        return parsed if math.isfinite(parsed) else 0.0
    return 0.0


def prefix_match(request: LLMRequest, producer: str) -> PrefixMatchInfo | None:
    """The match a prefix producer published for the request (upstream's default producer
    when ``producer`` is empty)."""
    info = request.data.get(prefix_match_info_key(producer or DEFAULT_PREFIX_PRODUCER))
    return info if isinstance(info, PrefixMatchInfo) else None


def prefix_score(info: PrefixMatchInfo | None, address: str) -> float:
    """Upstream's prefix-cache score of an endpoint: its tier-weighted matched blocks over the
    request's blocks (0 without a match)."""
    if info is None or info.total_blocks <= 0:
        return 0.0
    return info.weighted_blocks.get(address, 0.0) / info.total_blocks


class ProducerParameters(BaseModel):
    """llm-d-router's producer parameters, its names and defaults (module docstring)."""

    model_config = ConfigDict(extra="forbid")

    samplingMean: float = Field(
        default=1000.0,
        description="Deprecated upstream, which no longer uses it; accepted, unused here too.",
    )
    maxDecodeTokenSamplesForPrediction: int = Field(
        default=0,
        description="Deprecated upstream, which no longer uses it; accepted, unused here too.",
    )
    sloBufferFactor: float = Field(
        default=1.0, gt=0.0, description="Multiplies the TPOT SLO budgets (streaming mode)."
    )
    contextTTL: int = Field(
        default=_DEFAULT_CONTEXT_TTL_NS,
        ge=0,
        description="Nanoseconds (a Go time.Duration in JSON) after which a request still "
        "counted as running is forgotten; 0 keeps it until it ends.",
    )
    streamingMode: bool = Field(
        default=False, description="Learn TTFT and TPOT from streamed answers, not end to end."
    )
    endpointRoleLabel: str = Field(
        default="", description="Pod label whose value 'prefill' makes an endpoint's TPOT neutral."
    )
    predictInProduce: bool = Field(
        default=True, description="false: learn, but publish no predictions."
    )
    prefixMatchInfoProducerName: str = Field(
        default="", description="The prefix producer whose match gives the uncached tokens."
    )
    inFlightLoadProducerName: str = Field(
        default="", description="An inflight-load-producer (the EPP's own counts)."
    )
    useEncoderCacheFeatures: bool = Field(
        default=False, description="Upstream's sidecar features; not offered here."
    )
    encoderCacheMatchInfoProducerName: str = Field(
        default="",
        description="Read upstream only with useEncoderCacheFeatures, which is not offered here: "
        "accepted, unused, as upstream does without it.",
    )

    @field_validator("contextTTL", mode="before")
    @classmethod
    def _nanoseconds(cls, value: Any) -> Any:
        # Upstream decodes a time.Duration from JSON, which takes an integer of nanoseconds
        # only: "5m" fails there, so it fails here too rather than load a config upstream
        # refuses.
        if isinstance(value, str | bool):
            raise ValueError(
                "contextTTL is an integer of nanoseconds (a Go time.Duration in JSON), e.g. "
                f"300000000000 for 5m; got {value!r}"
            )
        return value

    @field_validator("useEncoderCacheFeatures")
    @classmethod
    def _no_encoder_features(cls, value: bool) -> bool:
        if value:
            raise ValueError(
                "the encoder-cache sizes are inputs of upstream's predictor sidecar; this EPP's "
                "estimate (scorers.predicted_latency) has no such input: remove "
                "useEncoderCacheFeatures or set it to false"
            )
        return value


@dataclass(slots=True)
class _Candidate:
    """One candidate as the producer saw it when it ran (upstream's Produce-time snapshot)."""

    endpoint: Endpoint
    queued_tokens: int
    in_flight: int


@dataclass(slots=True)
class _RequestState:
    candidates: list[_Candidate]
    ttft_slo_ms: float
    tpot_slo_ms: float
    published: bool = False
    # Set in pre_request: the pod computing the prompt, its prefill work ahead and the requests
    # in flight there, what `ServiceRates` learns the first token against.
    decision: tuple[str, int, int] | None = None


@dataclass(slots=True)
class _Running:
    tpot_slo_ms: float
    routed_at: float


@dataclass(slots=True)
class DecodeSteps:
    """Exponentially weighted means of streamed answers' time per output token and of the
    requests running beside them (module docstring: the TPOT line goes through them)."""

    itl_s: float | None = None
    running: float | None = None
    weight: float = field(default=1.0 - 0.5 ** (1.0 / _STEP_MEMORY))

    def observe(self, itl_s: float, running: float) -> None:
        if self.itl_s is None or self.running is None:
            self.itl_s, self.running = itl_s, running
            return
        self.itl_s += self.weight * (itl_s - self.itl_s)
        self.running += self.weight * (running - self.running)

    def predict(self, rates: Rates, in_flight: int) -> float | None:
        """Seconds per output token with ``in_flight`` requests already there (None until a
        streamed answer of more than one token was seen)."""
        if self.itl_s is None or self.running is None:
            return None
        step = rates.in_flight_s_per_request
        return max(0.0, self.itl_s + step * (in_flight + 1 - self.running))


@register(PRODUCER_TYPE)
class PredictedLatencyProducer(Plugin[ProducerParameters]):
    """Per-endpoint TTFT and TPOT predictions and their SLO headroom (module docstring).

    Roles: DataProducer (snapshots the candidates' load and the SLO headers), PreRequest
    (tracks the request on its endpoint), ResponseComplete (learns from its timings),
    EndpointListener (forgets removed endpoints); consumers call `predictions`."""

    def __init__(self, name: str, params: BaseModel, context: PluginContext) -> None:
        super().__init__(name, params, context)
        p = self.p
        self.rates = ServiceRates()
        self.steps = DecodeSteps()
        self._running: dict[str, dict[str, _Running]] = {}
        self._ttl_s = p.contextTTL / 1e9
        self._state_key = f"{self.type_name}/{name}"
        self._key = latency_prediction_info_key(name)
        if p.samplingMean != 1000.0 or p.maxDecodeTokenSamplesForPrediction != 0:
            logger.info(
                "%s %r: samplingMean and maxDecodeTokenSamplesForPrediction are deprecated "
                "upstream, where mid-stream TPOT predictions were removed; they change nothing",
                self.type_name,
                name,
            )
        sidecar = [v for v in SIDECAR_ENVIRONMENT if os.environ.get(v)]
        if sidecar:
            logger.warning(
                "%s %r: %s set, but this EPP runs no latency predictor sidecar: it predicts "
                "from the speeds it learns itself (scorers.predicted_latency)",
                self.type_name,
                name,
                " and ".join(sidecar),
            )

    def bind(self, plugins: Mapping[str, object]) -> None:
        bind_in_flight_producer(self, self.p.inFlightLoadProducerName, plugins)

    # -- the request path --------------------------------------------------------------------

    async def prepare(self, request: LLMRequest, endpoints: Sequence[Endpoint]) -> None:
        request.data[self._state_key] = _RequestState(
            candidates=[
                _Candidate(e, e.load.in_flight_prefill_tokens, e.load.in_flight_requests)
                for e in endpoints
            ],
            ttft_slo_ms=slo_ms(request, TTFT_SLO_HEADERS),
            tpot_slo_ms=slo_ms(request, TPOT_SLO_HEADERS),
        )

    def predictions(self, request: LLMRequest) -> Mapping[str, LatencyPredictionInfo]:
        """Endpoint address → prediction for the candidates this producer saw, computed on the
        first call and kept in ``request.data``; empty while there is none to give."""
        state: _RequestState | None = request.data.get(self._state_key)
        if state is not None and not state.published:
            state.published = True
            infos = self._predict(request, state)
            if infos is not None:
                request.data[self._key] = infos
        found = request.data.get(self._key)
        return found if isinstance(found, dict) else {}

    def _predict(
        self, request: LLMRequest, state: _RequestState
    ) -> dict[str, LatencyPredictionInfo] | None:
        p = self.p
        rates = self.rates.rates()
        if not p.predictInProduce or rates is None:
            return None
        match = prefix_match(request, p.prefixMatchInfoProducerName)
        prompt = request.prompt_tokens
        now = self.context.clock()
        infos: dict[str, LatencyPredictionInfo] = {}
        for c in state.candidates:
            address = c.endpoint.address
            uncached = prompt - min(prompt, self.cached_tokens(match, address))
            ttft_s = self.rates.slowness(address) * ServiceRates.predict_ttft(
                rates, c.queued_tokens + uncached, c.in_flight
            )
            tpot_s = self.steps.predict(rates, c.in_flight) if p.streamingMode else None
            running = self._running_on(address, now)
            infos[address] = self.judge(
                ttft_ms=1000.0 * ttft_s,
                tpot_ms=None if tpot_s is None or self._is_prefill(c.endpoint) else 1000 * tpot_s,
                ttft_slo_ms=state.ttft_slo_ms,
                tpot_slo_ms=state.tpot_slo_ms,
                # Upstream peeks at the smallest SLO in the endpoint's queue, 0 included.
                tightest_tpot_slo_ms=min((r.tpot_slo_ms for r in running), default=0.0),
                dispatched=len(running),
            )
        if logger.isEnabledFor(logging.DEBUG):
            logger.debug(
                "request %s: predicted (TTFT ms, TPOT ms) %s",
                request.request_id,
                {a: (round(i.ttft_ms, 1), round(i.tpot_ms, 2)) for a, i in infos.items()},
            )
        return infos

    @staticmethod
    def cached_tokens(match: PrefixMatchInfo | None, address: str) -> int:
        """Prompt tokens ``address`` holds per the match (its unweighted blocks × block size)."""
        if match is None:
            return 0
        return match.matched_blocks.get(address, 0) * match.block_size

    def judge(
        self,
        *,
        ttft_ms: float,
        tpot_ms: float | None,
        ttft_slo_ms: float,
        tpot_slo_ms: float,
        tightest_tpot_slo_ms: float = 0.0,
        dispatched: int = 0,
    ) -> LatencyPredictionInfo:
        """Upstream's validity and headroom for one endpoint (module docstring).  ``tpot_ms``
        None is a neutral TPOT (not streaming, a prefill pod, or nothing learned yet);
        ``tightest_tpot_slo_ms``: the smallest TPOT SLO of the requests running there (0: no
        bound); ``dispatched``: how many run there."""
        if tpot_ms is None:
            tpot_valid, tpot_headroom, tpot_ms = True, 0.0, 0.0
        else:
            budget = tpot_slo_ms * self.p.sloBufferFactor
            if tightest_tpot_slo_ms > 0:
                budget = min(budget, tightest_tpot_slo_ms * self.p.sloBufferFactor)
            tpot_valid, tpot_headroom = tpot_ms < budget, budget - tpot_ms
        return LatencyPredictionInfo(
            ttft_valid=ttft_ms < ttft_slo_ms,
            tpot_valid=tpot_valid,
            ttft_headroom_ms=ttft_slo_ms - ttft_ms,
            tpot_headroom_ms=tpot_headroom,
            ttft_ms=ttft_ms,
            tpot_ms=tpot_ms,
            dispatched_requests=dispatched,
        )

    def _is_prefill(self, endpoint: Endpoint) -> bool:
        label = self.p.endpointRoleLabel
        return bool(label) and endpoint.labels.get(label) == "prefill"

    def _running_on(self, address: str, now: float) -> list[_Running]:
        running = self._running.get(address)
        if not running:
            return []
        if self._ttl_s > 0:
            expired = [i for i, r in running.items() if now - r.routed_at > self._ttl_s]
            for request_id in expired:
                del running[request_id]
        return list(running.values())

    # -- after the decision: tracking and learning -------------------------------------------

    def pre_request(self, request: LLMRequest, result: SchedulingResult) -> None:
        state: _RequestState | None = request.data.get(self._state_key)
        if state is None or not result.targets:
            return
        target = result.targets[0].address
        self._running.setdefault(target, {})[request.request_id] = _Running(
            state.tpot_slo_ms, self.context.clock()
        )
        # The first token is the prefill pod's work when another pod prefills (upstream
        # trains TTFT against its prefill target too).
        computing = result.prefill_address or target
        seen = next((c for c in state.candidates if c.endpoint.address == computing), None)
        if seen is None:
            return
        match = prefix_match(request, self.p.prefixMatchInfoProducerName)
        prompt = request.prompt_tokens
        uncached = prompt - min(prompt, self.cached_tokens(match, computing))
        state.decision = (computing, seen.queued_tokens + uncached, seen.in_flight)

    def response_complete(self, request: LLMRequest, endpoint: str, usage: Usage | None) -> None:
        running = self._running.get(endpoint)
        if running is not None:
            running.pop(request.request_id, None)
            if not running:
                del self._running[endpoint]
        state: _RequestState | None = request.data.get(self._state_key)
        timing: ResponseTiming | None = request.data.get(RESPONSE_TIMING)
        if state is None or state.decision is None or timing is None:
            return
        computing, work, in_flight = state.decision
        first, finished = timing.first_byte_at, timing.finished_at
        if finished is None:
            return
        if not self.p.streamingMode:
            # Upstream's non-streaming mode learns the whole request's latency as its "TTFT".
            self.rates.observe(
                work_tokens=work,
                in_flight=in_flight,
                ttft_s=finished - timing.routed_at,
                endpoint=computing,
            )
            return
        if not request.stream or first is None:
            return  # an answer not streamed has its first byte at its end
        output = usage.completion_tokens if usage is not None else None
        self.rates.observe(
            work_tokens=work,
            in_flight=in_flight,
            ttft_s=first - timing.routed_at,
            decode_s=finished - first,
            output_tokens=output,
            running=timing.running_while_decoding,
            pool_running=timing.pool_running_while_decoding,
            endpoint=computing,
        )
        beside = timing.running_while_decoding
        if output is not None and output > 1 and beside is not None and finished > first:
            self.steps.observe((finished - first) / (output - 1), max(1.0, beside))

    def endpoint_added(self, endpoint: Endpoint) -> None:
        pass

    def endpoint_removed(self, endpoint: Endpoint) -> None:
        self.rates.forget(endpoint.address)
        self._running.pop(endpoint.address, None)


def bind_latency_producer(
    plugin: Plugin[Any], producer_name: str, plugins: Mapping[str, object]
) -> PredictedLatencyProducer | None:
    """The producer a consumer reads (``latencyPredictionInfoProducerName``, default upstream's
    ``predicted-latency-producer``, which the configuration loader creates when a consumer
    needs it).  A name given that is not a declared producer is an error; the default one
    missing (a scheduler assembled by hand) leaves the consumer reading ``request.data``."""
    name = producer_name or PRODUCER_TYPE
    producer = plugins.get(name)
    if isinstance(producer, PredictedLatencyProducer):
        return producer
    if producer is None and not producer_name:
        return None
    found = "no plugin" if producer is None else f"a {getattr(producer, 'type_name', '?')}"
    raise PluginConfigError(
        f"{plugin.type_name} {plugin.name!r}: parameters.latencyPredictionInfoProducerName "
        f"{name!r} names {found}; declare a {PRODUCER_TYPE} of that name"
    )


def latency_predictions(
    request: LLMRequest, producer: PredictedLatencyProducer | None, producer_name: str
) -> Mapping[str, LatencyPredictionInfo]:
    """What a consumer reads: its bound producer's predictions, else whatever a producer of
    that name published in ``request.data``."""
    if producer is not None:
        return producer.predictions(request)
    found = request.data.get(latency_prediction_info_key(producer_name or PRODUCER_TYPE))
    return found if isinstance(found, Mapping) else {}
