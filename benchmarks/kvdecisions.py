"""Sustained decisions per second with 1, 2 and 3 EPP replicas reading one shared store.

    python -m benchmarks.kvdecisions [--replicas 1,2,3] [--seconds 10] [--streams 32] [--json OUT]

For each replica count (after one replica with its index in memory, for reference): a real
Redis server (`launcher.kv_store`) and ``replicas`` processes,
each the EPP's request path behind its own ext_proc port (`benchmarks.overhead.Server`: the
profile of `benchmarks.decision`, precise prefix 3 / queue 2 / KV utilization 2) with its index
in the store (``kvBlockIndexConfig.redisConfig``).  Eight 1,850-token system prompts are held by
four of sixteen endpoints in the store; a load generator in another process keeps ``--streams``
ext_proc streams busy with warm 2k-token chat prompts (a shared system prompt, a new user turn),
the streams spread evenly over the replicas as Envoy spreads them over EPP pods.  Printed: the
decisions per second in all and per replica, the CPU cores each replica and the server used,
and the decision latency p50/p99 seen by the client.

Every process shares this machine's cores: on a 2-core machine the load generator, the server
and the replicas compete, so the aggregate is bounded by the cores; the per-core figures say
what one more core buys.  Figures are printed, never asserted.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import tempfile
import time
from pathlib import Path
from typing import Any

import grpc
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ep_grpc

from benchmarks.decision import Server, _percentiles, one_decision
from benchmarks.kvreplicas import _server_cpu
from benchmarks.overhead import _warm_bodies
from benchmarks.reports import command_line, write_json
from indexer.tokenizer_assets import build_llama3_tokenizer_dir
from launcher.configs import weighted_config
from launcher.kv_store import KVStoreServer


def _config(tokenizer_dir: Path, address: str | None) -> str:
    """`benchmarks.decision`'s profile, its index in the store at ``address`` (or in memory)."""
    index = {"redisConfig": {"address": address, "namespace": "rps"}} if address else {}
    return weighted_config(
        {"precise-prefix-cache-scorer": 3, "queue-scorer": 2, "kv-cache-utilization-scorer": 2},
        {
            "precise-prefix-cache-scorer": {
                "blockSize": 16,
                "tokenizer": str(tokenizer_dir),
                **({"kvBlockIndexConfig": index} if index else {}),
            }
        },
    )


def _replica(tok_dir: Path, address: str | None, ports: Any, go: Any, done: Any, out: Any) -> None:
    async def run() -> None:
        server = Server(16, tok_dir, _config(tok_dir, address))
        await server.start()
        try:
            bodies = _warm_bodies(tok_dir, server)  # the same prompts in every replica
            store = server.plugin.view._store  # a benchmark peeks: the holds are written
            assert store is None or store.flush(30)
            ports.put((server.port, bodies))
            loop = asyncio.get_running_loop()
            await loop.run_in_executor(None, go.wait)
            cpu0, t0 = time.process_time(), time.monotonic()
            await loop.run_in_executor(None, done.wait)
            out.put((server.port, (time.process_time() - cpu0) / (time.monotonic() - t0)))
        finally:
            await server.stop()

    asyncio.run(run())


def _load_generator(
    ports: list[int], bodies: list[bytes], seconds: float, streams: int, go: Any, out: Any
) -> None:
    """Drive the replicas for ``seconds``; ``go`` is set when the streams start (the
    measurement window opens then, not at this process's start-up)."""

    async def run() -> tuple[list[list[float]], float]:
        channels = [grpc.aio.insecure_channel(f"127.0.0.1:{port}") for port in ports]
        stubs = [ep_grpc.ExternalProcessorStub(channel) for channel in channels]
        for channel in channels:
            await channel.channel_ready()
        latencies: list[list[float]] = [[] for _ in ports]
        go.set()
        started = time.monotonic()
        deadline = started + seconds

        async def worker(k: int) -> None:
            i, replica = k, k % len(ports)
            while time.monotonic() < deadline:
                latencies[replica].append(
                    await one_decision(stubs[replica], bodies[i % len(bodies)])
                )
                i += streams

        try:
            await asyncio.gather(*(worker(k) for k in range(streams)))
            window = time.monotonic() - started
        finally:
            for channel in channels:
                await channel.close()
        return latencies, window

    out.put(asyncio.run(run()))


