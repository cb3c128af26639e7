"""Prefix-cache block hashes, byte for byte as vLLM computes them.

vLLM (`vllm/v1/core/kv_cache_utils.py`, 0.33) hashes every *full* block of a request as
``H((parent_digest, tuple(block_token_ids), extra_keys_or_None))`` where ``H`` is chosen by
``--prefix-caching-hash-algo`` and the first block's parent is ``NONE_HASH = H(seed_string)``.
KV events carry the last 8 bytes of each digest read big-endian (``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES``
defaults to 1), which is what `block_hashes` returns.  See ``docs/vllm-interop.md`` §1–§3.

Two entry points:

* `block_digests` / `block_hashes`: the reference functions, one call per prompt.
* `PrefixHasher`: the same hashes for the request hot path, with a bounded cache of block digests
  so a shared system prompt is hashed once, not once per request.
"""

from __future__ import annotations

import hashlib
import pickle
import struct
import weakref
from array import array
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Final, Literal, get_args

import cbor2
import xxhash

from indexer.errors import HashConfigError

HashAlgo = Literal["sha256", "sha256_cbor", "xxhash", "xxhash_cbor", "sha256_cbor_64bit"]
HASH_ALGOS: Final[tuple[str, ...]] = get_args(HashAlgo)

ExtraKeysStyle = Literal["tagged", "untagged"]
"""``tagged``: vLLM ≥ 0.31, ``("lora", name, path)``, ``("mm", id, offset)``, ``("cache_salt", s)``.
``untagged``: vLLM 0.11.1–0.30, bare ``lora_name`` (or ``lora_id`` before 0.11.1), ``(id, offset)``
and the bare salt, in that order."""

DEFAULT_NONE_HASH_SEED: Final = "vllm-none-hash"  # vLLM >= 0.29, sha256* only
_FAST_CBOR_ALGOS: Final = frozenset({"sha256_cbor", "xxhash_cbor"})

# The tag strings are module constants on purpose: pickle memoizes by object identity, and vLLM's
# tags are interned literals too, so two "mm" tags in one block pickle the same way in both.
_LORA_TAG: Final = "lora"
_MM_TAG: Final = "mm"
_SALT_TAG: Final = "cache_salt"

MMItem = tuple[str, int, int]
"""A multimodal placeholder: ``(identifier, offset, length)`` in prompt-token positions."""


def event_key(digest: bytes) -> int:
    """The 64-bit key vLLM publishes for a digest: its last 8 bytes, big-endian, unsigned."""
    return int.from_bytes(digest[-8:], "big")


def event_keys(digests: Sequence[bytes]) -> list[int]:
    """`event_key` of every digest, in one C call when they share a length (they do when one
    `HashConfig` made them): 27 µs instead of 92 µs for 512 SHA-256 digests."""
    if not digests:
        return []
    width = len(digests[0])
    if width < 8 or any(len(d) != width for d in digests):
        return [event_key(d) for d in digests]
    return list(_key_unpacker(width, len(digests)).unpack(b"".join(digests)))


@lru_cache(maxsize=256)
def _key_unpacker(width: int, count: int) -> struct.Struct:
    return struct.Struct(f">{count}Q" if width == 8 else ">" + f"{width - 8}xQ" * count)


def _serialize(algo: str, obj: Any) -> bytes:
    if algo.endswith("_cbor") or algo == "sha256_cbor_64bit":
        return cbor2.dumps(obj, canonical=True)
    # vLLM uses pickle.HIGHEST_PROTOCOL, which is 5 on every CPython vLLM supports.
    return pickle.dumps(obj, protocol=5)


def _digest(algo: str, data: bytes) -> bytes:
    if algo.startswith("sha256"):
        full = hashlib.sha256(data).digest()
        # vLLM 0.10.0-0.10.1 chained on the truncated 64-bit value (`sha256_cbor_64bit`).
        return full[24:] if algo == "sha256_cbor_64bit" else full
    return xxhash.xxh3_128_digest(data)


