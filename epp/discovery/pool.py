"""The InferencePool and its pods as the API server returns them (JSON dicts) → endpoint specs:
the pure part of `epp.discovery.kubernetes` (see its docstring for the rules)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final

from epp.datastore import EndpointSpec
from epp.discovery import DiscoveryConfigError, DiscoveryError, event_urls, format_address

POOL_GROUP: Final = "inference.networking.k8s.io"
POOL_GROUP_ALPHA: Final = "inference.networking.x-k8s.io"  # v1alpha2, before GIE v1.0
POOL_PLURAL: Final = "inferencepools"


@dataclass(slots=True, frozen=True)
class PoolRef:
    """Which InferencePool to serve (``--pool-name``, ``--pool-namespace``, ``--pool-group``)."""

    name: str
    namespace: str = "default"
    group: str = POOL_GROUP
    version: str | None = None  # None: v1 for the GA group, v1alpha2 for the x-k8s group

    @property
    def api_version(self) -> str:
        if self.version:
            return self.version
        return "v1alpha2" if self.group == POOL_GROUP_ALPHA else "v1"

    def __str__(self) -> str:
        return f"InferencePool {self.namespace}/{self.name} ({self.group}/{self.api_version})"


@dataclass(slots=True, frozen=True)
class PoolSpec:
    """The parts of an InferencePool that decide the endpoint set."""

    selector: tuple[tuple[str, str], ...]  # sorted (key, value) pairs: all must match
    target_ports: tuple[int, ...]

    @property
    def label_selector(self) -> str:
        """The selector in the API's ``labelSelector`` query syntax."""
        return ",".join(f"{k}={v}" for k, v in self.selector)

    def matches(self, labels: Mapping[str, str] | None) -> bool:
        labels = labels or {}
        return all(labels.get(k) == v for k, v in self.selector)


def _string_map(value: Any, field: str) -> dict[str, str]:
    if not isinstance(value, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in value.items()
    ):
        raise DiscoveryError(f"{field} must be a map of label names to string values")
    return dict(value)


def parse_pool(obj: Mapping[str, Any]) -> PoolSpec:
    """Selector and target ports of an InferencePool object (v1, or v1alpha2's older fields).
    Raises `DiscoveryError` naming the field when the pool cannot select endpoints."""
    spec = obj.get("spec")
    if not isinstance(spec, dict):
        raise DiscoveryError("spec is missing")
    raw = spec.get("selector")
    if not isinstance(raw, dict):
        raise DiscoveryError("spec.selector is missing")
    if "matchLabels" in raw or "matchExpressions" in raw:
        if raw.get("matchExpressions"):
            raise DiscoveryError(
                "spec.selector.matchExpressions is not supported: "
                "an InferencePool selects pods by matchLabels"
            )
        selector = _string_map(raw.get("matchLabels") or {}, "spec.selector.matchLabels")
    else:  # v1alpha2: selector: {app: vllm}
        selector = _string_map(raw, "spec.selector")
    if not selector:
        raise DiscoveryError("spec.selector is empty: it would select every pod in the namespace")

    ports: list[int] = []
    if "targetPorts" in spec:
        entries = spec["targetPorts"]
        if not isinstance(entries, list) or not entries:
            raise DiscoveryError("spec.targetPorts must be a non-empty list of {number: port}")
        for i, entry in enumerate(entries):
            number = entry.get("number") if isinstance(entry, dict) else None
            ports.append(_port(number, f"spec.targetPorts[{i}].number"))
    elif "targetPortNumber" in spec:
        ports.append(_port(spec["targetPortNumber"], "spec.targetPortNumber"))
    else:
        raise DiscoveryError("spec.targetPorts is missing")
    if len(set(ports)) != len(ports):
        raise DiscoveryError(f"spec.targetPorts repeats a port: {ports}")
    return PoolSpec(selector=tuple(sorted(selector.items())), target_ports=tuple(ports))


