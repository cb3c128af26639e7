"""The EPP's Prometheus metrics, served on ``--metrics-port`` (9090).

Names follow the Inference Extension where the metric exists there (``inference_objective_*``,
``inference_pool_*``, ``inference_extension_*``), so its dashboards and alerts work unchanged;
metrics only this project has (the precise KV index, KV-event ingestion, hash self-check) use the
``inference_extension_`` prefix with the same conventions.

State that lives in other objects (the KV index, the subscriber, the datastore) is read at scrape
time through `StatsSource` callbacks rather than pushed on every change, which keeps the request
and event hot paths free of metric updates.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Final

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from epp.flow_control import FlowObserver
from epp.gauges import GaugeSample
from epp.llmd_metrics import DEFAULT_FAIRNESS_ID, LlmdMetrics
from scorers.base import LLMRequest, Usage

# Decision latencies are sub-millisecond to tens of milliseconds.
_LATENCY_BUCKETS: Final = (
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0,
)  # fmt: skip
_REQUEST_BUCKETS: Final = (
    0.005, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160, 320, 640,
)  # fmt: skip
_SCRAPE_BUCKETS: Final = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0)
_TOKEN_BUCKETS: Final = (16, 64, 256, 1024, 4096, 16384, 65536, 131072, 262144, 1048576)
_RATIO_BUCKETS: Final = (0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 1.0)


StatsSource = Callable[[], Iterable[GaugeSample]]


class _SourceCollector(Collector):
    def __init__(self, sources: list[StatsSource]) -> None:
        self._sources = sources

    def collect(self) -> Iterable[Metric]:
        families: dict[str, GaugeMetricFamily] = {}
        for source in self._sources:
            for sample in source():
                family = families.get(sample.name)
                if family is None:
                    family = GaugeMetricFamily(
                        sample.name, sample.documentation, labels=[k for k, _ in sample.labels]
                    )
                    families[sample.name] = family
                family.add_metric([v for _, v in sample.labels], sample.value)
        return list(families.values())


@dataclass
class Telemetry(FlowObserver):
    """Every metric the EPP exports, in its own registry (tests create as many as they like)."""

    pool_name: str = "default"
    registry: CollectorRegistry = field(
        default_factory=lambda: CollectorRegistry(auto_describe=True)
    )
    _sources: list[StatsSource] = field(default_factory=list)

    def __post_init__(self) -> None:
        r = self.registry
        self.requests = Counter(
            "inference_objective_request_total",
            "Requests the EPP handled, by requested and target model.",
            ["model_name", "target_model_name"],
            registry=r,
        )
        self.request_errors = Counter(
            "inference_objective_request_error_total",
            "Requests that ended in an error response, by error code.",
            ["model_name", "target_model_name", "error_code"],
            registry=r,
        )
        self.request_duration = Histogram(
            "inference_objective_request_duration_seconds",
            "Time from the routing decision to the end of the response.",
            ["model_name", "target_model_name"],
            buckets=_REQUEST_BUCKETS,
            registry=r,
        )
        self.request_ttft = Histogram(
            "inference_objective_request_ttft_seconds",
            "Time from the routing decision to the first response body byte.",
            ["model_name", "target_model_name"],
            buckets=_REQUEST_BUCKETS,
            registry=r,
        )
        self.input_tokens = Histogram(
            "inference_objective_input_tokens",
            "Prompt tokens per request, as reported by the model server.",
            ["model_name", "target_model_name"],
            buckets=_TOKEN_BUCKETS,
            registry=r,
        )
        self.output_tokens = Histogram(
            "inference_objective_output_tokens",
            "Completion tokens per request, as reported by the model server.",
            ["model_name", "target_model_name"],
            buckets=_TOKEN_BUCKETS,
            registry=r,
        )
        self.prompt_cached_tokens = Histogram(
            "inference_objective_prompt_cached_tokens",
            "Prompt tokens served from the model server's prefix cache (usage.cached_tokens).",
            ["model_name", "target_model_name"],
            buckets=_TOKEN_BUCKETS,
            registry=r,
        )
        self.model_rewrite_decisions = Counter(
            "inference_extension_model_rewrite_decisions",
            "Requests an InferenceModelRewrite sent to another model, by rewrite, requested "
            "and chosen model.",
            ["model_rewrite_name", "model_name", "target_model"],
            registry=r,
        )
        self.running_requests = Gauge(
            "inference_objective_running_requests",
            "Requests routed by the EPP whose response has not finished.",
            ["model_name"],
            registry=r,
        )
        self.scheduler_e2e = Histogram(
            "inference_extension_scheduler_e2e_duration_seconds",
            "Whole scheduling decision: data producers (tokenize, hash), filters, scorers, picker.",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.scheduler_attempts = Counter(
            "inference_extension_scheduler_attempts_total",
            "Scheduling attempts by outcome (success, failure).",
            ["status"],
            registry=r,
        )
        self.plugin_duration = Histogram(
            "inference_extension_plugin_duration_seconds",
            "Time spent in each plugin, by extension point.",
            ["extension_point", "plugin_type", "plugin_name"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.decision_prefix_hit_ratio = Histogram(
            "inference_extension_prefix_indexer_hit_ratio",
            "Share of the request's full blocks cached on the chosen endpoint at decision time.",
            buckets=_RATIO_BUCKETS,
            registry=r,
        )
        self.scrape_duration = Histogram(
            "inference_extension_metrics_scrape_duration_seconds",
            "Time an endpoint's /metrics took to answer (or to time out): a busy vLLM answers "
            "late, which is not a reason to stop routing to it.",
            buckets=_SCRAPE_BUCKETS,
            registry=r,
        )
        self.info = Gauge(
            "inference_extension_info",
            "Build information of the endpoint picker.",
            ["commit", "build_ref"],
            registry=r,
        )
        self.info.labels(commit="unknown", build_ref="kv-epp").set(1)
        self.llmd = LlmdMetrics(r)
        r.register(_SourceCollector(self._sources))

    def add_source(self, source: StatsSource) -> None:
        """Register a callback whose samples are exported at every scrape."""
        self._sources.append(source)

    def observe_plugin(
        self, extension_point: str, plugin_type: str, plugin_name: str, seconds: float
    ) -> None:
        self.plugin_duration.labels(extension_point, plugin_type, plugin_name).observe(seconds)

    # -- a request's life, in both name families (this module's and `epp.llmd_metrics`') ----
    # Model names and fairness ids come from clients: both families use the capped values.

    def request_routed(self, request: LLMRequest) -> None:
        labels = self.llmd.labels(request)
        client, model = labels[:2]
        self.requests.labels(client, model).inc()
        self.running_requests.labels(model).inc()
        self.llmd.requests.labels(*labels).inc()
        self.llmd.running.labels(*labels).inc()
        self.llmd.disagg_decided(request)

    # -- flow control (epp.flow_control.FlowObserver) -------------------------------------------

    def _flow_labels(self, request: LLMRequest | None) -> tuple[str, str, str]:
        """(fairness_id, model_name, target_model_name) of a queued request."""
        if request is None:
            return DEFAULT_FAIRNESS_ID, "", ""
        model, target, fairness, _ = self.llmd.labels(request)
        return fairness, model, target

    def flow_control_outcome(
        self, request: LLMRequest | None, outcome: str, priority: int, waited: float
    ) -> None:
        pool = self.pool_name
        fairness, model, target = self._flow_labels(request)
        self.llmd.flow_requests.labels(outcome, str(priority), pool).inc()
        for histogram in self.llmd.flow_queue_duration:
            histogram.labels(fairness, str(priority), outcome, pool, model, target).observe(waited)

    def flow_control_enqueue(
        self, request: LLMRequest | None, outcome: str, priority: int, seconds: float
    ) -> None:
        fairness = self._flow_labels(request)[0]
        for histogram in self.llmd.flow_enqueue_duration:
            histogram.labels(fairness, str(priority), outcome).observe(seconds)

    def flow_control_cycle(self, seconds: float) -> None:
        for histogram in self.llmd.flow_dispatch_cycle:
            histogram.observe(seconds)

    def flow_control_queue(self, request: LLMRequest | None, count: int, size: int) -> None:
        """A request started (+1, +bytes) or stopped (-1, -bytes) waiting in flow control."""
        if request is None:
            return
        model, target, fairness, priority = self.llmd.labels(request)
        labels = (fairness, priority, self.pool_name, model, target)
        for gauges, delta in (
            (self.llmd.flow_queue_size, count),
            (self.llmd.flow_queue_bytes, size),
        ):
            for gauge in gauges:
                gauge.labels(*labels).inc(delta)

    def flow_control_capacity(
        self,
        bands: Mapping[int, tuple[float, float]],
        whole: tuple[float | None, float | None],
    ) -> None:
        for priority, (requests, size) in bands.items():
            self.llmd.flow_capacity_requests.labels(str(priority), self.pool_name).set(requests)
            self.llmd.flow_capacity_bytes.labels(str(priority), self.pool_name).set(size)
        # As upstream, the global series exist only where a global limit is configured.
        for gauge, share in zip(
            (self.llmd.flow_global_capacity_requests, self.llmd.flow_global_capacity_bytes),
            whole,
            strict=True,
        ):
            if share is not None:
                gauge.labels(self.pool_name).set(share)

    def flow_control_saturation(self, stages: Mapping[str, float]) -> None:
        for stage, value in stages.items():
            for gauge in self.llmd.flow_saturation:
                gauge.labels(self.pool_name, stage).set(value)

    def first_byte(self, request: LLMRequest, seconds: float) -> None:
        labels = self.llmd.labels(request)
        self.request_ttft.labels(*labels[:2]).observe(seconds)
        streaming = "true" if request.stream else "false"
        self.llmd.ttft.labels(*labels, streaming).observe(seconds)

    def request_finished(
        self, request: LLMRequest, seconds: float | None, status: int, usage: Usage | None
    ) -> None:
        labels = self.llmd.labels(request)
        client, model = labels[:2]
        self.running_requests.labels(model).dec()
        self.llmd.running.labels(*labels).dec()
        if seconds is not None:
            self.request_duration.labels(client, model).observe(seconds)
            self.llmd.duration.labels(*labels).observe(seconds)
        if status >= 400:
            self.request_errors.labels(client, model, str(status)).inc()
            self.llmd.errors.labels(*labels, str(status)).inc()
        if usage is not None:
            self.input_tokens.labels(client, model).observe(usage.prompt_tokens)
            self.output_tokens.labels(client, model).observe(usage.completion_tokens)
            self.llmd.input_tokens.labels(*labels).observe(usage.prompt_tokens)
            self.llmd.output_tokens.labels(*labels).observe(usage.completion_tokens)
            if usage.cached_tokens is not None:
                self.prompt_cached_tokens.labels(client, model).observe(usage.cached_tokens)
                self.llmd.cached_tokens.labels(*labels).observe(usage.cached_tokens)

    def request_refused(self, request: LLMRequest | None, status: int) -> None:
        if request is None:
            self.request_errors.labels("", "", str(status)).inc()
            return
        labels = self.llmd.labels(request)
        self.request_errors.labels(*labels[:2], str(status)).inc()
        self.llmd.errors.labels(*labels, str(status)).inc()

    def scheduled(self, seconds: float) -> None:
        self.scheduler_e2e.observe(seconds)
        self.llmd.scheduler_e2e.observe(seconds)

    def model_rewritten(self, rewrite: str, client_model: str, target: str) -> None:
        client = self.llmd.bound_model(client_model)
        self.model_rewrite_decisions.labels(rewrite, client, target).inc()
        self.llmd.model_rewrites.labels(rewrite, client, target).inc()
