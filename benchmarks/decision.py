"""Decision latency of the endpoint picker, measured through its real ext_proc gRPC server.

    python -m benchmarks.decision [--endpoints 16] [--requests 200] [--json OUT]

What is timed, per request: a gRPC client sends the ext_proc ``request_headers`` and the whole
``request_body`` on one stream, and the clock stops when the EPP's headers response (carrying
the destination) arrives.  That covers parsing, tokenization (chat template), vLLM block hashing,
the KV-index lookup, every scorer and the picker.  The configuration is the precise scorer with
the queue and KV-utilization scorers (weights 3/2/2) over ``--endpoints`` static endpoints, four
of which hold the shared system prompt in the KV index.

Cases: the first three decisions after start (the gRPC connection already open, as Envoy's
is); a burst of twelve conversations opened at once on a system prompt not seen before; 2k- and
8k-token chat prompts, ``cold`` (every prompt new: tokenize and hash everything) and ``warm`` (a
shared system prompt seen before, a new user turn: the "prefix seen recently" case of
docs/design.md, "Targets").  Each row has the longest decision (``max``) beside the
percentiles: a stall shows there.  ``schedule-only`` times the scheduler core alone (filters,
scorers, picker) with 64 endpoints and an 8k-token prompt.  Everything runs in this process (no
Envoy, no subprocess, so no process-launch helpers); Envoy's own share is the figure in
docs/toolchain.md §1, "Envoy and the ext_proc stubs" (p50 2.0 ms per request proxied with a
BUFFERED body).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import tempfile
import time
from collections.abc import AsyncIterator, Callable, Sequence
from pathlib import Path
from typing import Any

import grpc
from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ep_grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from benchmarks.reports import write_json
from epp.config import build_scheduler, load_config
from epp.datastore import Datastore, EndpointSpec
from epp.director import Director
from epp.extproc_server import start_extproc_server
from epp.health import EXTPROC_SERVICE, HealthService, add_health_service
from indexer.events import BlockStored, KVEventBatch
from indexer.hashing import block_hashes
from indexer.tokenization import PromptTokenizer
from indexer.tokenizer_assets import build_llama3_tokenizer_dir
from launcher.configs import weighted_config
from launcher.traffic import SUPPORT_WORDS
from scorers.base import EndpointMetrics, LLMRequest, PluginContext
from scorers.precise_prefix import PrecisePrefixCacheScorer

BURST = 12  # conversations opened at once in the burst case (``make demo``'s concurrency)


def _text(rng: random.Random, tokens: int) -> str:
    # About one Llama-3 token per word plus a space.
    return " ".join(rng.choice(SUPPORT_WORDS) for _ in range(tokens))


def _chat(messages: list[dict[str, Any]]) -> bytes:
    return json.dumps({"model": "llama3", "messages": messages}).encode()


def _chat_cases(
    rng: random.Random, size: int, shared: list[dict[str, Any]]
) -> dict[str, Callable[[], bytes]]:
    """Request-body makers for the ``cold`` case (a new ``size``-token prompt each call) and the
    ``warm`` case (the ``shared`` system prompt, a new user turn each call)."""

    def cold() -> bytes:
        return _chat(
            [
                {"role": "system", "content": _text(rng, size - 200)},
                {"role": "user", "content": _text(rng, 150)},
            ]
        )

    def warm() -> bytes:
        return _chat([*shared, {"role": "user", "content": _text(rng, 150)}])

    return {"cold": cold, "warm": warm}


def _stored(ids: Sequence[int]) -> BlockStored:
    """The event a vLLM pod (block size 16, ``sha256``, no LoRA or salt) publishes when it
    caches the full blocks of ``ids``: how a benchmark puts a prompt in the index without a pod."""
    keys = block_hashes(ids, block_size=16, algo="sha256")
    return BlockStored(
        block_hashes=tuple(keys),
        parent_block_hash=None,
        token_ids=tuple(ids[: 16 * len(keys)]),
        block_size=16,
        extra_keys=(None,) * len(keys),
    )


def _config(tokenizer_dir: Path) -> str:
    return weighted_config(
        {"precise-prefix-cache-scorer": 3, "queue-scorer": 2, "kv-cache-utilization-scorer": 2},
        {"precise-prefix-cache-scorer": {"blockSize": 16, "tokenizer": str(tokenizer_dir)}},
    )


def _percentiles(samples: list[float]) -> dict[str, float]:
    ordered = sorted(samples)
    return {
        "p50_ms": 1000 * statistics.median(ordered),
        "p99_ms": 1000 * ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))],
        "mean_ms": 1000 * statistics.fmean(ordered),
        "max_ms": 1000 * ordered[-1],
    }


async def one_decision(stub: Any, body: bytes, *, must_route: bool = False) -> float:
    """Seconds from sending a chat request's ext_proc headers and body on ``stub`` until the
    EPP answers with a destination or an immediate response; with ``must_route`` an immediate
    response (a rejection) raises instead."""
    headers = ep.HttpHeaders(
        headers=base_pb2.HeaderMap(
            headers=[
                base_pb2.HeaderValue(key=":path", raw_value=b"/v1/chat/completions"),
                base_pb2.HeaderValue(key=":method", raw_value=b"POST"),
                base_pb2.HeaderValue(key="content-type", raw_value=b"application/json"),
            ]
        ),
        end_of_stream=False,
    )
    queue: asyncio.Queue[ep.ProcessingRequest | None] = asyncio.Queue()

    async def messages() -> AsyncIterator[ep.ProcessingRequest]:
        while (item := await queue.get()) is not None:
            yield item

    start = time.perf_counter()
    call = stub.Process(messages())
    await queue.put(ep.ProcessingRequest(request_headers=headers))
    await queue.put(ep.ProcessingRequest(request_body=ep.HttpBody(body=body, end_of_stream=True)))
    async for response in call:
        if response.HasField("request_headers") or response.HasField("immediate_response"):
            elapsed = time.perf_counter() - start
            break
    else:
        raise RuntimeError("stream ended without a headers response")
    # Half-close and read the stream to its end: cancelling it instead makes grpc format a
    # traceback in this process, work the next decision would wait for.
    await queue.put(None)
    async for _ in call:
        pass
    if must_route and not response.HasField("request_headers"):
        raise RuntimeError(f"the EPP answered without a destination: {response}")
    return elapsed


async def run_extproc_cases(endpoints: int, requests: int, tokenizer_dir: Path) -> dict[str, Any]:
    datastore = Datastore(staleness_threshold=None)
    addresses = [f"10.0.{i // 250}.{i % 250 + 1}:8000" for i in range(endpoints)]
    for address in addresses:
        datastore.upsert(EndpointSpec(address=address))
        datastore.update_metrics(address, EndpointMetrics(waiting_requests=random.randrange(4)))
    context = PluginContext(endpoints=datastore)
    from concurrent.futures import ThreadPoolExecutor

    context.executor = ThreadPoolExecutor(max_workers=2)
    scheduler = build_scheduler(load_config(text=_config(tokenizer_dir)), context)
    plugin = scheduler.plugin("precise-prefix-cache-scorer")
    assert isinstance(plugin, PrecisePrefixCacheScorer)
    director = Director(datastore, scheduler)
    tok = PromptTokenizer.from_pretrained(tokenizer_dir)
    # Loads and warms the tokenizer, as `epp serve` does before it listens.
    await context.kv_caches.start(context.executor)
    await scheduler.start()
    health = HealthService(lambda: True)
    server = await start_extproc_server(
        director,
        port=0,
        host="127.0.0.1",
        extra_services=(lambda grpc_server: add_health_service(grpc_server, health),),
    )
    rng = random.Random(7)
    results: dict[str, Any] = {}
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            stub = ep_grpc.ExternalProcessorStub(channel)
            # Connected and health-checked before the clock starts, as Envoy's ext_proc
            # connection is: its health check asks the ext_proc port before traffic arrives.
            await channel.channel_ready()
            await health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=EXTPROC_SERVICE)
            )
            # The first decisions after start, before anything on the request path has run:
            # what the first burst after a roll-out waits for (a cold chat template, a cold
            # cache, first-use imports), next to the warm decisions below.
            system = _text(rng, 1848)
            first = [
                await one_decision(
                    stub,
                    _chat(
                        [
                            {"role": "system", "content": system},
                            {"role": "user", "content": _text(rng, 150)},
                        ]
                    ),
                )
                for _ in range(3)
            ]
            for i, elapsed in enumerate(first, 1):
                row = dict.fromkeys(("p50_ms", "p99_ms", "mean_ms", "max_ms"), 1000 * elapsed)
                results[f"decision {i} after start (2k)"] = row
            # A burst: twelve conversations open at once on a system prompt nobody has sent
            # yet (a roll-out, a new agent); every decision waits for the tokenization the
            # others are doing.  Timed per decision and for the whole burst.
            burst_system = [{"role": "system", "content": _text(rng, 1848)}]
            bodies = [
                _chat([*burst_system, {"role": "user", "content": _text(rng, 150)}])
                for _ in range(BURST)
            ]
            burst_start = time.perf_counter()
            burst = await asyncio.gather(*(one_decision(stub, body) for body in bodies))
            results[f"burst of {BURST} (2k, new prefix)"] = _percentiles(burst)
            results[f"burst of {BURST}: all decided"] = dict.fromkeys(
                ("p50_ms", "p99_ms", "mean_ms", "max_ms"),
                1000 * (time.perf_counter() - burst_start),
            )
            for size in (2048, 8192):
                system = _text(rng, size - 200)
                shared = [{"role": "system", "content": system}]
                # Four pods hold the shared system prompt, so lookups walk real index entries.
                stored = _stored(tok.encode_chat(shared))
                for address in addresses[:4]:
                    plugin.view.apply(address, KVEventBatch(ts=0.0, events=(stored,)))

                for name, make in _chat_cases(rng, size, shared).items():
                    for _ in range(5):  # warm-up: connections, first tokenizer load
                        await one_decision(stub, make())
                    samples = [await one_decision(stub, make()) for _ in range(requests)]
                    results[f"chat {size // 1024}k {name}"] = _percentiles(samples)
    finally:
        await server.stop(grace=None)
        await scheduler.stop()
        await context.kv_caches.stop()
        context.executor.shutdown()
    return results


def run_schedule_only(endpoints: int, requests: int) -> dict[str, Any]:
    """The synchronous scheduler core (scores from prepared data), for the p99 ≤ 1 ms target of
    docs/design.md ("Targets")."""
    datastore = Datastore(staleness_threshold=None)
    for i in range(endpoints):
        address = f"10.1.0.{i + 1}:8000"
        datastore.upsert(EndpointSpec(address=address))
        datastore.update_metrics(address, EndpointMetrics(waiting_requests=i % 5))
    context = PluginContext(endpoints=datastore)
    text = _config(Path("/nonexistent"))
    scheduler = build_scheduler(load_config(text=text), context)
    plugin = scheduler.plugin("precise-prefix-cache-scorer")
    assert isinstance(plugin, PrecisePrefixCacheScorer)
    tokens = [random.randrange(100_000) for _ in range(8192)]
    stored = _stored(tokens)
    for ep_ in datastore.endpoints()[:8]:
        plugin.view.apply(ep_.address, KVEventBatch(ts=0.0, events=(stored,)))
    candidates = datastore.endpoints()
    samples = []
    for i in range(requests + 20):
        request = LLMRequest(request_id=str(i), model="m", prompt=tokens)
        asyncio.run(scheduler.prepare(request, candidates))  # hashing + lookup, not timed
        start = time.perf_counter()
        scheduler.run_profiles(request, candidates)
        if i >= 20:
            samples.append(time.perf_counter() - start)
    return {f"schedule-only {endpoints} endpoints 8k": _percentiles(samples)}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--endpoints", type=int, default=16)
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--json", type=Path, help="also write the results as JSON")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        tokenizer_dir = build_llama3_tokenizer_dir(Path(tmp) / "tok")
        results = asyncio.run(run_extproc_cases(args.endpoints, args.requests, tokenizer_dir))
    results.update(run_schedule_only(64, args.requests))
    print(f"{'case':34} {'p50 ms':>8} {'p99 ms':>8} {'mean ms':>8} {'max ms':>8}")
    for name, row in results.items():
        print(
            f"{name:34} {row['p50_ms']:8.2f} {row['p99_ms']:8.2f} {row['mean_ms']:8.2f} "
            f"{row['max_ms']:8.2f}"
        )
    write_json(args.json, results)


if __name__ == "__main__":
    main()
