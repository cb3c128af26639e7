"""One simulated vLLM pod: vLLM's HTTP API, Prometheus metrics and ZMQ KV events around `Engine`.

The edges, and only the edges, live here:

* HTTP (aiohttp): ``/v1/completions`` and ``/v1/chat/completions`` (JSON, or SSE chunks ending in
  ``data: [DONE]``, with a usage chunk when ``stream_options.include_usage``), ``/v1/models``,
  ``/health``, ``/version``, ``/tokenize``, ``/detokenize``, ``/metrics``, ``POST
  /reset_prefix_cache``, and the fault-injection admin endpoints under ``/fault``.
* Tokenization with `indexer.tokenization` (the same files and chat-template rules as vLLM:
  completions add special tokens, chat renders the template and does not add them again), and the
  prompt's block hashes, both in a thread pool so a long prompt never stalls the event loop.
* A driver task that advances the engine in real time: it sleeps until the engine's next step
  ends, or until a new request wakes it.  Engine time is seconds since the pod started; the
  profile's durations are divided by ``--speedup``.
* A publisher thread owning the ZMQ sockets, as vLLM's ``ZmqEventPublisher`` does: PUB frames
  ``[topic, seq (8 bytes BE), payload]`` with seq from 0, and a ROUTER answering replay requests
  (`VLLM-INTEROP.md` §4.4), with a buffer of the last ``buffer_steps`` batches.

Generated text: the simulator has no model; each output token is drawn deterministically from a
pool of common single-token English words, so the text is readable and re-tokenizes to the same
ids when a client sends it back in the next turn.
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import json
import logging
import queue
import random
import threading
import time
import uuid
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Any, Final, Literal

import zmq
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from pydantic import BaseModel, ConfigDict, ValidationError

from indexer.errors import TokenizationError
from indexer.events import KVEventBatch, encode_batch
from indexer.hashing import HashConfig, PrefixHasher
from indexer.tokenization import PromptTokenizer
from simulator.engine import (
    AdvanceResult,
    Engine,
    EngineConfig,
    LoRA,
    RequestOutput,
    RequestRejected,
    RequestStats,
)
from simulator.profiles import Profile

logger = logging.getLogger("simulator")

VLLM_VERSION: Final = "0.33.0"
END_SEQ: Final = (-1).to_bytes(8, "big", signed=True)
COMPLETIONS_DEFAULT_MAX_TOKENS: Final = 16  # OpenAI's and vLLM's default for /v1/completions

# vLLM's buckets (vllm/v1/metrics/loggers.py).
TTFT_BUCKETS: Final = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
    2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
E2E_BUCKETS: Final = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
    60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0,
)  # fmt: skip
ITL_BUCKETS: Final = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
    7.5, 10.0, 20.0, 40.0, 80.0,
)  # fmt: skip

_OUTPUT_WORDS: Final = (
    "the", "of", "and", "to", "in", "a", "is", "that", "for", "it", "as", "with", "was", "on",
    "be", "by", "at", "this", "have", "from", "or", "an", "are", "not", "but", "we", "you",
    "they", "can", "will", "one", "all", "has", "more", "their", "which", "time", "new", "some",
    "about", "so", "what", "when", "there", "would", "been", "like", "out", "up", "into",
    "other", "than", "its", "only", "over", "most", "also", "after", "first", "these", "may",
    "any", "where", "many", "well", "even", "because", "our", "through", "those", "both",
    "each", "much", "under", "same", "very",
)  # fmt: skip


class SimulatorError(Exception):
    """Bad simulator configuration (flags), raised before anything is bound."""


# ---------------------------------------------------------------------------------------------
# Configuration


@dataclass(slots=True, frozen=True)
class FaultConfig:
    """Misbehaviours to inject, for tests of the EPP's failure handling."""

    slow_ms: float = 0.0
    """Extra latency added to every generation request before it reaches the engine."""
    drop_batch_prob: float = 0.0
    """Probability that a KV-event batch is not sent on PUB (it stays in the replay buffer)."""
    drop_seqs: frozenset[int] = frozenset()
    """Sequence numbers whose batches are not sent on PUB (kept for replay), like a lossy PUB."""
    stop_publishing_after: int | None = None
    """Batches with seq >= this are not sent on PUB (still buffered for replay)."""
    seed: int = 0

    def __post_init__(self) -> None:
        if self.slow_ms < 0:
            raise SimulatorError(f"fault slow_ms must be >= 0, got {self.slow_ms}")
        if not 0.0 <= self.drop_batch_prob <= 1.0:
            raise SimulatorError(
                f"fault drop_batch_prob must be within [0, 1], got {self.drop_batch_prob}"
            )
        if self.stop_publishing_after is not None and self.stop_publishing_after < 0:
            raise SimulatorError(
                f"fault stop_publishing_after must be >= 0, got {self.stop_publishing_after}"
            )


