"""The consumers of ``predicted-latency-producer``'s predictions (`scorers.predicted_latency`),
as llm-d-router's: ``latency-scorer``, ``slo-headroom-tier-filter`` and ``latency-slo-admitter``.
Each reads the producer named by ``latencyPredictionInfoProducerName`` (default upstream's
``predicted-latency-producer``, created by the configuration loader when missing, as upstream).
Their rules are upstream's; the predictions behind them are this EPP's own estimate, not
upstream's predictor sidecar (see `scorers.predicted_latency`).

``latency-scorer`` scores headroom (``SLO − predicted``, per TTFT and TPOT):

* endpoints with no negative headroom (or no prediction) are scored, the others get 0;
* when all are negative: only the idle ones (no request dispatched there by the producer), if
  any; else the least severe group: TPOT missed only, then TTFT missed only, then both;
* within the group, each headroom's absolute value is min-max normalized, blended
  ``ttftWeight : tpotWeight`` (a dimension with no spread gives its weight to the other), and
  ``headroomSelectionStrategy`` ``least`` (default) scores the smallest headroom highest,
  packing requests on endpoints that only just meet the SLO and keeping the others free;
  ``most`` the largest.  Negative headroom is always scored ``least`` (the smallest deficit).
  Scores are upstream's hundredths, ``(⌊100 · x⌋ + 1) / 100``, capped at 1 (upstream's reach
  1.01; the profile clamps them anyway);
* with no prediction at all (before the speeds are learned), upstream's composite fallback:
  ``compositeKVWeight`` × free KV + ``compositeQueueWeight`` × (max queue − queue) / max queue
  + ``compositePrefixWeight`` × prefix score, the weights normalized, rounded to hundredths.

``slo-headroom-tier-filter`` keeps the endpoints with no negative headroom, or, with
probability ``epsilonExploreNeg`` (default 0.01), the others instead, so an overloaded endpoint
is tried now and then and its predictions corrected; endpoints without a prediction belong to
the negative tier; one tier alone, or no prediction at all, keeps what there is.

``latency-slo-admitter`` drops a sheddable request (negative priority) that states an SLO
header when the producer has predictions and no endpoint is valid (both SLOs predicted met),
idle (``vllm:num_requests_running`` 0) or cold (KV cache under 2 %, where predictions are least
reliable), with upstream's message "request cannot be admitted: no valid endpoint available to
serve the request".  The status is 429, as every request this EPP sheds (``probabilistic-
admitter`` too): upstream's director wraps any admitter's denial as an internal error (500),
which tells clients and retry policies the server failed when it chose to shed.

Parameters are validated where upstream takes any value: negative weights and an unknown
strategy (which upstream scores as ``least``) are errors.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Final, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field

from scorers.base import (
    Endpoint,
    LLMRequest,
    Plugin,
    register,
)
from scorers.predicted_latency import (
    TPOT_SLO_HEADERS,
    TTFT_SLO_HEADERS,
    PredictedLatencyProducer,
    bind_latency_producer,
    latency_predictions,
    prefix_match,
    prefix_score,
    slo_ms,
)
from scorers.request_data import LatencyPredictionInfo

_STEPS: Final = 100  # upstream's scores are whole hundredths
_EPSILON: Final = 1e-9
COLD_KV_USAGE: Final = 0.02
# Upstream's answer, word for word: its director's prefix and the admitter's reason.
DENIAL: Final = "request cannot be admitted: no valid endpoint available to serve the request"


class ConsumerParameters(BaseModel):
    """What every consumer takes: the producer it reads."""

    model_config = ConfigDict(extra="forbid")

    latencyPredictionInfoProducerName: str = ""


ConsumerParamsT = TypeVar("ConsumerParamsT", bound=ConsumerParameters)


class _LatencyConsumer(Plugin[ConsumerParamsT]):
    """A plugin reading the producer named by ``latencyPredictionInfoProducerName``."""

    _producer: PredictedLatencyProducer | None = None

    def bind(self, plugins: Mapping[str, object]) -> None:
        self._producer = bind_latency_producer(
            self, self.p.latencyPredictionInfoProducerName, plugins
        )

    def infos(self, request: LLMRequest) -> Mapping[str, LatencyPredictionInfo]:
        return latency_predictions(
            request, self._producer, self.p.latencyPredictionInfoProducerName
        )


def _negative(info: LatencyPredictionInfo) -> bool:
    return info.ttft_headroom_ms < 0 or info.tpot_headroom_ms < 0


# ---------------------------------------------------------------------------------------------
# latency-scorer


class LatencyScorerParameters(ConsumerParameters):
    ttftWeight: float = Field(default=0.8, ge=0.0, description="TTFT headroom's share.")
    tpotWeight: float = Field(default=0.2, ge=0.0, description="TPOT headroom's share.")
    headroomSelectionStrategy: Literal["least", "most"] = Field(
        default="least",
        description="least: pack onto endpoints just meeting the SLO; most: the safest margin.",
    )
    compositeKVWeight: float = Field(default=1.0, ge=0.0)
    compositeQueueWeight: float = Field(default=1.0, ge=0.0)
    compositePrefixWeight: float = Field(default=1.0, ge=0.0)
    prefixMatchInfoProducerName: str = ""


_Entry = tuple[str, LatencyPredictionInfo | None]


@register("latency-scorer")
class LatencyScorer(_LatencyConsumer[LatencyScorerParameters]):
    """Scores predicted SLO headroom (module docstring)."""

    def score(self, request: LLMRequest, endpoints: Sequence[Endpoint]) -> dict[str, float]:
        infos = self.infos(request)
        entries: list[_Entry] = [(e.address, infos.get(e.address)) for e in endpoints]
        if all(info is None for _, info in entries):
            return self.composite_scores(request, endpoints)
        scores = {e.address: 0.0 for e in endpoints}
        # Upstream counts an endpoint without a prediction among the positive ones.
        positive = [(a, i) for a, i in entries if i is None or not _negative(i)]
        if positive:
            self._score_group(positive, scores, force_least=False)
            return scores
        negative = [(a, i) for a, i in entries if i is not None]
        idle = [(a, i) for a, i in negative if i.dispatched_requests == 0]
        if idle:
            self._score_group(idle, scores, force_least=True)
            return scores
        tpot_only = [(a, i) for a, i in negative if i.ttft_headroom_ms >= 0]
        ttft_only = [(a, i) for a, i in negative if i.tpot_headroom_ms >= 0]
        both = [(a, i) for a, i in negative if i.ttft_headroom_ms < 0 and i.tpot_headroom_ms < 0]
        group = next(g for g in (tpot_only, ttft_only, both, negative) if g)
        self._score_group(group, scores, force_least=True)
        return scores

    def _score_group(
        self, group: Sequence[_Entry], scores: dict[str, float], *, force_least: bool
    ) -> None:
        p = self.p
        total = p.ttftWeight + p.tpotWeight
        alpha, beta = (p.ttftWeight / total, p.tpotWeight / total) if total > 0 else (1.0, 0.0)
        ttft = [abs(i.ttft_headroom_ms) if i else 0.0 for _, i in group]
        tpot = [abs(i.tpot_headroom_ms) if i else 0.0 for _, i in group]
        ttft_low, tpot_low = min(ttft), min(tpot)
        ttft_range, tpot_range = max(ttft) - ttft_low, max(tpot) - tpot_low
        # A dimension where every endpoint is alike would squeeze all scores together.
        if ttft_range <= _EPSILON < tpot_range:
            alpha, beta = 0.0, 1.0
        elif tpot_range <= _EPSILON < ttft_range:
            alpha, beta = 1.0, 0.0
        most = p.headroomSelectionStrategy == "most" and not force_least
        for (address, _), h_ttft, h_tpot in zip(group, ttft, tpot, strict=True):
            n_ttft = (h_ttft - ttft_low) / ttft_range if ttft_range > _EPSILON else 0.5
            n_tpot = (h_tpot - tpot_low) / tpot_range if tpot_range > _EPSILON else 0.5
            combined = alpha * n_ttft + beta * n_tpot
            steps = int((combined if most else 1.0 - combined) * _STEPS) + 1
            scores[address] = min(1.0, steps / _STEPS)

    def composite_scores(
        self, request: LLMRequest, endpoints: Sequence[Endpoint]
    ) -> dict[str, float]:
        """Upstream's fallback without predictions (module docstring)."""
        p = self.p
        weights = (p.compositeKVWeight, p.compositeQueueWeight, p.compositePrefixWeight)
        total = sum(weights)
        w_kv, w_queue, w_prefix = (w / total for w in weights) if total > 0 else (1.0, 0.0, 0.0)
        longest = max((e.metrics.waiting_requests for e in endpoints), default=0)
        match = prefix_match(request, p.prefixMatchInfoProducerName)
        scores: dict[str, float] = {}
        for e in endpoints:
            queue = (longest - e.metrics.waiting_requests) / longest if longest > 0 else 1.0
            composite = (
                w_kv * (1.0 - e.metrics.kv_cache_usage)
                + w_queue * queue
                + w_prefix * prefix_score(match, e.address)
            )
            # Go's math.Round: halves away from zero (Python's round() goes to even).
            scores[e.address] = math.floor(_STEPS * composite + 0.5) / _STEPS
        return scores


