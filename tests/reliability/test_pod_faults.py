"""Pod faults with real processes: Envoy → ``epp serve`` → three simulated vLLM pods.

Each test breaks one thing while traffic flows, then checks the eventual behaviour with generous
timeouts (never tight timings): routing continues to the pods that can serve, nothing is routed
to a broken pod once the EPP has noticed, and the EPP's KV index converges back to what the pods
really hold.  Detection and recovery times are measured and printed (``pytest -s``, or
``EPP_RELIABILITY_REPORT=file``); ``docs/reliability.md`` collects them.

Pod 0's ``/metrics`` goes through a proxy the test controls; pod 2's replay URL points at a
ROUTER that never answers.  Tests run in file order and leave the fleet healthy for the next.
"""

from __future__ import annotations

import contextlib
import json
import time
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from epp.envoy_bootstrap import UPSTREAM_HOST_HEADER
from launcher.observe import metric, scrape, true_entries, wait_for
from launcher.stack import Stack
from launcher.traffic import Outcome, Traffic, chat_body, failures
from tests.reliability.reporting import report

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, llama3_tokenizer_dir: Path) -> Iterator[Stack]:
    work = tmp_path_factory.mktemp("pod-faults")
    fleet = Stack.start(work, llama3_tokenizer_dir, pods=3, metrics_proxies=[0], silent_replay=[2])
    try:
        yield fleet
    finally:
        fleet.stop()


def _epp(stack: Stack) -> str:
    return scrape(stack.replicas[0].metrics_url)


def _unreachable(stack: Stack) -> float:
    return metric(_epp(stack), "inference_extension_unreachable_endpoints")


def _epp_entries(stack: Stack, pod: int) -> float:
    return metric(
        _epp(stack),
        "inference_extension_kv_index_endpoint_entries",
        endpoint=stack.pods[pod].address,
    )


def _fault(stack: Stack, pod: int, path: str, body: dict[str, object] | None = None) -> object:
    request = urllib.request.Request(
        f"http://{stack.pods[pod].address}{path}",
        data=json.dumps(body or {}).encode(),
        headers={"content-type": "application/json"},
        method="POST",
    )
    with urllib.request.urlopen(request, timeout=5) as resp:
        return json.loads(resp.read())


def _converged(stack: Stack, pod: int) -> bool:
    return _epp_entries(stack, pod) == true_entries(stack.pods[pod])


@contextlib.contextmanager
def _traffic_on(stack: Stack, pods: tuple[int, ...], rate: float) -> Iterator[list[Traffic]]:
    """Traffic through the gateway plus traffic sent to each of ``pods`` directly: a test of
    those pods' events must not depend on the cache-affine EPP choosing to route to them."""
    with contextlib.ExitStack() as stack_of:
        runs = [stack_of.enter_context(Traffic(stack.gateway, rate=rate, max_seconds=30))]
        for i in pods:
            direct = Traffic(f"http://{stack.pods[i].address}", rate=rate / 2, max_seconds=30)
            runs.append(stack_of.enter_context(direct))
        yield runs


def _outcomes(runs: list[Traffic]) -> list:  # type: ignore[type-arg]
    return [o for run in runs for o in run.outcomes]


def _served_by(outcomes: list, address: str, after: float) -> list:  # type: ignore[type-arg]
    return [o for o in outcomes if o.upstream == address and o.sent_at > after]


def test_warm_up_the_fleet_serves_and_the_index_matches_the_pods(stack: Stack) -> None:
    with Traffic(stack.gateway, rate=30, max_seconds=20) as traffic:
        time.sleep(3)
    outcomes = traffic.outcomes
    assert outcomes and not failures(outcomes), failures(outcomes)[:5]
    assert len({o.upstream for o in outcomes}) >= 2  # prefix affinity may favour some pods
    for i in range(3):
        wait_for(lambda i=i: _converged(stack, i), f"pod {i} index converged", timeout=15)


