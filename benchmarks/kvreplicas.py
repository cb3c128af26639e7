"""KV-event ingestion with several EPP replicas sharing one store.

    python -m benchmarks.kvreplicas [--replicas 1,2,4] [--pods 100,1000] [--seconds 8]
                                    [--offered 500000] [--json OUT]

For each (replicas, pods): a real Redis server (`launcher.kv_store`), one process publishing
vLLM-format KV-event batches (32 stored blocks each, block size 16) on ``pods`` ZMQ PUB sockets
at ``--offered`` block events per second in all (more than the replicas take), and ``replicas`` processes, each a real `kvcache.view.KVCacheView` with the
store backend: the replicas share the pods out by lease (`kvcache.ownership`), subscribe to the
pods they own and write what they ingest.  Printed: block events per second, in all and per
replica, over ``--seconds`` after the streams are shared out, how the pods were split, and the
CPU cores each replica and the server used.

Every process shares this machine's cores with the server and the publisher: on a 2-core
machine the aggregate is bounded by the cores, not by the replicas; read the per-replica CPU
beside the rates.  "ingested" counts events decoded and handed to the store's writer; "written"
those the writer sent to the server (the writer's queue absorbs a difference).  Figures are
printed, never asserted.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import random
import resource
import tempfile
import time
from pathlib import Path
from typing import Any, cast

from benchmarks.kvstore import BLOCK, stored_batch
from benchmarks.reports import command_line, write_json
from indexer.events import encode_batch
from launcher.kv_store import KVStoreServer

BLOCKS_PER_BATCH = 32


def _payloads(count: int) -> list[bytes]:
    rng = random.Random(1)
    return [
        encode_batch(
            stored_batch([rng.randrange(100_000) for _ in range(BLOCK * BLOCKS_PER_BATCH)])[1]
        )
        for _ in range(count)
    ]


def _publisher(pods: int, urls: Any, stop: Any, rate: float) -> None:
    """Bind ``pods`` PUB sockets, send their URLs, publish round-robin at ``rate`` batches per
    second until ``stop``.  Paced, not flat out: a spinning publisher took a core the replicas
    then could not use, and what the replicas cannot take is dropped at the sockets anyway."""
    import zmq

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, max(soft, 4 * pods + 256)), hard))
    context = zmq.Context()
    sockets = []
    for _ in range(pods):
        sock = context.socket(zmq.PUB)
        sock.setsockopt(zmq.SNDHWM, 1000)
        port = sock.bind_to_random_port("tcp://127.0.0.1")
        sockets.append((sock, f"tcp://127.0.0.1:{port}"))
    urls.put([url for _, url in sockets])
    payloads = _payloads(64)
    seqs = [0] * pods
    i = 0
    start = time.monotonic()
    while not stop.is_set():
        for p, (sock, _) in enumerate(sockets):
            sock.send_multipart(
                [b"", seqs[p].to_bytes(8, "big"), payloads[i % len(payloads)]], copy=False
            )
            seqs[p] += 1
            i += 1
            if i % 64 == 0 and (ahead := start + i / rate - time.monotonic()) > 0:
                time.sleep(ahead)
    for sock, _ in sockets:
        sock.close(linger=0)
    context.term()


def _replica(address: str, urls: list[str], seconds: float, out: Any, ready: Any) -> None:
    asyncio.run(_replica_run(address, urls, seconds, out, ready))


async def _replica_run(address: str, urls: list[str], seconds: float, out: Any, ready: Any) -> None:
    from kvcache.settings import KVCacheSettings
    from kvcache.views import KVCacheViews
    from scorers.base import Endpoint

    views = KVCacheViews()
    settings = KVCacheSettings.model_validate(
        {
            "blockSize": BLOCK,
            "kvBlockIndexConfig": {"redisConfig": {"address": address, "namespace": "bench"}},
        }
    )
    view = views.view(settings)
    await views.start()
    for i, url in enumerate(urls):
        views.endpoint_added(Endpoint(address=f"10.{i // 250}.{i % 250}.1:8000", kv_events_url=url))
    ready.put(True)
    await asyncio.sleep(6.0)  # leases settle (default 3 s lease), subscriptions join
    store = view._store  # a benchmark reads the writer's counters
    assert store is not None
    owned = view._ownership.owned if view._ownership is not None else set()
    events0, writes0 = _events(view), store.writes_total
    cpu0, t0 = time.process_time(), time.monotonic()
    await asyncio.sleep(seconds)
    events1, writes1 = _events(view), store.writes_total
    cpu1, t1 = time.process_time(), time.monotonic()
    out.put(
        {
            "owned": len(owned),
            "ingested_per_s": (events1 - events0) / (t1 - t0),
            "written_per_s": (writes1 - writes0) / (t1 - t0),
            "cpu": (cpu1 - cpu0) / (t1 - t0),
        }
    )
    await views.stop()


def _events(view: Any) -> int:
    stats = view.subscriber_stats  # a fresh sum over the feeds at each read
    return int(stats.events) if stats is not None else 0


def _server_cpu(address: str) -> float:
    import valkey

    client = valkey.Valkey.from_url(address)
    try:
        info = cast(dict[str, Any], client.info("cpu"))
        return float(info["used_cpu_user"]) + float(info["used_cpu_sys"])
    finally:
        client.close()  # type: ignore[no-untyped-call]


def run(replicas: int, pods: int, seconds: float, offered: float) -> dict[str, Any]:
    ctx = multiprocessing.get_context("spawn")
    with tempfile.TemporaryDirectory() as tmp, KVStoreServer(Path(tmp)) as server:
        urls_q, stop = ctx.Queue(), ctx.Event()
        # Daemons: a failure here must not leave a publisher spinning or the parent waiting.
        publisher = ctx.Process(
            target=_publisher,
            args=(pods, urls_q, stop, offered / BLOCKS_PER_BATCH),
            daemon=True,
        )
        publisher.start()
        procs: list[Any] = []
        try:
            urls = urls_q.get(timeout=60)
            out, ready = ctx.Queue(), ctx.Queue()
            procs = [
                ctx.Process(
                    target=_replica, args=(server.address, urls, seconds, out, ready), daemon=True
                )
                for _ in range(replicas)
            ]
            for proc in procs:
                proc.start()
            for _ in procs:
                ready.get(timeout=120)
            time.sleep(6.0)  # as the replicas do, before they measure
            cpu0, t0 = _server_cpu(server.address), time.monotonic()
            time.sleep(seconds)
            server_cores = (_server_cpu(server.address) - cpu0) / (time.monotonic() - t0)
            results = [out.get(timeout=seconds + 120) for _ in procs]
        finally:
            stop.set()
            for proc in procs:
                proc.join(30)
            publisher.join(30)
    return {
        "replicas": replicas,
        "pods": pods,
        "ingested_block_events_per_s": BLOCKS_PER_BATCH * sum(r["ingested_per_s"] for r in results),
        "written_block_events_per_s": BLOCKS_PER_BATCH * sum(r["written_per_s"] for r in results),
        "server_cpu_cores": server_cores,
        "per_replica": [
            {
                "owned_pods": r["owned"],
                "written_block_events_per_s": BLOCKS_PER_BATCH * r["written_per_s"],
                "cpu_cores": r["cpu"],
            }
            for r in results
        ],
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--replicas", default="1,2,4")
    parser.add_argument("--pods", default="100,1000")
    parser.add_argument("--seconds", type=float, default=8.0)
    parser.add_argument(
        "--offered",
        type=float,
        default=500_000,
        help="block events per second the pods publish, in all (more than the replicas take)",
    )
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    rows = []
    print(
        f"{'pods':>6} {'replicas':>8} {'ingested/s':>12} {'written/s':>12} {'server':>7}  "
        "per replica (pods owned, written block events/s, cpu cores)"
    )
    for pods in [int(p) for p in args.pods.split(",")]:
        for replicas in [int(r) for r in args.replicas.split(",")]:
            row = run(replicas, pods, args.seconds, args.offered)
            rows.append(row)
            each = ", ".join(
                f"({r['owned_pods']}, {r['written_block_events_per_s']:,.0f}, {r['cpu_cores']:.2f})"
                for r in row["per_replica"]
            )
            print(
                f"{pods:>6} {replicas:>8} {row['ingested_block_events_per_s']:>12,.0f} "
                f"{row['written_block_events_per_s']:>12,.0f} {row['server_cpu_cores']:>7.2f}  {each}"
            )
    write_json(args.json, {"command": command_line("benchmarks.kvreplicas", argv), "rows": rows})


if __name__ == "__main__":
    main()
