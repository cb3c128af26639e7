"""Fixtures shared by the EPP tests."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest
from kubernetes import client

from epp.datastore import Datastore
from epp.discovery.kubernetes import KubernetesDiscovery
from epp.discovery.pool import PoolRef
from tests.epp.test_scraping import FakeVllm
from tests.support.fake_kube import FakeKubeApiServer
from tests.support.servers import running


def api_client(url: str) -> Any:
    """A real ``kubernetes`` client talking to ``url`` (the fake API server)."""
    cfg = client.Configuration()
    cfg.host = url
    return client.ApiClient(cfg)


@pytest.fixture
async def vllm_server() -> AsyncIterator[FakeVllm]:
    """A started fake vLLM whose /metrics page, status and delay the test controls."""
    async with running(FakeVllm()) as server:
        yield server


Factory = Callable[..., Awaitable[tuple[Datastore, KubernetesDiscovery]]]


@pytest.fixture
async def start_discovery(kube: FakeKubeApiServer) -> AsyncIterator[Factory]:
    started: list[tuple[KubernetesDiscovery, Any]] = []

    async def make(
        pool: PoolRef | None = None, server: FakeKubeApiServer | None = None, **kwargs: Any
    ) -> tuple[Datastore, KubernetesDiscovery]:
        ds = Datastore()
        api = api_client((server or kube).url)
        kwargs.setdefault("backoff_initial", 0.05)
        kwargs.setdefault("backoff_max", 0.2)
        kwargs.setdefault("request_timeout", 5.0)
        discovery = KubernetesDiscovery(ds, pool or PoolRef("pool"), api_client=api, **kwargs)
        await discovery.start()
        started.append((discovery, api))
        return ds, discovery

    yield make
    for discovery, api in started:
        await discovery.stop()
        api.close()
