"""The EPP's overhead, for the targets of docs/design.md ("Targets"): decision latency through the
real ext_proc server, sustained decisions per second per core, KV-event ingestion while serving,
index memory.

    python -m benchmarks.overhead [--endpoints 16 64 256] [--sizes 2048 8192 32768]
                                  [--requests 100] [--seconds 10] [--memory-entries 10000000]
                                  [--only latency rps ingestion memory] [--json OUT]

* ``latency``: the EPP in a fresh process of its own; a gRPC client (this process, as Envoy is
  another) sends ``request_headers`` + the whole body on one ext_proc stream
  and stops the clock at the headers response (the destination): parsing, the chat template,
  tokenization, vLLM block hashing, the index lookup, every scorer, the picker.  The profile is
  `benchmarks.decision`'s (precise prefix 3, queue 2, KV utilization 2); four endpoints hold the
  shared system prompt in the index.  ``cold``: every prompt new; ``warm``: the shared system
  prompt seen before, a new user turn (docs/design.md's "prefix seen recently").
* ``rps``: the EPP (this process: its event loop plus two tokenizer threads) against a load
  generator in another process keeping 32 streams busy with warm 2k-token chat prompts; the
  figure is decisions per second divided by the CPU cores the EPP process used meanwhile.
* ``ingestion``: a publisher process floods one endpoint's ZMQ socket with vLLM-format batches
  (64 BlockStored events of 16 blocks each per batch, with token ids) while the load generator
  keeps deciding; the figures are blocks indexed per second, per core used, and the decision
  latency meanwhile.
* ``memory``: `benchmarks.indexer.memory_probe` in a fresh interpreter (RSS growth per entry).

Figures are printed, never asserted.  Loopback only; every loop is bounded in count and time.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import os
import random
import resource
import tempfile
import time
from pathlib import Path
from typing import Any

import grpc
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ep_grpc

from benchmarks.decision import (
    Server,
    _chat,
    _chat_cases,
    _percentiles,
    _stored,
    _text,
    one_decision,
    with_fresh_epp,
)
from benchmarks.indexer import probe_memory
from benchmarks.reports import write_json
from epp.datastore import EndpointSpec
from indexer.endpoint_feed import _EndpointFeed
from indexer.events import KVEventBatch, encode_batch
from indexer.tokenization import PromptTokenizer
from indexer.tokenizer_assets import build_llama3_tokenizer_dir


def _cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


# ---------------------------------------------------------------------------------------------
# Decision latency


async def latency(endpoints: int, sizes: list[int], requests: int, tok_dir: Path) -> dict[str, Any]:
    """Decision latency per prompt size, cold and warm, the EPP in a process of its own (as
    `benchmarks.decision` runs it): a client on the EPP's own event loop once held it for
    25 ms in one of its writes, and that showed as the EPP's p99."""
    tok = PromptTokenizer.from_pretrained(tok_dir)
    rng = random.Random(7)
    shared = {size: [{"role": "system", "content": _text(rng, size - 200)}] for size in sizes}
    held = [tok.encode_chat(messages) for messages in shared.values()]
    cases: dict[str, tuple[list[bytes], list[bytes]]] = {}
    for size, messages in shared.items():
        n = max(20, requests * 2048 // size) if size > 8192 else requests
        for name, make in _chat_cases(rng, size, messages).items():
            label = f"{endpoints} endpoints, chat {size // 1024}k {name}"
            cases[label] = ([make() for _ in range(5)], [make() for _ in range(n)])
    out: dict[str, Any] = {}

    async def client(stub: Any) -> None:
        for label, (warm_up, timed) in cases.items():
            for body in warm_up:
                await one_decision(stub, body)
            samples = [await one_decision(stub, body) for body in timed]
            out[label] = {**_percentiles(samples), "n": len(timed)}

    await with_fresh_epp(endpoints, tok_dir, held, client)
    return out


# ---------------------------------------------------------------------------------------------
# Load generator (another process)


def _load_generator(
    port: int, bodies: list[bytes], seconds: float, streams: int, queue: Any
) -> None:
    async def run() -> list[float]:
        latencies: list[float] = []
        queue.put("ready")  # the EPP's CPU is measured from here
        deadline = time.monotonic() + seconds
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = ep_grpc.ExternalProcessorStub(channel)

            async def worker(k: int) -> None:
                i = k
                while time.monotonic() < deadline:
                    latencies.append(await one_decision(stub, bodies[i % len(bodies)]))
                    i += streams

            await asyncio.gather(*(worker(k) for k in range(streams)))
        return latencies

    queue.put(asyncio.run(run()))


async def _drive(
    port: int, bodies: list[bytes], seconds: float, streams: int = 32
) -> tuple[list[float], float, float]:
    """Decision latencies from a load generator in another process, and the wall and CPU
    seconds this (the EPP's) process spent while it ran."""
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=_load_generator, args=(port, bodies, seconds, streams, queue))
    proc.start()
    try:
        loop = asyncio.get_running_loop()
        assert await loop.run_in_executor(None, queue.get, True, 60) == "ready"
        wall, cpu = time.monotonic(), _cpu_seconds()
        result: list[float] = await loop.run_in_executor(None, queue.get, True, seconds + 60)
        return result, time.monotonic() - wall, _cpu_seconds() - cpu
    finally:
        await asyncio.get_running_loop().run_in_executor(None, proc.join, 30)


