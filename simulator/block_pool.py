"""The engine's prefix cache: vLLM 0.33's ``BlockPool`` in miniature, and the KV events it emits.

Modelled on ``vllm/v1/core/block_pool.py``, ``kv_cache_manager.py`` and
``single_type_kv_cache_manager.py``:

* ``num_gpu_blocks`` blocks of ``block_size`` tokens; block 0 is the reserved null block, so
  ``num_gpu_blocks - 1`` are usable.  Every block has a reference count.
* The free queue holds every block with no reference, cached or not, and is consumed from its
  head: initially the blocks in id order, then blocks in the order they were freed.  A request
  frees its blocks tail first (vLLM frees ``reversed(req_blocks)``), so the end of a prompt is
  evicted before its shared beginning.  Taking a cached block off the head evicts it: one
  ``BlockRemoved`` per hash.  A prefix hit on a free cached block takes it out of the queue.
* A block is cached (``BlockStored``) when the request's computed tokens fill it, which vLLM does
  at scheduling time in ``allocate_slots`` → ``cache_blocks``: prompt blocks when their prefill
  chunk is scheduled, decode blocks when the token that completes them is scheduled.  Blocks
  reused from the cache produce no event.  Two blocks can carry the same hash (a fully cached
  prompt recomputes its last block): both are cached and both emit events, as in vLLM.
* Admission looks up the longest run of cached full blocks, capped at ``(num_tokens - 1) //
  block_size`` blocks because vLLM always recomputes the last prompt token to get logits
  (``KVCacheManager.get_computed_blocks``: ``max_cache_hit_length = request.num_tokens - 1``).

**Events** — everything a step produced is one `KVEventBatch` (vLLM publishes one batch per step
that produced events), with the fields vLLM 0.33's GPU pool puts on the wire: ``medium="GPU"``,
``group_idx=0``, ``kv_cache_spec_kind="full_attention"``, per-block untagged extra keys.

Block identity: a request brings either its token ids (hashed here with `indexer.hashing`, vLLM's
algorithm, so event hashes equal the real pod's), or precomputed chained digests, or just its
length and precomputed 64-bit block keys (benchmarks that hash once for many engines).  Blocks
completed during decode extend the same chain when the digests and tokens are known, and get a
deterministic per-request synthetic key otherwise (generated text is never shared anyway).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from itertools import islice
from typing import Any, Final

from indexer.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent, KVEventBatch
from indexer.hashing import HashConfig, PrefixHasher, event_key, extra_keys_for_block
from simulator.engine_config import EngineConfig, LoRA
from simulator.request_state import RequestState

_MASK64: Final = (1 << 64) - 1
_MEDIUM: Final = "GPU"
_SPEC_KIND: Final = "full_attention"


def mix64(x: int) -> int:
    """splitmix64's finalizer: a cheap, well-spread 64-bit hash of an int."""
    x &= _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


