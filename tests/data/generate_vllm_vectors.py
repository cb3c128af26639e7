"""Regenerate the golden vLLM vectors (block hashes and a KV-event batch) from a real vLLM.

Run it with the interpreter of the vLLM environment that `make vllm-env` builds:

    .venv-vllm/bin/python tests/data/generate_vllm_vectors.py --out /tmp/vectors.json

It writes the JSON format of `vllm-0.33-hashes-and-events.json` (same keys, same cases, same
order), computed by calling the installed vLLM: `get_hash_fn_by_name`, `init_none_hash` and
`get_request_block_hasher` on real `Request` objects for the hashes, `resolve_block_hashes`
for coarser KV blocks, a real `KVCacheManager`/`BlockPool` for the events, and a real
`ZmqEventPublisher` (over inproc ZMQ) for the encoded batch.  Nothing is hashed or encoded by
code of this script.  What the installed vLLM cannot compute (hash schemes of older or newer
versions) is copied from `--carry-over-from` and listed in `provenance.carried_over`.

vLLM's `xxhash`/`xxhash_cbor` algorithms need the optional `xxhash` package, which
`make vllm-env` does not install: `.venv-vllm/bin/pip install xxhash` first.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import inspect
import json
import logging
import os
import platform
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import msgspec
import torch
import vllm
import vllm.utils.hashing as vllm_hashing
import zmq
from vllm.distributed.kv_events import (
    BlockStored,
    KVCacheEvent,
    KVEventBatch,
    ZmqEventPublisher,
)
from vllm.lora.request import LoRARequest
from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange
from vllm.sampling_params import SamplingParams
from vllm.v1.core import kv_cache_utils
from vllm.v1.core.block_pool import BlockPool
from vllm.v1.core.kv_cache_manager import KVCacheManager
from vllm.v1.core.kv_cache_utils import (
    get_none_hash_seed,
    get_request_block_hasher,
    init_none_hash,
    maybe_convert_block_hash,
    resolve_block_hashes,
    to_event_extra_keys,
)
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from vllm.v1.request import Request

HashFn = Callable[[Any], bytes]
Json = dict[str, Any]

DEFAULT_CARRY_OVER = Path(__file__).resolve().parent / "vllm-0.33-hashes-and-events.json"

TITLE = "vLLM prefix-cache block hashes and KV-event encodings: golden vectors"
ALGOS = ("sha256", "sha256_cbor", "xxhash", "xxhash_cbor")
SEEDS: tuple[str | None, ...] = (None, "0")  # PYTHONHASHSEED of the engine: unset, then "0"

TOKEN_SEQUENCES: dict[str, list[int]] = {
    "T16": list(range(1, 17)),
    "T33": [(i * 7919 + 13) % 151936 for i in range(33)],
    "T64": [151643, *range(100, 163)],
}
TOKEN_NOTE = (
    "T33 = [(i*7919+13) % 151936 for i in range(33)] (values > 65535 exercise 4-byte CBOR ints);"
    " T64 = [151643] + list(range(100,163)). Only full blocks are hashed: T33 with block_size 16"
    " yields 2 hashes (token 33 is never hashed)."
)

LORA = {"lora_name": "sql-lora", "lora_int_id": 1, "lora_path": "/adapters/sql-lora"}
CACHE_SALT = "tenant-a"
MM_FEATURES = [{"identifier": "img-3f2a9c", "offset": 10, "length": 20}]

FIELD_LEGEND = {
    "algo": "--prefix-caching-hash-algo value",
    "PYTHONHASHSEED": "env var of the vLLM engine process (null = unset)",
    "none_hash_seed_string": "string passed to hash_fn to build NONE_HASH (first block's parent)",
    "none_hash_hex": (
        "NONE_HASH = hash_fn(none_hash_seed_string) (32 bytes for sha256*, 16 for xxhash*)"
    ),
    "block_hashes_hex": (
        "raw BlockHash digests, chained; block i parent = block i-1 (block 0 parent = NONE_HASH)"
    ),
    "event_block_hashes_uint64": (
        "what BlockStored/BlockRemoved carry with the default"
        " VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1: int.from_bytes(digest,'big') & (2**64-1) ="
        " last 8 bytes of the digest, big-endian, unsigned (decimal strings)"
    ),
    "event_block_hashes_uint64_hex": (
        "same, as 16 hex digits (== last 16 hex chars of block_hashes_hex)"
    ),
    "hash_extra_keys_per_block": (
        "the extra_keys tuple that entered the hash for each block (tuples shown as JSON arrays;"
        " null = None)"
    ),
    "event_extra_keys": "BlockStored.extra_keys as published (to_event_extra_keys: untagged)",
    "hash_input_bytes_hex_block0": (
        "exact bytes fed to the digest for block 0: canonical CBOR for *_cbor, pickle protocol 5"
        " for sha256/xxhash"
    ),
    "reproducible_across_processes": (
        "false for xxhash/xxhash_cbor with PYTHONHASHSEED unset (NONE_HASH seed ="
        " os.urandom(32).hex() per process); those entries carry no hashes"
    ),
}

KVBLOCK_NOTE = (
    "resolve_block_hashes/BlockHashListWithBlockSize: the hash of a 64-token KV block is the LAST"
    " 16-token chained hash inside it"
)

# The events scenario (see kv_events._description): a fixed timestamp keeps the bytes stable.
EVENTS_TS = 1767225600.25
EVENTS_NUM_GPU_BLOCKS = 8
EVENTS_BLOCK_SIZE = 16
DECODE_TOKENS = list(range(500, 515))


# ---------------------------------------------------------------------------------------------
# The cases


@dataclass(frozen=True, slots=True)
class Case:
    name: str
    tokens: str  # a key of TOKEN_SEQUENCES
    block_size: int  # the hash block size
    lora: bool = False
    cache_salt: bool = False
    mm: bool = False
    kv_block_size: int | None = None  # a KV-cache group with bigger blocks than the hash's
    lookahead: int = 0  # num_hash_lookahead_tokens (a hashing mode of vLLM 0.33)


BASIC_CASES = (
    Case("t16_bs16", "T16", 16),
    Case("t33_bs16", "T33", 16),
    Case("t64_bs16", "T64", 16),
    Case("t64_bs64", "T64", 64),
    Case("t33_bs32", "T33", 32),
    Case("t64_bs16_lora", "T64", 16, lora=True),
    Case("t33_bs16_salt", "T33", 16, cache_salt=True),
    Case("t64_bs16_lora_salt", "T64", 16, lora=True, cache_salt=True),
    Case("t64_bs64_lora_salt", "T64", 64, lora=True, cache_salt=True),
    Case("t64_bs16_mm", "T64", 16, mm=True),
)
# Only for the cryptographic algorithms, as in the 0.33 file.
SHA_ONLY_CASES = (
    Case("t64_hash16_kvblock64", "T64", 16, kv_block_size=64),
    Case("t64_bs16_lookahead1", "T64", 16, lookahead=1),
    Case("t64_bs16_lookahead2_lora_salt", "T64", 16, lora=True, cache_salt=True, lookahead=2),
)


def cases_for(algo: str) -> tuple[Case, ...]:
    return BASIC_CASES + (SHA_ONLY_CASES if algo.startswith("sha256") else ())


def vector_id(algo: str, case: Case, seed: str | None) -> str:
    return f"{algo}/{case.name}/seed={'unset' if seed is None else seed}"


# ---------------------------------------------------------------------------------------------
# vLLM objects


def make_request(
    request_id: str,
    tokens: Sequence[int],
    block_hasher: Callable[[Request], list[Any]] | None,
    *,
    lora: bool = False,
    cache_salt: bool = False,
    mm: bool = False,
    max_tokens: int = 1,
) -> Request:
    lora_request = LoRARequest(**LORA) if lora else None
    features = [
        MultiModalFeatureSpec(
            data=None,
            modality="image",
            identifier=f["identifier"],
            mm_position=PlaceholderRange(offset=f["offset"], length=f["length"]),
        )
        for f in (MM_FEATURES if mm else [])
    ]
    return Request(
        request_id,
        list(tokens),
        SamplingParams(max_tokens=max_tokens),
        None,
        lora_request=lora_request,
        cache_salt=CACHE_SALT if cache_salt else None,
        mm_features=features or None,
        block_hasher=block_hasher,
    )


@contextmanager
def hash_seed(seed: str | None) -> Iterator[None]:
    """PYTHONHASHSEED as vLLM's engine sees it: `resolve_none_hash_seed` reads os.environ when
    `init_none_hash` runs, so setting it here is what setting it for the engine process does."""
    saved = os.environ.pop("PYTHONHASHSEED", None)
    if seed is not None:
        os.environ["PYTHONHASHSEED"] = seed
    try:
        yield
    finally:
        os.environ.pop("PYTHONHASHSEED", None)
        if saved is not None:
            os.environ["PYTHONHASHSEED"] = saved


@contextmanager
def digest_inputs() -> Iterator[list[bytes]]:
    """Record the bytes vLLM's hash functions hand to their digest (after vLLM's own pickle or
    CBOR serialization), so the file shows the exact digest input without this script
    serializing anything itself."""
    recorded: list[bytes] = []
    real_hashlib, real_xxhash = vllm_hashing.hashlib, vllm_hashing._xxhash

    def tap(digest: Callable[[bytes], Any]) -> Callable[[bytes], Any]:
        def recording(data: bytes) -> Any:
            recorded.append(bytes(data))
            return digest(data)

        return recording

    vllm_hashing.hashlib = SimpleNamespace(sha256=tap(real_hashlib.sha256))
    vllm_hashing._xxhash = SimpleNamespace(xxh3_128_digest=tap(real_xxhash.xxh3_128_digest))
    try:
        yield recorded
    finally:
        vllm_hashing.hashlib, vllm_hashing._xxhash = real_hashlib, real_xxhash


def recording_extra_keys(hash_fn: HashFn) -> tuple[HashFn, list[Any]]:
    """`hash_fn` plus a list that receives the extra keys of every (parent, tokens, extra_keys)
    tuple vLLM's block hasher passes to it: the keys that really entered each hash."""
    seen: list[Any] = []

    def recording(value: Any) -> bytes:
        seen.append(value[2])
        return hash_fn(value)

    return recording, seen


