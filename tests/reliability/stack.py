"""A whole fleet on loopback for fault tests, the soak and the overhead benchmark: simulated vLLM
pods (real processes, real ZMQ, vLLM's wire format), ``epp serve`` replicas (real processes)
and a real Envoy in front, plus the levers to break each of them.

Levers: kill a pod (SIGKILL) and start it again on the same ports, hang it (SIGSTOP/SIGCONT),
restart it in place (``POST /fault/restart``: seq back to 0, cache empty), change its publisher
faults (``POST /fault/config``), put a test-controlled proxy in front of its ``/metrics``
(answering garbage or nothing), point its replay URL at a socket that never answers, restart an
EPP replica.  Observations: the pod that served each request (Envoy's ``x-upstream-host``),
the EPP's Prometheus page, and each pod's true cache contents, folded from its own replay buffer
into a fresh index (the buffer holds every batch since the pod started, up to 10,000).

Every wait is bounded; `Stack.stop` ends every process it started.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import signal
import subprocess
import threading
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import yaml
import zmq
from aiohttp import web

from epp.envoy_bootstrap import UPSTREAM_HOST_HEADER, EnvoyProcess
from indexer.events import decode_batch
from indexer.index import KVBlockIndex
from simulator.launch import (
    EppPorts,
    PodPorts,
    epp_command,
    free_port,
    pod_command,
    spawn,
    start_loopback_envoy,
    stop_process,
    wait_grpc_ready,
    wait_http,
)

MODEL = "rel-llama3"
CONFIG = """\
apiVersion: inference.networking.x-k8s.io/v1alpha1
kind: EndpointPickerConfig
plugins:
- type: precise-prefix-cache-scorer
  parameters: {{tokenizer: "{tokenizer}"}}
- type: queue-scorer
- type: kv-cache-utilization-scorer
schedulingProfiles:
- name: default
  plugins:
  - {{pluginRef: precise-prefix-cache-scorer, weight: 1}}
  - {{pluginRef: queue-scorer, weight: 1}}
  - {{pluginRef: kv-cache-utilization-scorer, weight: 1}}
