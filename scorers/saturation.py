"""Saturation and admission, as llm-d-router's ``utilization-detector`` and
``probabilistic-admitter``.

``utilization-detector`` measures how full the pool is: the mean over the candidate endpoints of
``max(waiting / queueDepthThreshold, KV usage / kvCacheUtilThreshold)``, an endpoint whose
metrics are older than ``metricsStalenessThreshold`` (or never scraped) counting as 1, and an
empty pool as 1.  Named by ``flowControl.saturationDetector.pluginRef`` (or the deprecated
top-level ``saturationDetector.pluginRef``), it decides when sheddable requests (negative
InferenceObjective priority) are dropped: at 1 or more (`epp.admission`).  Without one, the same
rule runs with its defaults.  It counts the endpoints it took as full for want of fresh metrics
(``llm_d_epp_flow_control_stale_endpoints``, labelled with its name) and says so in the log at
most every 30 s: a dispatch stall with stale endpoints is a scrape problem, not overload.  Listed
in a profile it is also a filter: it keeps the endpoints
with fresh metrics under both thresholds (× ``1 + headroom``), or all of them when none is.

``concurrency-detector`` measures it from what the EPP itself has in flight instead of scraped
metrics (no scrape lag: a request counts from the moment it is routed): ``requests`` mode,
requests in flight over ``maxConcurrency`` per endpoint, pool-wide; ``tokens`` mode, the prompt
tokens they added to the pods' KV caches (and the output the ``inflight-load-producer`` it reads
estimates for them, when it does: `scorers.inflight_load`) over ``maxTokenConcurrency``;
``hybrid``, the mean over endpoints of the larger ratio.  As a filter it keeps the endpoints
under its limits (× ``1 + headroom``), and none when all are over (as upstream).

``probabilistic-admitter`` drops sheddable requests before it is saturated: with the same mean
``s`` (its own thresholds; metrics never scraped count as 1), with probability
``min(s ** power × k, 1)``.  Requests with a priority of 0 or more always pass.  A dropped
request is answered 429 with the admitter's reason (llm-d-router answers 500: its director wraps
every admitter's denial as an internal error).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Final, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from epp.gauges import GaugeSample
from kvcache.settings import parse_duration
from scorers.base import Endpoint, LLMRequest, Plugin, register
from scorers.inflight_load import InFlightLoadProducer, bind_in_flight_producer, in_flight_tokens

logger = logging.getLogger(__name__)

DEFAULT_QUEUE_DEPTH: Final = 5
DEFAULT_KV_UTILIZATION: Final = 0.8
_STALE_WARN_INTERVAL_S: Final = 30.0  # as upstream: enough to see it, not to flood the log


def utilization(
    endpoints: Sequence[Endpoint],
    queue_threshold: float,
    kv_threshold: float,
    staleness: float | None,
    *,
    is_stale: Callable[[Endpoint], bool] | None = None,
) -> tuple[float, int]:
    """The detector's saturation of ``endpoints`` (module docstring) and how many of them
    count as full because they were never scraped, or (``staleness`` seconds, or ``is_stale``
    when given) scraped too long ago."""
    if not endpoints:
        return 1.0, 0
    total = 0.0
    stale_count = 0
    for ep in endpoints:
        if is_stale is not None:
            stale = is_stale(ep)
        else:
            stale = ep.metrics_unknown or (staleness is not None and ep.metrics_age > staleness)
        stale_count += stale
        total += (
            1.0
            if stale
            else max(
                ep.metrics.waiting_requests / queue_threshold,
                ep.metrics.kv_cache_usage / kv_threshold,
            )
        )
    return total / len(endpoints), stale_count


class DetectorParameters(BaseModel):
    model_config = ConfigDict(extra="forbid")

    queueDepthThreshold: int = Field(
        default=DEFAULT_QUEUE_DEPTH, gt=0, description="Waiting requests at 100 %."
    )
    kvCacheUtilThreshold: float = Field(
        default=DEFAULT_KV_UTILIZATION, gt=0.0, le=1.0, description="KV use at 100 %."
    )
    metricsStalenessThreshold: str = Field(
        default="200ms", description="Older metrics count as saturated (a Go duration)."
    )
    headroom: float = Field(default=0.0, ge=0.0, description="The filter's slack over 100 %.")

    @field_validator("metricsStalenessThreshold")
    @classmethod
    def _positive_duration(cls, value: str) -> str:
        if not parse_duration(value) > 0:
            raise ValueError(f"must be strictly positive, got {value!r}")
        return value


@register("utilization-detector")
class UtilizationDetector(Plugin[DetectorParameters]):
    """The pool's saturation (module docstring); also a filter of the endpoints under it."""

    def __init__(self, name: str, params: BaseModel, context: Any) -> None:
        super().__init__(name, params, context)
        self.staleness = parse_duration(self.p.metricsStalenessThreshold)
        self.stale_endpoints = 0  # at the last saturation measured
        self._clock = context.clock
        self._warned_at = -math.inf

    def saturation(self, endpoints: Sequence[Endpoint]) -> float:
        p = self.p
        value, self.stale_endpoints = utilization(
            endpoints, p.queueDepthThreshold, p.kvCacheUtilThreshold, self.staleness
        )
        now = self._clock()
        if self.stale_endpoints and now - self._warned_at >= _STALE_WARN_INTERVAL_S:
            self._warned_at = now
            logger.warning(
                "%s: %d of %d endpoints have no metrics newer than %s and count as saturated; "
                "if dispatch stalls, check the model servers' metrics scraping (path, port, TLS)",
                self.name,
                self.stale_endpoints,
                len(endpoints),
                p.metricsStalenessThreshold,
            )
        return value

    def telemetry_samples(self) -> Iterable[GaugeSample]:
        yield GaugeSample(
            "llm_d_epp_flow_control_stale_endpoints",
            "Endpoints whose metrics were missing or older than the staleness threshold at the "
            "last saturation measured; they count as saturated.",
            self.stale_endpoints,
            (("detector", self.name),),
        )

    def filter(self, request: LLMRequest, endpoints: Sequence[Endpoint]) -> list[Endpoint]:
        p = self.p
        queue_limit = p.queueDepthThreshold * (1 + p.headroom)
        kv_limit = p.kvCacheUtilThreshold * (1 + p.headroom)
        kept = [
            ep
            for ep in endpoints
            if ep.metrics.updated_at is not None
            and ep.metrics_age <= self.staleness
            and ep.metrics.waiting_requests < queue_limit
            and ep.metrics.kv_cache_usage < kv_limit
        ]
        return kept or list(endpoints)


