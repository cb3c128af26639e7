"""Where a KV-cache view keeps its entries: the `IndexBackend` protocol and the factory.

A backend stores (block key, endpoint, tier) entries fed by the pods' KV events and answers, for
a prompt's block keys, how many leading blocks each endpoint holds.  Two implement it:

* ``inMemoryConfig`` (the default): `indexer.index.KVBlockIndex`, in this process.
* ``redisConfig``: `kvcache.redis_index.RedisIndex`, in a Redis or Valkey server that several
  EPP replicas can share (llm-d's ``kvBlockIndexConfig`` names, for the same choice).

The view (`kvcache.view.KVCacheView`) is the only reader and writer; scorers never see which
backend holds the entries.  ``blocking`` backends answer over the network: the view calls their
`match` from the CPU executor, never on the event loop.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol

from epp.gauges import GaugeSample
from indexer.events import KVEventBatch
from indexer.hashing import HashConfig
from indexer.index import KVBlockIndex, PrefixMatch
from kvcache.settings import KVCacheSettings


@dataclass(frozen=True, slots=True)
class BlockMatch:
    """A lookup's answer: per endpoint asked about, the leading blocks it holds (tier-weighted
    too) and the blocks it holds in all."""

    prefix: dict[str, PrefixMatch]
    held_blocks: dict[str, int]


class IndexBackend(Protocol):
    """What a view needs of the place its entries live."""

    blocking: bool  # True: calls go over the network (call `match` off the event loop)

    def apply(self, endpoint: str, batch: KVEventBatch) -> None:
        """Fold one endpoint's decoded batch in (stores, removals, clears), in order."""
        ...

    def clear_endpoint(self, endpoint: str) -> int:
        """The pod restarted: drop what it held and its self-check state."""
        ...

    def remove_endpoint(self, endpoint: str) -> int:
        """The endpoint left the pool: drop it."""
        ...

    def match(self, keys: Sequence[int], endpoints: Sequence[str]) -> BlockMatch:
        """The leading blocks of ``keys`` each of ``endpoints`` holds, and its blocks in all."""
        ...

    def longest_prefix(self, keys: Sequence[int], endpoints: Iterable[str]) -> dict[str, int]:
        """Leading blocks of ``keys`` each endpoint holds (on any tier)."""
        ...

    def telemetry_samples(self) -> Iterable[GaugeSample]:
        """The backend's gauges (entries, evictions, hash mismatches, store health)."""
        ...


class MemoryIndex(KVBlockIndex):
    """`KVBlockIndex` as an `IndexBackend` (the default backend)."""

    blocking = False

    def match(self, keys: Sequence[int], endpoints: Sequence[str]) -> BlockMatch:
        return BlockMatch(
            self.prefix_match(keys, endpoints), {a: self.endpoint_blocks(a) for a in endpoints}
        )

    def telemetry_samples(self) -> Iterable[GaugeSample]:
        yield GaugeSample(
            "inference_extension_kv_index_entries",
            "(block, endpoint) entries in the precise KV-block self.",
            self.entries,
        )
        yield GaugeSample(
            "inference_extension_prefix_indexer_size",
            "Distinct block keys in the precise KV-block self.",
            self.blocks,
        )
        yield GaugeSample(
            "inference_extension_kv_index_evictions",
            "Index entries evicted because maxIndexEntries was reached (cumulative).",
            self.evictions_total,
        )
        yield from mismatch_samples(self.mismatches)
        for address in self.endpoints():
            yield GaugeSample(
                "inference_extension_kv_index_endpoint_entries",
                "(block, endpoint) entries the precise KV-block index holds per endpoint.",
                self.endpoint_stats(address).blocks,
                (("endpoint", address),),
            )


def mismatch_samples(mismatches: dict[str, int]) -> Iterable[GaugeSample]:
    for endpoint, count in mismatches.items():
        yield GaugeSample(
            "inference_extension_kv_hash_mismatches",
            "KV events whose block hashes disagreed with the EPP's (cumulative); the "
            "endpoint is then indexed by the EPP's own hashes of its tokens.",
            count,
            (("endpoint", endpoint),),
        )


def build_backend(
    settings: KVCacheSettings, hash_config: HashConfig, store: object | None
) -> IndexBackend:
    """The backend ``settings`` choose, for pods hashing with ``hash_config``; ``store`` is the
    view's connection to a shared store (`kvcache.redis_index.RedisStore`) when configured."""
    check = hash_config if settings.selfCheck else None
    if store is not None:
        from kvcache.redis_index import RedisIndex, RedisStore  # the client only when used

        assert isinstance(store, RedisStore)
        return RedisIndex(
            store,
            hash_config=check,
            tier_weights=settings.tierWeights or None,
            self_check_blocks=settings.selfCheckBlocks,
        )
    return MemoryIndex(
        max_entries=settings.maxIndexEntries,
        hash_config=check,
        tier_weights=settings.tierWeights or None,
        self_check_blocks=settings.selfCheckBlocks,
    )