@dataclass(slots=True, frozen=True)
class ServerConfig:
    """The pod's edges: addresses, names, event sockets, request defaults."""

    model: str
    host: str = "0.0.0.0"
    port: int = 8000
    pod_address: str | None = None
    """``ip:port`` in the KV-events topic; default ``<host or 127.0.0.1>:<port>``."""
    kv_events_endpoint: str | None = None
    """PUB endpoint.  None: no KV events (vLLM's default)."""
    kv_events_bind: bool | None = None
    """Bind (True) or connect (False) the PUB socket; None applies vLLM's rule: bind for ``*``,
    ``::``, ipc:// and inproc://, else connect (to a central SUB that binds, llm-d's layout)."""
    replay_endpoint: str | None = None
    """ROUTER endpoint for replay (always bound).  None: replay disabled."""
    kv_events_topic: str | None = None
    """Frame 0 of every message; default ``kv@<pod_address>@<model>`` (llm-d's convention)."""
    buffer_steps: int = 10_000
    hwm: int = 100_000
    default_max_tokens: int = 256
    """Chat requests without max_tokens (vLLM would run to EOS, which the simulator lacks)."""
    lora_modules: tuple[tuple[str, str], ...] = ()
    """``--lora-modules name=path``: adapters served under their own model names."""
    faults: FaultConfig = field(default_factory=FaultConfig)
    tokenizer_workers: int = 2
    output_seed: int = 0

    @property
    def topic(self) -> str:
        if self.kv_events_topic is not None:
            return self.kv_events_topic
        return f"kv@{self.advertised_address}@{self.model}"

    @property
    def advertised_address(self) -> str:
        if self.pod_address is not None:
            return self.pod_address
        host = "127.0.0.1" if self.host in ("0.0.0.0", "::", "") else self.host
        return f"{host}:{self.port}"


# ---------------------------------------------------------------------------------------------
# KV-event publisher (a thread owning the ZMQ sockets)


_STOP: Final = object()
_RESTART: Final = object()


@dataclass(slots=True, frozen=True)
class PublisherStats:
    published: int
    dropped: int
    replay_requests: int
    next_seq: int
    buffered: int


class KVEventPublisher:
    """vLLM's ``ZmqEventPublisher`` semantics in a thread, so encoding and sending never run on
    the event loop: `publish` only enqueues.  Faults decide which batches skip the PUB socket;
    every batch is buffered for replay regardless."""

    def __init__(
        self,
        endpoint: str | None,
        replay_endpoint: str | None,
        topic: str,
        *,
        buffer_steps: int = 10_000,
        hwm: int = 100_000,
        faults: FaultConfig | None = None,
        bind: bool | None = None,
    ) -> None:
        if endpoint is None and replay_endpoint is None:
            raise SimulatorError("a publisher needs a PUB endpoint or a replay endpoint")
        if buffer_steps < 1:
            raise SimulatorError(f"buffer_steps must be >= 1, got {buffer_steps}")
        self._endpoint = endpoint
        self._bind = _binds(endpoint) if bind is None and endpoint is not None else bool(bind)
        self._replay_endpoint = replay_endpoint
        self._topic = topic.encode()
        self._buffer_steps = buffer_steps
        self._hwm = hwm
        self._faults = faults or FaultConfig()
        self._rng = random.Random(self._faults.seed)
        self._ctx = zmq.Context()
        self._queue: queue.SimpleQueue[object] = queue.SimpleQueue()
        self._wake_address = f"inproc://simulator-publisher-{uuid.uuid4().hex}"
        self._wake: zmq.Socket[bytes] | None = None
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="kv-event-publisher", daemon=True)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self._seq = 0
        self._published = 0
        self._dropped = 0
        self._replays = 0

    def start(self) -> None:
        """Bind/connect the sockets in the publisher thread; raises if that fails."""
        self._thread.start()
        self._ready.wait()
        if self._error is not None:
            raise SimulatorError(f"KV-event sockets: {self._error}") from self._error
        wake: zmq.Socket[bytes] = self._ctx.socket(zmq.PAIR)
        wake.connect(self._wake_address)
        self._wake = wake

    def publish(self, batch: KVEventBatch) -> None:
        self._send(batch)

    def restart(self) -> None:
        """What a vLLM restart looks like on the wire: seq back to 0, replay buffer empty, and
        no AllBlocksCleared."""
        self._send(_RESTART)

    def set_faults(self, faults: FaultConfig) -> None:
        self._send(faults)

    def stats(self) -> PublisherStats:
        return PublisherStats(
            published=self._published,
            dropped=self._dropped,
            replay_requests=self._replays,
            next_seq=self._seq,
            buffered=len(self._buffer),
        )

    def close(self) -> None:
        if self._thread.is_alive():
            self._send(_STOP)
            self._thread.join(timeout=5)
        if self._wake is not None:
            self._wake.close(linger=0)
            self._wake = None
        self._ctx.term()

    def _send(self, item: object) -> None:
        self._queue.put(item)
        if self._wake is not None:
            with contextlib.suppress(zmq.Again):  # a wake-up is already pending
                self._wake.send(b"", zmq.NOBLOCK)

    # -- publisher thread ---------------------------------------------------------------------

    def _run(self) -> None:
        sockets: list[zmq.Socket[bytes]] = []
        try:
            wake = self._ctx.socket(zmq.PAIR)
            sockets.append(wake)
            wake.bind(self._wake_address)
            pub: zmq.Socket[bytes] | None = None
            if self._endpoint is not None:
                pub = self._ctx.socket(zmq.PUB)
                sockets.append(pub)
                pub.setsockopt(zmq.SNDHWM, self._hwm)
                pub.setsockopt(zmq.LINGER, 0)
                if self._bind:
                    pub.bind(self._endpoint)
                else:
                    pub.connect(self._endpoint)
            replay: zmq.Socket[bytes] | None = None
            if self._replay_endpoint is not None:
                replay = self._ctx.socket(zmq.ROUTER)
                sockets.append(replay)
                replay.setsockopt(zmq.SNDHWM, 2 * (self._buffer_steps + 1))
                replay.setsockopt(zmq.LINGER, 0)
                replay.bind(self._replay_endpoint)
        except zmq.ZMQError as exc:
            self._error = exc
            for socket in sockets:
                socket.close(linger=0)
            self._ready.set()
            return
        self._ready.set()
        poller = zmq.Poller()
        poller.register(wake, zmq.POLLIN)
        if replay is not None:
            poller.register(replay, zmq.POLLIN)
        try:
            while True:
                ready = dict(poller.poll())
                if replay is not None and replay in ready:
                    self._serve_replays(replay)
                if wake in ready:
                    with contextlib.suppress(zmq.Again):
                        while True:
                            wake.recv(zmq.NOBLOCK)
                    if not self._drain_queue(pub):
                        return
        finally:
            for socket in sockets:
                socket.close(linger=0)

    def _drain_queue(self, pub: zmq.Socket[bytes] | None) -> bool:
        while True:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                return True
            if item is _STOP:
                return False
            if item is _RESTART:
                self._seq = 0
                self._buffer.clear()
            elif isinstance(item, FaultConfig):
                self._faults = item
                self._rng = random.Random(item.seed)
            elif isinstance(item, KVEventBatch):
                payload = encode_batch(item)
                seq = self._seq
                self._seq += 1
                self._buffer.append((seq, payload))
                if pub is not None and self._should_send(seq):
                    pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload))
                    self._published += 1
                else:
                    self._dropped += 1

    def _should_send(self, seq: int) -> bool:
        faults = self._faults
        if faults.stop_publishing_after is not None and seq >= faults.stop_publishing_after:
            return False
        if seq in faults.drop_seqs:
            return False
        return not (faults.drop_batch_prob and self._rng.random() < faults.drop_batch_prob)

    def _serve_replays(self, replay: zmq.Socket[bytes]) -> None:
        # vLLM's `_service_replay`: [client, b"", start_seq] → every buffered batch with
        # seq >= start as [client, b"", topic, seq, payload], then the end marker.
        while True:
            try:
                frames = replay.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            if len(frames) != 3 or len(frames[2]) != 8:
                logger.warning("ignoring a malformed replay request of %d frames", len(frames))
                continue
            client, _, start_bytes = frames
            start = int.from_bytes(start_bytes, "big")
            self._replays += 1
            for seq, payload in self._buffer:
                if seq >= start:
                    replay.send_multipart(
                        (client, b"", self._topic, seq.to_bytes(8, "big"), payload)
                    )
            replay.send_multipart((client, b"", b"", END_SEQ, b""))


