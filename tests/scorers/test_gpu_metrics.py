"""``dcgm-data-source`` and ``dcgm-extractor`` (`scorers.gpu_metrics`) and the scraper that
feeds them (`epp.dcgm_scraping`).

The real DCGM exporter needs an NVIDIA GPU, which this machine does not have.  Its substitute
here is `FakeDcgmExporter`, an aiohttp server answering ``GET /metrics`` with the exporter's
text exposition: its default counters' metric names, ``# HELP`` texts and ``# TYPE``s, and its
label set (``gpu``, ``UUID``, ``pci_bus_id``, ``device``, ``modelName``, ``Hostname``,
``DCGM_FI_DRIVER_VERSION``, plus ``container``/``namespace``/``pod`` when the exporter maps GPUs
to pods, ``""`` for an idle GPU), as dcgm-exporter 3.x/4.x pages show them.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import pytest
from aiohttp import web

from epp.config import build_scheduler, load_config
from epp.datastore import Datastore, EndpointSpec
from epp.dcgm_scraping import DcgmScraper, DcgmWiring, dcgm_wirings
from epp.discovery.pool import PoolSpec, pod_endpoints
from scorers.base import Endpoint, PluginConfigError, PluginContext
from scorers.endpoint_attribute import DataKey
from scorers.gpu_metrics import (
    FORGET_AFTER_MISSES,
    GPU_UTILIZATION_KEY,
    DcgmDataSource,
    DcgmExtractError,
    DcgmExtractor,
    gauge_samples,
    gpu_utilization,
)
from tests.scorers.plugin_helpers import StaticEndpoints, make, request
from tests.support.llmd_samples import SIM_EPP_GPU_CONFIG
from tests.support.servers import running

# ---------------------------------------------------------------------------------------------
# The exporter's page


@dataclass
class Gpu:
    utilization: float  # percent, as DCGM reports it
    pod: str | None = None  # None: the exporter does not map GPUs to pods (a sidecar)
    namespace: str = "default"
    container: str = "vllm"


# (name, help, type, value for a GPU): the exporter's default counters, in its order.
_FAMILIES: list[tuple[str, str, str, Callable[[Gpu], float]]] = [
    ("DCGM_FI_DEV_SM_CLOCK", "SM clock frequency (in MHz).", "gauge", lambda g: 1980),
    ("DCGM_FI_DEV_MEM_CLOCK", "Memory clock frequency (in MHz).", "gauge", lambda g: 2619),
    ("DCGM_FI_DEV_GPU_TEMP", "GPU temperature (in C).", "gauge", lambda g: 41),
    ("DCGM_FI_DEV_POWER_USAGE", "Power draw (in W).", "gauge", lambda g: 112.5),
    (
        "DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION",
        "Total energy consumption since boot (in mJ).",
        "counter",
        lambda g: 4742776,
    ),
    ("DCGM_FI_DEV_PCIE_REPLAY_COUNTER", "Total number of PCIe retries.", "counter", lambda g: 0),
    ("DCGM_FI_DEV_GPU_UTIL", "GPU utilization (in %).", "gauge", lambda g: g.utilization),
    ("DCGM_FI_DEV_MEM_COPY_UTIL", "Memory utilization (in %).", "gauge", lambda g: 12),
    ("DCGM_FI_DEV_ENC_UTIL", "Encoder utilization (in %).", "gauge", lambda g: 0),
    ("DCGM_FI_DEV_DEC_UTIL", "Decoder utilization (in %).", "gauge", lambda g: 0),
    ("DCGM_FI_DEV_FB_FREE", "Framebuffer memory free (in MiB).", "gauge", lambda g: 2048),
    ("DCGM_FI_DEV_FB_USED", "Framebuffer memory used (in MiB).", "gauge", lambda g: 78000),
    (
        "DCGM_FI_PROF_GR_ENGINE_ACTIVE",
        "Ratio of time the graphics engine is active.",
        "gauge",
        lambda g: g.utilization / 100,
    ),
]


def dcgm_exporter_page(gpus: Sequence[Gpu], hostname: str = "gpu-node-1") -> str:
    lines = []
    for name, help_text, kind, value in _FAMILIES:
        lines += [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}"]
        for index, gpu in enumerate(gpus):
            labels = (
                f'gpu="{index}",UUID="GPU-c2f76b33-7953-256e-8f33-13434190000{index}",'
                f'pci_bus_id="00000000:{0x31 + index:02X}:00.0",device="nvidia{index}",'
                f'modelName="NVIDIA H100 80GB HBM3",Hostname="{hostname}",'
                'DCGM_FI_DRIVER_VERSION="580.105.08"'
            )
            if gpu.pod is not None:
                assigned = gpu.pod != ""
                labels += (
                    f',container="{gpu.container if assigned else ""}",'
                    f'namespace="{gpu.namespace if assigned else ""}",pod="{gpu.pod}"'
                )
            lines.append(f"{name}{{{labels}}} {value(gpu):g}")
    return "\n".join(lines) + "\n"


def pod(address: str, name: str = "", rank: int = 0) -> Endpoint:
    return Endpoint(address=address, name=name or address, rank=rank)


VLLM_A = pod("10.0.0.1:8000", "vllm-a")
VLLM_B = pod("10.0.0.2:8000", "vllm-b")
DAEMONSET_PAGE = dcgm_exporter_page(
    [Gpu(40, "vllm-a"), Gpu(70, "vllm-a"), Gpu(99, "vllm-b"), Gpu(100, "")]
)


def test_a_sidecar_page_gives_the_busiest_gpu_as_a_fraction() -> None:
    page = dcgm_exporter_page([Gpu(35), Gpu(81)])
    assert gpu_utilization(page, VLLM_A) == pytest.approx(0.81)


def test_a_daemonset_page_gives_each_pod_its_own_gpus_and_no_idle_one() -> None:
    assert gpu_utilization(DAEMONSET_PAGE, VLLM_A) == pytest.approx(0.70)
    assert gpu_utilization(DAEMONSET_PAGE, VLLM_B) == pytest.approx(0.99)


def test_a_pod_missing_from_the_page_is_an_error_naming_it_and_the_pods_there() -> None:
    with pytest.raises(DcgmExtractError) as err:
        gpu_utilization(DAEMONSET_PAGE, pod("10.0.0.3:8000", "vllm-c"))
    assert "no series for pod 'vllm-c'" in str(err.value)
    assert "'', 'vllm-a', 'vllm-b'" in str(err.value)


def test_an_endpoint_without_a_pod_name_reads_every_gpu_on_the_page() -> None:
    assert gpu_utilization(DAEMONSET_PAGE, pod("10.0.0.9:8000")) == pytest.approx(1.0)


def test_each_data_parallel_rank_reads_its_pods_gpus() -> None:
    rank1 = pod("10.0.0.1:8001", "vllm-a-rank-1", rank=1)
    assert gpu_utilization(DAEMONSET_PAGE, rank1) == pytest.approx(0.70)
    wrong_rank = pod("10.0.0.1:8001", "vllm-a-rank-0", rank=1)
    with pytest.raises(DcgmExtractError):
        gpu_utilization(DAEMONSET_PAGE, wrong_rank)


def test_only_the_gpu_utilization_gauge_is_read() -> None:
    page = dcgm_exporter_page([Gpu(20)])
    samples = gauge_samples(page)
    assert [s.value for s in samples] == [20]
    assert samples[0].labels["modelName"] == "NVIDIA H100 80GB HBM3"
    assert samples[0].labels["DCGM_FI_DRIVER_VERSION"] == "580.105.08"


@pytest.mark.parametrize(
    ("page", "message"),
    [
        ("# HELP DCGM_FI_DEV_GPU_TEMP GPU temperature (in C).\n", "is not on the page"),
        (
            "# HELP DCGM_FI_DEV_GPU_UTIL GPU utilization (in %).\n"
            "# TYPE DCGM_FI_DEV_GPU_UTIL gauge\n",
            "has no samples",
        ),
        (
            '# TYPE DCGM_FI_DEV_GPU_UTIL counter\nDCGM_FI_DEV_GPU_UTIL{gpu="0"} 5\n',
            "is a counter, expected a gauge",
        ),
        ('DCGM_FI_DEV_GPU_UTIL{gpu="0" 5\n', "unterminated label set"),
        ('DCGM_FI_DEV_GPU_UTIL{gpu="0} 5\n', "malformed labels"),
        ("DCGM_FI_DEV_GPU_UTIL{gpu=0} 5\n", "malformed labels"),
        ('DCGM_FI_DEV_GPU_UTIL{gpu="0"} busy\n', "value 'busy' is not a number"),
        ('DCGM_FI_DEV_GPU_UTIL{gpu="0"}\n', "sample without a value"),
    ],
)
def test_unusable_pages_are_errors_that_say_why(page: str, message: str) -> None:
    with pytest.raises(DcgmExtractError, match=message):
        gpu_utilization(page, VLLM_A)


def test_text_format_details_are_honoured() -> None:
    page = (
        'DCGM_FI_DEV_GPU_UTIL_LIKE{gpu="0"} 99\n'  # a longer name sharing the prefix
        'DCGM_FI_DEV_GPU_UTIL{gpu="0",pod="vllm-a"} 30 1718000000000\n'  # with a timestamp
        'DCGM_FI_DEV_GPU_UTIL{gpu="1",modelName="say \\"hi\\"",pod="vllm-a"} 45\n'  # escapes
        'DCGM_FI_DEV_GPU_UTIL{gpu="2",pod="vllm-a"} NaN\n'  # no reading: skipped
        'DCGM_FI_DEV_GPU_UTIL_LIKE{gpu="1"} 99\n'
    )
    assert gpu_utilization(page, VLLM_A) == pytest.approx(0.45)
    assert gauge_samples(page)[1].labels["modelName"] == 'say "hi"'


def test_a_negative_reading_counts_as_idle_as_upstream() -> None:
    page = 'DCGM_FI_DEV_GPU_UTIL{gpu="0"} -3\n'  # untyped: accepted
    assert gpu_utilization(page, VLLM_A) == 0.0


# ---------------------------------------------------------------------------------------------
# dcgm-data-source's parameters


def source(**params: Any) -> DcgmDataSource:
    plugin = make("dcgm-data-source", params)
    assert isinstance(plugin, DcgmDataSource)
    return plugin


def test_defaults_scrape_the_pods_sidecar_on_9400_every_tick() -> None:
    defaults = source()
    assert defaults.url(VLLM_A) == "http://10.0.0.1:9400/metrics"
    assert defaults.period(0.05) == pytest.approx(0.05)
    assert defaults.experimental and DcgmDataSource.type_name == "dcgm-data-source"


def test_the_node_address_is_scraped_for_a_daemonset() -> None:
    node = source(useNodeAddress=True, port=9500)
    assert node.url(VLLM_A, "192.168.4.7") == "http://192.168.4.7:9500/metrics"
    # An endpoint without a known node (a static one) falls back to its pod IP, as upstream.
    assert node.url(VLLM_A, None) == "http://10.0.0.1:9500/metrics"
    # Without useNodeAddress the node address is not used.
    assert source().url(VLLM_A, "192.168.4.7") == "http://10.0.0.1:9400/metrics"


def test_urls_for_port_zero_ipv6_https_and_a_bare_path() -> None:
    assert source(port=0).url(VLLM_A) == "http://10.0.0.1:8000/metrics"
    v6 = pod("[fd00::7]:8000", "v6")
    assert source().url(v6) == "http://[fd00::7]:9400/metrics"
    tls = source(scheme="https", path="gpu", insecureSkipVerify=False)
    assert tls.url(VLLM_A) == "https://10.0.0.1:9400/gpu"


@pytest.mark.parametrize(
    ("interval", "tick", "period"),
    [("1s", 0.05, 1.0), ("", 0.05, 0.05), ("70ms", 0.05, 0.05), ("80ms", 0.05, 0.1),
     ("10ms", 0.05, 0.05), ("1m30s", 1.0, 90.0)],
)  # fmt: skip
def test_the_interval_is_rounded_to_whole_ticks(interval: str, tick: float, period: float) -> None:
    assert source(interval=interval).period(tick) == pytest.approx(period)


@pytest.mark.parametrize(
    ("params", "message"),
    [
        ({"port": "9400"}, "parameters.port: Input should be a valid integer"),
        ({"port": 70000}, "parameters.port: Input should be less than or equal to 65535"),
        ({"port": -1}, "parameters.port: Input should be greater than or equal to 0"),
        ({"scheme": "grpc"}, "parameters.scheme: Input should be 'http' or 'https'"),
        ({"interval": "soon"}, "parameters.interval"),
        ({"interval": 1}, "parameters.interval: Input should be a valid string"),
        ({"insecureSkipVerify": "false"}, "parameters.insecureSkipVerify"),
        ({"useNodeAddress": True, "port": 0}, "useNodeAddress needs the exporter's port"),
        ({"bogus": 1}, "parameters.bogus: Extra inputs are not permitted"),
    ],
)
def test_bad_source_parameters_are_refused_naming_the_key(
    params: dict[str, Any], message: str
) -> None:
    with pytest.raises(PluginConfigError) as err:
        source(**params)
    assert message in str(err.value)


def test_the_extractor_takes_no_parameters() -> None:
    with pytest.raises(PluginConfigError, match=r"parameters\.metric: Extra inputs"):
        make("dcgm-extractor", {"metric": "DCGM_FI_DEV_GPU_UTIL"})


# ---------------------------------------------------------------------------------------------
# dcgm-extractor's readings


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def extractor(name: str = "dcgm-extractor", clock: Clock | None = None) -> DcgmExtractor:
    ctx = PluginContext(endpoints=StaticEndpoints([]), clock=clock or Clock())
    plugin = make("dcgm-extractor", name=name, ctx=ctx)
    assert isinstance(plugin, DcgmExtractor)
    return plugin


def test_a_reading_is_published_under_upstreams_key_whatever_the_extractors_name() -> None:
    clock = Clock()
    reader = extractor("gpu-reader", clock)
    assert reader.produced_keys() == {DataKey("GPUUtilization", "dcgm-extractor")}
    assert reader.attribute(GPU_UTILIZATION_KEY, VLLM_A) is None
    assert reader.extract(VLLM_A, DAEMONSET_PAGE) == pytest.approx(0.70)
    assert reader.attribute(GPU_UTILIZATION_KEY, VLLM_A) == pytest.approx(0.70)
    assert reader.attribute(DataKey("GPUUtilization", "gpu-reader"), VLLM_A) is None
    assert reader.readings[VLLM_A.address].at == 100.0


def test_a_failed_extraction_keeps_the_last_reading_until_misses_pile_up() -> None:
    reader = extractor()
    reader.extract(VLLM_A, dcgm_exporter_page([Gpu(50)]))
    with pytest.raises(DcgmExtractError):
        reader.extract(VLLM_A, "")
    for _ in range(FORGET_AFTER_MISSES - 1):
        reader.missed(VLLM_A)
    assert reader.gpu_utilization(VLLM_A) == pytest.approx(0.5)
    reader.missed(VLLM_A)
    assert reader.gpu_utilization(VLLM_A) is None


def test_a_good_reading_resets_the_misses() -> None:
    reader = extractor()
    reader.extract(VLLM_A, dcgm_exporter_page([Gpu(50)]))
    for _ in range(FORGET_AFTER_MISSES - 1):
        reader.missed(VLLM_A)
    reader.extract(VLLM_A, dcgm_exporter_page([Gpu(60)]))
    for _ in range(FORGET_AFTER_MISSES - 1):
        reader.missed(VLLM_A)
    assert reader.gpu_utilization(VLLM_A) == pytest.approx(0.6)


def test_a_departed_endpoint_takes_its_reading_along() -> None:
    reader = extractor()
    reader.extract(VLLM_A, DAEMONSET_PAGE)
    reader.extract(VLLM_B, DAEMONSET_PAGE)
    reader.endpoint_removed(VLLM_A)
    assert reader.gpu_utilization(VLLM_A) is None
    assert reader.gpu_utilization(VLLM_B) == pytest.approx(0.99)


def test_kubernetes_discovery_records_the_pods_node_for_daemonset_exporters() -> None:
    pool = PoolSpec(selector=(("app", "vllm"),), target_ports=(8000,))
    ready = {
        "metadata": {"name": "vllm-a", "labels": {"app": "vllm"}},
        "status": {
            "podIP": "10.0.0.1",
            "hostIP": "192.168.4.7",
            "conditions": [{"type": "Ready", "status": "True"}],
        },
    }
    (spec,) = pod_endpoints(ready, pool)
    assert spec.node_address == "192.168.4.7"


# ---------------------------------------------------------------------------------------------
# Scraping a (substitute) exporter over HTTP


class FakeDcgmExporter:
    """Stands in for NVIDIA's dcgm-exporter (no GPU here): serves `dcgm_exporter_page` of
    ``gpus`` on 127.0.0.1, or ``status`` when not 200."""

    def __init__(self, gpus: Sequence[Gpu]) -> None:
        self.gpus = list(gpus)
        self.status = 200
        self.hits = 0
        self.port = 0
        self._runner: web.AppRunner | None = None

    async def _metrics(self, _: web.Request) -> web.Response:
        self.hits += 1
        if self.status != 200:
            return web.Response(status=self.status, text="exporter unavailable")
        return web.Response(text=dcgm_exporter_page(self.gpus), content_type="text/plain")

    async def start(self) -> None:
        app = web.Application()
        app.router.add_get("/metrics", self._metrics)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self.port = self._runner.addresses[0][1]

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()


async def eventually(check: Callable[[], bool], timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        await asyncio.sleep(0.01)


def dcgm_tasks() -> list[asyncio.Task[Any]]:
    return [t for t in asyncio.all_tasks() if t.get_name().startswith("dcgm-scraper ")]


def scraper_for(
    datastore: Datastore, exporter: FakeDcgmExporter, **params: Any
) -> tuple[DcgmScraper, DcgmExtractor]:
    reader = extractor()
    wiring = DcgmWiring(source(port=exporter.port, **params), (reader,))
    return DcgmScraper(datastore, [wiring], tick=0.02, timeout=0.5), reader


async def test_a_sidecar_exporter_is_polled_and_stops_with_the_scraper() -> None:
    datastore = Datastore()
    # The model server's port is not served: only the exporter's port is fetched.
    datastore.upsert(EndpointSpec(address="127.0.0.1:8000", name="vllm-a"))
    async with running(FakeDcgmExporter([Gpu(35), Gpu(81)])) as exporter:
        scraper, reader = scraper_for(datastore, exporter)
        async with running(scraper):
            endpoint = datastore.get("127.0.0.1:8000")
            assert endpoint is not None
            await eventually(lambda: reader.gpu_utilization(endpoint) is not None)
            assert reader.gpu_utilization(endpoint) == pytest.approx(0.81)
            exporter.gpus = [Gpu(12), Gpu(3)]
            await eventually(lambda: reader.gpu_utilization(endpoint) == pytest.approx(0.12))
        assert dcgm_tasks() == []
        hits = exporter.hits
        await asyncio.sleep(0.1)
        assert exporter.hits == hits  # nothing polls after stop


async def test_a_daemonset_exporter_is_read_on_each_pods_node() -> None:
    datastore = Datastore()
    # Pod IPs where nothing listens; the exporter runs on their node, 127.0.0.1.
    for address, name in (("127.0.0.2:8000", "vllm-a"), ("127.0.0.3:8000", "vllm-b")):
        datastore.upsert(EndpointSpec(address=address, name=name, node_address="127.0.0.1"))
    gpus = [Gpu(40, "vllm-a"), Gpu(70, "vllm-a"), Gpu(99, "vllm-b"), Gpu(0, "")]
    async with running(FakeDcgmExporter(gpus)) as exporter:
        scraper, reader = scraper_for(datastore, exporter, useNodeAddress=True)
        async with running(scraper):
            a, b = datastore.get("127.0.0.2:8000"), datastore.get("127.0.0.3:8000")
            assert a is not None and b is not None
            await eventually(lambda: None not in (reader.gpu_utilization(e) for e in (a, b)))
            assert reader.gpu_utilization(a) == pytest.approx(0.70)
            assert reader.gpu_utilization(b) == pytest.approx(0.99)


async def test_an_exporter_that_stops_answering_loses_its_reading_and_regains_it(
    caplog: pytest.LogCaptureFixture,
) -> None:
    datastore = Datastore()
    datastore.upsert(EndpointSpec(address="127.0.0.1:8000", name="vllm-a"))
    async with running(FakeDcgmExporter([Gpu(64)])) as exporter:
        scraper, reader = scraper_for(datastore, exporter)
        endpoint = datastore.get("127.0.0.1:8000")
        assert endpoint is not None
        with caplog.at_level(logging.INFO, "epp.dcgm_scraping"):
            async with running(scraper):
                await eventually(lambda: reader.gpu_utilization(endpoint) is not None)
                exporter.status = 503
                await eventually(lambda: reader.gpu_utilization(endpoint) is None)
                assert scraper.failing[(0, endpoint.address)].endswith("HTTP 503")
                exporter.status = 200
                await eventually(lambda: reader.gpu_utilization(endpoint) == pytest.approx(0.64))
                assert scraper.failing == {}
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1  # once per outage, not once per scrape
    assert "no GPU metrics from 127.0.0.1:8000" in warnings[0].getMessage()
    assert any("read again" in r.getMessage() for r in caplog.records)


async def test_a_page_without_the_pods_gpus_is_a_miss() -> None:
    datastore = Datastore()
    datastore.upsert(EndpointSpec(address="127.0.0.1:8000", name="vllm-a"))
    async with running(FakeDcgmExporter([Gpu(64, "vllm-a")])) as exporter:
        scraper, reader = scraper_for(datastore, exporter)
        async with running(scraper):
            endpoint = datastore.get("127.0.0.1:8000")
            assert endpoint is not None
            await eventually(lambda: reader.gpu_utilization(endpoint) is not None)
            exporter.gpus = [Gpu(64, "vllm-z")]  # the exporter lost track of the pod
            await eventually(lambda: reader.gpu_utilization(endpoint) is None)
            assert "no series for pod 'vllm-a'" in scraper.failing[(0, endpoint.address)]


async def test_endpoints_coming_and_going_get_and_lose_their_poller() -> None:
    datastore = Datastore()
    async with running(FakeDcgmExporter([Gpu(10)])) as exporter:
        scraper, reader = scraper_for(datastore, exporter)
        async with running(scraper):
            assert dcgm_tasks() == []
            datastore.upsert(EndpointSpec(address="127.0.0.1:8000", name="vllm-a"))
            assert len(dcgm_tasks()) == 1
            endpoint = datastore.get("127.0.0.1:8000")
            assert endpoint is not None
            await eventually(lambda: reader.gpu_utilization(endpoint) is not None)
            datastore.remove("127.0.0.1:8000")
            await eventually(lambda: dcgm_tasks() == [])


def test_without_a_dcgm_source_in_the_data_layer_nothing_is_wired() -> None:
    without = (
        SIM_EPP_GPU_CONFIG[: SIM_EPP_GPU_CONFIG.index("dataLayer:")]
        + (SIM_EPP_GPU_CONFIG[SIM_EPP_GPU_CONFIG.index("schedulingProfiles:") :])
    )
    context = PluginContext(endpoints=StaticEndpoints([]))
    config = load_config(text=without)
    scheduler = build_scheduler(config, context, allow_experimental_plugins=True)
    assert dcgm_wirings(config, scheduler.plugin) == []


def test_the_server_wires_the_samples_source_to_its_extractor() -> None:
    from epp.server import EndpointPicker, ServerOptions

    picker = EndpointPicker(
        ServerOptions(
            endpoints="127.0.0.1:8000",
            config_text=SIM_EPP_GPU_CONFIG,
            allow_experimental_plugins=True,
        )
    )
    try:
        (wiring,) = picker.dcgm_scraper.wirings
        assert wiring.source.name == "dcgm-source"
        assert [e.name for e in wiring.extractors] == ["dcgm-extractor"]
        assert picker.dcgm_scraper.periods == [pytest.approx(1.0)]  # interval "1s"
    finally:
        picker.executor.shutdown(wait=False)


async def test_the_gpu_sample_routes_on_what_the_exporter_reports() -> None:
    """llm-d-router's sim-epp-gpu-config.yaml end to end: the exporter's page, the scraper,
    the extractor, the filter and the scorer."""
    text = SIM_EPP_GPU_CONFIG.replace('interval: "1s"', 'interval: "20ms"')
    gpus = [Gpu(85, "vllm-a"), Gpu(30, "vllm-b"), Gpu(96, "vllm-c")]
    async with running(FakeDcgmExporter(gpus)) as exporter:
        text = text.replace("port: 9400", f"port: {exporter.port}")
        datastore = Datastore()
        for port, name in ((8001, "vllm-a"), (8002, "vllm-b"), (8003, "vllm-c")):
            datastore.upsert(EndpointSpec(address=f"127.0.0.1:{port}", name=name))
        context = PluginContext(endpoints=datastore, rng=random.Random(0))
        config = load_config(text=text)
        scheduler = build_scheduler(config, context, allow_experimental_plugins=True)
        reader = scheduler.plugin("dcgm-extractor")
        assert isinstance(reader, DcgmExtractor)
        scraper = DcgmScraper(datastore, dcgm_wirings(config, scheduler.plugin), tick=0.02)
        async with running(scraper):
            await eventually(lambda: len(reader.readings) == 3)
            result = await scheduler.schedule(request(), datastore.endpoints())
            assert result.targets[0].name == "vllm-b"
            totals = result.profiles["default"].scores
            assert "127.0.0.1:8003" not in totals  # 96 % > 90 %
            exporter.gpus = [Gpu(5, "vllm-a"), Gpu(30, "vllm-b"), Gpu(96, "vllm-c")]
            await eventually(lambda: reader.readings["127.0.0.1:8001"].utilization < 0.1)
            result = await scheduler.schedule(request(), datastore.endpoints())
            assert result.targets[0].name == "vllm-a"


async def test_a_running_epp_polls_the_exporter_from_start_to_stop() -> None:
    from epp.server import EndpointPicker, ServerOptions
    from launcher.ports import reserve_port

    async with running(FakeDcgmExporter([Gpu(42)])) as exporter:
        text = SIM_EPP_GPU_CONFIG.replace("port: 9400", f"port: {exporter.port}")
        picker = EndpointPicker(
            ServerOptions(
                host="127.0.0.1",
                grpc_port=reserve_port(),
                grpc_health_port=reserve_port(),
                metrics_port=reserve_port(),
                endpoints="127.0.0.1:8000",  # a static endpoint: its exporter is a sidecar
                kv_events_port=None,
                config_text=text.replace('interval: "1s"', 'interval: "20ms"'),
                allow_experimental_plugins=True,
                drain_quiet_period=0.0,
            )
        )
        reader = picker.scheduler.plugin("dcgm-extractor")
        assert isinstance(reader, DcgmExtractor)
        await picker.start()
        try:
            await eventually(lambda: "127.0.0.1:8000" in reader.readings)
            assert reader.readings["127.0.0.1:8000"].utilization == pytest.approx(0.42)
        finally:
            await picker.stop()
        assert dcgm_tasks() == []
