"""Block hashes must equal vLLM's bit for bit: every golden vector, read from ``tests/data``."""

from __future__ import annotations

import hashlib
import pickle
import random
from array import array
from typing import Any

import cbor2
import pytest
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from indexer.errors import HashConfigError
from indexer.hashing import (
    HashConfig,
    PrefixHasher,
    block_digests,
    block_hashes,
    event_key,
    event_keys,
    extra_keys_for_block,
    live_cache_blocks,
)
from tests.conftest import load_vectors

_VECTORS = load_vectors()
_TOKENS: dict[str, list[int]] = {
    k: v for k, v in _VECTORS["token_sequences"].items() if not k.startswith("_")
}
_REPRODUCIBLE = [v for v in _VECTORS["hash_vectors"] if v["reproducible_across_processes"]]
_RANDOM_SEEDED = [v for v in _VECTORS["hash_vectors"] if not v["reproducible_across_processes"]]
_LEGACY = _VECTORS["legacy_hash_vectors"]["vectors"]


def _kwargs(v: dict[str, Any]) -> dict[str, Any]:
    lora = v.get("lora") or {}
    mm = [(m["identifier"], m["offset"], m["length"]) for m in v.get("mm_features") or []]
    return {
        "block_size": v.get("block_size") or v["hash_block_size"],
        "algo": v["algo"],
        "seed": v["PYTHONHASHSEED"],
        "lora_name": lora.get("lora_name"),
        "lora_path": lora.get("lora_path"),
        "cache_salt": v.get("cache_salt"),
        "mm": mm,
        "lookahead": v.get("num_hash_lookahead_tokens", 0),
        "group_block_size": v.get("kv_block_size"),
    }


def test_the_vector_file_has_the_expected_cases() -> None:
    # Guards against a silently emptied or truncated vectors file making the tests vacuous.
    assert len(_REPRODUCIBLE) == 72
    assert len(_RANDOM_SEEDED) == 20
    assert len(_LEGACY) == 4


@pytest.mark.parametrize("vector", _REPRODUCIBLE, ids=[v["id"] for v in _REPRODUCIBLE])
def test_digests_and_event_keys_match_vllm(vector: dict[str, Any]) -> None:
    tokens = _TOKENS[vector["tokens"]]
    kwargs = _kwargs(vector)
    expected_hex = vector.get("block_hashes_hex") or vector["block_hashes_hex_at_kv_block_size"]
    assert [d.hex() for d in block_digests(tokens, **kwargs)] == expected_hex
    expected_keys = [int(k) for k in vector["event_block_hashes_uint64"]]
    assert block_hashes(tokens, **kwargs) == expected_keys
    if "none_hash_hex" in vector:
        config = HashConfig(
            block_size=kwargs["block_size"], algo=kwargs["algo"], seed=kwargs["seed"]
        )
        assert config.none_hash.hex() == vector["none_hash_hex"]


@pytest.mark.parametrize("vector", _REPRODUCIBLE, ids=[v["id"] for v in _REPRODUCIBLE])
def test_extra_keys_and_block0_bytes_match_vllm(vector: dict[str, Any]) -> None:
    if "hash_extra_keys_per_block" not in vector:
        pytest.skip("vector records no per-block extra keys (lookahead / kv-block cases)")
    kwargs = _kwargs(vector)
    size = kwargs["block_size"]
    got = [
        extra_keys_for_block(
            i * size,
            (i + 1) * size,
            lora_name=kwargs["lora_name"],
            lora_path=kwargs["lora_path"],
            cache_salt=kwargs["cache_salt"],
            mm=kwargs["mm"],
        )
        for i in range(vector["num_full_blocks"])
    ]
    as_json = [None if k is None else [list(item) for item in k] for k in got]
    assert as_json == vector["hash_extra_keys_per_block"]
    config = HashConfig(block_size=size, algo=kwargs["algo"], seed=kwargs["seed"])
    block0 = (config.none_hash, tuple(_TOKENS[vector["tokens"]][:size]), got[0])
    data = (
        cbor2.dumps(block0, canonical=True)
        if kwargs["algo"].endswith("_cbor")
        else pickle.dumps(block0, protocol=5)
    )
    assert data.hex() == vector["hash_input_bytes_hex_block0"]