class _CborUint(dict[int, bytes]):
    """Canonical CBOR encodings of token ids, filled on first use (major type 0, minimal length)."""

    def __missing__(self, value: int) -> bytes:
        if value < 0:
            raise HashConfigError(f"token id {value} is negative; vLLM token ids are >= 0")
        if value < 24:
            encoded = bytes((value,))
        elif value < 1 << 8:
            encoded = bytes((0x18, value))
        elif value < 1 << 16:
            encoded = b"\x19" + value.to_bytes(2, "big")
        elif value < 1 << 32:
            encoded = b"\x1a" + value.to_bytes(4, "big")
        else:
            encoded = b"\x1b" + value.to_bytes(8, "big")
        self[value] = encoded
        return encoded


_CBOR_UINT = _CborUint()


def _cbor_array_header(length: int) -> bytes:
    if length < 24:
        return bytes((0x80 + length,))
    if length < 1 << 8:
        return bytes((0x98, length))
    return b"\x99" + length.to_bytes(2, "big")


def _cbor_plain_block(parent: bytes, tokens: Sequence[int]) -> bytes:
    """``cbor2.dumps((parent, tuple(tokens), None), canonical=True)`` without the generic encoder:
    the hot case (no extra keys) is a fixed layout, and building it directly halves the cost of a
    sha256_cbor block.  Equality with cbor2 is a property test."""
    parent_header = b"\x58\x20" if len(parent) == 32 else bytes((0x40 + len(parent),))
    return b"".join(
        (
            b"\x83",
            parent_header,
            parent,
            _cbor_array_header(len(tokens)),
            b"".join(map(_CBOR_UINT.__getitem__, tokens)),
            b"\xf6",
        )
    )


def _sha256_pickle_plain(parent: bytes, tokens: tuple[int, ...]) -> bytes:
    # `HashConfig.hash_block` for "sha256" without extra keys, minus its dispatch.
    return hashlib.sha256(pickle.dumps((parent, tokens, None), protocol=5)).digest()


def _sha256_cbor_plain(parent: bytes, tokens: tuple[int, ...]) -> bytes:
    if len(parent) != 32:  # a caller-given parent: let the general path encode it
        return _digest("sha256_cbor", _serialize("sha256_cbor", (parent, tokens, None)))
    return hashlib.sha256(_cbor_plain_block(parent, tokens)).digest()


def _parent_object(algo: str, parent: bytes) -> bytes | int:
    # Only the legacy 64-bit algorithm chains on an int; every other one on the raw digest.
    return int.from_bytes(parent, "big") if algo == "sha256_cbor_64bit" else parent


