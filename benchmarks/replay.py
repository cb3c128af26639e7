"""Replay a workload against a simulated fleet in virtual time, routed by the product itself.

The fleet is ``pods`` simulated vLLM engines (`simulator.engine`: continuous batching, chunked
prefill, step timing, a prefix cache with LRU eviction and KV events).  Routing goes through the
real `epp.director.Director`, `epp.datastore.Datastore` and a `epp.scheduler.Scheduler` built
from an ``EndpointPickerConfig``, and every plugin sees only what it would see in production:

* scraped metrics: each pod's ``/metrics`` values (waiting, running, KV usage, block size) as
  the EPP's scraper would read them: a scrape starts every ``scrape_interval`` seconds, or when
  the previous one answered if that took longer, and answers after the profile's
  ``metrics_latency`` (longer the busier the pod: real vLLM renders ``/metrics`` in the process
  that streams every response), with the pod's state at that moment; a decision at time t reads
  the last answer at or before t;
* KV events: each engine step's `KVEventBatch` is handed to the configuration's event sinks
  (the precise scorer's index) ``event_lag`` seconds after the step ended, in order per pod;
* in-flight accounting: the director's own, released at the first token and at the end;
* the clock: plugins, the datastore and the director read the virtual time.

No plugin reads an engine directly.  Time only moves forward: before each arrival the engines
run every step that ends by then (first tokens and completions go back through the director at
their times), scrapes and event deliveries due by then are applied, and the request is routed
and added to the chosen engine at its arrival time.

What is counted, per request, comes from the engine: ``cached_tokens`` (the prefix-cache hit at
its first scheduling, vLLM's ``usage.prompt_tokens_details.cached_tokens``), first-token and
finish times.
"""

from __future__ import annotations

import math
import os
import random
import time
import uuid
from array import array
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

import yaml

from benchmarks.workloads import Workload
from epp.config import build_scheduler, load_config
from epp.datastore import Datastore, EndpointSpec
from epp.director import Director, TrackedDecision
from indexer.events import KVEventBatch
from indexer.subscriber_config import KVEventSink
from scorers.base import EndpointMetrics, LLMRequest, PluginContext, Usage
from scorers.disagg import PREFILLER_HEADER
from scorers.filters import ROLE_LABEL
from simulator.engine import Engine
from simulator.engine_config import EngineConfig
from simulator.engine_outputs import RequestOutput
from simulator.profiles import LLAMA3_8B_H100, Profile

MODEL = "meta-llama/Llama-3.1-8B-Instruct"
PREFILL_LEG = ":prefill"
"""Suffix of a disaggregated request's prefill-leg id on its prefill engine."""