def _warm_bodies(tok_dir: Path, server: Server, n: int = 400) -> list[bytes]:
    rng = random.Random(11)
    tok = PromptTokenizer.from_pretrained(tok_dir)
    systems = [[{"role": "system", "content": _text(rng, 1850)}] for _ in range(8)]
    for shared in systems:
        server.hold(tok.encode_chat(shared))
    return [
        _chat([*systems[i % 8], {"role": "user", "content": _text(rng, 150)}]) for i in range(n)
    ]


async def rps(seconds: float, tok_dir: Path) -> dict[str, Any]:
    server = Server(16, tok_dir)
    await server.start()
    try:
        bodies = _warm_bodies(tok_dir, server)
        samples, wall, cpu = await _drive(server.port, bodies, seconds)
    finally:
        await server.stop()
    rate = len(samples) / wall
    cores = cpu / wall
    return {
        "decisions_per_s": rate,
        "epp_cores_used": cores,
        "decisions_per_s_per_core": rate / cores if cores else None,
        **_percentiles(samples),
    }


# ---------------------------------------------------------------------------------------------
# Event ingestion while serving


def _publisher(url_queue: Any, seconds: float, batches_sent: Any, rate: float) -> None:
    """vLLM-format batches of 64 BlockStored events, each a 16-block chain from block 0 with
    its true sha256 keys and tokens (so the EPP's self-check verifies every block, as it does
    for real pods), 256 distinct batches round-robin (more blocks than the EPP's digest cache,
    so re-sent blocks are hashed again)."""
    import zmq

    ctx = zmq.Context()
    pub = ctx.socket(zmq.PUB)
    pub.setsockopt(zmq.SNDHWM, 0)
    port = pub.bind_to_random_port("tcp://127.0.0.1")
    url_queue.put(f"tcp://127.0.0.1:{port}")
    rng = random.Random(5)
    payloads = []
    for _ in range(256):
        events = []
        for _ in range(64):
            events.append(_stored([rng.randrange(128_000) for _ in range(16 * 16)]))
        payloads.append(encode_batch(KVEventBatch(ts=0.0, events=tuple(events))))
    url_queue.put("built")
    time.sleep(1.0)  # the subscriber connects (slow joiner)
    deadline = time.monotonic() + seconds
    seq = 0
    started = time.monotonic()
    while time.monotonic() < deadline:
        pub.send_multipart([b"", seq.to_bytes(8, "big"), payloads[seq % len(payloads)]])
        seq += 1
        if rate:  # paced: `rate` batches per second
            time.sleep(max(0.0, started + seq / rate - time.monotonic()))
        elif seq % 16 == 0:
            time.sleep(0.001)  # flood, but no unbounded queue in front of the subscriber
    batches_sent.value = seq
    pub.close(linger=0)
    ctx.term()


_UNTIMED_ON_MESSAGE = _EndpointFeed.on_message


def _time_ingestion() -> list[float]:
    """Counts the CPU time (of the event loop's thread) spent handling KV-event messages, from
    receipt to the index: decoding, sequencing and indexing.  ``epp_cores_used`` also holds
    the decisions made meanwhile; this isolates what ingestion itself costs."""
    spent = [0.0]

    # Named `self` like the method it replaces, so the signatures match (keyword calls included).
    def timed(self: _EndpointFeed, frames: list[bytes]) -> None:
        started = time.thread_time()
        _UNTIMED_ON_MESSAGE(self, frames)
        spent[0] += time.thread_time() - started

    # Patching the method is the point: it wraps every feed, including ones created later.
    _EndpointFeed.on_message = timed  # type: ignore[method-assign]
    return spent


