"""``utilization-filter``: llm-d-router's filter that drops overloaded pods by fixed caps on
their load (upstream ``pkg/epp/framework/plugins/scheduling/filter/utilization``; Alpha there and
here: it needs ``--allow-experimental-plugins``).

``conditions`` is a list of caps, at least one, each a ``metric`` and a ``maxValue``; a pod stays
when every metric is at most its cap, so several conditions drop a pod that breaks any of them.
The metrics:

* ``active-requests``: the requests this EPP routed to the pod that have not finished
  (`scorers.base.EndpointLoad.in_flight_requests`, upstream's ``inflight-load-producer`` count;
  running and queued alike);
* ``running-requests``, ``waiting-queue``: vLLM's running and waiting requests, as scraped;
* ``kv-cache-utilization``: its KV-cache usage, a fraction (``maxValue`` at most 1).

As upstream, a pod never scraped counts as 0 on the scraped metrics, and metrics are read however
old they are (the detectors, not this filter, judge staleness).  When every pod is dropped the
result is empty (the profile's 429), or, with ``fallbackOnEmpty``, every candidate.
``inFlightLoadProducerName`` may name the declared ``inflight-load-producer`` whose count
``active-requests`` reads (the EPP's own count here, whichever is named).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Final, Self

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from scorers.base import Endpoint, LLMRequest, Plugin, PluginContext, register
from scorers.inflight_load import bind_in_flight_producer

METRICS: Final[Mapping[str, Callable[[Endpoint], float]]] = {
    "active-requests": lambda e: e.load.in_flight_requests,
    "running-requests": lambda e: e.metrics.running_requests,
    "waiting-queue": lambda e: e.metrics.waiting_requests,
    "kv-cache-utilization": lambda e: e.metrics.kv_cache_usage,
}


class _Strict(BaseModel):
    # Strict, as upstream's Go decoding: "40" is not a number, "true" not a boolean.
    model_config = ConfigDict(extra="forbid", strict=True)


class Condition(_Strict):
    metric: str = ""
    maxValue: float | None = Field(default=None, allow_inf_nan=False)

    @model_validator(mode="after")
    def _valid_cap(self) -> Self:
        if self.metric not in METRICS:
            known = ", ".join(repr(m) for m in METRICS)
            raise ValueError(f"metric must be one of {known}, got {self.metric!r}")
        if self.maxValue is None:
            raise ValueError(f"the condition on {self.metric!r} needs maxValue")
        if self.maxValue < 0:
            raise ValueError(
                f"maxValue of {self.metric!r} must be non-negative, got {self.maxValue:g}"
            )
        if self.metric == "kv-cache-utilization" and self.maxValue > 1:
            raise ValueError(
                f"maxValue of 'kv-cache-utilization' is a fraction and must be at most 1, got "
                f"{self.maxValue:g} (0.8 for 80 %)"
            )
        return self


class UtilizationFilterParameters(_Strict):
    conditions: list[Condition] = Field(default_factory=list, validate_default=True)
    fallbackOnEmpty: bool = Field(
        default=False, description="Keep every candidate when all would be dropped."
    )
    inFlightLoadProducerName: str = Field(
        default="", description="active-requests: the inflight-load-producer it reads."
    )

    @field_validator("conditions")
    @classmethod
    def _some_condition(cls, value: list[Condition]) -> list[Condition]:
        if not value:
            raise ValueError(
                "a utilization filter needs at least one condition, e.g. "
                "[{metric: waiting-queue, maxValue: 0}]"
            )
        return value


@register("utilization-filter")
class UtilizationFilter(Plugin[UtilizationFilterParameters]):
    """Keeps the pods under every cap (module docstring)."""

    experimental = True

    def __init__(self, name: str, params: BaseModel, context: PluginContext) -> None:
        super().__init__(name, params, context)
        self.caps = tuple(
            (METRICS[c.metric], float(c.maxValue))
            for c in self.p.conditions
            if c.maxValue is not None  # checked by the parameters
        )

    def bind(self, plugins: Mapping[str, object]) -> None:
        bind_in_flight_producer(self, self.p.inFlightLoadProducerName, plugins)

    def filter(self, request: LLMRequest, endpoints: Sequence[Endpoint]) -> list[Endpoint]:
        kept = [e for e in endpoints if all(metric(e) <= cap for metric, cap in self.caps)]
        if not kept and self.p.fallbackOnEmpty:
            return list(endpoints)
        return kept
