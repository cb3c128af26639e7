"""Started-and-stopped test servers: any object with ``async start()`` and ``async stop()``."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Protocol, TypeVar


class Server(Protocol):
    async def start(self) -> None: ...

    async def stop(self) -> None: ...


S = TypeVar("S", bound=Server)


@asynccontextmanager
async def running(server: S) -> AsyncIterator[S]:
    """``server``, started; stopped on the way out, also when the body fails."""
    await server.start()
    try:
        yield server
    finally:
        await server.stop()
