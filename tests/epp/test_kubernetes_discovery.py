"""Kubernetes discovery against a fake API server on loopback, through the real client.

The fake (`tests.support.fake_kube`) honours label selectors like the real API server; the
discovery also filters pods by the pool's selector itself, which `test_foreign_pods_are_ignored`
checks both ways (fake filtering on, and off as kmock behaves).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

import pytest

from epp.datastore import Datastore
from epp.discovery import DiscoveryError
from epp.discovery.kubernetes import KubernetesDiscovery
from epp.discovery.pool import (
    POOL_GROUP_ALPHA,
    PoolRef,
    PoolSpec,
    parse_pool,
    pod_endpoints,
    pod_is_ready,
)
from tests.epp.conftest import Factory
from tests.support.fake_kube import PODS, POOLS, FakeKubeApiServer, label_selector_matches

VLLM = {"app": "vllm"}


async def eventually(check: Callable[[], bool], timeout: float = 10.0, what: str = "") -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"not reached within {timeout} s: {what}")
        await asyncio.sleep(0.01)


def addresses(ds: Datastore) -> list[str]:
    return sorted(e.address for e in ds.endpoints())


def put_pool_with_pod_a(kube: FakeKubeApiServer) -> None:
    """Pool "pool" selecting the VLLM pods on port 8000, and one ready such pod "a" at 10.0.0.1."""
    kube.put_pool("pool", match_labels=VLLM, ports=[8000])
    kube.put_pod("a", labels=VLLM, ip="10.0.0.1")


@pytest.fixture
async def discovered_pod_a(
    kube: FakeKubeApiServer, start_discovery: Factory
) -> tuple[Datastore, KubernetesDiscovery]:
    """A started discovery whose datastore holds pod "a" (`put_pool_with_pod_a`)."""
    put_pool_with_pod_a(kube)
    ds, discovery = await start_discovery()
    await eventually(lambda: addresses(ds) == ["10.0.0.1:8000"])
    return ds, discovery


# ---------------------------------------------------------------------------------------------
# Pods come and go


async def test_pods_appear_become_ready_unready_and_die(
    kube: FakeKubeApiServer, start_discovery: Factory
) -> None:
    kube.put_pool("pool", match_labels=VLLM, ports=[8000])
    kube.put_pod("a", labels={**VLLM, "zone": "z1"}, ip="10.0.0.1", ready=False)
    ds, _ = await start_discovery()
    await eventually(lambda: ds.synced, what="synced after the first list")
    assert addresses(ds) == []  # not ready yet

    kube.put_pod("a", labels={**VLLM, "zone": "z1"}, ip="10.0.0.1")
    await eventually(lambda: addresses(ds) == ["10.0.0.1:8000"], what="a ready")
    ep = ds.get("10.0.0.1:8000")
    assert ep is not None and ep.name == "a" and ep.labels == {"app": "vllm", "zone": "z1"}
    assert ep.kv_events_url is None  # no KV-event port configured

    kube.put_pod("b", labels=VLLM, ip="10.0.0.2")
    await eventually(lambda: addresses(ds) == ["10.0.0.1:8000", "10.0.0.2:8000"], what="b")

    kube.put_pod("a", labels=VLLM, ip="10.0.0.1", ready=False)  # unready → removed
    await eventually(lambda: addresses(ds) == ["10.0.0.2:8000"], what="a unready")

    kube.put_pod("b", labels=VLLM, ip="10.0.0.2", deleting=True)  # terminating → removed
    await eventually(lambda: addresses(ds) == [], what="b terminating")

    kube.put_pod("a", labels=VLLM, ip="10.0.0.1")
    await eventually(lambda: addresses(ds) == ["10.0.0.1:8000"], what="a ready again")
    kube.delete_pod("a")
    kube.delete_pod("b")
    await eventually(lambda: addresses(ds) == [], what="all deleted")
    assert ds.synced


async def test_pod_without_ip_is_not_an_endpoint(
    kube: FakeKubeApiServer, start_discovery: Factory
) -> None:
    kube.put_pool("pool", match_labels=VLLM, ports=[8000])
    kube.put_pod("a", labels=VLLM, ip=None)
    kube.put_pod("b", labels=VLLM, ip="fd00::2")
    ds, _ = await start_discovery()
    await eventually(lambda: ds.synced)
    await eventually(lambda: addresses(ds) == ["[fd00::2]:8000"], what="IPv6 pod")


@pytest.mark.parametrize("server_filters", [True, False])
async def test_foreign_pods_are_ignored(start_discovery: Factory, server_filters: bool) -> None:
    server = FakeKubeApiServer(honour_label_selectors=server_filters)
    await server.start()
    try:
        server.put_pool("pool", match_labels=VLLM, ports=[8000])
        server.put_pod("mine", labels=VLLM, ip="10.0.0.1")
        server.put_pod("other", labels={"app": "other"}, ip="10.0.0.9")
        server.put_pod("unlabelled", labels={}, ip="10.0.0.8")
        ds, _ = await start_discovery(server=server)
        await eventually(lambda: ds.synced and addresses(ds) == ["10.0.0.1:8000"])
        server.put_pod("other2", labels={"app": "other"}, ip="10.0.0.7")  # via the watch
        server.put_pod("mine2", labels=VLLM, ip="10.0.0.2")
        await eventually(lambda: addresses(ds) == ["10.0.0.1:8000", "10.0.0.2:8000"])
        server.put_pod("mine2", labels={"app": "other"}, ip="10.0.0.2")  # relabelled away
        await eventually(lambda: addresses(ds) == ["10.0.0.1:8000"], what="relabelled pod gone")
        assert ds.get("10.0.0.7:8000") is None
    finally:
        await server.stop()


async def test_two_target_ports_give_two_endpoints_per_pod(
    kube: FakeKubeApiServer, start_discovery: Factory
) -> None:
    kube.put_pool("pool", match_labels=VLLM, ports=[8000, 8001])
    kube.put_pod("a", labels=VLLM, ip="10.0.0.1")
    kube.put_pod("b", labels=VLLM, ip="10.0.0.2")
    ds, _ = await start_discovery(kv_events_port=5557, replay_port=5657)
    await eventually(lambda: len(ds) == 4)
    assert addresses(ds) == ["10.0.0.1:8000", "10.0.0.1:8001", "10.0.0.2:8000", "10.0.0.2:8001"]
    r0, r1 = ds.get("10.0.0.1:8000"), ds.get("10.0.0.1:8001")
    assert r0 is not None and r1 is not None
    assert (r0.name, r1.name) == ("a-rank-0", "a-rank-1")
    # vLLM offsets the KV-event and replay ports by the data-parallel rank.
    assert (r0.kv_events_url, r0.replay_url) == ("tcp://10.0.0.1:5557", "tcp://10.0.0.1:5657")
    assert (r1.kv_events_url, r1.replay_url) == ("tcp://10.0.0.1:5558", "tcp://10.0.0.1:5658")


async def test_replay_ports_that_clash_with_the_ranks_event_ports_turn_replay_off_with_an_error(
    kube: FakeKubeApiServer, start_discovery: Factory, caplog: pytest.LogCaptureFixture
) -> None:
    # 5557 and 5558 for two ranks: rank 1 would publish on rank 0's replay port.
    kube.put_pool("pool", match_labels=VLLM, ports=[8000, 8001])
    kube.put_pod("a", labels=VLLM, ip="10.0.0.1")
    ds, _ = await start_discovery(kv_events_port=5557, replay_port=5558)
    await eventually(lambda: len(ds) == 2)
    r0, r1 = ds.get("10.0.0.1:8000"), ds.get("10.0.0.1:8001")
    assert r0 is not None and r1 is not None
    assert (r0.kv_events_url, r1.kv_events_url) == ("tcp://10.0.0.1:5557", "tcp://10.0.0.1:5558")
    assert (r0.replay_url, r1.replay_url) == (None, None)
    assert any("clash for 2 data-parallel ranks" in r.message for r in caplog.records)


# ---------------------------------------------------------------------------------------------
# The pool


async def test_pool_changes_resync(kube: FakeKubeApiServer, start_discovery: Factory) -> None:
    put_pool_with_pod_a(kube)
    kube.put_pod("b", labels={"app": "vllm2"}, ip="10.0.0.2")
    ds, _ = await start_discovery()
    await eventually(lambda: addresses(ds) == ["10.0.0.1:8000"])
    lists = kube.list_requests(PODS)

    kube.put_pool("pool", match_labels={"app": "vllm2"}, ports=[8000])
    await eventually(lambda: addresses(ds) == ["10.0.0.2:8000"], what="new selector")
    assert kube.list_requests(PODS) > lists  # a full resync, not a patch-up

    kube.put_pool("pool", match_labels={"app": "vllm2"}, ports=[9000, 9001])
    await eventually(lambda: addresses(ds) == ["10.0.0.2:9000", "10.0.0.2:9001"], what="ports")
    assert ds.synced


async def test_missing_pool_then_created_then_deleted(
    kube: FakeKubeApiServer, start_discovery: Factory
) -> None:
    kube.put_pod("a", labels=VLLM, ip="10.0.0.1")
    ds, _ = await start_discovery()
    await eventually(lambda: kube.list_requests(POOLS) >= 1)
    await asyncio.sleep(0.2)
    assert not ds.synced and addresses(ds) == []

    kube.put_pool("pool", match_labels=VLLM, ports=[8000])
    await eventually(lambda: ds.synced and addresses(ds) == ["10.0.0.1:8000"], what="pool made")

    kube.delete_pool("pool")
    await eventually(lambda: not ds.synced and addresses(ds) == [], what="pool deleted")

    kube.put_pool("pool", match_labels=VLLM, ports=[8000])
    await eventually(lambda: ds.synced and addresses(ds) == ["10.0.0.1:8000"], what="pool back")


async def test_other_pools_in_the_namespace_are_ignored(
    kube: FakeKubeApiServer, start_discovery: Factory
) -> None:
    kube.put_pool("pool", match_labels=VLLM, ports=[8000])
    kube.put_pool("other", match_labels={"app": "x"}, ports=[1234])
    kube.put_pod("a", labels=VLLM, ip="10.0.0.1")
    ds, _ = await start_discovery()
    await eventually(lambda: addresses(ds) == ["10.0.0.1:8000"])
    kube.put_pool("other", match_labels=VLLM, ports=[4321])
    await asyncio.sleep(0.3)
    assert addresses(ds) == ["10.0.0.1:8000"]


async def test_v1alpha2_pool_with_flat_selector(
    kube: FakeKubeApiServer, start_discovery: Factory
) -> None:
    key = (POOL_GROUP_ALPHA, "v1alpha2", "inferencepools")
    kube.put(
        key,
        {
            "metadata": {"name": "pool", "namespace": "ns1"},
            "spec": {"selector": VLLM, "targetPortNumber": 8000},
        },
    )
    kube.put_pod("a", labels=VLLM, ip="10.0.0.1", namespace="ns1")
    kube.put_pod("b", labels=VLLM, ip="10.0.0.2", namespace="default")  # other namespace
    ds, _ = await start_discovery(pool=PoolRef("pool", "ns1", group=POOL_GROUP_ALPHA))
    await eventually(lambda: ds.synced and addresses(ds) == ["10.0.0.1:8000"])


async def test_invalid_pool_update_keeps_previous_endpoints(
    kube: FakeKubeApiServer, discovered_pod_a: tuple[Datastore, KubernetesDiscovery]
) -> None:
    ds, _ = discovered_pod_a
    kube.put(POOLS, {"metadata": {"name": "pool"}, "spec": {"selector": {"matchLabels": {}}}})
    await asyncio.sleep(0.3)
    assert ds.synced and addresses(ds) == ["10.0.0.1:8000"]
    kube.put_pool("pool", match_labels=VLLM, ports=[8001])
    await eventually(lambda: addresses(ds) == ["10.0.0.1:8001"], what="valid again")


# ---------------------------------------------------------------------------------------------
# Watch failures


@pytest.mark.parametrize("mode", ["close", "gone", "error"])
async def test_broken_watches_recover_and_converge(
    kube: FakeKubeApiServer, discovered_pod_a: tuple[Datastore, KubernetesDiscovery], mode: Any
) -> None:
    ds, discovery = discovered_pod_a
    await eventually(lambda: kube.open_watches(PODS) == 1 and kube.open_watches(POOLS) == 1)
    lists = kube.list_requests(PODS)

    kube.break_watches(mode)
    kube.put_pod("b", labels=VLLM, ip="10.0.0.2")  # happens while no watch is open
    kube.delete_pod("a")
    await eventually(lambda: addresses(ds) == ["10.0.0.2:8000"], what=f"converged after {mode}")
    await eventually(lambda: kube.open_watches(PODS) == 1, what="watching again")
    if mode == "close":  # a clean end resumes from the last resourceVersion
        assert kube.list_requests(PODS) == lists
    else:  # 410 and errors relist
        await eventually(lambda: kube.list_requests(PODS) > lists)
    if mode == "gone":
        assert discovery.relists >= 1
    if mode == "error":
        assert discovery.watch_errors >= 1
    kube.put_pod("c", labels=VLLM, ip="10.0.0.3")
    await eventually(lambda: addresses(ds) == ["10.0.0.2:8000", "10.0.0.3:8000"])


async def test_expired_resource_version_relists(
    kube: FakeKubeApiServer, discovered_pod_a: tuple[Datastore, KubernetesDiscovery]
) -> None:
    ds, discovery = discovered_pod_a
    await eventually(lambda: kube.open_watches(PODS) == 1)
    lists = kube.list_requests(PODS)
    kube.put_pod("b", labels=VLLM, ip="10.0.0.2")
    kube.compact()  # the watch resumes from a resourceVersion the server no longer has
    kube.break_watches("close")
    await eventually(lambda: addresses(ds) == ["10.0.0.1:8000", "10.0.0.2:8000"])
    await eventually(lambda: kube.list_requests(PODS) > lists, what="relisted after 410")
    assert discovery.relists >= 1


async def test_repeated_410_backs_off_instead_of_hammering(
    kube: FakeKubeApiServer, start_discovery: Factory
) -> None:
    put_pool_with_pod_a(kube)
    kube.compacted_rv = 10**9  # every watch is answered with 410
    ds, discovery = await start_discovery(backoff_initial=0.05, backoff_max=0.4)
    await eventually(lambda: ds.synced and addresses(ds) == ["10.0.0.1:8000"])
    lists = kube.list_requests(PODS)
    await asyncio.sleep(1.0)
    assert kube.list_requests(PODS) - lists <= 8  # unthrottled, this is hundreds
    assert discovery.relists >= 3
    kube.compacted_rv = 0
    kube.put_pod("b", labels=VLLM, ip="10.0.0.2")
    await eventually(lambda: addresses(ds) == ["10.0.0.1:8000", "10.0.0.2:8000"])


async def test_api_errors_back_off_and_recover(
    kube: FakeKubeApiServer, start_discovery: Factory
) -> None:
    put_pool_with_pod_a(kube)
    kube.fail_next(3, status=500, path_contains="/pods")
    kube.fail_next(2, status=503, path_contains="/inferencepools")
    ds, discovery = await start_discovery()
    await eventually(lambda: ds.synced and addresses(ds) == ["10.0.0.1:8000"])
    assert discovery.watch_errors >= 5


async def test_watch_timeout_rewatches(kube: FakeKubeApiServer, start_discovery: Factory) -> None:
    kube.put_pool("pool", match_labels=VLLM, ports=[8000])
    ds, _ = await start_discovery(watch_timeout=1)  # server ends each watch after 1–2 s
    await eventually(lambda: ds.synced)
    watches = sum(1 for path, q in kube.requests if path.endswith("/pods") and q.get("watch"))
    await eventually(
        lambda: (
            sum(1 for p, q in kube.requests if p.endswith("/pods") and q.get("watch")) > watches
        ),
        timeout=5,
        what="a new watch after the server timeout",
    )
    kube.put_pod("a", labels=VLLM, ip="10.0.0.1")
    await eventually(lambda: addresses(ds) == ["10.0.0.1:8000"])


async def test_stop_is_prompt_and_final(kube: FakeKubeApiServer, start_discovery: Factory) -> None:
    put_pool_with_pod_a(kube)
    ds, discovery = await start_discovery()
    await eventually(lambda: kube.open_watches() == 2)
    t0 = time.monotonic()
    await discovery.stop()
    assert time.monotonic() - t0 < 2.0
    assert not any(t.name.startswith("epp-discovery") for t in __import__("threading").enumerate())
    requests = len(kube.requests)
    kube.put_pod("b", labels=VLLM, ip="10.0.0.2")
    await asyncio.sleep(0.2)
    assert len(kube.requests) == requests
    assert addresses(ds) == ["10.0.0.1:8000"]
    await discovery.stop()  # idempotent


async def test_unreachable_api_server_never_syncs_and_stops(start_discovery: Factory) -> None:
    dead = FakeKubeApiServer()
    await dead.start()
    port = dead.port
    await dead.stop()
    server = FakeKubeApiServer()
    server.port = port  # nothing listens there any more
    ds, discovery = await start_discovery(server=server)
    await eventually(lambda: discovery.watch_errors >= 2)
    assert not ds.synced


# ---------------------------------------------------------------------------------------------
# The pure part


def _pod(**status: Any) -> dict[str, Any]:
    return {"metadata": {"name": "p", "labels": VLLM}, "status": status}


READY = [{"type": "Ready", "status": "True"}]


def test_pod_is_ready_rule() -> None:
    assert pod_is_ready(_pod(podIP="10.0.0.1", conditions=READY))
    assert not pod_is_ready(_pod(conditions=READY))
    assert not pod_is_ready(
        _pod(podIP="10.0.0.1", conditions=[{"type": "Ready", "status": "False"}])
    )
    assert not pod_is_ready(_pod(podIP="10.0.0.1"))
    deleting = _pod(podIP="10.0.0.1", conditions=READY)
    deleting["metadata"]["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    assert not pod_is_ready(deleting)
    assert not pod_is_ready({})


def test_pod_endpoints_single_port_uses_pod_name() -> None:
    pool = PoolSpec(selector=(("app", "vllm"),), target_ports=(8000,))
    (spec,) = pod_endpoints(_pod(podIP="10.0.0.1", conditions=READY), pool, kv_events_port=5557)
    assert (spec.address, spec.name, spec.kv_events_url) == (
        "10.0.0.1:8000",
        "p",
        "tcp://10.0.0.1:5557",
    )
    assert spec.replay_url is None
    other = PoolSpec(selector=(("app", "x"),), target_ports=(8000,))
    assert pod_endpoints(_pod(podIP="10.0.0.1", conditions=READY), other) == ()


def test_parse_pool_v1_and_v1alpha2() -> None:
    v1 = {
        "spec": {
            "selector": {"matchLabels": {"b": "2", "a": "1"}},
            "targetPorts": [{"number": 8000}],
        }
    }
    pool = parse_pool(v1)
    assert pool == PoolSpec(selector=(("a", "1"), ("b", "2")), target_ports=(8000,))
    assert pool.label_selector == "a=1,b=2"
    assert label_selector_matches(pool.label_selector, {"a": "1", "b": "2", "c": "3"})
    alpha = {"spec": {"selector": {"app": "vllm"}, "targetPortNumber": 8000}}
    assert parse_pool(alpha) == PoolSpec(selector=(("app", "vllm"),), target_ports=(8000,))


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        (None, "spec is missing"),
        ({"targetPorts": [{"number": 1}]}, "spec.selector is missing"),
        (
            {"selector": {"matchLabels": {}}, "targetPorts": [{"number": 1}]},
            "spec.selector is empty",
        ),
        (
            {"selector": {"matchExpressions": [{"key": "a", "operator": "Exists"}]}},
            "matchExpressions is not supported",
        ),
        ({"selector": {"matchLabels": {"a": 1}}}, "spec.selector.matchLabels must be a map"),
        ({"selector": VLLM}, "spec.targetPorts is missing"),
        ({"selector": VLLM, "targetPorts": []}, "non-empty list"),
        ({"selector": VLLM, "targetPorts": [{"number": 0}]}, "spec.targetPorts[0].number must be"),
        ({"selector": VLLM, "targetPorts": [{"port": 80}]}, "spec.targetPorts[0].number must be"),
        ({"selector": VLLM, "targetPorts": [{"number": 80}, {"number": 80}]}, "repeats a port"),
        ({"selector": VLLM, "targetPortNumber": "8000"}, "spec.targetPortNumber must be"),
    ],
)
def test_parse_pool_errors_name_the_field(spec: Any, message: str) -> None:
    with pytest.raises(DiscoveryError) as info:
        parse_pool({"spec": spec} if spec is not None else {})
    assert message in str(info.value)


def test_pool_ref_versions() -> None:
    assert PoolRef("p").api_version == "v1"
    assert PoolRef("p", group=POOL_GROUP_ALPHA).api_version == "v1alpha2"
    assert PoolRef("p", version="v9").api_version == "v9"
    assert "default/p" in str(PoolRef("p"))


def test_fake_label_selector_semantics() -> None:
    labels = {"app": "vllm", "tier": "gpu"}
    assert label_selector_matches("app=vllm,tier in (gpu, cpu)", labels)
    assert label_selector_matches("app==vllm,tier!=cpu,!missing,app", labels)
    assert not label_selector_matches("app notin (vllm)", labels)
    assert not label_selector_matches("missing", labels)


def test_the_pool_less_selector_flags_are_checked() -> None:
    from epp.discovery import DiscoveryConfigError
    from epp.discovery.pool import selector_pool

    pool = selector_pool("app=vllm, tier=gpu", "8000,8001")
    assert pool == PoolSpec(selector=(("app", "vllm"), ("tier", "gpu")), target_ports=(8000, 8001))
    for selector, ports, said in (
        ("app", "8000", "expected key=value"),
        ("app=vllm", None, "needs --endpoint-target-ports"),
        ("app=vllm", "8000,x", "expected port numbers"),
        ("app=vllm", ",".join(str(8000 + i) for i in range(9)), "1 to 8 distinct ports"),
        ("app=vllm", "0", "1..65535"),
    ):
        with pytest.raises(DiscoveryConfigError, match=said):
            selector_pool(selector, ports)


async def test_pool_less_mode_serves_the_selected_pods_on_every_port(
    kube: FakeKubeApiServer, start_discovery: Factory
) -> None:
    # No InferencePool at all: the selector and ports come from the command line.
    from epp.discovery.pool import selector_pool

    kube.put_pod("a", labels=VLLM, ip="10.0.0.1")
    kube.put_pod("other", labels={"app": "web"}, ip="10.0.0.9")
    ds, _ = await start_discovery(
        PoolRef("(endpoint-selector)"), fixed_pool=selector_pool("app=vllm", "8000,8001")
    )
    await eventually(lambda: addresses(ds) == ["10.0.0.1:8000", "10.0.0.1:8001"])
    assert sorted(e.name for e in ds.endpoints()) == ["a-rank-0", "a-rank-1"]
    assert ds.synced
    kube.put_pod("b", labels=VLLM, ip="10.0.0.2")
    await eventually(lambda: len(addresses(ds)) == 4, what="a new pod")