class ConcurrencyParameters(BaseModel):
    model_config = ConfigDict(extra="forbid")

    maxConcurrency: int = Field(default=100, gt=0, description="Requests per endpoint at 100 %.")
    headroom: float = Field(default=0.0, ge=0.0, description="The filter's slack over 100 %.")
    concurrencyMode: Literal["requests", "tokens", "hybrid"] = "requests"
    maxTokenConcurrency: int = Field(default=1_000_000, gt=0, description="Tokens at 100 %.")
    inFlightLoadProducerName: str = Field(
        default="", description="The inflight-load-producer it reads (the EPP's own counts)."
    )


@register("concurrency-detector")
class ConcurrencyDetector(Plugin[ConcurrencyParameters]):
    """The pool's saturation from the EPP's own in-flight counts (module docstring)."""

    producer: InFlightLoadProducer | None = None

    def bind(self, plugins: Mapping[str, object]) -> None:
        # Its token counts include the producer's output estimate, when it makes one.
        self.producer = bind_in_flight_producer(self, self.p.inFlightLoadProducerName, plugins)

    def _tokens(self, endpoint: Endpoint) -> int:
        return in_flight_tokens(endpoint, self.producer)

    def saturation(self, endpoints: Sequence[Endpoint]) -> float:
        if not endpoints:
            return 1.0
        p = self.p
        n = len(endpoints)
        if p.concurrencyMode == "requests":
            return sum(ep.load.in_flight_requests for ep in endpoints) / (n * p.maxConcurrency)
        if p.concurrencyMode == "tokens":
            tokens = sum(self._tokens(ep) for ep in endpoints)
            return tokens / (n * p.maxTokenConcurrency)
        return (
            sum(
                max(
                    ep.load.in_flight_requests / p.maxConcurrency,
                    self._tokens(ep) / p.maxTokenConcurrency,
                )
                for ep in endpoints
            )
            / n
        )

    def filter(self, request: LLMRequest, endpoints: Sequence[Endpoint]) -> list[Endpoint]:
        p = self.p
        requests_limit = int(p.maxConcurrency * (1 + p.headroom))
        tokens_limit = int(p.maxTokenConcurrency * (1 + p.headroom))
        mode = p.concurrencyMode
        return [
            ep
            for ep in endpoints
            if (mode == "tokens" or ep.load.in_flight_requests < requests_limit)
            and (mode == "requests" or self._tokens(ep) < tokens_limit)
        ]


class AdmitterParameters(BaseModel):
    model_config = ConfigDict(extra="forbid")

    queueDepthThreshold: int = Field(default=DEFAULT_QUEUE_DEPTH, gt=0)
    kvCacheUtilThreshold: float = Field(default=DEFAULT_KV_UTILIZATION, gt=0.0)
    power: float = Field(default=5.0, gt=0.0)
    k: float = Field(default=300.0, gt=0.0)


@register("probabilistic-admitter")
class ProbabilisticAdmitter(Plugin[AdmitterParameters]):
    """Drops sheddable requests with a probability that rises steeply with saturation."""

    def rejection_probability(self, endpoints: Sequence[Endpoint]) -> float:
        p = self.p
        saturation, _ = utilization(endpoints, p.queueDepthThreshold, p.kvCacheUtilThreshold, None)
        return min(math.pow(saturation, p.power) * p.k, 1.0)

    def admit(self, request: LLMRequest, endpoints: Sequence[Endpoint]) -> str | None:
        """None to admit, else why the request is dropped."""
        if request.priority >= 0 or not endpoints:
            return None
        probability = self.rejection_probability(endpoints)
        if self.context.rng.random() < probability:
            return (
                f"{self.name}: sheddable request dropped (rejection probability {probability:.2f})"
            )
        return None