def published_block_stored(request: Request, hash_block_size: int, block_size: int) -> BlockStored:
    """The BlockStored event a real BlockPool publishes when it caches all full blocks of
    `request` at `block_size` (the pool's hashes are at `hash_block_size`)."""
    num_blocks = len(resolve_block_hashes(request.block_hashes, hash_block_size, block_size))
    pool = BlockPool(
        num_gpu_blocks=num_blocks + 1,  # + vLLM's null block
        enable_caching=True,
        hash_block_size=hash_block_size,
        enable_kv_cache_events=True,
    )
    blocks = pool.get_new_blocks(num_blocks)
    pool.cache_full_blocks(request, blocks, 0, num_blocks, block_size, kv_cache_group_id=0)
    (event,) = pool.take_events()
    assert isinstance(event, BlockStored), event
    return event


# ---------------------------------------------------------------------------------------------
# Hash vectors


def uint64_strings(keys: Sequence[Any]) -> list[str]:
    return [str(k) for k in keys]


def jsonable(value: Any) -> Any:
    """Extra keys as JSON: tuples become arrays (json does that); bytes (prompt-embeds digests,
    none in these cases) would not survive, so refuse them loudly."""
    if isinstance(value, bytes):
        raise TypeError(f"bytes in extra keys are not representable in the vectors: {value!r}")
    if isinstance(value, list | tuple):
        return [jsonable(v) for v in value]
    return value


