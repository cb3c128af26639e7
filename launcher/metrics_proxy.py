"""A ``/metrics`` endpoint in front of a pod that a test or benchmark controls: it forwards, or
answers garbage, or never answers, so the EPP's scraping can be broken on purpose."""

from __future__ import annotations

import asyncio
import contextlib
import threading

import aiohttp
from aiohttp import web

from launcher.ports import LOOPBACK, reserve_port


class MetricsProxy:
    """Forwards ``GET /metrics`` to a pod, or answers ``garbage`` (200, not Prometheus text),
    or ``hang`` (accepts and never answers).  Runs its own loop in a thread."""

    def __init__(self, upstream: str) -> None:
        self.upstream = upstream
        self.mode = "pass"
        self.port = reserve_port()
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, name="metrics-proxy", daemon=True)
        self._thread.start()
        if not self._ready.wait(10):
            raise RuntimeError("metrics proxy did not start")

    @property
    def url(self) -> str:
        return f"http://{LOOPBACK}:{self.port}/metrics"

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._loop.run_until_complete(self._start())
        self._ready.set()
        self._loop.run_forever()

    async def _start(self) -> None:
        self._session = aiohttp.ClientSession()
        app = web.Application()
        app.router.add_get("/metrics", self._metrics)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        await web.TCPSite(self._runner, LOOPBACK, self.port).start()

    async def _metrics(self, _: web.Request) -> web.Response:
        if self.mode == "garbage":
            return web.Response(text="\x00<html>definitely { not prometheus", status=200)
        if self.mode == "hang":
            await asyncio.sleep(3600)
        async with self._session.get(f"http://{self.upstream}/metrics") as resp:
            return web.Response(body=await resp.read(), status=resp.status)

    def stop(self) -> None:
        async def close() -> None:
            current = asyncio.current_task()
            for task in asyncio.all_tasks():
                if task is not current:
                    task.cancel()  # handlers parked in "hang" mode
            await self._runner.cleanup()
            await self._session.close()

        with contextlib.suppress(Exception):
            asyncio.run_coroutine_threadsafe(close(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
