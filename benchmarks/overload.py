"""Overload: what the EPP's admission control does when more traffic arrives than the pods serve.

    python -m benchmarks.overload                    # 2 pods, 2x their capacity, 30 s per policy
    python -m benchmarks.overload --overload 1.5 --seconds 20 --json out.json
    python -m benchmarks.overload --priorities       # two priorities, four tenants

The same simulated pods (real processes, behind real Envoy) take the same open-loop Poisson
traffic under several EPP configurations, one after the other (the EPP restarted between them,
the pods drained):

* ``none``: no admission control; every request goes to a pod and queues there;
* ``flow-control``: llm-d-router's flow control (``featureGates: [flowControl]``) with a
  ``concurrency-detector`` of ``maxConcurrency`` = the pods' ``--max-num-seqs`` (what a pod
  runs at once: the fleet states it, nothing is tuned here), default TTL;
* ``flow-control-ttl``: the same with ``defaultRequestTTL`` = ``--slo``: a request that cannot
  start within the TTFT goal is refused (429 ``rejected-ttl-expired``) instead of served late;
* ``flow-control-ttl-rr``: the same with ``round-robin-fairness-policy`` in every band (flows
  take turns) instead of the default ``global-strict-fairness-policy`` (the oldest request of
  the band first, whoever sent it);
* ``in-flight-limit``: ``--max-in-flight-per-endpoint`` = the same, ``--admission-mode queue``.

The pods' capacity is measured first: a closed loop of ``max-num-seqs`` × pods concurrent
requests for a few seconds.  The offered rate is ``--overload`` × that.  Requests stream; the
client measures time to first token.  Reported per policy: requests sent, answered 200,
refused (429/503, by reason), TTFT p50/p90/p99 of the answered ones, and goodput: requests per
second answered within ``--slo`` seconds of TTFT.

``--priorities``: llm-d-router's question of flow control, priorities and tenants.  The EPP
finds its pods the way it does in a cluster: ``epp serve --pool-name`` against a Kubernetes API,
here the loopback one (`launcher.kube_api`) holding an InferencePool, the simulated pods as its
Pods (each on a loopback address of its own, all on the same target port, as pods of a cluster)
and two InferenceObjectives: ``interactive`` (``--high-priority``, 10) and ``batch``
(``--low-priority``, 0; a negative one makes batch *sheddable*, refused by the
utilization-detector rule even without flow control).  Each request names one of them
(``x-gateway-inference-objective``; ``--interactive-share`` of them interactive) and its
tenant (``x-llm-d-inference-fairness-id``: its flow within the band's queue); tenants send
at unequal rates (``--tenant-weights``, default 5:2:2:1: one heavy tenant with half the
traffic).  Reported per policy:

* goodput of each band: its requests answered with TTFT within ``--slo`` (the same goal for
  both bands), per second;
* TTFT p99 of each band's answered requests (the client's view; it bounds the queue time from
  above for every policy, the pod's queue included);
* queue p99 of each band: the EPP's own measure of the time from a request's arrival in flow
  control to its dispatch, from ``llm_d_epp_flow_control_request_queue_duration_seconds``
  (outcome ``Dispatched``, the run's increase) on the EPP's ``/metrics``, interpolated within
  the histogram's bucket as Prometheus' ``histogram_quantile`` does.  Upstream's buckets are
  coarse above 1 s (2.5, 5, 10, 30, 60): with a 2 s TTL a p99 in (1, 2.5] can read above 2 s
  although no dispatched request waited that long (the JSON keeps the buckets).  ``-`` for
  policies without flow control: the EPP does not queue (``none``) or does not measure its
  queue (``in-flight-limit``); TTFT bounds it there;
* fairness between tenants, two ways.  Each tenant's *share* is its goodput over its offered
  rate (both bands); ``share min``/``max`` are the smallest and largest over tenants
  (proportional fairness: equal when the heavy tenant is slowed as much as the light ones).
  ``jain`` is Jain's index of x_t = goodput_t / fair_t, where fair_t is the tenant's max-min
  fair share of the run's total goodput given the tenants' offered rates (Jain, Chiu and Hawe
  1984, §3: throughput over the fair throughput): 1 when every tenant gets its max-min share
  (a light tenant its whole demand, the others equal parts of the rest), lower when the heavy
  tenant takes more than its share at the light ones' expense;
* refusals by reason, and per tenant: offered rate, goodput per band, share.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import math
import os
import random
import re
import socket
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Final

import aiohttp

from benchmarks.replay import percentile
from benchmarks.reports import command_line, write_json
from epp.llmd_metrics import FAIRNESS_HEADERS
from indexer.tokenizer_assets import build_llama3_tokenizer_dir
from launcher.kube_api import KubeApiThread, write_kubeconfig
from launcher.observe import metric, scrape, wait_for
from launcher.ports import reserve_port
from launcher.processes import (
    EppPorts,
    PodPorts,
    epp_command,
    pod_command,
    start_loopback_envoy,
    wait_http,
)
from launcher.stack import MODEL, Pod, Replica, Stack
from launcher.traffic import words

BASE_CONFIG = """\
apiVersion: llm-d.ai/v1alpha1
kind: EndpointPickerConfig
{extra}plugins:
- type: queue-scorer
{plugins}schedulingProfiles:
- name: default
  plugins:
  - pluginRef: queue-scorer
