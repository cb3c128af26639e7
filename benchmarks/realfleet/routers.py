"""The routers a real-fleet run compares, each started in front of freshly started servers:

* ``epp:<policy>``: ``epp serve`` with one of `benchmarks.policies` (``epp:default`` is what it
  runs without a configuration file) behind a real Envoy, fed by the servers' KV events and
  ``/metrics``;
* ``sglang-router``: SGLang's model gateway (PyPI ``sglang-router``), policy ``cache_aware``
  with its defaults, talking to the servers directly.
"""

from __future__ import annotations

import math
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import yaml

from benchmarks.policies import POLICIES
from benchmarks.realfleet.fleet import Fleet, Server
from launcher.sglang_router import SGLangRouter
from launcher.stack import Stack
from launcher.vllm import metric_values

SGLANG_ROUTER = "sglang-router"
# Envoy's access log in each EPP run's directory (`epp.envoy_bootstrap.ACCESS_LOG_FIELDS`): where
# each request's time went between the client, the EPP and the server.
ENVOY_ACCESS_LOG = "envoy-access.log"


@dataclass
class RouterStats:
    """What a router reports about itself after a run (the EPP's own metrics)."""

    decision_ms_mean: float | None = None
    decision_ms_p99: float | None = None
    scrape_ms_p50: float | None = None
    """How long the servers' ``/metrics`` took to answer the EPP's scrapes (histogram buckets:
    upper bounds)."""
    scrape_ms_p99: float | None = None
    unreachable_transitions: dict[str, float] = field(default_factory=dict)


class Router(Protocol):
    name: str

    def start(self, servers: list[Server], fleet: Fleet, workdir: Path) -> str:
        """Bring the router up in front of ``servers``; its base URL."""
        ...

    def stats(self) -> RouterStats: ...

    def stop(self) -> None: ...


def router_names() -> list[str]:
    return [f"epp:{name}" for name in POLICIES] + [SGLANG_ROUTER]


def make_router(name: str) -> Router:
    if name == SGLANG_ROUTER:
        return SGLangPeer()
    policy = name.removeprefix("epp:")
    if not name.startswith("epp:") or policy not in POLICIES:
        raise ValueError(f"unknown router {name!r}; known: {', '.join(router_names())}")
    return EppRouter(name, POLICIES[policy].config_yaml)


def fleet_config(config_yaml: str, fleet: Fleet) -> str:
    """The policy's configuration with the fleet's tokenizer, block size and hash algorithm
    given to the precise prefix scorer (a user sets them the same way for their pods)."""
    config = yaml.safe_load(config_yaml)
    for plugin in config.get("plugins") or ():
        if plugin.get("type") == "precise-prefix-cache-scorer":
            parameters = plugin.setdefault("parameters", {}) or {}
            plugin["parameters"] = parameters
            parameters.setdefault("tokenizer", str(fleet.tokenizer_dir))
            parameters.setdefault("blockSize", fleet.block_size)
            parameters.setdefault("hashAlgo", fleet.hash_algo)
    return yaml.safe_dump(config, sort_keys=False)


class EppRouter:
    """``epp serve`` with static endpoints and a policy's configuration, and Envoy in front."""

    log_level: str | None = None
    """``epp --log-level`` (debug logs every decision); None leaves the EPP's default."""

    def __init__(self, name: str, config_yaml: str) -> None:
        self.name = name
        self.config_yaml = config_yaml
        self._stack: Stack | None = None
        self._last_stats = RouterStats()

    def start(self, servers: list[Server], fleet: Fleet, workdir: Path) -> str:
        self._stack = Stack.start(
            workdir,
            None,
            pods=0,
            config=fleet_config(self.config_yaml, fleet),
            extra_endpoints=[s.endpoint_entry() for s in servers],
            epp_log_level=self.log_level,
            envoy_options={"access_log_path": str(workdir / ENVOY_ACCESS_LOG)},
            ready_timeout=120,
        )
        return self._stack.gateway

    def stats(self) -> RouterStats:
        if self._stack is None:
            return self._last_stats
        with urllib.request.urlopen(self._stack.metrics_url, timeout=10) as response:
            text = response.read().decode()
        self._last_stats = epp_stats(text)
        return self._last_stats

    def stop(self) -> None:
        if self._stack is not None:
            self._stack.stop()
            self._stack = None


def _histogram_quantile(values: dict[str, float], name: str, q: float) -> float | None:
    """The upper bound of the bucket holding quantile ``q`` (None without observations)."""
    count = values.get(f"{name}_count", 0.0)
    if not count:
        return None
    buckets = sorted(
        (float(series.split('le="')[1].split('"')[0]), value)
        for series, value in values.items()
        if series.startswith(f"{name}_bucket{{")
    )
    return next((bound for bound, cumulative in buckets if cumulative >= q * count), math.inf)


def epp_stats(metrics_text: str) -> RouterStats:
    """Decision time (mean, and p99 from the histogram's buckets), scrape latency and
    unreachable transitions from an ``epp serve`` metrics page."""
    values = metric_values(metrics_text)
    name = "inference_extension_scheduler_e2e_duration_seconds"
    count = values.get(f"{name}_count", 0.0)
    stats = RouterStats()
    if count:
        stats.decision_ms_mean = 1000 * values.get(f"{name}_sum", 0.0) / count
        p99 = _histogram_quantile(values, name, 0.99)
        stats.decision_ms_p99 = None if p99 is None else 1000 * p99
    scrape = "inference_extension_metrics_scrape_duration_seconds"
    for attr, q in (("scrape_ms_p50", 0.5), ("scrape_ms_p99", 0.99)):
        value = _histogram_quantile(values, scrape, q)
        setattr(stats, attr, None if value is None else 1000 * value)
    prefix = "inference_extension_endpoint_unreachable_transitions{"
    for series, value in values.items():
        if series.startswith(prefix):
            reason = series.split('reason="')[1].split('"')[0]
            stats.unreachable_transitions[reason] = value
    return stats


class SGLangPeer:
    """SGLang's model gateway with ``cache_aware`` and its published defaults."""

    name = SGLANG_ROUTER

    def __init__(self) -> None:
        self._router: SGLangRouter | None = None

    def start(self, servers: list[Server], fleet: Fleet, workdir: Path) -> str:
        self._router = SGLangRouter([s.url for s in servers], workdir / "sglang-router.log")
        self._router.start()
        return self._router.url

    def stats(self) -> RouterStats:
        return RouterStats()

    def stop(self) -> None:
        if self._router is not None:
            self._router.stop()
            self._router = None
