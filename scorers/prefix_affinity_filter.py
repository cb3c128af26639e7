"""``prefix-cache-affinity-filter``: llm-d-router's filter that narrows the candidates to the
"sticky" endpoints, those already holding most of the request's prompt, unless they are too
busy.  Declared several times with different thresholds it makes tiers (upstream's
predicted-latency configuration: 0.99 before the SLO tier filter, 0.8 after it).

* An endpoint is sticky when its prefix-cache score (the prefix producer's tier-weighted
  matched blocks over the request's blocks; ``prefixMatchInfoProducerName``, default upstream's
  ``approx-prefix-cache-producer``, which the configuration loader creates when missing) is at
  least ``affinityThreshold`` (default 0.8; 0 or less turns the filter off).
* No sticky endpoint: every candidate is kept.  With probability ``explorationProbability``
  (default 0) the filter keeps every candidate anyway, so other endpoints get to cache the
  prefix too.
* The load gate: when the best sticky endpoint's TTFT exceeds the best other endpoint's by
  more than ``maxTTFTPenaltyMs`` (default 18000; 0 turns the gate off), stickiness is broken
  and every candidate is kept.  The TTFT is, with ``ttftSource: prefillThroughput`` (default),
  the prefill tokens in flight there over ``peakPrefillThroughput`` tokens/s (default 15928,
  upstream's measurement for Qwen 32B on two H100s; set yours), or, with ``latencyPredictor``,
  the ``predicted-latency-producer``'s prediction (``latencyPredictionInfoProducerName``), which
  also counts this request's own uncached tokens on each endpoint.  An endpoint without a
  prediction is never the fastest; with none at all the gate cannot break stickiness.

As upstream, except where the data come from: the in-flight prefill tokens are the EPP's own
count (prompt tokens not cached there, of requests routed there that have not produced their
first token: upstream's ``inflight-load-producer``, built in here; ``inFlightLoadProducerName``
may only name a declared one, whose output estimate, if it makes one, counts too:
`scorers.inflight_load`), read when the filter runs, and the
predictions are this EPP's estimate rather than upstream's sidecar's
(`scorers.predicted_latency`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Literal, Self

from pydantic import BaseModel, ConfigDict, Field, model_validator

from scorers.base import Endpoint, LLMRequest, Plugin, register
from scorers.inflight_load import (
    InFlightLoadProducer,
    bind_in_flight_producer,
    queued_prefill_tokens,
)
from scorers.predicted_latency import (
    PredictedLatencyProducer,
    bind_latency_producer,
    latency_predictions,
    prefix_match,
    prefix_score,
)


class AffinityFilterParameters(BaseModel):
    model_config = ConfigDict(extra="forbid")

    affinityThreshold: float = Field(
        default=0.8, le=1.0, description="Prefix-cache score from which an endpoint is sticky."
    )
    explorationProbability: float = Field(
        default=0.0, ge=0.0, le=1.0, description="Probability of keeping every endpoint."
    )
    maxTTFTPenaltyMs: float = Field(
        default=18000.0,
        ge=0.0,
        description="Extra TTFT (ms) of the best sticky endpoint over the best other one that "
        "breaks stickiness; 0 always sticks.",
    )
    ttftSource: Literal["prefillThroughput", "latencyPredictor"] = "prefillThroughput"
    peakPrefillThroughput: float = Field(
        default=15928.0, ge=0.0, description="Prefill tokens per second (prefillThroughput)."
    )
    prefixMatchInfoProducerName: str = ""
    latencyPredictionInfoProducerName: str = ""
    inFlightLoadProducerName: str = ""

    @model_validator(mode="after")
    def _throughput_needed(self) -> Self:
        if (
            self.ttftSource == "prefillThroughput"
            and self.maxTTFTPenaltyMs > 0
            and self.peakPrefillThroughput == 0
        ):
            raise ValueError(
                "peakPrefillThroughput must be > 0 when ttftSource is prefillThroughput and "
                "maxTTFTPenaltyMs > 0 (it turns in-flight tokens into a TTFT)"
            )
        return self


@register("prefix-cache-affinity-filter")
class PrefixCacheAffinityFilter(Plugin[AffinityFilterParameters]):
    """Keeps the endpoints holding the request's prefix, unless too busy (module docstring)."""

    _producer: PredictedLatencyProducer | None = None
    _in_flight: InFlightLoadProducer | None = None

    def bind(self, plugins: Mapping[str, object]) -> None:
        self._in_flight = bind_in_flight_producer(self, self.p.inFlightLoadProducerName, plugins)
        if self._uses_predictor:
            self._producer = bind_latency_producer(
                self, self.p.latencyPredictionInfoProducerName, plugins
            )

    @property
    def _uses_predictor(self) -> bool:
        # Upstream consumes the predictions only when the gate is on and reads them.
        return self.p.ttftSource == "latencyPredictor" and self.p.maxTTFTPenaltyMs > 0

    def filter(self, request: LLMRequest, endpoints: Sequence[Endpoint]) -> list[Endpoint]:
        p = self.p
        if len(endpoints) <= 1 or p.affinityThreshold <= 0:
            return list(endpoints)
        # No draw at 0, so that the other plugins' random choices do not shift.
        if p.explorationProbability > 0 and self.context.rng.random() < p.explorationProbability:
            return list(endpoints)
        match = prefix_match(request, p.prefixMatchInfoProducerName)
        sticky: list[Endpoint] = []
        others: list[Endpoint] = []
        for e in endpoints:
            (sticky if prefix_score(match, e.address) >= p.affinityThreshold else others).append(e)
        if not sticky:
            return list(endpoints)
        if p.maxTTFTPenaltyMs > 0 and others:
            ttft = self._ttft_ms(request)
            penalty = min(map(ttft, sticky)) - min(map(ttft, others))
            # Both unknown (inf − inf) is no evidence against the sticky endpoints.
            if not math.isnan(penalty) and penalty > p.maxTTFTPenaltyMs:
                return list(endpoints)
        return sticky

    def _ttft_ms(self, request: LLMRequest) -> Callable[[Endpoint], float]:
        if self.p.ttftSource == "latencyPredictor":
            infos = latency_predictions(
                request, self._producer, self.p.latencyPredictionInfoProducerName
            )

            def predicted(e: Endpoint) -> float:
                info = infos.get(e.address)
                return info.ttft_ms if info is not None else math.inf

            return predicted
        rate = self.p.peakPrefillThroughput
        in_flight = self._in_flight

        def from_throughput(e: Endpoint) -> float:
            return 1000.0 * queued_prefill_tokens(e, in_flight) / rate

        return from_throughput