"""
POLICIES: Final = "none,flow-control,flow-control-ttl,in-flight-limit"
PRIORITY_POLICIES: Final = "none,flow-control,flow-control-ttl,flow-control-ttl-rr"

# --priorities: the InferencePool the EPP serves and what selects its pods.
POOL: Final = "overload-pool"
POD_LABELS: Final = {"app": "sim-vllm"}
OBJECTIVE_HEADER: Final = "x-gateway-inference-objective"  # `epp.request_rules`
FAIRNESS_HEADER: Final = FAIRNESS_HEADERS[0]  # x-llm-d-inference-fairness-id
HIGH, LOW = "interactive", "batch"  # the InferenceObjectives, one per band
QUEUE_HISTOGRAM: Final = "llm_d_epp_flow_control_request_queue_duration_seconds"


def configs(concurrency: int, slo: float) -> dict[str, tuple[str, list[str]]]:
    """policy → (EndpointPickerConfig, extra `epp serve` flags)."""

    def flow(ttl: str, band: str = "") -> str:
        return BASE_CONFIG.format(
            extra="featureGates: [flowControl]\nflowControl:\n"
            "  saturationDetector: {pluginRef: concurrency-detector}\n"
            f"  defaultRequestTTL: {ttl}\n{band}",
            plugins="- type: concurrency-detector\n"
            f"  parameters: {{maxConcurrency: {concurrency}}}\n",
        )

    plain = BASE_CONFIG.format(extra="", plugins="")
    limit = [
        "--max-in-flight-per-endpoint",
        str(concurrency),
        "--admission-mode",
        "queue",
        "--max-queue-wait",
        "60s",
    ]
    ttl = f"{round(slo * 1000)}ms"
    round_robin = "  defaultPriorityBand: {fairnessPolicyRef: round-robin-fairness-policy}\n"
    return {
        "none": (plain, []),
        "flow-control": (flow("60s"), []),
        "flow-control-ttl": (flow(ttl), []),
        "flow-control-ttl-rr": (flow(ttl, round_robin), []),
        "in-flight-limit": (plain, limit),
    }


# ---------------------------------------------------------------------------------------------
# Traffic


@dataclass(slots=True, frozen=True)
class Arrival:
    """One request of the open loop: its prompt number and, with ``--priorities``, who sends
    it at which objective."""

    n: int
    tenant: str = ""
    band: str = ""  # HIGH or LOW
    headers: Mapping[str, str] = field(default_factory=dict)


@dataclass(slots=True, frozen=True)
class Mix:
    """The ``--priorities`` traffic: tenants (fairness ids) by weight, a share of interactive
    requests, the two objectives' priorities."""

    tenants: tuple[tuple[str, float], ...]
    interactive_share: float
    high_priority: int
    low_priority: int

    def __post_init__(self) -> None:
        if not self.tenants or any(w <= 0 for _, w in self.tenants):
            raise ValueError(f"--tenant-weights: positive weights needed, got {self.tenants}")
        if not 0 < self.interactive_share < 1:
            raise ValueError(f"--interactive-share must be in (0, 1), got {self.interactive_share}")
        if self.high_priority <= self.low_priority:
            raise ValueError(
                f"--high-priority {self.high_priority} must exceed --low-priority "
                f"{self.low_priority}"
            )

    @property
    def objectives(self) -> dict[str, int]:
        return {HIGH: self.high_priority, LOW: self.low_priority}

    def draw(self, rng: random.Random, n: int) -> Arrival:
        names = [t for t, _ in self.tenants]
        tenant = rng.choices(names, weights=[w for _, w in self.tenants])[0]
        band = HIGH if rng.random() < self.interactive_share else LOW
        headers = {OBJECTIVE_HEADER: band, FAIRNESS_HEADER: tenant}
        return Arrival(n, tenant, band, headers)


