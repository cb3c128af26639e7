"""Building plugins and endpoints for scheduling tests, without a server."""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from typing import Any

import scorers  # noqa: F401  (registers the built-in plugin types)
from scorers.base import (
    Endpoint,
    EndpointLoad,
    EndpointMetrics,
    LLMRequest,
    Plugin,
    PluginContext,
    ProfileResult,
    SchedulingResult,
    create_plugin,
)


class StaticEndpoints:
    def __init__(self, endpoints: Sequence[Endpoint] = ()) -> None:
        self._endpoints = {e.address: e for e in endpoints}

    def endpoints(self) -> list[Endpoint]:
        return list(self._endpoints.values())

    def get(self, address: str) -> Endpoint | None:
        return self._endpoints.get(address)


def context(seed: int = 0) -> PluginContext:
    return PluginContext(endpoints=StaticEndpoints(), rng=random.Random(seed))


def make(
    type_name: str,
    parameters: Mapping[str, Any] | None = None,
    *,
    name: str | None = None,
    seed: int = 0,
    ctx: PluginContext | None = None,
) -> Any:
    """A plugin instance, typed `Any` so tests call its role methods directly."""
    plugin: Plugin[Any] = create_plugin(
        type_name, name or type_name, parameters, ctx if ctx is not None else context(seed)
    )
    return plugin


def endpoint(
    address: str,
    *,
    waiting: int = 0,
    running: int = 0,
    kv: float = 0.0,
    stale: bool = False,
    scraped: bool = True,
    in_flight: int = 0,
    labels: Mapping[str, str] | None = None,
    running_lora: Sequence[str] = (),
    waiting_lora: Sequence[str] = (),
    max_lora: int = 0,
) -> Endpoint:
    return Endpoint(
        address=address,
        labels=dict(labels or {}),
        metrics=EndpointMetrics(
            waiting_requests=waiting,
            running_requests=running,
            kv_cache_usage=kv,
            running_lora_adapters=frozenset(running_lora),
            waiting_lora_adapters=frozenset(waiting_lora),
            max_lora=max_lora,
            updated_at=0.0 if scraped else None,
        ),
        load=EndpointLoad(in_flight_requests=in_flight),
        metrics_stale=stale or not scraped,
    )


def request(request_id: str = "r1", model: str = "m", **fields: Any) -> LLMRequest:
    return LLMRequest(request_id=request_id, model=model, **fields)


def result_for(*targets: Endpoint, profile: str = "default") -> SchedulingResult:
    return SchedulingResult(
        primary_profile=profile,
        profiles={profile: ProfileResult(targets=tuple(targets), scores={})},
    )


def disaggregated_result(decode: Sequence[Endpoint], prefill: Endpoint) -> SchedulingResult:
    """A prefill/decode decision: the primary "decode" profile's targets, and a "prefill" one."""
    return SchedulingResult(
        primary_profile="decode",
        profiles={
            "decode": ProfileResult(targets=tuple(decode), scores={}),
            "prefill": ProfileResult(targets=(prefill,), scores={}),
        },
        prefill_profile="prefill",
    )
