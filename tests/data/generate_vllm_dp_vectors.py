"""Golden KV-event messages of one data-parallel vLLM pod (four DP ranks), from a real vLLM.

Run it with the interpreter of the vLLM environment that `make vllm-env` builds:

    .venv-vllm/bin/python tests/data/generate_vllm_dp_vectors.py --out /tmp/dp.json

It writes the format of `vllm-0.32-data-parallel-events.json`.  With ``--data-parallel-size 4``
vLLM runs one engine (scheduler, `KVCacheManager`, KV-event publisher) per DP rank.  This script
does what each rank's scheduler does: a real `KVCacheManager` per rank caches, evicts and resets
blocks; after each step its events are taken (`KVCacheManager.take_events`), wrapped in
``KVEventBatch(ts, events)`` and handed to the rank's own publisher, made by
``EventPublisherFactory.create(KVEventsConfig(...), data_parallel_rank=rank)`` as the scheduler
makes it.  That real `ZmqEventPublisher` fills in ``data_parallel_rank``, offsets its endpoints by
the rank (`offset_endpoint_port`, here on ``inproc://`` addresses: no ports to reserve) and
encodes with its own ``msgspec.msgpack.Encoder``; the frames ``[topic, seq, payload]`` are read
back from its replay socket.  Nothing is hashed or encoded by this script.

The expected cache contents (``held_after_phase``) are read from each rank's `BlockPool` (the
hashes of its cached blocks, converted by vLLM's ``maybe_convert_block_hash``), not derived from
the events.  Helpers shared with `generate_vllm_vectors.py` (requests, prefill, the KV-cache
manager, the generic msgpack decoding) are imported from it.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import msgspec
import vllm
import vllm.utils.hashing as vllm_hashing
import zmq
from generate_vllm_vectors import (
    events_manager,
    generic_decode,
    hash_seed,
    make_request,
    prefill,
    version_of,
    vllm_distribution,
)
from vllm.config.kv_events import KVEventsConfig
from vllm.distributed.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventPublisher,
    EventPublisherFactory,
    KVEventBatch,
    ZmqEventPublisher,
)
from vllm.v1.core.kv_cache_manager import KVCacheManager
from vllm.v1.core.kv_cache_utils import (
    get_block_hash,
    get_request_block_hasher,
    init_none_hash,
    maybe_convert_block_hash,
)
from vllm.v1.request import Request

Json = dict[str, Any]

TITLE = "KV-event messages of one data-parallel vLLM pod (4 DP ranks): golden vectors"
DP_SIZE = 4
BLOCK_SIZE = 16  # = hash block size; sha256 (vLLM's default), PYTHONHASHSEED unset
# What every rank's engine is configured with (one --kv-events-config for the whole pod).  The
# topic is not per rank: every rank publishes the same one.  inproc:// instead of vLLM's usual
# tcp://*:5557 so the script binds no ports; the publisher offsets both the same way (the tcp
# results of `offset_endpoint_port` are in `offset_endpoint_port`).
PUB_ENDPOINT = "inproc://dp-golden-kv-events"
REPLAY_ENDPOINT = "inproc://dp-golden-kv-events-replay"
TOPIC = "kv@10.244.0.7@Qwen/Qwen3-0.6B"
BASE_TS = 1767225600.0

# Endpoints whose per-rank offsets are recorded (vLLM's default, the chart's replay default, a
# connect address as in central mode, an inproc address and the OS-chosen port 0).
OFFSET_EXAMPLES = (
    "tcp://*:5557",
    "tcp://*:5558",
    "tcp://*:5657",
    "tcp://10.0.0.1:5557",
    "inproc://kv-events",
    "tcp://*:0",
)

SHARED_PREFIX = list(range(1000, 1016))  # one block, the first of rank 0's and rank 1's prompt a


def prompt_tokens(rank: int, name: str) -> list[int]:
    """The prompts each rank caches: ``a`` (3 blocks; ranks 0 and 1 start it with the same
    block), ``b`` (2 blocks) and ``c`` (2 blocks, cached by rank 3 after its restart)."""
    base = (rank + 1) * 10_000
    if name == "a":
        if rank in (0, 1):
            return SHARED_PREFIX + [base + i for i in range(32)]
        return [base + i for i in range(48)]
    if name == "b":
        return [base + 5_000 + i for i in range(32)]
    if name == "c":
        return [base + 7_000 + i for i in range(32)]
    raise ValueError(name)


TOKEN_NOTE = (
    "prompt a: ranks 0 and 1 = list(range(1000,1016)) + [(rank+1)*10000 + i for i in range(32)],"
    " ranks 2 and 3 = [(rank+1)*10000 + i for i in range(48)]; prompt b = [(rank+1)*10000 + 5000"
    " + i for i in range(32)]; prompt c (rank 3 after its restart) = [(rank+1)*10000 + 7000 + i"
    " for i in range(32)].  Block size 16: a = 3 blocks, b and c = 2 blocks.  The first block of"
    " a is the same on ranks 0 and 1 (same tokens, no parent), so both publish its hash."
)

PHASES = {
    "initial": (
        "every rank: step 0 prefills its prompt a (one BlockStored of 3 hashes), step 1 prefills"
        " its prompt b (one BlockStored of 2 hashes); both requests stay running"
    ),
    "rank2_cache_reset": (
        "rank 2 only, step 2: both requests finish (freed) and reset_prefix_cache runs -> one"
        " batch [AllBlocksCleared]"
    ),
    "rank1_eviction": (
        "rank 1 only, step 2: request a finishes (freed) and every free block is handed out again,"
        " which evicts a's 3 cached blocks -> one batch of 3 BlockRemoved (the shared block among"
        " them); request b stays running"
    ),
    "rank3_restart": (
        "rank 3's engine process restarts: a new KVCacheManager (empty cache) and a new publisher"
        " (seq from 0, empty replay buffer; no AllBlocksCleared is sent at start-up), which"
        " prefills its prompt c -> one BlockStored of 2 hashes at seq 0"
    ),
}


# ---------------------------------------------------------------------------------------------
# One rank's engine


@dataclass
class Rank:
    """One DP rank's engine: its KV-cache manager and its own publisher."""

    rank: int
    generation: int = 0
    manager: KVCacheManager = field(default_factory=events_manager)
    publisher: EventPublisher | None = None
    requests: dict[str, Request] = field(default_factory=dict)
    batches: list[Json] = field(default_factory=list)  # what was published, with its phase

    def start_publisher(self) -> None:
        # A restarted engine binds the same addresses again; inproc names are only free once the
        # old sockets are closed, which `shutdown` does.
        config = KVEventsConfig(
            enable_kv_cache_events=True,
            publisher="zmq",
            endpoint=PUB_ENDPOINT,
            replay_endpoint=REPLAY_ENDPOINT,
            topic=TOPIC,
        )
        # vLLM's shutdown joins its publisher thread with a timeout: on a loaded machine the old
        # sockets may close a moment later, so binding again is retried for a few seconds.
        deadline = time.monotonic() + 10.0
        while True:
            try:
                self.publisher = EventPublisherFactory.create(config, data_parallel_rank=self.rank)
                break
            except zmq.ZMQError as exc:
                if exc.errno != zmq.EADDRINUSE or time.monotonic() > deadline:
                    raise
                time.sleep(0.05)
        assert isinstance(self.publisher, ZmqEventPublisher)

    def step(self, phase: str, step: int) -> None:
        """What the scheduler does after a step: take the manager's events, publish one batch."""
        events = self.manager.take_events()
        assert events, f"rank {self.rank} step {step}: no events"
        ts = BASE_TS + 0.25 * step + 0.001 * self.rank
        assert self.publisher is not None
        self.publisher.publish(KVEventBatch(ts=ts, events=events))
        self.batches.append(
            {"phase": phase, "step": step, "generation": self.generation, "events": events}
        )

    def prefill(self, name: str, hasher: Any) -> None:
        request = make_request(f"rank{self.rank}-{name}", prompt_tokens(self.rank, name), hasher)
        prefill(self.manager, request)
        self.requests[name] = request

    def held(self) -> list[int]:
        """The uint64 keys of the blocks this rank's cache holds now, as vLLM would publish them."""
        pool = self.manager.block_pool
        return sorted(
            maybe_convert_block_hash(get_block_hash(b.block_hash))
            for b in pool.blocks
            if b.block_hash is not None
        )

    def published_frames(self, timeout: float = 10.0) -> list[tuple[bytes, bytes, bytes]]:
        """Every (topic, seq, payload) this generation's publisher sent, from its replay ROUTER."""
        assert isinstance(self.publisher, ZmqEventPublisher)
        replay_url = self.publisher.get_publisher_config().replay_endpoint
        assert replay_url is not None
        wanted = sum(1 for b in self.batches if b["generation"] == self.generation)
        dealer = zmq.Context.instance().socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.setsockopt(zmq.RCVTIMEO, int(timeout * 1000))
        dealer.connect(replay_url)
        try:
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline:
                frames = replay_all(dealer)
                if len(frames) == wanted:  # the publisher thread has sent them all
                    return frames
                time.sleep(0.05)
            raise TimeoutError(f"rank {self.rank}: the publisher replayed {len(frames)} batches")
        finally:
            dealer.close()