@dataclass(slots=True, frozen=True)
class Result:
    status: int
    ttft: float | None
    reason: str
    tenant: str = ""
    band: str = ""


async def one(
    session: aiohttp.ClientSession, gateway: str, arrival: Arrival, tokens: int
) -> Result:
    n = arrival.n
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": f"request {n}: " + words(n, 120)}],
        "max_tokens": tokens,
        "stream": True,
    }
    who = (arrival.tenant, arrival.band)  # the report's grouping
    started = time.monotonic()
    try:
        async with session.post(
            f"{gateway}/v1/chat/completions",
            json=body,
            headers=dict(arrival.headers),
            timeout=aiohttp.ClientTimeout(total=120),
        ) as resp:
            reason = resp.headers.get("x-llm-d-request-dropped-reason") or resp.headers.get(
                "x-epp-request-dropped-reason", ""
            )
            if resp.status != 200:
                await resp.read()
                return Result(resp.status, None, reason or str(resp.status), *who)
            first: float | None = None
            async for _ in resp.content.iter_any():
                if first is None:
                    first = time.monotonic() - started
            return Result(200, first, "", *who)
    except (aiohttp.ClientError, TimeoutError):
        return Result(0, None, "connection", *who)


async def closed_loop(gateway: str, workers: int, seconds: float, tokens: int) -> float:
    """Requests per second the pods complete with ``workers`` always in flight."""
    done = 0
    deadline = time.monotonic() + seconds
    async with aiohttp.ClientSession() as session:

        async def worker(w: int) -> None:
            nonlocal done
            n = w * 100_000
            while time.monotonic() < deadline:
                result = await one(session, gateway, Arrival(n), tokens)
                n += 1
                done += result.status == 200

        await asyncio.gather(*(worker(w) for w in range(workers)))
    return done / seconds


async def open_loop(
    gateway: str, rate: float, seconds: float, tokens: int, seed: int, mix: Mix | None = None
) -> list[Result]:
    """Poisson arrivals at ``rate`` for ``seconds``; the arrival times depend on ``seed`` only,
    so every policy (and both scenarios) sees the same ones."""
    rng = random.Random(seed)
    choose = random.Random(f"mix-{seed}")
    tasks = []
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        t = time.monotonic()
        end = t + seconds
        n = 0
        while True:
            t += rng.expovariate(rate)
            if t >= end:
                break
            await asyncio.sleep(max(0.0, t - time.monotonic()))
            number = 1_000_000 + n
            arrival = mix.draw(choose, number) if mix is not None else Arrival(number)
            tasks.append(asyncio.create_task(one(session, gateway, arrival, tokens)))
            n += 1
        return list(await asyncio.gather(*tasks))


async def drained(stack: Stack, timeout: float = 120.0) -> None:
    """Until no pod runs or queues anything."""
    deadline = time.monotonic() + timeout
    async with aiohttp.ClientSession() as session:
        while time.monotonic() < deadline:
            busy = 0.0
            for pod in stack.pods:
                async with session.get(f"http://{pod.address}/metrics") as r:
                    for line in (await r.text()).splitlines():
                        if line.startswith(
                            ("vllm:num_requests_running", "vllm:num_requests_waiting")
                        ):
                            busy += float(line.rsplit(" ", 1)[1])
            if busy == 0:
                return
            await asyncio.sleep(0.2)


# ---------------------------------------------------------------------------------------------
# The fleet: a static endpoints file, or an InferencePool in the loopback Kubernetes API


@contextlib.contextmanager
def _kubeconfig_environment(kubeconfig: Path) -> Iterator[None]:
    """``$KUBECONFIG`` for the processes started meanwhile (`launcher.processes.spawn` passes
    this process's environment on), without the in-cluster variables that would win over it."""
    keys = [k for k in os.environ if k.startswith("KUBERNETES_")] + ["KUBECONFIG"]
    saved = {k: os.environ.pop(k, None) for k in keys}
    os.environ["KUBECONFIG"] = str(kubeconfig)
    try:
        yield
    finally:
        for key, value in saved.items():
            os.environ.pop(key, None)
            if value is not None:
                os.environ[key] = value