def run(
    replicas: int, seconds: float, streams: int, tok_dir: Path, *, store: bool = True
) -> dict[str, Any]:
    ctx = multiprocessing.get_context("spawn")
    with tempfile.TemporaryDirectory() as tmp, KVStoreServer(Path(tmp)) as server:
        ports_q, out, cores_q = ctx.Queue(), ctx.Queue(), ctx.Queue()
        go, done = ctx.Event(), ctx.Event()
        procs = [
            ctx.Process(
                target=_replica,
                args=(tok_dir, server.address if store else None, ports_q, go, done, cores_q),
                daemon=True,
            )
            for _ in range(replicas)
        ]
        for proc in procs:
            proc.start()
        loader: Any = None
        try:
            started = [ports_q.get(timeout=180) for _ in procs]
            ports, bodies = [port for port, _ in started], started[0][1]
            loader = ctx.Process(
                target=_load_generator,
                args=(ports, bodies, seconds, streams, go, out),
                daemon=True,
            )
            loader.start()
            assert go.wait(120), "the load generator did not start"
            cpu0, t0 = _server_cpu(server.address), time.monotonic()
            latencies, wall = out.get(timeout=seconds + 120)
            server_cores = (_server_cpu(server.address) - cpu0) / (time.monotonic() - t0)
            done.set()
            cores = dict(cores_q.get(timeout=60) for _ in procs)
        finally:
            go.set()
            done.set()
            for proc in [*procs, *([loader] if loader is not None else [])]:
                proc.join(30)
    every = [x for per in latencies for x in per]
    return {
        "replicas": replicas,
        "decisions_per_s": len(every) / wall,
        "server_cpu_cores": server_cores,
        "replica_cpu_cores": sum(cores.values()),
        "decisions_per_replica_core_s": len(every) / wall / sum(cores.values()),
        **_percentiles(every),
        "per_replica": [
            {"decisions_per_s": len(per) / wall, "cpu_cores": cores[port]}
            for port, per in zip(ports, latencies, strict=True)
        ],
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--replicas", default="1,2,3")
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--streams", type=int, default=32)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    rows = []
    print(
        f"{'replicas':>12} {'decisions/s':>12} {'replica cores':>14} {'per core':>9} "
        f"{'server':>7} {'p50 ms':>7} {'p99 ms':>7}  per replica decisions/s"
    )
    with tempfile.TemporaryDirectory() as tmp:
        tok_dir = build_llama3_tokenizer_dir(Path(tmp) / "tok")
        counts = [int(r) for r in args.replicas.split(",")]
        # First one replica with its index in memory: what the store costs a decision.
        for replicas, store in [(1, False), *((n, True) for n in counts)]:
            row = run(replicas, args.seconds, args.streams, tok_dir, store=store)
            row["index"] = "store" if store else "in-memory"
            rows.append(row)
            each = ", ".join(
                f"{r['decisions_per_s']:.0f} ({r['cpu_cores']:.2f} cores)"
                for r in row["per_replica"]
            )
            label = f"{replicas}" if store else "1 in-memory"
            print(
                f"{label:>12} {row['decisions_per_s']:>12.0f} {row['replica_cpu_cores']:>14.2f} "
                f"{row['decisions_per_replica_core_s']:>9.0f} {row['server_cpu_cores']:>7.2f} "
                f"{row['p50_ms']:>7.1f} {row['p99_ms']:>7.1f}  {each}"
            )
    write_json(args.json, {"command": command_line("benchmarks.kvdecisions", argv), "rows": rows})


if __name__ == "__main__":
    main()
