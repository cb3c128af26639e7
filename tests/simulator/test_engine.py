"""The simulated engine against hand-computed cases and vLLM's own golden events."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import pytest

from indexer.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEvent,
    KVEventBatch,
    encode_batch,
)
from indexer.hashing import block_hashes
from simulator.engine import Engine
from simulator.engine_config import EngineConfig, EngineError, LoRA, RequestRejected
from simulator.engine_outputs import RequestStats
from simulator.profiles import Profile
from tests.conftest import load_vectors

# A profile with round numbers: prefill 1 ms per token, no attention term, decode steps of
# 10 ms + 1 ms per sequence, no overhead.  Tests that need the other terms set them.
UNIT = Profile(
    name="unit",
    description="round numbers for hand-computed tests",
    step_overhead_s=0.0,
    linear_s_per_token=1e-3,
    attention_s_per_token_pair=0.0,
    weights_floor_s=0.0,
    decode_s_per_seq=1e-3,
    decode_s_per_context_token=0.0,
    kv_capacity_tokens=1024,
)
# UNIT with the other terms switched on too, for the timing tests: a 1 ms step overhead, a 5 ms
# weights floor, attention over the context, and a decode cost per context token.
TIMED = replace(
    UNIT,
    name="timed",
    step_overhead_s=1e-3,
    attention_s_per_token_pair=1e-7,
    weights_floor_s=5e-3,
    decode_s_per_context_token=1e-6,
)


def make_engine(
    num_gpu_blocks: int = 64,
    *,
    block_size: int = 4,
    profile: Profile = UNIT,
    **config: object,
) -> Engine:
    values: dict[str, object] = {
        "num_gpu_blocks": num_gpu_blocks,
        "block_size": block_size,
        "hash_algo": "sha256_cbor",
        "max_model_len": 4096,
    }
    values.update(config)
    return Engine(EngineConfig(**values), profile)  # type: ignore[arg-type]


@dataclass
class Run:
    stats: dict[str, RequestStats] = field(default_factory=dict)
    events: list[KVEvent] = field(default_factory=list)
    batches: list[KVEventBatch] = field(default_factory=list)
    tokens: dict[str, list[int]] = field(default_factory=dict)
    token_times: dict[str, list[float]] = field(default_factory=dict)
    steps: int = 0

    def removed(self) -> list[int | bytes]:
        return [e.block_hashes[0] for e in self.events if isinstance(e, BlockRemoved)]

    def ttft(self, req_id: str) -> float:
        ttft = self.stats[req_id].ttft
        assert ttft is not None
        return ttft

    def first_token_time(self, req_id: str) -> float:
        first = self.stats[req_id].first_token_time
        assert first is not None
        return first

    def stored(self) -> list[BlockStored]:
        return [e for e in self.events if isinstance(e, BlockStored)]


def drain(engine: Engine, run: Run | None = None, until: float | None = None) -> Run:
    """Advance until idle (or until ``until``), collecting everything."""
    run = run or Run()
    while (t := engine.next_event_time()) is not None:
        if until is not None and t > until:
            break
        result = engine.advance(t)
        run.steps += result.steps
        run.batches += result.kv_batches
        for batch in result.kv_batches:
            run.events += batch.events
        for out in result.outputs.values():
            run.tokens.setdefault(out.req_id, []).extend(out.new_token_ids)
            if out.token_times is not None:
                run.token_times.setdefault(out.req_id, []).extend(out.token_times)
            if out.stats is not None:
                run.stats[out.req_id] = out.stats
    return run


# ---------------------------------------------------------------------------------------------
# Prefix cache hits


def test_hits_count_only_full_consecutive_blocks() -> None:
    engine = make_engine()
    base = list(range(100, 110))  # 10 tokens: 2 full blocks of 4 and 2 loose tokens
    engine.add_request("a", base, 1, 0.0)
    run = drain(engine)
    assert run.stats["a"].cached_tokens == 0

    cases = {
        "same-2-blocks-new-tail": ([*base[:8], 7, 8, 9], 8),
        "second-block-differs": ([*base[:4], 1, 2, 3, 4, *base[8:10], 5, 6], 4),
        "same-prompt-again": (base, 8),  # the loose tokens never count
        "fully-cached-prompt": (base[:8], 4),  # vLLM recomputes the last token: last block misses
        "partial-first-block": (base[:3], 0),
        "different-first-token": ([1, *base[1:]], 0),
    }
    for i, (req_id, (tokens, _)) in enumerate(cases.items()):
        engine.add_request(req_id, tokens, 1, 1.0 + i)
        drain(engine, run)
    for req_id, (_, expected) in cases.items():
        assert run.stats[req_id].cached_tokens == expected, req_id
    metrics = engine.metrics()
    assert metrics.prefix_cache_queries == 10 + sum(len(t) for t, _ in cases.values())
    assert metrics.prefix_cache_hits == sum(hit for _, hit in cases.values())


def test_hit_tokens_are_not_prefilled_again() -> None:
    engine = make_engine()
    prompt = list(range(40))
    engine.add_request("cold", prompt, 1, 0.0)
    cold = drain(engine).stats["cold"]
    engine.add_request("warm", prompt, 1, 10.0)
    warm = drain(engine).stats["warm"]
    assert cold.ttft == pytest.approx(40e-3)
    # 36 tokens hit (9 blocks; the 10th is recomputed for the last token), 4 are prefilled.
    assert warm.cached_tokens == 36
    assert warm.ttft == pytest.approx(4e-3)


def test_block_keys_mode_hits_like_token_mode() -> None:
    engine = make_engine()
    keys = [11, 22, 33]
    engine.add_request("a", None, 2, 0.0, num_prompt_tokens=13, block_keys=keys)
    engine.add_request("b", None, 2, 0.0, num_prompt_tokens=10, block_keys=[11, 22])
    engine.add_request("c", None, 2, 0.0, num_prompt_tokens=9, block_keys=[11, 99])
    run = drain(engine)
    assert [run.stats[r].cached_tokens for r in "abc"] == [0, 8, 4]
    assert run.tokens["a"] == []  # no token ids without a prompt's ids
    assert run.stats["a"].completion_tokens == 2
    with pytest.raises(RequestRejected, match="block_keys has 1 entries"):
        engine.add_request("d", None, 1, 1.0, num_prompt_tokens=8, block_keys=[1])


# ---------------------------------------------------------------------------------------------
# Eviction


def test_eviction_takes_least_recently_freed_first_tail_first() -> None:
    # 4 usable blocks of 4 tokens.
    engine = make_engine(num_gpu_blocks=5)
    a = list(range(100, 108))
    b = list(range(200, 208))
    a_keys = block_hashes(a, block_size=4, algo="sha256_cbor")
    b_keys = block_hashes(b, block_size=4, algo="sha256_cbor")
    engine.add_request("a", a, 1, 0.0)
    run = drain(engine)
    engine.add_request("b", b, 1, 1.0)
    drain(engine, run)
    assert run.removed() == []  # never-used blocks go first
    assert engine.cached_block_keys() == {*a_keys, *b_keys}

    # 8 new tokens need 2 blocks: a's, freed first, tail before head.
    engine.add_request("c", list(range(300, 308)), 1, 2.0)
    drain(engine, run)
    assert run.removed() == [a_keys[1], a_keys[0]]

    # A hit takes b's blocks out of the free queue, so the next allocation evicts c's instead.
    engine.add_request("b-again", [*b, 1, 2, 3, 4], 1, 3.0)
    drain(engine, run)
    assert run.stats["b-again"].cached_tokens == 8
    c_keys = block_hashes(list(range(300, 308)), block_size=4, algo="sha256_cbor")
    assert run.removed() == [a_keys[1], a_keys[0], c_keys[1]]
    assert set(b_keys) <= engine.cached_block_keys()


def test_blocks_of_running_requests_are_never_evicted() -> None:
    engine = make_engine(num_gpu_blocks=9)  # 8 usable
    long = list(range(1000, 1012))  # 3 blocks, then grows while decoding
    long_keys = block_hashes(long, block_size=4, algo="sha256_cbor")
    engine.add_request("long", long, 12, 0.0)
    run = Run()
    for i in range(12):  # churn: each short request needs 2 fresh blocks
        engine.add_request(f"s{i}", [i] * 7 + [5000 + i], 1, 0.001 * i)
        drain(engine, run, until=0.001 * (i + 1))
    drain(engine, run)
    assert run.stats["long"].completion_tokens == 12
    removed_while_running = set(run.removed())
    assert not removed_while_running & set(long_keys)
    assert set(long_keys) <= engine.cached_block_keys()
    assert engine.metrics().num_preemptions == 0


def test_requests_queue_when_kv_capacity_is_short() -> None:
    engine = make_engine(num_gpu_blocks=5)  # 4 usable blocks
    engine.add_request("a", list(range(12)), 1, 0.0)  # 3 blocks
    engine.add_request("b", list(range(50, 62)), 1, 0.0)  # 3 more: does not fit
    engine.advance(0.0)
    metrics = engine.metrics()
    assert (metrics.num_requests_running, metrics.num_requests_waiting) == (1, 1)
    assert metrics.kv_cache_usage == pytest.approx(3 / 4)
    run = drain(engine)
    assert run.first_token_time("b") == pytest.approx(run.stats["a"].finish_time + 12e-3)
    final = engine.metrics()
    assert (final.num_requests_running, final.num_requests_waiting) == (0, 0)
    assert final.kv_cache_usage == 0.0  # cached but free blocks count as free
    assert final.num_cached_blocks == 4  # b evicted two of a's three blocks


def test_max_num_seqs_limits_the_batch() -> None:
    engine = make_engine(max_num_seqs=2)
    for name in "abc":
        engine.add_request(name, [ord(name)] * 5, 3, 0.0)
    engine.advance(0.0)
    assert engine.metrics().num_requests_running == 2
    assert engine.metrics().num_requests_waiting == 1
    run = drain(engine)
    assert run.first_token_time("c") > run.stats["a"].finish_time - 1e-12


def test_newest_running_request_is_preempted_when_a_block_is_short() -> None:
    engine = make_engine(num_gpu_blocks=5)  # 4 usable blocks
    # Each needs 1 block for its prompt, then a new block every 4 tokens: 4 blocks alone.
    engine.add_request("old", [1, 2, 3, 4], 12, 0.0)
    engine.add_request("new", [5, 6, 7, 8], 12, 0.0)
    run = drain(engine)
    assert run.stats["old"].num_preemptions == 0
    assert run.stats["new"].num_preemptions >= 1
    assert run.stats["old"].completion_tokens == run.stats["new"].completion_tokens == 12
    assert run.stats["old"].finish_time < run.stats["new"].finish_time
    metrics = engine.metrics()
    assert metrics.num_preemptions == run.stats["new"].num_preemptions
    # The preempted request's re-admission is not a prefix-cache query (vLLM counts it apart).
    assert metrics.prefix_cache_queries == 8


def test_abort_frees_blocks() -> None:
    engine = make_engine(num_gpu_blocks=5)
    engine.add_request("a", list(range(12)), 4, 0.0)
    engine.advance(0.0)
    assert engine.metrics().kv_cache_usage == pytest.approx(3 / 4)
    stats = engine.abort("a", 0.001)
    assert stats is not None and stats.finish_reason == "abort"
    assert engine.metrics().kv_cache_usage == 0.0
    assert engine.abort("a", 0.002) is None
    run = drain(engine)
    assert "a" not in run.stats
    assert engine.next_event_time() is None


# ---------------------------------------------------------------------------------------------
# Timing


def test_ttft_grows_with_uncached_tokens_and_attention_over_cached_context() -> None:
    profile = TIMED
    engine = make_engine(256, block_size=16, profile=profile)
    ttfts = []
    for i, n in enumerate((100, 400, 1600)):
        engine.add_request(f"r{n}", [i + 1] * n, 1, float(i))
        ttfts.append(drain(engine).ttft(f"r{n}"))
    assert ttfts[0] < ttfts[1] < ttfts[2]
    # 100 tokens: 1 ms + max(5 ms, 100 ms) + 1e-7 · 100 · 50
    assert ttfts[0] == pytest.approx(1e-3 + 100e-3 + 1e-7 * 100 * 50)
    assert ttfts[2] == pytest.approx(profile.prefill_time(1600))

    # A cached prefix removes the linear cost of its tokens, not the attention over them.
    prefix = [7] * 1600
    engine.add_request("warm-up", prefix, 1, 10.0)
    drain(engine)
    engine.add_request("hit", [*prefix, *([8] * 100)], 1, 20.0)
    run = drain(engine)
    assert run.stats["hit"].cached_tokens == 1600
    assert run.ttft("hit") == pytest.approx(profile.prefill_time(100, cached_tokens=1600))
    assert profile.prefill_time(100) < run.ttft("hit") < profile.prefill_time(1700)


def test_decode_step_time_grows_with_batch_size() -> None:
    profile = TIMED

    def inter_token_time(batch: int) -> float:
        engine = make_engine(512, block_size=16, profile=profile, record_token_times=True)
        for i in range(batch):
            engine.add_request(f"r{i}", [i + 1] * 64, 4, 0.0)
        times = drain(engine).token_times["r0"]
        return times[2] - times[1]  # the step computing token index 65 of every sequence

    # step = overhead + max(floor, α·B) + c1·B + c2·(B · 66 tokens of context)
    for batch in (1, 8, 64):
        expected = 1e-3 + max(5e-3, 1e-3 * batch) + 1e-3 * batch + 1e-6 * 66 * batch
        assert inter_token_time(batch) == pytest.approx(expected)
    assert inter_token_time(1) < inter_token_time(8) < inter_token_time(64)


def test_chunked_prefill_respects_the_token_budget() -> None:
    engine = make_engine(max_num_batched_tokens=16, record_token_times=True)
    engine.add_request("long", list(range(40)), 2, 0.0)
    run = drain(engine)
    # 40 tokens in chunks of 16, 16, 8, then one decode step (1 ms per token in UNIT).
    assert run.steps == 4
    assert run.stats["long"].ttft == pytest.approx(40e-3)

    # A decoding request keeps its token; the prefill gets the rest of the budget.
    engine = make_engine(max_num_batched_tokens=16, record_token_times=True)
    engine.add_request("decoder", [1, 2, 3], 10, 0.0)
    engine.advance(0.0)
    engine.add_request("long", list(range(40)), 1, 0.003)  # as its prefill (3 ms) ends
    run = drain(engine)
    # Steps: [decode 1 + prefill 15], [1 + 15], [1 + 10]: 16, 16, 11 tokens; decode steps in UNIT
    # cost 1 ms each for the linear token plus 1 ms per decoding sequence.
    step = [16e-3 + 1e-3, 16e-3 + 1e-3, 11e-3 + 1e-3]
    assert run.first_token_time("long") == pytest.approx(0.003 + sum(step))


def test_steps_start_when_work_arrives_and_never_overlap() -> None:
    engine = make_engine(record_token_times=True)
    engine.add_request("a", [1] * 10, 3, 5.0)
    assert engine.next_event_time() == 5.0
    run = drain(engine)
    assert run.token_times["a"][0] == pytest.approx(5.010)
    # A request arriving mid-step waits for the next step boundary.
    engine.add_request("b", [2] * 10, 1, 6.0)
    engine.advance(6.0)
    engine.add_request("c", [3] * 10, 1, 6.004)
    run = drain(engine)
    assert run.first_token_time("b") == pytest.approx(6.010)
    assert run.first_token_time("c") == pytest.approx(6.020)
    with pytest.raises(EngineError, match="backwards"):
        engine.advance(1.0)


def test_speedup_divides_every_duration() -> None:
    fast = UNIT.scaled(10)
    engine = make_engine(profile=fast)
    engine.add_request("a", [1] * 20, 1, 0.0)
    assert drain(engine).stats["a"].ttft == pytest.approx(20e-4)


def test_rejects_requests_vllm_would_refuse() -> None:
    engine = make_engine(num_gpu_blocks=5, max_model_len=64)
    with pytest.raises(RequestRejected, match="maximum context length is 64"):
        engine.add_request("x", [1] * 60, 10, 0.0)
    with pytest.raises(RequestRejected, match="KV blocks"):
        engine.add_request("y", [1] * 17, 1, 0.0)
    with pytest.raises(RequestRejected, match="empty"):
        engine.add_request("z", [], 1, 0.0)
    engine.add_request("ok", [1] * 4, 1, 0.0)
    with pytest.raises(RequestRejected, match="already"):
        engine.add_request("ok", [1] * 4, 1, 0.0)


# ---------------------------------------------------------------------------------------------
# KV events


def test_block_stored_chain_removed_and_cleared_events() -> None:
    engine = make_engine(num_gpu_blocks=5)  # 4 usable blocks
    prompt = list(range(10, 19))  # 9 tokens: 2 full blocks
    keys = block_hashes(prompt, block_size=4, algo="sha256_cbor")
    engine.add_request("a", prompt, 4, 0.0)
    run = drain(engine)
    stored = run.stored()
    # Prefill stores blocks 0-1; the decode step computing token index 11 fills block 2.
    assert next(s.block_hashes for s in stored) == tuple(keys)
    assert stored[0].parent_block_hash is None
    assert stored[0].token_ids == tuple(prompt[:8])
    assert len(stored) == 2 and len(stored[1].block_hashes) == 1
    assert stored[1].parent_block_hash == keys[1]
    assert stored[1].token_ids == (prompt[8], *run.tokens["a"][:3])
    for event in stored:
        assert (event.medium, event.group_idx, event.kv_cache_spec_kind) == (
            "GPU",
            0,
            "full_attention",
        )
        assert event.block_size == 4
    assert len(run.batches) == 2  # one batch per step that produced events

    engine.add_request("b", list(range(50, 63)), 1, 1.0)  # needs all 4 blocks
    drain(engine, run)
    removed = [e for e in run.events if isinstance(e, BlockRemoved)]
    assert [e.block_hashes for e in removed] == [
        (stored[1].block_hashes[0],),
        (keys[1],),
        (keys[0],),
    ]
    assert all(e.medium == "GPU" and e.group_idx == 0 for e in removed)

    assert engine.reset_prefix_cache()
    batch = engine.take_events(2.0)
    assert batch is not None and batch.events == (AllBlocksCleared(),)
    assert engine.cached_block_keys() == set()
    assert engine.take_events(2.0) is None


def test_reset_is_refused_while_blocks_are_in_use() -> None:
    engine = make_engine()
    engine.add_request("a", [1] * 8, 5, 0.0)
    engine.advance(0.0)
    assert not engine.reset_prefix_cache()
    drain(engine)
    assert engine.reset_prefix_cache()


def test_event_hashes_equal_indexer_hashing_with_salt_and_lora() -> None:
    lora = LoRA("sql-lora", "/adapters/sql-lora", 3)
    for algo in ("sha256", "sha256_cbor"):
        engine = make_engine(block_size=16, hash_algo=algo)
        prompt = [(i * 7919 + 13) % 151936 for i in range(70)]
        engine.add_request("plain", prompt, 1, 0.0)
        engine.add_request("salted", prompt, 1, 0.0, cache_salt="tenant-a", lora=lora)
        run = drain(engine)
        plain, salted = run.stored()
        assert list(plain.block_hashes) == block_hashes(prompt, block_size=16, algo=algo)
        assert list(salted.block_hashes) == block_hashes(
            prompt,
            block_size=16,
            algo=algo,
            cache_salt="tenant-a",
            lora_name="sql-lora",
            lora_path="/adapters/sql-lora",
        )
        assert run.stats["salted"].cached_tokens == 0  # the salt keeps tenants apart
        assert salted.lora_id == 3 and salted.lora_name == "sql-lora"
        assert salted.extra_keys == (
            ("sql-lora", "tenant-a"),
            ("sql-lora",),
            ("sql-lora",),
            ("sql-lora",),
        )
        assert plain.extra_keys == (None, None, None, None)


def test_decode_blocks_continue_the_real_hash_chain() -> None:
    engine = make_engine(block_size=16, hash_algo="sha256")
    prompt = list(range(1, 21))
    engine.add_request("a", prompt, 30, 0.0)
    run = drain(engine)
    full = prompt + run.tokens["a"]
    expected = block_hashes(full[:48], block_size=16, algo="sha256")
    assert [h for s in run.stored() for h in s.block_hashes] == expected


def test_golden_hashes_of_t33_and_t64() -> None:
    vectors = load_vectors()
    sequences = {
        "T33": [(i * 7919 + 13) % 151936 for i in range(33)],
        "T64": [151643, *range(100, 163)],
    }
    by_id = {v["id"]: v for v in vectors["hash_vectors"]}
    for name, tokens in sequences.items():
        engine = make_engine(block_size=16, hash_algo="sha256")
        engine.add_request(name, tokens, 1, 0.0)
        (stored,) = drain(engine).stored()
        golden = by_id[f"sha256/{name.lower()}_bs16/seed=unset"]["event_block_hashes_uint64"]
        assert list(stored.block_hashes) == [int(h) for h in golden]


def test_golden_event_batch_byte_for_byte() -> None:
    """Replays the scenario behind the golden `combined_batch` (vLLM 0.33's real BlockPool,
    8 GPU blocks of 16, sha256, seed unset) through the engine's scheduler and compares the
    encoded events byte for byte.  The engine also caches the blocks of the filler request that
    forces the evictions (the golden run reallocated blocks without a request); those events are
    left out of the comparison."""
    vectors = load_vectors()["kv_events"]["combined_batch"]
    t33 = [(i * 7919 + 13) % 151936 for i in range(33)]
    t64 = [151643, *range(100, 163)]
    engine = make_engine(
        num_gpu_blocks=8,
        block_size=16,
        hash_algo="sha256",
        output_tokens=lambda req_id, index: 500 + index,
    )
    # Step 1: A = T33 caches 2 blocks; its generated tokens 500..514 complete block 3.  Then
    # B = T64[:16] with LoRA and a cache salt caches one block.  Both are freed, A first.
    engine.add_request("A", t33, 17, 0.0)
    run = drain(engine)
    engine.add_request(
        "B", t64[:16], 1, 1.0, cache_salt="tenant-a", lora=LoRA("sql-lora", "/adapters/sql-lora", 1)
    )
    drain(engine, run)
    # Step 2: a filler request needing all 7 blocks evicts everything, in free-queue order.
    filler = list(range(1000, 1000 + 7 * 16 - 1))
    engine.add_request("filler", filler, 1, 10.0)
    drain(engine, run)
    filler_keys = set(block_hashes(filler, block_size=16, algo="sha256"))
    # Step 3: A's first two blocks cached again, freed, then the cache reset.
    engine.add_request("A2", t33, 1, 20.0)
    drain(engine, run)
    assert engine.reset_prefix_cache()
    cleared = engine.take_events(30.0)
    assert cleared is not None
    events = [
        e
        for e in [*run.events, *cleared.events]
        if isinstance(e, AllBlocksCleared) or not filler_keys & set(e.block_hashes)
    ]
    assert [type(e).__name__ for e in events] == vectors["event_types"]
    payload = encode_batch(
        KVEventBatch(ts=1767225600.25, events=tuple(events), data_parallel_rank=0)
    )
    assert payload.hex() == vectors["payload_hex"]
