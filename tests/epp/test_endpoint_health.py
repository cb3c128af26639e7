"""Reachability: the scraper marks endpoints that stop answering, the datastore and the director
leave them out of candidates (fail-open when none answers), and they come back on their own."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Sequence

import pytest

from epp.datastore import Datastore, EndpointSpec
from epp.director import Director
from epp.scheduler import Scheduler, SchedulerProfile
from epp.scraping import MetricsScraper
from scorers.base import LLMRequest, PluginContext
from scorers.pickers import MaxScorePicker
from scorers.profiles import SingleProfileHandler
from tests.epp.test_scraping import FakeVllm, eventually
from tests.support.servers import running


@pytest.fixture
def pod(vllm_server: FakeVllm) -> FakeVllm:
    """The watched pod: a started fake vLLM (`tests/epp/conftest.py`)."""
    return vllm_server


def _watching(
    pod: FakeVllm, *, timeout: float, unreachable_after: float
) -> tuple[Datastore, MetricsScraper]:
    """A datastore holding ``pod`` and a fast scraper watching it (not started)."""
    ds = Datastore()
    ds.upsert(EndpointSpec(address=pod.address))
    scraper = MetricsScraper(
        ds, interval=0.02, timeout=timeout, failure_threshold=3, unreachable_after=unreachable_after
    )
    return ds, scraper


@contextlib.asynccontextmanager
async def _watched(
    pod: FakeVllm, *, timeout: float, unreachable_after: float, peers: Sequence[FakeVllm] = ()
) -> AsyncIterator[tuple[Datastore, MetricsScraper]]:
    """`_watching` ``pod`` (and ``peers``), started; stopped and the pod answering at once
    again on the way out."""
    ds, scraper = _watching(pod, timeout=timeout, unreachable_after=unreachable_after)
    for peer in peers:
        ds.upsert(EndpointSpec(address=peer.address))
    await scraper.start()
    try:
        yield ds, scraper
    finally:
        await scraper.stop()
        pod.delay = 0.0


def test_routable_leaves_out_unreachable_endpoints_and_fails_open() -> None:
    ds = Datastore()
    for address in ("10.0.0.1:8000", "10.0.0.2:8000"):
        ds.upsert(EndpointSpec(address=address))
    assert ds.mark_unreachable("10.0.0.1:8000", "test")
    assert not ds.mark_unreachable("10.0.0.1:8000", "again")  # already marked
    assert not ds.mark_unreachable("10.9.9.9:8000", "unknown")  # not in the pool
    assert [e.address for e in ds.routable(ds.endpoints())] == ["10.0.0.2:8000"]
    assert ds.fail_open_total == 0
    ds.mark_unreachable("10.0.0.2:8000", "test")
    # Every candidate down: keep them all rather than answer 503 on a view that may be wrong.
    assert len(ds.routable(ds.endpoints())) == 2
    assert ds.fail_open_total == 1
    assert ds.pool_stats().unreachable_endpoints == 2
    assert ds.routable([]) == []
    assert ds.mark_reachable("10.0.0.1:8000")
    assert not ds.mark_reachable("10.0.0.1:8000")
    assert [e.address for e in ds.routable(ds.endpoints())] == ["10.0.0.1:8000"]
    ds.remove("10.0.0.2:8000")
    assert ds.unreachable() == {}
    assert ds.unreachable_marks_total == 2


def test_a_changed_metrics_url_is_judged_afresh() -> None:
    ds = Datastore()
    ds.upsert(EndpointSpec(address="10.0.0.1:8000"))
    ds.mark_unreachable("10.0.0.1:8000", "test")
    ds.upsert(EndpointSpec(address="10.0.0.1:8000", metrics_url="http://10.0.0.1:9000/metrics"))
    assert ds.is_reachable("10.0.0.1:8000")


async def test_a_refused_endpoint_is_unreachable_after_the_threshold_and_recovers(
    pod: FakeVllm,
) -> None:
    ds = Datastore()
    ds.upsert(EndpointSpec(address=pod.address))
    scraper = MetricsScraper(ds, interval=0.02, timeout=0.5, failure_threshold=3)
    await scraper.start()
    try:
        await eventually(lambda: scraper.status[pod.address].successes >= 1)
        port = pod.port
        await pod.stop()  # connections refused from now on
        await eventually(lambda: not ds.is_reachable(pod.address))
        assert scraper.status[pod.address].consecutive_refused >= 3
        assert "refused or reset" in ds.unreachable()[pod.address]
        assert ds.unreachable_marks == {"connection_refused": 1}
        # Back on the same port: the first answer makes it routable again.
        restarted = FakeVllm()
        await _start_on(restarted, port)
        try:
            await eventually(lambda: ds.is_reachable(pod.address))
        finally:
            await restarted.stop()
    finally:
        await scraper.stop()


async def test_a_hung_endpoint_is_unreachable_before_its_scrape_times_out(pod: FakeVllm) -> None:
    async with _watched(pod, timeout=10.0, unreachable_after=0.2) as (ds, scraper):
        await eventually(lambda: scraper.status[pod.address].successes >= 1)
        pod.delay = 1.0  # accepts the connection, does not answer in time
        loop = asyncio.get_running_loop()
        started = loop.time()
        await eventually(lambda: not ds.is_reachable(pod.address), timeout=3)
        assert loop.time() - started < 2.0  # long before the 10 s scrape timeout
        assert "waited" in ds.unreachable()[pod.address]
        assert ds.unreachable_marks == {"no_sign_of_life": 1}


async def test_a_busy_endpoint_answering_late_stays_routable(pod: FakeVllm) -> None:
    """Busy is not dead: a pod whose /metrics answers after the watchdog's wait, or never within
    the timeout, but which streams responses or publishes KV events meanwhile, keeps its place
    on its aging metrics."""
    ds, scraper = _watching(pod, timeout=0.6, unreachable_after=0.2)
    await scraper.start()
    alive = True

    async def keep_streaming() -> None:
        while alive:
            ds.saw_alive(pod.address)  # what the director does for each response byte
            await asyncio.sleep(0.05)

    streaming = asyncio.create_task(keep_streaming())
    try:
        await eventually(lambda: scraper.status[pod.address].successes >= 1)
        pod.delay = 1.0  # longer than the watchdog's wait and than the scrape timeout
        await eventually(lambda: scraper.status[pod.address].timeouts >= 3, timeout=5)
        assert ds.is_reachable(pod.address)
        assert ds.unreachable_marks_total == 0
        endpoint = ds.get(pod.address)
        assert endpoint is not None and endpoint.metrics_age > 1.0
        assert endpoint.metrics.running_requests == 2  # the last good page, aging
        # The same silence without any sign of life is a hung pod.
        alive = False
        await streaming
        await eventually(lambda: not ds.is_reachable(pod.address), timeout=3)
        assert ds.unreachable_marks == {"no_sign_of_life": 1}
    finally:
        alive = False
        await streaming
        await scraper.stop()
        pod.delay = 0.0


@pytest.mark.parametrize("prefilling", [True, False])
async def test_a_pod_prefilling_is_given_as_long_as_its_slowest_first_byte(
    pod: FakeVllm, prefilling: bool
) -> None:
    """On real vLLM-CPU one engine step of a long prefill on a starved machine left /metrics
    unanswered for 3 s with no other sign of life.  A pod with prefill in flight whose recent
    first bytes took that long may stay silent that long; with nothing waiting there, the same
    silence is a hang."""
    async with _watched(pod, timeout=10.0, unreachable_after=0.1) as (ds, scraper):
        await eventually(lambda: scraper.status[pod.address].successes >= 3)
        ds.saw_first_byte(pod.address, 0.5)  # an earlier request's first byte took 0.5 s
        if prefilling:
            ds.request_started(pod.address, prefill_tokens=1352)
        assert ds.expected_silence(pod.address) == (0.5 if prefilling else 0.0)
        await asyncio.sleep(0.1)  # the next scrape starts in that state
        pod.delay = 1.2  # silent for 1.2 s: 12 periods of 0.1 s, fewer than 3 of 0.5 s
        await asyncio.sleep(0.9)  # (checked before the late answer makes it reachable again)
        assert ds.is_reachable(pod.address) == prefilling
        assert ds.unreachable_marks_total == (0 if prefilling else 1)


async def test_an_endpoint_that_always_answers_slowly_is_given_time(pod: FakeVllm) -> None:
    """On a loaded machine every answer is slow: the wait before silence counts grows with
    the endpoint's slowest recent answer, so steady 0.3 s answers are not taken for a hang."""
    pod.delay = 0.15
    async with _watched(pod, timeout=5.0, unreachable_after=0.2) as (ds, scraper):
        await eventually(lambda: scraper.status[pod.address].successes >= 3)
        pod.delay = 0.3
        await eventually(lambda: scraper.status[pod.address].successes >= 8)
        assert ds.unreachable_marks_total == 0
        assert scraper.status[pod.address].slowest_recent >= 0.25


