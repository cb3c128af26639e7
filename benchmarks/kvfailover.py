"""Failover of KV-event ingestion between EPP replicas on one store: how long a SIGKILLed
replica's pods go unowned, how long until what they cached meanwhile is in the store, and how
many entries are lost.

    python -m benchmarks.kvfailover [--runs 3] [--lease 3.0] [--json OUT]

Each run: a real Redis server (`launcher.kv_store`), four simulated vLLM pods publishing real KV
events with replay buffers, three ``epp serve`` replicas sharing the pods' streams by lease
(``redisConfig.leaseSeconds``, default 3 s).  A client caches a new 64-token prompt on the pods
in turn, one every 50 ms, straight to the pods, for the whole run.  Two seconds in, the replica
owning the most pods is SIGKILLed (no clean hand-over: its lease has to lapse).  Printed:

* ``failover``: kill → every pod owned by a survivor (its metrics, polled every 0.1 s);
* ``caught up``: kill → every prompt cached on the orphaned pods between the kill and the
  failover is in the store (the new owners read them from the pods' replay buffers);
* ``lost``: after the traffic stops and the store settles, the block keys each pod really
  holds (folded from its own replay buffer) that the store lacks for it ("missing"), and those
  the store has for it that the pod does not ("extra"); both must be 0.

Figures are printed, never asserted.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, cast

import valkey

from benchmarks.reports import command_line, write_json
from indexer.tokenizer_assets import build_llama3_tokenizer_dir
from launcher.configs import shared_store_config
from launcher.kv_store import KVStoreServer
from launcher.observe import blocks_in_store, cache_on_pod, owned_streams, true_block_keys, wait_for
from launcher.stack import MODEL, Stack

NAMESPACE = "failover"
PODS = 4
REPLICAS = 3


class _Traffic:
    """New prompts cached on the pods in turn from a thread: (pod address, ids, sent at)."""

    def __init__(self, addresses: list[str], interval: float = 0.05) -> None:
        self.addresses = addresses
        self.interval = interval
        self.sent: list[tuple[str, list[int], float]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> _Traffic:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(30)

    def _run(self) -> None:
        n = 0
        while not self._stop.wait(self.interval):
            address = self.addresses[n % len(self.addresses)]
            ids = [100_000 + 64 * n + t for t in range(64)]
            cache_on_pod(address, MODEL, ids)
            self.sent.append((address, ids, time.monotonic()))
            n += 1


def _held(client: valkey.Valkey, address: str, ids: list[int]) -> bool:
    return all(blocks_in_store(client, NAMESPACE, address, ids))


def run_once(work: Path, tok_dir: Path, lease: float) -> dict[str, Any]:
    with KVStoreServer(work) as server:
        config = shared_store_config(tok_dir, server.address, NAMESPACE, lease)
        client = valkey.Valkey.from_url(server.address)
        with Stack.start(work, tok_dir, pods=PODS, replicas=REPLICAS, config=config) as stack:
            pods = [pod.address for pod in stack.pods]

            def owned(r: int) -> set[str]:
                return owned_streams(stack.replicas[r].metrics_url, pods)

            def shared_out() -> bool:
                sets = [owned(r) for r in range(REPLICAS)]
                return sum(len(s) for s in sets) == PODS and set().union(*sets) == set(pods)

            wait_for(shared_out, "every pod owned by exactly one replica", timeout=60)
            with _Traffic(pods) as traffic:
                time.sleep(2.0)
                victim = max(range(REPLICAS), key=lambda r: len(owned(r)))
                orphans = owned(victim)
                proc = stack.replicas[victim].proc
                assert proc is not None
                proc.kill()
                killed = time.monotonic()
                survivors = [r for r in range(REPLICAS) if r != victim]
                wait_for(
                    lambda: set().union(*(owned(r) for r in survivors)) == set(pods),
                    "the survivors own every pod",
                    timeout=60,
                    interval=0.1,
                )
                failover = time.monotonic() - killed
                gap = [
                    (a, ids) for a, ids, at in list(traffic.sent) if a in orphans and at >= killed
                ]
                wait_for(
                    lambda: all(_held(client, a, ids) for a, ids in gap),
                    "the prompts cached while the pods had no owner",
                    timeout=60,
                    interval=0.05,
                )
                caught_up = time.monotonic() - killed
                time.sleep(2.0)  # the new owners carry on live
            time.sleep(1.0)  # the last writes
            missing = extra = 0
            for pod in stack.pods:
                truth = true_block_keys(pod)
                fields = cast(list[bytes], client.hkeys(f"{NAMESPACE}:e:{pod.address}"))
                stored = {int.from_bytes(f, "big") for f in fields}
                missing += len(truth - stored)
                extra += len(stored - truth)
        client.close()  # type: ignore[no-untyped-call]
    return {
        "orphaned_pods": len(orphans),
        "failover_s": failover,
        "caught_up_s": caught_up,
        "prompts_cached_while_unowned": len(gap),
        "prompts_cached": len(traffic.sent),
        "entries_missing": missing,
        "entries_extra": extra,
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--lease", type=float, default=3.0, help="redisConfig.leaseSeconds")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    rows = []
    print(
        f"{'run':>3} {'orphans':>7} {'failover s':>10} {'caught up s':>11} "
        f"{'prompts (unowned)':>18} {'missing':>7} {'extra':>5}"
    )
    with tempfile.TemporaryDirectory() as tmp:
        tok_dir = build_llama3_tokenizer_dir(Path(tmp) / "tok")
        for i in range(args.runs):
            work = Path(tmp) / f"run-{i}"
            work.mkdir()
            row = run_once(work, tok_dir, args.lease)
            rows.append(row)
            print(
                f"{i + 1:>3} {row['orphaned_pods']:>7} {row['failover_s']:>10.2f} "
                f"{row['caught_up_s']:>11.2f} "
                f"{row['prompts_cached']:>9} ({row['prompts_cached_while_unowned']:>5}) "
                f"{row['entries_missing']:>7} {row['entries_extra']:>5}"
            )
    print(
        f"lease {args.lease:g} s: failover median {statistics.median(r['failover_s'] for r in rows):.2f} s, "
        f"max {max(r['failover_s'] for r in rows):.2f} s; entries lost "
        f"{sum(r['entries_missing'] for r in rows)}"
    )
    write_json(
        args.json,
        {
            "command": command_line("benchmarks.kvfailover", argv),
            "lease_s": args.lease,
            "rows": rows,
        },
    )


if __name__ == "__main__":
    main()
