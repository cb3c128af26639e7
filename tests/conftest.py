"""Shared fixtures: the read-only `shared/` folder that sits beside the project (also in CI)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

PROJECT_ROOT = Path(__file__).resolve().parent.parent
SHARED_DIR = Path(os.environ.get("EPP_SHARED_DIR", PROJECT_ROOT.parent / "shared"))
VECTORS_FILE = SHARED_DIR / "vectors" / "vllm-0.33-hashes-and-events.json"


def load_vectors() -> dict[str, Any]:
    if not VECTORS_FILE.is_file():
        raise FileNotFoundError(
            f"golden vectors not found at {VECTORS_FILE}; set EPP_SHARED_DIR to the shared/ folder"
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