def _port_free_on(hosts: Sequence[str]) -> int:
    """A port free on every one of ``hosts``: pods of a pool share their target port."""
    while True:
        port = reserve_port()
        try:
            for host in hosts:
                with socket.socket() as sock:
                    sock.bind((host, port))
            return port
        except OSError:
            continue


@contextlib.contextmanager
def pool_stack(
    work: Path,
    tokenizer: Path,
    *,
    pods: int,
    pod_args: Sequence[str],
    config: str,
    epp_args: Sequence[str],
    objectives: Mapping[str, int],
) -> Iterator[tuple[Stack, list[str]]]:
    """Simulated pods on 127.0.0.2, .3, ... (one target port), published as the Pods of an
    InferencePool with ``objectives`` (name → priority) in the loopback Kubernetes API; one
    ``epp serve --pool-name`` reading them through a kubeconfig; Envoy in front.  Yields the
    stack and the EPP's arguments without ``epp_args`` (a policy's own flags go after them)."""
    hosts = [f"127.0.0.{2 + i}" for i in range(pods)]
    http, pub, replay = (_port_free_on(hosts) for _ in range(3))
    stack = Stack(work=work, tokenizer_dir=tokenizer)
    with contextlib.ExitStack() as cleanup:  # stopped in reverse: the stack, $KUBECONFIG, the API
        kube = cleanup.enter_context(KubeApiThread())
        kubeconfig = write_kubeconfig(work / "kubeconfig", kube.url)
        cleanup.enter_context(_kubeconfig_environment(kubeconfig))
        cleanup.callback(stack.stop)
        for i, host in enumerate(hosts):
            at = PodPorts(http, pub, replay, host)
            options = [*pod_args, "--log-level", "warning"]
            command = pod_command(at, model=MODEL, tokenizer=tokenizer, seed=i, options=options)
            stack.pods.append(Pod(i, at, command, work / f"pod-{i}.log"))
            stack.start_pod(i, wait=False)
        for pod in stack.pods:
            assert pod.proc is not None
            asyncio.run(wait_http(f"http://{pod.address}/health", pod.proc, pod.log))
        kube.call(kube.server.put_pool, POOL, match_labels=POD_LABELS, ports=[http])
        for pod in stack.pods:
            name = f"sim-vllm-{pod.index}"
            kube.call(kube.server.put_pod, name, labels=POD_LABELS, ip=pod.ports.host)
        for name, priority in objectives.items():
            kube.call(kube.server.put_objective, name, priority, pool=POOL)
        stack.config_path.write_text(config)
        base = [
            "--pool-name", POOL, "--pool-namespace", "default",
            "--kv-events-port", str(pub), "--kv-events-replay-port", str(replay),
            "--config-file", str(stack.config_path),
            "--drain-timeout", "10s", "--drain-quiet-period", "1s",
        ]  # fmt: skip
        ports = EppPorts.free()
        args = epp_command(ports, [*base, *epp_args], log_level="warning")
        stack.replicas.append(Replica(ports, args, work / "epp.log"))
        stack.start_replica(0)
        stack.envoy = start_loopback_envoy(
            ports.grpc, work, log_level="error", expose_upstream_host=True, message_timeout_s=30
        )
        yield stack, args[: len(args) - len(epp_args)]


def discovered(stack: Stack, objectives: Mapping[str, int], timeout: float = 30.0) -> None:
    """Until the EPP serves every pod of the pool and applies every objective's priority: it
    is started (and restarted between policies) before the Kubernetes watches have listed.  A
    probe request per objective whose priority is not the default 0 shows it, in the
    ``priority`` label of ``llm_d_epp_request_total``."""
    wait_for(
        lambda: metric(scrape(stack.metrics_url), "inference_pool_ready_pods") == len(stack.pods),
        "the pool's pods discovered",
        timeout,
    )

    async def probe(objective: str, priority: int) -> bool:
        arrival = Arrival(0, "probe", objective, {OBJECTIVE_HEADER: objective})
        async with aiohttp.ClientSession() as session:
            await one(session, stack.gateway, arrival, 1)
        text = scrape(stack.metrics_url)
        return metric(text, "llm_d_epp_request_total", priority=str(priority)) > 0

    for objective, priority in objectives.items():
        deadline = time.monotonic() + timeout
        while priority != 0 and not asyncio.run(probe(objective, priority)):
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"InferenceObjective {objective} (priority {priority}) not applied by the EPP "
                    f"after {timeout:g} s; its log:\n{stack.logs()}"
                )
            time.sleep(0.2)