@dataclass(slots=True)
class Hashed:
    """One case hashed by vLLM under one algorithm and seed."""

    none_hash: bytes
    none_hash_seed: str
    reproducible: bool
    request: Request
    extra_keys: list[Any]
    digest_inputs: list[bytes]


def hash_case(algo: str, case: Case, seed: str | None) -> Hashed:
    hash_fn = vllm_hashing.get_hash_fn_by_name(algo)
    with hash_seed(seed):
        init_none_hash(hash_fn)
        first_seed = get_none_hash_seed()
        # A second init tells whether vLLM draws the seed at random (per process) or fixes it.
        init_none_hash(hash_fn)

    recording, extra_keys = recording_extra_keys(hash_fn)
    hasher = get_request_block_hasher(case.block_size, recording)
    with digest_inputs() as inputs:
        request = make_request(
            case.name,
            TOKEN_SEQUENCES[case.tokens],
            hasher,
            lora=case.lora,
            cache_salt=case.cache_salt,
            mm=case.mm,
        )
    assert len(inputs) == len(request.block_hashes) == len(extra_keys)
    return Hashed(
        none_hash=kv_cache_utils.NONE_HASH,  # rebound by every init_none_hash
        none_hash_seed=get_none_hash_seed(),
        reproducible=get_none_hash_seed() == first_seed,
        request=request,
        extra_keys=extra_keys,
        digest_inputs=inputs,
    )