@pytest.mark.parametrize("peer_slow", [True, False])
async def test_an_idle_pod_on_a_loaded_machine_is_given_the_pools_patience(
    pod: FakeVllm, peer_slow: bool
) -> None:
    """Three vLLM-CPU servers on two cores: an idle one left /metrics unanswered for 3.1 s
    while the others' answers took up to 2 s.  Its own answers had been quick, so only the
    pool's slowness says the machine is loaded; with a quick pool the same silence is a hang."""
    async with running(FakeVllm()) as peer:
        peer.delay = 0.5 if peer_slow else 0.0
        watched = _watched(pod, timeout=10.0, unreachable_after=0.1, peers=[peer])
        async with watched as (ds, scraper):
            await eventually(lambda: scraper.status[peer.address].successes >= 2, timeout=5)
            pod.delay = 1.2  # 12 periods of 0.1 s; fewer than 3 of 3 × the pool's mean 0.25 s
            await asyncio.sleep(1.0)  # (checked before the late answer makes it reachable)
            assert ds.is_reachable(pod.address) == peer_slow


async def test_an_endpoint_answering_garbage_or_errors_stays_reachable(pod: FakeVllm) -> None:
    ds = Datastore()
    ds.upsert(EndpointSpec(address=pod.address))
    scraper = MetricsScraper(ds, interval=0.02, timeout=0.5, failure_threshold=1)
    await scraper.start()
    try:
        pod.page = "\x00\xff garbage { not prometheus"
        await eventually(lambda: scraper.status[pod.address].errors >= 3)
        pod.status = 503
        errors = scraper.status[pod.address].errors
        await eventually(lambda: scraper.status[pod.address].errors >= errors + 3)
        # It answers, so it is alive; its metrics just age into "saturated".
        assert ds.is_reachable(pod.address)
        assert ds.unreachable_marks_total == 0
    finally:
        await scraper.stop()