def _binds(endpoint: str) -> bool:
    """vLLM's rule (``ZmqEventPublisher``): bind for wildcards and local transports."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


# ---------------------------------------------------------------------------------------------
# Request bodies (untrusted input: validated with pydantic)


class _StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow")
    include_usage: bool = False
    continuous_usage_stats: bool = False


class _GenerationBody(BaseModel):
    model_config = ConfigDict(extra="allow")
    model: str | None = None
    max_tokens: int | None = None
    stream: bool = False
    stream_options: _StreamOptions | None = None
    n: int = 1
    cache_salt: str | None = None


class CompletionBody(_GenerationBody):
    prompt: str | list[int] | list[str] | list[list[int]]
    add_special_tokens: bool = True


class ChatBody(_GenerationBody):
    messages: list[dict[str, Any]]
    max_completion_tokens: int | None = None
    tools: list[dict[str, Any]] | None = None
    documents: list[dict[str, Any]] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    reasoning_effort: str | None = None
    add_special_tokens: bool = False


class TokenizeBody(BaseModel):
    model_config = ConfigDict(extra="allow")
    model: str | None = None
    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    tools: list[dict[str, Any]] | None = None
    chat_template_kwargs: dict[str, Any] | None = None


class DetokenizeBody(BaseModel):
    model_config = ConfigDict(extra="allow")
    model: str | None = None
    tokens: list[int]


class FaultUpdate(BaseModel):
    model_config = ConfigDict(extra="forbid")
    slow_ms: float | None = None
    drop_batch_prob: float | None = None
    drop_seqs: list[int] | None = None
    stop_publishing_after: int | None = None
    resume_publishing: bool = False


class _HTTPError(Exception):
    def __init__(self, status: int, message: str, kind: str = "BadRequestError") -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.kind = kind


def _error_response(status: int, message: str, kind: str) -> web.Response:
    # vLLM's ErrorResponse (vllm/entrypoints/openai/protocol.py).
    body = {"error": {"message": message, "type": kind, "param": None, "code": status}}
    return web.json_response(body, status=status)


# ---------------------------------------------------------------------------------------------
# Metrics


class _Histogram:
    __slots__ = ("bounds", "counts", "total")

    def __init__(self, bounds: Sequence[float]) -> None:
        self.bounds = tuple(bounds)
        self.counts = [0] * (len(self.bounds) + 1)
        self.total = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.total += value

    def cumulative(self) -> list[tuple[str, float]]:
        out: list[tuple[str, float]] = []
        running = 0
        for bound, count in zip((*map(str, self.bounds), "+Inf"), self.counts, strict=True):
            running += count
            out.append((bound, running))
        return out


@dataclass(slots=True)
class _ServingStats:
    ttft: _Histogram = field(default_factory=lambda: _Histogram(TTFT_BUCKETS))
    e2e: _Histogram = field(default_factory=lambda: _Histogram(E2E_BUCKETS))
    itl: _Histogram = field(default_factory=lambda: _Histogram(ITL_BUCKETS))
    finished: dict[str, int] = field(default_factory=dict)


class _PodCollector:
    """Reads the engine on every scrape, with vLLM 0.33's names and labels (`VLLM-INTEROP` §6)."""

    def __init__(self, pod: SimulatedPod) -> None:
        self._pod = pod

    def collect(self) -> Iterable[Metric]:
        pod = self._pod
        metrics = pod.engine.metrics()
        stats = pod.serving_stats
        names = ["model_name", "engine"]
        values = [pod.config.model, "0"]

        def gauge(name: str, doc: str, value: float) -> Metric:
            family = GaugeMetricFamily(name, doc, labels=names)
            family.add_metric(values, value)
            return family

        def counter(name: str, doc: str, value: float) -> Metric:
            family = CounterMetricFamily(name, doc, labels=names)
            family.add_metric(values, value)
            return family

        def histogram(name: str, doc: str, hist: _Histogram) -> Metric:
            family = HistogramMetricFamily(name, doc, labels=names)
            family.add_metric(values, buckets=hist.cumulative(), sum_value=hist.total)
            return family

        yield gauge(
            "vllm:num_requests_running",
            "Number of requests in model execution batches.",
            metrics.num_requests_running,
        )
        yield gauge(
            "vllm:num_requests_waiting",
            "Number of requests waiting to be processed.",
            metrics.num_requests_waiting,
        )
        yield gauge(
            "vllm:kv_cache_usage_perc",
            "KV-cache usage. 1 means 100 percent usage.",
            metrics.kv_cache_usage,
        )
        yield counter(
            "vllm:prefix_cache_queries",
            "Prefix cache queries, in terms of number of queried tokens.",
            metrics.prefix_cache_queries,
        )
        yield counter(
            "vllm:prefix_cache_hits",
            "Prefix cache hits, in terms of number of cached tokens.",
            metrics.prefix_cache_hits,
        )
        yield counter(
            "vllm:num_preemptions",
            "Cumulative number of preemption from the engine.",
            metrics.num_preemptions,
        )
        yield counter(
            "vllm:prompt_tokens", "Number of prefill tokens processed.", metrics.prompt_tokens
        )
        yield counter(
            "vllm:generation_tokens",
            "Number of generation tokens processed.",
            metrics.generation_tokens,
        )
        success = CounterMetricFamily(
            "vllm:request_success",
            "Count of successfully processed requests.",
            labels=[*names, "finished_reason"],
        )
        for reason in ("stop", "length", "abort"):
            success.add_metric([*values, reason], stats.finished.get(reason, 0))
        yield success
        yield histogram(
            "vllm:time_to_first_token_seconds",
            "Histogram of time to first token in seconds.",
            stats.ttft,
        )
        yield histogram(
            "vllm:e2e_request_latency_seconds",
            "Histogram of e2e request latency in seconds.",
            stats.e2e,
        )
        yield histogram(
            "vllm:inter_token_latency_seconds",
            "Histogram of inter-token latency in seconds.",
            stats.itl,
        )
        engine_config = pod.engine.config
        info = GaugeMetricFamily(
            "vllm:cache_config_info",
            "Information of the LLMEngine CacheConfig",
            labels=[
                "block_size",
                "cache_dtype",
                "enable_prefix_caching",
                "gpu_memory_utilization",
                "hash_block_size",
                "num_cpu_blocks",
                "num_gpu_blocks",
                "prefix_caching_hash_algo",
                "engine",
            ],
        )
        info.add_metric(
            [
                str(engine_config.block_size),
                "auto",
                str(engine_config.enable_prefix_caching),
                "0.9",
                str(engine_config.block_size),
                "None",
                str(engine_config.num_gpu_blocks),
                engine_config.hash_algo,
                "0",
            ],
            1.0,
        )
        yield info
        publisher = pod.publisher
        if publisher is not None:
            pub_stats = publisher.stats()
            yield counter(
                "simulator_kv_event_batches_published",
                "KV-event batches sent on the PUB socket (simulator only).",
                pub_stats.published,
            )
            yield counter(
                "simulator_kv_event_batches_dropped",
                "KV-event batches not sent because of injected faults (simulator only).",
                pub_stats.dropped,
            )


