"""Benchmarks for the `indexer` package: index lookups, event ingestion, index memory, block
hashing and event decoding.  Figures are printed, never asserted (docs/design.md, "Targets").

    .venv/bin/python -m benchmarks.indexer [--json OUT] [--entries 10000000] [--only memory ...]

Each section is a function ``(Options) -> list[Figure]`` registered in `SECTIONS`; add a section
by writing one and adding it there.
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import os
import platform
import random
import subprocess
import sys
import time
import tracemalloc
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from benchmarks.reports import write_json
from indexer.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEvent,
    KVEventBatch,
    decode_batch,
    encode_batch,
)
from indexer.hashing import HashConfig, PrefixHasher, block_hashes
from indexer.index import KVBlockIndex

BLOCK_SIZE = 16
PROMPT_TOKENS = 8192  # 512 blocks of 16: the scheduling target (docs/design.md, "Targets")
ENDPOINTS = 64


@dataclass(slots=True, frozen=True)
class Figure:
    section: str
    name: str
    value: float
    unit: str
    note: str = ""


@dataclass(slots=True, frozen=True)
class Options:
    entries: int
    quick: bool


def _endpoints(n: int = ENDPOINTS) -> list[str]:
    return [f"10.0.{i // 256}.{i % 256}:8000" for i in range(n)]


def _tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(150_000) for _ in range(n)]


def _percentiles(samples_ns: list[int]) -> tuple[float, float]:
    ordered = sorted(samples_ns)
    p50 = ordered[len(ordered) // 2] / 1e3
    p99 = ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))] / 1e3
    return p50, p99


def _time_calls(call: Callable[[], object], repeat: int) -> tuple[float, float]:
    """p50 and p99 in µs of wall-clock time per call."""
    return _time_calls_both(call, repeat)[0]


def _time_calls_both(
    call: Callable[[], object], repeat: int
) -> tuple[tuple[float, float], tuple[float, float]]:
    """(p50, p99) in µs of wall-clock time and of this thread's CPU time per call.  On a shared
    machine the wall-clock p99 includes time slices lost to other processes; the CPU-time p99
    does not (its resolution is about 1 µs)."""
    for _ in range(min(100, repeat)):
        call()
    wall: list[int] = []
    cpu: list[int] = []
    for _ in range(repeat):
        start_cpu = time.thread_time_ns()
        start = time.perf_counter_ns()
        call()
        wall.append(time.perf_counter_ns() - start)
        cpu.append(time.thread_time_ns() - start_cpu)
    return _percentiles(wall), _percentiles(cpu)


# ---------------------------------------------------------------------------------------------
# (1) Index lookups


def _time_lookups(
    method: Callable[[list[int], list[str]], object],
    queries: list[list[int]],
    names: list[str],
    repeat: int,
) -> tuple[tuple[float, float], tuple[float, float]]:
    cycle = iter(queries * (repeat // len(queries) + 200))
    return _time_calls_both(lambda: method(next(cycle), names), repeat)


def bench_lookup(options: Options) -> list[Figure]:
    rng = random.Random(1)
    names = _endpoints()
    repeat = 500 if options.quick else 3000
    figures: list[Figure] = []
    blocks = PROMPT_TOKENS // BLOCK_SIZE

    def run(label: str, index: KVBlockIndex, queries: list[list[int]], note: str) -> None:
        for method in (index.longest_prefix, index.prefix_match):
            wall, cpu = _time_lookups(method, queries, names, repeat)
            name = f"{method.__name__} {label}"
            figures.append(Figure("index lookup", f"{name} p50", wall[0], "µs", note))
            figures.append(Figure("index lookup", f"{name} p99", wall[1], "µs"))
            figures.append(Figure("index lookup", f"{name} p99 CPU time", cpu[1], "µs"))
            note = ""

    # Worst case for the walk: all 64 endpoints hold all 512 blocks, so it runs to the end
    # with the full mask.
    index = KVBlockIndex()
    full = [rng.getrandbits(64) for _ in range(blocks)]
    for name in names:
        index.store(name, full)
    run("all 64 hold 512/512", index, [full], "64 endpoints × 512-key query, GPU only")

    # A fleet: a 128-block system prompt everywhere, 2,000 conversations of 512 blocks, each
    # on 1-3 endpoints to a random depth; a quarter of the endpoints also offload to CPU.
    index = KVBlockIndex()
    system = [rng.getrandbits(64) for _ in range(128)]
    for name in names:
        index.store(name, system)
    conversations = []
    for _ in range(2000):
        keys = system + [rng.getrandbits(64) for _ in range(blocks - 128)]
        conversations.append(keys)
        for name in rng.sample(names, rng.randint(1, 3)):
            index.store(name, keys[: rng.randint(128, blocks)])
        if rng.random() < 0.25:
            index.store(rng.choice(names), keys, medium="CPU")
    run(
        "fleet",
        index,
        conversations[:500],
        f"{index.entries:,} entries; shared 128-block system prompt, 1-3 holders per chat",
    )
    run("miss", index, [[rng.getrandbits(64) for _ in range(blocks)]], "block 0 unknown")
    return figures


# ---------------------------------------------------------------------------------------------
# (2) Event ingestion


def _ingestion_batches(
    rng: random.Random, endpoints: int, steps: int, shared: bool
) -> tuple[list[tuple[str, KVEventBatch]], int]:
    """Decoded batches as pods publish them per scheduler step: 4 BlockStored of 32 blocks
    (512-token prefill chunks, each continuing the previous one) and 8 BlockRemoved of blocks
    stored 10 steps earlier.  ``shared``: every pod caches the same prompts (a fleet-wide
    system prompt), otherwise every prompt is unique (worst case for the self-check)."""
    names = _endpoints(endpoints)
    batches: list[tuple[str, KVEventBatch]] = []
    block_events = 0
    prompts = [_tokens(rng, 32 * BLOCK_SIZE * 4) for _ in range(steps)] if shared else []
    for e, name in enumerate(names):
        history: list[int] = []
        for step in range(steps):
            tokens = prompts[step] if shared else _tokens(rng, 32 * BLOCK_SIZE * 4)
            keys = block_hashes(tokens, block_size=BLOCK_SIZE, algo="sha256_cbor")
            events: list[KVEvent] = []
            for chunk in range(4):
                first = chunk * 32
                events.append(
                    BlockStored(
                        block_hashes=tuple(keys[first : first + 32]),
                        parent_block_hash=keys[first - 1] if first else None,
                        token_ids=tuple(tokens[first * BLOCK_SIZE : (first + 32) * BLOCK_SIZE]),
                        block_size=BLOCK_SIZE,
                        medium="GPU",
                        extra_keys=(None,) * 32,
                        group_idx=0,
                        kv_cache_spec_kind="full_attention",
                    )
                )
            if len(history) > 10 * 128:
                for key in history[:8]:
                    events.append(BlockRemoved(block_hashes=(key,), medium="GPU", group_idx=0))
                del history[:8]
                block_events += 8
            history.extend(keys)
            block_events += 128
            payload = encode_batch(KVEventBatch(ts=1.0 + step + e, events=tuple(events)))
            batches.append((name, decode_batch(payload)))
    return batches, block_events


def bench_ingestion(options: Options) -> list[Figure]:
    rng = random.Random(2)
    steps = 10 if options.quick else 40
    figures: list[Figure] = []
    config = HashConfig(block_size=BLOCK_SIZE, algo="sha256_cbor")
    for shared in (False, True):
        batches, block_events = _ingestion_batches(rng, 16, steps, shared)
        workload = "same prompts on every pod" if shared else "unique prompts"
        makers: list[tuple[str, Callable[[], KVBlockIndex]]] = [
            ("trusting", KVBlockIndex),
            ("self-check", functools.partial(KVBlockIndex, hash_config=config)),
            (
                "self-check first 1k blocks/pod",
                functools.partial(KVBlockIndex, hash_config=config, self_check_blocks=1_000),
            ),
            # Far below the data set, so every batch also evicts.
            ("trusting, at the cap", functools.partial(KVBlockIndex, max_entries=20_000)),
        ]
        for label, make in makers:
            runs = []
            for _ in range(1 if options.quick else 3):
                index = make()
                start = time.perf_counter()
                for name, batch in batches:
                    index.apply(name, batch)
                runs.append(time.perf_counter() - start)
            rate = block_events / min(runs)
            note = f"{workload}; {block_events:,} block events, batches of 4×32 stored + 8 removed"
            figures.append(
                Figure("ingestion", f"{label}, {workload}", rate, "block events/s", note)
            )
    return figures


# ---------------------------------------------------------------------------------------------
# (3) Index memory


def _fill(index: KVBlockIndex, entries: int, holders: int) -> float:
    """``entries`` (block, endpoint) entries: blocks in runs of 512 (one prompt), each run held
    by ``holders`` consecutive endpoints (so the sets of holders repeat, as in a real fleet).
    Returns the slowest store call in seconds (a resize of the block dict)."""
    rng = random.Random(3)
    names = _endpoints()
    run = 512
    made = 0
    prompt = 0
    slowest = 0.0
    while made < entries:
        keys = [rng.getrandbits(64) for _ in range(min(run, (entries - made) // holders or 1))]
        for h in range(holders):
            start = time.perf_counter()
            index.store(names[(prompt + h) % len(names)], keys)
            slowest = max(slowest, time.perf_counter() - start)
        made += len(keys) * holders
        prompt += 1
    return slowest


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def memory_probe(entries: int, holders: int, traced: bool) -> None:
    """Build one index in this (fresh) process and print its size as JSON: bytes traced by
    tracemalloc (what Python asked for), or the growth of the resident set (what the allocator
    took, with its rounding: a 64-bit int asks for 36 bytes and occupies 48)."""
    gc.collect()
    if traced:
        tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0] if traced else _rss_bytes()
    index = KVBlockIndex(max_entries=max(entries, 1))
    slowest = _fill(index, entries, holders)
    gc.collect()
    after = tracemalloc.get_traced_memory()[0] if traced else _rss_bytes()
    print(
        json.dumps(
            {
                "bytes": after - before,
                "entries": index.entries,
                "blocks": index.blocks,
                "slowest_store_ms": slowest * 1e3,
            }
        )
    )


def probe_memory(entries: int, holders: int, traced: bool) -> dict[str, float]:
    """`memory_probe` in a fresh interpreter, and what it printed: memory freed by an earlier
    build in this process would otherwise be reused and hide from the resident set."""
    code = (
        f"from benchmarks.indexer import memory_probe; memory_probe({entries}, {holders}, {traced})"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        check=True,
        capture_output=True,
        text=True,
        cwd=Path(__file__).resolve().parent.parent,
    ).stdout
    probe: dict[str, float] = json.loads(out)
    return probe


def bench_memory(options: Options) -> list[Figure]:
    figures: list[Figure] = []
    for holders in (1, 2, 4):
        for traced in (True, False):
            probe = probe_memory(options.entries, holders, traced)
            how = "tracemalloc" if traced else "RSS growth"
            note = (
                f"{probe['entries']:,} entries, {probe['blocks']:,} blocks, 64 endpoints"
                if traced
                else ""
            )
            figures.append(
                Figure(
                    "memory",
                    f"{holders} holder(s) per block, {how}",
                    probe["bytes"] / probe["entries"],
                    "B/entry",
                    note,
                )
            )
            if not traced:
                figures.append(
                    Figure(
                        "memory",
                        f"{holders} holder(s) per block, slowest store",
                        probe["slowest_store_ms"],
                        "ms",
                        "one 512-block store call that resized the block dict",
                    )
                )
    return figures


# ---------------------------------------------------------------------------------------------
# (4) Hashing


def bench_hashing(options: Options) -> list[Figure]:
    rng = random.Random(4)
    prompts = [_tokens(rng, PROMPT_TOKENS) for _ in range(3 if options.quick else 10)]
    blocks = PROMPT_TOKENS // BLOCK_SIZE
    figures: list[Figure] = []
    for algo in ("sha256_cbor", "sha256"):
        start = time.perf_counter()
        for tokens in prompts:
            block_hashes(tokens, block_size=BLOCK_SIZE, algo=algo)
        elapsed = (time.perf_counter() - start) / len(prompts)
        note = f"{PROMPT_TOKENS}-token prompt, block_hashes, cold"
        figures.append(Figure("hashing", f"{algo} cold", blocks / elapsed, "blocks/s", note))
        figures.append(Figure("hashing", f"{algo} cold per prompt", elapsed * 1e3, "ms"))
        hasher = PrefixHasher(HashConfig(block_size=BLOCK_SIZE, algo=algo))
        for tokens in prompts:
            hasher.digests(tokens)
        warm = functools.partial(hasher.digests, prompts[0])
        p50, p99 = _time_calls(warm, 50 if options.quick else 300)
        note = "PrefixHasher, prompt seen before"
        figures.append(Figure("hashing", f"{algo} warm per prompt p50", p50 / 1e3, "ms", note))
        figures.append(Figure("hashing", f"{algo} warm per prompt p99", p99 / 1e3, "ms"))
    return figures


# ---------------------------------------------------------------------------------------------
# (5) Event decoding


def bench_decoding(options: Options) -> list[Figure]:
    rng = random.Random(5)
    payloads: list[bytes] = []
    block_events = 0
    events_total = 0
    for step in range(20 if options.quick else 200):
        events: list[KVEvent] = []
        for _ in range(4):
            tokens = _tokens(rng, 32 * BLOCK_SIZE)
            events.append(
                BlockStored(
                    block_hashes=tuple(rng.getrandbits(64) for _ in range(32)),
                    parent_block_hash=rng.getrandbits(64),
                    token_ids=tuple(tokens),
                    block_size=BLOCK_SIZE,
                    medium="GPU",
                    extra_keys=(None,) * 32,
                    group_idx=0,
                    kv_cache_spec_kind="full_attention",
                )
            )
        events += [
            BlockRemoved(block_hashes=(rng.getrandbits(64),), medium="GPU") for _ in range(8)
        ]
        if step % 50 == 49:
            events.append(AllBlocksCleared())
        payloads.append(encode_batch(KVEventBatch(ts=float(step), events=tuple(events))))
        block_events += 4 * 32 + 8
        events_total += len(events)
    size = sum(map(len, payloads))
    runs = []
    for _ in range(3):
        start = time.perf_counter()
        for payload in payloads:
            decode_batch(payload)
        runs.append(time.perf_counter() - start)
    best = min(runs)
    note = f"batches of 4 BlockStored×32 blocks (with tokens) + 8 BlockRemoved, {size // len(payloads):,} B each"
    return [
        Figure("decoding", "decode_batch events", events_total / best, "events/s", note),
        Figure("decoding", "decode_batch block events", block_events / best, "block events/s"),
        Figure("decoding", "decode_batch bytes", size / best / 1e6, "MB/s"),
    ]


SECTIONS: dict[str, Callable[[Options], list[Figure]]] = {
    "lookup": bench_lookup,
    "ingestion": bench_ingestion,
    "memory": bench_memory,
    "hashing": bench_hashing,
    "decoding": bench_decoding,
}


def _print_table(figures: Sequence[Figure]) -> None:
    width = max(len(f"{f.section}: {f.name}") for f in figures)
    for f in figures:
        value = f"{f.value:,.1f}" if f.value < 1e4 else f"{f.value:,.0f}"
        line = f"{f.section + ': ' + f.name:<{width}}  {value:>12} {f.unit:<15}"
        print(f"{line}  {f.note}".rstrip())


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.indexer", description=__doc__)
    parser.add_argument("--json", type=Path, help="also write the figures to this JSON file")
    parser.add_argument(
        "--entries", type=int, default=1_000_000, help="(block, endpoint) entries for memory"
    )
    parser.add_argument("--only", nargs="+", choices=sorted(SECTIONS), help="sections to run")
    parser.add_argument("--quick", action="store_true", help="fewer repetitions (smoke test)")
    args = parser.parse_args(argv)
    options = Options(entries=args.entries, quick=args.quick)
    # Timings on a shared machine are only as good as its idle time: say what it was.
    load = os.getloadavg()[0]
    print(f"python {platform.python_version()}, {os.cpu_count()} CPUs, load average {load:.2f}")
    figures: list[Figure] = []
    for name in args.only or SECTIONS:
        section = SECTIONS[name](options)
        _print_table(section)
        sys.stdout.flush()
        figures += section
    report = {
        "python": platform.python_version(),
        "machine": platform.machine(),
        "cpus": os.cpu_count(),
        "load_average_at_start": load,
        "figures": [asdict(f) for f in figures],
    }
    write_json(args.json, report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
