"""``ray-prefix-cache-affinity-scorer``: Ray Serve LLM's ``PrefixCacheAffinityRouter``, as a
scorer.

Ray's router (``ray/llm/_internal/serve/request_router/prefix_aware/prefix_aware_router.py``,
``PrefixAwarePow2ReplicaRouter``, published defaults) decides per request from its own state:

1. Queue length = requests the router has in flight on each replica.  The load is *imbalanced*
   when ``max − min > imbalancedThreshold`` (10): then plain power of two choices (two replicas
   at random, the shorter queue wins).
2. Otherwise it matches the prompt text (chat messages' contents concatenated without a
   separator) against a character radix tree of the prompts it routed to each replica.  When the
   matched share of the prompt is at least ``matchRateThreshold`` (0.1), the candidates are the
   replicas with the longest match; below it, the replicas holding the fewest characters in the
   tree (the "smallest tenants").
3. Among the candidates, the shortest queue wins.  The routed prompt is inserted into the chosen
   replica's tree.  Eviction is off by default in Ray (``do_eviction=False``), so the tree only
   grows; ``maxTreeSizeChars`` (unbounded by default) mirrors its ``eviction_threshold_chars``.

The tree here is the approximate prefix scorer's block index (`scorers.prefix_approx`) over
blocks of ``blockSizeChars`` characters (16 by default, finer than the Inference Extension's 64,
closer to Ray's per-character tree); matches are rounded down to a block.  Score: 1.0 for the
chosen replica, 0 for the others.
"""

from __future__ import annotations

from collections.abc import Sequence

from pydantic import BaseModel, ConfigDict, Field

from scorers.base import Endpoint, LLMRequest, Plugin, PluginContext, SchedulingResult, register
from scorers.prefix_approx import PrefixBlockIndex, block_hashes
from scorers.request_data import record_prefix_matches

_STATE = "ray-prefix-affinity.hashes"


class RayPrefixAffinityParameters(BaseModel):
    model_config = ConfigDict(extra="forbid")

    imbalancedThreshold: int = Field(default=10, ge=0)
    """Queue-length spread above which power of two choices replaces prefix matching (Ray: 10)."""
    matchRateThreshold: float = Field(default=0.1, ge=0.0, le=1.0)
    """Matched share of the prompt from which the best-matching replicas are the candidates
    (Ray: 0.1)."""
    maxTreeSizeChars: int | None = Field(default=None, ge=1)
    """Characters kept per replica, least recently routed dropped first; None keeps everything
    (Ray's default, ``do_eviction=False``)."""
    blockSizeChars: int = Field(default=16, ge=1, le=1 << 20)
    """Granularity of the approximate tree, in characters of prompt."""


def prompt_text(request: LLMRequest) -> str:
    """The text Ray matches: the prompt, or the messages' contents concatenated."""
    if isinstance(request.prompt, str):
        return request.prompt
    if isinstance(request.prompt, list):
        return " ".join(str(t) for t in request.prompt)
    if request.messages is not None:
        return "".join(str(m.get("content", "")) for m in request.messages if "content" in m)
    return ""


@register("ray-prefix-cache-affinity-scorer")
class RayPrefixAffinityScorer(Plugin[RayPrefixAffinityParameters]):
    """Ray Serve's ``PrefixCacheAffinityRouter``; see the module docstring."""

    def __init__(self, name: str, params: BaseModel, context: PluginContext) -> None:
        super().__init__(name, params, context)
        limit = self.p.maxTreeSizeChars
        self.tree = PrefixBlockIndex(
            (1 << 62) if limit is None else max(1, limit // self.p.blockSizeChars)
        )

    def _hashes(self, request: LLMRequest) -> tuple[list[int], int]:
        cached: tuple[list[int], int] | None = request.data.get(_STATE)
        if cached is None:
            text = prompt_text(request).encode()
            size = self.p.blockSizeChars
            cached = (
                block_hashes(text, size, len(text) // size, request.model, request.cache_salt),
                len(text),
            )
            request.data[_STATE] = cached
        return cached

    def _shortest_queue(self, endpoints: Sequence[Endpoint]) -> str:
        low = min(e.load.in_flight_requests for e in endpoints)
        tied = [e.address for e in endpoints if e.load.in_flight_requests == low]
        return tied[0] if len(tied) == 1 else self.context.rng.choice(tied)

    def choose(self, request: LLMRequest, endpoints: Sequence[Endpoint]) -> str:
        p = self.p
        queues = [e.load.in_flight_requests for e in endpoints]
        if max(queues) - min(queues) > p.imbalancedThreshold:
            pair = self.context.rng.sample(list(endpoints), min(2, len(endpoints)))
            return self._shortest_queue(pair)
        hashes, length = self._hashes(request)
        matched = self.tree.longest_prefix(hashes)
        record_prefix_matches(request, matched)
        best = max((matched.get(e.address, 0) for e in endpoints), default=0)
        rate = best * p.blockSizeChars / length if length else 0.0
        if best and rate >= p.matchRateThreshold:
            candidates = [e for e in endpoints if matched.get(e.address, 0) == best]
        else:
            sizes = {e.address: self.tree.blocks_held(e.address) for e in endpoints}
            smallest = min(sizes.values())
            candidates = [e for e in endpoints if sizes[e.address] == smallest]
        return self._shortest_queue(candidates)

    def score(self, request: LLMRequest, endpoints: Sequence[Endpoint]) -> dict[str, float]:
        if not endpoints:
            return {}
        chosen = self.choose(request, endpoints)
        return {e.address: 1.0 if e.address == chosen else 0.0 for e in endpoints}

    def pre_request(self, request: LLMRequest, result: SchedulingResult) -> None:
        if result.targets:
            self.tree.add(result.targets[0].address, self._hashes(request)[0])

    def endpoint_added(self, endpoint: Endpoint) -> None:
        pass

    def endpoint_removed(self, endpoint: Endpoint) -> None:
        self.tree.remove_endpoint(endpoint.address)