# ---------------------------------------------------------------------------------------------
# The pod


class _Restarted(Exception):
    """The pod restarted (fault injection) while the request was in flight."""


@dataclass(slots=True)
class _InFlight:
    req_id: str
    arrival: float
    outputs: asyncio.Queue[RequestOutput | None] = field(default_factory=asyncio.Queue)
    last_token_time: float | None = None
    finished: bool = False


@dataclass(slots=True, frozen=True)
class _Prompt:
    token_ids: list[int]
    digests: list[bytes] | None


@dataclass(slots=True, frozen=True)
class _OutputVocabulary:
    token_ids: tuple[int, ...]
    text: Mapping[int, str]


def output_vocabulary(tokenizer: PromptTokenizer) -> _OutputVocabulary:
    """Common English words that are one token each (with their leading space)."""
    text: dict[int, str] = {}
    for word in _OUTPUT_WORDS:
        ids = tokenizer.encode_text(" " + word, add_special_tokens=False)
        if len(ids) == 1:
            text[ids[0]] = " " + word
    if len(text) < 8:
        raise SimulatorError(
            f"tokenizer {tokenizer.name!r} encodes too few common English words as one token "
            f"({len(text)}); the simulator needs at least 8 for its generated text"
        )
    return _OutputVocabulary(tuple(text), text)


_Handler = Callable[["SimulatedPod", web.Request], Awaitable[web.StreamResponse]]


def _handles_errors(handler: _Handler) -> _Handler:
    """Map the request-level exceptions to vLLM's error bodies."""

    async def wrapped(pod: SimulatedPod, request: web.Request) -> web.StreamResponse:
        try:
            return await handler(pod, request)
        except _HTTPError as exc:
            return _error_response(exc.status, exc.message, exc.kind)
        except _Restarted:
            return _error_response(
                503, "the engine restarted while serving this request", "ServiceUnavailable"
            )

    return wrapped


