"""``sglang-cache-aware-scorer``: the SGLang router's ``cache_aware`` policy, as a scorer.

SGLang's router (``sgl-model-gateway/src/policies/cache_aware.rs``, defaults of its CLI) decides
per request, from its own state only (no engine events):

1. Load = requests the router sent to a worker that have not finished.  If the load is
   *imbalanced* — ``max − min > balanceAbsThreshold`` and ``max > balanceRelThreshold · min`` —
   route to the least loaded worker.
2. Otherwise match the prompt against an approximate radix tree of the prompts the router sent
   to each worker: if the best worker's match covers more than ``cacheThreshold`` of the prompt,
   route there; else route to the worker with the smallest tree ("most cache capacity").
3. Either way, insert the prompt into the chosen worker's tree.  Each worker's tree is trimmed,
   least recently used first, to ``maxTreeSizeTokens``.

The tree here is the approximate prefix scorer's block index (`scorers.prefix_approx`) with
blocks of ``blockSizeBytes`` bytes of prompt (64 bytes: 16 tokens of a token-id prompt, or 64
characters of text), with no cap on the blocks matched; SGLang's tree is per character (HTTP) or
per page of tokens (gRPC), so matches here are rounded down to a block.  Score: 1.0 for the
chosen worker(s), 0 for the others; ``max-score-picker`` breaks ties at random.
"""

from __future__ import annotations

from collections.abc import Sequence

from pydantic import BaseModel, ConfigDict, Field

from scorers.base import Endpoint, LLMRequest, Plugin, PluginContext, SchedulingResult, register
from scorers.prefix_approx import PrefixBlockIndex, block_hashes, prompt_bytes
from scorers.request_data import record_prefix_matches

_STATE = "sglang-cache-aware.hashes"


class CacheAwareParameters(BaseModel):
    model_config = ConfigDict(extra="forbid")

    cacheThreshold: float = Field(default=0.3, ge=0.0, le=1.0)
    """Minimum matched fraction of the prompt to follow the cache (SGLang: 0.3)."""
    balanceAbsThreshold: int = Field(default=64, ge=0)
    """In-flight spread above which load wins (SGLang: 64)."""
    balanceRelThreshold: float = Field(default=1.5, ge=1.0)
    """... and max/min ratio above which load wins (SGLang: 1.5)."""
    maxTreeSizeTokens: int = Field(default=1 << 26, ge=1)
    """Per-worker tree size (SGLang's ``max_tree_size``, 2^26)."""
    blockSizeBytes: int = Field(default=64, ge=4, le=1 << 20)
    """Granularity of the approximate tree, in bytes of prompt."""


@register("sglang-cache-aware-scorer")
class SGLangCacheAwareScorer(Plugin[CacheAwareParameters]):
    """SGLang's ``cache_aware`` rule; see the module docstring."""

    def __init__(self, name: str, params: BaseModel, context: PluginContext) -> None:
        super().__init__(name, params, context)
        block_tokens = max(1, self.p.blockSizeBytes // 4)
        self.tree = PrefixBlockIndex(max(1, self.p.maxTreeSizeTokens // block_tokens))

    def _hashes(self, request: LLMRequest) -> list[int]:
        hashes: list[int] | None = request.data.get(_STATE)
        if hashes is None:
            size = self.p.blockSizeBytes
            limit = 1 << 40  # the whole prompt
            hashes = block_hashes(
                prompt_bytes(request, limit), size, limit // size, request.model, request.cache_salt
            )
            request.data[_STATE] = hashes
        return hashes

    def choose(self, request: LLMRequest, endpoints: Sequence[Endpoint]) -> list[str]:
        """The worker(s) the rule picks (more than one only on exact ties)."""
        p = self.p
        loads = {e.address: e.load.in_flight_requests for e in endpoints}
        low, high = min(loads.values()), max(loads.values())
        if high - low > p.balanceAbsThreshold and high > p.balanceRelThreshold * low:
            return [a for a, load in loads.items() if load == low]
        hashes = self._hashes(request)
        matched = self.tree.longest_prefix(hashes)
        record_prefix_matches(request, matched)
        best = max((matched.get(a, 0) for a in loads), default=0)
        if hashes and best / len(hashes) > p.cacheThreshold:
            return [a for a in loads if matched.get(a, 0) == best]
        sizes = {a: self.tree.blocks_held(a) for a in loads}
        smallest = min(sizes.values())
        return [a for a, size in sizes.items() if size == smallest]

    def score(self, request: LLMRequest, endpoints: Sequence[Endpoint]) -> dict[str, float]:
        if not endpoints:
            return {}
        chosen = set(self.choose(request, endpoints))
        return {e.address: 1.0 if e.address in chosen else 0.0 for e in endpoints}

    def pre_request(self, request: LLMRequest, result: SchedulingResult) -> None:
        if result.targets:
            self.tree.add(result.targets[0].address, self._hashes(request))

    def endpoint_added(self, endpoint: Endpoint) -> None:
        pass

    def endpoint_removed(self, endpoint: Endpoint) -> None:
        self.tree.remove_endpoint(endpoint.address)