@contextlib.contextmanager
def fleet(
    args: argparse.Namespace,
    work: Path,
    tokenizer: Path,
    first: tuple[str, list[str]],
    mix: Mix | None,
) -> Iterator[tuple[Stack, list[str]]]:
    """The stack for the scenario, under the first policy's configuration, and the EPP's
    arguments without that policy's flags."""
    pod_args = ["--speedup", str(args.speedup), "--max-num-seqs", str(args.max_num_seqs)]
    config, extra = first
    if mix is not None:
        with pool_stack(
            work, tokenizer, pods=args.pods, pod_args=pod_args, config=config,
            epp_args=extra, objectives=mix.objectives,
        ) as started:  # fmt: skip
            yield started
        return
    with Stack.start(
        work, tokenizer, pods=args.pods, pod_args=pod_args, config=config,
        epp_args=extra, model=MODEL,
    ) as stack:  # fmt: skip
        base = list(stack.replicas[0].args)
        yield stack, base[: len(base) - len(extra)]


# ---------------------------------------------------------------------------------------------
# Summaries


@dataclass(slots=True, frozen=True)
class Row:
    policy: str
    sent: int
    ok: int
    refused: dict[str, int]
    ttft_p50: float
    ttft_p90: float
    ttft_p99: float
    goodput: float  # answered within the SLO, per second


def summarize(policy: str, results: Sequence[Result], seconds: float, slo: float) -> Row:
    ttfts = [r.ttft for r in results if r.status == 200 and r.ttft is not None]
    refused = Counter(r.reason for r in results if r.status != 200)
    return Row(
        policy=policy,
        sent=len(results),
        ok=len(ttfts),
        refused=dict(refused),
        ttft_p50=percentile(ttfts, 50),
        ttft_p90=percentile(ttfts, 90),
        ttft_p99=percentile(ttfts, 99),
        goodput=sum(t <= slo for t in ttfts) / seconds,
    )


def max_min_fair(demands: Mapping[str, float], total: float) -> dict[str, float]:
    """Max-min fair split of ``total`` among ``demands`` (water-filling): no one gets more than
    it asked for, and what a small demand leaves is split evenly among the larger ones."""
    fair: dict[str, float] = {}
    left = total
    ordered = sorted(demands.items(), key=lambda kv: kv[1])
    for i, (name, demand) in enumerate(ordered):
        fair[name] = min(demand, left / (len(ordered) - i))
        left -= fair[name]
    return fair


def jain_index(values: Sequence[float]) -> float:
    """(Σx)² / (n·Σx²): 1 when all equal, 1/n when one gets everything; NaN for no values or
    all zero."""
    squares = sum(x * x for x in values)
    if not values or squares == 0:
        return math.nan
    return sum(values) ** 2 / (len(values) * squares)


_LABEL = re.compile(r'(\w+)="([^"]*)"')


def histogram_buckets(text: str, name: str, **labels: str) -> dict[float, float]:
    """Upper bound → cumulative count of histogram ``name`` on a Prometheus page, summed over
    the series whose labels include ``labels``."""
    buckets: dict[float, float] = {}
    prefix = f"{name}_bucket{{"
    for line in text.splitlines():
        if not line.startswith(prefix):
            continue
        head, _, value = line.rpartition(" ")
        found = dict(_LABEL.findall(head))
        if all(found.get(k) == v for k, v in labels.items()):
            le = float(found["le"])
            buckets[le] = buckets.get(le, 0.0) + float(value)
    return buckets


def histogram_quantile(q: float, buckets: Mapping[float, float]) -> float | None:
    """Prometheus' ``histogram_quantile``: linear within the bucket holding the rank; the
    largest finite bound when it falls in ``+Inf``; None for an empty histogram."""
    ordered = sorted(buckets.items())
    if not ordered or ordered[-1][1] <= 0:
        return None
    rank = q * ordered[-1][1]
    low, below = 0.0, 0.0
    for le, count in ordered:
        if count >= rank:
            if math.isinf(le):
                return low
            return low + (le - low) * (rank - below) / (count - below)
        low, below = le, count
    return low