async def test_reachability_rules_can_be_disabled() -> None:
    ds = Datastore()
    ds.upsert(EndpointSpec(address="127.0.0.1:1"))  # nothing listens on port 1
    scraper = MetricsScraper(
        ds, interval=0.01, timeout=0.2, failure_threshold=None, unreachable_after=None
    )
    await scraper.start()
    try:
        await eventually(lambda: scraper.status["127.0.0.1:1"].errors >= 5)
        assert ds.is_reachable("127.0.0.1:1")
    finally:
        await scraper.stop()
    with pytest.raises(ValueError, match="failure_threshold"):
        MetricsScraper(ds, failure_threshold=0)
    with pytest.raises(ValueError, match="unreachable_after"):
        MetricsScraper(ds, unreachable_after=0)


async def test_the_director_routes_around_an_unreachable_endpoint() -> None:
    ds = Datastore(staleness_threshold=None)
    for address in ("10.0.0.1:8000", "10.0.0.2:8000"):
        ds.upsert(EndpointSpec(address=address))
    context = PluginContext(endpoints=ds)
    picker = MaxScorePicker("picker", MaxScorePicker.Parameters(), context)
    profile = SchedulerProfile("default", [], [], picker)
    handler = SingleProfileHandler("handler", SingleProfileHandler.Parameters(), context)
    director = Director(ds, Scheduler([profile], handler))
    ds.mark_unreachable("10.0.0.1:8000", "test")
    for i in range(20):
        decision = await director.route(LLMRequest(request_id=str(i), model="m"), None)
        assert decision.targets == ("10.0.0.2:8000",)
        director.response_complete(decision, None, 200)
    body_less = director.route_without_body(LLMRequest(request_id="x", model=""), None)
    assert body_less.targets == ("10.0.0.2:8000",)
    # The subset hint names only the unreachable endpoint: fail-open within the subset.
    decision = await director.route(LLMRequest(request_id="y", model="m"), frozenset({"10.0.0.1"}))
    assert decision.targets == ("10.0.0.1:8000",)
    assert ds.fail_open_total == 1


