"""The vLLM /metrics parser and the scraper.

Pages are built with prometheus_client itself (the library vLLM uses to serve them), with the
metric names, labels and histogram buckets of vLLM 0.33 (docs/vllm-interop.md §6), so escaping,
``_total`` / ``_created`` suffixes and label order are what a real server sends.

``python -m tests.epp.test_scraping`` times the parser against prometheus_client's on such a page.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import pytest
from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from epp.datastore import Datastore, EndpointSpec
from epp.scraping import MetricsScraper, ScrapeError, parse_vllm_metrics
from scorers.base import Endpoint, EndpointMetrics

MODEL = "meta-llama/Llama-3.1-8B-Instruct"
_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)  # fmt: skip
_ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                10.0, 20.0, 40.0, 80.0)  # fmt: skip
_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                    60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)  # fmt: skip
_TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000)  # build_1_2_5_buckets(8192)


@dataclass
class EngineState:
    waiting: int = 0
    running: int = 0
    kv_usage: float = 0.0
    num_gpu_blocks: int = 3000


@dataclass
class PageSpec:
    engines: list[EngineState] = field(default_factory=lambda: [EngineState()])
    old_kv_name: bool = False  # vLLM < 0.12: vllm:gpu_cache_usage_perc only
    block_size: int = 16
    # (running, waiting, max_lora, timestamp) per lora_requests_info series
    lora: list[tuple[str, str, int, float]] = field(default_factory=list)


def vllm_metrics_page(spec: PageSpec) -> str:
    """A /metrics page as vLLM 0.33's PrometheusStatLogger serves it."""
    r = CollectorRegistry()
    base = ["model_name", "engine"]
    running = Gauge(
        "vllm:num_requests_running",
        "Number of requests in model execution batches.",
        base,
        registry=r,
    )
    waiting = Gauge(
        "vllm:num_requests_waiting", "Number of requests waiting to be processed.", base, registry=r
    )
    by_reason = Gauge(
        "vllm:num_requests_waiting_by_reason",
        "Waiting requests by reason.",
        [*base, "reason"],
        registry=r,
    )
    kv_name = "vllm:gpu_cache_usage_perc" if spec.old_kv_name else "vllm:kv_cache_usage_perc"
    kv = Gauge(kv_name, "KV-cache usage. 1 means 100 percent usage.", base, registry=r)
    counters = {
        name: Counter(name, f"{name} counter", base, registry=r)
        for name in (
            "vllm:prefix_cache_queries", "vllm:prefix_cache_hits", "vllm:external_prefix_cache_queries",
            "vllm:external_prefix_cache_hits", "vllm:mm_cache_queries", "vllm:mm_cache_hits",
            "vllm:num_preemptions", "vllm:prompt_tokens", "vllm:generation_tokens",
        )
    }  # fmt: skip
    success = Counter(
        "vllm:request_success", "Finished requests.", [*base, "finished_reason"], registry=r
    )
    histograms = [
        Histogram(name, f"{name} histogram", base, buckets=buckets, registry=r)
        for name, buckets in (
            ("vllm:iteration_tokens_total", _TOKEN_BUCKETS),
            ("vllm:request_prompt_tokens", _TOKEN_BUCKETS),
            ("vllm:request_generation_tokens", _TOKEN_BUCKETS),
            ("vllm:request_max_num_generation_tokens", _TOKEN_BUCKETS),
            ("vllm:request_params_n", (1, 2, 5, 10, 20)),
            ("vllm:request_params_max_tokens", _TOKEN_BUCKETS),
            ("vllm:time_to_first_token_seconds", _TTFT_BUCKETS),
            ("vllm:inter_token_latency_seconds", _ITL_BUCKETS),
            ("vllm:request_time_per_output_token_seconds", _ITL_BUCKETS),
            ("vllm:e2e_request_latency_seconds", _LATENCY_BUCKETS),
            ("vllm:request_queue_time_seconds", _LATENCY_BUCKETS),
            ("vllm:request_inference_time_seconds", _LATENCY_BUCKETS),
            ("vllm:request_prefill_time_seconds", _LATENCY_BUCKETS),
            ("vllm:request_decode_time_seconds", _LATENCY_BUCKETS),
        )
    ]
    cache_labels = ["block_size", "gpu_memory_utilization", "swap_space", "cache_dtype",
                    "num_gpu_blocks", "num_cpu_blocks", "enable_prefix_caching",
                    "prefix_caching_hash_algo", "cpu_offload_gb", "calculate_kv_scales",
                    "kv_sharing_fast_prefill", "hash_block_size", "engine"]  # fmt: skip
    cache_info = Gauge(
        "vllm:cache_config_info",
        "Information of the LLMEngine CacheConfig",
        cache_labels,
        registry=r,
    )
    for i, eng in enumerate(spec.engines):
        labels = {"model_name": MODEL, "engine": str(i)}
        running.labels(**labels).set(eng.running)
        waiting.labels(**labels).set(eng.waiting)
        by_reason.labels(**labels, reason="capacity").set(eng.waiting)
        by_reason.labels(**labels, reason="deferred").set(0)
        kv.labels(**labels).set(eng.kv_usage)
        for c in counters.values():
            c.labels(**labels).inc(12345)
        for reason in ("stop", "length", "abort", "error"):
            success.labels(**labels, finished_reason=reason).inc(7)
        for h in histograms:
            h.labels(**labels).observe(0.7)
        cache_info.labels(
            block_size=str(spec.block_size), gpu_memory_utilization="0.9", swap_space="4",
            cache_dtype="auto", num_gpu_blocks=str(eng.num_gpu_blocks), num_cpu_blocks="None",
            enable_prefix_caching="True", prefix_caching_hash_algo="sha256_cbor",
            cpu_offload_gb="0", calculate_kv_scales="False", kv_sharing_fast_prefill="False",
            hash_block_size="None", engine=str(i),
        ).set(1)  # fmt: skip
    if spec.lora:
        lora = Gauge(
            "vllm:lora_requests_info",
            "Running stats on lora requests.",
            ["max_lora", "waiting_lora_adapters", "running_lora_adapters"],
            registry=r,
        )
        for run, wait, max_lora, ts in spec.lora:
            lora.labels(
                max_lora=str(max_lora), waiting_lora_adapters=wait, running_lora_adapters=run
            ).set(ts)
    return generate_latest(r).decode()