def common_fields(algo: str, case: Case, seed: str | None, hashed: Hashed) -> Json:
    return {
        "id": vector_id(algo, case, seed),
        "algo": algo,
        "PYTHONHASHSEED": seed,
        "none_hash_seed_string": (
            hashed.none_hash_seed if hashed.reproducible else "<random per process>"
        ),
        "none_hash_hex": hashed.none_hash.hex() if hashed.reproducible else None,
        "reproducible_across_processes": hashed.reproducible,
        "case": case.name,
        "tokens": case.tokens,
    }


def basic_vector(algo: str, case: Case, seed: str | None) -> Json:
    hashed = hash_case(algo, case, seed)
    digests = list(hashed.request.block_hashes)
    keys = [maybe_convert_block_hash(d) for d in digests]
    event_extra_keys = to_event_extra_keys(hashed.extra_keys)
    stored = published_block_stored(hashed.request, case.block_size, case.block_size)
    # The events a real BlockPool publishes must carry what this vector says they carry.
    published_matches = (
        stored.block_hashes == keys
        and stored.parent_block_hash is None
        and stored.extra_keys == event_extra_keys
    )
    kept = hashed.reproducible  # random-seeded hashes differ per process: leave them out
    return {
        **common_fields(algo, case, seed, hashed),
        "block_size": case.block_size,
        "lora": dict(LORA) if case.lora else None,
        "cache_salt": CACHE_SALT if case.cache_salt else None,
        "mm_features": [dict(f) for f in MM_FEATURES] if case.mm else None,
        "num_full_blocks": len(digests),
        "hash_extra_keys_per_block": jsonable(hashed.extra_keys),
        "block_hashes_hex": [d.hex() for d in digests] if kept else None,
        "event_block_hashes_uint64": uint64_strings(keys) if kept else None,
        "event_block_hashes_uint64_hex": [f"{k:016x}" for k in keys] if kept else None,
        "event_extra_keys": jsonable(event_extra_keys),
        "hash_input_bytes_hex_block0": hashed.digest_inputs[0].hex() if kept else None,
        "spec_reimplementation_matches": published_matches if kept else None,
    }