def replay_all(dealer: zmq.Socket[bytes]) -> list[tuple[bytes, bytes, bytes]]:
    """The replay buffer from seq 0 as (topic, seq, payload), DEALER framing (b'' first)."""
    dealer.send_multipart([b"", (0).to_bytes(8, "big")])
    out = []
    while True:
        _, topic, seq, payload = dealer.recv_multipart()
        if not topic and seq == ZmqEventPublisher.END_SEQ:
            return out
        out.append((topic, seq, payload))


# ---------------------------------------------------------------------------------------------
# The scenario


def run_scenario() -> tuple[list[Rank], dict[str, list[list[int]]], list[Json]]:
    """Run the phases; returns the ranks, each phase's held keys per rank, and the frames of
    every generation that ended (rank 3's first process) as they were before its restart."""
    hash_fn = vllm_hashing.get_hash_fn_by_name("sha256")
    with hash_seed(None):
        init_none_hash(hash_fn)
    hasher = get_request_block_hasher(BLOCK_SIZE, hash_fn)
    ranks = [Rank(r) for r in range(DP_SIZE)]
    for r in ranks:
        r.start_publisher()
    held: dict[str, list[list[int]]] = {}
    ended: list[Json] = []

    for r in ranks:
        r.prefill("a", hasher)
        r.step("initial", 0)
        r.prefill("b", hasher)
        r.step("initial", 1)
    held["initial"] = [r.held() for r in ranks]

    two = ranks[2]
    two.manager.free(two.requests["a"])
    two.manager.free(two.requests["b"])
    assert two.manager.reset_prefix_cache()
    two.step("rank2_cache_reset", 2)
    held["rank2_cache_reset"] = [r.held() for r in ranks]

    one = ranks[1]
    one.manager.free(one.requests["a"])
    pool = one.manager.block_pool
    pool.free_blocks(pool.get_new_blocks(pool.get_num_free_blocks()))
    one.step("rank1_eviction", 2)
    held["rank1_eviction"] = [r.held() for r in ranks]

    three = ranks[3]
    ended.append(rank_record(three, three.published_frames()))
    assert three.publisher is not None
    three.publisher.shutdown()
    three.generation += 1
    three.manager = events_manager()
    three.requests = {}
    three.start_publisher()
    three.prefill("c", hasher)
    three.step("rank3_restart", 0)
    held["rank3_restart"] = [r.held() for r in ranks]
    return ranks, held, ended