@dataclass(slots=True, frozen=True)
class TenantRow:
    tenant: str
    offered: float  # requests sent per second
    goodput_high: float  # interactive requests answered within the SLO, per second
    goodput_low: float
    share: float  # (goodput_high + goodput_low) / offered
    fair: float  # its max-min fair share of the run's total goodput, per second


@dataclass(slots=True, frozen=True)
class PriorityRow:
    policy: str
    sent: int
    ok: int
    refused: dict[str, int]
    refused_by_band: dict[str, dict[str, int]]
    goodput_high: float
    goodput_low: float
    ttft_p99_high: float
    ttft_p99_low: float
    queue_p99_high: float | None  # flow control's histogram; None: no EPP queue measured
    queue_p99_low: float | None
    queue_buckets: dict[str, dict[str, float]]  # band → upper bound → dispatched requests
    jain: float
    share_min: float
    share_max: float
    tenants: tuple[TenantRow, ...]


def queue_increase(before: str, after: str, priority: int) -> dict[float, float]:
    """Flow control's queue-time histogram for ``priority``'s dispatched requests: how much
    each bucket grew between two scrapes of the same EPP process (empty without flow
    control)."""
    labels = {"priority": str(priority), "outcome": "Dispatched"}
    start = histogram_buckets(before, QUEUE_HISTOGRAM, **labels)
    end = histogram_buckets(after, QUEUE_HISTOGRAM, **labels)
    return {le: n - start.get(le, 0.0) for le, n in end.items()}


def summarize_priorities(
    policy: str,
    results: Sequence[Result],
    seconds: float,
    slo: float,
    mix: Mix,
    queue: Mapping[str, Mapping[float, float]],
) -> PriorityRow:
    """``queue``: band → its queue-time histogram over the run (`queue_increase`)."""

    def good(r: Result) -> bool:
        return r.status == 200 and r.ttft is not None and r.ttft <= slo

    def ttft_p99(band: str) -> float:
        return percentile(
            [r.ttft for r in results if r.band == band and r.status == 200 and r.ttft is not None],
            99,
        )

    by_band: dict[str, Counter[str]] = {HIGH: Counter(), LOW: Counter()}
    for r in results:
        if r.status != 200:
            by_band[r.band][r.reason] += 1
    offered = {t: sum(r.tenant == t for r in results) / seconds for t, _ in mix.tenants}
    goodput = {
        (t, band): sum(r.tenant == t and r.band == band and good(r) for r in results) / seconds
        for t, _ in mix.tenants
        for band in (HIGH, LOW)
    }
    served = {t: goodput[t, HIGH] + goodput[t, LOW] for t in offered}
    fair = max_min_fair(offered, sum(served.values()))
    tenants = tuple(
        TenantRow(
            tenant=t,
            offered=offered[t],
            goodput_high=goodput[t, HIGH],
            goodput_low=goodput[t, LOW],
            share=served[t] / offered[t] if offered[t] else math.nan,
            fair=fair[t],
        )
        for t in offered
    )
    shares = [row.share for row in tenants if offered[row.tenant]]
    return PriorityRow(
        policy=policy,
        sent=len(results),
        ok=sum(r.status == 200 for r in results),
        refused=dict(by_band[HIGH] + by_band[LOW]),
        refused_by_band={band: dict(c) for band, c in by_band.items()},
        goodput_high=sum(goodput[t, HIGH] for t in offered),
        goodput_low=sum(goodput[t, LOW] for t in offered),
        ttft_p99_high=ttft_p99(HIGH),
        ttft_p99_low=ttft_p99(LOW),
        queue_p99_high=histogram_quantile(0.99, queue.get(HIGH, {})),
        queue_p99_low=histogram_quantile(0.99, queue.get(LOW, {})),
        queue_buckets={
            band: {str(le): n for le, n in sorted(buckets.items())}
            for band, buckets in queue.items()
        },
        jain=jain_index([served[t] / fair[t] for t in offered if fair[t] > 0]),
        share_min=min(shares, default=math.nan),
        share_max=max(shares, default=math.nan),
        tenants=tenants,
    )