@dataclass(slots=True, frozen=True)
class HashConfig:
    """How the pods hash blocks.  Must equal the pods' ``--block-size``,
    ``--prefix-caching-hash-algo`` and ``PYTHONHASHSEED`` (None = unset)."""

    block_size: int = 16
    algo: HashAlgo = "sha256_cbor"
    seed: str | None = None
    extra_keys_style: ExtraKeysStyle = "tagged"

    def __post_init__(self) -> None:
        if self.algo not in HASH_ALGOS:
            raise HashConfigError(
                f"hash algorithm {self.algo!r} is not one vLLM uses; "
                f"expected one of {', '.join(HASH_ALGOS)}"
            )
        if not isinstance(self.block_size, int) or isinstance(self.block_size, bool):
            raise HashConfigError(f"block_size must be an integer, got {self.block_size!r}")
        if not 1 <= self.block_size <= 4096:
            raise HashConfigError(
                f"block_size {self.block_size} is out of range: vLLM block sizes are 1..4096 "
                "(commonly 16, 32 or 64); use the pods' --block-size"
            )
        if self.seed is None and self.algo.startswith("xxhash"):
            raise HashConfigError(
                f"{self.algo} without PYTHONHASHSEED is not reproducible: vLLM seeds NONE_HASH "
                "with os.urandom per process. Set the same PYTHONHASHSEED on the pods and here, "
                "or run the pods with --prefix-caching-hash-algo sha256_cbor"
            )
        if self.seed is None and self.algo == "sha256_cbor_64bit":
            raise HashConfigError(
                "sha256_cbor_64bit (vLLM 0.10.0-0.10.1) seeds NONE_HASH randomly when "
                "PYTHONHASHSEED is unset; set it on the pods and pass the same seed here"
            )
        if self.extra_keys_style not in get_args(ExtraKeysStyle):
            raise HashConfigError(
                f"extra_keys_style {self.extra_keys_style!r} must be 'tagged' (vLLM >= 0.31) "
                "or 'untagged' (vLLM 0.11.1-0.30)"
            )

    @property
    def none_hash(self) -> bytes:
        """The first block's parent: ``H(PYTHONHASHSEED)``, or ``H("vllm-none-hash")`` when unset."""
        seed = DEFAULT_NONE_HASH_SEED if self.seed is None else self.seed
        return _digest(self.algo, _serialize(self.algo, seed))

    def hash_block(
        self, parent: bytes, tokens: Sequence[int], extra: tuple[Any, ...] | None
    ) -> bytes:
        """One chained block digest, exactly as vLLM's ``hash_block_tokens``."""
        if extra is None and self.algo in _FAST_CBOR_ALGOS and len(parent) in (16, 32):
            return _digest(self.algo, _cbor_plain_block(parent, tokens))
        obj = (_parent_object(self.algo, parent), tuple(tokens), extra)
        return _digest(self.algo, _serialize(self.algo, obj))


def extra_keys_for_block(
    start: int,
    end: int,
    *,
    style: ExtraKeysStyle = "tagged",
    lora_name: str | None = None,
    lora_path: str | None = None,
    lora_id: int | None = None,
    cache_salt: str | None = None,
    mm: Sequence[MMItem] = (),
) -> tuple[Any, ...] | None:
    """The extra keys vLLM mixes into the hash of the block covering tokens ``[start, end)``:
    LoRA first, then every multimodal item overlapping the block (sorted by offset), then the
    cache salt on block 0 only.  None when there are none (vLLM hashes ``None`` then)."""
    keys: list[Any] = []
    lora = lora_name is not None or lora_id is not None
    if lora:
        if style == "tagged":
            keys.append((_LORA_TAG, lora_name, lora_path))
        else:
            # <= 0.11.0 hashed the integer id, 0.11.1-0.30 the bare name.
            keys.append(lora_id if lora_id is not None else lora_name)
    for identifier, offset, length in sorted(mm, key=lambda item: item[1]):
        if end > offset and start < offset + length:
            relative = offset - start  # negative when the item began in an earlier block
            keys.append(
                (_MM_TAG, identifier, relative) if style == "tagged" else (identifier, relative)
            )
    if start == 0 and cache_salt:
        keys.append((_SALT_TAG, cache_salt) if style == "tagged" else cache_salt)
    return tuple(keys) if keys else None


