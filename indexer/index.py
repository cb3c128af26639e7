"""The KV-block index: which endpoints hold which prefix-cache blocks, and on which tier.

vLLM pods publish a `BlockStored` for every block that becomes full and cached, a `BlockRemoved`
for every block they evict and `AllBlocksCleared` on a cache reset (``docs/vllm-interop.md``
§4.3).  `KVBlockIndex` folds those events into one picture of the fleet and answers, for a
request's block keys, how many leading blocks each candidate endpoint already holds.

Layout (chosen for ≤ 128 bytes per (block, endpoint) entry at 10 M entries, see
``benchmarks/indexer.py``):

* Each endpoint (``"ip:port"``) owns a small integer slot; ``1 << slot`` is its bit.
* ``_blocks`` maps a 64-bit block key to the bitmask of endpoints holding it on any tier.
  Masks are interned, so the thousands of blocks held by the same set of pods share one int.
* ``_tiers`` holds the GPU, CPU and STORAGE masks, packed into one int, only for blocks that
  some endpoint holds off GPU; a block absent from it is on GPU wherever it is held.
* Each endpoint keeps its keys (a reverse map), so `BlockRemoved`, `AllBlocksCleared`,
  `clear_endpoint` and `remove_endpoint` cost O(blocks of that endpoint).

Every big container holds only ints (the reverse maps are ``dict[int, None]``, not sets), so the
cyclic garbage collector does not track them: a full collection would otherwise walk every entry,
about 60 ns each, which is 600 ms at 10 M entries.

Memory is bounded by ``max_entries`` (block, endpoint) entries.  When the bound is reached by a
store from an endpoint holding more than its fair share (``max_entries`` / endpoints), that
endpoint's own oldest entries go first: a pod flooding the index with bogus `BlockStored`s
evicts only itself, never the blocks other pods really hold.  Otherwise eviction is by block, oldest
first, CLOCK-style: ``_blocks`` is insertion-ordered, so its first keys are the oldest; a store
of a block already indexed, or a lookup that matched it, marks it recently used, and a marked block
found at the old end gets a second chance (moved to the young end, mark cleared) instead of being
evicted.  Lookups only append their matched keys to a short log that the next eviction reads, so
they never write to the big dict, which keeps them fast and keeps the key objects shared between
``_blocks`` and the reverse maps.

The index checks itself (``docs/design.md``, same heading): with a `HashConfig`, it recomputes
the hashes of each `BlockStored` from the event's own tokens.  A pod whose algorithm, seed or
block size differs is reported once and from then on keyed by the EPP's own hashes of its tokens,
so routing stays correct; see `KVBlockIndex` for what can and cannot be verified.

Pure and single-threaded: no sockets, no asyncio; call it from one event loop.
"""

from __future__ import annotations

import heapq
import logging
import math
from collections import deque
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from itertools import groupby, islice, pairwise
from types import MappingProxyType
from typing import Final

from indexer.errors import IndexerError
from indexer.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEvent,
    KVEventBatch,
    block_key,
)
from indexer.hashing import HashConfig
from indexer.key_check import EndpointKeyState, KeyCheck

logger = logging.getLogger("indexer.index")

TIERS: Final = ("GPU", "CPU", "STORAGE")
DEFAULT_TIER_WEIGHTS: Final[Mapping[str, float]] = MappingProxyType(
    {"GPU": 1.0, "CPU": 0.8, "STORAGE": 0.5}
)
DEFAULT_MAX_ENTRIES: Final = 10_000_000

_GPU: Final = 0
_CPU: Final = 1
_STORAGE: Final = 2
# vLLM's main pool says "GPU"; offloading connectors say "CPU" or "STORAGE".  Anything else
# (None, a connector's own name) is treated as GPU, the tier a request can use directly.
_TIER_OF_MEDIUM: Final[Mapping[str, int]] = MappingProxyType(
    {
        **{name: i for i, name in enumerate(TIERS)},
        **{name.lower(): i for i, name in enumerate(TIERS)},
    }
)
_UINT64: Final = (1 << 64) - 1

