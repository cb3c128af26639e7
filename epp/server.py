"""Wiring: builds the EPP from its options and runs it until told to stop.

    discovery (Kubernetes or static) ─▶ datastore ─▶ listeners: scheduler plugins (KV-event
                                                     subscriptions), metrics scraper
    Envoy ─ext_proc─▶ ExtProcServicer ─▶ Director ─▶ Scheduler (plugins from the config)
    kubelet/Envoy ─grpc.health.v1─▶ HealthService      Prometheus ─▶ /metrics (Telemetry)

Start order: telemetry, datastore, scheduler (plugins start), scraper, discovery, then the
servers; readiness turns SERVING once discovery has synced.  Stop order is the reverse, after a
drain: readiness goes NOT_SERVING first so Envoy and Kubernetes move traffic elsewhere; the
ext_proc server keeps serving until nothing is in flight *and* no new request arrived for
``drain_quiet_period`` (the time a proxy's health check needs to notice), or ``drain_timeout``
passes; then it stops.  With two or more replicas behind Envoy's health-checked ext_proc cluster,
a replica restarts without losing a request (``docs/reliability.md``).

The ext_proc port speaks TLS with ``secure_serving`` (`epp.tls`); off by default because the
project's own chart, demo and tests connect Envoy in plaintext inside the pod network (turn it on
for gateways configured for the Inference Extension's default TLS).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import time
from collections.abc import Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path
from typing import cast

import grpc
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from epp.admission import AdmissionController, AdmissionMode, AdmissionSettings
from epp.config import EndpointPickerConfig, build_scheduler, load_config
from epp.datastore import Datastore
from epp.dcgm_scraping import DcgmScraper, dcgm_wirings
from epp.director import Director
from epp.discovery import Discovery
from epp.discovery.kubernetes import KubernetesDiscovery
from epp.discovery.pool import PoolRef, rank_port_clash, selector_pool
from epp.discovery.static import StaticDiscovery
from epp.extproc import ExtProcSettings
from epp.extproc_server import ExtProcServer, start_extproc_server
from epp.flow_control import FlowController, build_flow_controller
from epp.gauges import GaugeSample
from epp.health import HealthService, add_health_service
from epp.models_scraping import ModelsScraper, models_wirings
from epp.request_rules import RequestRules
from epp.requests import DEFAULT_MAX_BODY_BYTES
from epp.scheduler import Scheduler
from epp.scraping import (
    DEFAULT_FAILURE_THRESHOLD,
    DEFAULT_SCRAPE_TIMEOUT,
    DEFAULT_UNREACHABLE_AFTER,
    MetricsScraper,
)
from epp.telemetry import Telemetry
from epp.tls import server_credentials
from indexer.hashing import CACHE_BYTES_PER_BLOCK, live_cache_blocks
from indexer.tokenization import CACHE_BYTES_PER_TOKEN, live_segment_caches
from kvcache.settings import KVEventsSettings
from scorers.base import PluginContext, SaturationDetector, create_plugin

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class ServerOptions:
    """Everything `epp serve` accepts; see ``epp.cli`` for each flag's documentation."""

    grpc_port: int = 9002
    grpc_health_port: int = 9003
    metrics_port: int = 9090
    host: str = "0.0.0.0"
    config_file: str | None = None
    config_text: str | None = None
    pool_name: str | None = None
    pool_namespace: str = "default"
    pool_group: str = "inference.networking.k8s.io"
    endpoints: str | None = None
    endpoints_file: str | None = None
    kv_events_port: int | None = 5557
    kv_events_replay_port: int | None = None
    refresh_metrics_interval: float = 0.05
    metrics_timeout: float = DEFAULT_SCRAPE_TIMEOUT
    saturation_staleness: float = 0.2
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    drain_timeout: float = 30.0
    drain_quiet_period: float = 2.0
    tokenizer_workers: int = 2
    endpoint_failure_threshold: int | None = DEFAULT_FAILURE_THRESHOLD
    endpoint_unreachable_after: float | None = DEFAULT_UNREACHABLE_AFTER
    max_in_flight_per_endpoint: int | None = None
    admission_mode: AdmissionMode = "reject"
    max_queued_requests: int = 1000
    max_queue_wait: float = 5.0
    secure_serving: bool = False
    cert_path: str | None = None
    enable_cert_reload: bool = False
    kv_cache_grpc_port: int | None = None
    disable_endpoint_subset_filter: bool | None = None
    endpoint_selector: str | None = None
    endpoint_target_ports: str | None = None
    allow_experimental_plugins: bool | None = None
    # The options set on the command line (the others hold their defaults): the configuration
    # may set some of them another way, and only a value the user chose can disagree with it.
    flags_given: frozenset[str] = frozenset()


