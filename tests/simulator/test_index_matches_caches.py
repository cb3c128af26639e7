"""After a workload with evictions, the EPP's KV index holds exactly what the simulated pods'
caches hold: the engines' events, applied in order to `KVBlockIndex`, reproduce their state."""

from __future__ import annotations

import random

from indexer.hashing import HashConfig
from indexer.index import KVBlockIndex
from simulator.engine import Engine
from simulator.engine_config import EngineConfig
from simulator.profiles import get_profile


def test_index_after_a_workload_equals_the_union_of_the_pods_caches() -> None:
    profile = get_profile("tiny-cpu")
    # 64 blocks per pod: far less than the workload's blocks, so eviction runs all the time.
    engines = {
        f"10.0.0.{i}:8000": Engine(EngineConfig.from_profile(profile, num_gpu_blocks=64), profile)
        for i in range(3)
    }
    index = KVBlockIndex(hash_config=HashConfig(block_size=16, algo="sha256"))
    rng = random.Random(3)
    shared = [rng.randrange(30_000) for _ in range(100)]
    now = 0.0
    for n in range(120):
        address = rng.choice(list(engines))
        prompt = (shared[: rng.randrange(0, 100)] if rng.random() < 0.6 else []) + [
            rng.randrange(30_000) for _ in range(rng.randrange(20, 200))
        ]
        engines[address].add_request(f"r{n}", prompt, rng.randrange(1, 40), now)
        now += rng.random() * 0.02
        for name, engine in engines.items():
            for batch in engine.advance(now).kv_batches:
                index.apply(name, batch)
    # Drain: let every request finish and every event reach the index.
    for name, engine in engines.items():
        while (due := engine.next_event_time()) is not None:
            now = max(now, due)
            for batch in engine.advance(now).kv_batches:
                index.apply(name, batch)

    evicted_somewhere = False
    for name, engine in engines.items():
        cached = engine.cached_block_keys()
        held = {key for key in cached if name in index.holders(key)}
        assert held == cached, f"{name}: index misses {len(cached - held)} cached blocks"
        assert index.endpoint_stats(name).blocks == len(cached)
        evicted_somewhere |= index.endpoint_stats(name).removed_total > 0
    assert evicted_somewhere, "the workload should have forced evictions"
    assert index.mismatches == {}
    assert index.consistency_errors() == []