async def _start_on(server: FakeVllm, port: int) -> None:
    from aiohttp import web

    app = web.Application()
    app.router.add_get("/metrics", server.handle)
    server.runner = web.AppRunner(app)
    await server.runner.setup()
    site = web.TCPSite(server.runner, "127.0.0.1", port)
    await site.start()
    server.port = port


async def test_a_loaded_machine_is_remembered_after_its_answers_turn_quick(pod: FakeVllm) -> None:
    """On real vLLM-CPU a server whose /metrics had answered quickly for two seconds, after
    slow answers earlier in the run, went silent for 3.5 s while busy.  The slowest answer is
    remembered for tens of seconds, not a few scrapes, so that silence is not taken for a hang."""
    pod.delay = 0.3
    async with _watched(pod, timeout=10.0, unreachable_after=0.2) as (ds, scraper):
        await eventually(lambda: scraper.status[pod.address].successes >= 3, timeout=5)
        pod.delay = 0.0
        quick = scraper.status[pod.address].successes
        # (The slow answers paced the scrapes out to 0.5 s; the quick ones bring them back.)
        await eventually(lambda: scraper.status[pod.address].successes >= quick + 40, timeout=10)
        assert scraper.status[pod.address].slowest_recent >= 0.25
        marks = ds.unreachable_marks_total  # (a loaded CI machine may mark it while warming up)
        pod.delay = 1.2  # 6 periods of 0.2 s; fewer than 3 of 3 × the remembered 0.3 s
        await asyncio.sleep(1.0)  # (checked before the late answer makes it reachable)
        assert ds.is_reachable(pod.address)
        assert ds.unreachable_marks_total == marks


async def test_a_pod_answering_slowly_is_scraped_less_often_and_still_found_dead_at_once(
    pod: FakeVllm,
) -> None:
    """A scrape costs the pod the time of its answer; slow answers space the scrapes out (at
    most 150 ms apart: 3/4 of the 200 ms staleness bound), and a pod that refuses them is asked
    again at the interval."""
    pod.delay = 0.03  # 1.5 s at the 2 % share: held to 0.15 s
    async with _watched(pod, timeout=5.0, unreachable_after=5.0) as (ds, scraper):
        await eventually(lambda: scraper.status[pod.address].successes >= 3)
        assert scraper.period(pod.address) == pytest.approx(0.15)
        hits = pod.hits
        await asyncio.sleep(1.2)
        # At the 0.02 s interval (each answer taking 0.03 s) it would have been asked 24 times.
        assert 5 <= pod.hits - hits <= 10
        assert ds.get(pod.address) is not None and not ds.get(pod.address).metrics_stale
        await pod.stop()
        stopped = asyncio.get_running_loop().time()
        await eventually(lambda: not ds.is_reachable(pod.address), timeout=3)
        assert asyncio.get_running_loop().time() - stopped < 0.5
        assert scraper.period(pod.address) == pytest.approx(0.02)
        assert ds.unreachable_marks_total == 1
