"""The loop llm-d-router runs for its HTTP data sources beside ``/metrics`` (the DCGM exporter,
``/v1/models``): one task per (source, endpoint), fetching once per the source's period of the
``--refresh-metrics-interval`` tick, each fetch bounded in time.  A failed fetch keeps what the
extractors last read and says nothing about the endpoint's health (the metrics scraper judges
that); each outage is logged once as a warning and its end once at info.

`EndpointPoller` owns the tasks and the outage log; `epp.dcgm_scraping` and
`epp.models_scraping` say what is fetched and who reads it (``scrape_once``)."""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Callable, Sequence
from typing import Any, Generic, Protocol, TypeVar

import aiohttp

from epp.config import EndpointPickerConfig
from epp.datastore import Datastore
from scorers.base import Endpoint

DEFAULT_FETCH_TIMEOUT = 1.0  # llm-d-router bounds each poll of an HTTP data source to 1 s


class _Source(Protocol):
    name: str

    def period(self, tick: float) -> float: ...


class Wiring(Protocol):
    """A ``dataLayer.sources`` entry: a source (with its polling period) and its extractors."""

    @property
    def source(self) -> _Source: ...


W = TypeVar("W", bound=Wiring)
S = TypeVar("S")
X = TypeVar("X")


def data_layer_wirings(
    config: EndpointPickerConfig,
    plugin: Callable[[str], object | None],
    source_type: type[S],
    extractor_type: type[X],
    wiring: Callable[[S, tuple[X, ...]], W],
) -> list[W]:
    """The ``dataLayer.sources`` entries of ``config`` whose source is a ``source_type``, each
    with its extractors of ``extractor_type``, as ``wiring(source, extractors)``; ``plugin``
    finds a configured instance by name (`epp.scheduler.Scheduler.plugin`).  The configuration
    loader has checked the references and types (`epp.config_sections.data_layer_problems`)."""
    found = []
    for entry in config.dataLayer.sources if config.dataLayer is not None else ():
        source = plugin(entry.pluginRef)
        if not isinstance(source, source_type):
            continue
        extractors = tuple(
            extractor
            for ref in entry.extractors
            if isinstance(extractor := plugin(ref.pluginRef), extractor_type)
        )
        found.append(wiring(source, extractors))
    return found


class FetchError(Exception):
    """The server answered, but not with what was asked for (an HTTP error status)."""


class EndpointPoller(Generic[W]):
    """Polls every endpoint once per wiring (a source and its extractors): an `EndpointListener`
    of the datastore from `start` to `stop`.  With no wiring it does nothing.  ``reading``
    names what is fetched in log lines ("GPU metrics", "the model list")."""

    name = "endpoint-poller"
    reading = "data"

    def __init__(
        self,
        datastore: Datastore,
        wirings: Sequence[W],
        *,
        tick: float,
        timeout: float = DEFAULT_FETCH_TIMEOUT,
        session: aiohttp.ClientSession | None = None,
    ) -> None:
        """``tick``: ``--refresh-metrics-interval`` in seconds, the unit of every period."""
        if timeout <= 0:
            raise ValueError(f"{self.reading} fetch timeout must be > 0 seconds, got {timeout}")
        self.datastore = datastore
        self.wirings = list(wirings)
        self.periods = [w.source.period(tick) for w in wirings]  # ValueError for a bad tick
        self.timeout = timeout
        self.failing: dict[tuple[int, str], str] = {}  # (wiring, address) → the outage's error
        self._session = session
        self._owns_session = session is None
        self._tasks: dict[tuple[int, str], asyncio.Task[None]] = {}
        self._retiring: set[asyncio.Task[None]] = set()  # cancelled, awaited by stop
        self._running = False
        # Log lines carry the module of the kind of source (epp.dcgm_scraping, ...).
        self.log = logging.getLogger(type(self).__module__)

    def source_name(self, index: int) -> str:
        return self.wirings[index].source.name

    async def start(self) -> None:
        if self._running or not self.wirings:
            return
        if self._session is None:
            self._session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))
            self._owns_session = True
        self._running = True
        self.datastore.add_listener(self, replay=True)

    async def stop(self) -> None:
        if not self._running:
            return
        self._running = False
        self.datastore.remove_listener(self)
        tasks = [*self._tasks.values(), *self._retiring]
        self._tasks.clear()
        self._retiring.clear()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self._owns_session and self._session is not None:
            await self._session.close()
            self._session = None

    # -- EndpointListener -----------------------------------------------------------------------

    def endpoint_added(self, endpoint: Endpoint) -> None:
        if not self._running:
            return
        loop = asyncio.get_running_loop()
        for index in range(len(self.wirings)):
            key = (index, endpoint.address)
            if key not in self._tasks:
                self._tasks[key] = loop.create_task(
                    self._poll_forever(index, endpoint.address),
                    name=f"{self.name} {self.source_name(index)} {endpoint.address}",
                )

    def endpoint_removed(self, endpoint: Endpoint) -> None:
        for index in range(len(self.wirings)):
            key = (index, endpoint.address)
            self.failing.pop(key, None)
            task = self._tasks.pop(key, None)
            if task is not None and not task.done():
                task.cancel()
                self._retiring.add(task)
                task.add_done_callback(self._retiring.discard)

    # -- the loop -------------------------------------------------------------------------------

    async def _poll_forever(self, index: int, address: str) -> None:
        loop = asyncio.get_running_loop()
        period = self.periods[index]
        await asyncio.sleep(random.uniform(0, period))  # spread endpoints over the period
        while True:
            started = loop.time()
            await self.scrape_once(index, address)
            await asyncio.sleep(max(0.0, started + period - loop.time()))

    async def scrape_once(self, index: int, address: str) -> bool:
        """Fetch one endpoint's answer for wiring ``index`` and hand it to the extractors; True
        when every extractor read it.  Never raises, except cancellation."""
        raise NotImplementedError

    @property
    def session(self) -> aiohttp.ClientSession | None:
        return self._session

    async def fetch(self, url: str, accept: str, ssl: Any) -> bytes:
        """One GET within the timeout; `FetchError` for an answer that is not a 200."""
        session = self._session
        if session is None:
            raise FetchError("not started")
        async with session.get(
            url,
            timeout=aiohttp.ClientTimeout(total=self.timeout),
            headers={"Accept": accept},
            ssl=ssl,
        ) as response:
            if response.status != 200:
                raise FetchError(f"HTTP {response.status}")
            return await response.read()

    def failed(self, index: int, address: str, error: str) -> None:
        """Wiring ``index`` read nothing from ``address``: a warning when an outage starts."""
        source = self.source_name(index)
        if (index, address) not in self.failing:
            self.log.warning("%s: no %s from %s: %s", source, self.reading, address, error)
        else:
            self.log.debug("%s: no %s from %s: %s", source, self.reading, address, error)
        self.failing[(index, address)] = error

    def read_again(self, index: int, address: str) -> None:
        """Wiring ``index`` read ``address`` again: the end of its outage, if one was logged."""
        if self.failing.pop((index, address), None) is not None:
            self.log.info(
                "%s: %s from %s read again", self.source_name(index), self.reading, address
            )

    def describe(self, exc: BaseException) -> str:
        if isinstance(exc, TimeoutError):
            return f"no answer within {self.timeout:g} s"
        text = str(exc)
        return f"{type(exc).__name__}: {text}" if text else type(exc).__name__