def event_summary(event: Any) -> Json:
    """An event as this file's readers need it: type and uint64 block hashes."""
    if isinstance(event, BlockStored):
        return {
            "type": "BlockStored",
            "block_hashes_uint64": [str(h) for h in event.block_hashes],
            "parent_block_hash_uint64": (
                None if event.parent_block_hash is None else str(event.parent_block_hash)
            ),
            "num_tokens": len(event.token_ids),
            "block_size": event.block_size,
            "medium": event.medium,
        }
    if isinstance(event, BlockRemoved):
        return {
            "type": "BlockRemoved",
            "block_hashes_uint64": [str(h) for h in event.block_hashes],
            "medium": event.medium,
        }
    assert isinstance(event, AllBlocksCleared), event
    return {"type": "AllBlocksCleared"}


def rank_record(rank: Rank, frames: list[tuple[bytes, bytes, bytes]]) -> Json:
    """One generation of one rank: its publisher's resolved endpoints and every batch."""
    assert isinstance(rank.publisher, ZmqEventPublisher)
    config = rank.publisher.get_publisher_config()
    published = [b for b in rank.batches if b["generation"] == rank.generation]
    assert len(frames) == len(published), (len(frames), len(published))
    batches = []
    encoder = msgspec.msgpack.Encoder()  # a second encoding, as the publisher's thread makes it
    for (topic, seq, payload), batch in zip(frames, published, strict=True):
        ts, _, dp_rank = msgspec.msgpack.decode(payload)
        again = encoder.encode(
            KVEventBatch(ts=ts, events=batch["events"], data_parallel_rank=rank.rank)
        )
        assert payload == again, "ZmqEventPublisher's payload differs from msgspec's encoding"
        assert dp_rank == rank.rank, (dp_rank, rank.rank)
        batches.append(
            {
                "seq": int.from_bytes(seq, "big"),
                "phase": batch["phase"],
                "step": batch["step"],
                "frames": {
                    "topic_hex": topic.hex(),
                    "seq_hex": seq.hex(),
                    "payload_hex": payload.hex(),
                },
                "topic": topic.decode(),
                "data_parallel_rank": dp_rank,
                "ts": ts,
                "events": [event_summary(e) for e in batch["events"]],
                "payload_decoded_generic_msgpack": generic_decode(payload),
            }
        )
    return {
        "data_parallel_rank": rank.rank,
        "generation": rank.generation,
        "publisher_endpoint": config.endpoint,
        "publisher_replay_endpoint": config.replay_endpoint,
        "requests": {
            name: {
                "token_ids": list(req.prompt_token_ids or []),
                "block_hashes_uint64": [str(maybe_convert_block_hash(h)) for h in req.block_hashes],
                "block_hashes_hex": [h.hex() for h in req.block_hashes],
            }
            for name, req in rank.requests.items()
        },
        "batches": batches,
    }