"""
_END_SEQ = b"\xff" * 8


# ---------------------------------------------------------------------------------------------
# A /metrics proxy the test controls


class MetricsProxy:
    """Forwards ``GET /metrics`` to a pod, or answers ``garbage`` (200, not Prometheus text),
    or ``hang`` (accepts and never answers).  Runs its own loop in a thread."""

    def __init__(self, upstream: str) -> None:
        self.upstream = upstream
        self.mode = "pass"
        self.port = free_port()
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, name="metrics-proxy", daemon=True)
        self._thread.start()
        if not self._ready.wait(10):
            raise RuntimeError("metrics proxy did not start")

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/metrics"

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._loop.run_until_complete(self._start())
        self._ready.set()
        self._loop.run_forever()

    async def _start(self) -> None:
        self._session = aiohttp.ClientSession()
        app = web.Application()
        app.router.add_get("/metrics", self._metrics)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        await web.TCPSite(self._runner, "127.0.0.1", self.port).start()

    async def _metrics(self, _: web.Request) -> web.Response:
        if self.mode == "garbage":
            return web.Response(text="\x00<html>definitely { not prometheus", status=200)
        if self.mode == "hang":
            await asyncio.sleep(3600)
        async with self._session.get(f"http://{self.upstream}/metrics") as resp:
            return web.Response(body=await resp.read(), status=resp.status)

    def stop(self) -> None:
        async def close() -> None:
            current = asyncio.current_task()
            for task in asyncio.all_tasks():
                if task is not current:
                    task.cancel()  # handlers parked in "hang" mode
            await self._runner.cleanup()
            await self._session.close()

        with contextlib.suppress(Exception):
            asyncio.run_coroutine_threadsafe(close(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)


# ---------------------------------------------------------------------------------------------
# Processes


@dataclass
class Pod:
    index: int
    ports: PodPorts
    args: list[str]
    log: Path
    proc: subprocess.Popen[bytes] | None = None
    metrics_proxy: MetricsProxy | None = None
    replay_url_override: str | None = None

    @property
    def address(self) -> str:
        return self.ports.address

    @property
    def replay_url(self) -> str:
        return self.ports.replay_url


@dataclass
class Replica:
    ports: EppPorts
    args: list[str]
    log: Path
    proc: subprocess.Popen[bytes] | None = None

    @property
    def metrics_url(self) -> str:
        return self.ports.metrics_url


@dataclass
class Stack:
    """Pods, EPP replicas and Envoy; see the module docstring."""

    work: Path
    tokenizer_dir: Path
    pods: list[Pod] = field(default_factory=list)
    replicas: list[Replica] = field(default_factory=list)
    envoy: EnvoyProcess | None = None
    silent_router: zmq.Socket[bytes] | None = None
    _zmq: zmq.Context[zmq.Socket[bytes]] | None = None
    _extra_endpoints: list[dict[str, Any]] = field(default_factory=list)

    @classmethod
    def start(
        cls,
        work: Path,
        tokenizer_dir: Path,
        *,
        pods: int = 2,
        replicas: int = 1,
        pod_args: Sequence[str] = (),
        epp_args: Sequence[str] = (),
        metrics_proxies: Iterable[int] = (),
        silent_replay: Iterable[int] = (),
        envoy_health_check_s: float | None = None,
        extproc_tls: bool = False,
        config: str | None = None,
        extra_endpoints: Sequence[dict[str, Any]] = (),
    ) -> Stack:
        """``extra_endpoints``: more entries for the EPP's endpoints file (a rogue publisher)."""
        stack = cls(work=work, tokenizer_dir=tokenizer_dir)
        stack._extra_endpoints = list(extra_endpoints)
        try:
            stack._start(
                pods=pods,
                replicas=replicas,
                pod_args=pod_args,
                epp_args=epp_args,
                metrics_proxies=set(metrics_proxies),
                silent_replay=set(silent_replay),
                envoy_health_check_s=envoy_health_check_s,
                extproc_tls=extproc_tls,
                config=config,
            )
        except BaseException:
            stack.stop()
            raise
        return stack

    def _start(
        self,
        *,
        pods: int,
        replicas: int,
        pod_args: Sequence[str],
        epp_args: Sequence[str],
        metrics_proxies: set[int],
        silent_replay: set[int],
        envoy_health_check_s: float | None,
        extproc_tls: bool,
        config: str | None,
    ) -> None:
        for i in range(pods):
            ports = PodPorts.free()
            options = ["--speedup", "20", "--max-num-seqs", "8", "--log-level", "warning"]
            args = pod_command(
                ports,
                model=MODEL,
                tokenizer=self.tokenizer_dir,
                seed=i,
                options=[*options, *pod_args],
            )
            pod = Pod(i, ports, args, self.work / f"pod-{i}.log")
            self.pods.append(pod)
            self.start_pod(i, wait=False)
        for pod in self.pods:
            assert pod.proc is not None
            asyncio.run(wait_http(f"http://{pod.address}/health", pod.proc, pod.log))
            if pod.index in metrics_proxies:
                pod.metrics_proxy = MetricsProxy(pod.address)
        if silent_replay:
            self._zmq = zmq.Context()
            self.silent_router = self._zmq.socket(zmq.ROUTER)
            self.silent_router.setsockopt(zmq.LINGER, 0)
            port = self.silent_router.bind_to_random_port("tcp://127.0.0.1")
            for i in silent_replay:
                self.pods[i].replay_url_override = f"tcp://127.0.0.1:{port}"
        endpoints = []
        for pod in self.pods:
            entry: dict[str, Any] = {
                "address": pod.address,
                "kvEventsUrl": pod.ports.kv_events_url,
                "replayUrl": pod.replay_url_override or pod.replay_url,
            }
            if pod.metrics_proxy is not None:
                entry["metricsUrl"] = pod.metrics_proxy.url
            endpoints.append(entry)
        endpoints.extend(self._extra_endpoints)
        (self.work / "endpoints.yaml").write_text(yaml.safe_dump(endpoints))
        (self.work / "config.yaml").write_text(
            config or CONFIG.format(tokenizer=self.tokenizer_dir)
        )
        serve_options = [
            "--endpoints-file",
            str(self.work / "endpoints.yaml"),
            "--config-file",
            str(self.work / "config.yaml"),
            "--drain-timeout",
            "10s",
            "--drain-quiet-period",
            "1s",
            *epp_args,
        ]
        for r in range(replicas):
            replica_ports = EppPorts.free()
            args = epp_command(replica_ports, serve_options, log_level="warning")
            self.replicas.append(Replica(replica_ports, args, self.work / f"epp-{r}.log"))
            self.start_replica(r)
        self.envoy = start_loopback_envoy(
            self.replicas[0].ports.grpc,
            self.work,
            log_level="error",
            extproc_endpoints=[("127.0.0.1", r.ports.grpc) for r in self.replicas],
            extproc_health_check_interval_s=envoy_health_check_s,
            extproc_tls=extproc_tls,
            expose_upstream_host=True,
            message_timeout_s=30,
        )

    @property
    def gateway(self) -> str:
        assert self.envoy is not None
        return f"http://127.0.0.1:{self.envoy.listen_port}"

    # -- levers ---------------------------------------------------------------------------------

    def start_pod(self, i: int, *, wait: bool = True) -> None:
        pod = self.pods[i]
        pod.proc = spawn(pod.args, pod.log)
        if wait:
            asyncio.run(wait_http(f"http://{pod.address}/health", pod.proc, pod.log))

    def kill_pod(self, i: int) -> None:
        proc = self.pods[i].proc
        assert proc is not None
        proc.kill()
        proc.wait(10)

    def hang_pod(self, i: int, hung: bool = True) -> None:
        proc = self.pods[i].proc
        assert proc is not None
        proc.send_signal(signal.SIGSTOP if hung else signal.SIGCONT)

    def start_replica(self, r: int) -> None:
        replica = self.replicas[r]
        replica.proc = spawn(replica.args, replica.log)
        wait_grpc_ready(replica.ports.health, replica.proc, replica.log)

    def stop_replica(self, r: int) -> float:
        """SIGTERM and wait for the exit; returns how long the drain took."""
        proc = self.replicas[r].proc
        assert proc is not None
        started = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)
        return time.monotonic() - started

    def stop(self) -> None:
        if self.envoy is not None:
            self.envoy.stop()
            self.envoy = None
        for proc in [r.proc for r in self.replicas] + [p.proc for p in self.pods]:
            if proc is not None:
                stop_process(proc)
        for pod in self.pods:
            if pod.metrics_proxy is not None:
                pod.metrics_proxy.stop()
                pod.metrics_proxy = None
        if self.silent_router is not None:
            self.silent_router.close(linger=0)
            self.silent_router = None
        if self._zmq is not None:
            self._zmq.term()
            self._zmq = None

    def logs(self) -> str:
        parts = []
        for path in sorted(self.work.glob("*.log")):
            parts.append(f"--- {path.name}\n{path.read_text(errors='replace')[-2000:]}")
        return "\n".join(parts)


