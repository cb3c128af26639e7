"""Fixtures shared by the EPP tests."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from tests.epp.test_scraping import FakeVllm
from tests.support.servers import running


@pytest.fixture
async def vllm_server() -> AsyncIterator[FakeVllm]:
    """A started fake vLLM whose /metrics page, status and delay the test controls."""
    async with running(FakeVllm()) as server:
        yield server