_POD_PORTS = (
    # (option, KVEventsSettings key, llm-d-router's key in podDiscoveryConfig)
    ("kv_events_port", "publisherPort", "socketPort"),
    ("kv_events_replay_port", "replayPort", "replaySocketPort"),
)


def with_pod_event_ports(
    options: ServerOptions, views: Sequence[KVEventsSettings]
) -> ServerOptions:
    """``options`` with each pod's KV-event ports taken from the KV-cache views' settings where
    they name them (llm-d-router's ``kvEventsConfig.podDiscoveryConfig``): discovery gives every
    endpoint one publisher and one replay address, so the views must agree, and a flag given on
    the command line must say the same.  Raises ValueError naming both sides otherwise."""
    for option, key, llmd_key in _POD_PORTS:
        ports = sorted({port for view in views if (port := getattr(view, key)) is not None})
        if not ports:
            continue
        flag = "--" + option.replace("_", "-")
        if len(ports) > 1:
            raise ValueError(
                f"the precise prefix plugins name different per-pod ports ({key} / "
                f"podDiscoveryConfig.{llmd_key}: {', '.join(map(str, ports))}); each pod has one "
                f"address for them ({flag}): configure one port"
            )
        (port,) = ports
        given = getattr(options, option)
        if option in options.flags_given and given != port:
            raise ValueError(
                f"{flag} {given or 'off'} and the configuration's {key} "
                f"(podDiscoveryConfig.{llmd_key}) {port} disagree: drop the flag or make them "
                "equal"
            )
        if given != port:
            logger.info("%s %d, from the configuration's %s", flag, port, key)
        options = replace(options, **{option: port})
    return options


