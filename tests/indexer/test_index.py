"""The KV-block index: bookkeeping, prefix lookups, tiers, the LRU cap and the self-check."""

from __future__ import annotations

import logging
from collections.abc import Sequence

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from indexer.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEvent,
    KVEventBatch,
    decode_batch,
    encode_batch,
)
from indexer.hashing import HashAlgo, HashConfig, block_hashes
from indexer.index import IndexConfigError, KVBlockIndex, PrefixMatch
from tests.conftest import load_vectors

A, B, C = "10.0.0.1:8000", "10.0.0.2:8000", "10.0.0.3:8000"
OURS = HashConfig(block_size=16, algo="sha256_cbor")


def _tokens(n: int, start: int = 1000) -> list[int]:
    return [(start + 7919 * i) % 150_000 for i in range(n)]


def _stored(
    tokens: Sequence[int],
    *,
    block_size: int = 16,
    algo: HashAlgo = "sha256_cbor",
    seed: str | None = None,
    first_block: int = 0,
    medium: str | None = "GPU",
) -> BlockStored:
    """A BlockStored for the full blocks of ``tokens`` from ``first_block`` on, hashed as a pod
    with this configuration would (the parent is the block before ``first_block``)."""
    keys = block_hashes(tokens, block_size=block_size, algo=algo, seed=seed)
    blocks = keys[first_block:]
    return BlockStored(
        block_hashes=tuple(blocks),
        parent_block_hash=keys[first_block - 1] if first_block else None,
        token_ids=tuple(tokens[first_block * block_size : len(keys) * block_size]),
        block_size=block_size,
        medium=medium,
        extra_keys=(None,) * len(blocks),
    )


def _batch(*events: KVEvent) -> KVEventBatch:
    # Through the wire encoder and decoder, as the subscriber will hand them over.
    return decode_batch(encode_batch(KVEventBatch(ts=1.0, events=events, data_parallel_rank=0)))


# ---------------------------------------------------------------------------------------------
# Bookkeeping and lookups


def test_longest_prefix_counts_consecutive_blocks_from_the_start() -> None:
    index = KVBlockIndex()
    index.store(A, [1, 2, 3, 4])
    index.store(B, [1, 2, 4])  # a hole at block 2
    index.store(C, [2, 3, 4])  # no block 0
    assert index.longest_prefix([1, 2, 3, 4, 5], [A, B, C, "unknown:1"]) == {
        A: 4,
        B: 2,
        C: 0,
        "unknown:1": 0,
    }
    assert index.longest_prefix([], [A]) == {A: 0}
    assert index.longest_prefix([1], []) == {}
    assert index.entries == 10 and index.blocks == 4
    assert index.consistency_errors() == []


def test_block_removed_and_all_blocks_cleared_touch_only_their_endpoint() -> None:
    index = KVBlockIndex()
    index.store(A, [1, 2, 3])
    index.store(B, [1, 2, 3])
    index.apply(A, _batch(BlockRemoved(block_hashes=(2,), medium="GPU")))
    assert index.longest_prefix([1, 2, 3], [A, B]) == {A: 1, B: 3}
    assert index.removed_total == 1 and index.entries == 5
    index.apply(B, _batch(AllBlocksCleared()))
    assert index.longest_prefix([1, 2, 3], [A, B]) == {A: 1, B: 0}
    assert index.endpoint_stats(B).blocks == 0 and index.endpoint_stats(A).blocks == 2
    assert index.cleared_total == 3 and index.entries == 2 and index.blocks == 2
    # Removing what is not held is a no-op.
    index.remove(A, [2, 99])
    index.remove("never-seen:1", [1])
    assert index.entries == 2 and index.consistency_errors() == []


def test_clear_and_remove_endpoint() -> None:
    index = KVBlockIndex()
    index.store(A, [1, 2])
    index.store(B, [1, 2, 3])
    assert index.clear_endpoint(A) == 2
    assert index.endpoints() == [A, B] and index.entries == 3
    assert index.remove_endpoint(B) == 3
    assert index.endpoints() == [A] and index.entries == 0 and index.blocks == 0
    assert index.remove_endpoint(B) == 0 and index.clear_endpoint("nobody:1") == 0
    # A new endpoint reuses B's slot and inherits nothing from it.
    index.store(C, [5])
    assert index.longest_prefix([1, 2, 3], [A, B, C]) == {A: 0, B: 0, C: 0}
    assert index.longest_prefix([5], [C]) == {C: 1}
    assert index.consistency_errors() == []


