"""Topology affinity for P/D (`scorers.topology`), through real schedulers built from
llm-d-router's ``deploy/config/pd-topology-epp-config.yaml``: the prefill pod is chosen near the
decode pod already picked."""

from __future__ import annotations

import random
from collections.abc import Sequence

import pytest

from epp.config import ConfigError, build_scheduler, load_config
from scorers.base import Endpoint, PluginContext
from scorers.disagg import PEER_ENDPOINT, PREFILLER_HEADER
from scorers.topology import Topology, common_level
from tests.scorers.plugin_helpers import StaticEndpoints, endpoint, make, request
from tests.support.llmd_samples import PD_TOPOLOGY_EPP_CONFIG

PD_TOPOLOGY_CONFIG = PD_TOPOLOGY_EPP_CONFIG

HOST, RACK, ZONE, REGION = (
    "kubernetes.io/hostname",
    "topology.kubernetes.io/rack",
    "topology.kubernetes.io/zone",
    "topology.kubernetes.io/region",
)


def place(role: str, host: str, rack: str, zone: str = "z1") -> dict[str, str]:
    return {"llm-d.ai/role": role, HOST: host, RACK: rack, ZONE: zone, REGION: "eu"}


DECODE = endpoint("10.0.0.1:8000", labels=place("decode", "h1", "r1"))
# The prefill pod on the decode pod's host is the busiest: without topology it would lose.
SAME_HOST = endpoint("10.0.1.1:8000", waiting=6, labels=place("prefill", "h1", "r1"))
SAME_RACK = endpoint("10.0.1.2:8000", waiting=1, labels=place("prefill", "h2", "r1"))
SAME_ZONE = endpoint("10.0.1.3:8000", labels=place("prefill", "h3", "r2"))
LONG = "a long prompt " * 40


def build(fleet: Sequence[Endpoint], text: str = PD_TOPOLOGY_CONFIG) -> object:
    context = PluginContext(endpoints=StaticEndpoints(fleet), rng=random.Random(0))
    return build_scheduler(load_config(text=text), context, allow_experimental_plugins=True)


async def prefiller(fleet: Sequence[Endpoint], text: str = PD_TOPOLOGY_CONFIG) -> str | None:
    scheduler = build(fleet, text)
    r = request(prompt=LONG)
    await scheduler.schedule(r, fleet)  # type: ignore[attr-defined]
    return r.set_headers.get(PREFILLER_HEADER)


def test_the_sample_needs_the_experimental_flag_as_upstream() -> None:
    context = PluginContext(endpoints=StaticEndpoints([]))
    with pytest.raises(ConfigError) as err:
        build_scheduler(load_config(text=PD_TOPOLOGY_CONFIG), context)
    text = str(err.value)
    for index, kind in ((6, "topology-extractor"), (7, "topology-affinity-filter")):
        assert f"plugins[{index}]: plugin {kind!r} (type: {kind!r}) is Alpha" in text
    assert "--allow-experimental-plugins" in text


async def test_the_prefill_pod_on_the_decode_pods_host_wins_though_it_is_busiest() -> None:
    assert await prefiller([DECODE, SAME_HOST, SAME_RACK, SAME_ZONE]) == SAME_HOST.address


async def test_without_a_pod_on_its_host_the_filter_keeps_all_and_the_scorer_prefers_the_rack() -> (
    None
):
    # minAffinity host matches nobody: every prefill pod stays, and the rack's 0.2 beats the
    # zone's 0.05 (both idle but for one waiting request on the rack pod, worth less).
    idle_rack = endpoint("10.0.1.2:8000", labels=place("prefill", "h2", "r1"))
    assert await prefiller([DECODE, idle_rack, SAME_ZONE]) == idle_rack.address


async def test_min_affinity_zone_keeps_the_zone_and_drops_the_rest() -> None:
    other_zone = endpoint("10.0.1.4:8000", labels=place("prefill", "h9", "r9", zone="z2"))
    text = PD_TOPOLOGY_CONFIG.replace(
        "- type: topology-affinity-filter\n",
        "- type: topology-affinity-filter\n  parameters:\n    minAffinity: zone\n",
    )
    # The other zone's pod is idle and the zone's pod is busy: only the filter keeps it out.
    busy_zone = endpoint("10.0.1.3:8000", waiting=8, labels=place("prefill", "h3", "r2"))
    assert await prefiller([DECODE, busy_zone, other_zone], text) == busy_zone.address


def test_the_filter_and_scorer_do_nothing_without_a_peer() -> None:
    extractor = make("topology-extractor")
    plugins = {"topology-extractor": extractor}
    flt = make("topology-affinity-filter")
    flt.bind(plugins)  # type: ignore[attr-defined]
    scorer = make("topology-affinity-scorer")
    scorer.bind(plugins)  # type: ignore[attr-defined]
    fleet = [SAME_HOST, SAME_ZONE]
    assert flt.filter(request(), fleet) == fleet  # type: ignore[attr-defined]
    assert scorer.score(request(), fleet) == {}  # type: ignore[attr-defined]
    peered = request()
    peered.data[PEER_ENDPOINT] = DECODE
    assert scorer.score(peered, [*fleet, SAME_RACK]) == {  # type: ignore[attr-defined]
        SAME_HOST.address: 1.0,
        SAME_ZONE.address: 0.05,
        SAME_RACK.address: 0.2,
    }


def test_levels_compare_from_the_tightest_and_unset_values_never_match() -> None:
    peer = Topology("h1", "r1", "z1", "eu")
    assert common_level(peer, Topology("h1", "x", "y", "w")) == "host"
    assert common_level(peer, Topology("h2", "r1", "z1", "eu")) == "rack"
    assert common_level(peer, Topology("", "", "", "eu")) == "region"
    assert common_level(Topology("", "", "", ""), Topology("", "", "", "")) is None


def test_custom_label_keys_are_read() -> None:
    extractor = make("topology-extractor", {"hostname": "example.com/node", "rack": "nvl-domain"})
    pod = endpoint("10.0.0.9:8000", labels={"example.com/node": "n7", "nvl-domain": "nvl1"})
    assert extractor.topology(pod) == Topology("n7", "nvl1", "", "")  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (
            ("- type: topology-affinity-filter\n", "- type: topology-affinity-filter\n  parameters:\n    minAffinity: node\n"),
            "minAffinity",
        ),
        (
            ("- type: topology-affinity-scorer\n", "- type: topology-affinity-scorer\n  parameters:\n    topologyProducerName: topo\n"),
            "topologyProducerName 'topo' names no plugin",
        ),
        (
            ("- type: topology-extractor\n", "- type: topology-extractor\n  parameters:\n    node: x\n"),
            "node",
        ),
    ],
)  # fmt: skip
def test_bad_parameters_are_errors_naming_them(change: tuple[str, str], message: str) -> None:
    text = PD_TOPOLOGY_CONFIG.replace(*change)
    with pytest.raises(ConfigError, match=message):
        build([], text)
