"""Starting the system's processes on loopback and waiting until they serve.

The three programs of a local stack: simulated vLLM pods (``python -m simulator``), ``epp
serve`` and Envoy.  This module builds their command lines on ports from `launcher.ports`,
starts them with their output in a log file, waits for each to be ready (failing with the log's
tail when one exits or hangs) and stops them.  Every wait is bounded.  `launcher.stack` puts
them together.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from epp.envoy_bootstrap import EnvoyProcess, render_envoy_config, start_envoy
from launcher.ports import LOOPBACK, reserve_port

# Children inherit the environment; tokenizers' own thread pool would fight the EPP's executor
# for two cores, and unbuffered output keeps the logs current when a wait fails.
_CHILD_ENV = {"TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1"}


def spawn(args: Sequence[str], log: Path) -> subprocess.Popen[bytes]:
    """Starts ``args`` in its own session (so a Ctrl-C of the parent does not reach it twice),
    stdout and stderr appended to ``log``."""
    with log.open("ab") as out:
        return subprocess.Popen(
            list(args),
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env=os.environ | _CHILD_ENV,
        )


def stop_process(proc: subprocess.Popen[bytes], timeout: float = 10.0) -> None:
    """SIGTERM (after SIGCONT: a stopped process must be able to die), then SIGKILL if it has
    not exited within ``timeout``."""
    if proc.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        proc.send_signal(signal.SIGCONT)
        proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout)


def log_tail(log: Path, chars: int = 3000) -> str:
    return log.read_text(errors="replace")[-chars:] if log.exists() else "(no log)"


async def wait_http(
    url: str, proc: subprocess.Popen[bytes], log: Path, timeout: float = 60.0
) -> None:
    """Until ``url`` answers 200; fails at once if ``proc`` exits."""
    deadline = time.monotonic() + timeout
    async with aiohttp.ClientSession() as session:
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"{proc.args!r} exited early; its log:\n{log_tail(log)}")
            with contextlib.suppress(aiohttp.ClientError, OSError, asyncio.TimeoutError):
                async with session.get(url, timeout=aiohttp.ClientTimeout(total=1)) as resp:
                    if resp.status == 200:
                        return
            if time.monotonic() > deadline:
                raise TimeoutError(f"{url} not healthy after {timeout:.0f}s; log:\n{log_tail(log)}")
            await asyncio.sleep(0.1)


def wait_grpc_ready(
    port: int, proc: subprocess.Popen[bytes], log: Path, timeout: float = 60.0
) -> None:
    """Until the EPP's gRPC health service reports ``readiness`` SERVING; fails at once if
    ``proc`` exits."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    deadline = time.monotonic() + timeout
    with grpc.insecure_channel(f"{LOOPBACK}:{port}") as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"the EPP exited early; its log:\n{log_tail(log)}")
            with contextlib.suppress(grpc.RpcError):
                reply = stub.Check(health_pb2.HealthCheckRequest(service="readiness"), timeout=1)
                if reply.status == health_pb2.HealthCheckResponse.SERVING:
                    return
            if time.monotonic() > deadline:
                raise TimeoutError(f"EPP not ready after {timeout:.0f}s; log:\n{log_tail(log)}")
            time.sleep(0.1)


# ---------------------------------------------------------------------------------------------
# Command lines


@dataclass(frozen=True)
class PodPorts:
    """A pod's HTTP port, KV-event PUB port and replay ROUTER port on ``host`` (another loopback
    address than 127.0.0.1 lets pods share port numbers, as pods of a cluster do): a simulated
    pod's, or a real vLLM server's (`launcher.vllm.ServerSpec`)."""

    http: int
    pub: int
    replay: int
    host: str = LOOPBACK

    @classmethod
    def free(cls) -> PodPorts:
        return cls(reserve_port(), reserve_port(), reserve_port())

    @property
    def address(self) -> str:
        return f"{self.host}:{self.http}"

    @property
    def kv_events_url(self) -> str:
        return f"tcp://{self.host}:{self.pub}"

    @property
    def replay_url(self) -> str:
        return f"tcp://{self.host}:{self.replay}"

    def endpoint(self, name: str | None = None) -> dict[str, str]:
        """This pod's entry in ``epp serve --endpoints-file``."""
        entry = {
            "address": self.address,
            "kvEventsUrl": self.kv_events_url,
            "replayUrl": self.replay_url,
        }
        if name is not None:
            entry["name"] = name
        return entry


def pod_command(
    ports: PodPorts, *, model: str, tokenizer: Path, seed: int, options: Sequence[str] = ()
) -> list[str]:
    """``python -m simulator`` serving ``model`` on ``ports``; ``options`` are more simulator
    flags (profile, speed-up, capacity, faults)."""
    return [
        sys.executable,
        "-m",
        "simulator",
        "--host",
        ports.host,
        "--port",
        str(ports.http),
        "--model",
        model,
        "--tokenizer",
        str(tokenizer),
        "--kv-events-port",
        str(ports.pub),
        "--replay-port",
        str(ports.replay),
        "--seed",
        str(seed),
        *options,
    ]


@dataclass(frozen=True)
class EppPorts:
    """``epp serve``'s ext_proc, gRPC health and metrics ports."""

    grpc: int
    health: int
    metrics: int

    @classmethod
    def free(cls) -> EppPorts:
        return cls(reserve_port(), reserve_port(), reserve_port())

    @property
    def metrics_url(self) -> str:
        return f"http://{LOOPBACK}:{self.metrics}/metrics"


def epp_command(
    ports: EppPorts, serve_options: Sequence[str], *, log_level: str | None = None
) -> list[str]:
    """``epp serve`` on loopback at ``ports``; ``serve_options`` say where endpoints and
    configuration come from and anything else."""
    global_options = [] if log_level is None else ["--log-level", log_level]
    return [
        sys.executable,
        "-m",
        "epp.cli",
        *global_options,
        "serve",
        "--host",
        LOOPBACK,
        "--grpc-port",
        str(ports.grpc),
        "--grpc-health-port",
        str(ports.health),
        "--metrics-port",
        str(ports.metrics),
        *serve_options,
    ]


def start_loopback_envoy(
    extproc_port: int, workdir: Path, *, log_level: str = "warning", **options: Any
) -> EnvoyProcess:
    """A real Envoy listening on a free loopback port in front of the EPP at ``extproc_port``;
    ``options`` go to `render_envoy_config`."""
    listen, admin = reserve_port(), reserve_port()
    return start_envoy(
        render_envoy_config(
            listen_port=listen,
            extproc_port=extproc_port,
            admin_port=admin,
            listen_host=LOOPBACK,
            admin_host=LOOPBACK,
            **options,
        ),
        admin_port=admin,
        listen_port=listen,
        workdir=workdir,
        log_level=log_level,
    )


@dataclass
class ProcessGroup:
    """Processes started together and stopped in reverse order, whatever happens."""

    procs: list[tuple[str, subprocess.Popen[bytes]]] = field(default_factory=list)
    envoy: EnvoyProcess | None = None

    def add(self, name: str, proc: subprocess.Popen[bytes]) -> subprocess.Popen[bytes]:
        self.procs.append((name, proc))
        return proc

    def stop(self, name: str | None = None) -> None:
        """Stops the processes called ``name``, or everything (Envoy first)."""
        if name is None and self.envoy is not None:
            self.envoy.stop()
            self.envoy = None
        keep = []
        for proc_name, proc in reversed(self.procs):
            if name is None or proc_name == name:
                stop_process(proc)
            else:
                keep.append((proc_name, proc))
        self.procs = list(reversed(keep))