def realistic_page() -> str:
    return vllm_metrics_page(
        PageSpec(
            engines=[EngineState(3, 5, 0.25, 3000), EngineState(1, 7, 0.75, 3100)],
            lora=[
                ("sql-lora", "", 4, 1_700_000_000.0),
                ("sql-lora,chat-lora", "sql-lora", 4, 1_700_000_100.0),
            ],
        )
    )


# ---------------------------------------------------------------------------------------------
# Parsing


def test_parses_a_two_engine_page_with_lora() -> None:
    m = parse_vllm_metrics(realistic_page())
    assert m.waiting_requests == 4  # summed over engines
    assert m.running_requests == 12
    assert m.kv_cache_usage == pytest.approx(0.5)  # averaged over engines
    # Two lora_requests_info series: the newer (larger timestamp value) wins.
    assert m.running_lora_adapters == frozenset({"sql-lora", "chat-lora"})
    assert m.waiting_lora_adapters == frozenset({"sql-lora"})
    assert m.max_lora == 4
    assert m.block_size == 16
    assert m.num_gpu_blocks == 6100  # each engine has its own KV cache
    assert m.updated_at is None


def test_page_has_the_confusable_series() -> None:
    page = realistic_page()
    # Guard the fixture itself: the parser must cope with these look-alikes.
    assert "vllm:num_requests_waiting_by_reason{" in page
    assert "vllm:prefix_cache_queries_total{" in page
    assert "vllm:prefix_cache_queries_created{" in page


def test_newest_lora_series_wins_regardless_of_order() -> None:
    page = vllm_metrics_page(PageSpec(lora=[("new-a", "new-b", 2, 2e9), ("old", "", 1, 1e9)]))
    m = parse_vllm_metrics(page)
    assert m.running_lora_adapters == frozenset({"new-a"})
    assert m.waiting_lora_adapters == frozenset({"new-b"})
    assert m.max_lora == 2


def test_no_lora_series_means_no_adapters() -> None:
    m = parse_vllm_metrics(vllm_metrics_page(PageSpec()))
    assert m.running_lora_adapters == frozenset()
    assert m.max_lora == 0


