"""A whole local stack on loopback: simulated vLLM pods (real processes, real ZMQ in vLLM's wire
format) or servers started elsewhere (real vLLM), ``epp serve`` replicas (real processes), and a
real Envoy in front: the one way `make demo`, the end-to-end, reliability and real-vLLM tests and
the benchmarks bring the system up.

Levers for fault runs: kill a pod (SIGKILL) and start it again on the same ports, hang it
(SIGSTOP/SIGCONT), restart an EPP replica or swap its configuration, put a `MetricsProxy` in
front of a pod's ``/metrics``, point a pod's replay URL at a socket that never answers.  The pod
that served each request is in Envoy's ``x-upstream-host`` response header.

Ports come from `launcher.ports` (no other process can take them between choosing and binding).
Every wait is bounded; `Stack.stop` (or leaving ``with Stack.start(...)``) ends every process it
started, and each process's output stays in a log file in the stack's working directory.
"""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

import yaml
import zmq

from epp.envoy_bootstrap import EnvoyProcess
from launcher.configs import equal_weights_config
from launcher.metrics_proxy import MetricsProxy
from launcher.ports import LOOPBACK, reserve_port
from launcher.processes import (
    EppPorts,
    PodPorts,
    epp_command,
    pod_command,
    spawn,
    start_loopback_envoy,
    stop_process,
    wait_grpc_ready,
    wait_http,
)

MODEL: Final = "sim-llama3"
"""The model name simulated pods serve unless told otherwise."""

QUICK_PODS: Final = ("--speedup", "20", "--max-num-seqs", "8")
"""Simulated pods that answer in milliseconds: runs that check behaviour, not timing."""


ROLE_LABEL: Final = "llm-d.ai/role"
ROLES: Final = ("prefill", "decode")


def role_options(role: str) -> list[str]:
    """Simulator flags of a P/D role: a NIXL connector producing (prefill) or consuming
    (decode) KV."""
    if role not in ROLES:
        raise ValueError(f"pod role {role!r} is not one of {', '.join(ROLES)}")
    kv_role = "kv_producer" if role == "prefill" else "kv_consumer"
    return [
        "--kv-transfer-config",
        json.dumps({"kv_connector": "NixlConnector", "kv_role": kv_role}),
    ]


