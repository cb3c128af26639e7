"""The capacity-bounded oracle: the hit rate no placement can beat with the fleet's memory.

The definition of docs/design.md ("Targets"): one LRU cache holding the whole fleet's capacity
(same block size) replays the same requests in order.  Per request, the hit is the longest run
of its leading blocks the cache holds, capped as vLLM caps it (at least the last prompt token is
recomputed: ``(prompt_tokens - 1) // block_size`` blocks at most); then every block of the
prompt is touched last block first, so a prompt's beginning is the most recent and the tail is
evicted first (as vLLM frees a request's blocks tail first).  It is a ceiling, not a policy: one
pooled cache has no duplicates and no blocks pinned by running requests, and it knows the future
no better than LRU does.  Computed from the same block keys the engines use.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(slots=True, frozen=True)
class OracleResult:
    hit_tokens: int
    prompt_tokens: int
    capacity_blocks: int | None

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


def oracle_hit_rate(
    prompts: Sequence[tuple[int, Sequence[int]]],
    block_size: int,
    capacity_blocks: int | None,
    *,
    measure_from: int = 0,
) -> OracleResult:
    """``prompts``: ``(prompt tokens, full-block keys)`` per request, in arrival order;
    ``capacity_blocks`` None means unbounded.  Requests before index ``measure_from`` (a
    warm-up) fill the cache but are not counted."""
    cache: OrderedDict[int, None] = OrderedDict()
    hits = 0
    total = 0
    for index, (prompt_tokens, keys) in enumerate(prompts):
        limit = max(0, (prompt_tokens - 1) // block_size)
        matched = 0
        for key in keys[:limit]:
            if key not in cache:
                break
            matched += 1
        if index >= measure_from:
            total += prompt_tokens
            hits += matched * block_size
        for key in reversed(keys):
            if key in cache:
                cache.move_to_end(key)
            else:
                cache[key] = None
        if capacity_blocks is not None:
            while len(cache) > capacity_blocks:
                cache.popitem(last=False)
    return OracleResult(hits, total, capacity_blocks)