@dataclass(frozen=True)
class _Outage:
    """What `_outage` saw: the traffic's outcomes and when things happened (``time.monotonic``
    instants, durations in seconds)."""

    outcomes: list[Outcome]
    broken_at: float
    detection: float  # from breaking the pod until the EPP marked it unreachable
    mended_at: float
    recovery: float  # from mending it until the EPP marked it reachable
    back: float  # from mending it until it served a request again


def _outage(
    stack: Stack, pod: int, what: str, break_pod: Callable[[], None], mend_pod: Callable[[], None]
) -> _Outage:
    """Traffic through the gateway while pod ``pod`` is broken by ``break_pod`` until the EPP
    marks it unreachable and two seconds more, then mended by ``mend_pod`` (even when the EPP
    never noticed, so the next test finds the fleet whole) until it serves again."""
    address = stack.pods[pod].address
    with Traffic(stack.gateway, rate=30, max_seconds=60) as traffic:
        time.sleep(1)
        broken_at = time.monotonic()
        break_pod()
        try:
            detection = wait_for(lambda: _unreachable(stack) >= 1, f"the {what} pod unreachable")
            time.sleep(2)
        finally:
            mended_at = time.monotonic()
            mend_pod()
        recovery = wait_for(lambda: _unreachable(stack) == 0, "the pod reachable again")
        back = wait_for(
            lambda: bool(_served_by(traffic.outcomes, address, mended_at)),
            f"a request served by the {what} pod once mended",
        )
        time.sleep(1)
    return _Outage(traffic.outcomes, broken_at, detection, mended_at, recovery, back)


def test_a_killed_pod_is_left_out_then_taken_back(stack: Stack) -> None:
    victim = stack.pods[1]
    outage = _outage(stack, 1, "killed", lambda: stack.kill_pod(1), lambda: stack.start_pod(1))
    outcomes, killed_at, restarted_at = outage.outcomes, outage.broken_at, outage.mended_at
    detection = outage.detection
    lost = [o for o in failures(outcomes) if o.sent_at >= killed_at - 1]
    # Lost: requests in flight on the pod when it died, and those routed there before the EPP
    # noticed.  Nothing sent after detection (plus one scrape of slack) may fail.
    late = [o for o in lost if o.sent_at > killed_at + detection + 0.3]
    assert not late, late[:5]
    assert not [
        o
        for o in _served_by(outcomes, victim.address, killed_at + detection + 0.3)
        if o.sent_at < restarted_at
    ]
    report(
        "pod killed (SIGKILL)",
        detection_s=detection,
        lost_requests=len(lost),
        sent=len([o for o in outcomes if killed_at <= o.sent_at <= killed_at + detection]),
        recovery_after_restart_s=outage.recovery,
        first_request_served_s=outage.back,
    )
    converged = wait_for(lambda: _converged(stack, 1), "restarted pod's index converged", 20)
    report("pod killed: index converged after restart", seconds=converged)


def test_a_hung_pod_is_left_out_then_taken_back(stack: Stack) -> None:
    victim = stack.pods[1]
    outage = _outage(
        stack, 1, "hung", lambda: stack.hang_pod(1), lambda: stack.hang_pod(1, hung=False)
    )
    outcomes, hung_at, resumed_at = outage.outcomes, outage.broken_at, outage.mended_at
    detection = outage.detection
    # A request sent just before the resume may be decided just after it (the parked scrape is
    # answered at once then, making the pod routable): only earlier ones count.
    routed_while_hung = [
        o
        for o in _served_by(outcomes, victim.address, hung_at + detection + 0.3)
        if o.sent_at < resumed_at - 0.2
    ]
    assert not routed_while_hung, routed_while_hung[:5]
    stuck = [
        o
        for o in outcomes
        if hung_at <= o.sent_at <= hung_at + detection and o.upstream == victim.address
    ]
    assert not failures(o for o in outcomes if o.sent_at > hung_at + detection + 0.3)
    report(
        "pod hung (SIGSTOP)",
        detection_s=detection,
        requests_stalled_until_resume=len(stuck),
        recovery_after_resume_s=outage.recovery,
        first_request_served_s=outage.back,
    )