@pytest.mark.parametrize("vector", _LEGACY, ids=[v["id"] for v in _LEGACY])
def test_legacy_vectors(vector: dict[str, Any]) -> None:
    tokens = _TOKENS[vector["tokens"]]
    lora = vector.get("lora") or {}
    legacy_64bit = vector["algo"] == "sha256_cbor_64bit"
    keys = block_hashes(
        tokens,
        block_size=vector["block_size"],
        algo=vector["algo"],
        seed=vector["PYTHONHASHSEED"],
        lora_name=lora.get("lora_name"),
        lora_path=lora.get("lora_path"),
        lora_id=lora.get("lora_int_id") if legacy_64bit else None,
        cache_salt=vector.get("cache_salt"),
        extra_keys_style="untagged",
    )
    expected = vector.get("block_hashes_uint64") or vector["event_block_hashes_uint64"]
    assert keys == [int(k) for k in expected]
    if legacy_64bit:
        config = HashConfig(block_size=16, algo="sha256_cbor_64bit", seed=vector["PYTHONHASHSEED"])
        assert int.from_bytes(config.none_hash, "big") == int(vector["none_hash_uint64"])


@pytest.mark.parametrize("vector", _RANDOM_SEEDED, ids=[v["id"] for v in _RANDOM_SEEDED])
def test_xxhash_without_seed_is_refused(vector: dict[str, Any]) -> None:
    with pytest.raises(HashConfigError, match="PYTHONHASHSEED"):
        block_hashes(_TOKENS[vector["tokens"]], **_kwargs(vector))


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"algo": "md5"}, "not one vLLM uses"),
        ({"block_size": 0}, "out of range"),
        ({"algo": "sha256_cbor_64bit"}, "PYTHONHASHSEED"),
        ({"lora_name": "a"}, "lora_path"),
        ({"group_block_size": 24}, "multiple"),
    ],
)
def test_bad_configuration_is_refused_with_a_reason(kwargs: dict[str, Any], message: str) -> None:
    args: dict[str, Any] = {"block_size": 16, **kwargs}
    with pytest.raises(HashConfigError, match=message):
        block_hashes(list(range(64)), **args)


def test_only_full_blocks_are_hashed() -> None:
    assert len(block_hashes(list(range(31)), block_size=16)) == 1
    assert len(block_hashes(list(range(32)), block_size=16)) == 2
    assert block_hashes(list(range(15)), block_size=16) == []


def test_event_key_is_last_eight_bytes_big_endian() -> None:
    digest = bytes(range(32))
    assert event_key(digest) == int.from_bytes(bytes(range(24, 32)), "big")


@settings(max_examples=200, deadline=None)
@given(
    tokens=st.lists(st.integers(min_value=0, max_value=2**32 - 1), min_size=0, max_size=80),
    block_size=st.sampled_from([1, 3, 16, 23, 24, 32]),
    algo=st.sampled_from(["sha256_cbor", "xxhash_cbor"]),
)
def test_fast_cbor_path_equals_cbor2(tokens: list[int], block_size: int, algo: str) -> None:
    # HashConfig.hash_block builds the CBOR of plain blocks by hand; the reference is cbor2.
    config = HashConfig(block_size=block_size, algo=algo, seed="7")  # type: ignore[arg-type]
    parent = config.none_hash
    for start in range(0, len(tokens) - block_size + 1, block_size):
        block = tokens[start : start + block_size]
        generic = cbor2.dumps((parent, tuple(block), None), canonical=True)
        expected = (
            hashlib.sha256(generic).digest()
            if algo == "sha256_cbor"
            else xxhash.xxh3_128_digest(generic)
        )
        assert config.hash_block(parent, block, None) == expected
        parent = expected


@pytest.mark.parametrize("algo", ["sha256_cbor", "sha256"])
def test_prefix_hasher_equals_reference_and_caches(algo: str) -> None:
    rng = random.Random(5)
    shared = [rng.randrange(128_000) for _ in range(200)]
    hasher = PrefixHasher(HashConfig(block_size=16, algo=algo))  # type: ignore[arg-type]
    for i in range(5):
        tokens = shared + [rng.randrange(128_000) for _ in range(40 + i)]
        for salt in (None, "tenant-a"):
            expected = block_hashes(tokens, block_size=16, algo=algo, cache_salt=salt)  # type: ignore[arg-type]
            assert hasher.keys(tokens, cache_salt=salt) == expected
    lora = block_hashes(shared, block_size=16, algo=algo, lora_name="x", lora_path="/x")  # type: ignore[arg-type]
    assert hasher.keys(shared, lora_name="x", lora_path="/x") == lora
    assert hasher.hits > 0


