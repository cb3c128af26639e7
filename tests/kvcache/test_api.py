"""The KV-cache gRPC API: stubs that match the proto, and a client in another process
(``epp kv``) getting the same per-pod scores the precise scorer used."""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

import grpc
import pytest

from indexer.events import BlockStored, KVEventBatch
from indexer.hashing import block_hashes
from kvcache.api import kvcache_pb2 as pb
from kvcache.api import kvcache_pb2_grpc as pb_grpc
from kvcache.api.generate import generate
from kvcache.api.service import start_kv_cache_server
from scorers.base import Endpoint, LLMRequest, PluginContext, create_plugin
from scorers.precise_prefix import PrecisePrefixCacheScorer
from tests.scorers.plugin_helpers import StaticEndpoints

REPO = Path(__file__).resolve().parents[2]
PODS = ["10.0.0.1:8000", "10.0.0.2:8000", "10.0.0.3:8000"]


def test_committed_stubs_are_what_the_proto_generates(tmp_path: Path) -> None:
    for made in generate(tmp_path):
        committed = REPO / "kvcache" / "api" / made.name
        assert made.read_bytes() == committed.read_bytes(), (
            f"{committed} is stale: run python -m kvcache.api.generate"
        )


def _plugin(tokenizer_dir: Path) -> PrecisePrefixCacheScorer:
    endpoints = [Endpoint(address=a) for a in PODS]

    plugin = create_plugin(
        "precise-prefix-cache-scorer",
        "p",
        {"blockSize": 16, "tokenizer": str(tokenizer_dir)},
        PluginContext(endpoints=StaticEndpoints(endpoints)),
    )
    assert isinstance(plugin, PrecisePrefixCacheScorer)
    return plugin


async def _epp_kv(*args: str) -> tuple[int, str, str]:
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "epp.cli",
        "kv",
        *args,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await proc.communicate()
    assert proc.returncode is not None
    return proc.returncode, out.decode(), err.decode()


def test_a_client_in_another_process_gets_the_scores_the_scorer_used(
    llama3_tokenizer_dir: Path,
) -> None:
    plugin = _plugin(llama3_tokenizer_dir)
    messages = [
        {"role": "system", "content": "You are the support assistant of Acme. " * 20},
        {"role": "user", "content": "My router reboots every night."},
    ]
    tokenizer = plugin.view._tokenizer_for("*")
    assert tokenizer is not None
    ids = tokenizer.encode_chat(messages)
    keys = block_hashes(ids, block_size=16, algo="sha256")
    held = {PODS[0]: len(keys), PODS[1]: len(keys) // 2}  # PODS[2] holds nothing
    for pod, count in held.items():
        event = BlockStored(
            block_hashes=tuple(keys[:count]),
            parent_block_hash=None,
            token_ids=tuple(ids[: 16 * count]),
            block_size=16,
        )
        plugin.view.apply(pod, KVEventBatch(ts=0.0, events=(event,)))

    async def run() -> tuple[dict[str, float], dict[str, object], tuple[int, str, str]]:
        views = plugin.context.kv_caches
        await views.start()
        server, port = await start_kv_cache_server(views, None, "127.0.0.1", 0)
        try:
            request = LLMRequest(
                request_id="r",
                model="m",
                kind="chat",
                messages=messages,
                body={"model": "m", "messages": messages},
            )
            eps = [Endpoint(address=a) for a in PODS]
            await plugin.prepare(request, eps)
            used = plugin.score(request, eps)
            endpoint_flags = [f for pod in PODS for f in ("--endpoint", pod)]
            address = f"127.0.0.1:{port}"
            code, out, err = await _epp_kv(
                "score", "--address", address, "--model", "m",
                "--chat-json", json.dumps(messages), "--json", *endpoint_flags,
            )  # fmt: skip
            assert code == 0, err
            bad = await _epp_kv("score", "--address", address, "--model", "m", "--chat-json", "{")
            return used, json.loads(out), bad
        finally:
            await server.stop(None)
            await views.stop()

    used, answer, bad = asyncio.run(run())
    scores = {pod["endpoint"]: pod["score"] for pod in answer["pods"]}  # type: ignore[index]
    assert scores == pytest.approx(used)
    assert scores[PODS[0]] == 1.0 and 0 < scores[PODS[1]] < 1 and scores[PODS[2]] == 0
    assert answer["totalBlocks"] == len(keys) and answer["blockSize"] == 16
    assert bad[0] == 1 and "INVALID_ARGUMENT" in bad[2] and "chat_json is not JSON" in bad[2]


def test_lookup_and_errors_over_grpc() -> None:
    async def run() -> None:
        context = PluginContext(endpoints=None)  # type: ignore[arg-type]
        views = context.kv_caches
        server, port = await start_kv_cache_server(views, None, "127.0.0.1", 0)
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                stub = pb_grpc.KVCacheStub(channel)
                with pytest.raises(grpc.aio.AioRpcError) as caught:
                    await stub.Lookup(pb.LookupRequest(block_keys=[1, 2]))
                assert caught.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        finally:
            await server.stop(None)

    asyncio.run(run())


def test_score_refuses_what_it_cannot_tokenize_or_hash() -> None:
    # No tokenizer for the model, or a block size not known yet: an error that says so, not a
    # table of zeros that looks like "no pod holds this prompt".
    async def run() -> list[tuple[grpc.StatusCode, str]]:
        endpoints = [Endpoint(address=a) for a in PODS]
        with_size = create_plugin(
            "precise-prefix-cache-scorer",
            "p",
            {"blockSize": 16},
            PluginContext(endpoints=StaticEndpoints(endpoints)),
        )
        without_size = create_plugin(
            "precise-prefix-cache-scorer",
            "p",
            {},
            PluginContext(endpoints=StaticEndpoints(endpoints)),
        )
        errors = []
        for plugin, request in (
            (with_size, pb.ScoreRequest(model="m", text="hello")),
            (without_size, pb.ScoreRequest(model="m", token_ids=pb.TokenIds(ids=[1, 2, 3]))),
        ):
            views = plugin.context.kv_caches
            server, port = await start_kv_cache_server(views, None, "127.0.0.1", 0)
            try:
                async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                    with pytest.raises(grpc.aio.AioRpcError) as caught:
                        await pb_grpc.KVCacheStub(channel).Score(request)
                    errors.append((caught.value.code(), caught.value.details() or ""))
            finally:
                await server.stop(None)
        return errors

    (code1, text1), (code2, text2) = asyncio.run(run())
    assert code1 == grpc.StatusCode.FAILED_PRECONDITION and "no tokenizer" in text1
    assert code2 == grpc.StatusCode.FAILED_PRECONDITION and "block size" in text2