def kv_block_vector(algo: str, case: Case, seed: str | None) -> Json:
    assert case.kv_block_size is not None
    hashed = hash_case(algo, case, seed)
    assert hashed.reproducible, "kv-block vectors are for sha256* only, whose seed is never random"
    at_hash_size = list(hashed.request.block_hashes)
    at_kv_size = list(resolve_block_hashes(at_hash_size, case.block_size, case.kv_block_size))
    stored = published_block_stored(hashed.request, case.block_size, case.kv_block_size)
    assert stored.block_hashes == [maybe_convert_block_hash(h) for h in at_kv_size], stored
    return {
        **common_fields(algo, case, seed, hashed),
        "hash_block_size": case.block_size,
        "kv_block_size": case.kv_block_size,
        "note": KVBLOCK_NOTE,
        "block_hashes_hex_at_hash_block_size": [h.hex() for h in at_hash_size],
        "block_hashes_hex_at_kv_block_size": [h.hex() for h in at_kv_size],
        "event_block_hashes_uint64": uint64_strings(stored.block_hashes),
    }


def hash_vectors(carried: dict[str, Json]) -> tuple[list[Json], list[str]]:
    """All vectors in the 0.33 file's order, and the ids copied from `carried` (by id) because
    the installed vLLM has no such hashing mode."""
    if hashes_lookahead_tokens():
        raise SystemExit(
            "this vLLM hashes lookahead tokens: compute the lookahead cases with it (extend"
            " hash_vectors) instead of copying them from the carry-over file"
        )
    vectors: list[Json] = []
    copied: list[str] = []
    for seed in SEEDS:
        for algo in ALGOS:
            for case in cases_for(algo):
                if case.lookahead:
                    vid = vector_id(algo, case, seed)
                    vectors.append(carried_vector(carried, vid))
                    copied.append(vid)
                elif case.kv_block_size is not None:
                    vectors.append(kv_block_vector(algo, case, seed))
                else:
                    vectors.append(basic_vector(algo, case, seed))
    return vectors, copied


def hashes_lookahead_tokens() -> bool:
    """Whether this vLLM's block hasher can hash lookahead tokens (vLLM 0.32's cannot: its
    only parameters are the block size and the hash function)."""
    parameters = inspect.signature(get_request_block_hasher).parameters
    return any("lookahead" in name for name in parameters)


def carried_vector(carried: dict[str, Json], vid: str) -> Json:
    if vid not in carried:
        raise SystemExit(f"vector {vid!r} is not in the --carry-over-from file; cannot copy it")
    return carried[vid]


# ---------------------------------------------------------------------------------------------
# KV events


def events_manager() -> KVCacheManager:
    """A real KVCacheManager over one full-attention group of 8 blocks of 16 tokens (the
    layer shape is irrelevant to the events)."""
    spec = FullAttentionSpec(
        block_size=EVENTS_BLOCK_SIZE, num_kv_heads=1, head_size=8, dtype=torch.float16
    )
    config = KVCacheConfig(
        num_blocks=EVENTS_NUM_GPU_BLOCKS,
        kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec(["model.layers.0.self_attn.attn"], spec)],
    )
    return KVCacheManager(
        config,
        max_model_len=(EVENTS_NUM_GPU_BLOCKS - 1) * EVENTS_BLOCK_SIZE,
        scheduler_block_size=EVENTS_BLOCK_SIZE,
        hash_block_size=EVENTS_BLOCK_SIZE,
        enable_caching=True,
        enable_kv_cache_events=True,
    )


def prefill(manager: KVCacheManager, request: Request) -> None:
    """The scheduler's prefill of a whole prompt: prefix-cache lookup, then allocate and cache."""
    hit_blocks, num_hit_tokens, _ = manager.get_computed_blocks(request)
    new_tokens = request.num_tokens - num_hit_tokens
    assert manager.allocate_slots(request, new_tokens, num_hit_tokens, hit_blocks) is not None
    request.num_computed_tokens = request.num_tokens


def decode(manager: KVCacheManager, request: Request, tokens: Sequence[int]) -> None:
    """One scheduler step per sampled token: each step computes the KV of the previous token,
    so the block holding the last sampled token is cached on the step after it is sampled."""
    request.append_output_token_ids(tokens[0])
    for token in tokens[1:]:
        assert manager.allocate_slots(request, 1) is not None
        request.num_computed_tokens += 1
        request.append_output_token_ids(token)
    assert manager.allocate_slots(request, 1) is not None
    request.num_computed_tokens += 1