# ---------------------------------------------------------------------------------------------
# slo-headroom-tier-filter


class TierFilterParameters(ConsumerParameters):
    epsilonExploreNeg: float = Field(
        default=0.01,
        ge=0.0,
        le=1.0,
        description="Probability of keeping the negative tier when both tiers have endpoints.",
    )


@register("slo-headroom-tier-filter")
class SLOHeadroomTierFilter(_LatencyConsumer[TierFilterParameters]):
    """Keeps the endpoints predicted to meet the request's SLOs (module docstring)."""

    def filter(self, request: LLMRequest, endpoints: Sequence[Endpoint]) -> list[Endpoint]:
        if len(endpoints) <= 1:
            return list(endpoints)
        infos = self.infos(request)
        positive: list[Endpoint] = []
        negative: list[Endpoint] = []
        unknown: list[Endpoint] = []
        for e in endpoints:
            info = infos.get(e.address)
            if info is None:
                unknown.append(e)
            else:
                (negative if _negative(info) else positive).append(e)
        if not positive and not negative:
            return list(endpoints)
        negative += unknown  # an endpoint without a prediction cannot be said to meet the SLO
        if positive and negative:
            explore = self.context.rng.random() < self.p.epsilonExploreNeg
            return negative if explore else positive
        return positive or negative


# ---------------------------------------------------------------------------------------------
# latency-slo-admitter


@register("latency-slo-admitter")
class LatencySLOAdmitter(_LatencyConsumer[ConsumerParameters]):
    """Drops sheddable requests no endpoint can serve within their SLO (module docstring)."""

    def admit(self, request: LLMRequest, endpoints: Sequence[Endpoint]) -> str | None:
        """None to admit, else why the request is dropped (429, module docstring)."""
        if request.priority >= 0:
            return None
        if slo_ms(request, TTFT_SLO_HEADERS) <= 0 and slo_ms(request, TPOT_SLO_HEADERS) <= 0:
            return None  # no SLO: nothing to judge the predictions against
        infos = self.infos(request)
        predicted = [infos[e.address] for e in endpoints if e.address in infos]
        if not predicted:
            return None  # no predictions: fail open, as upstream
        if any(i.is_valid for i in predicted) or any(
            e.metrics.running_requests == 0 or e.metrics.kv_cache_usage < COLD_KV_USAGE
            for e in endpoints
        ):
            return None
        return DENIAL
