"""``prefill-cost-scorer``: prefer the endpoint where this request's prefill finishes first.

Time to first token on a pod is, to first order, the prefill work queued ahead of the request
plus the request's own uncached prefill, both in tokens of prefill work (DESIGN.md: "decisions
weigh work, not just ratios").  So the scorer estimates, per candidate ``e``, a cost in tokens:

    cost_e = uncachedTokenWeight · (computed_tokens − cached_tokens_e)⁺
           + uncomputedTokenWeight · (the rest of prompt_tokens − cached_tokens_e)
           + queued_prefill_tokens_e
           + inFlightRequestTokens · in_flight_requests_e
           + kv_pressure_e

* ``cached_tokens_e``: prompt tokens the endpoint holds in its prefix cache, exactly, from
  ``request.data[PREFIX_MATCHED_TOKENS]`` (the precise scorer writes it, predicted entries
  included).  With no prefix information (no events, no tokenizer) it is 0 everywhere and the
  scorer is plain least-work routing.
* ``computed_tokens``: the longest prefix any endpoint really holds per the KV events
  (``request.data[PREFIX_COMPUTED_TOKENS]``, predictions excluded).  Uncached tokens within it
  are copies of another pod's blocks; tokens beyond it are new to the fleet and cost the same
  everywhere except on a pod predicted to hold them, whose first prefill is still running.
  Without it (no precise scorer) every uncached token is charged ``uncachedTokenWeight``.
* ``queued_prefill_tokens_e``: uncached prompt tokens of requests this EPP routed there that
  have not produced their first token (``Endpoint.load.in_flight_prefill_tokens``): never stale.
* ``uncachedTokenWeight`` > 1 charges a miss for more than the time it costs this request: an
  uncached prefill delays every request queued behind it, and a prefix copied to a second pod
  evicts something else there.  It is the lever between cache affinity and spreading.
* ``in_flight_requests_e`` (decoding requests slow every step and hold KV blocks) and the KV
  term (``kv_cache_usage`` above ``kvPressureThreshold`` costs linearly up to
  ``kvPressureTokens`` at a full cache) weigh load.  The KV term measures load by the memory
  running requests hold, which a request count cannot do when answers are long; by default it
  is linear from an empty cache, and a pod 20 points fuller costs about 3,300 tokens, less than
  missing a 1,200-token question, so load decides between pods that hold the same prefix and
  only a deep imbalance sends a request away from its prefix.

Scores are ``(min_cost + smoothingTokens) / (cost_e + smoothingTokens)``: 1.0 for the cheapest,
0.5 for twice its cost, so the scorer composes with others by weight, and alone with
``max-score-picker`` it is argmin cost.  A hot prefix spills by itself: once the holder's queue
is longer than the full prefill elsewhere, another pod wins; with speculative indexing that pod
becomes a holder too.  Endpoints with stale scraped metrics get the KV term at its maximum.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from pydantic import BaseModel, ConfigDict, Field

from scorers.base import Endpoint, LLMRequest, Plugin, PluginContext, register
from scorers.request_data import PREFIX_COMPUTED_TOKENS, PREFIX_MATCHED_TOKENS


class PrefillCostParameters(BaseModel):
    """Weights of ``prefill-cost-scorer`` (module docstring); every term is in prompt tokens."""

    model_config = ConfigDict(extra="forbid")

    uncachedTokenWeight: float = Field(default=4.0, ge=0.0, le=100.0)
    """Cost of one uncached prompt token on a candidate, relative to one token of prefill
    already queued there.  1 = this request's TTFT alone; larger = stickier to the cache.
    Measured (``benchmarks/routing.py``, Mooncake trace): 1 loses a third of the hits, 3-4 is
    best at every load, 6-8 starts to queue behind hot pods.  Useful range 2-6."""
    uncomputedTokenWeight: float = Field(default=2.0, ge=0.0, le=100.0)
    """Cost of one uncached prompt token that no endpoint has computed yet according to the KV
    events (``PREFIX_COMPUTED_TOKENS``, written by ``precise-prefix-cache-scorer``): the part
    of the prompt new to the fleet, or held only as a prediction while its first prefill runs.
    Those tokens are computed wherever the request goes, so no pod's copy is duplicated; a
    weight below ``uncachedTokenWeight`` lets a burst of a new prefix spread over idle pods
    instead of queueing behind the first prefill (virtual-time burst of 10 requests on a new
    2,000-token prefix, 4 pods: worst TTFT 392 ms at 4, 253 ms at 2, 245 ms at 1), while 1
    copies more (shared-prefix shape at load 0.9: hit rate 96.2 % at 2, 95.9 % at 1).  Equal
    to ``uncachedTokenWeight`` turns the distinction off.  Range 1 to uncachedTokenWeight."""
    inFlightRequestTokens: float = Field(default=250.0, ge=0.0, le=1_000_000.0)
    """Token-equivalent cost of each request in flight on the candidate (decode load and the
    KV blocks it holds).  It is what spreads a hot prefix whose requests each add little
    prefill (chat sessions on a shared system prompt: TTFT p90 0.154 s at 200, 0.086 s at 500)
    and keeps decode from piling up on the pods that won the popular prefixes (shared-prefix
    shape with 1,000-token answers: TTFT p99 33 s at 0).  Larger values spill warm requests
    (trace hit rate 31.5 % at 200, 30.9 % at 500 at load 0.9).  Range 200-1000."""
    waitingRequestTokens: float = Field(default=0.0, ge=0.0, le=1_000_000.0)
    """Token-equivalent cost of each request the pod itself reports waiting
    (``vllm:num_requests_waiting``, scraped): requests it cannot admit yet, including those
    routed by other EPP replicas."""
    kvPressureThreshold: float = Field(default=0.0, ge=0.0, le=1.0)
    """KV-cache usage (blocks held by running requests) above which the pressure term grows."""
    kvPressureTokens: float = Field(default=16384.0, ge=0.0, le=10_000_000.0)
    """Pressure term at a full cache, growing linearly from the threshold (default: one
    prefill chunk of vLLM's default ``max_num_batched_tokens``); 0 turns the guard off."""
    smoothingTokens: float = Field(default=16.0, gt=0.0, le=1_000_000.0)
    """Added to every cost before the ratio, so near-zero costs do not make huge differences."""


@register("prefill-cost-scorer")
class PrefillCostScorer(Plugin):
    """Least prefill work to the first token; see the module docstring."""

    Parameters = PrefillCostParameters

    def __init__(self, name: str, params: BaseModel, context: PluginContext) -> None:
        super().__init__(name, params, context)
        assert isinstance(params, PrefillCostParameters)
        self.p = params

    def costs(self, request: LLMRequest, endpoints: Sequence[Endpoint]) -> dict[str, float]:
        """Estimated cost per candidate, in tokens of prefill work (exposed for explanations
        and tests)."""
        p = self.p
        total = request.prompt_tokens
        cached: Mapping[str, int] = request.data.get(PREFIX_MATCHED_TOKENS) or {}
        computed: int | None = request.data.get(PREFIX_COMPUTED_TOKENS)
        fresh_weight = p.uncomputedTokenWeight
        threshold = p.kvPressureThreshold
        span = 1.0 - threshold
        costs: dict[str, float] = {}
        per_request = p.inFlightRequestTokens
        for endpoint in endpoints:
            held = cached.get(endpoint.address, 0)
            uncached = max(0, total - held)
            # Without the fleet-wide fact every uncached token is a copy of someone's blocks.
            copied = uncached if computed is None else max(0, min(total, computed) - held)
            cost = (
                p.uncachedTokenWeight * copied
                + fresh_weight * (uncached - copied)
                + endpoint.load.in_flight_prefill_tokens
                + per_request * endpoint.load.in_flight_requests
            )
            if p.waitingRequestTokens and not endpoint.metrics_stale:
                cost += p.waitingRequestTokens * endpoint.metrics.waiting_requests
            if p.kvPressureTokens:
                usage = 1.0 if endpoint.metrics_stale else endpoint.metrics.kv_cache_usage
                if usage > threshold:
                    cost += (
                        p.kvPressureTokens * (min(usage, 1.0) - threshold) / span
                        if span
                        else p.kvPressureTokens
                    )
            costs[endpoint.address] = cost
        return costs

    def score(self, request: LLMRequest, endpoints: Sequence[Endpoint]) -> dict[str, float]:
        costs = self.costs(request, endpoints)
        if not costs:
            return {}
        smoothing = self.p.smoothingTokens
        best = min(costs.values()) + smoothing
        return {address: best / (cost + smoothing) for address, cost in costs.items()}