# ---------------------------------------------------------------------------------------------
# Tables


def format_table(rows: Sequence[Row]) -> str:
    header = (
        f"{'policy':<16} {'sent':>5} {'200':>5} {'refused':<34} "
        f"{'ttft p50':>9} {'p90':>7} {'p99':>7} {'goodput/s':>9}"
    )
    lines = [header, "-" * len(header)]
    for r in rows:
        refused = ", ".join(f"{k} {v}" for k, v in sorted(r.refused.items())) or "-"
        lines.append(
            f"{r.policy:<16} {r.sent:>5} {r.ok:>5} {refused:<34} {r.ttft_p50:>9.2f} "
            f"{r.ttft_p90:>7.2f} {r.ttft_p99:>7.2f} {r.goodput:>9.2f}"
        )
    return "\n".join(lines)


def _seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def format_priority_table(rows: Sequence[PriorityRow]) -> str:
    """One line per policy; hi = interactive, lo = batch."""
    header = (
        f"{'policy':<20} {'sent':>5} {'200':>5} {'refused (band:reason)':<34} {'good/s hi':>9} {'lo':>6} "
        f"{'ttft p99 hi':>11} {'lo':>6} {'queue p99 hi':>12} {'lo':>6} {'jain':>5} "
        f"{'share min':>9} {'max':>5}"
    )
    lines = [header, "-" * len(header)]
    for r in rows:
        refused = ", ".join(
            f"{'hi' if band == HIGH else 'lo'}:{reason} {n}"
            for band, reasons in r.refused_by_band.items()
            for reason, n in sorted(reasons.items())
        )
        lines.append(
            f"{r.policy:<20} {r.sent:>5} {r.ok:>5} {refused or '-':<34} {r.goodput_high:>9.2f} "
            f"{r.goodput_low:>6.2f} {r.ttft_p99_high:>11.2f} {r.ttft_p99_low:>6.2f} "
            f"{_seconds(r.queue_p99_high):>12} {_seconds(r.queue_p99_low):>6} {r.jain:>5.2f} "
            f"{r.share_min:>9.2f} {r.share_max:>5.2f}"
        )
    return "\n".join(lines)


def format_tenant_table(rows: Sequence[PriorityRow]) -> str:
    header = (
        f"{'policy':<20} {'tenant':<10} {'offered/s':>9} {'good/s hi':>9} {'lo':>6} "
        f"{'share':>6} {'fair/s':>6}"
    )
    lines = [header, "-" * len(header)]
    for r in rows:
        for t in r.tenants:
            lines.append(
                f"{r.policy:<20} {t.tenant:<10} {t.offered:>9.2f} {t.goodput_high:>9.2f} "
                f"{t.goodput_low:>6.2f} {t.share:>6.2f} {t.fair:>6.2f}"
            )
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# Command line


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.overload", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--pods", type=int, default=2)
    parser.add_argument("--max-num-seqs", type=int, default=4, help="each pod's batch limit")
    parser.add_argument("--speedup", type=float, default=1.0, help="the pods' --speedup")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--overload", type=float, default=2.0, help="offered / measured capacity")
    parser.add_argument("--seconds", type=float, default=30.0, help="traffic per policy")
    parser.add_argument("--slo", type=float, default=2.0, help="TTFT goal for goodput (s)")
    parser.add_argument(
        "--calibrate-seconds", type=float, default=8.0, help="of the capacity measurement"
    )
    parser.add_argument(
        "--policies",
        help=f"comma-separated (default: {POLICIES}; with --priorities: {PRIORITY_POLICIES})",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path)
    p = parser.add_argument_group("--priorities: two InferenceObjectives, several tenants")
    p.add_argument(
        "--priorities",
        action="store_true",
        help="the EPP on an InferencePool of the loopback Kubernetes API, requests of two "
        "priorities from tenants of unequal rates (module docstring)",
    )
    p.add_argument("--high-priority", type=int, default=10, help="the interactive objective's")
    p.add_argument(
        "--low-priority",
        type=int,
        default=0,
        help="the batch objective's (negative: sheddable, refused when the pool is saturated "
        "even without flow control)",
    )
    p.add_argument("--interactive-share", type=float, default=0.3, help="of the requests")
    p.add_argument(
        "--tenant-weights",
        default="5,2,2,1",
        help="offered rate of each tenant (tenant-a, tenant-b, ...), relative",
    )
    return parser.parse_args(argv)


