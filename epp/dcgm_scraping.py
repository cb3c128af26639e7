"""Reading each endpoint's NVIDIA DCGM exporter for the configuration's ``dcgm-data-source``
plugins, and handing every page to the ``dcgm-extractor`` plugins wired to that source in
``dataLayer.sources`` (`scorers.gpu_metrics` says where, how often and what is read).

This is llm-d-router's HTTP data-source loop for one kind of source: one task per (source,
endpoint), each fetching ``DcgmDataSource.url`` every ``DcgmDataSource.period`` of the
``--refresh-metrics-interval`` tick, with upstream's one-second bound on each fetch.  A page is
given to every extractor of the source; a fetch that fails, and an extractor that finds nothing
for the endpoint, count as a miss for it (`DcgmExtractor.missed`).  Unlike `epp.scraping`, a
failure here says nothing about the endpoint's health: the exporter is another process (often
on another port or host) than the model server.  Each outage is logged once as a warning and its
end once at info, as `epp.scraping` does.

Endpoints on one node under a DaemonSet exporter each fetch the same page, as upstream.
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Callable
from dataclasses import dataclass

import aiohttp

from epp.config import EndpointPickerConfig
from epp.datastore import Datastore
from scorers.base import Endpoint
from scorers.gpu_metrics import DcgmDataSource, DcgmExtractError, DcgmExtractor

log = logging.getLogger(__name__)

DEFAULT_FETCH_TIMEOUT = 1.0  # llm-d-router bounds each poll of an HTTP data source to 1 s


@dataclass(slots=True, frozen=True)
class DcgmWiring:
    """One ``dataLayer.sources`` entry: a DCGM source and the extractors it feeds."""

    source: DcgmDataSource
    extractors: tuple[DcgmExtractor, ...]


def dcgm_wirings(
    config: EndpointPickerConfig, plugin: Callable[[str], object | None]
) -> list[DcgmWiring]:
    """The DCGM sources of ``config``'s ``dataLayer`` with their extractors; ``plugin`` finds a
    configured instance by name (`epp.scheduler.Scheduler.plugin`).  The configuration loader
    has checked the references and types (`epp.config_sections.data_layer_problems`)."""
    wirings = []
    for entry in config.dataLayer.sources if config.dataLayer is not None else ():
        source = plugin(entry.pluginRef)
        if not isinstance(source, DcgmDataSource):
            continue
        extractors = tuple(
            extractor
            for ref in entry.extractors
            if isinstance(extractor := plugin(ref.pluginRef), DcgmExtractor)
        )
        wirings.append(DcgmWiring(source, extractors))
    return wirings


class DcgmScraper:
    """Polls every endpoint's exporter for each wiring; an `EndpointListener` of the datastore
    from `start` to `stop` (as `epp.scraping.MetricsScraper`).  With no wiring it does
    nothing."""

    name = "dcgm-scraper"

    def __init__(
        self,
        datastore: Datastore,
        wirings: list[DcgmWiring],
        *,
        tick: float,
        timeout: float = DEFAULT_FETCH_TIMEOUT,
        session: aiohttp.ClientSession | None = None,
    ) -> None:
        """``tick``: ``--refresh-metrics-interval`` in seconds, the unit of every period."""
        if timeout <= 0:
            raise ValueError(f"DCGM fetch timeout must be > 0 seconds, got {timeout}")
        self.datastore = datastore
        self.wirings = wirings
        self.periods = [w.source.period(tick) for w in wirings]  # ValueError for a bad tick
        self.timeout = timeout
        self.failing: dict[tuple[int, str], str] = {}  # (wiring, address) → the outage's error
        self._session = session
        self._owns_session = session is None
        self._tasks: dict[tuple[int, str], asyncio.Task[None]] = {}
        self._retiring: set[asyncio.Task[None]] = set()  # cancelled, awaited by stop
        self._running = False

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
                    name=f"dcgm {self.wirings[index].source.name} {endpoint.address}",
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
        """Fetch one endpoint's page for wiring ``index`` and hand it to the extractors; True
        when every extractor got a reading.  Never raises, except cancellation."""
        endpoint = self.datastore.get(address)
        spec = self.datastore.spec(address)
        session = self._session
        if endpoint is None or spec is None or session is None:
            return False
        wiring = self.wirings[index]
        url = wiring.source.url(endpoint, spec.node_address or None)
        try:
            page = await self._fetch(session, url, wiring.source)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            for extractor in wiring.extractors:
                extractor.missed(endpoint)
            self._failed(index, address, f"fetching {url}: {_describe(exc, self.timeout)}")
            return False
        problems = []
        for extractor in wiring.extractors:
            try:
                extractor.extract(endpoint, page)
            except DcgmExtractError as exc:
                extractor.missed(endpoint)
                problems.append(f"{extractor.name}: {exc}")
        if problems:
            self._failed(index, address, f"{url}: {'; '.join(problems)}")
            return False
        if self.failing.pop((index, address), None) is not None:
            log.info("%s: GPU metrics for %s read again", wiring.source.name, address)
        return True

    def _failed(self, index: int, address: str, error: str) -> None:
        source = self.wirings[index].source.name
        if (index, address) not in self.failing:
            log.warning("%s: no GPU metrics for %s: %s", source, address, error)
        else:
            log.debug("%s: no GPU metrics for %s: %s", source, address, error)
        self.failing[(index, address)] = error

    async def _fetch(self, session: aiohttp.ClientSession, url: str, source: DcgmDataSource) -> str:
        # https: unverified with insecureSkipVerify (upstream's default), else against the
        # system's trust store.
        async with session.get(
            url,
            timeout=aiohttp.ClientTimeout(total=self.timeout),
            headers={"Accept": "text/plain;version=0.0.4"},
            ssl=not source.p.insecureSkipVerify,
        ) as response:
            if response.status != 200:
                raise DcgmFetchError(f"HTTP {response.status}")
            body = await response.read()
        return body.decode("utf-8", errors="replace")


class DcgmFetchError(Exception):
    """The exporter answered, but not with a page (an HTTP error status)."""


def _describe(exc: BaseException, timeout: float) -> str:
    if isinstance(exc, TimeoutError):
        return f"no answer within {timeout:g} s"
    text = str(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__