# Bounds on internal caches, none of which affects answers, only speed and memory.
_MAX_INTERNED_MASKS: Final = 1 << 16  # distinct endpoint sets seen; cleared (not trimmed) beyond
# Lookups and re-stores remembered for the next eviction (a tuple of keys each): about the last
# second of traffic on a busy EPP, at most ~20 MB.
_READ_LOG_LENGTH: Final = 512


class IndexConfigError(IndexerError, ValueError):
    """A `KVBlockIndex` parameter that cannot work (a non-positive bound, an unknown tier, a
    negative weight)."""


def tier_of(medium: str | None) -> int:
    """The tier (0 GPU, 1 CPU, 2 STORAGE) of an event's ``medium``."""
    return _GPU if medium is None else _TIER_OF_MEDIUM.get(medium, _GPU)


def validated_tier_weights(tier_weights: Mapping[str, float] | None) -> dict[str, float]:
    """Every tier's weight: the defaults, overridden by ``tier_weights`` (checked)."""
    weights = dict(DEFAULT_TIER_WEIGHTS)
    for tier, weight in (tier_weights or {}).items():
        if tier not in weights:
            raise IndexConfigError(
                f"tier_weights: unknown tier {tier!r}; expected one of {', '.join(TIERS)}"
            )
        if not isinstance(weight, int | float) or not math.isfinite(weight) or weight < 0:
            raise IndexConfigError(
                f"tier_weights[{tier!r}] must be a finite number >= 0, got {weight!r}"
            )
        weights[tier] = float(weight)
    return weights


@dataclass(slots=True, frozen=True)
class PrefixMatch:
    """How much of a request's prefix one endpoint holds: ``blocks`` consecutive blocks from
    block 0 on any tier, and ``weighted``, the sum over those blocks of the best tier weight the
    endpoint has for each (GPU 1.0, CPU 0.8, STORAGE 0.5 by default)."""

    blocks: int
    weighted: float


@dataclass(slots=True, frozen=True)
class EndpointStats:
    """One endpoint's view for metrics and debugging.  Counters are cumulative over the
    endpoint's life in the index (a restart does not reset them); ``hash_mismatch`` is the
    current state and is reset by `KVBlockIndex.clear_endpoint`."""

    endpoint: str
    blocks: int
    hash_mismatch: bool
    mismatch_events: int
    verified_blocks: int
    unverified_blocks: int
    unchecked_blocks: int
    rekeyed_blocks: int
    skipped_events: int
    stored_total: int
    removed_total: int


@dataclass(slots=True, eq=False)
class _Endpoint:
    name: str
    slot: int
    bit: int
    check: EndpointKeyState
    keys: dict[int, None] = field(default_factory=dict)  # a set, but untracked by the GC
    stored_total: int = 0
    removed_total: int = 0


_NO_MATCH: Final = PrefixMatch(0, 0.0)


def _slots_of(mask: int) -> Iterator[int]:
    while mask:
        low = mask & -mask
        yield low.bit_length() - 1
        mask ^= low


def _matches(walked: int, segments: list[tuple[int, int]]) -> Iterator[tuple[int, int]]:
    """(slot, blocks matched) for every endpoint that matched at least one block, from the
    segments of `KVBlockIndex._walk`: an endpoint dropping out where a segment starts matched
    the blocks before it; those still matching at the end matched all ``walked``."""
    for (_, before), (start, after) in pairwise(segments):
        if start:
            for slot in _slots_of(before ^ after):
                yield slot, start
    if walked:
        for slot in _slots_of(segments[-1][1]):
            yield slot, walked