def event_scenario() -> tuple[list[KVCacheEvent], Request, Request]:
    hash_fn = vllm_hashing.get_hash_fn_by_name("sha256")
    with hash_seed(None):
        init_none_hash(hash_fn)
    hasher = get_request_block_hasher(EVENTS_BLOCK_SIZE, hash_fn)
    manager = events_manager()
    t33, t64 = TOKEN_SEQUENCES["T33"], TOKEN_SEQUENCES["T64"]

    # Step 1: A = T33 caches 2 blocks; decoding 500..514 completes its third.  B = T64[:16]
    # with LoRA and a cache salt caches one.  Both finish (A first).
    a = make_request("A", t33, hasher, max_tokens=len(DECODE_TOKENS))
    prefill(manager, a)
    decode(manager, a, DECODE_TOKENS)
    b = make_request("B", t64[:16], hasher, lora=True, cache_salt=True)
    prefill(manager, b)
    manager.free(a)
    manager.free(b)
    # Step 2: every free block handed out again evicts all cached ones, in free-queue order.
    pool = manager.block_pool
    pool.free_blocks(pool.get_new_blocks(pool.get_num_free_blocks()))
    # Step 3: A's prompt cached again, freed, then the whole cache reset.
    a2 = make_request("A2", t33, hasher)
    prefill(manager, a2)
    manager.free(a2)
    assert manager.reset_prefix_cache()
    return manager.take_events(), a, b


def publish_through_zmq(batch: KVEventBatch, timeout: float = 10.0) -> bytes:
    """The payload frame vLLM's ZmqEventPublisher sends for `batch`, read back through its
    replay ROUTER (inproc: no ports, and no PUB/SUB slow-joiner loss)."""
    pub_url, replay_url = "inproc://golden-vectors-pub", "inproc://golden-vectors-replay"
    publisher = ZmqEventPublisher(
        data_parallel_rank=0, endpoint=pub_url, replay_endpoint=replay_url
    )
    dealer = zmq.Context.instance().socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.setsockopt(zmq.RCVTIMEO, int(timeout * 1000))
    try:
        publisher.publish(batch)
        dealer.connect(replay_url)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            payloads = replay(dealer)
            if payloads:  # the publisher thread has encoded the batch
                (payload,) = payloads
                return payload
            time.sleep(0.05)
        raise TimeoutError(f"ZmqEventPublisher replayed nothing within {timeout:.0f}s")
    finally:
        dealer.close()
        publisher.shutdown()


def replay(dealer: zmq.Socket[bytes]) -> list[bytes]:
    """Every payload in the replay buffer from seq 0 (DEALER framing: b'' then the reply)."""
    dealer.send_multipart([b"", (0).to_bytes(8, "big")])
    payloads = []
    while True:
        _, topic, seq, payload = dealer.recv_multipart()
        if not topic and seq == ZmqEventPublisher.END_SEQ:
            return payloads
        payloads.append(payload)


def as_json_hash(value: Any) -> Any:
    """uint64 hashes as {"uint64": "<decimal>"} (JSON numbers lose precision past 2**53)."""
    if value is None:
        return None
    if isinstance(value, bytes):
        return {"bytes_hex": value.hex()}
    return {"uint64": str(value)}


def generic_decode(payload: bytes) -> list[Any]:
    """The payload decoded without vLLM's types, as a consumer sees it on the wire."""
    ts, events, rank = msgspec.msgpack.decode(payload)
    for event in events:
        if "block_hashes" in event:
            event["block_hashes"] = [as_json_hash(h) for h in event["block_hashes"]]
        if "parent_block_hash" in event:
            event["parent_block_hash"] = as_json_hash(event["parent_block_hash"])
    return [ts, events, rank]