@dataclass(slots=True, frozen=True)
class FleetSpec:
    """The simulated pods and what the EPP observes of them."""

    pods: int = 8
    profile: Profile = LLAMA3_8B_H100
    capacity_tokens: int | None = None
    """KV-cache tokens per pod; None = the profile's (Llama-3.1-8B bf16 on an H100: ~399k)."""
    block_size: int = 16
    """vLLM's default block size; the trace's 512-token blocks are 32 engine blocks each."""
    max_model_len: int = 262_144
    """Above Llama-3.1's 131,072 so that the Mooncake trace's longest prompts (up to 191k
    tokens, ten of them over 131k) are served rather than rejected."""
    scrape_interval: float = 0.05
    """The Inference Extension's metrics refresh interval (50 ms)."""
    event_lag: float = 0.02
    """From the end of an engine step to its KV events reaching the index."""
    roles: tuple[str | None, ...] = ()
    """Per pod, its ``llm-d.ai/role`` ("prefill", "decode"; None or () for aggregated pods).
    A request the EPP disaggregates (``x-prefiller-host-port``) runs one token on its prefill
    pod, then on its decode pod pulling the prompt's KV, as the routing sidecar does."""
    kv_link_gbps: float = 400.0
    """A decode pod's link for KV pulls (Gb/s): a pull takes its tokens × the profile's KV
    bytes per token over this, pulls queued one after another."""
    kv_transfer_latency: float = 0.001
    """Fixed seconds per pull (handshake, completion notice)."""

    def __post_init__(self) -> None:
        if self.roles and len(self.roles) != self.pods:
            raise ValueError(f"{len(self.roles)} roles for {self.pods} pods")
        if "decode" in self.roles and self.profile.kv_bytes_per_token <= 0:
            raise ValueError(
                f"profile {self.profile.name!r} states no KV bytes per token: KV pulls to "
                "decode pods cannot be timed"
            )
        if not self.kv_link_gbps > 0:
            raise ValueError(f"kv_link_gbps must be > 0, got {self.kv_link_gbps}")

    def role(self, pod: int) -> str | None:
        return self.roles[pod] if self.roles else None

    @property
    def capacity(self) -> int:
        return (
            self.capacity_tokens
            if self.capacity_tokens is not None
            else self.profile.kv_capacity_tokens
        )

    @property
    def usable_blocks(self) -> int:
        """Cacheable blocks per pod (vLLM's ``num_gpu_blocks`` minus the null block)."""
        return self.capacity // self.block_size

    def engine_config(
        self, *, emit_events: bool, role: str | None = None, record_token_times: bool = False
    ) -> EngineConfig:
        transfer: dict[str, float] = {}
        if role == "decode":
            bytes_per_s = self.kv_link_gbps * 1e9 / 8
            transfer = {
                "kv_transfer_s_per_token": self.profile.kv_bytes_per_token / bytes_per_s,
                "kv_transfer_latency_s": self.kv_transfer_latency,
            }
        return EngineConfig.from_profile(
            self.profile,
            block_size=self.block_size,
            num_gpu_blocks=self.usable_blocks + 1,
            max_model_len=self.max_model_len,
            emit_events=emit_events,
            record_token_times=record_token_times,
            **transfer,
        )

    def addresses(self) -> list[str]:
        return [f"10.0.{i // 250}.{i % 250 + 1}:8000" for i in range(self.pods)]


@dataclass(slots=True, frozen=True)
class RequestRecord:
    """One finished request, as the engine and the router saw it."""

    request_id: str
    pod: int
    arrival: float
    prompt_tokens: int
    cached_tokens: int
    output_tokens: int
    ttft: float
    finish: float


@dataclass(slots=True)
class ReplayResult:
    policy: str
    records: list[RequestRecord]
    busy_time: list[float]
    """Seconds each pod spent running steps."""
    preemptions: int
    wall_seconds: float
    decisions_per_pod: list[int] = field(default_factory=list)
    inter_token_latencies: list[float] = field(default_factory=list)
    """Seconds between consecutive output tokens of a request (with ``record_itl``)."""
    disaggregated: int = 0
    """Requests prefilled on a prefill pod."""