class SimulatedPod:
    """One simulated vLLM pod.  ``await start()``, then serve until ``await stop()``."""

    def __init__(
        self,
        config: ServerConfig,
        engine_config: EngineConfig,
        profile: Profile,
        tokenizer: PromptTokenizer,
        *,
        decode: Callable[[list[int]], str] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = config
        self._tokenizer = tokenizer
        self._decode = decode
        self._vocabulary = output_vocabulary(tokenizer)
        self._engine_config = replace(
            engine_config,
            output_token_pool=self._vocabulary.token_ids,
            output_seed=config.output_seed,
        )
        self._profile = profile
        self.engine = Engine(self._engine_config, profile)
        self._hash_config = HashConfig(
            block_size=engine_config.block_size,
            algo=engine_config.hash_algo,
            seed=engine_config.hash_seed,
        )
        self._loras = {
            name: LoRA(name, path, index)
            for index, (name, path) in enumerate(config.lora_modules, start=1)
        }
        self._faults = config.faults
        self.serving_stats = _ServingStats()
        self._clock = clock
        self._epoch = clock()
        self._inflight: dict[str, _InFlight] = {}
        self._executor = ThreadPoolExecutor(
            max_workers=config.tokenizer_workers, thread_name_prefix="tokenize"
        )
        self._local = threading.local()
        self._wake = asyncio.Event()
        self._driver: asyncio.Task[None] | None = None
        self._runner: web.AppRunner | None = None
        self.publisher: KVEventPublisher | None = None
        if config.kv_events_endpoint is not None or config.replay_endpoint is not None:
            self.publisher = KVEventPublisher(
                config.kv_events_endpoint,
                config.replay_endpoint,
                config.topic,
                buffer_steps=config.buffer_steps,
                hwm=config.hwm,
                faults=config.faults,
                bind=config.kv_events_bind,
            )
        self._registry = CollectorRegistry(auto_describe=False)
        self._registry.register(_PodCollector(self))
        self._created = int(time.time())

    # -- lifecycle ----------------------------------------------------------------------------

    def app(self) -> web.Application:
        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.add_routes(
            [
                web.post("/v1/completions", self._completions),
                web.post("/v1/chat/completions", self._chat),
                web.get("/v1/models", self._models),
                web.get("/health", self._health),
                web.get("/ping", self._health),
                web.get("/version", self._version),
                web.post("/tokenize", self._tokenize),
                web.post("/detokenize", self._detokenize),
                web.get("/metrics", self._metrics),
                web.post("/reset_prefix_cache", self._reset_prefix_cache),
                web.get("/fault", self._fault_status),
                web.post("/fault/config", self._fault_config),
                web.post("/fault/restart", self._fault_restart),
            ]
        )
        return app

    async def start(self) -> None:
        if self.publisher is not None:
            await asyncio.get_running_loop().run_in_executor(None, self.publisher.start)
        self._driver = asyncio.create_task(self._drive(), name="engine-driver")
        self._runner = web.AppRunner(self.app(), access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.config.host, self.config.port)
        await site.start()

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
        if self._driver is not None:
            self._driver.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._driver
        if self.publisher is not None:
            self.publisher.close()
        self._executor.shutdown(wait=False, cancel_futures=True)

    def now(self) -> float:
        """Engine time: seconds since the pod (re)started."""
        return self._clock() - self._epoch

    # -- engine driving -----------------------------------------------------------------------

    async def _drive(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            self._wake.clear()
            engine = self.engine
            try:
                self._dispatch(engine.advance(self.now()))
            except Exception:
                logger.exception("engine step failed")
                raise
            due = engine.next_event_time()
            timer = None
            if due is not None:
                timer = loop.call_later(max(0.0, due - self.now()), self._wake.set)
            await self._wake.wait()
            if timer is not None:
                timer.cancel()

    def _dispatch(self, result: AdvanceResult) -> None:
        stats = self.serving_stats
        for out in result.outputs.values():
            flight = self._inflight.get(out.req_id)
            if flight is None:
                continue
            if out.first_token_time is not None:
                stats.ttft.observe(out.first_token_time - flight.arrival)
            if out.num_new_tokens:
                # Tokens that arrive together share the interval since the previous output.
                previous = flight.last_token_time
                gaps = out.num_new_tokens if previous is not None else out.num_new_tokens - 1
                if previous is None and out.first_token_time is not None:
                    previous = out.first_token_time
                if previous is not None and gaps > 0:
                    gap = (out.last_token_time - previous) / gaps
                    for _ in range(gaps):
                        stats.itl.observe(gap)
                flight.last_token_time = out.last_token_time
            if out.stats is not None:
                flight.finished = True
                stats.e2e.observe(out.stats.e2e_latency)
                stats.finished[out.stats.finish_reason] = (
                    stats.finished.get(out.stats.finish_reason, 0) + 1
                )
                del self._inflight[out.req_id]
            flight.outputs.put_nowait(out)
        if self.publisher is not None:
            for batch in result.kv_batches:
                # vLLM stamps a batch with time.time() when the scheduler step hands it over.
                self.publisher.publish(replace(batch, ts=time.time()))

    def _submit(
        self,
        prompt: _Prompt,
        max_tokens: int,
        *,
        cache_salt: str | None,
        lora: LoRA | None,
        prefix: str,
    ) -> _InFlight:
        req_id = f"{prefix}-{uuid.uuid4().hex}"
        now = self.now()
        try:
            self.engine.add_request(
                req_id,
                prompt.token_ids,
                max_tokens,
                now,
                cache_salt=cache_salt,
                lora=lora,
                block_digests=prompt.digests,
            )
        except RequestRejected as exc:
            raise _HTTPError(400, str(exc)) from exc
        flight = _InFlight(req_id, now)
        self._inflight[req_id] = flight
        self._wake.set()
        return flight

    async def _outputs(self, flight: _InFlight) -> AsyncIterator[RequestOutput]:
        """The request's outputs until it finishes; aborts it if the client goes away."""
        try:
            while True:
                out = await flight.outputs.get()
                if out is None:
                    raise _Restarted
                yield out
                if out.stats is not None:
                    return
        finally:
            if not flight.finished and self._inflight.pop(flight.req_id, None) is not None:
                self.engine.abort(flight.req_id, self.now())
                self.serving_stats.finished["abort"] = (
                    self.serving_stats.finished.get("abort", 0) + 1
                )
                self._wake.set()

    # -- prompts ------------------------------------------------------------------------------

    def _hasher(self) -> PrefixHasher:
        hasher: PrefixHasher | None = getattr(self._local, "hasher", None)
        if hasher is None:
            hasher = PrefixHasher(self._hash_config, cache_blocks=50_000)
            self._local.hasher = hasher
        return hasher

    def _prepare(
        self, encode: Callable[[], list[int]], cache_salt: str | None, lora: LoRA | None
    ) -> _Prompt:
        """Runs in the thread pool: tokenize, then hash the full blocks as the pod would."""
        token_ids = encode()
        if not self._engine_config.enable_prefix_caching:
            return _Prompt(token_ids, None)
        digests = self._hasher().digests(
            token_ids,
            lora_name=lora.name if lora else None,
            lora_path=lora.path if lora else None,
            cache_salt=cache_salt,
        )
        return _Prompt(token_ids, digests)

    async def _run_prepare(
        self, encode: Callable[[], list[int]], cache_salt: str | None, lora: LoRA | None
    ) -> _Prompt:
        loop = asyncio.get_running_loop()
        try:
            return await loop.run_in_executor(
                self._executor, self._prepare, encode, cache_salt, lora
            )
        except TokenizationError as exc:
            raise _HTTPError(400, str(exc)) from exc

    def _resolve_model(self, requested: str | None) -> tuple[str, LoRA | None]:
        if requested is None or requested == self.config.model:
            return self.config.model, None
        lora = self._loras.get(requested)
        if lora is None:
            raise _HTTPError(404, f"The model `{requested}` does not exist.", "NotFoundError")
        return requested, lora

    # -- HTTP handlers ------------------------------------------------------------------------

    async def _body(self, request: web.Request, model: type[BaseModel]) -> Any:
        try:
            raw = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise _HTTPError(400, f"the request body is not valid JSON: {exc}") from exc
        try:
            return model.model_validate(raw)
        except ValidationError as exc:
            problems = "; ".join(
                f"{'.'.join(map(str, e['loc'])) or 'body'}: {e['msg']}" for e in exc.errors()
            )
            raise _HTTPError(400, problems) from exc

    @_handles_errors
    async def _completions(self, request: web.Request) -> web.StreamResponse:
        body: CompletionBody = await self._body(request, CompletionBody)
        model, lora = self._resolve_model(body.model)
        prompt = _single_prompt(body.prompt)
        self._check_generation(body)
        tokenizer = self._tokenizer

        def encode() -> list[int]:
            return tokenizer.encode_completion(prompt, add_special_tokens=body.add_special_tokens)

        prepared = await self._run_prepare(encode, body.cache_salt, lora)
        max_tokens = body.max_tokens or COMPLETIONS_DEFAULT_MAX_TOKENS
        await self._inject_latency()
        flight = self._submit(
            prepared, max_tokens, cache_salt=body.cache_salt, lora=lora, prefix="cmpl"
        )
        if body.stream:
            return await self._stream(request, flight, model, "completion", body.stream_options)
        return await self._respond(flight, model, "completion")

    @_handles_errors
    async def _chat(self, request: web.Request) -> web.StreamResponse:
        body: ChatBody = await self._body(request, ChatBody)
        model, lora = self._resolve_model(body.model)
        self._check_generation(body)
        tokenizer = self._tokenizer

        def encode() -> list[int]:
            return tokenizer.encode_chat(
                body.messages,
                tools=body.tools,
                documents=body.documents,
                chat_template_kwargs=body.chat_template_kwargs,
                add_generation_prompt=body.add_generation_prompt,
                continue_final_message=body.continue_final_message,
                reasoning_effort=body.reasoning_effort,
                add_special_tokens=body.add_special_tokens,
            )

        prepared = await self._run_prepare(encode, body.cache_salt, lora)
        requested = body.max_completion_tokens or body.max_tokens
        room = self._engine_config.max_model_len - len(prepared.token_ids)
        max_tokens = requested or max(1, min(self.config.default_max_tokens, room))
        await self._inject_latency()
        flight = self._submit(
            prepared, max_tokens, cache_salt=body.cache_salt, lora=lora, prefix="chatcmpl"
        )
        if body.stream:
            return await self._stream(request, flight, model, "chat", body.stream_options)
        return await self._respond(flight, model, "chat")

    def _check_generation(self, body: _GenerationBody) -> None:
        if body.n != 1:
            raise _HTTPError(400, f"n={body.n}: the simulator generates one choice per request")
        if body.max_tokens is not None and body.max_tokens < 1:
            raise _HTTPError(400, f"max_tokens must be at least 1, got {body.max_tokens}")

    async def _inject_latency(self) -> None:
        if self._faults.slow_ms > 0:
            await asyncio.sleep(self._faults.slow_ms / 1000)

    def _text(self, token_ids: Sequence[int]) -> str:
        text = self._vocabulary.text
        return "".join(text.get(t, "") for t in token_ids)

    async def _respond(
        self, flight: _InFlight, model: str, kind: Literal["completion", "chat"]
    ) -> web.Response:
        token_ids: list[int] = []
        stats: RequestStats | None = None
        async for out in self._outputs(flight):
            token_ids += out.new_token_ids
            stats = out.stats
        assert stats is not None
        text = self._text(token_ids)
        created = int(time.time())
        if kind == "completion":
            body: dict[str, Any] = {
                "id": flight.req_id,
                "object": "text_completion",
                "created": created,
                "model": model,
                "choices": [
                    {
                        "index": 0,
                        "text": text,
                        "logprobs": None,
                        "finish_reason": "length",
                        "stop_reason": None,
                        "prompt_logprobs": None,
                    }
                ],
                "usage": _usage(stats),
                "system_fingerprint": None,
                "kv_transfer_params": None,
            }
        else:
            body = {
                "id": flight.req_id,
                "object": "chat.completion",
                "created": created,
                "model": model,
                "choices": [
                    {
                        "index": 0,
                        "message": {
                            "role": "assistant",
                            "content": text,
                            "refusal": None,
                            "annotations": None,
                            "audio": None,
                            "function_call": None,
                            "tool_calls": [],
                            "reasoning_content": None,
                        },
                        "logprobs": None,
                        "finish_reason": "length",
                        "stop_reason": None,
                    }
                ],
                "service_tier": None,
                "system_fingerprint": None,
                "usage": _usage(stats),
                "prompt_logprobs": None,
                "kv_transfer_params": None,
            }
        return web.json_response(body)

    async def _stream(
        self,
        request: web.Request,
        flight: _InFlight,
        model: str,
        kind: Literal["completion", "chat"],
        options: _StreamOptions | None,
    ) -> web.StreamResponse:
        response = web.StreamResponse(
            headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
        )
        await response.prepare(request)
        created = int(time.time())
        include_usage = options is not None and options.include_usage
        continuous = include_usage and options is not None and options.continuous_usage_stats
        obj = "text_completion" if kind == "completion" else "chat.completion.chunk"

        def chunk(choices: list[dict[str, Any]], usage: dict[str, Any] | None = None) -> bytes:
            data: dict[str, Any] = {
                "id": flight.req_id,
                "object": obj,
                "created": created,
                "model": model,
                "choices": choices,
            }
            if usage is not None:
                data["usage"] = usage
            return b"data: " + json.dumps(data, separators=(",", ":")).encode() + b"\n\n"

        try:
            # vLLM's chat stream sends the role chunk on the engine's first output, i.e. with
            # the first token, not when the request is accepted: a proxy or EPP that takes the
            # first body byte for the end of prefill must see it then.
            role_pending = kind == "chat"
            completion_tokens = 0
            stats: RequestStats | None = None
            async for out in self._outputs(flight):
                if role_pending:
                    role_pending = False
                    first = {
                        "index": 0,
                        "delta": {"role": "assistant", "content": ""},
                        "logprobs": None,
                        "finish_reason": None,
                    }
                    await response.write(chunk([first]))
                completion_tokens += out.num_new_tokens
                stats = out.stats
                finish = "length" if out.stats is not None else None
                text = self._text(out.new_token_ids)
                if kind == "completion":
                    choice: dict[str, Any] = {
                        "index": 0,
                        "text": text,
                        "logprobs": None,
                        "finish_reason": finish,
                        "stop_reason": None,
                    }
                else:
                    choice = {
                        "index": 0,
                        "delta": {"content": text},
                        "logprobs": None,
                        "finish_reason": finish,
                    }
                    if finish is not None:
                        choice["stop_reason"] = None
                usage = None
                if continuous:
                    current = stats or self.engine.request_stats(flight.req_id)
                    if current is not None:
                        usage = _usage(current, completion_tokens)
                await response.write(chunk([choice], usage))
            if include_usage and stats is not None:
                await response.write(chunk([], _usage(stats)))
            await response.write(b"data: [DONE]\n\n")
            await response.write_eof()
        except _Restarted:
            # A restarted pod drops its connections: end the stream without [DONE].
            if request.transport is not None:
                request.transport.close()
        return response

    async def _models(self, request: web.Request) -> web.Response:
        base = self.config.model
        max_len = self._engine_config.max_model_len

        def card(model_id: str, root: str, parent: str | None) -> dict[str, Any]:
            return {
                "id": model_id,
                "object": "model",
                "created": self._created,
                "owned_by": "vllm",
                "root": root,
                "parent": parent,
                "max_model_len": max_len if parent is None else None,
                "permission": [],
            }

        data = [card(base, base, None)]
        data += [card(lora.name, lora.path, base) for lora in self._loras.values()]
        return web.json_response({"object": "list", "data": data})

    async def _health(self, request: web.Request) -> web.Response:
        return web.Response(status=200)

    async def _version(self, request: web.Request) -> web.Response:
        return web.json_response({"version": VLLM_VERSION, "simulator": True})

    @_handles_errors
    async def _tokenize(self, request: web.Request) -> web.Response:
        body: TokenizeBody = await self._body(request, TokenizeBody)
        self._resolve_model(body.model)
        tokenizer = self._tokenizer
        if (body.prompt is None) == (body.messages is None):
            raise _HTTPError(400, "give exactly one of `prompt` or `messages`")

        def encode() -> list[int]:
            if body.messages is not None:
                return tokenizer.encode_chat(
                    body.messages,
                    tools=body.tools,
                    chat_template_kwargs=body.chat_template_kwargs,
                    add_generation_prompt=body.add_generation_prompt,
                    continue_final_message=body.continue_final_message,
                    add_special_tokens=bool(body.add_special_tokens),
                )
            assert body.prompt is not None
            special = True if body.add_special_tokens is None else body.add_special_tokens
            return tokenizer.encode_completion(body.prompt, add_special_tokens=special)

        loop = asyncio.get_running_loop()
        try:
            tokens = await loop.run_in_executor(self._executor, encode)
        except TokenizationError as exc:
            raise _HTTPError(400, str(exc)) from exc
        return web.json_response(
            {
                "count": len(tokens),
                "max_model_len": self._engine_config.max_model_len,
                "tokens": tokens,
                "token_strs": None,
            }
        )

    @_handles_errors
    async def _detokenize(self, request: web.Request) -> web.Response:
        body: DetokenizeBody = await self._body(request, DetokenizeBody)
        self._resolve_model(body.model)
        text = self._vocabulary.text
        if all(t in text for t in body.tokens):
            return web.json_response({"prompt": self._text(body.tokens)})
        if self._decode is None:
            raise _HTTPError(400, "this pod has no decoder for ids outside its output words")
        return web.json_response({"prompt": self._decode(body.tokens)})

    async def _metrics(self, request: web.Request) -> web.Response:
        # A busy vLLM answers /metrics late (its API server also streams every response).
        m = self.engine.metrics()
        await asyncio.sleep(
            self._profile.metrics_latency(m.num_requests_running + m.num_requests_waiting)
        )
        payload = generate_latest(self._registry)
        return web.Response(body=payload, headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def _reset_prefix_cache(self, request: web.Request) -> web.Response:
        if not self.engine.reset_prefix_cache():
            return _error_response(
                409,
                "cannot reset the prefix cache while requests hold KV blocks (vLLM refuses too); "
                "retry when the pod is idle",
                "ConflictError",
            )
        batch = self.engine.take_events(self.now())
        if batch is not None and self.publisher is not None:
            self.publisher.publish(replace(batch, ts=time.time()))
        return web.Response(status=200)

    async def _fault_status(self, request: web.Request) -> web.Response:
        faults = self._faults
        body: dict[str, Any] = {
            "slow_ms": faults.slow_ms,
            "drop_batch_prob": faults.drop_batch_prob,
            "drop_seqs": sorted(faults.drop_seqs),
            "stop_publishing_after": faults.stop_publishing_after,
        }
        if self.publisher is not None:
            stats = self.publisher.stats()
            body["publisher"] = {
                "published": stats.published,
                "dropped": stats.dropped,
                "replay_requests": stats.replay_requests,
                "next_seq": stats.next_seq,
                "buffered": stats.buffered,
            }
        return web.json_response(body)

    @_handles_errors
    async def _fault_config(self, request: web.Request) -> web.Response:
        update: FaultUpdate = await self._body(request, FaultUpdate)
        faults = self._faults
        changes: dict[str, Any] = {}
        if update.slow_ms is not None:
            changes["slow_ms"] = update.slow_ms
        if update.drop_batch_prob is not None:
            changes["drop_batch_prob"] = update.drop_batch_prob
        if update.drop_seqs is not None:
            changes["drop_seqs"] = frozenset(update.drop_seqs)
        if update.stop_publishing_after is not None:
            changes["stop_publishing_after"] = update.stop_publishing_after
        if update.resume_publishing:
            changes["stop_publishing_after"] = None
        try:
            self._faults = replace(faults, **changes)
        except SimulatorError as exc:
            raise _HTTPError(400, str(exc)) from exc
        if self.publisher is not None:
            self.publisher.set_faults(self._faults)
        return await self._fault_status(request)

    async def _fault_restart(self, request: web.Request) -> web.Response:
        """A pod restart as the EPP sees it: the cache is empty, in-flight requests fail, metrics
        counters start over, KV-event seq goes back to 0 and no AllBlocksCleared is sent."""
        self.restart()
        return web.json_response({"restarted": True})

    def restart(self) -> None:
        for flight in self._inflight.values():
            flight.outputs.put_nowait(None)
        self._inflight.clear()
        self.engine = Engine(self._engine_config, self._profile)
        self._epoch = self._clock()
        self.serving_stats = _ServingStats()
        if self.publisher is not None:
            self.publisher.restart()
        self._wake.set()


def _single_prompt(prompt: str | list[int] | list[str] | list[list[int]]) -> str | list[int]:
    if isinstance(prompt, str):
        return prompt
    if not prompt:
        raise _HTTPError(400, "prompt must not be empty")
    if all(isinstance(p, int) for p in prompt):
        return [p for p in prompt if isinstance(p, int)]
    if len(prompt) == 1:
        (only,) = prompt
        if isinstance(only, str | list):
            return only
    raise _HTTPError(
        400, f"prompt holds {len(prompt)} prompts; the simulator serves one prompt per request"
    )


def _usage(stats: RequestStats, completion_tokens: int | None = None) -> dict[str, Any]:
    completion = stats.completion_tokens if completion_tokens is None else completion_tokens
    return {
        "prompt_tokens": stats.prompt_tokens,
        "total_tokens": stats.prompt_tokens + completion,
        "completion_tokens": completion,
        "prompt_tokens_details": {"cached_tokens": stats.cached_tokens},
    }