def block_digests(
    token_ids: Sequence[int],
    *,
    block_size: int,
    algo: HashAlgo = "sha256_cbor",
    seed: str | None = None,
    lora_name: str | None = None,
    lora_path: str | None = None,
    cache_salt: str | None = None,
    mm: Sequence[MMItem] = (),
    extra_keys_style: ExtraKeysStyle = "tagged",
    lora_id: int | None = None,
    lookahead: int = 0,
    group_block_size: int | None = None,
) -> list[bytes]:
    """The raw chained digests of every full block of ``token_ids``, as vLLM stores them.

    ``seed`` is the pods' ``PYTHONHASHSEED`` string (None = unset).  ``lookahead`` is vLLM 0.33's
    ``num_hash_lookahead_tokens`` (EAGLE block drop): a block is hashed once its next ``lookahead``
    tokens exist and those tokens join its extra keys.  ``group_block_size`` (a multiple of
    ``block_size``) returns, per KV block of that size, the last hash inside it, as hybrid models'
    groups do (``BlockHashListWithBlockSize``).
    """
    config = HashConfig(
        block_size=block_size, algo=algo, seed=seed, extra_keys_style=extra_keys_style
    )
    if lookahead < 0:
        raise HashConfigError(f"lookahead must be >= 0, got {lookahead}")
    if lora_name is not None and lora_path is None and extra_keys_style == "tagged":
        raise HashConfigError(
            f"LoRA {lora_name!r}: vLLM >= 0.31 hashes the adapter path too; pass lora_path "
            "(the path the adapter was registered with, e.g. --lora-modules name=path)"
        )
    digests: list[bytes] = []
    parent = config.none_hash
    for start in range(0, len(token_ids) - block_size - lookahead + 1, block_size):
        end = start + block_size
        extra = extra_keys_for_block(
            start,
            end + lookahead,
            style=extra_keys_style,
            lora_name=lora_name,
            lora_path=lora_path,
            lora_id=lora_id,
            cache_salt=cache_salt,
            mm=mm,
        )
        if lookahead:
            extra = (extra, *token_ids[end : end + lookahead])
        parent = config.hash_block(parent, token_ids[start:end], extra)
        digests.append(parent)
    if group_block_size is not None:
        if group_block_size <= 0 or group_block_size % block_size:
            raise HashConfigError(
                f"group_block_size {group_block_size} must be a positive multiple of the hash "
                f"block size {block_size}"
            )
        scale = group_block_size // block_size
        digests = digests[scale - 1 :: scale]
    return digests


def block_hashes(
    token_ids: Sequence[int],
    *,
    block_size: int,
    algo: HashAlgo = "sha256_cbor",
    seed: str | None = None,
    lora_name: str | None = None,
    lora_path: str | None = None,
    cache_salt: str | None = None,
    mm: Sequence[MMItem] = (),
    extra_keys_style: ExtraKeysStyle = "tagged",
    lora_id: int | None = None,
    lookahead: int = 0,
    group_block_size: int | None = None,
) -> list[int]:
    """The 64-bit keys vLLM publishes in its KV events for every full block of ``token_ids``.

    Same arguments as `block_digests`.
    """
    return [
        event_key(d)
        for d in block_digests(
            token_ids,
            block_size=block_size,
            algo=algo,
            seed=seed,
            lora_name=lora_name,
            lora_path=lora_path,
            cache_salt=cache_salt,
            mm=mm,
            extra_keys_style=extra_keys_style,
            lora_id=lora_id,
            lookahead=lookahead,
            group_block_size=group_block_size,
        )
    ]


@dataclass(slots=True, frozen=True)
class RequestKeys:
    """What one prompt contributes to a lookup: its chained digests and their event keys."""

    digests: tuple[bytes, ...]
    keys: tuple[int, ...]


def _plain_block_hasher(config: HashConfig) -> Callable[[bytes, tuple[int, ...]], bytes]:
    """``config.hash_block(parent, tokens, None)`` as one direct call (the hot case)."""
    if config.algo == "sha256":
        return _sha256_pickle_plain
    if config.algo == "sha256_cbor":
        return _sha256_cbor_plain_hasher(config.block_size)
    return lambda parent, tokens: config.hash_block(parent, tokens, None)


