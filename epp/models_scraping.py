"""Reading each endpoint's ``/v1/models`` for the configuration's ``models-data-source`` plugins
and handing every answer to the ``models-data-extractor`` plugins wired to that source in
``dataLayer.sources`` (`scorers.models_data` says where, how often and what is read).

The loop is llm-d-router's for HTTP data sources (`epp.endpoint_polling`), as for the DCGM
exporter (`epp.dcgm_scraping`): every `ModelsDataSource.period`.  A failed fetch or an
unreadable answer keeps the extractors' last list.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass
from urllib.parse import urlsplit

from epp.config import EndpointPickerConfig
from epp.endpoint_polling import EndpointPoller, data_layer_wirings
from scorers.models_data import ModelsDataExtractor, ModelsDataSource, ModelsExtractError


@dataclass(slots=True, frozen=True)
class ModelsWiring:
    """One ``dataLayer.sources`` entry: a models source and the extractors it feeds."""

    source: ModelsDataSource
    extractors: tuple[ModelsDataExtractor, ...]


def models_wirings(
    config: EndpointPickerConfig, plugin: Callable[[str], object | None]
) -> list[ModelsWiring]:
    """The models sources of ``config``'s ``dataLayer`` with their extractors."""
    return data_layer_wirings(config, plugin, ModelsDataSource, ModelsDataExtractor, ModelsWiring)


def metrics_host(metrics_url: str, address: str) -> str:
    """The ``host:port`` an endpoint's metrics are scraped from (upstream's MetricsHost)."""
    return urlsplit(metrics_url).netloc or address


class ModelsScraper(EndpointPoller[ModelsWiring]):
    """Polls every endpoint's ``/v1/models`` for each wiring
    (`epp.endpoint_polling.EndpointPoller`)."""

    name = "models-scraper"
    reading = "model list"

    async def scrape_once(self, index: int, address: str) -> bool:
        endpoint = self.datastore.get(address)
        spec = self.datastore.spec(address)
        if endpoint is None or spec is None or self.session is None:
            return False
        source = self.wirings[index].source
        url = source.url(metrics_host(spec.metrics_url, address))
        # http: no TLS; https: the source's context (unverified by default, as upstream).
        ssl_context = source.ssl_context
        try:
            body = await self.fetch(
                url, "application/json", ssl_context if ssl_context is not None else True
            )
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            self.failed(index, address, f"fetching {url}: {self.describe(exc)}")
            return False
        problems = []
        for extractor in self.wirings[index].extractors:
            try:
                extractor.extract(endpoint, body)
            except ModelsExtractError as exc:
                problems.append(f"{extractor.name}: {exc}")
        if problems:
            self.failed(index, address, f"{url}: {'; '.join(problems)}")
            return False
        self.read_again(index, address)
        return True