def kv_events() -> Json:
    events, a, b = event_scenario()
    payload = publish_through_zmq(KVEventBatch(ts=EVENTS_TS, events=events))
    # The publisher encodes with a plain msgspec Encoder; a second encoding must agree.
    direct = msgspec.msgpack.Encoder().encode(
        KVEventBatch(ts=EVENTS_TS, events=events, data_parallel_rank=0)
    )
    assert payload == direct, "ZmqEventPublisher's payload differs from msgspec's encoding"
    return {
        "_description": EVENTS_DESCRIPTION,
        "combined_batch": {
            "description": (
                f"KVEventBatch(ts={EVENTS_TS}, events=[...all three steps...],"
                " data_parallel_rank=0) encoded with msgspec.msgpack.Encoder() (what"
                " ZmqEventPublisher sends as frame 3; captured from its replay socket)"
            ),
            "event_types": [type(e).__name__ for e in events],
            "payload_hex": payload.hex(),
            "payload_decoded_generic_msgpack": generic_decode(payload),
        },
        "request_A_block_hashes_hex": [h.hex() for h in a.block_hashes],
        "request_B_block_hashes_hex": [h.hex() for h in b.block_hashes],
    }


EVENTS_DESCRIPTION = (
    f"Events produced by vLLM {vllm.__version__}'s real KVCacheManager (one full_attention group,"
    f" {EVENTS_NUM_GPU_BLOCKS} GPU blocks of {EVENTS_BLOCK_SIZE} tokens = hash_block_size, algo"
    " sha256 = default, PYTHONHASHSEED unset, VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES default 1) and"
    " taken with KVCacheManager.take_events (which annotates kv_cache_spec_kind). Step 1: request"
    " A = T33 is prefilled (2 full blocks cached), then 15 sampled tokens (500..514) are decoded"
    " one scheduler step each, completing block 3 (second BlockStored has parent_block_hash);"
    " request B = T64[:16] with LoRA(sql-lora, id 1, path /adapters/sql-lora) and cache_salt"
    " 'tenant-a' caches 1 block; A then B are freed. Step 2: every free block is handed out by"
    " BlockPool.get_new_blocks and freed again -> one BlockRemoved per evicted hash, in"
    " free-queue order. Step 3: A's prompt is prefilled again (2 blocks re-cached), freed, and"
    " reset_prefix_cache runs -> BlockStored + AllBlocksCleared. The batch was published by a real"
    " ZmqEventPublisher (inproc PUB and replay ROUTER) and its payload read back from the replay"
    " socket."
)


# ---------------------------------------------------------------------------------------------
# Provenance and the file


def version_of(distribution: str) -> str:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def vllm_distribution() -> str:
    names = importlib.metadata.packages_distributions().get("vllm", ["vllm"])
    return f"{names[0]}=={version_of(names[0])}"


