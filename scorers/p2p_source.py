"""``p2p-source-producer``: names a pod holding the request's prompt prefix so the routing
sidecar pulls those KV blocks from it over vLLM's P2P connector instead of recomputing them
(``x-kv-cache-source-host-port: <ip>:<port>``).

llm-d-router's ``pkg/epp/framework/plugins/requestcontrol/dataproducer/p2psource/`` (Alpha
there), a DataProducer and PreRequest plugin:

* the source: of the candidates holding any prefix, those within one block of the longest
  cached prefix (tokens: a prefix producer's matched blocks × its block size) share the pick,
  each weighted ``1/(1 + its waiting requests)``; the draw is the FNV-1a hash of the request id
  mapped to [0, 1), so requests spread over a prefix's replicas and one request always gets the
  same one.  Sampling within a block of the longest, not taking the longest, keeps every pull
  for a popular prefix off one replica: a source one block short costs one block of
  recompute, a queue costs more.
* after scheduling: the header is set when the source is not the pod that computes the prompt
  (the prefill profile's pod when that profile chose one, else the primary's) and holds at
  least ``minCachedTokenDelta`` more tokens than it; a value the client sent is always removed.

The match is the `PrefixMatchInfo` of ``prefixMatchInfoProducerName`` (none:
``approx-prefix-cache-producer``, created when not declared, as upstream creates its default
producer).  Pulls need the pods configured for them (upstream's README): vLLM's
``OffloadingConnector`` with a ``p2p`` tier and ``offload_prompt_only: false``, one
``--block-size`` and one ``PYTHONHASHSEED`` across pods.

Difference from upstream: when its producer reports cached blocks per device tier (the precise
producer does), upstream counts only a source's leading blocks on the CPU tier, since pulls are
served from there, and no speculative entries.  The producers here report no tiers, so every
tier counts (predicted blocks of ``speculativeIndexing`` included), which is upstream's rule
for a producer without tier data.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Final

from pydantic import BaseModel, ConfigDict, Field, field_validator

from scorers.base import Endpoint, LLMRequest, Plugin, SchedulingResult, register
from scorers.request_data import PrefixMatchInfo, prefix_match_info_key

PLUGIN_TYPE: Final = "p2p-source-producer"
KV_CACHE_SOURCE_HEADER: Final = "x-kv-cache-source-host-port"
DEFAULT_PRODUCER: Final = "approx-prefix-cache-producer"  # upstream's default match producer

_FNV_OFFSET: Final = 0x811C9DC5
_FNV_PRIME: Final = 0x01000193


class P2PSourceParameters(BaseModel):
    model_config = ConfigDict(extra="forbid")

    prefixMatchInfoProducerName: str = Field(
        default="",
        description="The prefix producer whose match is read (empty: "
        "approx-prefix-cache-producer).",
    )
    minCachedTokenDelta: int = Field(
        default=1,
        description="Tokens the source must hold beyond the computing pod for the header to be "
        "set (>= 1; higher skips pulls of prefixes cheap to recompute).",
    )
    prefillProfileName: str = Field(
        default="prefill",
        description="The P/D prefill profile: its pod computes the prompt when it chose one.",
    )

    @field_validator("minCachedTokenDelta")
    @classmethod
    def _at_least_one(cls, value: int) -> int:
        if value < 1:
            raise ValueError(f"minCachedTokenDelta must be >= 1, got {value}")
        return value

    @field_validator("prefillProfileName")
    @classmethod
    def _default_profile(cls, value: str) -> str:
        return value or "prefill"


@dataclass(slots=True, frozen=True)
class SourcePeer:
    """The pull source drawn for a request: its ``ip:port`` and the prompt tokens it holds."""

    host_port: str
    cached_tokens: int


def spread_fraction(request_id: str) -> float:
    """``request_id``'s 32-bit FNV-1a hash over 2^32: the same request, the same point."""
    h = _FNV_OFFSET
    for byte in request_id.encode():
        h = ((h ^ byte) * _FNV_PRIME) & 0xFFFFFFFF
    return h / 2**32


def choose_source(
    request_id: str, held: Sequence[tuple[str, int, int]], block_size: int
) -> SourcePeer | None:
    """The source among ``held`` (``(ip:port, cached tokens, waiting requests)`` per candidate,
    in candidate order); None when none holds anything.  See the module docstring."""
    holders = [h for h in held if h[1] > 0]
    if not holders:
        return None
    longest = max(tokens for _, tokens, _ in holders)
    band = [h for h in holders if h[1] + block_size >= longest]
    weights = [1.0 / (1.0 + waiting) for _, _, waiting in band]
    target = spread_fraction(request_id) * sum(weights)
    chosen = band[-1]
    for peer, weight in zip(band, weights, strict=True):
        if target < weight:
            chosen = peer
            break
        target -= weight
    return SourcePeer(chosen[0], chosen[1])


@register(PLUGIN_TYPE)
class P2PSourceProducer(Plugin[P2PSourceParameters]):
    """DataProducer (the candidates and their queues, as scheduling starts) and PreRequest
    (the source and the header); see the module docstring."""

    experimental: ClassVar[bool] = True

    def __init__(self, name: str, params: BaseModel, context: Any) -> None:
        super().__init__(name, params, context)
        self._producer_key = prefix_match_info_key(
            self.p.prefixMatchInfoProducerName or DEFAULT_PRODUCER
        )
        self._candidates_key = f"{PLUGIN_TYPE}/{name}/candidates"

    async def prepare(self, request: LLMRequest, endpoints: Sequence[Endpoint]) -> None:
        # The prefix producers run beside this one, so their match is read after scheduling;
        # the queues are taken now, when upstream's producer reads them.
        request.data[self._candidates_key] = [
            (ep.address, ep.metrics.waiting_requests) for ep in endpoints
        ]

    def match(self, request: LLMRequest) -> PrefixMatchInfo | None:
        info = request.data.get(self._producer_key)
        return info if isinstance(info, PrefixMatchInfo) else None

    def source(self, request: LLMRequest) -> SourcePeer | None:
        """The pull source for ``request`` among the candidates `prepare` saw."""
        info = self.match(request)
        candidates: list[tuple[str, int]] = request.data.get(self._candidates_key) or []
        if info is None or not candidates:
            return None
        held = [
            (address, info.matched_blocks.get(address, 0) * info.block_size, waiting)
            for address, waiting in candidates
        ]
        return choose_source(request.request_id, held, info.block_size)

    def pre_request(self, request: LLMRequest, result: SchedulingResult) -> None:
        request.set_headers[KV_CACHE_SOURCE_HEADER] = None  # never the client's own value
        best = self.source(request)
        if best is None:
            return
        computing = result.profiles.get(self.p.prefillProfileName)
        if computing is None or not computing.targets:
            computing = result.profiles.get(result.primary_profile)
        if computing is None or not computing.targets:
            return
        address = computing.targets[0].address
        info = self.match(request)
        held = info.matched_blocks.get(address, 0) * info.block_size if info is not None else 0
        if best.host_port == address or best.cached_tokens - held < self.p.minCachedTokenDelta:
            return
        request.set_headers[KV_CACHE_SOURCE_HEADER] = best.host_port
