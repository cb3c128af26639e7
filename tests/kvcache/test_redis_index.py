"""The Redis/Valkey index backend against a real server process (``launcher.kv_store``): the same
answers as the in-memory index on the same events, the self-check before writing, the store's
outage and return, malformed entries, and configuration errors."""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import valkey

from indexer.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch
from indexer.hashing import HashConfig, block_hashes
from kvcache.backend import BlockMatch, MemoryIndex
from kvcache.redis_index import KVStoreError, RedisIndex, RedisStore
from launcher.kv_store import KVStoreServer
from scorers.base import Endpoint, LLMRequest, PluginConfigError, PluginContext, create_plugin
from scorers.precise_prefix import PrecisePrefixCacheScorer
from tests.scorers.plugin_helpers import StaticEndpoints

BLOCK = 4
CONFIG = HashConfig(block_size=BLOCK, algo="sha256", seed=None)
PODS = [f"10.0.0.{i}:8000" for i in range(1, 6)]


@pytest.fixture
def server(tmp_path: Path) -> Iterator[KVStoreServer]:
    with KVStoreServer(tmp_path) as running:
        yield running


def _store(server: KVStoreServer, namespace: str = "test") -> RedisStore:
    store = RedisStore(server.address, namespace)
    store.check()
    store.start()
    return store


def _stored(tokens: list[int], *, medium: str = "GPU", seed: str | None = None) -> BlockStored:
    keys = block_hashes(tokens, block_size=BLOCK, algo="sha256", seed=seed)
    return BlockStored(
        block_hashes=tuple(keys),
        parent_block_hash=None,
        token_ids=tuple(tokens[: len(keys) * BLOCK]),
        block_size=BLOCK,
        medium=medium,
    )


def _same(a: BlockMatch, b: BlockMatch) -> None:
    """Equal answers: the same blocks, the same held counts, weights equal up to rounding (the
    two backends add the same tier weights in different orders)."""
    assert a.held_blocks == b.held_blocks
    assert {e: m.blocks for e, m in a.prefix.items()} == {e: m.blocks for e, m in b.prefix.items()}
    for endpoint, match in a.prefix.items():
        assert match.weighted == pytest.approx(b.prefix[endpoint].weighted, rel=1e-12)


def _random_events(rng: random.Random, prompts: list[list[int]]) -> list[tuple[str, KVEventBatch]]:
    """Stores of prompt prefixes on several tiers, removals of some of their blocks, a clear."""
    out: list[tuple[str, KVEventBatch]] = []
    for _ in range(120):
        pod = rng.choice(PODS)
        tokens = rng.choice(prompts)[: BLOCK * rng.randint(1, 16)]
        roll = rng.random()
        if roll < 0.7:
            event: Any = _stored(tokens, medium=rng.choice(["GPU", "GPU", "CPU", "STORAGE"]))
        elif roll < 0.97:
            stored = _stored(tokens)
            start = rng.randrange(len(stored.block_hashes))
            event = BlockRemoved(
                block_hashes=stored.block_hashes[start:], medium=rng.choice(["GPU", "CPU"])
            )
        else:
            event = AllBlocksCleared()
        out.append((pod, KVEventBatch(ts=0.0, events=(event,))))
    return out


def test_answers_equal_the_in_memory_index_on_the_same_events(server: KVStoreServer) -> None:
    rng = random.Random(7)
    prompts = [[rng.randrange(50_000) for _ in range(64)] for _ in range(6)]
    memory = MemoryIndex(hash_config=CONFIG)
    store = _store(server)
    redis = RedisIndex(store, hash_config=CONFIG, tier_weights=None, self_check_blocks=None)
    try:
        for pod, batch in _random_events(rng, prompts):
            memory.apply(pod, batch)
            redis.apply(pod, batch)
        assert store.flush()
        for prompt in prompts:
            for length in (1, 5, 16):
                keys = [
                    k & ((1 << 64) - 1)
                    for k in block_hashes(prompt[: BLOCK * length], block_size=BLOCK, algo="sha256")
                ]
                _same(redis.match(keys, PODS), memory.match(keys, PODS))
        # Restarts and departures drop exactly that pod's entries.
        memory.clear_endpoint(PODS[0])
        redis.clear_endpoint(PODS[0])
        memory.remove_endpoint(PODS[1])
        redis.remove_endpoint(PODS[1])
        assert store.flush()
        keys = block_hashes(prompts[0][: BLOCK * 16], block_size=BLOCK, algo="sha256")
        _same(redis.match(keys, PODS), memory.match(keys, PODS))
        assert store.dropped_writes_total == 0 and store.writes_total > 100
    finally:
        store.stop()


