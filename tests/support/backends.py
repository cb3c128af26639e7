"""Small HTTP backends standing in for vLLM pods: they record what they received and answer
with an echo (JSON) or, for ``"stream": true`` bodies, a fixed OpenAI-style SSE stream.  Test-only
body fields shape the stream: ``test_chunk_delay_s`` (pause between writes) and
``test_hold_after_first_chunk`` (send one event, then hang until the client disconnects).

aiohttp sets TCP_NODELAY on its sockets, so there is no Nagle / delayed-ACK stall (the gotcha
with ``http.server`` backends in docs/toolchain.md §1).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import socket
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

# What every backend reports as usage; the SSE stream carries it in its final data event.
USAGE = {
    "prompt_tokens": 7,
    "completion_tokens": 3,
    "total_tokens": 10,
    "prompt_tokens_details": {"cached_tokens": 4},
}


def sse_chunks(backend: str) -> list[bytes]:
    """The exact bytes a backend streams, one write per element."""
    events: list[dict[str, Any]] = [
        {"id": "cmpl-1", "object": "text_completion", "choices": [{"index": 0, "text": text}]}
        for text in ("Hé", "llo", f" from {backend}")
    ]
    events.append({"id": "cmpl-1", "object": "text_completion", "choices": [], "usage": USAGE})
    chunks = [f"data: {json.dumps(e, ensure_ascii=False)}\n\n".encode() for e in events]
    return [*chunks, b"data: [DONE]\n\n"]


@dataclass(frozen=True)
class ReceivedRequest:
    backend: str
    method: str
    path: str
    headers: dict[str, str]
    body: bytes


@dataclass
class Backend:
    name: str
    runner: web.AppRunner
    port: int = 0
    received: list[ReceivedRequest] = field(default_factory=list)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"


async def start_backend(name: str) -> Backend:
    backend: Backend

    async def handle(request: web.Request) -> web.StreamResponse:
        body = await request.read()
        backend.received.append(
            ReceivedRequest(
                backend=name,
                method=request.method,
                path=request.path_qs,
                headers={k.lower(): v for k, v in request.headers.items()},
                body=body,
            )
        )
        try:
            document = json.loads(body) if body else None
        except ValueError:
            document = None
        if isinstance(document, dict) and document.get("stream") is True:
            response = web.StreamResponse(headers={"content-type": "text/event-stream"})
            await response.prepare(request)
            delay = float(document.get("test_chunk_delay_s", 0.005))
            for index, chunk in enumerate(sse_chunks(name)):
                if index == 1 and document.get("test_hold_after_first_chunk"):
                    # Keep the stream open until the client goes away (the handler is then
                    # cancelled); a safety timeout ends it otherwise.
                    await asyncio.sleep(60)
                await response.write(chunk)
                await asyncio.sleep(delay)  # separate writes, so Envoy sees several chunks
            await response.write_eof()
            return response
        return web.json_response(
            {
                # The model it was asked for, as a model server names it in its reply.
                **(
                    {"model": document["model"]}
                    if isinstance(document, dict) and "model" in document
                    else {}
                ),
                "backend": name,
                "method": request.method,
                "path": request.path_qs,
                "body_sha256": hashlib.sha256(body).hexdigest(),
                "body_len": len(body),
                "usage": USAGE,
            }
        )

    app = web.Application(client_max_size=64 * 1024 * 1024)
    app.router.add_route("*", "/{tail:.*}", handle)
    # handler_cancellation: a handler stops when its client goes away (Envoy resetting the
    # upstream after a client abort), instead of running on; cleanup then has nothing to wait
    # for beyond the short shutdown timeout.
    runner = web.AppRunner(app, access_log=None, handler_cancellation=True, shutdown_timeout=2.0)
    await runner.setup()
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    site = web.SockSite(runner, sock)
    await site.start()
    backend = Backend(name=name, runner=runner, port=sock.getsockname()[1])
    return backend