def offsets() -> Json:
    """`ZmqEventPublisher.offset_endpoint_port` for ranks 0..3 of each example endpoint."""
    return {
        endpoint: [ZmqEventPublisher.offset_endpoint_port(endpoint, r) for r in range(DP_SIZE)]
        for endpoint in OFFSET_EXAMPLES
    }


def provenance() -> Json:
    return {
        "vllm_version": (
            f"{vllm.__version__} (PyPI {vllm_distribution()}, commit id"
            f" {getattr(vllm, '__commit_id__', None) or 'not recorded in the wheel'})"
        ),
        "status": "COMPUTED WITH vLLM'S OWN CODE (not derived)",
        "how": (
            "tests/data/generate_vllm_dp_vectors.py, run with .venv-vllm/bin/python: one real"
            " KVCacheManager per DP rank (8 GPU blocks of 16 tokens, sha256, PYTHONHASHSEED"
            " unset, VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES default 1); after each step the"
            " manager's events (take_events) are published as KVEventBatch(ts, events) through"
            " the rank's own publisher, EventPublisherFactory.create(KVEventsConfig(publisher="
            f"'zmq', endpoint={PUB_ENDPOINT!r}, replay_endpoint={REPLAY_ENDPOINT!r},"
            f" topic={TOPIC!r}), data_parallel_rank=rank), which fills in the rank, offsets its"
            " endpoints and encodes; the frames are read back from its replay ROUTER."
            " held_after_phase is read from each rank's BlockPool."
        ),
        "generated_at": datetime.now(UTC).isoformat(timespec="seconds"),
        "python": f"{platform.python_implementation()} {platform.python_version()}",
        "libs": {
            "msgspec": version_of("msgspec"),
            "pyzmq": f"{zmq.pyzmq_version()} (libzmq {zmq.zmq_version()})",
        },
        "cross_checks": [
            "every payload equals msgspec.msgpack.Encoder().encode(KVEventBatch(ts, events,"
            " data_parallel_rank=rank)) of the events the manager produced",
            "every payload's third element (data_parallel_rank) equals the publisher's rank",
        ],
    }