def test_a_pod_restarted_in_place_is_dropped_from_the_index_and_reindexed(stack: Stack) -> None:
    """Pod 1 gets traffic sent to it directly too: its restart shows only when it publishes
    again, which must not depend on the cache-affine EPP routing there.  (Comparing its entry
    count with the one before the restart was no evidence: a pod that held few blocks caches
    more than that again within a scrape.)"""
    wait_for(lambda: _epp_entries(stack, 1) > 0, "pod 1 holds blocks in the index")
    restarts_before = metric(_epp(stack), "inference_extension_kv_events_restarts_detected")
    _fault(stack, 1, "/fault/restart")
    restarted_at = time.monotonic()
    with _traffic_on(stack, (1,), rate=20) as runs:
        converged = wait_for(
            lambda: (
                metric(_epp(stack), "inference_extension_kv_events_restarts_detected")
                > restarts_before
                and _converged(stack, 1)
            ),
            "the index forgot the old cache and follows the new one",
        )
        time.sleep(0.5)
    assert not failures(o for o in _outcomes(runs) if o.sent_at > restarted_at + 1)
    report("pod restarted in place (seq back to 0)", index_converged_s=converged)
    wait_for(lambda: _converged(stack, 1), "converged at rest", 15)


def test_lost_batches_are_replayed_and_the_index_stays_exact(stack: Stack) -> None:
    before = _epp(stack)
    recovered_before = metric(before, "inference_extension_kv_events_gaps_recovered")
    unrecovered_before = metric(before, "inference_extension_kv_events_gaps_unrecovered")
    lossy = (0, 1)
    for i in lossy:
        _fault(stack, i, "/fault/config", {"drop_batch_prob": 0.1})
    try:
        with _traffic_on(stack, lossy, rate=25) as runs:
            time.sleep(4)
    finally:
        for i in lossy:
            _fault(stack, i, "/fault/config", {"drop_batch_prob": 0.0})
    assert not failures(_outcomes(runs))
    # A gap shows when the next batch arrives: a little more traffic reveals the last ones.
    with _traffic_on(stack, lossy, rate=10):
        seconds = wait_for(
            lambda: all(_converged(stack, i) for i in lossy), "index exact despite lost batches"
        )
    after = _epp(stack)
    recovered = metric(after, "inference_extension_kv_events_gaps_recovered")
    assert recovered > recovered_before
    report(
        "lost event batches (10 % dropped on PUB)",
        gaps_recovered=recovered - recovered_before,
        gaps_unrecovered=metric(after, "inference_extension_kv_events_gaps_unrecovered")
        - unrecovered_before,
        exact_after_traffic_s=seconds,
    )


def test_a_pod_that_stops_publishing_is_caught_up_when_it_resumes(stack: Stack) -> None:
    silent = (0, 1)
    for i in silent:
        status = _fault(stack, i, "/fault/config", {})
        assert isinstance(status, dict)
        next_seq = status["publisher"]["next_seq"]
        _fault(stack, i, "/fault/config", {"stop_publishing_after": next_seq})
    try:
        with _traffic_on(stack, silent, rate=25) as runs:
            time.sleep(3)
        stale = sum(true_entries(stack.pods[i]) - _epp_entries(stack, i) for i in silent)
    finally:
        for i in silent:
            _fault(stack, i, "/fault/config", {"resume_publishing": True})
    assert not failures(_outcomes(runs))
    assert stale > 0  # the silent pods did compute blocks nobody heard of
    resumed_at = time.monotonic()
    # The next batch each publishes reveals the gap; the replay fills it.
    with _traffic_on(stack, silent, rate=10):
        converged = wait_for(
            lambda: all(_converged(stack, i) for i in silent), "caught up by replay", 20
        )
    report(
        "pods stopped publishing, then resumed",
        stale_entries_while_silent=float(stale),
        caught_up_after_resume_s=time.monotonic() - resumed_at,
        converged_s=converged,
    )


