"""Shared fixtures: vLLM's golden hash and KV-event vectors (`tests/data`), the Llama-3 tokenizer,
a fake Kubernetes API server."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from tests.support.fake_kube import FakeKubeApiServer
from tests.support.servers import running

PROJECT_ROOT = Path(__file__).resolve().parent.parent
VECTORS_FILE = PROJECT_ROOT / "tests" / "data" / "vllm-0.33-hashes-and-events.json"


def load_vectors() -> dict[str, Any]:
    if not VECTORS_FILE.is_file():
        raise FileNotFoundError(
            f"golden vectors not found at {VECTORS_FILE} (they ship with the repository)"
        )
    data: dict[str, Any] = json.loads(VECTORS_FILE.read_text())
    return data


@pytest.fixture(scope="session")
def llama3_tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A real Llama-3 tokenizer directory (with a chat template), built offline once per test
    session by the same builder the demo uses."""
    from indexer.tokenizer_assets import build_llama3_tokenizer_dir

    return build_llama3_tokenizer_dir(tmp_path_factory.mktemp("llama3-tokenizer"))


@pytest.fixture(scope="session")
def vectors() -> dict[str, Any]:
    return load_vectors()


@pytest.fixture
async def kube() -> AsyncIterator[FakeKubeApiServer]:
    """A fake Kubernetes API server on loopback (`tests.support.fake_kube`), started and empty."""
    async with running(FakeKubeApiServer()) as server:
        yield server
