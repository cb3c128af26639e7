"""The EPP itself restarting with traffic flowing, over TLS (``--secure-serving``, self-signed).

Two replicas (active-active: each subscribes to every pod) behind Envoy's ext_proc cluster with
gRPC health checks.  A replica told to stop (SIGTERM) turns NOT_SERVING, keeps serving until
Envoy has moved away, then exits; started again, it rebuilds its index from the pods' replay
buffers.  No request may fail.  A replica that crashes (SIGKILL) while it is the only one shows
the fail-closed window: Envoy cannot route without an EPP (``failure_mode_allow`` would not help:
ORIGINAL_DST needs the EPP's destination), so requests fail until it is back.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from launcher.observe import metric, scrape, wait_for
from launcher.stack import Stack
from launcher.traffic import Traffic, failures
from tests.reliability.reporting import report

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, llama3_tokenizer_dir: Path) -> Iterator[Stack]:
    fleet = Stack.start(
        tmp_path_factory.mktemp("epp-restart"),
        llama3_tokenizer_dir,
        pods=2,
        replicas=2,
        epp_args=["--secure-serving"],
        envoy_options={"extproc_tls": True, "extproc_health_check_interval_s": 0.5},
    )
    try:
        yield fleet
    finally:
        fleet.stop()


def _entries(stack: Stack, r: int) -> float:
    return metric(scrape(stack.replicas[r].metrics_url), "inference_extension_kv_index_entries")


def test_requests_flow_over_tls_to_both_replicas(stack: Stack) -> None:
    with Traffic(stack.gateway, rate=30, max_seconds=20) as traffic:
        time.sleep(2)
    assert traffic.outcomes and not failures(traffic.outcomes)
    for r in (0, 1):  # active-active: both replicas index every pod
        wait_for(lambda r=r: _entries(stack, r) > 0, f"replica {r} indexed events")


def test_a_rolling_restart_of_the_replicas_loses_no_request(stack: Stack) -> None:
    with Traffic(stack.gateway, rate=30, max_seconds=90) as traffic:
        time.sleep(1)
        figures: dict[str, float] = {}
        events: list[tuple[str, float]] = []
        for r in (0, 1):
            events.append((f"stop {r}", time.monotonic()))
            figures[f"replica{r}_drain_s"] = stack.stop_replica(r)
            events.append((f"stopped {r}", time.monotonic()))
            started = time.monotonic()
            stack.start_replica(r)
            events.append((f"ready {r}", time.monotonic()))
            figures[f"replica{r}_ready_s"] = time.monotonic() - started
            figures[f"replica{r}_index_rebuilt_s"] = wait_for(
                lambda r=r: _entries(stack, r) >= _entries(stack, 1 - r) > 0,
                f"replica {r} caught up with the other",
            )
            time.sleep(1.5)  # Envoy's health check takes it back
    outcomes = traffic.outcomes
    assert len(outcomes) > 100
    if failures(outcomes):
        t0 = events[0][1]
        print([(e, round(t - t0, 2)) for e, t in events])
        print([(round(o.sent_at - t0, 2), o.status) for o in failures(outcomes)])
    assert not failures(outcomes), failures(outcomes)[:5]
    report(
        "EPP rolling restart, 2 replicas, TLS", requests=float(len(outcomes)), failed=0.0, **figures
    )


def test_a_lone_replica_crashing_fails_requests_until_it_is_back(stack: Stack) -> None:
    stack.stop_replica(1)
    time.sleep(1.5)  # Envoy marks it unhealthy
    with Traffic(stack.gateway, rate=30, max_seconds=90) as traffic:
        time.sleep(1)
        crashed_at = time.monotonic()
        proc = stack.replicas[0].proc
        assert proc is not None
        proc.kill()
        proc.wait(10)
        stack.start_replica(0)
        ready = time.monotonic() - crashed_at
        back = wait_for(
            lambda: any(
                o.status == 200 and o.sent_at > crashed_at + ready for o in traffic.outcomes
            ),
            "requests served again",
        )
        time.sleep(1)
    lost = failures(traffic.outcomes)
    assert lost, "a lone replica's crash should be visible"
    assert all(crashed_at - 1 <= o.sent_at <= crashed_at + ready + back + 1 for o in lost)
    report(
        "lone EPP replica crash (SIGKILL), fail-closed",
        unavailable_s=max(o.sent_at for o in lost) - crashed_at,
        failed_requests=float(len(lost)),
        restart_to_ready_s=ready,
    )
    stack.start_replica(1)