class BlockPool:
    """Reference-counted KV blocks, the hash → block map, and the events not yet taken."""

    def __init__(self, config: EngineConfig) -> None:
        self._config = config
        self._hash_config = HashConfig(
            block_size=config.block_size, algo=config.hash_algo, seed=config.hash_seed
        )
        self._hasher: PrefixHasher | None = None  # built on first use: key-only callers never hash
        self._none_hash: bytes | None = None
        n = config.num_gpu_blocks
        self._ref = [0] * n
        self._block_key: list[int | None] = [None] * n
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(1, n))
        self._cached: dict[int, int] = {}
        self._duplicates: dict[int, list[int]] = {}
        self._events: list[KVEvent] = []

    # ------------------------------------------------------------------------------------------
    # Occupancy

    def num_free(self) -> int:
        return len(self._free)

    def num_free_without(self, blocks: list[int]) -> int:
        """Free blocks left once ``blocks`` (prefix hits, some possibly free) are in use."""
        ref = self._ref
        return len(self._free) - sum(1 for b in blocks if ref[b] == 0)

    def usage(self) -> float:
        """``BlockPool.get_usage()``: cached free blocks count as free."""
        return 1.0 - len(self._free) / (self._config.num_gpu_blocks - 1)

    def num_cached_blocks(self) -> int:
        return len(self._cached) + sum(len(v) for v in self._duplicates.values())

    def cached_block_keys(self) -> set[int]:
        return set(self._cached)

    # ------------------------------------------------------------------------------------------
    # Allocation

    def longest_cached_prefix(self, request: RequestState) -> list[int]:
        if not self._config.enable_prefix_caching:
            return []
        max_blocks = (request.num_tokens - 1) // self._config.block_size
        self._ensure_keys(request, max_blocks)
        cached = self._cached
        hits: list[int] = []
        for key in islice(request.keys, max_blocks):
            block = cached.get(key)
            if block is None:
                break
            hits.append(block)
        return hits

    def touch(self, blocks: list[int]) -> None:
        ref = self._ref
        free = self._free
        for block in blocks:
            if ref[block] == 0:
                del free[block]
            ref[block] += 1

    def take_free_blocks(self, request: RequestState, count: int) -> None:
        free = self._free
        ref = self._ref
        block_key = self._block_key
        blocks = request.blocks
        for _ in range(count):
            block, _ = free.popitem(last=False)
            key = block_key[block]
            if key is not None:
                self._evict(block, key)
            ref[block] = 1
            blocks.append(block)

    def free_blocks(self, request: RequestState) -> None:
        ref = self._ref
        free = self._free
        for block in reversed(request.blocks):  # tail first, as vLLM frees
            ref[block] -= 1
            if ref[block] == 0:
                free[block] = None
        request.blocks = []

    def _evict(self, block: int, key: int) -> None:
        self._block_key[block] = None
        cached = self._cached
        if cached.get(key) == block:
            others = self._duplicates.get(key)
            if others:
                cached[key] = others.pop()
                if not others:
                    del self._duplicates[key]
            else:
                del cached[key]
        else:
            others = self._duplicates[key]
            others.remove(block)
            if not others:
                del self._duplicates[key]
        if self._config.emit_events:
            self._events.append(BlockRemoved(block_hashes=(key,), medium=_MEDIUM, group_idx=0))

    # ------------------------------------------------------------------------------------------
    # Caching

    def cache_full_blocks(self, request: RequestState, num_tokens: int) -> None:
        """vLLM's ``cache_blocks`` after ``allocate_slots``: newly full blocks enter the cache."""
        if not self._config.enable_prefix_caching:
            return
        size = self._config.block_size
        start = request.num_cached_blocks
        end = min(num_tokens, request.num_tokens) // size
        if end <= start:
            return
        self._ensure_keys(request, end)
        keys = request.keys
        blocks = request.blocks
        block_key = self._block_key
        cached = self._cached
        for i in range(start, end):
            block = blocks[i]
            key = keys[i]
            block_key[block] = key
            if key in cached:
                self._duplicates.setdefault(key, []).append(block)
            else:
                cached[key] = block
        request.num_cached_blocks = end
        if self._config.emit_events:
            self._events.append(self._block_stored(request, start, end))

    def _block_stored(self, request: RequestState, start: int, end: int) -> BlockStored:
        size = self._config.block_size
        tokens = request.token_ids
        lora = request.lora
        salt = request.cache_salt
        extra: list[tuple[Any, ...] | None] = []
        for i in range(start, end):
            # vLLM's to_event_extra_keys: the untagged projection of the hash's extra keys.
            keys: tuple[Any, ...] = (lora.name,) if lora else ()
            if i == 0 and salt:
                keys = (*keys, salt)
            extra.append(keys or None)
        return BlockStored(
            block_hashes=tuple(request.keys[start:end]),
            parent_block_hash=request.keys[start - 1] if start > 0 else None,
            token_ids=tuple(tokens[start * size : end * size]) if tokens is not None else (),
            block_size=size,
            lora_id=lora.int_id if lora else None,
            medium=_MEDIUM,
            lora_name=lora.name if lora else None,
            extra_keys=tuple(extra),
            group_idx=0,
            kv_cache_spec_kind=_SPEC_KIND,
        )

    def reset(self) -> bool:
        """vLLM's ``BlockPool.reset_prefix_cache``: forget every cached hash and queue
        ``AllBlocksCleared``, only when no request holds a block; False (nothing done) otherwise."""
        if len(self._free) != self._config.num_gpu_blocks - 1:
            return False
        self._cached.clear()
        self._duplicates.clear()
        self._block_key = [None] * self._config.num_gpu_blocks
        if self._config.emit_events:
            self._events.append(AllBlocksCleared())
        return True

    def take_batch(self, ts: float) -> KVEventBatch | None:
        """The events queued since the last batch, stamped ``ts``; None when there are none."""
        if not self._events:
            return None
        events, self._events = self._events, []
        return KVEventBatch(
            ts=ts, events=tuple(events), data_parallel_rank=self._config.data_parallel_rank
        )

    # ------------------------------------------------------------------------------------------
    # Block keys

    def prompt_digests(
        self, tokens: Sequence[int], lora: LoRA | None, cache_salt: str | None
    ) -> list[bytes]:
        """The chained digests of the prompt's full blocks, as the pod would hash them."""
        if self._hasher is None:
            self._hasher = PrefixHasher(
                self._hash_config, cache_blocks=self._config.hasher_cache_blocks
            )
        return self._hasher.digests(
            tokens,
            lora_name=lora.name if lora else None,
            lora_path=lora.path if lora else None,
            cache_salt=cache_salt,
        )

    def _ensure_keys(self, request: RequestState, count: int) -> None:
        """Keys for the first ``count`` full blocks (the prompt's are known from the start;
        blocks that include generated tokens are keyed when first needed)."""
        keys = request.keys
        if len(keys) >= count:
            return
        size = self._config.block_size
        tokens = request.token_ids
        digests = request.digests
        while len(keys) < count:
            i = len(keys)
            if tokens is not None and digests is not None:
                parent = digests[i - 1] if i else self._root_hash()
                lora = request.lora
                extra = extra_keys_for_block(
                    i * size,
                    (i + 1) * size,
                    lora_name=lora.name if lora else None,
                    lora_path=lora.path if lora else None,
                    cache_salt=request.cache_salt,
                )
                digest = self._hash_config.hash_block(
                    parent, tokens[i * size : (i + 1) * size], extra
                )
                digests.append(digest)
                keys.append(event_key(digest))
            else:
                keys.append(mix64((keys[i - 1] if i else 0) ^ mix64(request.uid + i)))

    def _root_hash(self) -> bytes:
        if self._none_hash is None:
            self._none_hash = self._hash_config.none_hash
        return self._none_hash