def test_many_endpoints_use_wide_masks() -> None:
    index = KVBlockIndex()
    names = [f"10.1.{i // 256}.{i % 256}:8000" for i in range(200)]
    expected: dict[str, PrefixMatch] = {}
    for i, name in enumerate(names):
        gpu, cpu, storage = i % 17, 0, 0
        index.store(name, range(1, 1 + gpu))
        if i % 3 == 0:  # offloaded copies, before and after the tier fields widen
            cpu, storage = i % 5, i % 7
            index.store(name, range(1, 1 + cpu), medium="CPU")
            index.store(name, range(1, 1 + storage), medium="STORAGE")
        held = max(gpu, cpu, storage)
        weights = [1.0 if b < gpu else 0.8 if b < cpu else 0.5 for b in range(held)]
        expected[name] = PrefixMatch(len(weights), pytest.approx(sum(weights)))
    query = list(range(1, 20))
    assert index.longest_prefix(query, names) == {n: m.blocks for n, m in expected.items()}
    assert index.prefix_match(query, names) == expected
    assert index.consistency_errors() == []
    for name in names[::2]:
        index.remove_endpoint(name)
    assert index.prefix_match(query, names[1::2]) == {n: expected[n] for n in names[1::2]}
    assert index.consistency_errors() == []


def test_tiers_weight_the_match_by_the_best_medium() -> None:
    index = KVBlockIndex()
    index.store(A, [1, 2, 3])
    index.store(B, [1, 2], medium="CPU")
    index.store(B, [3], medium="STORAGE")
    index.store(C, [1, 2], medium="CPU")
    index.store(C, [1], medium="GPU")
    index.store(C, [3], medium="NVME-connector")  # unknown media count as GPU
    got = index.prefix_match([1, 2, 3, 4], [A, B, C, "x:1"])
    assert got[A] == PrefixMatch(3, 3.0)
    assert got[B] == PrefixMatch(3, pytest.approx(0.8 + 0.8 + 0.5))
    assert got[C] == PrefixMatch(3, pytest.approx(1.0 + 0.8 + 1.0))
    assert got["x:1"] == PrefixMatch(0, 0.0)
    assert index.longest_prefix([1, 2, 3], [A, B, C]) == {A: 3, B: 3, C: 3}
    assert index.entries == 9
    assert index.holders(1) == {A: "GPU", B: "CPU", C: "GPU"}

    # Dropping the GPU copy keeps the CPU one; dropping a tier not held changes nothing.
    index.remove(C, [1], medium="GPU")
    index.remove(A, [1], medium="CPU")
    assert index.prefix_match([1, 2, 3], [A, C]) == {
        A: PrefixMatch(3, 3.0),
        C: PrefixMatch(3, pytest.approx(0.8 + 0.8 + 1.0)),
    }
    index.remove(C, [1], medium="CPU")
    assert index.longest_prefix([1, 2, 3], [C]) == {C: 0}
    assert index.entries == 8 and index.consistency_errors() == []


def test_tier_weights_are_configurable_and_validated() -> None:
    index = KVBlockIndex(tier_weights={"CPU": 0.25})
    assert dict(index.tier_weights) == {"GPU": 1.0, "CPU": 0.25, "STORAGE": 0.5}
    index.store(A, [1, 2], medium="CPU")
    assert index.prefix_match([1, 2], [A]) == {A: PrefixMatch(2, 0.5)}
    with pytest.raises(IndexConfigError, match="unknown tier 'DISK'"):
        KVBlockIndex(tier_weights={"DISK": 1.0})
    with pytest.raises(IndexConfigError, match=r"tier_weights\['GPU'\]"):
        KVBlockIndex(tier_weights={"GPU": -1.0})
    with pytest.raises(IndexConfigError, match="max_entries"):
        KVBlockIndex(max_entries=0)
    with pytest.raises(IndexConfigError, match="self_check_blocks"):
        KVBlockIndex(self_check_blocks=0)


# ---------------------------------------------------------------------------------------------
# The LRU cap


def test_entries_never_exceed_the_cap_and_evictions_are_counted() -> None:
    index = KVBlockIndex(max_entries=100)
    for i in range(50):
        index.store(A, range(i * 10, i * 10 + 10))
        index.store(B, range(i * 10, i * 10 + 3))
        assert index.entries <= 100
        assert index.consistency_errors() == []
    assert index.evictions_total == 50 * 13 - index.entries
    assert index.stored_total == 50 * 13
    # The newest blocks survived, the oldest went.
    assert index.longest_prefix(range(490, 500), [A]) == {A: 10}
    assert index.longest_prefix(range(0, 10), [A, B]) == {A: 0, B: 0}


