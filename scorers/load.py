"""Load scorers: prefer the endpoint with the least work on it.

Two sources of load:

* what the model server reports on ``/metrics`` (``Endpoint.metrics``: waiting and running
  requests, KV-cache usage), refreshed by the scraper and possibly stale;
* what the EPP itself routed and has not seen finish (``Endpoint.load``), always current.

A scorer reading scraped metrics leaves an endpoint that was never scraped unscored (0, and out of
the min and max), and scores one whose metrics are old on its last ones, as llm-d-router's
scorers do (they skip only metrics never written).  Old is not full: a busy pod answers its
``/metrics`` late, and scoring it 0 once its last answer was 200 ms old sent the follow-up of a
prompt it held to another server on a loaded machine (issue 14, "busy is not dead").  The
Inference Extension's utilization detector, which does count stale metrics as saturated, is
admission's business (`epp.admission`), not a scorer's.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Final

from pydantic import BaseModel, ConfigDict, Field

from scorers.base import (
    Endpoint,
    LLMRequest,
    NoParameters,
    Plugin,
    PluginContext,
    register,
)
from scorers.disagg import cached_tokens_on
from scorers.inflight_load import (
    InFlightLoadProducer,
    bind_in_flight_producer,
    queued_prefill_tokens,
)

DEFAULT_TOKEN_QUEUE_THRESHOLD: Final = 4_194_304  # upstream's: 128 requests of 32k tokens


def inverse_min_max(
    endpoints: Sequence[Endpoint], load: Callable[[Endpoint], float]
) -> dict[str, float]:
    """``(max - x) / (max - min)`` over the endpoints with metrics; all equal → 1.0; never
    scraped → 0.0, without taking part in the min and max (upstream leaves it unscored)."""
    scores: dict[str, float] = {}
    known: list[tuple[str, float]] = []
    for endpoint in endpoints:
        if endpoint.metrics_unknown:
            scores[endpoint.address] = 0.0
        else:
            known.append((endpoint.address, load(endpoint)))
    if not known:
        return scores
    low = min(value for _, value in known)
    high = max(value for _, value in known)
    if high == low:
        for address, _ in known:
            scores[address] = 1.0
        return scores
    span = high - low
    for address, value in known:
        scores[address] = (high - value) / span
    return scores


@register("queue-scorer")
class QueueScorer(Plugin[NoParameters]):
    """Shortest waiting queue (``vllm:num_requests_waiting``), min-max normalized over the
    candidates: ``(maxQ - q) / (maxQ - minQ)``; all equal → 1.0."""

    def score(self, request: LLMRequest, endpoints: Sequence[Endpoint]) -> dict[str, float]:
        return inverse_min_max(endpoints, lambda e: e.metrics.waiting_requests)


@register("running-requests-size-scorer")
class RunningRequestsSizeScorer(Plugin[NoParameters]):
    """Fewest running requests (``vllm:num_requests_running``), min-max normalized like
    ``queue-scorer``."""

    def score(self, request: LLMRequest, endpoints: Sequence[Endpoint]) -> dict[str, float]:
        return inverse_min_max(endpoints, lambda e: e.metrics.running_requests)


@register("kv-cache-utilization-scorer")
class KVCacheUtilizationScorer(Plugin[NoParameters]):
    """Most free KV cache: ``1 - kv_cache_usage`` (usage clamped to [0, 1]); never scraped → 0."""

    def score(self, request: LLMRequest, endpoints: Sequence[Endpoint]) -> dict[str, float]:
        return {
            e.address: 0.0
            if e.metrics_unknown
            else 1.0 - min(1.0, max(0.0, e.metrics.kv_cache_usage))
            for e in endpoints
        }


@register("kv-cache-scorer")
class KVCacheScorer(KVCacheUtilizationScorer):
    """Older llm-d name of ``kv-cache-utilization-scorer`` (llm-d v0.3 example configs)."""


class LoadAwareParameters(BaseModel):
    model_config = ConfigDict(extra="forbid")

    threshold: int = Field(
        default=128,
        gt=0,
        description="Waiting requests at which an endpoint scores 0 (llm-d: 128).",
    )


@register("load-aware-scorer")
class LoadAwareScorer(Plugin[LoadAwareParameters]):
    """llm-d's absolute queue scorer, not relative to the other candidates: waiting queue
    ``q = 0`` → 0.5; ``q ≥ threshold`` → 0; else ``0.5 · (1 - q / threshold)``; never scraped → 0.
    (The score tops out at 0.5 by llm-d's design, leaving room above for spare capacity.)"""

    def __init__(self, name: str, params: BaseModel, context: PluginContext) -> None:
        super().__init__(name, params, context)
        self.threshold = float(self.p.threshold)

    def score(self, request: LLMRequest, endpoints: Sequence[Endpoint]) -> dict[str, float]:
        threshold = self.threshold
        scores: dict[str, float] = {}
        for endpoint in endpoints:
            waiting = endpoint.metrics.waiting_requests
            if endpoint.metrics_unknown or waiting >= threshold:
                scores[endpoint.address] = 0.0
            elif waiting <= 0:
                scores[endpoint.address] = 0.5
            else:
                scores[endpoint.address] = 0.5 * (1.0 - waiting / threshold)
        return scores


@register("active-request-scorer")
class ActiveRequestScorer(Plugin[NoParameters]):
    """llm-d's in-flight scorer on the load the EPP observes itself
    (``Endpoint.load.in_flight_requests``, never stale): ``(max - n) / max`` over the
    candidates; all idle → 1.0."""

    def score(self, request: LLMRequest, endpoints: Sequence[Endpoint]) -> dict[str, float]:
        busiest = max((e.load.in_flight_requests for e in endpoints), default=0)
        if busiest <= 0:
            return {e.address: 1.0 for e in endpoints}
        return {
            e.address: (busiest - max(0, e.load.in_flight_requests)) / busiest for e in endpoints
        }


class TokenLoadParameters(BaseModel):
    model_config = ConfigDict(extra="forbid")

    queueThresholdTokens: int = Field(
        default=DEFAULT_TOKEN_QUEUE_THRESHOLD,
        description="Tokens in flight at which an endpoint scores 0 (0 or less: the default, "
        "4,194,304, as upstream: 128 requests of 32k tokens).",
    )
    inFlightLoadProducerName: str = Field(
        default="", description="The inflight-load-producer it reads (the EPP's own counts)."
    )


@register("token-load-scorer")
class TokenLoadScorer(Plugin[TokenLoadParameters]):
    """llm-d-router's ``token-load-scorer``: ``1 − min(1, tokens / queueThresholdTokens)``,
    where ``tokens`` is the prefill work in flight on the endpoint (``Endpoint.load
    .in_flight_prefill_tokens``: the uncached prompt tokens of the requests this EPP routed
    there that have not produced a first token, upstream's ``InFlightLoad`` tokens) plus what
    this request would add there (its prompt less what the endpoint holds, per the prefix
    plugins' match; the whole prompt without one, upstream's ``UncachedRequestTokens``).
    When the ``inflight-load-producer`` it reads estimates output, both terms include the
    estimated output and the requests in flight count until they end
    (`scorers.inflight_load`)."""

    def __init__(self, name: str, params: BaseModel, context: PluginContext) -> None:
        super().__init__(name, params, context)
        threshold = self.p.queueThresholdTokens
        self.threshold = float(threshold if threshold > 0 else DEFAULT_TOKEN_QUEUE_THRESHOLD)
        self.producer: InFlightLoadProducer | None = None

    def bind(self, plugins: Mapping[str, object]) -> None:
        self.producer = bind_in_flight_producer(self, self.p.inFlightLoadProducerName, plugins)

    def score(self, request: LLMRequest, endpoints: Sequence[Endpoint]) -> dict[str, float]:
        prompt = request.prompt_tokens
        producer = self.producer
        output = producer.estimated_output(request) if producer is not None else 0
        scores = {}
        for endpoint in endpoints:
            cached = cached_tokens_on(request, endpoint.address) or 0
            own = max(0, prompt - cached) + output
            tokens = queued_prefill_tokens(endpoint, producer) + own
            scores[endpoint.address] = 1.0 - min(1.0, tokens / self.threshold)
        return scores
