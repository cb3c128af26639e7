"""Topology affinity for disaggregated serving, as llm-d-router's ``topology-*`` plugins (Alpha
there and here: they need ``--allow-experimental-plugins``).

A P/D request's KV moves from its prefill pod to its decode pod; the closer the two, the faster
(NVLink within a host, one switch within a rack, several hops within a zone).  While the prefill
profile runs, ``disagg-profile-handler`` names the chosen decode pod as the request's peer
(`scorers.disagg.PEER_ENDPOINT`), and:

* ``topology-extractor`` reads each pod's place from its labels (``kubernetes.io/hostname``,
  ``topology.kubernetes.io/rack``, ``topology.kubernetes.io/zone``,
  ``topology.kubernetes.io/region``, each key renamable); Kubernetes does not copy node labels
  onto pods, so the deployment must set them.  Unlike upstream, a pod without the hostname label
  does not fall back to its ``spec.hostname`` (which names the pod, not its node).
* ``topology-affinity-filter`` keeps the candidates at least as close to the peer as
  ``minAffinity`` (host, rack, zone or region); when none is, or there is no peer, it keeps all.
* ``topology-affinity-scorer`` scores a candidate by its closeness to the peer: host 1.0, rack
  0.2, zone 0.05, region 0.02, otherwise 0 (upstream's table).

Levels compare raw label values from the tightest: a candidate shares the peer's host if both
hostnames are set and equal, else its rack, and so on; an unset value never matches.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Final, Literal

from pydantic import BaseModel, ConfigDict, Field

from scorers.base import Endpoint, LLMRequest, Plugin, PluginConfigError, register
from scorers.disagg import PEER_ENDPOINT

LEVELS: Final = ("host", "rack", "zone", "region")
LEVEL_SCORES: Final = {"host": 1.0, "rack": 0.2, "zone": 0.05, "region": 0.02}
DEFAULT_PRODUCER: Final = "topology-extractor"


@dataclass(slots=True, frozen=True)
class Topology:
    host: str
    rack: str
    zone: str
    region: str


def common_level(peer: Topology, candidate: Topology) -> str | None:
    """The tightest level both share, or None."""
    for level in LEVELS:
        value = getattr(peer, level)
        if value and value == getattr(candidate, level):
            return level
    return None


class ExtractorParameters(BaseModel):
    """The pod label keys of each level; empty means upstream's default key."""

    model_config = ConfigDict(extra="forbid")

    hostname: str = ""
    rack: str = ""
    zone: str = ""
    region: str = ""


@register("topology-extractor")
class TopologyExtractor(Plugin[ExtractorParameters]):
    """Where each endpoint's pod runs, from its labels."""

    experimental: ClassVar[bool] = True

    def __init__(self, name: str, params: BaseModel, context: Any) -> None:
        super().__init__(name, params, context)
        p = self.p
        self.keys = (
            p.hostname or "kubernetes.io/hostname",
            p.rack or "topology.kubernetes.io/rack",
            p.zone or "topology.kubernetes.io/zone",
            p.region or "topology.kubernetes.io/region",
        )

    def topology(self, endpoint: Endpoint) -> Topology:
        labels = endpoint.labels
        host, rack, zone, region = (labels.get(key, "") for key in self.keys)
        return Topology(host, rack, zone, region)


def _bind_extractor(plugin: Plugin[Any], producer: str, plugins: Mapping[str, object]) -> Any:
    extractor = plugins.get(producer)
    if not isinstance(extractor, TopologyExtractor):
        found = "no plugin" if extractor is None else f"a {type(extractor).__name__}"
        raise PluginConfigError(
            f"{plugin.type_name} {plugin.name!r}: parameters.topologyProducerName {producer!r} "
            f"names {found}; declare a topology-extractor of that name"
        )
    return extractor


class FilterParameters(BaseModel):
    model_config = ConfigDict(extra="forbid")

    minAffinity: Literal["host", "rack", "zone", "region"] = Field(
        default="host",
        description="Keep candidates sharing at least this level with the peer (default host).",
    )
    topologyProducerName: str = Field(default=DEFAULT_PRODUCER, min_length=1)


class _PeerAware:
    """What the filter and the scorer share: the extractor, and the peer's topology."""

    extractor: TopologyExtractor

    def peer(self, request: LLMRequest) -> Topology | None:
        peer = request.data.get(PEER_ENDPOINT)
        return self.extractor.topology(peer) if isinstance(peer, Endpoint) else None


@register("topology-affinity-filter")
class TopologyAffinityFilter(_PeerAware, Plugin[FilterParameters]):
    """Candidates at least ``minAffinity``-close to the peer; all of them when none is."""

    experimental: ClassVar[bool] = True

    def bind(self, plugins: Mapping[str, object]) -> None:
        self.extractor = _bind_extractor(self, self.p.topologyProducerName, plugins)
        self.allowed = frozenset(LEVELS[: LEVELS.index(self.p.minAffinity) + 1])

    def filter(self, request: LLMRequest, endpoints: Sequence[Endpoint]) -> list[Endpoint]:
        peer = self.peer(request)
        if peer is None:
            return list(endpoints)
        topology = self.extractor.topology
        kept = [e for e in endpoints if common_level(peer, topology(e)) in self.allowed]
        return kept or list(endpoints)


class ScorerParameters(BaseModel):
    model_config = ConfigDict(extra="forbid")

    topologyProducerName: str = Field(default=DEFAULT_PRODUCER, min_length=1)


@register("topology-affinity-scorer")
class TopologyAffinityScorer(_PeerAware, Plugin[ScorerParameters]):
    """1.0 on the peer's host, 0.2 in its rack, 0.05 in its zone, 0.02 in its region."""

    experimental: ClassVar[bool] = True

    def bind(self, plugins: Mapping[str, object]) -> None:
        self.extractor = _bind_extractor(self, self.p.topologyProducerName, plugins)

    def score(self, request: LLMRequest, endpoints: Sequence[Endpoint]) -> dict[str, float]:
        peer = self.peer(request)
        if peer is None:
            return {}
        topology = self.extractor.topology
        out = {}
        for endpoint in endpoints:
            level = common_level(peer, topology(endpoint))
            out[endpoint.address] = LEVEL_SCORES[level] if level is not None else 0.0
        return out