def _sha256_cbor_plain_hasher(block_size: int) -> Callable[[bytes, tuple[int, ...]], bytes]:
    """`_sha256_cbor_plain` for full blocks of ``block_size`` chained on a 32-byte digest, with
    the fixed parts of the CBOR document prepared once and everything looked up in locals:
    1.95 -> 1.26 µs per 16-token block in a tight loop, 1.64 -> 1.55 ms (best of 100) for the
    512 new blocks of an 8k-token prompt, where SHA-256 and the token encodings dominate."""
    sha256 = hashlib.sha256
    join = b"".join
    encode = _CBOR_UINT.__getitem__
    array_header = _cbor_array_header(block_size)

    def hash_plain(parent: bytes, tokens: tuple[int, ...]) -> bytes:
        if len(parent) != 32 or len(tokens) != block_size:
            return _sha256_cbor_plain(parent, tokens)
        # [parent as a 32-byte string, the tokens as an array of uints, null]
        document = (b"\x83\x58\x20", parent, array_header, join(map(encode, tokens)), b"\xf6")
        return sha256(join(document)).digest()

    return hash_plain


DEFAULT_CACHE_BLOCKS: Final = 32_768
"""Blocks `PrefixHasher` remembers by default: 512k tokens at block size 16, about 10 MiB."""
CACHE_BYTES_PER_BLOCK: Final = 320
"""Measured cost of one cached block, rounded up: 268-296 bytes (tracemalloc, block size 16,
sha256 and sha256_cbor; 348 with the former tuple-of-ints keys when token ids are shared int
objects, several hundred more when they are not): the key (parent digest + the block's token
ids as uint32, one bytes object), the digest, the LRU entry."""


def live_cache_blocks() -> int:
    """Blocks held now by the caches of every `PrefixHasher` alive in this process (exported
    as a metric, so a soak can tell a cache filling up from a leak)."""
    return sum(len(hasher) for hasher in list(_LIVE_HASHERS))