def _chat(url: str, body: dict[str, object]) -> str:
    """POST a chat completion; the pod that served it (Envoy's header), or "" sent directly."""
    request = urllib.request.Request(
        f"{url}/v1/chat/completions",
        data=json.dumps(body).encode(),
        headers={"content-type": "application/json"},
        method="POST",
    )
    with urllib.request.urlopen(request, timeout=30) as resp:
        resp.read()
        return str(resp.headers.get(UPSTREAM_HOST_HEADER, ""))


def _silent_flag(stack: Stack, pod: int) -> float:
    return metric(
        _epp(stack),
        "inference_extension_kv_events_silent_publisher",
        endpoint=stack.pods[pod].address,
    )


def test_a_pod_serving_without_publishing_is_found_silent_then_caught_up(
    stack: Stack,
) -> None:
    """The EPP routes requests with new prompt blocks to pods whose PUB sends nothing (their
    replay buffers still fill, as when only the path to the EPP broke); with no batch since,
    ``silentPublisherTimeout`` (10 s, the default) after such a completion it marks them
    silent and subscribes to them again, whose replay-buffer fetch catches their entries up and
    trusts them again while their PUBs stay mute; once they publish again nothing is amiss.

    The requests reach the mute pods by prefix affinity, not by luck: each mute pod first
    caches a long system prompt of its own (sent to it directly, heard by the EPP), and every
    request extends that prompt with a new turn; the pod that served each one is checked."""
    silent = (0, 1)
    run = f"silent-{time.monotonic_ns()}"
    for i in silent:
        _chat(f"http://{stack.pods[i].address}", chat_body(9000 + i, 0, run=run))
    for i in silent:
        wait_for(lambda i=i: _converged(stack, i), f"pod {i}'s own prefix indexed", 15)
        assert _silent_flag(stack, i) == 0
    detected_before = metric(
        _epp(stack), "inference_extension_kv_events_silent_publishers_detected"
    )
    for i in silent:
        status = _fault(stack, i, "/fault/config", {})
        assert isinstance(status, dict)
        _fault(
            stack, i, "/fault/config", {"stop_publishing_after": status["publisher"]["next_seq"]}
        )
    try:
        evidence_at: dict[int, float] = {}
        for turn in range(1, 11):  # bounded: each turn is new text, so new blocks
            for i in silent:
                if i not in evidence_at:
                    upstream = _chat(stack.gateway, chat_body(9000 + i, turn, run=run))
                    if upstream == stack.pods[i].address:
                        evidence_at[i] = time.monotonic()
            if len(evidence_at) == len(silent):
                break
        assert sorted(evidence_at) == list(silent), f"routed elsewhere: {evidence_at}"
        stale = sum(true_entries(stack.pods[i]) - _epp_entries(stack, i) for i in silent)
        assert stale > 0  # the mute pods did compute blocks nobody heard of
        # The flag is 1 from the scrape that marks a pod until its resync lands (milliseconds):
        # read both flags from each scrape, and the detection counter, which stays.
        detected: dict[int, float] = {}

        def found_silent() -> bool:
            text = _epp(stack)
            for i in silent:
                flag = metric(
                    text,
                    "inference_extension_kv_events_silent_publisher",
                    endpoint=stack.pods[i].address,
                )
                if i not in detected and flag == 1:
                    detected[i] = time.monotonic() - evidence_at[i]
            count = metric(text, "inference_extension_kv_events_silent_publishers_detected")
            return count - detected_before >= len(silent)

        wait_for(found_silent, "the mute pods found silent", 60)
        # Only the mute pods: pod 2 kept publishing.
        assert _silent_flag(stack, 2) == 0
        # Subscribed again: the fetch of their buffers catches them up, PUBs still mute.
        caught_up = wait_for(
            lambda: all(_silent_flag(stack, i) == 0 and _converged(stack, i) for i in silent),
            "caught up from the replay buffers while still mute",
            20,
        )
    finally:
        for i in silent:
            _fault(stack, i, "/fault/config", {"resume_publishing": True})
    with contextlib.ExitStack() as runs:
        for i in silent:
            runs.enter_context(Traffic(f"http://{stack.pods[i].address}", rate=5, max_seconds=30))
        converged = wait_for(
            lambda: all(_silent_flag(stack, i) == 0 and _converged(stack, i) for i in silent),
            "trusted and exact after resuming",
            20,
        )
    report(
        "pods serving without publishing (silentPublisherTimeout 10 s)",
        detected_after_evidence_s=max(detected.values(), default=float("nan")),
        stale_entries_before_detection=float(stale),
        caught_up_after_detection_s=caught_up,
        converged_after_resume_s=converged,
    )


