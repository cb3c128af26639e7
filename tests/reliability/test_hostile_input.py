"""Hostile input through the real stack: request bodies and headers from clients, KV events from a
rogue publisher registered as a pod.  The EPP answers what is wrong with a 400 that says why,
keeps serving everyone else, and keeps the honest pods' index entries whatever the rogue sends.
``cache_salt`` keeps tenants' prefixes apart in the index.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import zmq

from indexer.events import AllBlocksCleared, BlockStored, KVEventBatch, encode_batch
from launcher.configs import weighted_config
from launcher.observe import metric, scrape, true_entries, wait_for
from launcher.ports import reserve_port
from launcher.stack import MODEL, Stack
from launcher.traffic import Traffic, chat_body, failures
from tests.reliability.reporting import report

pytestmark = pytest.mark.slow

MAX_BODY = 1_000_000


class Fleet:
    def __init__(self, stack: Stack, rogue: zmq.Socket[bytes], rogue_address: str) -> None:
        self.stack = stack
        self.rogue = rogue
        self.rogue_address = rogue_address


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory, llama3_tokenizer_dir: Path) -> Iterator[Fleet]:
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    rogue = context.socket(zmq.PUB)
    rogue.setsockopt(zmq.LINGER, 0)
    rogue.setsockopt(zmq.SNDHWM, 1_000_000)
    pub_port = rogue.bind_to_random_port("tcp://127.0.0.1")
    # Nothing serves HTTP at the rogue's address: it is unreachable, so never a candidate, but
    # its events are received and indexed like any pod's.
    rogue_address = f"127.0.0.1:{reserve_port()}"
    stack = Stack.start(
        tmp_path_factory.mktemp("hostile"),
        llama3_tokenizer_dir,
        pods=2,
        epp_args=["--max-body-bytes", str(MAX_BODY)],
        config=weighted_config(
            {"precise-prefix-cache-scorer": 2, "queue-scorer": 1},
            {
                "precise-prefix-cache-scorer": {
                    "tokenizer": str(llama3_tokenizer_dir),
                    "maxIndexEntries": 20000,
                }
            },
        ),
        extra_endpoints=[{"address": rogue_address, "kvEventsUrl": f"tcp://127.0.0.1:{pub_port}"}],
    )
    try:
        yield Fleet(stack, rogue, rogue_address)
    finally:
        stack.stop()
        rogue.close(linger=0)
        context.term()


async def _post(
    gateway: str,
    body: bytes,
    headers: dict[str, str] | None = None,
    path: str = "/v1/chat/completions",
) -> tuple[int, str]:
    async with (
        aiohttp.ClientSession() as session,
        session.post(
            f"{gateway}{path}",
            data=body,
            headers={"content-type": "application/json", **(headers or {})},
            timeout=aiohttp.ClientTimeout(total=30),
        ) as resp,
    ):
        return resp.status, await resp.text()


def _post_json(gateway: str, body: Any, **kwargs: Any) -> tuple[int, str]:
    return asyncio.run(_post(gateway, json.dumps(body).encode(), **kwargs))


def _epp(fleet: Fleet) -> str:
    return scrape(fleet.stack.replicas[0].metrics_url)


# ---------------------------------------------------------------------------------------------
# Request bodies and headers


@pytest.mark.parametrize(
    ("body", "says"),
    [
        (b'{"model": "m", "messages": [{"role": "user", "content": "\xff\xfe"}]}', "UTF-8"),
        (b"[" * 100_000 + b"]" * 100_000, "nested too deeply"),
        (b'{"model": "m", "messages": [{"role": "user", "content": "hi"}', "not valid JSON"),
        (b'{"model": 123, "messages": []}', '"model" must be a string'),
        (b'{"model": "m", "messages": "hello"}', '"messages" must be a list'),
        (b'{"model": "m", "messages": [{"content": "x"}]}', 'has no string "role"'),
        (b'{"model": "m", "messages": [{"role": "user"}], "stream": "yes"}', '"stream" must be'),
        (b'{"model": "m", "messages": [{"role": "user"}], "cache_salt": 5}', '"cache_salt"'),
        (b"", "JSON"),  # body-less: routed by load, the model server says what is wrong
    ],
    ids=[
        "utf8",
        "deep",
        "truncated",
        "model-type",
        "messages-type",
        "role",
        "stream",
        "salt",
        "empty",
    ],
)
def test_invalid_bodies_get_400_saying_why(fleet: Fleet, body: bytes, says: str) -> None:
    status, text = asyncio.run(_post(fleet.stack.gateway, body))
    assert status == 400, text
    assert says in text


def test_a_body_over_the_limit_gets_400_without_being_buffered(fleet: Fleet) -> None:
    huge = json.dumps(
        {"model": MODEL, "messages": [{"role": "user", "content": "x " * MAX_BODY}]}
    ).encode()
    started = time.monotonic()
    status, text = asyncio.run(_post(fleet.stack.gateway, huge))
    assert status == 400 and "larger than the limit" in text
    report("body over --max-body-bytes", answered_in_s=time.monotonic() - started)


def test_a_long_valid_prompt_and_an_unknown_model_are_routed(fleet: Fleet) -> None:
    long_prompt = chat_body(99, 1, system_words=30_000)
    status, text = _post_json(fleet.stack.gateway, long_prompt)
    assert status == 200, text
    unknown = {**chat_body(1, 1), "model": "no-such-model"}
    status, text = _post_json(fleet.stack.gateway, unknown)
    assert status == 404, text  # the model server's own answer, passed through


def test_a_header_flood_is_stopped_by_envoy_and_the_epp_keeps_serving(fleet: Fleet) -> None:
    flood = {f"x-flood-{i}": "v" * 1_000 for i in range(200)}
    try:
        status, _ = _post_json(fleet.stack.gateway, chat_body(1, 2), headers=flood)
    except (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError):
        # Envoy answers 431 and closes; a client still writing the flood may see the close (or
        # a reset) before it reads the answer.
        status = 431
    assert status == 431
    status, _ = _post_json(fleet.stack.gateway, chat_body(1, 3))
    assert status == 200


def test_cache_salt_keeps_tenants_prefixes_apart(fleet: Fleet) -> None:
    gateway = fleet.stack.gateway
    name = "inference_extension_prefix_indexer_hit_ratio_sum"
    tenant_a = {**chat_body(7, 1, system_words=400), "cache_salt": "tenant-a"}
    assert _post_json(gateway, tenant_a)[0] == 200
    before = metric(_epp(fleet), name)
    # Tenant A again: the index knows its blocks (once the pod's events arrive).
    wait_for(
        lambda: (
            _post_json(gateway, tenant_a)[0] == 200 and metric(_epp(fleet), name) > before + 0.5
        ),
        "tenant A's prefix found in the index",
    )
    before = metric(_epp(fleet), name)
    tenant_b = {**tenant_a, "cache_salt": "tenant-b"}
    status, text = _post_json(gateway, tenant_b)
    assert status == 200, text
    assert metric(_epp(fleet), name) == before  # same text, other salt: no hit anywhere
    unsalted = {k: v for k, v in tenant_a.items() if k != "cache_salt"}
    assert _post_json(gateway, unsalted)[0] == 200
    assert metric(_epp(fleet), name) == before


# ---------------------------------------------------------------------------------------------
# A rogue KV-event publisher


def _send(rogue: zmq.Socket[bytes], seq: int, payload: bytes) -> None:
    rogue.send_multipart([b"", seq.to_bytes(8, "big"), payload])


def _stored(keys: range | list[int]) -> BlockStored:
    return BlockStored(
        block_hashes=tuple(keys), parent_block_hash=None, token_ids=(), block_size=16
    )


def test_a_rogue_publisher_cannot_break_the_index_or_the_service(fleet: Fleet) -> None:
    stack, rogue = fleet.stack, fleet.rogue
    with Traffic(stack.gateway, rate=20, max_seconds=60) as traffic:
        time.sleep(1)
        # The subscription may take a moment to reach the rogue (PUB/SUB slow joiner).
        seq = 0

        def rogue_seen() -> bool:
            nonlocal seq
            _send(rogue, seq, encode_batch(KVEventBatch(ts=0.0, events=(AllBlocksCleared(),))))
            seq += 1
            return metric(_epp(fleet), "inference_extension_kv_events_batches_applied") > 0

        wait_for(rogue_seen, "the rogue's first batch applied")
        errors_before = metric(_epp(fleet), "inference_extension_kv_events_decode_errors")
        malformed_before = metric(_epp(fleet), "inference_extension_kv_events_malformed_frames")
        # Garbage: not msgpack, msgpack of the wrong shape, wrong frame counts.
        for payload in (b"\xc1\xc1\xc1", b"\x93\x01\x02\x03", b"\x92\xa1x\xa1y", b""):
            _send(rogue, seq, payload)
            seq += 1
        rogue.send_multipart([b"only-one-frame"])
        rogue.send_multipart([b"", b"short", b"x"])
        # Forged sequence numbers: far jumps and going back.
        for forged in (seq + 10**6, seq + 10**9, 3, 2**63):
            _send(rogue, forged, encode_batch(KVEventBatch(ts=0.0, events=())))
        seq = 2**63 + 1
        # One enormous batch (over the 4 MiB decode limit), then a hash flood: 400k bogus blocks.
        _send(rogue, seq, b"\x93\xcb" + b"\x00" * 8 + b"\xdd" + b"\x00" * (6 << 20))
        seq += 1
        flood_started = time.monotonic()
        applied = metric(_epp(fleet), "inference_extension_kv_events_batches_applied")
        for start in range(0, 400_000, 2_000):
            batch = KVEventBatch(
                ts=0.0, events=(_stored(range(10**9 + start, 10**9 + start + 2_000)),)
            )
            _send(rogue, seq, encode_batch(batch))
            seq += 1
        wait_for(
            lambda: (
                metric(_epp(fleet), "inference_extension_kv_events_batches_applied")
                >= applied + 150
            ),
            "the flood ingested",
        )
        flood_s = time.monotonic() - flood_started
        time.sleep(1)
    text = _epp(fleet)
    assert metric(text, "inference_extension_kv_events_decode_errors") >= errors_before + 3
    assert metric(text, "inference_extension_kv_events_malformed_frames") >= malformed_before + 2
    assert not failures(traffic.outcomes), failures(traffic.outcomes)[:5]
    assert fleet.rogue_address not in {o.upstream for o in traffic.outcomes}
    # The honest pods' entries are exactly what they hold; the rogue evicted only its own.
    for i, pod in enumerate(stack.pods):
        wait_for(
            lambda pod=pod: (
                metric(
                    _epp(fleet),
                    "inference_extension_kv_index_endpoint_entries",
                    endpoint=pod.address,
                )
                == true_entries(pod)
            ),
            f"pod {i}'s entries intact",
        )
    rogue_entries = metric(
        text, "inference_extension_kv_index_endpoint_entries", endpoint=fleet.rogue_address
    )
    assert metric(text, "inference_extension_kv_index_entries") <= 20_000
    report(
        "rogue publisher: garbage, forged seqs, 6 MiB batch, 400k-block flood",
        requests=float(len(traffic.outcomes)),
        failed=float(len(failures(traffic.outcomes))),
        rogue_entries_kept=rogue_entries,
        flood_ingest_s=flood_s,
        p99_latency_ms=1000
        * sorted(o.latency for o in traffic.outcomes)[int(0.99 * (len(traffic.outcomes) - 1))],
    )