class EndpointPicker:
    """One running EPP.  `start` brings everything up; `stop` drains and tears it down."""

    def __init__(self, options: ServerOptions) -> None:
        if not options.secure_serving and (options.cert_path or options.enable_cert_reload):
            raise ValueError(
                "--cert-path and --enable-cert-reload apply to TLS: add --secure-serving"
            )
        self.options = options
        self.telemetry = Telemetry(pool_name=options.pool_name or "static")
        self.datastore = Datastore(staleness_threshold=options.saturation_staleness)
        self.executor = ThreadPoolExecutor(
            max_workers=max(1, options.tokenizer_workers), thread_name_prefix="epp-cpu"
        )
        self.context = PluginContext(
            endpoints=self.datastore, executor=self.executor, saw_alive=self.datastore.saw_alive
        )
        config = self.config = load_config(
            Path(options.config_file) if options.config_file else None, text=options.config_text
        )
        self.scheduler: Scheduler = build_scheduler(
            config,
            self.context,
            on_plugin_duration=self.telemetry.observe_plugin,
            allow_experimental_plugins=bool(options.allow_experimental_plugins),
        )
        self.options = options = with_pod_event_ports(
            options, [view.settings.kvEvents for view in self.context.kv_caches]
        )
        configured = self.scheduler.plugin(config.saturation_detector or "")
        detector = configured if isinstance(configured, SaturationDetector) else None
        self.admission = AdmissionController(
            AdmissionSettings(
                max_in_flight_per_endpoint=options.max_in_flight_per_endpoint,
                mode=options.admission_mode,
                max_queued=options.max_queued_requests,
                max_queue_wait=options.max_queue_wait,
            ),
            saturation=detector.saturation if detector is not None else None,
        )
        # llm-d-router's InferenceModelRewrites and InferenceObjectives, watched with the pool.
        self.rules = (
            RequestRules(pool=(options.pool_group, options.pool_name))
            if options.pool_name
            else None
        )
        self.flow_detector: SaturationDetector | None = None  # flow control's, once built
        self.flow_control = self._flow_control(config, detector)
        self.director = Director(
            self.datastore,
            self.scheduler,
            self.telemetry,
            self.flow_control or self.admission,
            self.rules,
        )
        self.scraper = MetricsScraper(
            self.datastore,
            interval=options.refresh_metrics_interval,
            timeout=options.metrics_timeout,
            failure_threshold=options.endpoint_failure_threshold,
            unreachable_after=options.endpoint_unreachable_after,
            on_duration=self.telemetry.scrape_duration.observe,
        )
        # dataLayer's dcgm-data-source entries: GPU utilization for endpoint-attribute-*.
        self.dcgm_scraper = DcgmScraper(
            self.datastore,
            dcgm_wirings(config, self.scheduler.plugin),
            tick=options.refresh_metrics_interval,
        )
        # dataLayer's models-data-source entries: each endpoint's /v1/models.
        self.models_scraper = ModelsScraper(
            self.datastore,
            models_wirings(config, self.scheduler.plugin),
            tick=options.refresh_metrics_interval,
        )
        self.discovery: Discovery = self._discovery()
        self.health = HealthService(lambda: self.datastore.synced)
        self.extproc: ExtProcServer | None = None
        self.health_server: HealthServer | None = None
        self._metrics_runner: web.AppRunner | None = None
        self.metrics_port: int | None = None
        self.kv_cache_server: grpc.aio.Server | None = None
        self.kv_cache_port: int | None = None
        self.telemetry.add_source(self._pool_samples)
        self.telemetry.add_source(self._reliability_samples)
        self.telemetry.add_source(self._plugin_samples)

    def _discovery(self) -> Discovery:
        opts = self.options
        if opts.endpoint_selector is not None:
            if opts.pool_name or opts.endpoints or opts.endpoints_file:
                raise ValueError(
                    "--endpoint-selector (pool-less discovery) excludes --pool-name, "
                    "--endpoints and --endpoints-file; pass one"
                )
            selected = selector_pool(opts.endpoint_selector, opts.endpoint_target_ports)
            clash = rank_port_clash(
                opts.kv_events_port, opts.kv_events_replay_port, len(selected.target_ports)
            )
            if clash:
                raise ValueError(clash.replace("; replay is off until then", ""))
            return KubernetesDiscovery(
                self.datastore,
                PoolRef(name="(endpoint-selector)", namespace=opts.pool_namespace),
                fixed_pool=selected,
                kv_events_port=opts.kv_events_port,
                replay_port=opts.kv_events_replay_port,
            )
        if opts.pool_name:
            if opts.endpoints or opts.endpoints_file:
                raise ValueError(
                    "--pool-name (Kubernetes discovery) and --endpoints/--endpoints-file (static) "
                    "are mutually exclusive; pass one"
                )
            pool = PoolRef(
                name=opts.pool_name, namespace=opts.pool_namespace, group=opts.pool_group
            )
            return KubernetesDiscovery(
                self.datastore,
                pool,
                rules=self.rules,
                kv_events_port=opts.kv_events_port,
                replay_port=opts.kv_events_replay_port,
            )
        return StaticDiscovery.from_flags(
            self.datastore,
            endpoints=opts.endpoints,
            endpoints_file=opts.endpoints_file,
            kv_events_port=opts.kv_events_port,
            replay_port=opts.kv_events_replay_port,
        )

    async def start(self) -> None:
        opts = self.options
        # The KV-cache views first: tokenizers loaded and warmed, subscribers ready for the
        # endpoints discovery is about to add.
        await self.context.kv_caches.start(self.executor)
        self.datastore.add_listener(self.context.kv_caches)
        await self.scheduler.start()
        self.datastore.add_listener(self.scheduler)
        self.datastore.add_listener(self.scraper)
        await self.scraper.start()
        await self.dcgm_scraper.start()
        await self.models_scraper.start()
        await self.discovery.start()
        self.health_server = await _start_health_server(
            self.health, opts.host, opts.grpc_health_port
        )
        tls = (
            server_credentials(
                cert_path=opts.cert_path,
                reload=opts.enable_cert_reload,
                hosts=[opts.host] if opts.host not in ("0.0.0.0", "::") else [],
            )
            if opts.secure_serving
            else None
        )
        self.extproc = await start_extproc_server(
            self.director,
            port=opts.grpc_port,
            host=opts.host,
            settings=ExtProcSettings(
                max_body_bytes=opts.max_body_bytes,
                ignore_subset_hint=bool(opts.disable_endpoint_subset_filter),
                parsers=frozenset(self.config.parser_types),
            ),
            tls=tls,
            # Envoy's ext_proc cluster health check asks the ext_proc port itself.
            extra_services=(lambda server: add_health_service(server, self.health),),
        )
        await self._start_metrics_server()
        if opts.kv_cache_grpc_port is not None:
            from kvcache.api.service import start_kv_cache_server  # stubs only when served

            self.kv_cache_server, self.kv_cache_port = await start_kv_cache_server(
                self.context.kv_caches, self.executor, opts.host, opts.kv_cache_grpc_port
            )
            logger.info("KV-cache gRPC API on :%d", self.kv_cache_port)
        logger.info(
            "endpoint picker serving: ext_proc :%d (%s), health :%d, metrics :%d",
            self.extproc.port,
            "TLS" if tls is not None else "plaintext",
            self.health_server.port,
            self.metrics_port or 0,
        )

    def _flow_control(
        self, config: EndpointPickerConfig, detector: SaturationDetector | None
    ) -> FlowController | None:
        """llm-d-router's flow control when the configuration's ``flowControl`` gate is on."""
        if not config.flow_control_enabled:
            return None
        if self.options.max_in_flight_per_endpoint is not None:
            raise ValueError(
                "featureGates: flowControl queues requests by the pool's saturation; "
                "--max-in-flight-per-endpoint is the other admission control: use one"
            )
        if detector is None:  # upstream injects a utilization-detector with its defaults
            detector = cast(
                SaturationDetector,
                create_plugin("utilization-detector", "utilization-detector", None, self.context),
            )
        self.flow_detector = detector
        datastore = self.datastore
        return build_flow_controller(
            config.flow_control_settings,
            {getattr(p, "name", ""): p for p in self.scheduler.plugins},
            detector.saturation,
            lambda: datastore.routable(datastore.endpoints()),
            observer=self.telemetry,
        )

    async def stop(self) -> None:
        """Drain, then stop in reverse order.  Safe to call once after `start` (even if it
        failed part-way)."""
        self.health.draining = True
        if self.flow_control is not None:
            await self.flow_control.stop()
        if self.extproc is not None:
            await self._drain()
            await self.extproc.stop(grace=5.0)
        if self.health_server is not None:
            await self.health_server.stop(grace=1.0)
        if self._metrics_runner is not None:
            await self._metrics_runner.cleanup()
        if self.kv_cache_server is not None:
            await self.kv_cache_server.stop(grace=1.0)
        with contextlib.suppress(Exception):
            await self.discovery.stop()
        await self.scraper.stop()
        await self.dcgm_scraper.stop()
        await self.models_scraper.stop()
        await self.scheduler.stop()
        await self.context.kv_caches.stop()
        self.executor.shutdown(wait=False, cancel_futures=True)

    async def _drain(self) -> None:
        """Keep serving until no routed request is in flight and none arrived for
        ``drain_quiet_period`` (proxies still sending are not yet told we are leaving), at most
        ``drain_timeout``."""
        loop = asyncio.get_running_loop()
        started = time.monotonic()
        deadline = loop.time() + self.options.drain_timeout
        quiet = self.options.drain_quiet_period
        while loop.time() < deadline:
            last = max(self.director.last_request_at or started, started)
            idle = self.datastore.pool_stats().in_flight_requests == 0
            if idle and time.monotonic() - last >= quiet:
                return
            await asyncio.sleep(0.05)
        logger.warning("drain timeout reached with requests still in flight or arriving")

    async def _start_metrics_server(self) -> None:
        async def metrics(_: web.Request) -> web.Response:
            body = generate_latest(self.telemetry.registry)
            return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

        app = web.Application()
        app.router.add_get("/metrics", metrics)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, self.options.host, self.options.metrics_port)
        await site.start()
        self._metrics_runner = runner
        server = site._server
        sockets = getattr(server, "sockets", None) or []
        self.metrics_port = sockets[0].getsockname()[1] if sockets else self.options.metrics_port

    # -- scrape-time samples --------------------------------------------------------------------

    def _pool_samples(self) -> Iterable[GaugeSample]:
        pool = (("name", self.telemetry.pool_name),)
        stats = self.datastore.pool_stats()
        yield GaugeSample(
            "inference_pool_ready_pods", "Ready endpoints in the pool.", stats.ready_endpoints, pool
        )
        if stats.average_kv_cache_usage is not None:
            yield GaugeSample(
                "inference_pool_average_kv_cache_utilization",
                "Average KV-cache utilization (0..1) of endpoints with fresh metrics.",
                stats.average_kv_cache_usage,
                pool,
            )
        if stats.average_waiting_requests is not None:
            yield GaugeSample(
                "inference_pool_average_queue_size",
                "Average waiting requests of endpoints with fresh metrics.",
                stats.average_waiting_requests,
                pool,
            )
        for ep in self.datastore.endpoints():
            yield GaugeSample(
                "inference_pool_per_pod_queue_size",
                "Waiting requests per endpoint, as scraped.",
                ep.metrics.waiting_requests,
                (*pool, ("model_server_pod", ep.name or ep.address)),
            )
        for address, status in self.scraper.status.items():
            yield GaugeSample(
                "inference_extension_metrics_scrape_errors",
                "Failed scrapes of an endpoint's /metrics since it was added.",
                status.errors,
                (("endpoint", address),),
            )
        for ep in self.datastore.endpoints():
            if ep.metrics.updated_at is not None:
                yield GaugeSample(
                    "inference_extension_metrics_age_seconds",
                    "Seconds since the endpoint's /metrics last answered with a good page (a "
                    "busy pod answers late; routing weighs its aging metrics).",
                    ep.metrics_age,
                    (("endpoint", ep.address),),
                )

    def _reliability_samples(self) -> Iterable[GaugeSample]:
        datastore, admission = self.datastore, self.admission
        with contextlib.suppress(RuntimeError):  # scraped from outside the loop's thread
            yield GaugeSample(
                "inference_extension_asyncio_tasks",
                "asyncio tasks alive in the EPP (a steady number; growth is a leak).",
                len(asyncio.all_tasks(asyncio.get_running_loop())),
            )
        yield GaugeSample(
            "inference_extension_unreachable_endpoints",
            "Ready endpoints left out of candidates because their /metrics stopped answering.",
            len(datastore.unreachable()),
        )
        for reason in ("connection_refused", "connection_reset", "no_sign_of_life"):
            yield GaugeSample(
                "inference_extension_endpoint_unreachable_transitions",
                "Times an endpoint was found unreachable (cumulative), by reason: its /metrics "
                "connection refused or reset several times in a row, or no answer and no other "
                "sign of life (KV events, response bytes) for a while.",
                datastore.unreachable_marks.get(reason, 0),
                (("reason", reason),),
            )
        yield GaugeSample(
            "inference_extension_fail_open_decisions",
            "Requests routed among unreachable endpoints because no candidate was reachable "
            "(cumulative).",
            datastore.fail_open_total,
        )
        if admission.settings.enabled:
            yield GaugeSample(
                "inference_extension_admission_queued_requests",
                "Requests waiting for an endpoint with room.",
                admission.queued,
            )
            for reason, count in admission.rejected_total.items():
                yield GaugeSample(
                    "inference_extension_admission_rejected",
                    "Requests answered 429 by admission control (cumulative).",
                    count,
                    (("reason", reason),),
                )
        yield from self.context.kv_caches.telemetry_samples()

        yield GaugeSample(
            "inference_extension_prefix_hasher_cached_blocks",
            "Block digests held by the prefix hashers' caches (bounded; about "
            f"{CACHE_BYTES_PER_BLOCK} bytes each).",
            live_cache_blocks(),
        )
        for model, tokens in live_segment_caches().items():
            yield GaugeSample(
                "inference_extension_tokenizer_cache_tokens",
                "Tokens held by the tokenizer's segment cache (bounded; about "
                f"{CACHE_BYTES_PER_TOKEN} bytes each).",
                tokens,
                (("tokenizer", model),),
            )

    def _plugin_samples(self) -> Iterable[GaugeSample]:
        plugins: list[object] = list(self.scheduler.plugins)
        if self.flow_detector is not None and self.flow_detector not in plugins:
            plugins.append(self.flow_detector)  # the one flow control injected
        for plugin in plugins:
            samples = getattr(plugin, "telemetry_samples", None)
            if callable(samples):
                yield from samples()


@dataclass(slots=True)
class HealthServer:
    server: grpc.aio.Server
    port: int

    async def stop(self, grace: float | None = 1.0) -> None:
        await self.server.stop(grace)


async def _start_health_server(health: HealthService, host: str, port: int) -> HealthServer:
    server = grpc.aio.server()
    add_health_service(server, health)
    bound = server.add_insecure_port(f"{host}:{port}")
    if bound == 0:
        raise OSError(f"gRPC health server could not bind {host}:{port}")
    await server.start()
    return HealthServer(server=server, port=bound)


async def serve(options: ServerOptions) -> None:
    """Run until SIGTERM or SIGINT, then drain and stop."""
    picker = EndpointPicker(options)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        with contextlib.suppress(NotImplementedError):
            loop.add_signal_handler(sig, stop.set)
    try:
        await picker.start()
        await stop.wait()
        logger.info("signal received: draining (up to %.0f s)", options.drain_timeout)
    finally:
        await picker.stop()