def test_old_gauge_name_before_vllm_0_12() -> None:
    page = vllm_metrics_page(PageSpec(engines=[EngineState(kv_usage=0.4)], old_kv_name=True))
    assert "vllm:kv_cache_usage_perc" not in page
    assert parse_vllm_metrics(page).kv_cache_usage == pytest.approx(0.4)


def test_new_gauge_name_wins_when_both_exist() -> None:
    page = (
        "vllm:num_requests_waiting 0\nvllm:num_requests_running 0\n"
        "vllm:gpu_cache_usage_perc 0.9\nvllm:kv_cache_usage_perc 0.1\n"
    )
    assert parse_vllm_metrics(page).kv_cache_usage == pytest.approx(0.1)


def test_hand_written_page_with_escapes_timestamps_and_crlf() -> None:
    page = (
        'vllm:num_requests_waiting{engine="0",model_name="m"} 2 1700000000000\r\n'
        "# HELP vllm:num_requests_running Running.\r\n"
        "vllm:num_requests_running 3.0\r\n"
        'vllm:kv_cache_usage_perc{model_name="a \\"quoted\\" } name"} 1.5e-01\r\n'
        'vllm:lora_requests_info{max_lora="3",running_lora_adapters="x, y",waiting_lora_adapters=""} 1.7e+09\r\n'
        'vllm:cache_config_info{block_size="32",num_gpu_blocks="None",engine="0"} 1.0'
    )
    m = parse_vllm_metrics(page)
    assert (m.waiting_requests, m.running_requests) == (2, 3)
    assert m.kv_cache_usage == pytest.approx(0.15)
    assert m.running_lora_adapters == frozenset({"x", "y"})
    assert m.max_lora == 3
    assert m.block_size == 32
    assert m.num_gpu_blocks is None  # "None" before the KV cache is profiled


@pytest.mark.parametrize(
    ("page", "fragment"),
    [
        ("", "no vllm:num_requests_waiting, vllm:num_requests_running"),
        ("<html><body>404 Not Found</body></html>", "not a vLLM metrics page"),
        ("\x00\xff\x10garbage", "not a vLLM metrics page"),
        ("vllm:num_requests_waiting 1\nvllm:num_requests_running 1\n", "vllm:kv_cache_usage_perc"),
        (
            "vllm:num_requests_waiting abc\nvllm:num_requests_running 1\nvllm:kv_cache_usage_perc 0",
            "vllm:num_requests_waiting: sample value 'abc' is not a number",
        ),
        (
            'vllm:num_requests_waiting{engine="0" 1\nvllm:num_requests_running 1\nvllm:kv_cache_usage_perc 0',
            "unterminated label set",
        ),
        (
            "vllm:num_requests_waiting NaN\nvllm:num_requests_running 1\nvllm:kv_cache_usage_perc 0",
            "not finite",
        ),
        (
            "vllm:num_requests_waiting 0\nvllm:num_requests_running 1\nvllm:kv_cache_usage_perc 0\n"
            "vllm:cache_config_info{block_size=16} 1",
            "vllm:cache_config_info: malformed labels",
        ),
        (
            "vllm:num_requests_waiting 0\nvllm:num_requests_running 1\nvllm:kv_cache_usage_perc 0\n"
            'vllm:cache_config_info{block_size="sixteen"} 1',
            "block_size='sixteen' is not an integer",
        ),
    ],
)
def test_garbage_raises_one_scrape_error(page: str, fragment: str) -> None:
    with pytest.raises(ScrapeError) as info:
        parse_vllm_metrics(page)
    assert fragment in str(info.value)


def test_agrees_with_prometheus_client_parser() -> None:
    page = realistic_page()
    reference: dict[str, list[float]] = {}
    for family in text_string_to_metric_families(page):
        for sample in family.samples:
            reference.setdefault(sample.name, []).append(sample.value)
    m = parse_vllm_metrics(page)
    assert m.waiting_requests == sum(reference["vllm:num_requests_waiting"])
    assert m.running_requests == sum(reference["vllm:num_requests_running"])
    kv = reference["vllm:kv_cache_usage_perc"]
    assert m.kv_cache_usage == pytest.approx(sum(kv) / len(kv))


# ---------------------------------------------------------------------------------------------
# Scraping a real HTTP server