def provenance(copied_ids: list[str], carry_over_from: Path) -> Json:
    commit = getattr(vllm, "__commit_id__", None)
    return {
        "vllm_version": (
            f"{vllm.__version__} (PyPI {vllm_distribution()}, commit id"
            f" {commit or 'not recorded in the wheel'})"
        ),
        "status": "COMPUTED WITH vLLM'S OWN CODE (not derived), except `carried_over`",
        "how": (
            "tests/data/generate_vllm_vectors.py, run with the vLLM environment's interpreter"
            " (.venv-vllm/bin/python, built by `make vllm-env`), imports the installed vLLM"
            " normally (torch included) and calls it: get_hash_fn_by_name + init_none_hash +"
            " get_request_block_hasher on real Request objects (real SamplingParams, LoRARequest,"
            " MultiModalFeatureSpec) for the hashes, resolve_block_hashes for bigger KV blocks,"
            " to_event_extra_keys / maybe_convert_block_hash for the event fields, a real"
            " KVCacheManager for the events and a real ZmqEventPublisher for the encoded batch."
            " Extra keys are recorded as vLLM's block hasher passes them to the hash function;"
            " hash_input_bytes_hex_block0 is recorded where vLLM hands its serialized bytes to"
            " hashlib/xxhash. The script hashes and encodes nothing itself."
        ),
        "generated_at": datetime.now(UTC).isoformat(timespec="seconds"),
        "python": f"{platform.python_implementation()} {platform.python_version()}",
        "libs": {
            "cbor2": version_of("cbor2"),
            "msgspec": version_of("msgspec"),
            "xxhash": vllm_hashing._xxhash.VERSION,  # the module vLLM imported
            "pyzmq": f"{zmq.pyzmq_version()} (libzmq {zmq.zmq_version()})",
            "torch": torch.__version__,
        },
        "cross_checks": [
            "spec_reimplementation_matches (name kept from the 0.33 file's format, which the"
            " loaders read): no re-implementation runs here; the field records whether a real"
            " vLLM BlockPool caching the vector's request published a BlockStored with exactly"
            " event_block_hashes_uint64, no parent and event_extra_keys (null where the hashes"
            " are random per process)",
            "t64_hash16_kvblock64: event_block_hashes_uint64 is what a BlockPool with"
            " hash_block_size 16 published caching 64-token blocks; it equals the uint64 form of"
            " block_hashes_hex_at_kv_block_size",
            "reproducible_across_processes: init_none_hash run twice under the vector's"
            " PYTHONHASHSEED; false when vLLM drew two different seeds",
            "kv_events: the payload read back from ZmqEventPublisher equals"
            " msgspec.msgpack.Encoder().encode of the same KVEventBatch",
        ],
        "carried_over": {
            "from": f"{carry_over_from.name} (copied unchanged, not recomputed)",
            "legacy_hash_vectors": (
                f"vLLM {vllm.__version__} has neither sha256_cbor_64bit nor the untagged"
                " extra keys of vLLM <= 0.30"
            ),
            "hash_vectors": {
                "ids": copied_ids,
                "why": (
                    f"vLLM {vllm.__version__} has no lookahead block hashing"
                    " (num_hash_lookahead_tokens); get_request_block_hasher takes no lookahead"
                ),
            },
        },
    }


def require_xxhash() -> None:
    if vllm_hashing._xxhash is None:
        raise SystemExit(
            "vLLM's xxhash/xxhash_cbor algorithms need the optional `xxhash` package, which this"
            f" interpreter ({sys.executable}) lacks: run `{Path(sys.executable).parent}/pip"
            " install xxhash` and try again"
        )


def build(carry_over_from: Path) -> Json:
    source: Json = json.loads(carry_over_from.read_text())
    carried = {v["id"]: v for v in source["hash_vectors"]}
    vectors, copied_ids = hash_vectors(carried)
    events = kv_events()
    return {
        "title": TITLE,
        "provenance": provenance(copied_ids, carry_over_from),
        "token_sequences": {**TOKEN_SEQUENCES, "_note": TOKEN_NOTE},
        "field_legend": FIELD_LEGEND,
        "hash_vectors": vectors,
        "legacy_hash_vectors": source["legacy_hash_vectors"],
        "kv_events": events,
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="the JSON file to write")
    parser.add_argument(
        "--carry-over-from",
        type=Path,
        default=DEFAULT_CARRY_OVER,
        help="vectors file to copy what this vLLM cannot compute from (default: %(default)s)",
    )
    args = parser.parse_args(argv)
    started = time.monotonic()
    # vLLM logs every random NONE_HASH seed and each publisher start; only errors matter here.
    logging.getLogger("vllm").setLevel(logging.ERROR)
    # The event fields are the default integer form; a stray setting would change the format.
    os.environ.pop("VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES", None)
    require_xxhash()
    data = build(args.carry_over_from)
    args.out.write_text(json.dumps(data, indent=1) + "\n")
    carried = data["provenance"]["carried_over"]["hash_vectors"]["ids"]
    print(
        f"wrote {args.out}: {len(data['hash_vectors'])} hash vectors ({len(carried)} carried"
        f" over), {len(data['kv_events']['combined_batch']['event_types'])} events, vLLM"
        f" {vllm.__version__}, {time.monotonic() - started:.1f} s after importing vLLM"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