def percentile(values: Sequence[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default); ``q`` in [0, 100]."""
    if not values:
        return math.nan
    ordered = sorted(values)
    position = (len(ordered) - 1) * q / 100.0
    low = math.floor(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


@dataclass(slots=True, frozen=True)
class PolicySummary:
    """The per-policy numbers the benchmark reports (`--json`)."""

    policy: str
    requests: int
    hit_rate: float
    """Engine-counted cached prompt tokens / prompt tokens."""
    ttft_p50: float
    ttft_p90: float
    ttft_p99: float
    ttft_mean: float
    throughput: float
    """Output tokens per second, first arrival to last finish."""
    max_over_mean_load: float
    """Busiest pod's busy time over the mean pod's."""
    preemptions: int
    wall_seconds: float

    @classmethod
    def of(cls, result: ReplayResult, warmup: float = 0.0) -> PolicySummary:
        """Numbers over the requests that arrived at or after ``warmup`` seconds."""
        records = [r for r in result.records if r.arrival >= warmup] if warmup else result.records
        ttfts = [r.ttft for r in records]
        prompt = sum(r.prompt_tokens for r in records)
        cached = sum(r.cached_tokens for r in records)
        output = sum(r.output_tokens for r in records)
        start = min((r.arrival for r in records), default=0.0)
        end = max((r.finish for r in records), default=0.0)
        mean_busy = sum(result.busy_time) / len(result.busy_time) if result.busy_time else 0.0
        return cls(
            policy=result.policy,
            requests=len(records),
            hit_rate=cached / prompt if prompt else 0.0,
            ttft_p50=percentile(ttfts, 50),
            ttft_p90=percentile(ttfts, 90),
            ttft_p99=percentile(ttfts, 99),
            ttft_mean=sum(ttfts) / len(ttfts) if ttfts else math.nan,
            throughput=output / (end - start) if end > start else 0.0,
            max_over_mean_load=max(result.busy_time) / mean_busy if mean_busy else 1.0,
            preemptions=result.preemptions,
            wall_seconds=result.wall_seconds,
        )


class Replay:
    """One policy over one workload; `run` returns the engine-side record of every request."""

    def __init__(
        self,
        workload: Workload,
        keys: Sequence[array[int]],
        fleet: FleetSpec,
        config_yaml: str,
        *,
        policy: str = "policy",
        seed: int = 0,
        kv_store: str | None = None,
        record_itl: bool = False,
    ) -> None:
        if len(keys) != len(workload.requests):
            raise ValueError("one block-key array per request is needed")
        self.workload = workload
        self.keys = keys
        self.fleet = fleet
        self.policy = policy
        self.now = 0.0
        clock = self._clock
        self.datastore = Datastore(clock=clock)
        self.context = PluginContext(endpoints=self.datastore, clock=clock, rng=random.Random(seed))
        self.kv_store = kv_store
        if kv_store is not None:
            namespace = f"replay-{policy}-{seed}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
            config_yaml = with_kv_store(config_yaml, kv_store, namespace)
        self.scheduler = build_scheduler(load_config(text=config_yaml), self.context)
        self.datastore.add_listener(self.scheduler)
        self.director = Director(self.datastore, self.scheduler)
        # The KV-cache views the configuration's plugins read consume the engines' KV events
        # (`indexer.subscriber_config.KVEventSink`); they learn of endpoints like the scheduler.
        self.datastore.add_listener(self.context.kv_caches)
        self.sinks: list[KVEventSink] = list(self.context.kv_caches)
        self.addresses = fleet.addresses()
        self.engines = [
            Engine(
                fleet.engine_config(
                    emit_events=bool(self.sinks),
                    role=fleet.role(pod),
                    record_token_times=record_itl,
                ),
                fleet.profile,
            )
            for pod in range(len(self.addresses))
        ]
        for pod, address in enumerate(self.addresses):
            role = fleet.role(pod)
            labels = {ROLE_LABEL: role} if role is not None else {}
            self.datastore.upsert(EndpointSpec(address=address, labels=labels))
        self.record_itl = record_itl
        self._itl: list[float] = []
        self._last_token: dict[str, float] = {}
        # P/D: a prefill leg's id → (decode pod, request id, output tokens, keys, prompt tokens).
        self._handoffs: dict[str, tuple[int, str, int, list[int], int]] = {}
        self._prefill_cached: dict[str, int] = {}
        self._arrivals: dict[str, float] = {}
        self._disaggregated = 0
        self._events: list[deque[tuple[float, KVEventBatch]]] = [deque() for _ in self.addresses]
        self._decisions: dict[str, TrackedDecision] = {}
        self._records: list[RequestRecord] = []
        # Per pod: when its scrape in flight started and when it answers.
        self._scrape_started = [0.0] * len(self.addresses)
        self._scrape_answers = [0.0] * len(self.addresses)
        self._per_pod = [0] * len(self.addresses)

    def _clock(self) -> float:
        return self.now

    # -- time ------------------------------------------------------------------------------------

    def _advance(self, t: float) -> None:
        """Bring the fleet and the EPP's inputs to time ``t``."""
        answered = self._scrapes_answered_by(t)
        for when, pod in sorted(answered):
            self._run_engines(when)
            self._scrape(pod, when)
        self._run_engines(t)
        self.now = t
        if self.sinks:
            self._deliver_events(t)

    def advance(self, t: float) -> None:
        """Bring the fleet and the EPP's inputs (scrapes, KV events) to time ``t``: `run` does
        it before each arrival; tests call it to construct a state between decisions."""
        self._advance(t)

    def _run_engines(self, t: float) -> None:
        """Run every engine step that ends by ``t``; hand first tokens and completions to the
        director in time order (the clock reads each one's own time).  A P/D fleet runs event
        by event: a prefill leg's end hands its request to a decode engine at that moment."""
        if not self.fleet.roles:
            self._run_engines_until(t)
            return
        while True:
            due = [w for e in self.engines if (w := e.next_event_time()) is not None and w <= t]
            if not due:
                return
            self._run_engines_until(min(due))

    def _run_engines_until(self, t: float) -> None:
        happened: list[tuple[float, int, int, RequestOutput]] = []
        for pod, engine in enumerate(self.engines):
            next_time = engine.next_event_time()
            if next_time is not None and next_time <= t:
                result = engine.advance(t)
                if result.kv_batches:
                    lag = self.fleet.event_lag
                    self._events[pod].extend((b.ts + lag, b) for b in result.kv_batches)
                for out in result.outputs.values():
                    if self.record_itl and out.token_times:
                        self._inter_token(out.req_id, out.token_times)
                    if out.first_token_time is not None:
                        happened.append((out.first_token_time, 0, pod, out))
                    if out.finished:
                        happened.append((out.last_token_time, 1, pod, out))
        if len(happened) > 1:
            happened.sort(key=lambda item: (item[0], item[1]))
        director = self.director
        for when, finished, pod, out in happened:
            if out.req_id in self._handoffs:
                if finished:
                    self._hand_off(out, when)
                continue
            entry = self._decisions.get(out.req_id)
            if entry is None:
                continue
            self.now = when
            if not finished:
                director.response_chunk(entry)
                continue
            stats = out.stats
            assert stats is not None and stats.first_token_time is not None
            del self._decisions[out.req_id]
            self._last_token.pop(out.req_id, None)
            arrival = self._arrivals.pop(out.req_id, stats.arrival_time)
            # A disaggregated request's cache hit is its prefill pod's (llm-d's sidecar reports
            # that one to the client too).
            cached = self._prefill_cached.pop(out.req_id, stats.cached_tokens)
            director.response_complete(
                entry, Usage(stats.prompt_tokens, stats.completion_tokens, cached), 200
            )
            self._records.append(
                RequestRecord(
                    out.req_id,
                    pod,
                    arrival,
                    stats.prompt_tokens,
                    cached,
                    stats.completion_tokens,
                    stats.first_token_time - arrival,
                    stats.finish_time,
                )
            )

    def _inter_token(self, req_id: str, token_times: Sequence[float]) -> None:
        if req_id in self._handoffs:
            return  # a prefill leg's one token is not the client's
        last = self._last_token.get(req_id)
        for when in token_times:
            if last is not None:
                self._itl.append(when - last)
            last = when
        if last is not None:
            self._last_token[req_id] = last

    def _hand_off(self, out: RequestOutput, when: float) -> None:
        """A prefill leg finished: its request goes to its decode engine, pulling the KV."""
        pod, req_id, output_tokens, keys, prompt_tokens = self._handoffs.pop(out.req_id)
        if out.stats is not None:
            self._prefill_cached[req_id] = out.stats.cached_tokens
        self.engines[pod].add_request(
            req_id,
            None,
            output_tokens,
            when,
            block_keys=keys,
            num_prompt_tokens=prompt_tokens,
            remote_prefill=True,
        )

    def _scrapes_answered_by(self, t: float) -> list[tuple[float, int]]:
        """Per pod, the last scrape answer at or before ``t`` (earlier ones would be overwritten
        before any decision reads them), with the pod's scrape schedule moved past ``t``.  The
        latency of scrapes in between is taken from the pod's state now."""
        interval = self.fleet.scrape_interval
        profile = self.fleet.profile
        out = []
        for pod, engine in enumerate(self.engines):
            answer = self._scrape_answers[pod]
            if answer > t:
                continue
            m = engine.metrics()
            latency = profile.metrics_latency(m.num_requests_running + m.num_requests_waiting)
            # The scraper starts the next scrape `interval` after the last one started, or
            # when it answered if that took longer: one every `step` while latency holds.
            step = max(interval, latency)
            last = answer
            start = max(self._scrape_started[pod] + interval, answer)
            if start + latency <= t:
                start += math.floor((t - start - latency) / step) * step
                last = min(t, start + latency)  # float rounding must not step past t
                start += step
            self._scrape_started[pod] = start
            self._scrape_answers[pod] = start + latency
            out.append((last, pod))
        return out

    def _scrape(self, pod: int, when: float) -> None:
        """What the scraper read from ``pod`` at ``when`` (vLLM's gauges and cache config)."""
        self.now = when
        m = self.engines[pod].metrics()
        self.datastore.update_metrics(
            self.addresses[pod],
            EndpointMetrics(
                waiting_requests=m.num_requests_waiting,
                running_requests=m.num_requests_running,
                kv_cache_usage=m.kv_cache_usage,
                block_size=self.fleet.block_size,
                num_gpu_blocks=self.fleet.usable_blocks + 1,
                updated_at=when,
            ),
        )

    def _deliver_events(self, t: float) -> None:
        sinks = self.sinks
        for address, queue in zip(self.addresses, self._events, strict=True):
            while queue and queue[0][0] <= t:
                _, batch = queue.popleft()
                for sink in sinks:
                    sink.apply(address, batch)

    # -- the run ---------------------------------------------------------------------------------

    async def run(self) -> ReplayResult:
        if self.kv_store is None:
            return await self._run()
        await self.context.kv_caches.start()
        try:
            return await self._run()
        finally:
            await self.context.kv_caches.stop()

    async def _run(self) -> ReplayResult:
        started = time.perf_counter()
        index_of = {address: i for i, address in enumerate(self.addresses)}
        director = self.director
        engines = self.engines
        for pod in range(len(engines)):
            self._scrape(pod, 0.0)
        for request, keys in zip(self.workload.requests, self.keys, strict=True):
            t = request.arrival
            self._advance(t)
            self.now = t
            llm = LLMRequest(
                request_id=request.request_id,
                model=MODEL,
                kind="completions",
                prompt=request.token_ids(),
                stream=True,  # clients stream: the first token is seen when it is produced
            )
            if self.kv_store is not None:
                # The store applies writes on its own thread: let it catch up, so the decision
                # sees the events delivered before it, as with the in-memory index.
                self.context.kv_caches.flush()
            decision = await director.route(llm, None)
            assert isinstance(decision, TrackedDecision)
            pod = index_of[decision.targets[0]]
            self._per_pod[pod] += 1
            self._decisions[request.request_id] = decision
            self._arrivals[request.request_id] = t
            prefiller = llm.set_headers.get(PREFILLER_HEADER)
            if prefiller:
                # The routing sidecar's first leg: one token on the prefill pod.
                leg = request.request_id + PREFILL_LEG
                self._handoffs[leg] = (
                    pod,
                    request.request_id,
                    request.output_length,
                    keys.tolist(),
                    request.input_length,
                )
                self._disaggregated += 1
                pod = index_of[prefiller]
                self._per_pod[pod] += 1
                engines[pod].add_request(
                    leg,
                    None,
                    1,
                    t,
                    block_keys=keys.tolist(),
                    num_prompt_tokens=request.input_length,
                )
                continue
            engines[pod].add_request(
                request.request_id,
                None,
                request.output_length,
                t,
                block_keys=keys.tolist(),
                num_prompt_tokens=request.input_length,
            )
        # Drain: run to the end, tick by tick only as far as outputs need ordering.
        while True:
            pending = [e.next_event_time() for e in engines]
            due = [when for when in pending if when is not None]
            if not due:
                break
            self._run_engines(max(due))
        metrics = [engine.metrics() for engine in engines]
        return ReplayResult(
            policy=self.policy,
            records=self._records,
            busy_time=[m.busy_time for m in metrics],
            preemptions=sum(m.num_preemptions for m in metrics),
            wall_seconds=time.perf_counter() - started,
            decisions_per_pod=list(self._per_pod),
            inter_token_latencies=self._itl,
            disaggregated=self._disaggregated,
        )


def with_kv_store(config_yaml: str, address: str, namespace: str) -> str:
    """``config_yaml`` with every precise prefix scorer keeping its index in the Redis/Valkey
    server at ``address``, under ``namespace`` (``maxIndexEntries`` dropped: it bounds the
    in-memory index only)."""
    config = yaml.safe_load(config_yaml)
    for plugin in config.get("plugins", []):
        if plugin.get("type") == "precise-prefix-cache-scorer":
            params = plugin.setdefault("parameters", {}) or {}
            params.pop("maxIndexEntries", None)
            params["kvBlockIndexConfig"] = {
                "redisConfig": {"address": address, "namespace": namespace}
            }
            plugin["parameters"] = params
    return str(yaml.safe_dump(config, sort_keys=False))
