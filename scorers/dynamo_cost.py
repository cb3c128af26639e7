"""``dynamo-cost-scorer``: NVIDIA Dynamo's KV-router cost rule, as a scorer.

Dynamo (``lib/kv-router/src/scheduling/selector``, docs "KV Cache Routing") picks, per request,
the worker with the lowest

    cost_w = overlapScoreWeight · prefill_blocks_w + decode_blocks_w

* ``prefill_blocks_w``: tokens the request would prefill there (prompt minus the blocks the
  worker's KV events say it holds) plus the prefill tokens already pending on the worker
  (requests routed there that have not produced a first token), divided by the block size.
* ``decode_blocks_w``: the KV blocks of the worker's active requests, as the router tracks them
  (added when it routes a request, freed when the response ends), plus this request's blocks;
  with ``assumeKvReuse`` blocks are counted once per worker however many active requests share
  them, as Dynamo's ``router_assume_kv_reuse`` does.

Here the prefix overlap comes from ``request.data[PREFIX_MATCHED_TOKENS]`` (declare a
``precise-prefix-cache-scorer`` so it is filled; Dynamo's default uses KV events too), pending
prefill from ``Endpoint.load.in_flight_prefill_tokens``, and the active blocks from this plugin's
own PreRequest / ResponseComplete bookkeeping.  Score = ``(max − cost) / (max − min)`` over the
candidates (all equal → 1), so with ``max-score-picker`` this is Dynamo's temperature-0 argmin,
ties broken at random (Dynamo breaks them by smallest tree first).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from pydantic import BaseModel, ConfigDict, Field

from scorers.base import (
    Endpoint,
    LLMRequest,
    Plugin,
    PluginContext,
    SchedulingResult,
    Usage,
    register,
)
from scorers.request_data import PREFIX_BLOCK_KEYS, PREFIX_MATCHED_TOKENS


class DynamoCostParameters(BaseModel):
    model_config = ConfigDict(extra="forbid")

    overlapScoreWeight: float = Field(default=1.0, ge=0.0, le=1000.0)
    """Dynamo's ``--kv-overlap-score-weight`` (default 1): weight of prefill blocks."""
    blockSize: int = Field(default=16, ge=1, le=4096)
    """Tokens per block when an endpoint does not report its own (``vllm:cache_config_info``)."""
    assumeKvReuse: bool = True
    """Count a block shared by several active requests on a worker once."""


class _Active:
    """One worker's active blocks: key → number of active requests using it."""

    __slots__ = ("anonymous", "refs")

    def __init__(self) -> None:
        self.refs: dict[int, int] = {}
        self.anonymous = 0  # blocks of requests without keys (counted, not deduplicated)

    @property
    def blocks(self) -> int:
        return len(self.refs) + self.anonymous


@register("dynamo-cost-scorer")
class DynamoCostScorer(Plugin[DynamoCostParameters]):
    """Dynamo's router cost; see the module docstring."""

    def __init__(self, name: str, params: BaseModel, context: PluginContext) -> None:
        super().__init__(name, params, context)
        self._active: dict[str, _Active] = {}
        # request id → (endpoint, keys or None, anonymous block count)
        self._requests: dict[str, tuple[str, list[int] | None, int]] = {}

    def active_blocks(self, address: str) -> int:
        active = self._active.get(address)
        return active.blocks if active is not None else 0

    def _new_blocks(self, address: str, keys: list[int] | None, blocks: int) -> int:
        """Blocks this request would add to the worker's active set."""
        if keys is None or not self.p.assumeKvReuse:
            return blocks
        active = self._active.get(address)
        if active is None:
            return blocks
        refs = active.refs
        shared = 0
        for key in keys:  # active sets are unions of prefixes: the first miss ends the run
            if key not in refs:
                break
            shared += 1
        return blocks - shared

    def costs(self, request: LLMRequest, endpoints: Sequence[Endpoint]) -> dict[str, float]:
        tokens = request.prompt_tokens
        cached: Mapping[str, int] = request.data.get(PREFIX_MATCHED_TOKENS) or {}
        keys: list[int] | None = request.data.get(PREFIX_BLOCK_KEYS)
        weight = self.p.overlapScoreWeight
        costs: dict[str, float] = {}
        for endpoint in endpoints:
            size = endpoint.metrics.block_size or self.p.blockSize
            blocks = len(keys) if keys is not None else tokens // size
            prefill = max(0, tokens - cached.get(endpoint.address, 0))
            prefill += endpoint.load.in_flight_prefill_tokens
            decode = self.active_blocks(endpoint.address) + self._new_blocks(
                endpoint.address, keys, blocks
            )
            costs[endpoint.address] = weight * prefill / size + decode
        return costs

    def score(self, request: LLMRequest, endpoints: Sequence[Endpoint]) -> dict[str, float]:
        costs = self.costs(request, endpoints)
        if not costs:
            return {}
        low, high = min(costs.values()), max(costs.values())
        if high == low:
            return dict.fromkeys(costs, 1.0)
        return {address: (high - cost) / (high - low) for address, cost in costs.items()}

    # -- active-block bookkeeping ---------------------------------------------------------------

    def pre_request(self, request: LLMRequest, result: SchedulingResult) -> None:
        targets = result.targets
        if not targets or request.request_id in self._requests:
            return
        address = targets[0].address
        keys: list[int] | None = request.data.get(PREFIX_BLOCK_KEYS)
        active = self._active.setdefault(address, _Active())
        if keys is not None and self.p.assumeKvReuse:
            refs = active.refs
            for key in keys:
                refs[key] = refs.get(key, 0) + 1
            self._requests[request.request_id] = (address, keys, 0)
        else:
            size = targets[0].metrics.block_size or self.p.blockSize
            count = len(keys) if keys is not None else request.prompt_tokens // size
            active.anonymous += count
            self._requests[request.request_id] = (address, None, count)

    def response_complete(self, request: LLMRequest, endpoint: str, usage: Usage | None) -> None:
        entry = self._requests.pop(request.request_id, None)
        if entry is None:
            return
        address, keys, anonymous = entry
        active = self._active.get(address)
        if active is None:
            return
        active.anonymous = max(0, active.anonymous - anonymous)
        if keys is not None:
            refs = active.refs
            for key in keys:
                count = refs.get(key, 0) - 1
                if count > 0:
                    refs[key] = count
                else:
                    refs.pop(key, None)

    def endpoint_added(self, endpoint: Endpoint) -> None:
        pass

    def endpoint_removed(self, endpoint: Endpoint) -> None:
        self._active.pop(endpoint.address, None)
