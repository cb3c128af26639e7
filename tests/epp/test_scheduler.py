"""The scheduler core: producers → profile handler loop (filters → weighted scorers → picker) →
PreRequest, built by hand from small fake plugins and the real picker and handler."""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Mapping, Sequence
from typing import Any

import pytest

from epp.scheduler import (
    DATA_PRODUCER,
    FILTER,
    PICKER,
    PRE_REQUEST,
    PROCESS_PROFILES_RESULTS,
    PROFILE_PICKER,
    RESPONSE_COMPLETE,
    SCORER,
    Scheduler,
    SchedulerProfile,
    WeightedScorer,
)
from scorers.base import (
    AllEndpointsFilteredError,
    Endpoint,
    LLMRequest,
    NoReadyEndpointsError,
    ProfileResult,
    SchedulingError,
    SchedulingResult,
    ScoredEndpoint,
    Usage,
)
from tests.scorers.plugin_helpers import endpoint, make, request

A, B, C = endpoint("a:1"), endpoint("b:1"), endpoint("c:1")


class FixedScorer:
    type_name = "fixed-scorer"

    def __init__(self, name: str, scores: Mapping[str, float]) -> None:
        self.name = name
        self.scores = dict(scores)
        self.seen: list[list[str]] = []

    def score(self, request: LLMRequest, endpoints: Sequence[Endpoint]) -> dict[str, float]:
        self.seen.append([e.address for e in endpoints])
        return dict(self.scores)


class DropFilter:
    def __init__(self, name: str, drop: set[str], log: list[str] | None = None) -> None:
        self.name = name
        self.drop = drop
        self.log = log if log is not None else []
        self.seen: list[list[str]] = []

    def filter(self, request: LLMRequest, endpoints: Sequence[Endpoint]) -> list[Endpoint]:
        self.log.append(f"filter:{self.name}")
        self.seen.append([e.address for e in endpoints])
        return [e for e in endpoints if e.address not in self.drop]


class RecordingPlugin:
    """Producer + PreRequest + ResponseComplete + EndpointListener + Lifecycle."""

    type_name = "recorder"

    def __init__(self, name: str, log: list[str]) -> None:
        self.name = name
        self.log = log
        self.results: list[SchedulingResult] = []

    async def prepare(self, request: LLMRequest, endpoints: Sequence[Endpoint]) -> None:
        await asyncio.sleep(0)
        self.log.append(f"prepare:{self.name}")
        request.data[self.name] = True

    def pre_request(self, request: LLMRequest, result: SchedulingResult) -> None:
        self.log.append(f"pre_request:{self.name}")
        self.results.append(result)

    def response_complete(self, request: LLMRequest, endpoint: str, usage: Usage | None) -> None:
        self.log.append(f"response_complete:{self.name}:{endpoint}")

    def endpoint_added(self, endpoint: Endpoint) -> None:
        self.log.append(f"added:{endpoint.address}")

    def endpoint_removed(self, endpoint: Endpoint) -> None:
        self.log.append(f"removed:{endpoint.address}")

    async def start(self) -> None:
        self.log.append(f"start:{self.name}")

    async def stop(self) -> None:
        self.log.append(f"stop:{self.name}")


def one_profile(
    *scorers: tuple[Any, float], filters: Sequence[Any] = (), picker: Any = None, **kwargs: Any
) -> Scheduler:
    profile = SchedulerProfile(
        "default",
        filters,
        [WeightedScorer(s, w) for s, w in scorers],
        picker if picker is not None else make("max-score-picker"),
    )
    return Scheduler([profile], make("single-profile-handler"), **kwargs)


async def test_weighted_scores_are_summed_per_endpoint() -> None:
    queue = FixedScorer("queue", {"a:1": 1.0, "b:1": 0.5, "c:1": 0.0})
    prefix = FixedScorer("prefix", {"a:1": 0.0, "b:1": 0.5, "c:1": 1.0})
    scheduler = one_profile((queue, 2.0), (prefix, 3.0))
    result = await scheduler.schedule(request(), [A, B, C])
    assert result.primary_profile == "default"
    assert result.profiles["default"].scores == {"a:1": 2.0, "b:1": 2.5, "c:1": 3.0}
    assert [e.address for e in result.targets] == ["c:1"]