class FakeVllm:
    """An aiohttp server whose /metrics page, status and delay the test controls."""

    def __init__(self) -> None:
        self.page = vllm_metrics_page(
            PageSpec(engines=[EngineState(waiting=1, running=2, kv_usage=0.3)])
        )
        self.status = 200
        self.delay = 0.0
        self.hits = 0
        self.runner: web.AppRunner | None = None
        self.port = 0

    async def handle(self, request: web.Request) -> web.Response:
        self.hits += 1
        if self.delay:
            await asyncio.sleep(self.delay)
        return web.Response(text=self.page, status=self.status, content_type="text/plain")

    async def start(self) -> None:
        app = web.Application()
        app.router.add_get("/metrics", self.handle)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        self.port = self.runner.addresses[0][1]

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"


async def eventually(check: Callable[[], bool], timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        await asyncio.sleep(0.01)


def _scrape_tasks() -> list[asyncio.Task[object]]:
    return [t for t in asyncio.all_tasks() if t.get_name().startswith("scrape ")]


async def test_scraper_updates_datastore_and_stops_cleanly(vllm_server: FakeVllm) -> None:
    ds = Datastore()
    ds.upsert(EndpointSpec(address=vllm_server.address))
    scraper = MetricsScraper(ds, interval=0.02, timeout=0.5)
    await scraper.start()
    try:
        await eventually(lambda: ds.get(vllm_server.address).metrics.updated_at is not None)  # type: ignore[union-attr]
        ep = ds.get(vllm_server.address)
        assert ep is not None
        assert (ep.metrics.waiting_requests, ep.metrics.running_requests) == (1, 2)
        assert ep.metrics.kv_cache_usage == pytest.approx(0.3)
        assert not ep.metrics_stale
        vllm_server.page = vllm_metrics_page(PageSpec(engines=[EngineState(waiting=9)]))
        await eventually(lambda: ds.get(vllm_server.address).metrics.waiting_requests == 9)  # type: ignore[union-attr]
        hits = vllm_server.hits
        await eventually(lambda: vllm_server.hits >= hits + 3)  # keeps polling at its interval
        assert scraper.status[vllm_server.address].successes >= 3
        assert scraper.status[vllm_server.address].errors == 0
    finally:
        await scraper.stop()
    assert _scrape_tasks() == []
    hits = vllm_server.hits
    await asyncio.sleep(0.1)
    assert vllm_server.hits == hits  # nothing polls after stop


async def test_timing_out_endpoint_keeps_old_metrics_and_goes_stale(vllm_server: FakeVllm) -> None:
    ds = Datastore(staleness_threshold=0.15)
    ds.upsert(EndpointSpec(address=vllm_server.address))
    scraper = MetricsScraper(ds, interval=0.02, timeout=0.05)
    await scraper.start()
    try:
        await eventually(lambda: ds.get(vllm_server.address).metrics.updated_at is not None)  # type: ignore[union-attr]
        vllm_server.delay = 1.0  # every scrape now times out
        await eventually(lambda: ds.get(vllm_server.address).metrics_stale, timeout=3)  # type: ignore[union-attr]
        ep = ds.get(vllm_server.address)
        assert ep is not None
        assert ep.metrics.waiting_requests == 1  # the old values stay, only flagged stale
        await eventually(lambda: scraper.status[vllm_server.address].errors >= 2)
        assert "timed out" in (scraper.status[vllm_server.address].last_error or "")
        vllm_server.delay = 0.0
        await eventually(lambda: not ds.get(vllm_server.address).metrics_stale)  # type: ignore[union-attr]
        assert scraper.status[vllm_server.address].consecutive_errors == 0
    finally:
        await scraper.stop()
    assert _scrape_tasks() == []


async def test_http_errors_and_garbage_are_counted_not_raised(vllm_server: FakeVllm) -> None:
    ds = Datastore()
    ds.upsert(EndpointSpec(address=vllm_server.address))
    scraper = MetricsScraper(ds, interval=0.02)
    await scraper.start()
    try:
        vllm_server.status = 500
        await eventually(lambda: scraper.status[vllm_server.address].errors >= 2)
        assert "HTTP 500" in (scraper.status[vllm_server.address].last_error or "")
        vllm_server.status = 200
        vllm_server.page = "<html>oops</html>"
        await eventually(
            lambda: (
                "not a vLLM metrics page" in (scraper.status[vllm_server.address].last_error or "")
            )
        )
        assert ds.get(vllm_server.address).metrics.updated_at is None  # type: ignore[union-attr]
    finally:
        await scraper.stop()


async def test_unreachable_endpoint_is_counted() -> None:
    ds = Datastore()
    ds.upsert(EndpointSpec(address="127.0.0.1:1"))  # nothing listens on port 1
    scraper = MetricsScraper(ds, interval=0.02, timeout=0.2)
    await scraper.start()
    try:
        await eventually(lambda: scraper.status["127.0.0.1:1"].errors >= 2)
    finally:
        await scraper.stop()
    assert _scrape_tasks() == []


async def test_tasks_follow_endpoint_membership(vllm_server: FakeVllm) -> None:
    ds = Datastore()
    scraper = MetricsScraper(ds, interval=0.02)
    await scraper.start()
    try:
        assert scraper.scraped_addresses() == []
        ds.upsert(EndpointSpec(address=vllm_server.address))
        assert scraper.scraped_addresses() == [vllm_server.address]
        await eventually(lambda: ds.get(vllm_server.address).metrics.updated_at is not None)  # type: ignore[union-attr]
        # A new metrics URL restarts the task against it.
        ds.upsert(
            EndpointSpec(
                address=vllm_server.address, metrics_url=f"http://{vllm_server.address}/other"
            )
        )
        await eventually(lambda: scraper.status[vllm_server.address].errors >= 1)
        assert "HTTP 404" in (scraper.status[vllm_server.address].last_error or "")
        ds.remove(vllm_server.address)
        assert scraper.scraped_addresses() == []
        assert vllm_server.address not in scraper.status
        await eventually(lambda: len(_scrape_tasks()) == 0)
    finally:
        await scraper.stop()


async def test_scrape_once_for_unknown_endpoint_is_false() -> None:
    scraper = MetricsScraper(Datastore())
    await scraper.start()
    try:
        assert await scraper.scrape_once("10.0.0.1:8000") is False
    finally:
        await scraper.stop()


async def test_existing_endpoints_are_scraped_on_start_and_listener_removed_on_stop(
    vllm_server: FakeVllm,
) -> None:
    ds = Datastore()
    ds.upsert(EndpointSpec(address=vllm_server.address))
    scraper = MetricsScraper(ds, interval=0.02)
    await scraper.start()
    assert scraper.scraped_addresses() == [vllm_server.address]
    await scraper.stop()
    ds.upsert(EndpointSpec(address="10.9.9.9:8000"))
    assert scraper.scraped_addresses() == []


def test_rejects_bad_knobs() -> None:
    with pytest.raises(ValueError, match="interval"):
        MetricsScraper(Datastore(), interval=0)
    with pytest.raises(ValueError, match="timeout"):
        MetricsScraper(Datastore(), timeout=-1)


def test_endpoint_view_unchanged_by_parse() -> None:
    # parse returns a fresh object each time; the datastore swaps it in whole.
    ds = Datastore()
    ds.upsert(EndpointSpec(address="10.0.0.1:8000"))
    first = parse_vllm_metrics(realistic_page())
    assert ds.update_metrics("10.0.0.1:8000", first)
    ep: Endpoint | None = ds.get("10.0.0.1:8000")
    assert ep is not None and ep.metrics is first
    assert isinstance(ep.metrics, EndpointMetrics)


# ---------------------------------------------------------------------------------------------
# Timing (not a test): python -m tests.epp.test_scraping


def _time(fn: Callable[[], object], rounds: int) -> float:
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(rounds):
            fn()
        best = min(best, (time.perf_counter() - t0) / rounds)
    return best * 1e6


def _reference_parse(page: str) -> object:
    return [s for f in text_string_to_metric_families(page) for s in f.samples]


def main() -> None:
    page = realistic_page()
    ours = _time(lambda: parse_vllm_metrics(page), 2000)
    theirs = _time(lambda: _reference_parse(page), 20)
    lines = page.count("\n")
    print(f"page: {len(page)} bytes, {lines} lines, 2 engines, LoRA info")
    print(f"epp.scraping.parse_vllm_metrics:                  {ours:9.1f} µs per page")
    print(f"prometheus_client text_string_to_metric_families: {theirs:9.1f} µs per page")


if __name__ == "__main__":
    main()