def test_lookups_and_restores_give_blocks_a_second_chance() -> None:
    index = KVBlockIndex(max_entries=100)
    index.store(A, range(0, 10))  # oldest
    index.store(A, range(10, 20))
    index.store(A, range(20, 30))
    assert index.longest_prefix(range(0, 10), [A]) == {A: 10}  # read: marked
    index.store(B, range(10, 20))  # stored again by another pod: marked
    index.store(A, range(100, 190))  # forces eviction of ~30 entries
    assert index.entries <= 100 and index.evictions_total > 0
    assert index.longest_prefix(range(0, 10), [A]) == {A: 10}
    assert index.longest_prefix(range(10, 20), [A, B]) == {A: 10, B: 10}
    assert index.longest_prefix(range(20, 30), [A]) == {A: 0}
    assert index.consistency_errors() == []


# ---------------------------------------------------------------------------------------------
# Self-check


@pytest.mark.parametrize("algo", ["sha256_cbor", "sha256"])
def test_events_hashed_like_ours_are_verified(algo: HashAlgo) -> None:
    config = HashConfig(block_size=16, algo=algo)
    index = KVBlockIndex(hash_config=config)
    prompt = _tokens(16 * 10 + 5)
    # Prefill of 6 blocks, then two decode steps completing one block each.
    index.apply(A, _batch(_stored(prompt[:96], algo=algo)))
    index.apply(A, _batch(_stored(prompt[:128], algo=algo, first_block=6)))
    index.apply(A, _batch(_stored(prompt, algo=algo, first_block=8)))
    # Another pod caching the same prefix verifies from the digests already computed.
    index.apply(B, _batch(_stored(prompt[:64], algo=algo)))
    ours = block_hashes(prompt, block_size=16, algo=algo)
    assert index.longest_prefix(ours, [A, B]) == {A: 10, B: 4}
    stats = index.endpoint_stats(A)
    assert (stats.verified_blocks, stats.mismatch_events, stats.hash_mismatch) == (10, 0, False)
    assert index.verified_blocks_total == 14 and index.mismatch_events_total == 0
    assert index.mismatches == {}