def test_a_pod_hashing_differently_is_stored_under_the_epp_keys(server: KVStoreServer) -> None:
    store = _store(server)
    redis = RedisIndex(store, hash_config=CONFIG, tier_weights=None, self_check_blocks=None)
    tokens = [random.Random(3).randrange(50_000) for _ in range(32)]
    try:
        redis.apply(PODS[0], KVEventBatch(ts=0.0, events=(_stored(tokens, seed="42"),)))
        assert store.flush()
        ours = block_hashes(tokens, block_size=BLOCK, algo="sha256")
        assert redis.match(ours, PODS[:2]).prefix[PODS[0]].blocks == 8
        assert redis.key_check.mismatch_events_total == 1
    finally:
        store.stop()


def test_store_outage_routes_by_load_then_recovers(server: KVStoreServer) -> None:
    store = _store(server)
    redis = RedisIndex(store, hash_config=None, tier_weights=None, self_check_blocks=None)
    tokens = list(range(32))
    keys = block_hashes(tokens, block_size=BLOCK, algo="sha256")
    try:
        redis.apply(PODS[0], KVEventBatch(ts=0.0, events=(_stored(tokens),)))
        assert store.flush()
        assert redis.match(keys, PODS[:1]).prefix[PODS[0]].blocks == 8
        server.kill()
        # A lookup during the outage answers "nothing held", it does not raise.
        assert redis.match(keys, PODS[:1]).prefix[PODS[0]].blocks == 0
        assert not store.up and store.lookup_errors_total == 1
        redis.apply(PODS[1], KVEventBatch(ts=0.0, events=(_stored(tokens),)))
        assert store.flush(timeout_s=10)
        assert store.dropped_writes_total >= 1
        gauges = {s.name: s.value for s in redis.telemetry_samples()}
        assert gauges["inference_extension_kv_store_up"] == 0.0
        server.start()  # same port, empty: a restarted server without persistence
        redis.apply(PODS[2], KVEventBatch(ts=0.0, events=(_stored(tokens),)))
        assert store.flush(timeout_s=10)
        found = redis.match(keys, PODS[:3]).prefix
        assert store.up and found[PODS[2]].blocks == 8 and found[PODS[0]].blocks == 0
        assert store.outages_total == 1
    finally:
        store.stop()


def test_a_busy_store_is_not_taken_for_dead(server: KVStoreServer) -> None:
    # A script keeps the real server busy for 1.2 s: a lookup meanwhile times out (0.5 s) and
    # answers "nothing held", but the store is not marked down and a write queued meanwhile is
    # written once the server answers (the writer waits up to 5 s), not dropped.
    import threading

    store = _store(server, namespace="busy")
    redis = RedisIndex(store, hash_config=None, tier_weights=None, self_check_blocks=None)
    tokens = list(range(16))
    keys = block_hashes(tokens, block_size=BLOCK, algo="sha256")
    client = valkey.Valkey.from_url(server.address, socket_timeout=10)
    busy = client.register_script(
        "local t0 = redis.call('TIME') "
        "repeat local t = redis.call('TIME') "
        "until (t[1] - t0[1]) * 1000000 + (t[2] - t0[2]) > 1200000 return 0"
    )
    blocker = threading.Thread(target=busy)
    try:
        blocker.start()
        time.sleep(0.1)
        assert redis.match(keys, PODS[:1]).prefix[PODS[0]].blocks == 0
        redis.apply(PODS[0], KVEventBatch(ts=0.0, events=(_stored(tokens),)))
        blocker.join()
        assert store.flush()
        assert redis.match(keys, PODS[:1]).prefix[PODS[0]].blocks == 4
        assert store.up and store.outages_total == 0 and store.dropped_writes_total == 0
        assert store.lookup_timeouts_total == 1 and store.lookup_errors_total == 1
    finally:
        blocker.join()
        client.close()
        store.stop()


