"""The ``kvepp.kvcache.v1.KVCache`` gRPC service: the EPP's KV-cache view for other processes.

`epp serve --kv-cache-grpc-port N` runs it on its own port (off by default), with the standard
gRPC health service beside it.  ``Score`` tokenizes and hashes a prompt exactly as the precise
prefix scorer does (same view, same tokenizer, same keys) and answers per endpoint what the
scorer would use; ``Lookup`` takes raw block keys.  Tokenization and store lookups run in the
CPU executor, as on the request path.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Sequence
from concurrent.futures import Executor
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from indexer.errors import IndexerError
from kvcache.api import kvcache_pb2 as pb
from kvcache.api import kvcache_pb2_grpc as pb_grpc
from kvcache.view import ChatPrompt, KVCacheView, PrefixLookup
from kvcache.views import KVCacheViews

SERVICE_NAME = "kvepp.kvcache.v1.KVCache"


class KVCacheService(pb_grpc.KVCacheServicer):
    """Answers from the EPP's (first) KV-cache view."""

    def __init__(self, views: KVCacheViews, executor: Executor | None) -> None:
        self._views = views
        self._executor = executor

    def _view(self) -> KVCacheView:
        view = next(iter(self._views), None)
        if view is None:
            raise _Abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                "this EPP's configuration has no KV-cache view (no precise-prefix-cache-scorer)",
            )
        return view

    def _endpoints(self, asked: Sequence[str]) -> list[str]:
        return list(asked) if asked else self._views.endpoint_names()

    async def Score(
        self, request: pb.ScoreRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.ScoreResponse:
        try:
            view = self._view()
            if not request.model:
                raise _Abort(grpc.StatusCode.INVALID_ARGUMENT, "model is required")
            which = request.WhichOneof("prompt")
            if which is None:
                raise _Abort(
                    grpc.StatusCode.INVALID_ARGUMENT,
                    "one of text, token_ids, chat_json is required",
                )
            chat = _chat(request.chat_json) if which == "chat_json" else None
            loop = asyncio.get_running_loop()
            ids, keys = await loop.run_in_executor(
                self._executor, _keys_of, view, request, which, chat
            )
            endpoints = self._endpoints(request.endpoints)
            found = await view.lookup(keys, endpoints, self._executor)
        except _Abort as abort:
            await context.abort(abort.code, abort.message)
        except IndexerError as exc:  # tokenization or hashing refused the prompt
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        return pb.ScoreResponse(
            block_size=view.block_size or 0,
            total_blocks=len(keys),
            prompt_tokens=len(ids),
            pods=_pods(found, endpoints),
        )

    async def Lookup(
        self, request: pb.LookupRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.LookupResponse:
        try:
            view = self._view()
        except _Abort as abort:
            await context.abort(abort.code, abort.message)
        endpoints = self._endpoints(request.endpoints)
        found = await view.lookup(list(request.block_keys), endpoints, self._executor)
        return pb.LookupResponse(pods=_pods(found, endpoints))


class _Abort(Exception):
    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


def _chat(text: str) -> ChatPrompt:
    try:
        messages = json.loads(text)
    except json.JSONDecodeError as exc:
        raise _Abort(grpc.StatusCode.INVALID_ARGUMENT, f"chat_json is not JSON: {exc}") from exc
    if not isinstance(messages, list):
        raise _Abort(grpc.StatusCode.INVALID_ARGUMENT, "chat_json must be a JSON list of messages")
    return ChatPrompt(messages=messages)


def _keys_of(
    view: KVCacheView, request: pb.ScoreRequest, which: str, chat: ChatPrompt | None
) -> tuple[list[int], list[int]]:
    """Token ids and block keys, as the precise scorer computes them.  CPU work."""
    if which == "token_ids":
        ids: list[int] | None = list(request.token_ids.ids)
    elif which == "text":
        ids = view.token_ids(request.model, prompt=request.text)
    else:
        ids = view.token_ids(request.model, chat=chat)
    if ids is None:
        raise _Abort(
            grpc.StatusCode.FAILED_PRECONDITION,
            f"no tokenizer is configured for model {request.model!r}; send token_ids",
        )
    keys = view.block_keys(ids, model=request.model, cache_salt=request.cache_salt or None)
    if keys is None:
        raise _Abort(
            grpc.StatusCode.FAILED_PRECONDITION,
            "the pods' block size is not known yet (set blockSize, or wait for their metrics "
            "or first KV event)",
        )
    return ids, keys


def _pods(found: PrefixLookup, endpoints: Sequence[str]) -> list[pb.PodMatch]:
    total = found.total_blocks
    return [
        pb.PodMatch(
            endpoint=endpoint,
            matched_blocks=found.blocks.get(endpoint, 0),
            weighted=found.weighted.get(endpoint, 0.0),
            score=found.weighted.get(endpoint, 0.0) / total if total else 0.0,
            held_blocks=found.held_blocks.get(endpoint, 0),
        )
        for endpoint in endpoints
    ]


async def start_kv_cache_server(
    views: KVCacheViews, executor: Executor | None, host: str, port: int
) -> tuple[grpc.aio.Server, int]:
    """The service and the gRPC health service on ``host:port`` (0: any free port)."""
    server = grpc.aio.server()
    pb_grpc.add_KVCacheServicer_to_server(KVCacheService(views, executor), server)  # type: ignore[no-untyped-call]
    checker = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(checker, server)
    bound = server.add_insecure_port(f"{host}:{port}")
    if bound == 0:
        raise OSError(f"KV-cache gRPC server could not bind {host}:{port}")
    await server.start()
    for name in ("", SERVICE_NAME):
        await checker.set(name, health_pb2.HealthCheckResponse.SERVING)
    return server, bound