async def ingestion(seconds: float, tok_dir: Path, rate: float = 0.0) -> dict[str, Any]:
    """``rate``: batches of 1,024 blocks per second offered (0: as fast as the EPP takes them)."""
    server = Server(16, tok_dir)
    await server.start()
    ctx = multiprocessing.get_context("spawn")
    url_queue = ctx.Queue()
    sent = ctx.Value("q", 0)
    publisher = ctx.Process(target=_publisher, args=(url_queue, seconds + 2, sent, rate))
    publisher.start()
    try:
        loop = asyncio.get_running_loop()
        url = await loop.run_in_executor(None, url_queue.get, True, 30)
        assert await loop.run_in_executor(None, url_queue.get, True, 120) == "built"
        ingest_cpu = _time_ingestion()
        server.datastore.upsert(EndpointSpec(address="10.9.9.9:8000", kv_events_url=url))
        bodies = _warm_bodies(tok_dir, server)
        await asyncio.sleep(1.5)
        stats = server.plugin.view.subscriber_stats
        assert stats is not None, "the KV-cache view subscribes to KV events when it starts"
        events_before = stats.events
        cpu_before = ingest_cpu[0]
        samples, wall, cpu = await _drive(server.port, bodies, seconds, streams=8)
        events = stats.events - events_before
        ingest_cores = (ingest_cpu[0] - cpu_before) / wall
    finally:
        _EndpointFeed.on_message = _UNTIMED_ON_MESSAGE  # type: ignore[method-assign]
        await asyncio.get_running_loop().run_in_executor(None, publisher.join, 60)
        await server.stop()
    blocks = events * 16 / wall
    cores = cpu / wall
    return {
        "blocks_indexed_per_s": blocks,
        "epp_cores_used": cores,
        "blocks_per_s_per_core": blocks / cores if cores else None,
        "ingestion_cores": ingest_cores,
        "blocks_per_ingestion_core_s": blocks / ingest_cores if ingest_cores else None,
        "decisions_per_s_meanwhile": len(samples) / wall,
        **{f"decision_{k}": v for k, v in _percentiles(samples).items()},
    }


# ---------------------------------------------------------------------------------------------
# Index memory


def memory(entries: int) -> dict[str, Any]:
    out = {}
    for holders in (1, 2):
        probe = probe_memory(entries, holders, traced=False)
        out[f"{holders} holder(s) per block"] = {
            "bytes_per_entry": probe["bytes"] / probe["entries"],
            "entries": probe["entries"],
        }
    return out


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--endpoints", type=int, nargs="+", default=[16, 64, 256])
    parser.add_argument("--sizes", type=int, nargs="+", default=[2048, 8192, 32768])
    parser.add_argument("--requests", type=int, default=100, help="per latency case (fewer at 32k)")
    parser.add_argument("--seconds", type=float, default=10.0, help="rps and ingestion runs")
    parser.add_argument("--memory-entries", type=int, default=10_000_000)
    parser.add_argument(
        "--only", nargs="+", choices=["latency", "rps", "ingestion", "memory"], default=None
    )
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    sections = args.only or ["latency", "rps", "ingestion", "memory"]
    print(f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.2f}")
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        tok_dir = build_llama3_tokenizer_dir(Path(tmp) / "tok")
        if "latency" in sections:
            print(f"\n{'decision latency (ext_proc)':44} {'p50 ms':>8} {'p99 ms':>8} {'n':>5}")
            for n in args.endpoints:
                rows = asyncio.run(latency(n, args.sizes, args.requests, tok_dir))
                for name, row in rows.items():
                    print(f"{name:44} {row['p50_ms']:8.2f} {row['p99_ms']:8.2f} {row['n']:5d}")
                results.update(rows)
        if "rps" in sections:
            row = asyncio.run(rps(args.seconds, tok_dir))
            results["sustained"] = row
            print(
                f"\nsustained: {row['decisions_per_s']:.0f} decisions/s on "
                f"{row['epp_cores_used']:.2f} cores = {row['decisions_per_s_per_core']:.0f}/s per "
                f"core (warm 2k chat, 32 streams; p50 {row['p50_ms']:.1f} ms, p99 {row['p99_ms']:.1f} ms)"
            )
        for rate in [0.0, 40.0] if "ingestion" in sections else []:
            row = asyncio.run(ingestion(args.seconds, tok_dir, rate))
            label = "flood" if not rate else f"{rate * 1024:,.0f} blocks/s offered"
            results[f"ingestion {label}"] = row
            print(
                f"\ningestion while serving ({label}): {row['blocks_indexed_per_s']:,.0f} blocks/s on "
                f"{row['epp_cores_used']:.2f} cores = {row['blocks_per_s_per_core']:,.0f}/s per core; "
                f"ingestion itself used {row['ingestion_cores']:.2f} cores = "
                f"{row['blocks_per_ingestion_core_s']:,.0f} blocks/s per core; "
                f"{row['decisions_per_s_meanwhile']:.0f} decisions/s meanwhile, "
                f"p50 {row['decision_p50_ms']:.1f} ms, p99 {row['decision_p99_ms']:.1f} ms"
            )
    if "memory" in sections:
        rows = memory(args.memory_entries)
        results["memory"] = rows
        for name, row in rows.items():
            print(
                f"\nindex memory at {row['entries']:,} entries, {name}: "
                f"{row['bytes_per_entry']:.1f} B/entry (RSS growth)"
            )
    print(f"\nload average at the end {os.getloadavg()[0]:.2f}")
    write_json(args.json, results)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