def test_prefix_hasher_continues_a_chain_mid_sequence() -> None:
    tokens = list(range(100, 164))
    digests = block_digests(tokens, block_size=16)
    hasher = PrefixHasher(HashConfig(block_size=16))
    assert hasher.digests(tokens[32:], parent=digests[1], start_offset=32) == digests[2:]


def test_prefix_hasher_cache_is_bounded() -> None:
    hasher = PrefixHasher(HashConfig(block_size=4), cache_blocks=10)
    hasher.keys(list(range(400)))
    assert len(hasher._cache) == 10


def test_prefix_hasher_cache_keys_every_kind_of_block_exactly() -> None:
    """Compact keys (bytes), keys with extra keys, ids that do not fit uint32 (tuple keys), and
    no cache at all: all equal the reference, cold and warm."""
    rng = random.Random(4)
    tokens = [rng.randrange(128_000) for _ in range(200)]
    for algo in ("sha256", "sha256_cbor"):
        for cache_blocks in (0, 3, 1000):
            hasher = PrefixHasher(HashConfig(block_size=16, algo=algo), cache_blocks=cache_blocks)  # type: ignore[arg-type]
            for _ in range(2):
                assert hasher.keys(tokens) == block_hashes(tokens, block_size=16, algo=algo)  # type: ignore[arg-type]
                assert hasher.keys(tokens, cache_salt="s") == block_hashes(
                    tokens,
                    block_size=16,
                    algo=algo,  # type: ignore[arg-type]
                    cache_salt="s",
                )
                big = [*tokens[:40], 1 << 40, *tokens[40:]]
                assert hasher.keys(big) == block_hashes(big, block_size=16, algo=algo)  # type: ignore[arg-type]
            assert len(hasher) <= cache_blocks
    with pytest.raises(HashConfigError, match="cache_blocks"):
        PrefixHasher(HashConfig(), cache_blocks=-1)


def test_prefix_hasher_walks_a_cached_prefix_then_hashes_the_rest() -> None:
    """A cached prefix is looked up, the rest hashed without lookups; a block whose parent was
    evicted (its child still cached) and a cache smaller than one prompt give the same keys."""
    rng = random.Random(8)
    shared = [rng.randrange(128_000) for _ in range(16 * 6)]
    hasher = PrefixHasher(HashConfig(block_size=16, algo="sha256"), cache_blocks=1000)
    for i in range(4):
        tokens = shared + [rng.randrange(128_000) for _ in range(16 * 3 + i)]
        hits, misses = hasher.hits, hasher.misses
        assert hasher.keys(tokens) == block_hashes(tokens, block_size=16, algo="sha256")
        assert hasher.hits - hits == (6 if i else 0)
        assert hasher.misses - misses == (3 if i else 9)
    # Evict the first block only: the chain misses at block 0 and hashes on, re-storing it.
    first = hasher.config.none_hash + array("I", shared[:16]).tobytes()
    del hasher._cache[first]
    assert hasher.keys(shared) == block_hashes(shared, block_size=16, algo="sha256")
    assert first in hasher._cache
    tiny = PrefixHasher(HashConfig(block_size=16, algo="sha256"), cache_blocks=2)
    for _ in range(2):
        assert tiny.keys(shared) == block_hashes(shared, block_size=16, algo="sha256")
        assert len(tiny) == 2


def test_live_cache_blocks_counts_every_hasher_alive() -> None:
    before = live_cache_blocks()
    hasher = PrefixHasher(HashConfig(block_size=16), cache_blocks=100)
    hasher.keys(list(range(16 * 5)))
    assert live_cache_blocks() == before + 5
    del hasher
    assert live_cache_blocks() == before


def test_event_keys_equal_event_key_for_every_digest_width() -> None:
    for width in (32, 16, 8):
        digests = [random.randbytes(width) for _ in range(50)]
        assert event_keys(digests) == [event_key(d) for d in digests]
    mixed = [random.randbytes(32), random.randbytes(16)]
    assert event_keys(mixed) == [event_key(d) for d in mixed]
    assert event_keys([]) == []
