"""precise-prefix-cache-scorer: a pod that keeps serving but stops publishing KV events is found
from evidence (a completed request with new prompt blocks, then no batch), its entries are left
out of scoring, and they are used again (with a resync) once it publishes."""

from __future__ import annotations

import asyncio
import random
from typing import Any

import pytest

from indexer.events import BlockStored, KVEventBatch
from indexer.hashing import block_hashes
from indexer.subscriber import SubscriberPool
from kvcache.silent import SilentPublishers
from scorers.base import (
    Endpoint,
    LLMRequest,
    PluginConfigError,
    PluginContext,
    Usage,
    create_plugin,
)
from scorers.precise_prefix import PrecisePrefixCacheScorer
from tests.support.clock import ManualClock

A, B = "10.0.0.1:8000", "10.0.0.2:8000"
BS = 4


class _Endpoints:
    def endpoints(self) -> list[Endpoint]:
        return [Endpoint(address=A), Endpoint(address=B)]

    def get(self, address: str) -> Endpoint | None:
        return Endpoint(address=address)


def _plugin(clock: ManualClock, **params: Any) -> PrecisePrefixCacheScorer:
    context = PluginContext(endpoints=_Endpoints(), clock=clock)
    plugin = create_plugin(
        "precise-prefix-cache-scorer",
        "precise",
        {"blockSize": BS, "silentPublisherTimeout": 5, **params},
        context,
    )
    assert isinstance(plugin, PrecisePrefixCacheScorer)
    return plugin


def _stored(tokens: list[int]) -> KVEventBatch:
    keys = block_hashes(tokens, block_size=BS, algo="sha256", seed=None)
    event = BlockStored(
        block_hashes=tuple(keys),
        parent_block_hash=None,
        token_ids=tuple(tokens[: len(keys) * BS]),
        block_size=BS,
        medium="GPU",
    )
    return KVEventBatch(ts=0.0, events=(event,))


def _tokens(seed: int, n: int = 32) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(50_000) for _ in range(n)]


def _route(plugin: PrecisePrefixCacheScorer, prompt: list[int]) -> tuple[LLMRequest, dict]:  # type: ignore[type-arg]
    request = LLMRequest(request_id="r", model="m", prompt=prompt)
    endpoints = [Endpoint(address=A), Endpoint(address=B)]
    asyncio.run(plugin.prepare(request, endpoints))
    return request, plugin.score(request, endpoints)


def _samples(plugin: PrecisePrefixCacheScorer, name: str) -> dict[str, float]:
    return {
        dict(s.labels).get("endpoint", ""): s.value
        for s in plugin.view.telemetry_samples()
        if s.name == name
    }


def test_a_pod_that_served_new_blocks_and_published_nothing_is_marked_silent() -> None:
    clock = ManualClock()
    plugin = _plugin(clock)
    shared = _tokens(1)
    plugin.view.apply(A, _stored(shared))  # A has published before: a known publisher
    plugin.view.apply(B, _stored(_tokens(2)))
    assert _route(plugin, shared)[1][A] == 1.0

    # A request with 8 new blocks goes to A, completes; A publishes nothing.
    clock.now += 1
    request, _ = _route(plugin, _tokens(3))
    clock.now += 0.5
    plugin.response_complete(request, A, Usage(prompt_tokens=32, completion_tokens=4))
    clock.now += 4.9  # within silentPublisherTimeout of the completion
    assert _route(plugin, shared)[1][A] == 1.0
    assert _samples(plugin, "inference_extension_kv_events_silent_publisher") == {A: 0, B: 0}

    clock.now += 0.2
    request, scores = _route(plugin, shared)
    assert scores[A] == 0.0  # entries kept but not trusted
    assert plugin.view.index is not None and plugin.view.index.endpoint_stats(A).blocks == 8
    assert _samples(plugin, "inference_extension_kv_events_silent_publisher") == {A: 1, B: 0}
    assert _samples(plugin, "inference_extension_kv_events_silent_publishers_detected") == {"": 1}

    # Its next batch (whatever it says) makes it trusted again.
    plugin.view.apply(A, _stored(_tokens(3)))
    assert _route(plugin, shared)[1][A] == 1.0
    assert _samples(plugin, "inference_extension_kv_events_silent_publisher") == {A: 0, B: 0}
    assert _samples(plugin, "inference_extension_kv_events_silent_publishers_detected") == {"": 1}


@pytest.mark.parametrize(
    ("usage", "published_after_routing", "marked"),
    [
        (Usage(prompt_tokens=32, completion_tokens=1), False, True),
        # The batch for the request arrived before its completion: the usual order.
        (Usage(prompt_tokens=32, completion_tokens=1), True, False),
        # All but one block cached: vLLM may store nothing new.
        (Usage(prompt_tokens=32, completion_tokens=1, cached_tokens=28), False, False),
        (Usage(prompt_tokens=32, completion_tokens=1, cached_tokens=24), False, True),
        # No usage: the request failed or did not report it.
        (None, False, False),
    ],
)
def test_evidence_needs_new_blocks_and_no_batch_since_routing(
    usage: Usage | None, published_after_routing: bool, marked: bool
) -> None:
    clock = ManualClock()
    plugin = _plugin(clock)
    plugin.view.apply(A, _stored(_tokens(1)))
    clock.now += 1
    request, _ = _route(plugin, _tokens(3))
    if published_after_routing:
        clock.now += 0.01
        plugin.view.apply(A, _stored(_tokens(3)))
    clock.now += 0.5
    plugin.response_complete(request, A, usage)
    clock.now += 60
    _route(plugin, _tokens(4))
    assert (
        A in (plugin.view.silent_publishers.silent if plugin.view.silent_publishers else {})
    ) is marked


