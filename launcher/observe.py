"""Reading a local stack's state: Prometheus samples, which pods' KV-event streams a replica
owns, a pod's true cache contents (from its own replay buffer), and bounded polling until a
condition holds; and caching a prompt on a pod directly."""

from __future__ import annotations

import json
import time
import urllib.request
from collections.abc import Iterable
from typing import Any

import zmq

from indexer.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    block_key,
    decode_batch,
)
from indexer.hashing import block_hashes
from indexer.index import KVBlockIndex
from launcher.stack import Pod

_END_SEQ = b"\xff" * 8


def metric(text: str, name: str, **labels: str) -> float:
    """Sum of the samples of ``name`` whose labels include ``labels``."""
    total = 0.0
    for line in text.splitlines():
        if not line.startswith(name) or line[len(name) : len(name) + 1] not in ("{", " "):
            continue
        head, _, value = line.rpartition(" ")
        if all(f'{k}="{v}"' in head for k, v in labels.items()):
            total += float(value)
    return total


def scrape(url: str, timeout: float = 5.0) -> str:
    with urllib.request.urlopen(url, timeout=timeout) as resp:
        text: str = resp.read().decode()
        return text


def owned_streams(metrics_url: str, addresses: Iterable[str]) -> set[str]:
    """The pods among ``addresses`` whose KV events the replica serving ``metrics_url`` ingests
    (``inference_extension_kv_stream_owned``, with a shared store)."""
    text = scrape(metrics_url)
    return {a for a in addresses if metric(text, "inference_extension_kv_stream_owned", endpoint=a)}


def cache_on_pod(address: str, model: str, ids: list[int], timeout: float = 30.0) -> None:
    """A one-token completion of ``ids`` sent straight to the pod (no EPP): the pod caches the
    prompt and publishes its blocks."""
    body = json.dumps({"model": model, "prompt": ids, "max_tokens": 1}).encode()
    request = urllib.request.Request(
        f"http://{address}/v1/completions",
        data=body,
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=timeout) as response:
        if response.status != 200:
            raise RuntimeError(f"{address} answered {response.status} to a completion")


def blocks_in_store(client: Any, namespace: str, address: str, ids: list[int]) -> list[bool]:
    """Whether each full block of ``ids`` (a simulated pod's hashing: 16 tokens, ``sha256``)
    is in the shared store's hash for ``address``."""
    keys = block_hashes(ids, block_size=16, algo="sha256")
    values = client.hmget(f"{namespace}:e:{address}", [k.to_bytes(8, "big") for k in keys])
    return [v is not None for v in values]


def true_block_keys(pod: Pod, timeout: float = 5.0) -> set[int]:
    """The block keys the pod's cache really holds (any tier): its whole replay buffer folded,
    stores adding, removals and clears taking away."""
    held: set[int] = set()
    for batch in _replayed(pod, timeout):
        for event in batch.events:
            if isinstance(event, BlockStored):
                held.update(block_key(h) for h in event.block_hashes)
            elif isinstance(event, BlockRemoved):
                held.difference_update(block_key(h) for h in event.block_hashes)
            elif isinstance(event, AllBlocksCleared):
                held.clear()
    return held


def _replayed(pod: Pod, timeout: float) -> list[KVEventBatch]:
    """Every batch in the pod's replay buffer, from seq 0, in order."""
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    dealer = context.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.setsockopt(zmq.RCVTIMEO, int(timeout * 1000))
    batches: list[KVEventBatch] = []
    try:
        dealer.connect(pod.replay_url)
        dealer.send_multipart([b"", (0).to_bytes(8, "big")])
        while True:
            frames = dealer.recv_multipart()
            if frames[-2] == _END_SEQ:
                return batches
            batches.append(decode_batch(frames[-1]))
    finally:
        dealer.close(linger=0)
        context.term()


def true_entries(pod: Pod, timeout: float = 5.0) -> int:
    """The (block, endpoint) entries the pod's cache really holds: its whole replay buffer
    (every batch since it started), folded into a fresh index."""
    index = KVBlockIndex()
    for batch in _replayed(pod, timeout):
        index.apply(pod.address, batch)
    return index.endpoint_stats(pod.address).blocks


def wait_for(condition: Any, what: str, timeout: float = 20.0, interval: float = 0.05) -> float:
    """Poll ``condition()`` until true; returns the seconds it took.  Raises after ``timeout``."""
    started = time.monotonic()
    last_error: Exception | None = None
    while True:
        try:
            if condition():
                return time.monotonic() - started
        except Exception as exc:  # a scrape racing a restart
            last_error = exc
        if time.monotonic() - started > timeout:
            raise AssertionError(f"timed out after {timeout}s waiting for {what} ({last_error})")
        time.sleep(interval)
