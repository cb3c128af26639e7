"""Runs the pure `Engine` in real time for the HTTP server.

A driver task advances the engine: it sleeps until the engine's next step ends, or until a new
request wakes it.  Engine time is seconds since the pod (re)started; the profile's durations are
already divided by ``--speedup``.  Each step's outputs go to the waiting requests' queues and
feed the serving statistics; its KV-event batches go to the publisher.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field, replace

from indexer.events import KVEventBatch
from simulator.engine import Engine
from simulator.engine_config import EngineConfig, LoRA
from simulator.engine_outputs import AdvanceResult, RequestOutput
from simulator.kv_event_publisher import KVEventPublisher
from simulator.profiles import Profile
from simulator.prompt_preparation import Prompt
from simulator.serving_stats import ServingStats

logger = logging.getLogger("simulator")


class PodRestarted(Exception):
    """The pod restarted (fault injection) while the request was in flight."""


@dataclass(slots=True)
class InFlight:
    req_id: str
    arrival: float
    outputs: asyncio.Queue[RequestOutput | None] = field(default_factory=asyncio.Queue)
    """The engine's outputs for this request; None means the pod restarted."""
    last_token_time: float | None = None
    finished: bool = False


class EngineDriver:
    """The pod's engine, its clock, and the requests waiting on it.  ``start()`` inside the
    event loop, ``await stop()`` when done."""

    def __init__(
        self,
        engine_config: EngineConfig,
        profile: Profile,
        publisher: KVEventPublisher | None,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._engine_config = engine_config
        self._profile = profile
        self.engine = Engine(engine_config, profile)
        self.serving_stats = ServingStats()
        self._publisher = publisher
        self._clock = clock
        self._epoch = clock()
        self._inflight: dict[str, InFlight] = {}
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._drive(), name="engine-driver")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    def now(self) -> float:
        """Engine time: seconds since the pod (re)started."""
        return self._clock() - self._epoch

    # -- requests -----------------------------------------------------------------------------

    def submit(
        self,
        prompt: Prompt,
        max_tokens: int,
        *,
        cache_salt: str | None,
        lora: LoRA | None,
        prefix: str,
        remote_prefill: bool = False,
    ) -> InFlight:
        """Hand a prepared prompt to the engine; raises `RequestRejected` as the engine does."""
        req_id = f"{prefix}-{uuid.uuid4().hex}"
        now = self.now()
        self.engine.add_request(
            req_id,
            prompt.token_ids,
            max_tokens,
            now,
            cache_salt=cache_salt,
            lora=lora,
            block_digests=prompt.digests,
            remote_prefill=remote_prefill,
        )
        flight = InFlight(req_id, now)
        self._inflight[req_id] = flight
        self._wake.set()
        return flight

    async def outputs(self, flight: InFlight) -> AsyncIterator[RequestOutput]:
        """The request's outputs until it finishes; aborts it if the client goes away."""
        try:
            while True:
                out = await flight.outputs.get()
                if out is None:
                    raise PodRestarted
                yield out
                if out.stats is not None:
                    return
        finally:
            if not flight.finished and self._inflight.pop(flight.req_id, None) is not None:
                self.engine.abort(flight.req_id, self.now())
                self.serving_stats.count_finished("abort")
                self._wake.set()

    def reset_prefix_cache(self) -> bool:
        """The engine's reset, its ``AllBlocksCleared`` published at once; False when refused."""
        if not self.engine.reset_prefix_cache():
            return False
        batch = self.engine.take_events(self.now())
        if batch is not None:
            self._publish(batch)
        return True

    def restart(self) -> None:
        """A fresh engine and clock: requests in flight fail, statistics start over."""
        for flight in self._inflight.values():
            flight.outputs.put_nowait(None)
        self._inflight.clear()
        self.engine = Engine(self._engine_config, self._profile)
        self._epoch = self._clock()
        self.serving_stats = ServingStats()
        self._wake.set()

    # -- the driver task ----------------------------------------------------------------------

    async def _drive(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            self._wake.clear()
            engine = self.engine
            try:
                self._dispatch(engine.advance(self.now()))
            except Exception:
                logger.exception("engine step failed")
                raise
            due = engine.next_event_time()
            timer = None
            if due is not None:
                timer = loop.call_later(max(0.0, due - self.now()), self._wake.set)
            await self._wake.wait()
            if timer is not None:
                timer.cancel()

    def _dispatch(self, result: AdvanceResult) -> None:
        stats = self.serving_stats
        for out in result.outputs.values():
            flight = self._inflight.get(out.req_id)
            if flight is None:
                continue
            if out.first_token_time is not None:
                stats.ttft.observe(out.first_token_time - flight.arrival)
            if out.num_new_tokens:
                stats.observe_tokens(out, flight.last_token_time)
                flight.last_token_time = out.last_token_time
            if out.stats is not None:
                flight.finished = True
                stats.e2e.observe(out.stats.e2e_latency)
                stats.count_finished(out.stats.finish_reason)
                del self._inflight[out.req_id]
            flight.outputs.put_nowait(out)
        for batch in result.kv_batches:
            self._publish(batch)

    def _publish(self, batch: KVEventBatch) -> None:
        if self._publisher is not None:
            # vLLM stamps a batch with time.time() when the scheduler step hands it over.
            self._publisher.publish(replace(batch, ts=time.time()))