def _port(value: Any, field: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 65535:
        raise DiscoveryError(f"{field} must be a port number 1..65535, got {value!r}")
    return value


def pod_is_ready(pod: Mapping[str, Any]) -> bool:
    """The Inference Extension's rule: not being deleted, ``Ready=True``, and an IP."""
    meta = pod.get("metadata") or {}
    status = pod.get("status") or {}
    if meta.get("deletionTimestamp") or not status.get("podIP"):
        return False
    return any(
        c.get("type") == "Ready" and c.get("status") == "True"
        for c in status.get("conditions") or ()
        if isinstance(c, dict)
    )


def rank_port_clash(kv_events_port: int | None, replay_port: int | None, ranks: int) -> str | None:
    """Why the KV-event and replay ports cannot serve ``ranks`` data-parallel ranks, or None:
    vLLM offsets both by the rank, so their ranges must not overlap."""
    if ranks < 2 or not kv_events_port or not replay_port:
        return None
    if abs(kv_events_port - replay_port) >= ranks:
        return None
    low, high = sorted((kv_events_port, replay_port))
    return (
        f"--kv-events-port {kv_events_port} and --kv-events-replay-port {replay_port} clash for "
        f"{ranks} data-parallel ranks: vLLM offsets both ports by the rank, so rank "
        f"{high - low} would use port {high} for both; put the replay port at least {ranks} "
        f"ports away from the events port (e.g. {kv_events_port + 100}); replay is off until then"
    )


def pod_endpoints(
    pod: Mapping[str, Any],
    pool: PoolSpec,
    *,
    kv_events_port: int | None = None,
    replay_port: int | None = None,
) -> tuple[EndpointSpec, ...]:
    """The endpoints of one pod: one per target port if it is ready and selected, else none."""
    meta = pod.get("metadata") or {}
    labels = meta.get("labels") or {}
    if not pool.matches(labels) or not pod_is_ready(pod):
        return ()
    ip = str((pod.get("status") or {})["podIP"])
    name = str(meta.get("name", ""))
    several = len(pool.target_ports) > 1
    if rank_port_clash(kv_events_port, replay_port, len(pool.target_ports)):
        replay_port = None  # which socket is which cannot be told; said where the pool is set
    out = []
    for rank, port in enumerate(pool.target_ports):
        kv, replay = event_urls(
            ip,
            kv_events_port + rank if kv_events_port else None,
            replay_port + rank if replay_port else None,
        )
        out.append(
            EndpointSpec(
                address=format_address(ip, port),
                name=f"{name}-rank-{rank}" if several else name,
                labels=dict(labels),
                kv_events_url=kv,
                replay_url=replay,
                rank=rank,
                node_address=str((pod.get("status") or {}).get("hostIP") or ""),
            )
        )
    return tuple(out)


def selector_pool(selector: str, target_ports: str | None) -> PoolSpec:
    """The pool of the Inference Extension's pool-less mode: ``--endpoint-selector k=v,k2=v2``
    (pods in ``--pool-namespace`` with all these labels) and ``--endpoint-target-ports
    8000,8001`` (1 to 8 ports, one endpoint per port: data-parallel ranks).  Raises
    `DiscoveryConfigError` naming the flag."""
    pairs = []
    for term in selector.split(","):
        key, sep, value = term.strip().partition("=")
        if not sep or not key.strip():
            raise DiscoveryConfigError(
                f"--endpoint-selector {selector!r}: expected key=value[,key=value...]"
            )
        pairs.append((key.strip(), value.strip()))
    if not target_ports:
        raise DiscoveryConfigError(
            "--endpoint-selector needs --endpoint-target-ports (1 to 8 ports)"
        )
    try:
        ports = tuple(int(p) for p in target_ports.replace(" ", "").split(","))
    except ValueError:
        raise DiscoveryConfigError(
            f"--endpoint-target-ports {target_ports!r}: expected port numbers, e.g. 8000,8001"
        ) from None
    if not 1 <= len(ports) <= 8 or len(set(ports)) != len(ports):
        raise DiscoveryConfigError("--endpoint-target-ports: 1 to 8 distinct ports")
    if any(not 1 <= p <= 65535 for p in ports):
        raise DiscoveryConfigError("--endpoint-target-ports: ports are 1..65535")
    return PoolSpec(selector=tuple(sorted(pairs)), target_ports=ports)
