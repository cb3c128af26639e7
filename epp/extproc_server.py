"""The ext_proc gRPC server: a ``grpc.aio`` server whose ``Process`` streams are each handled by
one `epp.extproc.ExtProcStream`."""

from __future__ import annotations

import gc
import logging
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import Any

import grpc
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ext_proc_grpc

from epp.extproc import (
    ExtProcSettings,
    ExtProcStream,
    ProcessingRequest,
    ProcessingResponse,
    Router,
)

logger = logging.getLogger(__name__)


class ExtProcServicer(ext_proc_grpc.ExternalProcessorServicer):  # type: ignore[misc]
    """grpcio adapter: one `ExtProcStream` per ``Process`` call."""

    def __init__(self, router: Router, settings: ExtProcSettings | None = None) -> None:
        self._router = router
        self._settings = settings or ExtProcSettings()

    async def Process(
        self,
        request_iterator: AsyncIterator[ProcessingRequest],
        context: grpc.aio.ServicerContext[Any, Any],
    ) -> AsyncIterator[ProcessingResponse]:
        stream = ExtProcStream(self._router, self._settings)
        try:
            async for message in request_iterator:
                for response in await stream.handle(message):
                    yield response
        finally:
            # Normal end, Envoy's reset after the response, or client cancellation.
            stream.close()


@dataclass(slots=True)
class ExtProcServer:
    """A running ext_proc gRPC server and the port it listens on."""

    server: grpc.aio.Server
    port: int

    async def stop(self, grace: float | None = 5.0) -> None:
        await self.server.stop(grace)
        gc.unfreeze()  # what start froze may be garbage from now on


def settle_heap() -> None:
    """Collect once, then hide every object alive now from the cyclic garbage collector.

    What exists when the EPP starts serving (modules, the transformers tokenizers, config,
    compiled templates: about 93,000 tracked objects in `benchmarks.decision`) lives until it
    exits, yet every full collection walks all of it while holding the GIL, stalling decisions
    (28-80 ms per full collection measured at start-up).  ``gc.freeze`` moves them to a
    generation that is never examined; objects made later are collected as usual.
    """
    gc.collect()
    gc.freeze()


async def start_extproc_server(
    router: Router,
    *,
    port: int,
    host: str = "0.0.0.0",
    settings: ExtProcSettings | None = None,
    tls: grpc.ServerCredentials | None = None,
    extra_services: Sequence[Callable[[grpc.aio.Server], None]] = (),
) -> ExtProcServer:
    """Start a ``grpc.aio`` server with the ext_proc service on ``host:port`` (``port=0``
    picks a free port; the result says which).  ``tls``: server credentials for a secure
    port (building them from certificate files is the caller's job); None listens in
    plaintext.  ``extra_services``: functions registering more services on the same server
    (health, reflection).  Everything alive once it listens is frozen out of the garbage
    collector's full collections (`settle_heap`) until `ExtProcServer.stop`."""
    settings = settings or ExtProcSettings()
    # A BUFFERED body arrives in a single message: let gRPC accept the largest body we allow.
    max_message = settings.max_body_bytes + 1024 * 1024
    server = grpc.aio.server(
        options=[
            ("grpc.max_receive_message_length", max_message),
            ("grpc.max_send_message_length", max_message),
        ]
    )
    ext_proc_grpc.add_ExternalProcessorServicer_to_server(ExtProcServicer(router, settings), server)
    for register in extra_services:
        register(server)
    address = f"{host}:{port}"
    bound = (
        server.add_secure_port(address, tls)
        if tls is not None
        else server.add_insecure_port(address)
    )
    if bound == 0:
        raise OSError(f"ext_proc server could not bind {address}")
    await server.start()
    settle_heap()
    logger.info("ext_proc server listening on %s:%d", host, bound)
    return ExtProcServer(server=server, port=bound)