async def test_scores_are_clamped_and_missing_endpoints_score_zero() -> None:
    wild = FixedScorer("wild", {"a:1": 1.7, "b:1": -0.5, "c:1": math.nan, "ghost:1": 1.0})
    partial = FixedScorer("partial", {"b:1": 0.25})
    scheduler = one_profile((wild, 2.0), (partial, 1.0))
    result = await scheduler.schedule(request(), [A, B, C])
    assert result.profiles["default"].scores == {"a:1": 2.0, "b:1": 0.25, "c:1": 0.0}


async def test_filters_run_in_order_on_the_survivors() -> None:
    log: list[str] = []
    first = DropFilter("first", {"a:1"}, log)
    second = DropFilter("second", {"b:1"}, log)
    scorer = FixedScorer("s", {})
    scheduler = one_profile((scorer, 1.0), filters=[first, second])
    result = await scheduler.schedule(request(), [A, B, C])
    assert log == ["filter:first", "filter:second"]
    assert second.seen == [["b:1", "c:1"]]
    assert scorer.seen == [["c:1"]]
    assert [e.address for e in result.targets] == ["c:1"]
    assert result.profiles["default"].scores == {"c:1": 0.0}


async def test_filters_removing_everything_is_a_429_naming_the_filter() -> None:
    scheduler = one_profile(filters=[DropFilter("keep-some", {"a:1"}), DropFilter("gpu", {"b:1"})])
    with pytest.raises(AllEndpointsFilteredError, match=r"filter 'gpu'.*removed every candidate"):
        await scheduler.schedule(request(), [A, B])
    assert AllEndpointsFilteredError.http_status == 429


async def test_no_candidates_is_a_503() -> None:
    scheduler = one_profile()
    with pytest.raises(NoReadyEndpointsError):
        await scheduler.schedule(request(), [])
    with pytest.raises(NoReadyEndpointsError):
        scheduler.run_profiles(request(), [])
    assert NoReadyEndpointsError.http_status == 503


async def test_data_producers_finish_before_filters_and_run_concurrently() -> None:
    log: list[str] = []
    first_started, second_started = asyncio.Event(), asyncio.Event()

    class Waiting:
        def __init__(self, name: str, mine: asyncio.Event, other: asyncio.Event) -> None:
            self.name, self.mine, self.other = name, mine, other

        async def prepare(self, request: LLMRequest, endpoints: Sequence[Endpoint]) -> None:
            self.mine.set()
            await self.other.wait()  # deadlocks unless both run at the same time
            log.append(f"prepare:{self.name}")

    class NeedsData:
        name = "needs-data"

        def filter(self, request: LLMRequest, endpoints: Sequence[Endpoint]) -> list[Endpoint]:
            log.append("filter")
            return list(endpoints)

    producers = [
        Waiting("one", first_started, second_started),
        Waiting("two", second_started, first_started),
    ]
    scheduler = one_profile(filters=[NeedsData()], plugins=producers)
    assert scheduler.data_producers == tuple(producers)
    await asyncio.wait_for(scheduler.schedule(request(), [A]), timeout=5)
    assert sorted(log[:2]) == ["prepare:one", "prepare:two"]
    assert log[2:] == ["filter"]


async def test_pre_request_gets_the_result() -> None:
    log: list[str] = []
    recorder = RecordingPlugin("rec", log)
    scheduler = one_profile((FixedScorer("s", {"b:1": 1.0}), 1.0), plugins=[recorder])
    req = request()
    result = await scheduler.schedule(req, [A, B])
    assert log == ["prepare:rec", "pre_request:rec"]
    assert recorder.results == [result]
    assert req.data["rec"] is True
    assert [e.address for e in result.targets] == ["b:1"]


