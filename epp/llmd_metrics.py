"""llm-d-router's ``llm_d_epp_*`` request metrics, emitted beside the Inference Extension's
``inference_objective_*`` / ``inference_extension_*`` ones (`epp.telemetry`), so dashboards
written for either work.

Their labels are llm-d-router's: ``model_name`` (the client's), ``target_model_name`` (after a
rewrite), ``fairness_id`` (the ``x-llm-d-inference-fairness-id`` or
``x-gateway-inference-fairness-id`` header, else the ``agent-identity`` plugin's session id,
``default-flow`` without either), ``priority`` (the
InferenceObjective's, `epp.request_rules`), and ``streaming`` on the TTFT.  Buckets are
upstream's.
"""

from __future__ import annotations

from typing import Final

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from scorers.base import LLMRequest
from scorers.disagg import DISAGG_DECISION, DisaggDecision
from scorers.disagg_legacy import PD_DECISION
from scorers.request_data import AGENT_IDENTITY

FAIRNESS_HEADERS: Final = ("x-llm-d-inference-fairness-id", "x-gateway-inference-fairness-id")
DEFAULT_FAIRNESS_ID: Final = "default-flow"
_LABELS: Final = ["model_name", "target_model_name", "fairness_id", "priority"]
_TOKEN_BUCKETS: Final = (
    1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32778, 65536, 131072,
    262144, 524288, 1048576,
)  # fmt: skip
_OUTPUT_BUCKETS: Final = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)
_TTFT_BUCKETS: Final = (
    0.005, 0.025, 0.05, 0.1, 0.2, 0.4, 0.6, 0.8, 1.0, 1.25, 1.5, 2, 3, 4, 5, 6, 8, 10, 15, 20,
    30, 45, 60, 120,
)  # fmt: skip
_DURATION_BUCKETS: Final = (
    0.005, 0.025, 0.05, 0.1, 0.2, 0.4, 0.6, 0.8, 1.0, 1.25, 1.5, 2, 3, 4, 5, 6, 8, 10, 15, 20,
    30, 45, 60, 120, 180, 240, 300, 360, 480, 600, 900, 1200, 1800, 2700, 3600,
)  # fmt: skip
_QUEUE_BUCKETS: Final = (
    0.0001, 0.0005, 0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60,
)  # fmt: skip
_SCHEDULER_BUCKETS: Final = (
    0.0001, 0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1,
)  # fmt: skip
_CYCLE_BUCKETS: Final = _SCHEDULER_BUCKETS  # upstream's flow-control dispatch and enqueue ones


# Label values a client chooses (model names, fairness ids) are capped as llm-d-router caps
# them: the first 1,000 distinct values are kept, later ones count as "other".
MAX_LABEL_VALUES: Final = 1000
OVERFLOW: Final = "other"


def fairness_id(request: LLMRequest) -> str:
    """The request's flow: its fairness header, else the agent session ``agent-identity``
    found (llm-d-router's director derives it the same way), else ``default-flow``."""
    for header in FAIRNESS_HEADERS:
        if value := request.headers.get(header):
            return value
    agent = request.data.get(AGENT_IDENTITY)
    return agent if isinstance(agent, str) and agent else DEFAULT_FAIRNESS_ID


class BoundedLabel:
    """A label's values, capped at ``limit`` distinct ones; the mapping never changes once a
    value is seen, so a gauge's increment and decrement land on the same series."""

    def __init__(self, limit: int = MAX_LABEL_VALUES) -> None:
        self.limit = limit
        self._seen: set[str] = set()

    def __call__(self, value: str) -> str:
        if not value or value in self._seen:
            return value
        if len(self._seen) >= self.limit:
            return OVERFLOW
        self._seen.add(value)
        return value