@dataclass
class Pod:
    index: int
    ports: PodPorts
    args: list[str]
    log: Path
    proc: subprocess.Popen[bytes] | None = None
    metrics_proxy: MetricsProxy | None = None
    replay_url_override: str | None = None
    role: str | None = None  # llm-d.ai/role: "prefill", "decode" (behind a routing sidecar)
    sidecar_port: int | None = None
    sidecar_proc: subprocess.Popen[bytes] | None = None

    @property
    def address(self) -> str:
        """Where requests for the pod go: its routing sidecar's port when it has one."""
        if self.sidecar_port is not None:
            return f"{self.ports.host}:{self.sidecar_port}"
        return self.ports.address

    def sidecar_command(self) -> list[str]:
        assert self.sidecar_port is not None
        return [
            sys.executable,
            "-m",
            "simulator.routing_sidecar",
            "--host",
            self.ports.host,
            "--port",
            str(self.sidecar_port),
            "--vllm-host",
            self.ports.host,
            "--vllm-port",
            str(self.ports.http),
            "--pod-ip",
            self.ports.host,
            "--log-level",
            "warning",
        ]

    @property
    def replay_url(self) -> str:
        return self.ports.replay_url

    def endpoint(self) -> dict[str, Any]:
        """Its entry in ``epp serve --endpoints-file``."""
        entry: dict[str, Any] = self.ports.endpoint()
        entry["address"] = self.address
        if self.role is not None:
            entry["labels"] = {ROLE_LABEL: self.role}
        if self.replay_url_override is not None:
            entry["replayUrl"] = self.replay_url_override
        if self.metrics_proxy is not None:
            entry["metricsUrl"] = self.metrics_proxy.url
        return entry


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
    tokenizer_dir: Path | None
    pods: list[Pod] = field(default_factory=list)
    replicas: list[Replica] = field(default_factory=list)
    envoy: EnvoyProcess | None = None
    silent_router: zmq.Socket[bytes] | None = None
    ready_timeout: float = 60.0
    _zmq: zmq.Context[zmq.Socket[bytes]] | None = None

    @classmethod
    def start(
        cls,
        work: Path,
        tokenizer_dir: Path | None,
        *,
        pods: int = 2,
        replicas: int = 1,
        model: str = MODEL,
        pod_args: Sequence[str] = QUICK_PODS,
        epp_args: Sequence[str] = (),
        epp_log_level: str | None = "warning",
        config: str | None = None,
        extra_endpoints: Sequence[Mapping[str, Any]] = (),
        metrics_proxies: Iterable[int] = (),
        silent_replay: Iterable[int] = (),
        envoy_options: Mapping[str, Any] | None = None,
        ready_timeout: float = 60.0,
        roles: Sequence[str | None] = (),
    ) -> Stack:
        """Starts ``pods`` simulated pods serving ``model`` (``pod_args``: more simulator flags),
        then, unless ``replicas`` is 0, that many EPP replicas routing to them and to
        ``extra_endpoints`` (servers started elsewhere, e.g. real vLLM; entries of the
        endpoints file) with ``config`` (default `equal_weights_config`) and a real Envoy in
        front of the replicas (``envoy_options`` go to `render_envoy_config`).  Pods listed in
        ``metrics_proxies`` are scraped through a `MetricsProxy`; those in ``silent_replay``
        get a replay URL that never answers.  ``roles`` (one per pod, None for an aggregated
        pod) make a P/D fleet: "prefill" pods prefill for remote decoders, "decode" pods pull
        their KV and are reached through a routing sidecar (`simulator.routing_sidecar`); each
        is labelled ``llm-d.ai/role``.  On any failure everything started is stopped."""
        stack = cls(work=work, tokenizer_dir=tokenizer_dir, ready_timeout=ready_timeout)
        proxied = set(metrics_proxies)
        try:
            if pods and tokenizer_dir is None:
                raise ValueError("simulated pods need a tokenizer directory")
            if roles and len(roles) != pods:
                raise ValueError(f"{len(roles)} roles for {pods} pods")
            for i in range(pods):
                assert tokenizer_dir is not None
                ports = PodPorts.free()
                role = roles[i] if roles else None
                options = [*pod_args, "--log-level", "warning"]
                sidecar = reserve_port() if role == "decode" else None
                if role is not None:
                    options += role_options(role)
                if sidecar is not None:
                    # Its KV events name the pod as the EPP knows it: the sidecar's address.
                    options += ["--pod-address", f"{ports.host}:{sidecar}"]
                args = pod_command(
                    ports, model=model, tokenizer=tokenizer_dir, seed=i, options=options
                )
                stack.pods.append(
                    Pod(i, ports, args, work / f"pod-{i}.log", role=role, sidecar_port=sidecar)
                )
                stack.start_pod(i, wait=False)
            for pod in stack.pods:
                stack._wait_pod(pod)
                if pod.index in proxied:
                    pod.metrics_proxy = MetricsProxy(pod.address)
            stack._silence_replay(set(silent_replay))
            if replicas:
                stack._start_epp(replicas, config, extra_endpoints, epp_args, epp_log_level)
                stack._start_envoy(envoy_options or {})
        except BaseException:
            stack.stop()
            raise
        return stack

    def __enter__(self) -> Stack:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _silence_replay(self, pods: set[int]) -> None:
        if not pods:
            return
        self._zmq = zmq.Context()
        self.silent_router = self._zmq.socket(zmq.ROUTER)
        self.silent_router.setsockopt(zmq.LINGER, 0)
        port = self.silent_router.bind_to_random_port(f"tcp://{LOOPBACK}")
        for i in pods:
            self.pods[i].replay_url_override = f"tcp://{LOOPBACK}:{port}"

    def _start_epp(
        self,
        replicas: int,
        config: str | None,
        extra_endpoints: Sequence[Mapping[str, Any]],
        epp_args: Sequence[str],
        log_level: str | None,
    ) -> None:
        endpoints = [pod.endpoint() for pod in self.pods] + [dict(e) for e in extra_endpoints]
        (self.work / "endpoints.yaml").write_text(yaml.safe_dump(endpoints))
        if config is None:
            if self.tokenizer_dir is None:
                raise ValueError("the default test configuration needs a tokenizer directory")
            config = equal_weights_config(self.tokenizer_dir)
        self.config_path.write_text(config)
        serve_options = [
            "--endpoints-file",
            str(self.work / "endpoints.yaml"),
            "--config-file",
            str(self.config_path),
            "--drain-timeout",
            "10s",
            "--drain-quiet-period",
            "1s",
            *epp_args,
        ]
        for r in range(replicas):
            ports = EppPorts.free()
            args = epp_command(ports, serve_options, log_level=log_level)
            log = self.work / ("epp.log" if replicas == 1 else f"epp-{r}.log")
            self.replicas.append(Replica(ports, args, log))
            self.start_replica(r)

    def _start_envoy(self, options: Mapping[str, Any]) -> None:
        settings: dict[str, Any] = {
            "log_level": "error",
            "extproc_endpoints": [(LOOPBACK, r.ports.grpc) for r in self.replicas],
            "expose_upstream_host": True,
            "message_timeout_s": 30,
        }
        settings.update(options)
        self.envoy = start_loopback_envoy(self.replicas[0].ports.grpc, self.work, **settings)

    def _wait_pod(self, pod: Pod) -> None:
        assert pod.proc is not None
        asyncio.run(
            wait_http(f"http://{pod.ports.address}/health", pod.proc, pod.log, self.ready_timeout)
        )
        if pod.sidecar_proc is not None:
            asyncio.run(
                wait_http(
                    f"http://{pod.address}/health",
                    pod.sidecar_proc,
                    pod.log.with_suffix(".sidecar.log"),
                    self.ready_timeout,
                )
            )

    @property
    def config_path(self) -> Path:
        return self.work / "config.yaml"

    @property
    def gateway(self) -> str:
        assert self.envoy is not None
        return f"http://{LOOPBACK}:{self.envoy.listen_port}"

    @property
    def metrics_url(self) -> str:
        """The first EPP replica's Prometheus page."""
        return self.replicas[0].metrics_url

    # -- levers ---------------------------------------------------------------------------------

    def start_pod(self, i: int, *, wait: bool = True) -> None:
        pod = self.pods[i]
        pod.proc = spawn(pod.args, pod.log)
        if pod.sidecar_port is not None and (
            pod.sidecar_proc is None or pod.sidecar_proc.poll() is not None
        ):
            pod.sidecar_proc = spawn(pod.sidecar_command(), pod.log.with_suffix(".sidecar.log"))
        if wait:
            self._wait_pod(pod)

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
        wait_grpc_ready(replica.ports.health, replica.proc, replica.log, self.ready_timeout)

    def stop_replica(self, r: int) -> float:
        """SIGTERM and wait for the exit; returns how long the drain took."""
        proc = self.replicas[r].proc
        assert proc is not None
        started = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)
        return time.monotonic() - started

    def reconfigure(self, config: str) -> None:
        """Every replica stopped, ``config`` written, every replica started again on the same
        ports (Envoy keeps running): the same fleet under another configuration."""
        for replica in self.replicas:
            if replica.proc is not None:
                stop_process(replica.proc, timeout=15)
        self.config_path.write_text(config)
        for r in range(len(self.replicas)):
            self.start_replica(r)

    def stop(self) -> None:
        if self.envoy is not None:
            self.envoy.stop()
            self.envoy = None
        sidecars = [p.sidecar_proc for p in self.pods]
        for proc in [r.proc for r in self.replicas] + [p.proc for p in self.pods] + sidecars:
            if proc is not None:
                stop_process(proc, timeout=15)
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

    def logs(self, chars: int = 2000) -> str:
        """The tail of every log in the working directory (for a failure's message)."""
        parts = []
        for path in sorted(self.work.glob("*.log")):
            parts.append(f"--- {path.name}\n{path.read_text(errors='replace')[-chars:]}")
        return "\n".join(parts)