async def test_failing_producer_is_logged_and_skipped(caplog: pytest.LogCaptureFixture) -> None:
    class Broken:
        name = "broken"

        async def prepare(self, request: LLMRequest, endpoints: Sequence[Endpoint]) -> None:
            raise RuntimeError("tokenizer missing")

    scheduler = one_profile(plugins=[Broken()])
    with caplog.at_level(logging.ERROR):
        result = await scheduler.schedule(request("req-7"), [A])
    assert result.targets == (A,)
    assert "req-7" in caplog.text and "'broken'" in caplog.text


async def test_producer_scheduling_error_fails_the_request() -> None:
    class Shedding:
        name = "shed"

        async def prepare(self, request: LLMRequest, endpoints: Sequence[Endpoint]) -> None:
            raise AllEndpointsFilteredError("saturated")

    with pytest.raises(AllEndpointsFilteredError, match="saturated"):
        await one_profile(plugins=[Shedding()]).schedule(request(), [A])


async def test_prepare_timeout_continues_without_the_slow_producer(
    caplog: pytest.LogCaptureFixture,
) -> None:
    class Slow:
        name = "slow"

        async def prepare(self, request: LLMRequest, endpoints: Sequence[Endpoint]) -> None:
            await asyncio.Event().wait()

    scheduler = one_profile(plugins=[Slow()], prepare_timeout=0.01)
    with caplog.at_level(logging.WARNING):
        result = await scheduler.schedule(request(), [A])
    assert result.targets == (A,)
    assert "did not finish" in caplog.text


async def test_failing_pre_request_does_not_fail_the_request(
    caplog: pytest.LogCaptureFixture,
) -> None:
    class Broken:
        name = "broken"

        def pre_request(self, request: LLMRequest, result: SchedulingResult) -> None:
            raise KeyError("x")

    log: list[str] = []
    scheduler = one_profile(plugins=[Broken(), RecordingPlugin("after", log)])
    with caplog.at_level(logging.ERROR):
        await scheduler.schedule(request(), [A])
    assert "pre_request:after" in log
    assert "PreRequest plugin 'broken'" in caplog.text


async def test_plugin_durations_are_reported() -> None:
    calls: list[tuple[str, str, str]] = []

    def hook(point: str, plugin_type: str, name: str, seconds: float) -> None:
        assert seconds >= 0
        calls.append((point, plugin_type, name))

    scheduler = one_profile(
        (FixedScorer("s", {}), 1.0),
        filters=[DropFilter("f", set())],
        plugins=[RecordingPlugin("rec", [])],
        on_plugin_duration=hook,
    )
    await scheduler.schedule(request(), [A])
    scheduler.run_response_complete(request(), "a:1", None)
    assert calls == [
        (DATA_PRODUCER, "recorder", "rec"),
        (PROFILE_PICKER, "single-profile-handler", "single-profile-handler"),
        (FILTER, "DropFilter", "f"),
        (SCORER, "fixed-scorer", "s"),
        (PICKER, "max-score-picker", "max-score-picker"),
        (PROFILE_PICKER, "single-profile-handler", "single-profile-handler"),
        (PROCESS_PROFILES_RESULTS, "single-profile-handler", "single-profile-handler"),
        (PRE_REQUEST, "recorder", "rec"),
        (RESPONSE_COMPLETE, "recorder", "rec"),
    ]


async def test_plugins_by_role_for_wiring() -> None:
    log: list[str] = []
    first, second = RecordingPlugin("one", log), RecordingPlugin("two", log)
    scorer = make("prefix-cache-scorer")
    scheduler = one_profile((scorer, 1.0), plugins=[first, second])
    assert scheduler.response_complete_plugins == (first, second)
    assert scheduler.lifecycle_plugins == (first, second)
    assert scheduler.endpoint_listeners == (first, second, scorer)
    assert scheduler.pre_request_plugins == (first, second, scorer)
    assert scheduler.plugin("two") is second
    assert scheduler.plugin("nope") is None

    await scheduler.start()
    await scheduler.stop()
    scheduler.endpoint_added(A)
    scheduler.endpoint_removed(A)
    scheduler.run_response_complete(request(), "a:1", Usage(prompt_tokens=3))
    assert log == [
        "start:one",
        "start:two",
        "stop:two",
        "stop:one",
        "added:a:1",
        "added:a:1",
        "removed:a:1",
        "removed:a:1",
        "response_complete:one:a:1",
        "response_complete:two:a:1",
    ]