class LlmdMetrics:
    """The ``llm_d_epp_*`` families, in ``registry``."""

    def __init__(self, registry: CollectorRegistry) -> None:
        r = registry
        self.bound_model = BoundedLabel()
        self.bound_fairness = BoundedLabel()
        self.requests = Counter(
            "llm_d_epp_request", "Total number of processed requests.", _LABELS, registry=r
        )
        self.errors = Counter(
            "llm_d_epp_request_error",
            "Total number of request errors.",
            [*_LABELS, "error_code"],
            registry=r,
        )
        self.duration = Histogram(
            "llm_d_epp_request_duration_seconds",
            "End-to-end request latency distribution in seconds.",
            _LABELS,
            buckets=_DURATION_BUCKETS,
            registry=r,
        )
        self.ttft = Histogram(
            "llm_d_epp_request_ttft_seconds",
            "Time to first token in seconds, from the routing decision to the first response byte.",
            [*_LABELS, "streaming"],
            buckets=_TTFT_BUCKETS,
            registry=r,
        )
        self.input_tokens = Histogram(
            "llm_d_epp_request_input_tokens",
            "Input token count distribution per request.",
            _LABELS,
            buckets=_TOKEN_BUCKETS,
            registry=r,
        )
        self.output_tokens = Histogram(
            "llm_d_epp_request_output_tokens",
            "Output token count distribution per request.",
            _LABELS,
            buckets=_OUTPUT_BUCKETS,
            registry=r,
        )
        self.cached_tokens = Histogram(
            "llm_d_epp_request_cached_tokens",
            "Prompt tokens read from cache per request, as the model server reports them.",
            _LABELS,
            buckets=_TOKEN_BUCKETS,
            registry=r,
        )
        self.running = Gauge(
            "llm_d_epp_request_running",
            "Current number of active running requests.",
            _LABELS,
            registry=r,
        )
        self.scheduler_e2e = Histogram(
            "llm_d_epp_scheduler_e2e_duration_seconds",
            "End-to-end scheduling latency distribution in seconds.",
            buckets=_SCHEDULER_BUCKETS,
            registry=r,
        )
        self.model_rewrites = Counter(
            "llm_d_epp_model_rewrite_decisions",
            "Total number of inference model rewrite decisions.",
            ["model_rewrite_name", "model_name", "target_model"],
            registry=r,
        )

        self.disagg_decisions = Counter(
            "llm_d_epp_disagg_decision",
            "Disaggregation decisions of the disagg-profile-handler, by the stages that ran on "
            "pods of their own.",
            ["plugin_name", "plugin_type", "model_name", "decision_type"],
            registry=r,
        )
        # llm-d-router's deprecated subsystem still carries the same counter (two labels).
        self.disagg_decisions_deprecated = Counter(
            "llm_d_inference_scheduler_disagg_decision",
            "Disaggregation decisions (deprecated name of llm_d_epp_disagg_decision_total).",
            ["model_name", "decision_type"],
            registry=r,
        )
        # The deprecated pd-profile-handler's own counters (scorers.disagg_legacy), in both
        # subsystems as upstream.
        self.pd_decisions = Counter(
            "llm_d_epp_pd_decision",
            "P/D decisions of the pd-profile-handler (decode-only or prefill-decode), made "
            "before the prefill profile runs.",
            ["plugin_name", "plugin_type", "model_name", "decision_type"],
            registry=r,
        )
        self.pd_decisions_deprecated = Counter(
            "llm_d_inference_scheduler_pd_decision",
            "P/D decisions (deprecated name of llm_d_epp_pd_decision_total).",
            ["model_name", "decision_type"],
            registry=r,
        )

        self.flow_requests = Counter(
            "llm_d_epp_flow_control_requests",
            "Requests through flow control, by outcome (Dispatched, RejectedCapacity, "
            "RejectedNoEndpoints, EvictedTTL, EvictedNoEndpoints, EvictedContextCancelled).",
            ["outcome", "priority", "inference_pool"],
            registry=r,
        )
        self.flow_queue_duration = tuple(
            Histogram(
                f"{prefix}_flow_control_request_queue_duration_seconds",
                "Time a request spent in flow control, from its arrival to its outcome.",
                [
                    "fairness_id",
                    "priority",
                    "outcome",
                    "inference_pool",
                    "model_name",
                    "target_model_name",
                ],
                buckets=_QUEUE_BUCKETS,
                registry=r,
            )
            for prefix in ("llm_d_epp", "inference_extension")
        )
        self.flow_dispatch_cycle = tuple(
            Histogram(
                f"{prefix}_flow_control_dispatch_cycle_duration_seconds",
                "Time one flow-control dispatch cycle took.",
                buckets=_CYCLE_BUCKETS,
                registry=r,
            )
            for prefix in ("llm_d_epp", "inference_extension")
        )
        self.flow_enqueue_duration = tuple(
            Histogram(
                f"{prefix}_flow_control_request_enqueue_duration_seconds",
                "Time to put a request into its flow-control queue (outcome NotYetFinalized) "
                "or to refuse it.",
                ["fairness_id", "priority", "outcome"],
                buckets=_CYCLE_BUCKETS,
                registry=r,
            )
            for prefix in ("llm_d_epp", "inference_extension")
        )
        queue_labels = ["fairness_id", "priority", "inference_pool", "model_name",
                        "target_model_name"]  # fmt: skip
        self.flow_queue_size = tuple(
            Gauge(
                f"{prefix}_flow_control_queue_size",
                "Requests waiting in flow control now.",
                queue_labels,
                registry=r,
            )
            for prefix in ("llm_d_epp", "inference_extension")
        )
        self.flow_queue_bytes = tuple(
            Gauge(
                f"{prefix}_flow_control_queue_bytes",
                "Body bytes of the requests waiting in flow control now.",
                queue_labels,
                registry=r,
            )
            for prefix in ("llm_d_epp", "inference_extension")
        )
        self.flow_capacity_requests = Gauge(
            "llm_d_epp_flow_control_capacity_utilization_requests",
            "Waiting requests over the priority band's maxRequests, at the last dispatch cycle.",
            ["priority", "inference_pool"],
            registry=r,
        )
        self.flow_capacity_bytes = Gauge(
            "llm_d_epp_flow_control_capacity_utilization_bytes",
            "Waiting bytes over the priority band's maxBytes, at the last dispatch cycle.",
            ["priority", "inference_pool"],
            registry=r,
        )
        self.flow_global_capacity_requests = Gauge(
            "llm_d_epp_flow_control_global_capacity_utilization_requests",
            "Waiting requests over flowControl.maxRequests (only when it is set).",
            ["inference_pool"],
            registry=r,
        )
        self.flow_global_capacity_bytes = Gauge(
            "llm_d_epp_flow_control_global_capacity_utilization_bytes",
            "Waiting bytes over flowControl.maxBytes (only when it is set).",
            ["inference_pool"],
            registry=r,
        )
        self.flow_saturation = tuple(
            Gauge(
                f"{prefix}_flow_control_pool_saturation",
                "The pool's saturation as flow control last measured it, by stage (prefill, "
                "decode, effective).",
                ["inference_pool", "stage"],
                registry=r,
            )
            for prefix in ("llm_d_epp", "inference_extension")
        )

    def disagg_decided(self, request: LLMRequest) -> None:
        model = self.bound_model(request.model) or "unknown"
        for key, counter, deprecated in (
            (DISAGG_DECISION, self.disagg_decisions, self.disagg_decisions_deprecated),
            (PD_DECISION, self.pd_decisions, self.pd_decisions_deprecated),
        ):
            decision = request.data.get(key)
            if not isinstance(decision, DisaggDecision):
                continue
            counter.labels(
                decision.plugin_name, decision.plugin_type, model, decision.decision
            ).inc()
            deprecated.labels(model, decision.decision).inc()

    def labels(self, request: LLMRequest) -> tuple[str, str, str, str]:
        """(model_name, target_model_name, fairness_id, priority), capped; the first two are
        the labels of the Inference Extension's family too."""
        return (
            self.bound_model(request.client_model),
            self.bound_model(request.model),
            self.bound_fairness(fairness_id(request)),
            str(request.priority),
        )