def mix_of(args: argparse.Namespace) -> Mix | None:
    if not args.priorities:
        return None
    weights = [float(w) for w in args.tenant_weights.split(",") if w.strip()]
    return Mix(
        tenants=tuple((f"tenant-{chr(ord('a') + i)}", w) for i, w in enumerate(weights)),
        interactive_share=args.interactive_share,
        high_priority=args.high_priority,
        low_priority=args.low_priority,
    )


def measure_priorities(
    stack: Stack, policy: str, rate: float, args: argparse.Namespace, mix: Mix
) -> PriorityRow:
    """One policy's run of the ``--priorities`` traffic, the EPP (re)started under it."""
    discovered(stack, mix.objectives)
    before = scrape(stack.metrics_url)
    results = asyncio.run(
        open_loop(stack.gateway, rate, args.seconds, args.max_tokens, args.seed, mix)
    )
    after = scrape(stack.metrics_url)
    queue = {
        band: queue_increase(before, after, priority) for band, priority in mix.objectives.items()
    }
    return summarize_priorities(policy, results, args.seconds, args.slo, mix, queue)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        mix = mix_of(args)
    except ValueError as exc:
        print(f"benchmarks.overload: {exc}", file=sys.stderr)
        return 2
    variants = configs(args.max_num_seqs, args.slo)
    policies = args.policies or (PRIORITY_POLICIES if mix else POLICIES)
    chosen = [p.strip() for p in policies.split(",") if p.strip()]
    unknown = [p for p in chosen if p not in variants]
    if unknown or not chosen:
        print(
            f"benchmarks.overload: unknown policies {unknown}; known: {list(variants)}",
            file=sys.stderr,
        )
        return 2
    rows: list[Row] = []
    priority_rows: list[PriorityRow] = []
    with tempfile.TemporaryDirectory(prefix="overload-") as tmp:
        work = Path(tmp)
        tokenizer = build_llama3_tokenizer_dir(work / "tokenizer")
        with fleet(args, work, tokenizer, variants[chosen[0]], mix) as (stack, base_args):
            if mix is not None:
                discovered(stack, mix.objectives)
            capacity = asyncio.run(
                closed_loop(
                    stack.gateway,
                    args.pods * args.max_num_seqs,
                    args.calibrate_seconds,
                    args.max_tokens,
                )
            )
            rate = args.overload * capacity
            print(
                f"{args.pods} pods, --max-num-seqs {args.max_num_seqs}, capacity "
                f"{capacity:.1f} req/s measured; offering {rate:.1f} req/s for {args.seconds:g} s "
                "per policy",
                flush=True,
            )
            if mix is not None:
                print(
                    "objectives "
                    + ", ".join(f"{o} priority {p}" for o, p in mix.objectives.items())
                    + f"; {mix.interactive_share:.0%} {HIGH}; tenants "
                    + ", ".join(f"{t} {w:g}" for t, w in mix.tenants),
                    flush=True,
                )
            for i, policy in enumerate(chosen):
                config, extra = variants[policy]
                asyncio.run(drained(stack))
                if i > 0:
                    stack.replicas[0].args = [*base_args, *extra]
                    stack.reconfigure(config)
                if mix is None:
                    results = asyncio.run(
                        open_loop(stack.gateway, rate, args.seconds, args.max_tokens, args.seed)
                    )
                    rows.append(summarize(policy, results, args.seconds, args.slo))
                    print(format_table(rows[-1:]).splitlines()[-1], flush=True)
                    continue
                priority_rows.append(measure_priorities(stack, policy, rate, args, mix))
                print(format_priority_table(priority_rows[-1:]).splitlines()[-1], flush=True)
    report: dict[str, Any] = {
        "command": command_line("benchmarks.overload", argv),
        "capacity_rps": capacity,
        "offered_rps": rate,
    }
    if mix is None:
        print(format_table(rows))
        report["rows"] = [asdict(r) for r in rows]
    else:
        print(format_priority_table(priority_rows))
        print()
        print(format_tenant_table(priority_rows))
        report["scenario"] = "priorities"
        report["mix"] = asdict(mix)
        report["rows"] = [asdict(r) for r in priority_rows]
    write_json(args.json, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