class PrefixHasher:
    """`block_hashes` for the request hot path: identical output, with a bounded LRU of block
    digests keyed by ``(parent digest, block tokens, extra keys)``.

    A shared system prompt costs one dict lookup per block after the first request instead of a
    serialisation and a SHA-256 (about 5x less work).  A key is one bytes object (the parent
    digest followed by the tokens as uint32), not a tuple of int objects, so an entry costs about
    `CACHE_BYTES_PER_BLOCK` bytes and is invisible to the garbage collector.  Not thread-safe:
    one per event loop, or a lock around it.
    """

    def __init__(self, config: HashConfig, *, cache_blocks: int = DEFAULT_CACHE_BLOCKS) -> None:
        if isinstance(cache_blocks, bool) or not isinstance(cache_blocks, int) or cache_blocks < 0:
            raise HashConfigError(
                f"cache_blocks must be an integer >= 0 (0 turns the cache off), got "
                f"{cache_blocks!r}; each cached block costs about {CACHE_BYTES_PER_BLOCK} bytes"
            )
        self.config = config
        self._none_hash = config.none_hash
        self._plain_hash = _plain_block_hasher(config)
        self._cache: OrderedDict[bytes | tuple[Any, ...], bytes] = OrderedDict()
        self._capacity = cache_blocks
        self.hits = 0
        self.misses = 0
        _LIVE_HASHERS.add(self)

    @property
    def capacity(self) -> int:
        """The most blocks the cache holds (0: no cache)."""
        return self._capacity

    def __len__(self) -> int:
        """Blocks cached now."""
        return len(self._cache)

    def digests(
        self,
        token_ids: Sequence[int],
        *,
        lora_name: str | None = None,
        lora_path: str | None = None,
        cache_salt: str | None = None,
        mm: Sequence[MMItem] = (),
        parent: bytes | None = None,
        start_offset: int = 0,
    ) -> list[bytes]:
        """Digests of the full blocks of ``token_ids``.  ``parent``/``start_offset`` continue a
        chain from an earlier block (used to re-key a pod's event tokens mid-sequence)."""
        config = self.config
        size = config.block_size
        count = len(token_ids) // size
        out: list[bytes] = []
        chain = self._none_hash if parent is None else parent
        if not count:
            return out
        capacity = self._capacity
        raw: bytes | None = None
        if capacity:
            try:
                raw = array("I", token_ids[: count * size]).tobytes()
            except (OverflowError, TypeError):
                raw = None  # ids that are not uint32 (vLLM rejects them): tuple keys
        cache = self._cache
        hash_block = config.hash_block
        plain_hash = self._plain_hash
        # One tuple for the whole prompt: its slices are the tuples vLLM hashes, copied once.
        ids = tuple(token_ids[: count * size])
        plain = lora_name is None and not mm
        width = 4 * size
        if raw is not None and plain and (start_offset != 0 or not cache_salt):
            return self._plain_digests(chain, ids, raw, count)
        hits = misses = 0
        for index in range(count):
            start = index * size
            absolute = start + start_offset
            extra: tuple[Any, ...] | None
            if plain and (absolute != 0 or not cache_salt):
                extra = None
            else:
                extra = extra_keys_for_block(
                    absolute,
                    absolute + size,
                    style=config.extra_keys_style,
                    lora_name=lora_name,
                    lora_path=lora_path,
                    cache_salt=cache_salt,
                    mm=mm,
                )
            if not capacity:
                block = ids[start : start + size]
                chain = (
                    plain_hash(chain, block) if extra is None else hash_block(chain, block, extra)
                )
                out.append(chain)
                continue
            key: bytes | tuple[Any, ...]
            if raw is not None:
                key = chain + raw[index * width : index * width + width]
                if extra is not None:
                    key = (key, extra)
            else:
                key = (chain, ids[start : start + size], extra)
            found = cache.get(key)
            if found is None:
                misses += 1
                block = ids[start : start + size]
                found = (
                    plain_hash(chain, block) if extra is None else hash_block(chain, block, extra)
                )
                cache[key] = found
                if len(cache) > capacity:
                    cache.popitem(last=False)
            else:
                hits += 1
                cache.move_to_end(key)
            chain = found
            out.append(found)
        self.hits += hits
        self.misses += misses if capacity else count
        return out

    def _plain_digests(
        self, chain: bytes, ids: tuple[int, ...], raw: bytes, count: int
    ) -> list[bytes]:
        """`digests` of blocks without extra keys, with the cache on (the hot case).

        The same result as the general loop, in two runs: the cached prefix (one lookup per
        block), then, from the first miss on, every block hashed and remembered without
        looking it up first.  A block after a miss can still be cached (its parent evicted
        before it), but hashing it again gives the same digest.  Against the general loop,
        interleaved in one process (sha256, 8k tokens, median): a new prompt 0.92 -> 0.85 ms,
        one whose 7.8k-token prefix is cached 0.28 -> 0.23 ms.
        (During the call the cache may exceed its capacity by this prompt's new blocks.)
        """
        size = self.config.block_size
        width = 4 * size
        cache = self._cache
        get = cache.get
        out: list[bytes] = []
        cached = 0
        key = chain + raw[:width]
        while (found := get(key)) is not None:
            cache.move_to_end(key)
            chain = found
            out.append(found)
            cached += 1
            if cached == count:
                break
            key = chain + raw[cached * width : cached * width + width]
        self.hits += cached
        self.misses += count - cached
        plain_hash = self._plain_hash
        for index in range(cached, count):
            start = index * size
            chain = plain_hash(chain, ids[start : start + size])
            cache[key] = chain
            out.append(chain)
            key = chain + raw[start * 4 + width : start * 4 + 2 * width]
        for _ in range(len(cache) - self._capacity):
            cache.popitem(last=False)
        return out

    def keys(self, token_ids: Sequence[int], **extra: Any) -> list[int]:
        """The event keys of `digests`."""
        return event_keys(self.digests(token_ids, **extra))


_LIVE_HASHERS: Final[weakref.WeakSet[PrefixHasher]] = weakref.WeakSet()