def test_a_replay_socket_that_never_answers_costs_accuracy_not_availability(
    stack: Stack,
) -> None:
    failed_before = metric(_epp(stack), "inference_extension_kv_events_gaps_unrecovered")
    _fault(stack, 2, "/fault/config", {"drop_batch_prob": 0.5})
    try:
        with _traffic_on(stack, (2,), rate=25) as runs:  # pod 2 publishes, whatever the EPP picks
            time.sleep(4)
    finally:
        _fault(stack, 2, "/fault/config", {"drop_batch_prob": 0.0})
    assert not failures(_outcomes(runs))
    unrecovered = wait_for(
        lambda: (
            metric(_epp(stack), "inference_extension_kv_events_gaps_unrecovered") > failed_before
        ),
        "gaps given up after the replay timeout",
    )
    report(
        "replay socket never answers (50 % batches lost)",
        gaps_unrecovered=metric(_epp(stack), "inference_extension_kv_events_gaps_unrecovered")
        - failed_before,
        noticed_s=unrecovered,
        failed_requests=len(failures(_outcomes(runs))),
    )


def test_a_metrics_page_of_garbage_leaves_the_pod_routable(stack: Stack) -> None:
    proxy = stack.pods[0].metrics_proxy
    assert proxy is not None
    proxy.mode = "garbage"
    try:
        with Traffic(stack.gateway, rate=25, max_seconds=30) as traffic:
            time.sleep(3)
            assert _unreachable(stack) == 0
    finally:
        proxy.mode = "pass"
    assert not failures(traffic.outcomes)
    report(
        "metrics page returns garbage",
        unreachable=0.0,
        requests_to_that_pod=len(
            [o for o in traffic.outcomes if o.upstream == stack.pods[0].address]
        ),
        requests=len(traffic.outcomes),
    )


def test_a_metrics_page_that_never_answers_leaves_a_serving_pod_routable(
    stack: Stack,
) -> None:
    """Busy is not dead: a pod whose /metrics stops answering while it keeps serving (its KV
    events and response bytes are signs of life) stays routable on its aging metrics."""
    proxy = stack.pods[0].metrics_proxy
    assert proxy is not None
    transitions = "inference_extension_endpoint_unreachable_transitions"
    silent_before = metric(_epp(stack), transitions, reason="no_sign_of_life")
    with _traffic_on(stack, (0,), rate=25) as runs:
        time.sleep(0.5)
        proxy.mode = "hang"
        try:
            time.sleep(3)
            page = _epp(stack)
            age = metric(
                page, "inference_extension_metrics_age_seconds", endpoint=stack.pods[0].address
            )
            unreachable = metric(page, "inference_extension_unreachable_endpoints")
            silent = metric(page, transitions, reason="no_sign_of_life") - silent_before
        finally:
            proxy.mode = "pass"
    outcomes = _outcomes(runs)
    assert not failures(outcomes)
    assert age > 2.0  # its metrics stopped updating ...
    assert unreachable == 0 and silent == 0  # ... and it was never taken for dead
    report("metrics page times out on a serving pod", metrics_age_s=age, unreachable=unreachable)