class KVBlockIndex:
    """Block key → endpoints (and tiers) holding it, fed by vLLM KV events.

    Parameters:

    * ``max_entries``: bound on (block, endpoint) entries; beyond it the least recently used
      blocks are evicted in batches (see the module docstring for what "used" means).  The
      default, about 1.2 GB, holds 400 pods of 25k blocks (400k tokens of KV at block size 16,
      the H100 example of ``docs/design.md``, "Targets"); with removals flowing, the cap is a
      guard, not the policy.
    * ``hash_config``, ``self_check_blocks``, ``verify_cache_blocks``: the self-check of the
      pods' keys (`indexer.key_check.KeyCheck`, which says under which keys each event's blocks
      are stored: the pod's own, or the EPP's hashes of its tokens when the pod hashes
      differently).  None trusts the pods' keys.
    * ``tier_weights``: weights per medium for `prefix_match`; missing tiers keep the defaults.

    Not thread-safe.
    """

    def __init__(
        self,
        *,
        max_entries: int = DEFAULT_MAX_ENTRIES,
        hash_config: HashConfig | None = None,
        tier_weights: Mapping[str, float] | None = None,
        self_check_blocks: int | None = None,
        verify_cache_blocks: int = 65_536,
    ) -> None:
        if isinstance(max_entries, bool) or not isinstance(max_entries, int) or max_entries < 1:
            raise IndexConfigError(f"max_entries must be a positive integer, got {max_entries!r}")
        if self_check_blocks is not None and self_check_blocks < 1:
            raise IndexConfigError(
                f"self_check_blocks must be None (verify every event) or >= 1, "
                f"got {self_check_blocks!r}"
            )
        if verify_cache_blocks < 0:
            raise IndexConfigError(f"verify_cache_blocks must be >= 0, got {verify_cache_blocks!r}")
        weights = validated_tier_weights(tier_weights)
        self.tier_weights: Mapping[str, float] = MappingProxyType(weights)
        self._weights: tuple[float, float, float] = (
            weights["GPU"],
            weights["CPU"],
            weights["STORAGE"],
        )
        self._tiers_best_first = sorted(range(3), key=lambda t: -self._weights[t])
        self._gpu_matches: list[PrefixMatch] = []  # PrefixMatch(n, n * GPU weight) by n
        # Width of one tier's field in a packed `_tiers` value; grows with the slots in use.
        self._tier_width = 64
        self.max_entries = max_entries
        # Evict a little below the cap so that eviction runs once per batch, not per store.
        self._evict_to = max_entries - max(1, min(max_entries // 100, 65_536))

        self._blocks: dict[int, int] = {}
        self._tiers: dict[int, int] = {}
        self._masks: dict[int, int] = {}
        self._read_log: deque[tuple[int, ...]] = deque(maxlen=_READ_LOG_LENGTH)
        self._endpoints: dict[str, _Endpoint] = {}
        self._by_slot: list[_Endpoint | None] = []
        self._slot_names: list[str] = []  # "" for a free slot
        self._free_slots: list[int] = []

        self.hash_config = hash_config
        self.key_check = KeyCheck(
            hash_config,
            self_check_blocks=self_check_blocks,
            verify_cache_blocks=verify_cache_blocks,
        )

        # Counters for metrics (read them, do not write them).
        self.entries = 0
        """(block, endpoint) entries held now."""
        self.stored_total = 0
        """Block stores applied, one per block per endpoint, re-stores included."""
        self.removed_total = 0
        """Entries removed by `BlockRemoved` (or `remove`)."""
        self.cleared_total = 0
        """Entries dropped by `AllBlocksCleared`, `clear_endpoint` and `remove_endpoint`."""
        self.evictions_total = 0
        """Entries evicted because ``max_entries`` was reached."""
        self.share_evictions_total = 0
        """Of which were an over-share endpoint's own entries (see the module docstring)."""

    # Self-check totals (`indexer.key_check.KeyCheck`), for metrics and tests.

    @property
    def mismatch_events_total(self) -> int:
        return self.key_check.mismatch_events_total

    @property
    def verified_blocks_total(self) -> int:
        return self.key_check.verified_blocks_total

    @property
    def unverified_blocks_total(self) -> int:
        return self.key_check.unverified_blocks_total

    @property
    def unchecked_blocks_total(self) -> int:
        return self.key_check.unchecked_blocks_total

    @property
    def rekeyed_blocks_total(self) -> int:
        return self.key_check.rekeyed_blocks_total

    @property
    def skipped_events_total(self) -> int:
        return self.key_check.skipped_events_total

    # -----------------------------------------------------------------------------------------
    # Reading

    @property
    def blocks(self) -> int:
        """Distinct block keys held by at least one endpoint."""
        return len(self._blocks)

    def endpoints(self) -> list[str]:
        """Every endpoint the index knows, in the order they were first seen."""
        return list(self._endpoints)

    @property
    def mismatches(self) -> dict[str, int]:
        """Hash-mismatch events per endpoint, for endpoints that had any."""
        return {
            name: ep.check.mismatch_events
            for name, ep in self._endpoints.items()
            if ep.check.mismatch_events
        }

    def endpoint_blocks(self, endpoint: str) -> int:
        """How many blocks the index holds for ``endpoint`` (0 when unknown)."""
        ep = self._endpoints.get(endpoint)
        return len(ep.keys) if ep is not None else 0

    def endpoint_stats(self, endpoint: str) -> EndpointStats:
        """Counts for one endpoint; an unknown endpoint reads as empty."""
        ep = self._endpoints.get(endpoint) or _Endpoint(endpoint, -1, 0, EndpointKeyState(endpoint))
        check = ep.check
        return EndpointStats(
            endpoint=endpoint,
            blocks=len(ep.keys),
            hash_mismatch=check.rekey,
            mismatch_events=check.mismatch_events,
            verified_blocks=check.verified_blocks,
            unverified_blocks=check.unverified_blocks,
            unchecked_blocks=check.unchecked_blocks,
            rekeyed_blocks=check.rekeyed_blocks,
            skipped_events=check.skipped_events,
            stored_total=ep.stored_total,
            removed_total=ep.removed_total,
        )

    def holders(self, key: int) -> dict[str, str]:
        """Endpoint → best medium for one block key (for debugging and explanations)."""
        mask = self._blocks.get(key & _UINT64, 0)
        packed = self._tiers.get(key & _UINT64)
        tiers = (mask, 0, 0) if packed is None else self._unpack(packed)
        out: dict[str, str] = {}
        for slot in _slots_of(mask):
            ep = self._by_slot[slot]
            assert ep is not None
            best = max((t for t in range(3) if tiers[t] & ep.bit), key=lambda t: self._weights[t])
            out[ep.name] = TIERS[best]
        return out

    def longest_prefix(self, keys: Sequence[int], endpoints: Iterable[str]) -> dict[str, int]:
        """For each endpoint, how many of ``keys`` it holds consecutively from ``keys[0]`` (any
        tier).  Every requested endpoint is in the result; unknown ones get 0."""
        result = dict.fromkeys(endpoints, 0)
        alive = self._mask_of(result)
        if alive:
            names = self._slot_names
            walked, segments = self._walk(keys, alive)
            for slot, blocks in _matches(walked, segments):
                result[names[slot]] = blocks
            self._mark_read(keys, walked)
        return result

    def prefix_match(self, keys: Sequence[int], endpoints: Iterable[str]) -> dict[str, PrefixMatch]:
        """`longest_prefix` plus, per endpoint, the tier-weighted sum over its matched blocks
        (the best weight among the tiers it holds each block on)."""
        result = dict.fromkeys(endpoints, _NO_MATCH)
        alive = self._mask_of(result)
        if not alive:
            return result
        walked, segments = self._walk(keys, alive)
        self._mark_read(keys, walked)
        adjust = self._tier_adjustments(keys, walked, segments) if self._tiers else {}
        names = self._slot_names
        gpu_matches = self._gpu_matches
        for slot, blocks in _matches(walked, segments):
            extra = adjust.get(slot)
            if extra is None:
                # GPU only: one shared value per length instead of a new object per endpoint.
                while len(gpu_matches) <= blocks:
                    gpu_matches.append(
                        PrefixMatch(len(gpu_matches), len(gpu_matches) * self._weights[_GPU])
                    )
                result[names[slot]] = gpu_matches[blocks]
            else:
                result[names[slot]] = PrefixMatch(blocks, blocks * self._weights[_GPU] + extra)
        return result

    def _walk(self, keys: Sequence[int], alive: int) -> tuple[int, list[tuple[int, int]]]:
        """The lookup's hot loop.  Walks ``keys`` from block 0 with the bitmask of endpoints
        still matching and stops when it is empty or a block is unknown: O(longest match),
        whatever the number of endpoints.  Returns the number of blocks walked and the segments
        ``(first block, endpoints matching from there)``; the first starts at 0 with ``alive``."""
        get = self._blocks.get
        segments = [(0, alive)]
        walked = 0
        for key in keys:
            mask = get(key)
            if mask is None:
                break
            mask &= alive
            if mask != alive:
                alive = mask
                segments.append((walked, alive))
                if not alive:
                    break
            walked += 1
        return walked, segments

    def _tier_adjustments(
        self, keys: Sequence[int], walked: int, segments: list[tuple[int, int]]
    ) -> dict[int, float]:
        """Per slot, the sum over its matched blocks of (best tier weight - GPU weight).

        Found with C-level passes (`map`, `groupby`) rather than block by block: consecutive
        blocks of one prompt usually share their interned tier masks (or have none), so the
        Python work is per run of equal masks, not per block."""
        adjust: dict[int, float] = {}
        packed_by_block = list(map(self._tiers.get, islice(keys, walked)))
        bounds = [start for start, _ in segments[1:]] + [walked]
        segment = 0
        position = 0
        for packed, run in groupby(packed_by_block):
            length = len(list(run))
            if packed is not None:
                start, end = position, position + length
                while start < end:
                    while bounds[segment] <= start:
                        segment += 1
                    stop = min(end, bounds[segment])
                    self._weigh_tiers(adjust, packed, segments[segment][1], stop - start)
                    start = stop
            position += length
        return adjust

    def _weigh_tiers(self, adjust: dict[int, float], packed: int, alive: int, blocks: int) -> None:
        """Add to ``adjust`` what ``blocks`` blocks with these packed tier masks are worth,
        relative to GPU, to each endpoint in ``alive``: the best weight among its tiers."""
        weights = self._weights
        tier_masks = self._unpack(packed)
        rest = alive
        for tier in self._tiers_best_first:
            got = tier_masks[tier] & rest
            if got:
                rest ^= got
                delta = (weights[tier] - weights[_GPU]) * blocks
                if delta:
                    for slot in _slots_of(got):
                        adjust[slot] = adjust.get(slot, 0.0) + delta

    def _mask_of(self, names: Iterable[str]) -> int:
        endpoints = self._endpoints
        mask = 0
        for name in names:
            ep = endpoints.get(name)
            if ep is not None:
                mask |= ep.bit
        return mask

    def _mark_read(self, keys: Sequence[int], matched: int) -> None:
        # Only logged here (one tuple, a C-level copy); the marks are worked out when the cap
        # forces an eviction, which is rare, instead of costing every lookup a set update.
        # Tuples of ints, unlike lists, are untracked by the GC once they survive a collection.
        if matched:
            if matched == len(keys) and type(keys) is tuple:
                self._read_log.append(keys)
            else:
                self._read_log.append(tuple(islice(keys, matched)))

    # -----------------------------------------------------------------------------------------
    # Writing: events

    def apply(self, endpoint: str, batch: KVEventBatch) -> None:
        """Apply one decoded `KVEventBatch` from ``endpoint``, event by event, in order."""
        self.apply_events(endpoint, batch.events)

    def apply_events(self, endpoint: str, events: Iterable[KVEvent]) -> None:
        """Apply events from ``endpoint`` in order (registers the endpoint if new)."""
        ep = self._endpoint(endpoint)
        for event in events:
            if type(event) is BlockStored:
                self._apply_stored(ep, event)
            elif type(event) is BlockRemoved:
                self._apply_removed(ep, event)
            elif type(event) is AllBlocksCleared:
                # A reset of the pod's prefix cache, not a restart: a mismatched pod stays so.
                self._clear_blocks(ep)
                ep.check.links.clear()
        if len(self._masks) > _MAX_INTERNED_MASKS:
            # Only sharing is lost: masks already stored stay valid.
            self._masks.clear()

    def _apply_stored(self, ep: _Endpoint, event: BlockStored) -> None:
        hashes = event.block_hashes
        if not hashes:
            return
        keys = [h & _UINT64 if type(h) is int else block_key(h) for h in hashes]
        medium = event.medium
        tier = _GPU if medium is None else _TIER_OF_MEDIUM.get(medium, _GPU)
        stored = self.key_check.stored_keys(ep.check, event, keys, self._fair_share)
        if stored is not None:
            self._store(ep, stored, tier)

    def _apply_removed(self, ep: _Endpoint, event: BlockRemoved) -> None:
        keys = [h & _UINT64 if type(h) is int else block_key(h) for h in event.block_hashes]
        medium = event.medium
        tier = _GPU if medium is None else _TIER_OF_MEDIUM.get(medium, _GPU)
        self._remove(ep, self.key_check.removed_keys(ep.check, keys), tier)
        self.key_check.forget_removed(ep.check, keys, ep.keys)

    # -----------------------------------------------------------------------------------------
    # Writing: direct

    def store(self, endpoint: str, keys: Iterable[int], *, medium: str | None = None) -> None:
        """Record that ``endpoint`` holds ``keys`` on ``medium`` (None: GPU).  No self-check:
        for callers that computed the keys themselves (tests, the simulator)."""
        ep = self._endpoint(endpoint)
        tier = _GPU if medium is None else _TIER_OF_MEDIUM.get(medium, _GPU)
        self._store(ep, [k & _UINT64 for k in keys], tier)

    def remove(self, endpoint: str, keys: Iterable[int], *, medium: str | None = None) -> None:
        """Record that ``endpoint`` dropped ``keys`` from ``medium`` (None: GPU)."""
        ep = self._endpoints.get(endpoint)
        if ep is not None:
            tier = _GPU if medium is None else _TIER_OF_MEDIUM.get(medium, _GPU)
            self._remove(ep, [k & _UINT64 for k in keys], tier)

    def clear_endpoint(self, endpoint: str) -> int:
        """The pod restarted (its event sequence went backwards): drop everything it held and
        forget its self-check state, since it may come back with another configuration.
        Returns the number of entries dropped."""
        ep = self._endpoints.get(endpoint)
        if ep is None:
            return 0
        dropped = self._clear_blocks(ep)
        ep.check.restarted()
        return dropped

    def remove_endpoint(self, endpoint: str) -> int:
        """The endpoint left the pool: drop its entries and its slot.  Returns entries dropped."""
        ep = self._endpoints.pop(endpoint, None)
        if ep is None:
            return 0
        dropped = self._clear_blocks(ep)
        self._by_slot[ep.slot] = None
        self._slot_names[ep.slot] = ""
        heapq.heappush(self._free_slots, ep.slot)
        return dropped

    # -----------------------------------------------------------------------------------------
    # Internals

    def _endpoint(self, name: str) -> _Endpoint:
        ep = self._endpoints.get(name)
        if ep is None:
            if not isinstance(name, str) or not name:
                raise IndexConfigError(
                    f"endpoint must be a non-empty 'ip:port' string, got {name!r}"
                )
            # Lowest free slot first keeps masks (Python ints) as short as the pool allows.
            if self._free_slots:
                slot = heapq.heappop(self._free_slots)
            else:
                slot = len(self._by_slot)
                self._by_slot.append(None)
                self._slot_names.append("")
            ep = _Endpoint(name, slot, 1 << slot, EndpointKeyState(name))
            self._by_slot[slot] = ep
            self._slot_names[slot] = name
            if slot >= self._tier_width:
                self._widen_tiers()
            self._endpoints[name] = ep
        return ep

    def _store(self, ep: _Endpoint, keys: list[int], tier: int) -> None:
        blocks = self._blocks
        get = blocks.get
        masks = self._masks
        restored: list[int] = []
        keyset = ep.keys
        bit = ep.bit
        tiers = self._tiers
        added = 0
        for key in keys:
            mask = get(key)
            if tier or (tiers and key in tiers):
                if self._store_tiered(key, mask or 0, bit, tier):
                    keyset[key] = None
                    added += 1
                if mask is not None:
                    restored.append(key)
            elif mask is None:
                blocks[key] = bit
                keyset[key] = None
                added += 1
            else:
                if not mask & bit:
                    mask |= bit
                    blocks[key] = masks.setdefault(mask, mask)
                    keyset[key] = None
                    added += 1
                restored.append(key)
        self.entries += added
        self.stored_total += len(keys)
        ep.stored_total += len(keys)
        if restored:
            self._read_log.append(tuple(restored))
        if self.entries > self.max_entries:
            self._evict_over_share(ep)
            if self.entries > self.max_entries:
                self._evict()

    def _fair_share(self) -> int:
        return max(1, self.max_entries // max(1, len(self._endpoints)))

    def _evict_over_share(self, ep: _Endpoint) -> None:
        """The index is full and ``ep`` stored last: if ``ep`` holds more than its fair share,
        drop its own oldest entries (a little more than needed, so this runs once per batch)."""
        share = self._fair_share()
        excess = len(ep.keys) - share
        if excess <= 0:
            return
        slack = max(1, min(share // 100, 65_536))
        drop = min(len(ep.keys), excess + slack, self.entries - self._evict_to)
        keyset = ep.keys
        # Recently read or re-stored blocks get a second chance, as in `_evict` (whose log
        # this leaves in place): moved to the young end of the endpoint's own order.
        marked: set[int] = set()
        for used in self._read_log:
            marked.update(used)
        victims: list[int] = []
        for key in list(islice(keyset, drop + len(marked))):
            if len(victims) == drop:
                break
            if key in marked:
                keyset[key] = keyset.pop(key)
            else:
                victims.append(key)
        self._drop_holder(victims, ep.bit)
        for key in victims:
            del keyset[key]
        dropped = len(victims)
        self.entries -= dropped
        self.evictions_total += dropped
        self.share_evictions_total += dropped

    # Tier masks of a block held off GPU, packed as ``gpu | cpu << w | storage << 2w`` with
    # ``w = _tier_width`` so that `_tiers` holds ints only (see the module docstring).

    def _unpack(self, packed: int) -> tuple[int, int, int]:
        width = self._tier_width
        field_mask = (1 << width) - 1
        return packed & field_mask, (packed >> width) & field_mask, packed >> (2 * width)

    def _widen_tiers(self) -> None:
        """Double the field width once a slot no longer fits (the 65th endpoint, the 129th...)."""
        old = {key: self._unpack(packed) for key, packed in self._tiers.items()}
        self._tier_width *= 2
        for key, (gpu, cpu, storage) in old.items():
            self._set_tiers(key, gpu, cpu, storage)

    def _store_tiered(self, key: int, mask: int, bit: int, tier: int) -> bool:
        """Add ``bit`` on ``tier`` to a block that is or will be in `_tiers`; True when the
        (block, endpoint) entry is new."""
        packed = self._tiers.get(key)
        gpu, cpu, storage = (mask, 0, 0) if packed is None else self._unpack(packed)
        if tier == _CPU:
            cpu |= bit
        elif tier == _STORAGE:
            storage |= bit
        else:
            gpu |= bit
        self._set_tiers(key, gpu, cpu, storage)
        return not mask & bit

    def _set_tiers(self, key: int, gpu: int, cpu: int, storage: int) -> None:
        """Write a block's tier masks, keeping `_tiers` only for blocks held off GPU."""
        masks = self._masks
        union = gpu | cpu | storage
        if not union:
            self._blocks.pop(key, None)
            self._tiers.pop(key, None)
            return
        self._blocks[key] = masks.setdefault(union, union)
        if cpu | storage:
            width = self._tier_width
            packed = gpu | cpu << width | storage << (2 * width)
            self._tiers[key] = masks.setdefault(packed, packed)
        else:
            self._tiers.pop(key, None)

    def _remove(self, ep: _Endpoint, keys: list[int], tier: int) -> None:
        blocks = self._blocks
        masks = self._masks
        tiers = self._tiers
        keyset = ep.keys
        bit = ep.bit
        removed = 0
        for key in keys:
            mask = blocks.get(key)
            if mask is None or not mask & bit:
                continue
            packed = tiers.get(key) if tiers else None
            if packed is None:
                if tier != _GPU:
                    continue  # held on GPU only; removing another tier's copy changes nothing
                mask &= ~bit
                if mask:
                    blocks[key] = masks.setdefault(mask, mask)
                else:
                    del blocks[key]
            else:
                held = list(self._unpack(packed))
                if not held[tier] & bit:
                    continue
                held[tier] &= ~bit
                gpu, cpu, storage = held
                self._set_tiers(key, gpu, cpu, storage)
                if (gpu | cpu | storage) & bit:
                    continue  # still held on another tier
            del keyset[key]
            removed += 1
        self.entries -= removed
        self.removed_total += removed
        ep.removed_total += removed

    def _drop_holder(self, keys: Iterable[int], bit: int) -> None:
        """Take the endpoint of ``bit`` off blocks it holds, on every tier; a block no one holds
        any more is deleted.  The caller updates the endpoint's own keys and the counts."""
        blocks = self._blocks
        masks = self._masks
        tiers = self._tiers
        keep = ~bit
        for key in keys:
            packed = tiers.get(key) if tiers else None
            if packed is None:
                mask = blocks[key] & keep
                if mask:
                    blocks[key] = masks.setdefault(mask, mask)
                else:
                    del blocks[key]
            else:
                gpu, cpu, storage = self._unpack(packed)
                self._set_tiers(key, gpu & keep, cpu & keep, storage & keep)

    def _clear_blocks(self, ep: _Endpoint) -> int:
        self._drop_holder(ep.keys, ep.bit)
        dropped = len(ep.keys)
        ep.keys = {}
        self.entries -= dropped
        self.cleared_total += dropped
        return dropped

    def _evict(self) -> None:
        """Drop the least recently used blocks until ``entries`` is a little under the cap."""
        blocks = self._blocks
        by_slot = self._by_slot
        target = max(0, self._evict_to)
        # Blocks read or stored again since the last eviction get a second chance, once.
        marked: set[int] = set()
        for used in self._read_log:
            marked.update(used)
        self._read_log.clear()
        while self.entries > target:
            # Take the oldest keys in one slice: each `next(iter(dict))` would rescan the
            # deleted slots at the front of the table.
            oldest = list(islice(blocks, 1024))
            if not oldest:
                break
            for key in oldest:
                if self.entries <= target:
                    break
                if key in marked:
                    marked.discard(key)
                    blocks[key] = blocks.pop(key)  # second chance, same key object
                    continue
                mask = blocks.pop(key)
                self._tiers.pop(key, None)
                for slot in _slots_of(mask):
                    ep = by_slot[slot]
                    assert ep is not None
                    del ep.keys[key]
                dropped = mask.bit_count()
                self.entries -= dropped
                self.evictions_total += dropped

    def consistency_errors(self, limit: int = 10) -> list[str]:
        """Invariant violations between the block map, the tier map and the reverse maps (for
        tests and debugging; O(entries)).  Empty when the index is consistent."""
        errors: list[str] = []
        total = 0
        for ep in self._endpoints.values():
            total += len(ep.keys)
            if self._by_slot[ep.slot] is not ep:
                errors.append(f"{ep.name}: slot {ep.slot} does not point back to it")
            for key in ep.keys:
                if not self._blocks.get(key, 0) & ep.bit:
                    errors.append(f"{ep.name}: reverse map has {key:#x}, block map does not")
                    break
        for key, mask in self._blocks.items():
            if not mask:
                errors.append(f"block {key:#x} has an empty mask")
            for slot in _slots_of(mask):
                holder = self._by_slot[slot] if slot < len(self._by_slot) else None
                if holder is None or key not in holder.keys:
                    errors.append(f"block {key:#x}: slot {slot} holds it but its reverse map not")
            packed = self._tiers.get(key)
            if packed is not None:
                gpu, cpu, storage = self._unpack(packed)
                if gpu | cpu | storage != mask or not cpu | storage:
                    errors.append(f"block {key:#x}: tiers {packed:#x} disagree with {mask:#x}")
            if len(errors) >= limit:
                break
        if not set(self._tiers) <= set(self._blocks):
            errors.append("tier map has keys the block map does not")
        if total != self.entries:
            errors.append(f"entries counter {self.entries} != {total} held")
        if self.entries > self.max_entries:
            errors.append(f"entries {self.entries} exceed max_entries {self.max_entries}")
        return errors[:limit]