# ---------------------------------------------------------------------------------------------
# Traffic and observations


def words(seed: int, n: int) -> str:
    vocab = ["alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf", "hotel", "india"]
    return " ".join(vocab[(seed * 7 + i * 13 + i * i) % len(vocab)] for i in range(n))


def chat_body(
    conversation: int, turn: int, *, system_words: int = 200, run: str = ""
) -> dict[str, Any]:
    return {
        "model": MODEL,
        "messages": [
            {
                "role": "system",
                "content": f"conversation {conversation}: " + words(conversation, system_words),
            },
            # New text every turn: a few new blocks, so the pod publishes events.
            {"role": "user", "content": f"{run} turn {turn} " + words(turn, 40)},
        ],
        "max_tokens": 4,
    }


@dataclass(frozen=True)
class Outcome:
    sent_at: float  # time.monotonic()
    latency: float
    status: int  # 0: the connection failed
    upstream: str  # "ip:port" of the pod that served it, "" if none
    dropped_reason: str = ""


async def send(
    session: aiohttp.ClientSession, gateway: str, body: dict[str, Any], timeout: float = 30.0
) -> Outcome:
    started = time.monotonic()
    try:
        async with session.post(
            f"{gateway}/v1/chat/completions",
            json=body,
            timeout=aiohttp.ClientTimeout(total=timeout),
        ) as resp:
            await resp.read()
            return Outcome(
                started,
                time.monotonic() - started,
                resp.status,
                resp.headers.get(UPSTREAM_HOST_HEADER, ""),
                resp.headers.get("x-epp-request-dropped-reason", ""),
            )
    except (aiohttp.ClientError, TimeoutError):
        return Outcome(started, time.monotonic() - started, 0, "")