def test_a_malformed_entry_reads_as_not_held_and_is_overwritten(server: KVStoreServer) -> None:
    store = _store(server, namespace="bad")
    redis = RedisIndex(store, hash_config=None, tier_weights=None, self_check_blocks=None)
    tokens = list(range(16))
    keys = block_hashes(tokens, block_size=BLOCK, algo="sha256")
    client = valkey.Valkey.from_url(server.address)
    try:
        redis.apply(PODS[0], KVEventBatch(ts=0.0, events=(_stored(tokens),)))
        assert store.flush()
        client.hset(f"bad:e:{PODS[0]}", keys[1].to_bytes(8, "big"), "garbage")
        assert redis.match(keys, PODS[:1]).prefix[PODS[0]].blocks == 1
        redis.apply(PODS[0], KVEventBatch(ts=0.0, events=(_stored(tokens),)))
        assert store.flush()
        assert redis.match(keys, PODS[:1]).prefix[PODS[0]].blocks == 4
        client.hset(f"bad:e:{PODS[0]}", keys[0].to_bytes(8, "big"), "9")  # not tier bits
        assert redis.match(keys, PODS[:1]).prefix[PODS[0]].blocks == 0
        assert store.write_errors_total == 0 and store.lookup_errors_total == 0
    finally:
        client.close()
        store.stop()


def test_bad_addresses_fail_with_the_fix(tmp_path: Path) -> None:
    with pytest.raises(KVStoreError, match="must start with one of"):
        RedisStore("127.0.0.1:6379", "kv")
    unreachable = KVStoreServer(tmp_path)  # a port nobody listens on
    store = RedisStore(unreachable.address, "kv")
    with pytest.raises(KVStoreError, match=r"does not answer.*redisConfig\.address"):
        store.check()


def _plugin(params: dict[str, Any]) -> PrecisePrefixCacheScorer:
    endpoints = [Endpoint(address=a) for a in PODS[:3]]

    plugin = create_plugin(
        "precise-prefix-cache-scorer",
        "p",
        params,
        PluginContext(endpoints=StaticEndpoints(endpoints)),
    )
    assert isinstance(plugin, PrecisePrefixCacheScorer)
    return plugin


def test_the_scorer_scores_the_same_with_either_backend(server: KVStoreServer) -> None:
    in_memory = _plugin({"blockSize": BLOCK})
    shared = _plugin(
        {"blockSize": BLOCK, "kvBlockIndexConfig": {"redisConfig": {"address": server.address}}}
    )
    rng = random.Random(5)
    prompts = [[rng.randrange(50_000) for _ in range(48)] for _ in range(4)]

    async def run() -> list[dict[str, float]]:
        await shared.context.kv_caches.start()
        try:
            for i, prompt in enumerate(prompts):
                batch = KVEventBatch(ts=0.0, events=(_stored(prompt[: BLOCK * (4 + 2 * i)]),))
                for plugin in (in_memory, shared):
                    plugin.view.apply(PODS[i % 3], batch)
            store = shared.view._store
            assert store is not None and store.flush()
            scores = []
            for prompt in prompts:
                for plugin in (in_memory, shared):
                    request = LLMRequest(request_id="r", model="m", prompt=prompt)
                    eps = [Endpoint(address=a) for a in PODS[:3]]
                    await plugin.prepare(request, eps)
                    scores.append(plugin.score(request, eps))
            return scores
        finally:
            await shared.context.kv_caches.stop()

    scores = asyncio.run(run())
    assert scores[0::2] == scores[1::2]
    assert any(v > 0 for s in scores for v in s.values())