def test_without_cached_tokens_the_index_tells_what_the_pod_held() -> None:
    clock = ManualClock()
    plugin = _plugin(clock)
    prompt = _tokens(1)
    plugin.view.apply(A, _stored(prompt))
    clock.now += 1
    # The index shows A holding all 8 blocks: nothing new to publish, no evidence.
    request, _ = _route(plugin, prompt)
    plugin.response_complete(request, A, Usage(prompt_tokens=32, completion_tokens=1))
    # B never published: not a publisher the EPP can call silent (events may be off there).
    plugin.response_complete(request, B, Usage(prompt_tokens=32, completion_tokens=1))
    clock.now += 60
    _route(plugin, prompt)
    assert plugin.view.silent_publishers is not None and not plugin.view.silent_publishers.silent


def test_resuming_publisher_is_resynced_from_its_replay_buffer() -> None:
    clock = ManualClock()
    plugin = _plugin(clock)
    resyncs: list[str] = []

    class _Subscriber:
        def resync(self, endpoint: str) -> bool:
            resyncs.append(endpoint)
            return True

    plugin.view._subscriber = _Subscriber()  # type: ignore[assignment]
    plugin.view.apply(A, _stored(_tokens(1)))
    clock.now += 1
    request, _ = _route(plugin, _tokens(3))
    plugin.response_complete(request, A, Usage(prompt_tokens=32, completion_tokens=1))
    clock.now += 10
    _route(plugin, _tokens(4))

    async def resume() -> None:
        plugin.view.apply(A, _stored(_tokens(5)))
        plugin.view.apply(A, _stored(_tokens(6)))  # only the first batch after silence resyncs
        await asyncio.sleep(0)

    asyncio.run(resume())
    assert resyncs == [A]


def test_the_oldest_evidence_sets_the_deadline_and_removed_endpoints_are_forgotten() -> None:
    silent = SilentPublishers(timeout=1.0)
    silent.batch_arrived(A, now=0.0)
    for i in range(100):
        silent.completed(A, routed_at=1.0 + i, new_blocks=4, now=2.0 + i)
    assert silent.check(now=2.5) == []
    assert silent.check(now=3.0) == [A]
    assert silent.check(now=500.0) == []  # marked once per episode
    silent.forget(A)
    assert not silent.silent and list(silent.known()) == []


@pytest.mark.parametrize(("value", "seconds"), [("500ms", 0.5), ("2s", 2.0), (None, None)])
def test_silent_publisher_timeout_takes_durations_or_null(
    value: str | None, seconds: float | None
) -> None:
    plugin = _plugin(ManualClock(), silentPublisherTimeout=value)
    if seconds is None:
        assert plugin.view.silent_publishers is None
        # Off: completions are ignored and nothing is exported.
        request = LLMRequest(request_id="r", model="m", prompt=_tokens(1))
        plugin.response_complete(request, A, Usage(prompt_tokens=32, completion_tokens=1))
        assert not _samples(plugin, "inference_extension_kv_events_silent_publisher")
    else:
        assert plugin.view.silent_publishers is not None
        assert plugin.view.silent_publishers.timeout == seconds


@pytest.mark.parametrize("value", [0, -1, 3601, "soon"])
def test_bad_silent_publisher_timeout_names_the_field(value: object) -> None:
    with pytest.raises(PluginConfigError, match="silentPublisherTimeout"):
        _plugin(ManualClock(), silentPublisherTimeout=value)


def test_a_pod_marked_silent_gets_a_new_subscription_once() -> None:
    """libzmq never reconnects a connection it dropped over an oversized message, which looks
    exactly like a silent publisher: marking one replaces its SUB socket (once per episode)."""
    clock = ManualClock()
    plugin = _plugin(clock)
    reconnected: list[str] = []

    plugin.view.apply(A, _stored(_tokens(1)))
    clock.now += 1
    request, _ = _route(plugin, _tokens(3))
    plugin.response_complete(request, A, Usage(prompt_tokens=32, completion_tokens=1))
    clock.now += 10

    async def scrape_twice() -> None:
        pool = SubscriberPool(plugin)
        pool.reconnect = reconnected.append  # type: ignore[assignment,method-assign]
        plugin.view._subscriber = pool
        try:
            # A scrape (on the event loop, as the metrics server runs) marks A silent.
            assert _samples(plugin, "inference_extension_kv_events_silent_publisher") == {A: 1}
            assert _samples(plugin, "inference_extension_kv_events_silent_publisher") == {A: 1}
            await asyncio.sleep(0)
        finally:
            await pool.close()

    asyncio.run(scrape_twice())
    assert reconnected == [A]