async def test_picker_returning_nothing_is_an_internal_error() -> None:
    class Nothing:
        name = "nothing"

        def pick(self, request: LLMRequest, scored: Sequence[ScoredEndpoint]) -> list[Endpoint]:
            return []

    with pytest.raises(SchedulingError, match=r"picker 'nothing'.*returned no endpoint") as info:
        await one_profile(picker=Nothing()).schedule(request(), [A])
    assert info.value.http_status == 500


class TwoProfiles:
    """Runs 'prefill' then 'decode' (one per round), primary 'decode'."""

    name = "two"

    def __init__(self, order: Sequence[str] = ("prefill", "decode")) -> None:
        self.order = list(order)

    def pick_profiles(
        self, request: LLMRequest, profiles: Sequence[str], results: Mapping[str, ProfileResult]
    ) -> list[str]:
        return self.order[len(results) : len(results) + 1]

    def process_results(
        self, request: LLMRequest, results: Mapping[str, ProfileResult]
    ) -> SchedulingResult:
        return SchedulingResult(primary_profile="decode", profiles=dict(results))


def _pd_profiles() -> list[SchedulerProfile]:
    prefill = SchedulerProfile(
        "prefill", [], [WeightedScorer(FixedScorer("p", {"a:1": 1.0}))], make("max-score-picker")
    )
    decode = SchedulerProfile(
        "decode", [], [WeightedScorer(FixedScorer("d", {"b:1": 1.0}))], make("max-score-picker")
    )
    return [prefill, decode]


async def test_profile_handler_loop_runs_every_chosen_profile() -> None:
    scheduler = Scheduler(_pd_profiles(), TwoProfiles())
    result = await scheduler.schedule(request(), [A, B])
    assert set(result.profiles) == {"prefill", "decode"}
    assert result.profiles["prefill"].targets == (A,)
    assert result.targets == (B,)


async def test_profile_handler_mistakes_are_internal_errors() -> None:
    with pytest.raises(SchedulingError, match="unknown scheduling profile 'encode'"):
        await Scheduler(_pd_profiles(), TwoProfiles(["encode"])).schedule(request(), [A])
    with pytest.raises(SchedulingError, match="'prefill' a second time"):
        await Scheduler(_pd_profiles(), TwoProfiles(["prefill", "prefill"])).schedule(
            request(), [A]
        )


def test_scheduler_needs_uniquely_named_profiles() -> None:
    with pytest.raises(ValueError, match="at least one"):
        Scheduler([], make("single-profile-handler"))
    profiles = _pd_profiles()
    with pytest.raises(ValueError, match="unique"):
        Scheduler([profiles[0], profiles[0]], TwoProfiles())


async def test_end_to_end_prefix_affinity_with_real_plugins() -> None:
    """The default weights: once a prompt went to b, its repeat goes to b too, unless b's
    queue makes up for it."""
    prefix, queue = make("prefix-cache-scorer"), make("queue-scorer")
    scheduler = one_profile((queue, 2.0), (prefix, 3.0))
    prompt = "You are a helpful assistant. " * 20
    eps = [endpoint("a:1", waiting=1), endpoint("b:1", waiting=0), endpoint("c:1", waiting=1)]
    first = await scheduler.schedule(request("r1", prompt=prompt), eps)
    assert [e.address for e in first.targets] == ["b:1"]
    eps = [endpoint("a:1", waiting=0), endpoint("b:1", waiting=1), endpoint("c:1", waiting=1)]
    second = await scheduler.schedule(request("r2", prompt=prompt), eps)
    assert second.profiles["default"].scores == {"a:1": 2.0, "b:1": 3.0, "c:1": 0.0}
    assert [e.address for e in second.targets] == ["b:1"]