@pytest.mark.parametrize(
    ("index_config", "message"),
    [
        ({"inMemoryConfig": {}, "redisConfig": {}}, "not both"),
        ({"redisConfig": {"adress": "redis://x:1"}}, "adress"),
        ({"redisConfig": {"address": "x:1"}}, "must start with one of"),
    ],
)
def test_index_configuration_errors_name_the_key(
    index_config: dict[str, Any], message: str
) -> None:
    with pytest.raises((PluginConfigError, KVStoreError), match=message):
        _plugin({"kvBlockIndexConfig": index_config})


def test_max_index_entries_with_a_store_is_an_error() -> None:
    with pytest.raises(PluginConfigError, match="maxIndexEntries bounds the in-memory index"):
        _plugin(
            {
                "maxIndexEntries": 5000,
                "kvBlockIndexConfig": {"redisConfig": {"address": "redis://127.0.0.1:1"}},
            }
        )


def test_epp_serve_refuses_to_start_on_an_unreachable_store(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from epp.cli import main
    from launcher.ports import reserve_port

    config = tmp_path / "config.yaml"
    config.write_text(
        "apiVersion: inference.networking.x-k8s.io/v1alpha1\n"
        "kind: EndpointPickerConfig\n"
        "plugins:\n"
        "- type: precise-prefix-cache-scorer\n"
        "  parameters:\n"
        "    blockSize: 16\n"
        "    kvBlockIndexConfig:\n"
        f"      redisConfig: {{address: 'redis://127.0.0.1:{reserve_port()}'}}\n"
        "- type: max-score-picker\n"
        "schedulingProfiles:\n"
        "- name: default\n"
        "  plugins: [{pluginRef: precise-prefix-cache-scorer}, {pluginRef: max-score-picker}]\n"
    )
    ports = [str(reserve_port()) for _ in range(3)]
    code = main(
        [
            "serve",
            "--config-file",
            str(config),
            "--endpoints",
            "127.0.0.1:9",
            "--grpc-port",
            ports[0],
            "--grpc-health-port",
            ports[1],
            "--metrics-port",
            ports[2],
        ]
    )
    assert code == 2
    assert "does not answer" in capsys.readouterr().err


def test_routing_replays_decide_the_same_with_either_backend(server: KVStoreServer) -> None:
    # The routing benchmark's replay (simulated pods, real scheduler) with the index in memory
    # and in the store: every decision and every engine-counted hit the same.
    from benchmarks import workloads
    from benchmarks.policies import POLICIES
    from benchmarks.replay import FleetSpec, Replay
    from simulator.profiles import TINY_CPU

    fleet = FleetSpec(pods=3, profile=TINY_CPU, capacity_tokens=4096, block_size=16)
    workload = workloads.multi_turn(
        rate=4.0, duration=20.0, turns=4, system_prompt_len=400, output_len=40, seed=3
    )
    keys = workloads.block_keys(workload.requests, 16)
    config = POLICIES["default"].config_yaml

    def replay(store: str | None) -> Any:
        return asyncio.run(
            Replay(workload, keys, fleet, config, policy="default", kv_store=store).run()
        )

    in_memory, shared = replay(None), replay(server.address)
    assert shared.decisions_per_pod == in_memory.decisions_per_pod
    assert [r.cached_tokens for r in shared.records] == [r.cached_tokens for r in in_memory.records]
    assert sum(r.cached_tokens for r in shared.records) > 0


async def test_after_an_outage_the_store_is_rebuilt_from_the_pods_replay_buffers(
    server: KVStoreServer,
) -> None:
    # A view on the store, subscribed to a pod publishing real KV-event frames with a replay
    # buffer.  The store dies and comes back empty; what the pod published before and during
    # the outage is back in the store from the pod's buffer, without a new event.
    import zmq.asyncio

    from indexer.events import encode_batch
    from tests.indexer.test_subscriber import FakeVLLMPod

    settings = {
        "blockSize": BLOCK,
        "selfCheck": False,
        "kvBlockIndexConfig": {"redisConfig": {"address": server.address, "namespace": "rb"}},
    }
    plugin = _plugin(settings)
    view = plugin.view
    context = zmq.asyncio.Context()
    pod = FakeVLLMPod(context)
    prompts = [[i * 1000 + t for t in range(BLOCK * 6)] for i in range(3)]
    keys = [block_hashes(p, block_size=BLOCK, algo="sha256") for p in prompts]
    address = PODS[0]

    async def holds(prompt: int) -> bool:
        assert view.flush()
        found = await view.lookup(keys[prompt], [address])
        return found.blocks[address] == 6

    async def wait_for(condition: Any, what: str, timeout: float = 15.0) -> None:
        deadline = asyncio.get_running_loop().time() + timeout
        while not await condition():
            if asyncio.get_running_loop().time() > deadline:
                raise AssertionError(f"timed out waiting for {what}")
            await asyncio.sleep(0.05)

    views = plugin.context.kv_caches
    try:
        await views.start()
        endpoint = Endpoint(address=address, kv_events_url=pod.pub_url, replay_url=pod.replay_url)
        views.endpoint_added(endpoint)

        async def publish(prompt: int) -> None:
            batch = KVEventBatch(ts=0.0, events=(_stored(prompts[prompt]),))
            await pod.publish(payload=encode_batch(batch))

        async def first_held() -> bool:
            await publish(0)  # until the subscription is live (PUB/SUB's slow joiner)
            return await holds(0)

        await wait_for(first_held, "the first prompt in the store")
        server.kill()
        await publish(1)  # published while the store is down
        store = view._store
        assert store is not None
        await wait_for(lambda: _true(not store.up), "the outage to be noticed")
        server.start()  # empty, as a restarted server without persistence
        await publish(2)

        async def all_held() -> bool:
            return all([await holds(0), await holds(1), await holds(2)])

        # Prompt 0 was only ever in the old server; without the rebuild it never comes back.
        await wait_for(all_held, "every prompt back in the restarted store")
        assert store.dropped_writes_total >= 1 and store.outages_total == 1
    finally:
        await views.stop()
        await pod.close()
        context.destroy(linger=0)


async def _true(value: bool) -> bool:
    return value


async def test_replicas_share_the_streams_and_take_over_a_dead_ones(
    server: KVStoreServer,
) -> None:
    # Two replicas on one store, eight pods publishing real KV-event frames: each pod's stream
    # is ingested by exactly one replica, both read everything; one replica dies without
    # leaving (its lease lapses) and the other takes its pods over, catching up from their
    # replay buffers, so the events published meanwhile are not lost.
    import time

    import zmq.asyncio

    from indexer.events import encode_batch
    from tests.indexer.test_subscriber import FakeVLLMPod

    settings = {
        "blockSize": BLOCK,
        "selfCheck": False,
        "kvBlockIndexConfig": {
            "redisConfig": {"address": server.address, "namespace": "own", "leaseSeconds": 1.0}
        },
    }
    replicas = [_plugin(settings), _plugin(settings)]
    context = zmq.asyncio.Context()
    pods = [FakeVLLMPod(context) for _ in range(8)]
    names = [f"10.0.1.{i}:8000" for i in range(8)]

    def prompt(pod: int, round_: int) -> list[int]:
        return [100_000 * round_ + 1000 * pod + t for t in range(BLOCK * 4)]

    async def publish(round_: int) -> None:
        for i, pod in enumerate(pods):
            batch = KVEventBatch(ts=0.0, events=(_stored(prompt(i, round_)),))
            await pod.publish(payload=encode_batch(batch))

    async def all_held(plugin: PrecisePrefixCacheScorer, round_: int) -> bool:
        view = plugin.view
        assert view.flush()
        for i, name in enumerate(names):
            keys = block_hashes(prompt(i, round_), block_size=BLOCK, algo="sha256")
            if (await view.lookup(keys, [name])).blocks[name] != 4:
                return False
        return True

    async def wait_for(condition: Any, what: str, timeout: float = 20.0) -> None:
        deadline = asyncio.get_running_loop().time() + timeout
        while not await condition():
            if asyncio.get_running_loop().time() > deadline:
                raise AssertionError(f"timed out waiting for {what}")
            await publish_round_if_needed()
            await asyncio.sleep(0.05)

    republish = [True]

    async def publish_round_if_needed() -> None:
        if republish[0]:
            await publish(0)  # PUB/SUB's slow joiner: publish until delivered

    def ownership(plugin: PrecisePrefixCacheScorer) -> set[str]:
        owned = plugin.view._ownership
        assert owned is not None
        return set(owned.owned)

    try:
        for plugin in replicas:
            await plugin.context.kv_caches.start()
        for plugin in replicas:
            for name, pod in zip(names, pods, strict=True):
                plugin.context.kv_caches.endpoint_added(
                    Endpoint(address=name, kv_events_url=pod.pub_url, replay_url=pod.replay_url)
                )

        async def shared_out() -> bool:
            a, b = ownership(replicas[0]), ownership(replicas[1])
            return not a & b and a | b == set(names)

        await wait_for(shared_out, "the pods shared out between the replicas")
        for plugin in replicas:  # both read every pod's entries, whoever wrote them
            await wait_for(lambda p=plugin: all_held(p, 0), "round 0 in the store")

        # Replica 0 dies: its renewals and sockets stop, its lease is left to lapse.
        dead = replicas[0].view
        assert dead._ownership is not None and dead._ownership._thread is not None
        dead._ownership._stopping.set()  # renewals stop; the lease is not given up
        assert dead._subscriber is not None
        await dead._subscriber.close()
        dead._subscriber = None
        died = time.monotonic()
        republish[0] = False
        # Published once, while its pods have no ingesting replica: only the survivor's
        # catch-up from the pods' replay buffers can bring these into the store.
        await publish(1)
        await wait_for(
            lambda: _true(ownership(replicas[1]) == set(names)), "the survivor to own every pod"
        )
        failover = time.monotonic() - died
        await wait_for(lambda: all_held(replicas[1], 1), "round 1 of every pod in the store")
        assert failover < 1.0 + 1.0, f"failover took {failover:.2f} s"
        assert await all_held(replicas[1], 0)
    finally:
        for plugin in replicas:
            await plugin.context.kv_caches.stop()
        for pod in pods:
            await pod.close()
        context.destroy(linger=0)


async def test_a_replica_whose_renewals_time_out_keeps_its_streams(
    server: KVStoreServer,
) -> None:
    # The store is kept busy (a script) for longer than the lease: renewals time out, are
    # counted, and the replica keeps ingesting its pods (the server often applied the renewal
    # anyway, so no other replica would take them); once the store answers, nothing moved.
    import threading

    from kvcache.ownership import StreamOwnership
    from scorers.base import Endpoint

    store = _store(server, namespace="busy-lease")
    subscribed: list[str] = []
    unsubscribed: list[str] = []
    ownership = StreamOwnership(
        store,
        0.6,
        lambda endpoint: subscribed.append(endpoint.address),
        unsubscribed.append,
        replica="only",
    )
    client = valkey.Valkey.from_url(server.address, socket_timeout=10)
    busy = client.register_script(
        "local t0 = redis.call('TIME') "
        "repeat local t = redis.call('TIME') "
        "until (t[1] - t0[1]) * 1000000 + (t[2] - t0[2]) > 2000000 return 0"
    )
    try:
        await ownership.start(None)
        ownership.endpoint_added(Endpoint(address=PODS[0]))
        assert ownership.owned == {PODS[0]}
        blocker = threading.Thread(target=busy)
        blocker.start()
        await asyncio.to_thread(blocker.join)
        assert store.renew_timeouts_total >= 1
        await asyncio.sleep(0.5)  # a renewal after the store answers again
        assert ownership.owned == {PODS[0]} and unsubscribed == [] and subscribed == [PODS[0]]
    finally:
        await ownership.stop()
        client.close()
        store.stop()
