"""Reading each endpoint's NVIDIA DCGM exporter for the configuration's ``dcgm-data-source``
plugins, and handing every page to the ``dcgm-extractor`` plugins wired to that source in
``dataLayer.sources`` (`scorers.gpu_metrics` says where, how often and what is read).

The loop is llm-d-router's for HTTP data sources (`epp.endpoint_polling`): ``DcgmDataSource.url``
every ``DcgmDataSource.period``.  A page is given to every extractor of the source; a fetch that
fails, and an extractor that finds nothing for the endpoint, count as a miss for it
(`DcgmExtractor.missed`).  Unlike `epp.scraping`, a failure here says nothing about the
endpoint's health: the exporter is another process (often on another port or host) than the
model server.

Endpoints on one node under a DaemonSet exporter each fetch the same page, as upstream.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass

from epp.config import EndpointPickerConfig
from epp.endpoint_polling import EndpointPoller, data_layer_wirings
from scorers.gpu_metrics import DcgmDataSource, DcgmExtractError, DcgmExtractor


@dataclass(slots=True, frozen=True)
class DcgmWiring:
    """One ``dataLayer.sources`` entry: a DCGM source and the extractors it feeds."""

    source: DcgmDataSource
    extractors: tuple[DcgmExtractor, ...]


def dcgm_wirings(
    config: EndpointPickerConfig, plugin: Callable[[str], object | None]
) -> list[DcgmWiring]:
    """The DCGM sources of ``config``'s ``dataLayer`` with their extractors."""
    return data_layer_wirings(config, plugin, DcgmDataSource, DcgmExtractor, DcgmWiring)


class DcgmScraper(EndpointPoller[DcgmWiring]):
    """Polls every endpoint's exporter for each wiring (`epp.endpoint_polling.EndpointPoller`,
    as `epp.scraping.MetricsScraper` polls ``/metrics``)."""

    name = "dcgm-scraper"
    reading = "GPU metrics"

    async def scrape_once(self, index: int, address: str) -> bool:
        endpoint = self.datastore.get(address)
        spec = self.datastore.spec(address)
        if endpoint is None or spec is None or self.session is None:
            return False
        wiring = self.wirings[index]
        url = wiring.source.url(endpoint, spec.node_address or None)
        # https: unverified with insecureSkipVerify (upstream's default), else against the
        # system's trust store.
        try:
            body = await self.fetch(
                url, "text/plain;version=0.0.4", not wiring.source.p.insecureSkipVerify
            )
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            for extractor in wiring.extractors:
                extractor.missed(endpoint)
            self.failed(index, address, f"fetching {url}: {self.describe(exc)}")
            return False
        page = body.decode("utf-8", errors="replace")
        problems = []
        for extractor in wiring.extractors:
            try:
                extractor.extract(endpoint, page)
            except DcgmExtractError as exc:
                extractor.missed(endpoint)
                problems.append(f"{extractor.name}: {exc}")
        if problems:
            self.failed(index, address, f"{url}: {'; '.join(problems)}")
            return False
        self.read_again(index, address)
        return True