FIELD_LEGEND = {
    "offset_endpoint_port": (
        "endpoint -> [ZmqEventPublisher.offset_endpoint_port(endpoint, rank) for rank 0..3]: what"
        " each rank of a pod started with that endpoint (or replay_endpoint) binds or connects"
    ),
    "ranks[].publisher_endpoint": (
        "the endpoint the rank's real publisher resolved (get_publisher_config().endpoint)"
    ),
    "ranks[].batches[].frames": (
        "the three ZMQ frames exactly as the PUB sends them: topic (UTF-8), seq (8-byte"
        " big-endian, from 0 per publisher), payload (msgspec msgpack of KVEventBatch ="
        " [ts, events, data_parallel_rank])"
    ),
    "ranks[].batches[].events": ("the decoded meaning; hashes as decimal strings (uint64 > 2**53)"),
    "ranks[].batches[].payload_decoded_generic_msgpack": (
        "the payload decoded with plain msgspec (hashes as {'uint64': '<decimal>'})"
    ),
    "ranks[].requests": (
        "the prompts the rank cached: token ids and vLLM's block hashes (Request.block_hashes)"
        " as raw digests and as the uint64 the events carry"
    ),
    "held_after_phase": (
        "phase -> per rank, the sorted uint64 keys of the blocks its BlockPool holds after the"
        " phase (what an index fed by that rank's events must attribute to it)"
    ),
    "shared_block_uint64": "the first block of prompt a on ranks 0 and 1 (same tokens, same hash)",
}


def build() -> Json:
    ranks, held, ended = run_scenario()
    records = [rank_record(r, r.published_frames()) for r in ranks]
    restarted = records[3]
    first_three = ended[0]
    shared = records[0]["requests"]["a"]["block_hashes_uint64"][0]
    assert shared == records[1]["requests"]["a"]["block_hashes_uint64"][0]
    for r in ranks:
        if r.publisher is not None:
            r.publisher.shutdown()
    return {
        "title": TITLE,
        "provenance": provenance(),
        "field_legend": FIELD_LEGEND,
        "data_parallel_size": DP_SIZE,
        "block_size": BLOCK_SIZE,
        "hash_algo": "sha256",
        "pythonhashseed": None,
        "kv_events_config": {
            "endpoint": PUB_ENDPOINT,
            "replay_endpoint": REPLAY_ENDPOINT,
            "topic": TOPIC,
        },
        "offset_endpoint_port": offsets(),
        "token_note": TOKEN_NOTE,
        "phases": PHASES,
        "shared_block_uint64": shared,
        # Rank 3's first process (before its restart) in ranks[3]'s place; the new process apart.
        "ranks": [*records[:3], first_three],
        "rank3_after_restart": restarted,
        "held_after_phase": {
            phase: [[str(k) for k in keys] for keys in per_rank] for phase, per_rank in held.items()
        },
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="the JSON file to write")
    args = parser.parse_args(argv)
    started = time.monotonic()
    logging.getLogger("vllm").setLevel(logging.ERROR)
    # The event hashes are vLLM's default integer form; a stray setting would change the format.
    os.environ.pop("VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES", None)
    data = build()
    args.out.write_text(json.dumps(data, indent=1) + "\n")
    batches = sum(len(r["batches"]) for r in data["ranks"]) + len(
        data["rank3_after_restart"]["batches"]
    )
    print(
        f"wrote {args.out}: {batches} batches from {DP_SIZE} DP ranks, vLLM {vllm.__version__},"
        f" {time.monotonic() - started:.1f} s after importing vLLM"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
