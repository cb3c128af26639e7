"""SGLang's model gateway (PyPI ``sglang-router``) in front of vLLM servers: the peer router.

``sglang-router`` is a Rust router with a Python launcher.  Its ``cache_aware`` policy keeps an
approximate radix tree of the text it routed to each worker and sends a request to the worker
with the longest match when the match covers more than ``--cache-threshold`` (0.3) of the prompt,
unless the load (requests in flight per worker) is imbalanced by more than
``--balance-abs-threshold`` (64) and ``--balance-rel-threshold`` (1.5) times, when the shortest
queue wins.  Its HTTP router forwards OpenAI requests to any worker, vLLM included (its
``--backend openai`` mode is something else: a proxy to a single OpenAI-compatible vendor).

It is installed on first use into ``.venv-sglang-router`` (its own environment: it pins pydantic
and FastAPI versions the project does not need to share), in well under a minute.
"""

from __future__ import annotations

import subprocess
import sys
import time
import urllib.request
from collections.abc import Sequence
from pathlib import Path

from launcher.ports import reserve_port
from launcher.processes import log_tail, spawn, stop_process

PROJECT_ROOT = Path(__file__).resolve().parents[1]
VENV = PROJECT_ROOT / ".venv-sglang-router"
VERSION = "0.3.2"
STAMP = VENV / f".installed-sglang-router-{VERSION}"


class RouterLaunchError(RuntimeError):
    """The router or its environment could not be brought up; the message has the log."""


def ensure_env(base_python: str = sys.executable) -> Path:
    """The environment's Python, installing ``sglang-router`` first when it is missing."""
    python = VENV / "bin" / "python"
    if STAMP.exists():
        return python
    log = PROJECT_ROOT / ".cache" / "sglang-router-env.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("w") as out:
        for args in (
            [base_python, "-m", "venv", "--clear", str(VENV)],
            [str(python), "-m", "pip", "install", "--quiet", f"sglang-router=={VERSION}"],
        ):
            if subprocess.run(args, stdout=out, stderr=subprocess.STDOUT, check=False).returncode:
                raise RouterLaunchError(
                    f"installing sglang-router failed ({' '.join(args)}); log {log}:\n"
                    f"{log_tail(log)}"
                )
    STAMP.touch()
    return python


class SGLangRouter:
    """One ``sglang_router.launch_router`` process routing to ``workers`` with ``policy``."""

    def __init__(
        self, workers: Sequence[str], log: Path, *, policy: str = "cache_aware", port: int = 0
    ) -> None:
        self.workers = list(workers)
        self.policy = policy
        self.port = port or reserve_port()
        self.log = log
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def command(self, python: Path) -> list[str]:
        return [
            str(python),
            "-m",
            "sglang_router.launch_router",
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--policy",
            self.policy,
            "--worker-urls",
            *self.workers,
            "--log-level",
            "warn",
        ]

    def start(self, timeout: float = 120.0) -> None:
        python = ensure_env()
        self.proc = spawn(self.command(python), self.log)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RouterLaunchError(
                    f"sglang-router exited with {self.proc.returncode}; log {self.log}:\n"
                    f"{log_tail(self.log)}"
                )
            try:
                with urllib.request.urlopen(f"{self.url}/v1/models", timeout=2) as response:
                    if response.status == 200:
                        return
            except OSError:
                pass
            time.sleep(0.3)
        self.stop()
        raise RouterLaunchError(
            f"sglang-router not serving after {timeout:.0f} s; log {self.log}:\n{log_tail(self.log)}"
        )

    def stop(self) -> None:
        if self.proc is not None:
            stop_process(self.proc, timeout=10)
            self.proc = None