@pytest.mark.parametrize(
    ("algo", "seed", "size", "problem", "diagnosis"),
    [
        (
            "sha256_cbor",
            "42",
            16,
            "where this EPP computes",
            "algo sha256_cbor, PYTHONHASHSEED '42'",
        ),
        ("sha256", None, 16, "where this EPP computes", "algo sha256, PYTHONHASHSEED unset"),
        ("sha256_cbor", None, 32, "its events have block size 32", "block size 32"),
    ],
    ids=["other-seed", "other-algo", "block-size-32"],
)
def test_a_mismatched_pod_is_reported_once_and_rekeyed(
    algo: HashAlgo,
    seed: str | None,
    size: int,
    problem: str,
    diagnosis: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    index = KVBlockIndex(hash_config=OURS)
    prompt = _tokens(320)
    pod_keys = block_hashes(prompt, block_size=size, algo=algo, seed=seed)
    head = 128 // size  # pod blocks in the first 128 tokens

    def event(first: int, last: int) -> BlockStored:
        return _stored(
            prompt[: last * size], block_size=size, algo=algo, seed=seed, first_block=first
        )

    with caplog.at_level(logging.WARNING, logger="indexer.index"):
        index.apply(A, _batch(event(0, head)))
        index.apply(A, _batch(event(head, len(pod_keys))))
        index.apply(B, _batch(_stored(prompt[:64])))  # a well-configured pod
    records = [r for r in caplog.records if r.name == "indexer.index"]
    assert len(records) == 1, "a mismatch is logged once per endpoint"
    message = records[0].getMessage()
    assert A in message and problem in message and diagnosis in message
    assert "algo sha256_cbor, PYTHONHASHSEED unset, block size 16" in message

    stats = index.endpoint_stats(A)
    assert stats.hash_mismatch and stats.mismatch_events == 1
    assert stats.rekeyed_blocks == len(pod_keys) and stats.skipped_events == 0
    assert index.mismatches == {A: 1} and not index.endpoint_stats(B).hash_mismatch

    # Routing stays correct: the pod is found under our own keys for the prompt.
    ours = block_hashes(prompt, block_size=16, algo="sha256_cbor")
    assert len(ours) == 20
    assert index.longest_prefix(ours, [A, B]) == {A: 20, B: 4}
    assert index.longest_prefix(pod_keys, [A]) == {A: 0}

    # The pod's own keys in BlockRemoved remove the right entries.
    index.apply(A, _batch(BlockRemoved(block_hashes=(pod_keys[-1],), medium="GPU")))
    assert index.longest_prefix(ours, [A]) == {A: 20 - size // 16}
    index.apply(A, _batch(*(BlockRemoved(block_hashes=(k,), medium="GPU") for k in pod_keys)))
    assert index.longest_prefix(ours, [A, B]) == {A: 0, B: 4}
    assert index.endpoint_stats(A).blocks == 0
    assert index.consistency_errors() == []


def test_a_pod_with_smaller_blocks_is_rekeyed_exactly_across_events() -> None:
    # Pod blocks of 16, EPP blocks of 48: tokens that do not fill an EPP block are carried into
    # the next event, one decode block at a time.
    ours_config = HashConfig(block_size=48, algo="sha256_cbor")
    index = KVBlockIndex(hash_config=ours_config)
    prompt = _tokens(16 * 10)
    index.apply(A, _batch(_stored(prompt[:64])))  # 4 pod blocks: 1 EPP block + 16 tokens
    for last in range(5, 11):
        index.apply(A, _batch(_stored(prompt[: last * 16], first_block=last - 1)))
    ours = block_hashes(prompt, block_size=48, algo="sha256_cbor")
    assert len(ours) == 3
    assert index.longest_prefix(ours, [A]) == {A: 3}
    stats = index.endpoint_stats(A)
    assert stats.hash_mismatch and stats.skipped_events == 0 and stats.blocks == 3
    # Removing the pod block that completed EPP block 2 removes it.
    pod_keys = block_hashes(prompt, block_size=16, algo="sha256_cbor")
    index.apply(A, _batch(BlockRemoved(block_hashes=(pod_keys[8],))))
    assert index.longest_prefix(ours, [A]) == {A: 2}
    assert index.consistency_errors() == []


def test_hybrid_model_blocks_are_diagnosed_and_rekeyed(caplog: pytest.LogCaptureFixture) -> None:
    # A hybrid model hashes at 16 tokens but reports 64-token KV blocks with the last hash of
    # each (docs/vllm-interop.md §3).
    index = KVBlockIndex(hash_config=OURS)
    prompt = _tokens(128)
    fine = block_hashes(prompt, block_size=16, algo="sha256_cbor")
    event = BlockStored(
        block_hashes=(fine[3], fine[7]),
        parent_block_hash=None,
        token_ids=tuple(prompt),
        block_size=64,
        medium="GPU",
    )
    with caplog.at_level(logging.WARNING, logger="indexer.index"):
        index.apply(A, _batch(event))
    assert "hybrid or multi-group" in caplog.text
    assert index.longest_prefix(fine, [A]) == {A: 8}


def test_unverifiable_events_are_trusted_and_counted() -> None:
    index = KVBlockIndex(hash_config=OURS)
    prompt = _tokens(96)
    # The parent was stored before the index existed: its digest is unknown.
    index.apply(A, _batch(_stored(prompt, first_block=2)))
    # LoRA blocks carry extra keys (and the adapter path is not published).
    lora = BlockStored(
        block_hashes=(11, 12),
        parent_block_hash=None,
        token_ids=tuple(prompt[:32]),
        block_size=16,
        lora_name="sql-lora",
        extra_keys=(("sql-lora",), ("sql-lora",)),
    )
    salted = BlockStored(
        block_hashes=(13,),
        parent_block_hash=None,
        token_ids=tuple(prompt[:16]),
        block_size=16,
        extra_keys=(("tenant-a",),),
    )
    offloaded = BlockStored(
        block_hashes=(14,), parent_block_hash=None, token_ids=(), block_size=0, medium="CPU"
    )
    index.apply(A, _batch(lora, salted, offloaded))
    stats = index.endpoint_stats(A)
    assert (stats.unverified_blocks, stats.unchecked_blocks, stats.verified_blocks) == (4, 4, 0)
    assert not stats.hash_mismatch and stats.blocks == 8
    keys = block_hashes(prompt, block_size=16, algo="sha256_cbor")
    assert index.longest_prefix(keys[2:], [A]) == {A: 4}
    assert index.longest_prefix([14], [A]) == {A: 1}


def test_a_mismatched_pod_skips_what_it_cannot_map_and_restart_resets_it() -> None:
    index = KVBlockIndex(hash_config=OURS)
    prompt = _tokens(96)
    index.apply(A, _batch(_stored(prompt[:32], seed="0")))
    assert index.endpoint_stats(A).hash_mismatch
    # Continues a chain the index never saw from this pod: cannot be mapped to our keys.
    index.apply(A, _batch(_stored(prompt, seed="0", first_block=4)))
    # Extra-key blocks keep the pod's keys, and are removed by them.
    lora = BlockStored(
        block_hashes=(77,),
        parent_block_hash=None,
        token_ids=tuple(prompt[:16]),
        block_size=16,
        lora_name="x",
        extra_keys=(("x",),),
    )
    index.apply(A, _batch(lora))
    stats = index.endpoint_stats(A)
    assert (stats.skipped_events, stats.rekeyed_blocks, stats.unchecked_blocks) == (1, 2, 1)
    assert index.skipped_events_total == 1
    index.apply(A, _batch(BlockRemoved(block_hashes=(77,))))
    assert index.endpoint_stats(A).blocks == 2

    # A restart drops the blocks and the mismatch state; a fixed pod verifies again.
    index.clear_endpoint(A)
    index.apply(A, _batch(_stored(prompt[:32])))
    stats = index.endpoint_stats(A)
    assert not stats.hash_mismatch and stats.verified_blocks == 2 and stats.blocks == 2
    assert stats.mismatch_events == 1  # counters are cumulative


def test_self_check_can_stop_after_enough_verified_blocks() -> None:
    index = KVBlockIndex(hash_config=OURS, self_check_blocks=4)
    prompt = _tokens(128)
    index.apply(A, _batch(_stored(prompt[:64])))
    index.apply(A, _batch(_stored(prompt, first_block=4)))
    stats = index.endpoint_stats(A)
    assert (stats.verified_blocks, stats.unchecked_blocks) == (4, 4)
    index.clear_endpoint(A)
    index.apply(A, _batch(_stored(prompt[:64], seed="1")))
    assert index.endpoint_stats(A).hash_mismatch


def test_without_a_hash_config_nothing_is_verified() -> None:
    index = KVBlockIndex()
    index.apply(A, _batch(_stored(_tokens(64), seed="7")))
    stats = index.endpoint_stats(A)
    assert stats.blocks == 4 and stats.verified_blocks == 0 and not stats.hash_mismatch


# ---------------------------------------------------------------------------------------------
# vLLM's own events (golden vectors)

_VECTORS = load_vectors()["kv_events"]
_GOLDEN = decode_batch(bytes.fromhex(_VECTORS["combined_batch"]["payload_hex"]))
_A_KEYS = [int(h[-16:], 16) for h in _VECTORS["request_A_block_hashes_hex"]]
_B_KEYS = [int(h[-16:], 16) for h in _VECTORS["request_B_block_hashes_hex"]]


@pytest.mark.parametrize(
    "config", [None, HashConfig(block_size=16, algo="sha256")], ids=["trusting", "self-check"]
)
def test_golden_events_leave_exactly_the_expected_state(config: HashConfig | None) -> None:
    index = KVBlockIndex(hash_config=config)
    # After each event: the longest prefix of request A and of request B held by the pod.
    expected = [(2, 0), (3, 0), (3, 1), (2, 1), (1, 1), (0, 1), (0, 0), (2, 0), (0, 0)]
    for event, (a_blocks, b_blocks) in zip(_GOLDEN.events, expected, strict=True):
        index.apply_events(A, [event])
        assert index.longest_prefix(_A_KEYS, [A]) == {A: a_blocks}
        assert index.longest_prefix(_B_KEYS, [A]) == {A: b_blocks}
        assert index.consistency_errors() == []
    assert index.entries == 0 and index.blocks == 0
    stats = index.endpoint_stats(A)
    assert stats.mismatch_events == 0 and not stats.hash_mismatch
    if config is not None:
        # A's prefill (2) and decode block (1, parent verified just before), A re-cached (2).
        assert stats.verified_blocks == 5
        assert stats.unchecked_blocks == 1  # B: LoRA + cache_salt


def test_golden_events_under_another_algo_are_rekeyed() -> None:
    index = KVBlockIndex(hash_config=OURS)
    index.apply(A, _GOLDEN)  # sha256 pod, sha256_cbor EPP
    stats = index.endpoint_stats(A)
    assert stats.hash_mismatch and stats.mismatch_events == 1
    assert index.entries == 0 and index.consistency_errors() == []


# ---------------------------------------------------------------------------------------------
# Property: the index answers like a plain dict-of-sets model


_EPS = ["a:1", "b:1", "c:1", "d:1"]
_MEDIA = [None, "GPU", "CPU", "STORAGE"]
_KEYS = st.lists(st.integers(0, 11), max_size=8)
_WEIGHT = {"GPU": 1.0, "CPU": 0.8, "STORAGE": 0.5}
_OPS = st.lists(
    st.one_of(
        st.tuples(st.just("store"), st.sampled_from(_EPS), _KEYS, st.sampled_from(_MEDIA)),
        st.tuples(st.just("remove"), st.sampled_from(_EPS), _KEYS, st.sampled_from(_MEDIA)),
        st.tuples(st.just("clear"), st.sampled_from(_EPS), st.just([]), st.just(None)),
        st.tuples(st.just("remove_endpoint"), st.sampled_from(_EPS), st.just([]), st.just(None)),
        st.tuples(st.just("lookup"), st.just(""), _KEYS, st.just(None)),
    ),
    max_size=60,
)


@settings(max_examples=300, deadline=None)
@given(ops=_OPS)
def test_index_matches_a_reference_model(ops: list[tuple[str, str, list[int], str | None]]) -> None:
    index = KVBlockIndex()
    model: dict[str, dict[int, set[str]]] = {}  # endpoint -> key -> tiers held

    def check(query: list[int]) -> None:
        expected_blocks: dict[str, int] = {}
        expected_weighted: dict[str, float] = {}
        for ep in _EPS:
            held = model.get(ep, {})
            n, weighted = 0, 0.0
            for key in query:
                if key not in held:
                    break
                n += 1
                weighted += max(_WEIGHT[t] for t in held[key])
            expected_blocks[ep], expected_weighted[ep] = n, weighted
        assert index.longest_prefix(query, _EPS) == expected_blocks
        matched = index.prefix_match(query, _EPS)
        assert {ep: m.blocks for ep, m in matched.items()} == expected_blocks
        for ep in _EPS:
            assert matched[ep].weighted == pytest.approx(expected_weighted[ep])

    for op, ep, keys, medium in ops:
        tier = medium or "GPU"
        if op == "store":
            index.store(ep, keys, medium=medium)
            for key in keys:
                model.setdefault(ep, {}).setdefault(key, set()).add(tier)
        elif op == "remove":
            index.remove(ep, keys, medium=medium)
            held = model.get(ep, {})
            for key in keys:
                if key in held:
                    held[key].discard(tier)
                    if not held[key]:
                        del held[key]
        elif op == "clear":
            index.clear_endpoint(ep)
            model.get(ep, {}).clear()
        elif op == "remove_endpoint":
            index.remove_endpoint(ep)
            model.pop(ep, None)
        else:
            check(keys)
        assert index.entries == sum(len(held) for held in model.values())
        assert index.blocks == len({key for held in model.values() for key in held})
    check(list(range(12)))
    for ep in _EPS:
        assert index.endpoint_stats(ep).blocks == len(model.get(ep, {}))
    assert index.consistency_errors() == []


@settings(max_examples=150, deadline=None)
@given(ops=_OPS, cap=st.integers(1, 12))
def test_a_capped_index_only_ever_forgets(
    ops: list[tuple[str, str, list[int], str | None]], cap: int
) -> None:
    index = KVBlockIndex(max_entries=cap)
    model: dict[str, set[int]] = {}
    for op, ep, keys, _ in ops:
        if op == "store":
            index.store(ep, keys)
            model.setdefault(ep, set()).update(keys)
        elif op == "remove":
            index.remove(ep, keys)
            model.get(ep, set()).difference_update(keys)
        elif op in ("clear", "remove_endpoint"):
            index.clear_endpoint(ep)
            model.pop(ep, None)
        else:
            got = index.longest_prefix(keys, _EPS)
            for name in _EPS:
                held = model.get(name, set())
                full = next((i for i, k in enumerate(keys) if k not in held), len(keys))
                assert got[name] <= full
        assert index.entries <= cap
        assert index.consistency_errors() == []
        for name in _EPS:
            assert index.endpoint_stats(name).blocks <= len(model.get(name, set()))