_RUNS = itertools.count()


class Traffic:
    """Steady traffic in a background thread: ``rate`` requests per second, at most
    ``concurrency`` in flight, for at most ``max_seconds``; `stop` ends it and returns every
    outcome.  Bounded in count and time by construction."""

    def __init__(
        self,
        gateway: str,
        *,
        rate: float = 20.0,
        concurrency: int = 16,
        max_seconds: float = 120.0,
        conversations: int = 12,
    ) -> None:
        self.gateway = gateway
        self.rate = rate
        self.concurrency = concurrency
        self.max_seconds = max_seconds
        self.conversations = conversations
        self.outcomes: list[Outcome] = []
        # Each run's user turns are new text: the pods compute (and publish) new blocks.
        self.run = f"run {next(_RUNS)}-{os.getpid()}-{time.monotonic_ns() % 1_000_000}"
        self._stop = threading.Event()
        self._thread = threading.Thread(target=lambda: asyncio.run(self._run()), daemon=True)

    def __enter__(self) -> Traffic:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self) -> list[Outcome]:
        self._stop.set()
        self._thread.join(60)
        return self.outcomes

    async def _run(self) -> None:
        deadline = time.monotonic() + self.max_seconds
        semaphore = asyncio.Semaphore(self.concurrency)
        tasks: set[asyncio.Task[None]] = set()
        async with aiohttp.ClientSession() as session:
            n = 0
            while not self._stop.is_set() and time.monotonic() < deadline:
                await semaphore.acquire()
                body = chat_body(n % self.conversations, n, run=self.run)
                n += 1

                async def one(body: dict[str, Any] = body) -> None:
                    try:
                        self.outcomes.append(await send(session, self.gateway, body, timeout=10))
                    finally:
                        semaphore.release()

                task = asyncio.create_task(one())
                tasks.add(task)
                task.add_done_callback(tasks.discard)
                await asyncio.sleep(1.0 / self.rate)
            await asyncio.gather(*tasks, return_exceptions=True)


def failures(outcomes: Iterable[Outcome]) -> list[Outcome]:
    return [o for o in outcomes if o.status != 200]


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
    import urllib.request

    with urllib.request.urlopen(url, timeout=timeout) as resp:
        text: str = resp.read().decode()
        return text


def true_entries(pod: Pod, timeout: float = 5.0) -> int:
    """The (block, endpoint) entries the pod's cache really holds: its whole replay buffer
    (every batch since it started), folded into a fresh index."""
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    dealer = context.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.setsockopt(zmq.RCVTIMEO, int(timeout * 1000))
    try:
        dealer.connect(pod.replay_url)
        dealer.send_multipart([b"", (0).to_bytes(8, "big")])
        index = KVBlockIndex()
        while True:
            frames = dealer.recv_multipart()
            seq = frames[-2]
            if seq == _END_SEQ:
                break
            index.apply(pod.address, decode_batch(frames[-1]))
        return index.endpoint_stats(pod.address).blocks
    finally:
        dealer.close(linger=0)
        context.term()


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


def report(what: str, **figures: float | str) -> None:
    """Print a measured figure (``pytest -s`` shows them; docs/reliability.md collects them)."""
    shown = ", ".join(
        f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}" for k, v in figures.items()
    )
    print(f"\n[reliability] {what}: {shown}", flush=True)
    path = os.environ.get("EPP_RELIABILITY_REPORT")
    if path:
        with open(path, "a") as out:
            out.write(f"{what}: {shown}\n")


@contextlib.contextmanager
def running(stack: Stack) -> Iterator[Stack]:
    try:
        yield stack
    finally:
        stack.stop()
