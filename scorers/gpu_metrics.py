"""GPU utilization from NVIDIA's DCGM exporter, as llm-d-router's ``dcgm-data-source`` and
``dcgm-extractor`` (Alpha there and here: they need ``--allow-experimental-plugins``).

* ``dcgm-data-source`` says where each endpoint's exporter answers: ``<scheme>://<pod IP>:<port>
  <path>`` for an exporter run as a sidecar, or the pod's node IP (``useNodeAddress``) for the
  usual DaemonSet (the GPU Operator's); ``port: 0`` means the endpoint's own port.  How often:
  ``interval`` (a Go duration), rounded to a whole number of ``--refresh-metrics-interval`` ticks,
  every tick when omitted.  The fetching itself is `epp.dcgm_scraping` (I/O stays out of here).
* ``dcgm-extractor`` reads the page's ``DCGM_FI_DEV_GPU_UTIL`` gauge (percent, one series per
  GPU) and publishes the busiest of the endpoint's GPUs as a fraction, 0.73 for 73 %, under the
  key ``GPUUtilization/dcgm-extractor`` whatever the extractor's own name (upstream's fixed
  ``GPUUtilizationDataKey``).  `scorers.endpoint_attribute`'s filter and scorer read it.

Which series are the endpoint's: a DaemonSet exporter started with
``DCGM_EXPORTER_KUBERNETES=true`` labels each GPU with the ``pod`` using it (``""`` for an idle
one); a sidecar's page usually has no ``pod`` label.  As upstream, a series with a ``pod`` label
counts only for the endpoint of that pod, one without counts for every endpoint reading the
page, and an endpoint whose pod name is unknown (a static endpoint without ``name``) takes every
series.  The ``namespace`` label is not compared (upstream does not either).  A pod serving
several data-parallel ranks is one endpoint per rank here, named ``<pod>-rank-<n>``; each rank
reads its pod's series.

Staleness, where this differs from upstream: llm-d-router keeps the last value for as long as
the endpoint exists, so a pod whose exporter died stays filtered on its last reading.  Here a
reading is withdrawn after `FORGET_AFTER_MISSES` scrapes in a row that gave no value (the
exporter did not answer, or its page had no series for the pod); the endpoint then counts as
missing the attribute, which the filter's ``onMissing`` decides.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, Final, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from epp.prometheus_text import PrometheusTextError, parse_labels, series
from kvcache.settings import parse_duration
from scorers.base import Endpoint, NoParameters, Plugin, register
from scorers.endpoint_attribute import DataKey

GPU_UTIL_METRIC: Final = "DCGM_FI_DEV_GPU_UTIL"
POD_LABEL: Final = "pod"
DCGM_EXTRACTOR: Final = "dcgm-extractor"
GPU_UTILIZATION_KEY: Final = DataKey("GPUUtilization", DCGM_EXTRACTOR)
FORGET_AFTER_MISSES: Final = 3
"""One failed scrape (an exporter restarting, a slow answer) leaves the last reading in place;
three in a row (3 s at the sample configuration's 1 s interval) mean the exporter is gone."""


class DcgmExtractError(Exception):
    """A DCGM page without a usable GPU-utilization reading for an endpoint."""


# ---------------------------------------------------------------------------------------------
# The exporter's page


@dataclass(slots=True, frozen=True)
class ExporterSample:
    """One sample of the exporter's page: its labels and value."""

    labels: Mapping[str, str]
    value: float


def gauge_samples(page: str, metric: str = GPU_UTIL_METRIC) -> list[ExporterSample]:
    """Every sample of gauge ``metric`` on a Prometheus text page, read with the vLLM
    scraper's parser (`epp.prometheus_text.series`: only the metric's own group of lines).

    Raises `DcgmExtractError` when the page has no such metric, declares it other than a gauge
    (upstream reads gauges only; an undeclared type is accepted), or a sample is malformed.
    """
    if page.find(metric) == -1:
        raise DcgmExtractError(f"metric {metric} is not on the page")
    type_line = f"# TYPE {metric} "
    declared = page.find(type_line)
    if declared != -1:
        end = page.find("\n", declared)
        kind = page[declared + len(type_line) : None if end == -1 else end].strip()
        if kind != "gauge":
            raise DcgmExtractError(f"{metric} is a {kind}, expected a gauge")
    try:
        samples = [
            ExporterSample(parse_labels(metric, labels), value)
            for labels, value in series(page, metric)
        ]
    except PrometheusTextError as exc:
        raise DcgmExtractError(str(exc)) from None
    if not samples:
        raise DcgmExtractError(f"metric {metric} has no samples on the page")
    return samples


def pod_name(endpoint: Endpoint) -> str | None:
    """The endpoint's pod, or None when unknown (a static endpoint named by its address)."""
    return None if endpoint.name in ("", endpoint.address) else endpoint.name


def belongs_to(sample: ExporterSample, endpoint: Endpoint) -> bool:
    """Whether a series counts for the endpoint (module docstring)."""
    pod = pod_name(endpoint)
    owner = sample.labels.get(POD_LABEL)
    if pod is None or owner is None:
        return True
    return owner == pod or pod == f"{owner}-rank-{endpoint.rank}"


def gpu_utilization(page: str, endpoint: Endpoint) -> float:
    """The busiest of the endpoint's GPUs on a DCGM page, as a fraction (73 % → 0.73).

    Raises `DcgmExtractError` when the page has no finite reading for the endpoint."""
    samples = gauge_samples(page)
    values = [s.value for s in samples if belongs_to(s, endpoint) and math.isfinite(s.value)]
    if not values:
        pods = sorted({s.labels[POD_LABEL] for s in samples if POD_LABEL in s.labels})
        raise DcgmExtractError(
            f"{GPU_UTIL_METRIC} has no series for pod {pod_name(endpoint)!r} (endpoint "
            f"{endpoint.address}); the page's pod labels: {', '.join(map(repr, pods)) or 'none'}"
        )
    # Upstream's running maximum starts at 0: a negative reading counts as idle.
    return max(0.0, *values) / 100.0


# ---------------------------------------------------------------------------------------------
# The plugins


class DataSourceParameters(BaseModel):
    # Strict, as upstream's Go decoding: "9400" is not a port, "true" not a boolean.
    model_config = ConfigDict(extra="forbid", strict=True)

    scheme: Literal["http", "https"] = "http"
    path: str = "/metrics"
    port: int = Field(
        default=9400, ge=0, le=65535, description="The exporter's port; 0: the endpoint's own."
    )
    insecureSkipVerify: bool = Field(default=True, description="https: skip verification.")
    useNodeAddress: bool = Field(
        default=False, description="Scrape the pod's node IP (DaemonSet), not the pod IP."
    )
    interval: str = Field(default="", description="Scrape period, a Go duration; '': every tick.")

    @field_validator("interval")
    @classmethod
    def _duration(cls, value: str) -> str:
        if value:
            parse_duration(value)  # ValueError names the accepted forms
        return value

    @model_validator(mode="after")
    def _node_needs_port(self) -> DataSourceParameters:
        if self.useNodeAddress and self.port == 0:
            raise ValueError("useNodeAddress needs the exporter's port: set port (e.g. 9400)")
        return self


@register("dcgm-data-source")
class DcgmDataSource(Plugin[DataSourceParameters]):
    """Where and how often each endpoint's DCGM exporter is read (module docstring)."""

    experimental: ClassVar[bool] = True

    def __init__(self, name: str, params: BaseModel, context: Any) -> None:
        super().__init__(name, params, context)
        self.interval = parse_duration(self.p.interval) if self.p.interval else 0.0
        path = self.p.path
        self.path = path if path.startswith("/") else f"/{path}"

    def url(self, endpoint: Endpoint, node_address: str | None = None) -> str:
        """The exporter's URL for this endpoint; without a node address (a static endpoint),
        ``useNodeAddress`` falls back to the pod IP, as upstream."""
        p = self.p
        if p.port == 0:
            return f"{p.scheme}://{endpoint.address}{self.path}"
        host = node_address if p.useNodeAddress and node_address else endpoint.ip
        if ":" in host:
            host = f"[{host}]"
        return f"{p.scheme}://{host}:{p.port}{self.path}"

    def period(self, tick: float) -> float:
        """Seconds between scrapes: ``interval`` rounded to whole ticks of
        ``--refresh-metrics-interval`` (at least one), one tick without ``interval``."""
        if tick <= 0:
            raise ValueError(f"the refresh tick must be > 0 seconds, got {tick}")
        return max(1, round(self.interval / tick)) * tick


@dataclass(slots=True, frozen=True)
class GpuReading:
    utilization: float  # fraction of the busiest GPU
    at: float  # the context clock when read


@register(DCGM_EXTRACTOR)
class DcgmExtractor(Plugin[NoParameters]):
    """Each endpoint's GPU utilization from its DCGM page (module docstring).  The scraper
    (`epp.dcgm_scraping`) hands it pages (`extract`) and failures (`missed`); the
    ``endpoint-attribute-*`` plugins read it through `attribute`."""

    experimental: ClassVar[bool] = True

    def __init__(self, name: str, params: BaseModel, context: Any) -> None:
        super().__init__(name, params, context)
        self.readings: dict[str, GpuReading] = {}
        self._misses: dict[str, int] = {}

    def extract(self, endpoint: Endpoint, page: str) -> float:
        """Read the endpoint's utilization from its exporter's page and keep it.  Raises
        `DcgmExtractError` (the previous reading stays; see `missed`)."""
        utilization = gpu_utilization(page, endpoint)
        self.readings[endpoint.address] = GpuReading(utilization, self.context.clock())
        self._misses.pop(endpoint.address, None)
        return utilization

    def missed(self, endpoint: Endpoint) -> None:
        """A scrape gave no reading: after `FORGET_AFTER_MISSES` in a row the last one goes."""
        misses = self._misses.get(endpoint.address, 0) + 1
        self._misses[endpoint.address] = misses
        if misses >= FORGET_AFTER_MISSES:
            self.readings.pop(endpoint.address, None)

    def gpu_utilization(self, endpoint: Endpoint) -> float | None:
        reading = self.readings.get(endpoint.address)
        return reading.utilization if reading is not None else None

    # -- AttributeProducer ----------------------------------------------------------------------

    def produced_keys(self) -> frozenset[DataKey]:
        return frozenset({GPU_UTILIZATION_KEY})

    def attribute(self, key: DataKey, endpoint: Endpoint) -> float | None:
        return self.gpu_utilization(endpoint) if key == GPU_UTILIZATION_KEY else None

    # -- EndpointListener: a departed endpoint's reading goes with it -------------------------------

    def endpoint_added(self, endpoint: Endpoint) -> None:
        pass

    def endpoint_removed(self, endpoint: Endpoint) -> None:
        self.readings.pop(endpoint.address, None)
        self._misses.pop(endpoint.address, None)
