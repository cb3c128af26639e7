"""The scheduler: composes configured plugins into one decision per request.

    schedule(request, candidates)
      0. every Screener narrows the candidates (none left: 503 ``rejected-no-endpoints``)
      1. every DataProducer's ``prepare`` (concurrently; tokenizing, prefix lookups), then
         every Admitter (the first to refuse drops the request with 429)
      2. the profile handler picks profiles until it returns none; each profile runs
         filters (in order) → scorers (clamped to [0, 1], × weight, summed) → picker
      3. the profile handler's ``process_results`` → `SchedulingResult`
      4. every PreRequest plugin (record routing history, session tokens)

It knows nothing of gRPC or HTTP: failures are `scorers.base.SchedulingError`s carrying the HTTP
status the ext_proc layer answers with (503 no candidates, 429 all filtered out).  Per-plugin
latency goes to an optional ``on_plugin_duration(extension_point, plugin_type, plugin_name,
seconds)`` hook, named after the Inference Extension's
``inference_extension_plugin_duration_seconds`` labels.

Built from an ``EndpointPickerConfig`` by `epp.config.build_scheduler`; tests and benchmarks may
also assemble one by hand from plugin instances.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from time import perf_counter
from typing import Any, Final, Protocol, TypeVar

from scorers.base import (
    AdmissionDeniedError,
    Admitter,
    AllEndpointsFilteredError,
    DataProducer,
    Endpoint,
    EndpointListener,
    Filter,
    Lifecycle,
    LLMRequest,
    NoReadyEndpointsError,
    Picker,
    PreRequest,
    ProfileHandler,
    ProfileResult,
    RequestHeaderProcessor,
    ResponseComplete,
    ResponseHeaderProcessor,
    SchedulingError,
    SchedulingResult,
    ScoredEndpoint,
    Scorer,
    Screener,
    Usage,
)

logger = logging.getLogger(__name__)

# Extension point names, as in the Inference Extension's plugin duration metric.
REQUEST_HEADER: Final = "RequestHeader"
SCREENER: Final = "Screener"
DATA_PRODUCER: Final = "DataProducer"
ADMISSION: Final = "Admission"
PROFILE_PICKER: Final = "ProfilePicker"
FILTER: Final = "Filter"
SCORER: Final = "Scorer"
PICKER: Final = "Picker"
PROCESS_PROFILES_RESULTS: Final = "ProcessProfilesResults"
PRE_REQUEST: Final = "PreRequest"
RESPONSE_RECEIVED: Final = "ResponseReceived"
RESPONSE_COMPLETE: Final = "ResponseComplete"
# llm-d-router's director answers a request its screeners left no endpoint with this header.
DROPPED_REASON_HEADER: Final = "x-llm-d-request-dropped-reason"

PluginDurationHook = Callable[[str, str, str, float], None]
"""``(extension_point, plugin_type, plugin_name, seconds)``."""


class ScreenedOutError(NoReadyEndpointsError):
    """503: the screeners left no candidate (llm-d-router's ``rejected-no-endpoints``)."""

    response_headers: tuple[tuple[str, str], ...] = (
        (DROPPED_REASON_HEADER, "rejected-no-endpoints"),
    )


class _Named(Protocol):
    """What every plugin role has: the name its log lines and duration labels carry."""

    name: str


_NamedPluginT = TypeVar("_NamedPluginT", bound=_Named)
_ArgT = TypeVar("_ArgT")
_ResultT = TypeVar("_ResultT")


def plugin_type(plugin: object) -> str:
    type_name = getattr(plugin, "type_name", "")
    return type_name if isinstance(type_name, str) and type_name else type(plugin).__name__


@dataclass(slots=True, frozen=True)
class WeightedScorer:
    scorer: Scorer
    weight: float = 1.0


class SchedulerProfile:
    """One scheduling profile: filters in order, weighted scorers, one picker."""

    __slots__ = ("filters", "name", "picker", "scorers")

    def __init__(
        self,
        name: str,
        filters: Sequence[Filter],
        scorers: Sequence[WeightedScorer],
        picker: Picker,
    ) -> None:
        self.name = name
        self.filters = tuple(filters)
        self.scorers = tuple(scorers)
        self.picker = picker

    def run(
        self,
        request: LLMRequest,
        candidates: Sequence[Endpoint],
        on_duration: PluginDurationHook | None = None,
    ) -> ProfileResult:
        endpoints: Sequence[Endpoint] = candidates
        for plugin in self.filters:
            endpoints = _timed(on_duration, FILTER, plugin, plugin.filter, request, endpoints)
            if not endpoints:
                raise AllEndpointsFilteredError(
                    f"filter {plugin.name!r} ({plugin_type(plugin)}) in scheduling profile "
                    f"{self.name!r} removed every candidate endpoint"
                )

        totals = dict.fromkeys((e.address for e in endpoints), 0.0)
        for weighted in self.scorers:
            scorer = weighted.scorer
            scores = _timed(on_duration, SCORER, scorer, scorer.score, request, endpoints)
            weight = weighted.weight
            for address, score in scores.items():
                # Clamp to [0, 1]; NaN fails `> 0` and counts as 0.  Addresses that are not
                # candidates are ignored, candidates a scorer left out score 0.
                if score > 0.0 and address in totals:
                    totals[address] += weight * (1.0 if score > 1.0 else score)

        scored = [ScoredEndpoint(e, totals[e.address]) for e in endpoints]
        picker = self.picker
        targets = _timed(on_duration, PICKER, picker, picker.pick, request, scored)
        if not targets:
            raise SchedulingError(
                f"picker {picker.name!r} ({plugin_type(picker)}) in scheduling profile "
                f"{self.name!r} returned no endpoint out of {len(scored)}"
            )
        return ProfileResult(targets=tuple(targets), scores=totals)


def _timed(
    on_duration: PluginDurationHook | None,
    extension_point: str,
    plugin: _Named,
    method: Callable[[LLMRequest, _ArgT], _ResultT],
    request: LLMRequest,
    argument: _ArgT,
) -> _ResultT:
    """``method(request, argument)`` of ``plugin``, its duration reported to ``on_duration``."""
    start = perf_counter()
    result = method(request, argument)
    if on_duration is not None:
        on_duration(extension_point, plugin_type(plugin), plugin.name, perf_counter() - start)
    return result


class Scheduler:
    """Runs the profiles of one configuration for each request; see the module docstring.

    ``plugins`` is every configured plugin instance (the profile handler and the plugins used in
    profiles are added if missing); the role lists below are derived from it for the server to
    wire: ``response_complete_plugins`` to the response path, ``endpoint_listeners`` to the
    datastore, ``lifecycle_plugins`` to server start and stop.

    ``prepare_timeout`` bounds the data producers (the Inference Extension uses 400 ms): on
    expiry scheduling continues with whatever they produced.  A producer that raises is logged
    and skipped, unless it raises a `SchedulingError`, which fails the request with its status.
    """

    # The server registers the scheduler with the datastore as one EndpointListener that fans
    # out to the plugins; the protocol wants a name for its log lines.
    name = "scheduler"

    def __init__(
        self,
        profiles: Sequence[SchedulerProfile],
        profile_handler: ProfileHandler,
        plugins: Iterable[object] = (),
        *,
        on_plugin_duration: PluginDurationHook | None = None,
        prepare_timeout: float | None = None,
    ) -> None:
        if not profiles:
            raise ValueError("a scheduler needs at least one scheduling profile")
        self.profiles: Mapping[str, SchedulerProfile] = {p.name: p for p in profiles}
        if len(self.profiles) != len(profiles):
            raise ValueError("scheduling profile names must be unique")
        self.profile_names: tuple[str, ...] = tuple(self.profiles)
        self.profile_handler = profile_handler
        self.on_plugin_duration = on_plugin_duration
        self.prepare_timeout = prepare_timeout

        everything: dict[int, object] = {id(p): p for p in plugins}
        everything.setdefault(id(profile_handler), profile_handler)
        for profile in profiles:
            for plugin in (*profile.filters, *(w.scorer for w in profile.scorers), profile.picker):
                everything.setdefault(id(plugin), plugin)
        self.plugins: tuple[object, ...] = tuple(everything.values())
        self.request_header_plugins = tuple(
            p for p in self.plugins if isinstance(p, RequestHeaderProcessor)
        )
        self.screeners = tuple(p for p in self.plugins if isinstance(p, Screener))
        self.data_producers = tuple(p for p in self.plugins if isinstance(p, DataProducer))
        self.admitters = tuple(p for p in self.plugins if isinstance(p, Admitter))
        self.pre_request_plugins = tuple(p for p in self.plugins if isinstance(p, PreRequest))
        self.response_header_plugins = tuple(
            p for p in self.plugins if isinstance(p, ResponseHeaderProcessor)
        )
        self.response_complete_plugins = tuple(
            p for p in self.plugins if isinstance(p, ResponseComplete)
        )
        self.endpoint_listeners = tuple(p for p in self.plugins if isinstance(p, EndpointListener))
        self.lifecycle_plugins = tuple(p for p in self.plugins if isinstance(p, Lifecycle))

    def plugin(self, name: str) -> object | None:
        """The configured plugin instance called ``name``, if any."""
        for plugin in self.plugins:
            if getattr(plugin, "name", None) == name:
                return plugin
        return None

    # -- the request path ----------------------------------------------------------------------

    async def schedule(
        self, request: LLMRequest, candidates: Sequence[Endpoint]
    ) -> SchedulingResult:
        """The whole decision: prepare, run profiles, run PreRequest plugins.

        Raises `NoReadyEndpointsError` (503) for an empty candidate list,
        `AllEndpointsFilteredError` (429) when a profile's filters leave nothing."""
        if not candidates:
            raise NoReadyEndpointsError(
                "no ready endpoint to serve the request (the pool, or the subset hint, is empty)"
            )
        candidates = self.run_screeners(request, candidates)
        await self.prepare(request, candidates)
        self.run_admission(request, candidates)
        result = self.run_profiles(request, candidates)
        self.run_pre_request(request, result)
        return result

    def run_request_header(self, request: LLMRequest) -> None:
        """Every RequestHeaderProcessor, in configuration order, before admission; one that
        raises a `SchedulingError` fails the request (as llm-d-router's director)."""
        for plugin in self.request_header_plugins:
            start = perf_counter()
            plugin.request_header(request)
            self._record(REQUEST_HEADER, plugin, perf_counter() - start)

    def run_screeners(self, request: LLMRequest, candidates: Sequence[Endpoint]) -> list[Endpoint]:
        """The candidates every Screener keeps.  Each sees all of them, as llm-d-router's
        director hands each its own copy and intersects the answers; none left is
        `ScreenedOutError` (503)."""
        kept = list(candidates)
        for screener in self.screeners:
            start = perf_counter()
            allowed = {id(ep) for ep in screener.screen(request, list(candidates))}
            self._record(SCREENER, screener, perf_counter() - start)
            kept = [ep for ep in kept if id(ep) in allowed]
        if not kept:
            raise ScreenedOutError("screeners eliminated all endpoint candidates")
        return kept

    async def prepare(self, request: LLMRequest, candidates: Sequence[Endpoint]) -> None:
        """Await every DataProducer, concurrently."""
        producers = self.data_producers
        if not producers:
            return
        work: Any
        if len(producers) == 1:
            work = self._produce(producers[0], request, candidates)
        else:
            work = asyncio.gather(*(self._produce(p, request, candidates) for p in producers))
        if self.prepare_timeout is None:
            await work
            return
        try:
            await asyncio.wait_for(work, self.prepare_timeout)
        except TimeoutError:
            logger.warning(
                "request %s: data producers did not finish within %.3f s; scheduling without "
                "their remaining data",
                request.request_id,
                self.prepare_timeout,
            )

    async def _produce(
        self, producer: DataProducer, request: LLMRequest, candidates: Sequence[Endpoint]
    ) -> None:
        start = perf_counter()
        try:
            await producer.prepare(request, candidates)
        except SchedulingError:
            raise
        except Exception:
            logger.exception(
                "request %s: data producer %r (%s) failed; scheduling continues without its data",
                request.request_id,
                producer.name,
                plugin_type(producer),
            )
        finally:
            self._record(DATA_PRODUCER, producer, perf_counter() - start)

    def run_admission(self, request: LLMRequest, candidates: Sequence[Endpoint]) -> None:
        """Every Admitter in configuration order; the first to refuse drops the request
        (`AdmissionDeniedError`, 429)."""
        for admitter in self.admitters:
            start = perf_counter()
            reason = admitter.admit(request, candidates)
            self._record(ADMISSION, admitter, perf_counter() - start)
            if reason is not None:
                raise AdmissionDeniedError(reason)

    def run_profiles(self, request: LLMRequest, candidates: Sequence[Endpoint]) -> SchedulingResult:
        """The synchronous core (no producers, no PreRequest): profile handler loop, then
        ``process_results``.  This is what the scheduling benchmark times."""
        if not candidates:
            raise NoReadyEndpointsError(
                "no ready endpoint to serve the request (the pool, or the subset hint, is empty)"
            )
        handler = self.profile_handler
        hook = self.on_plugin_duration
        # None: the profile's filters left no endpoint.  The handler decides what that means
        # (a P/D request's prefill stage falls back to its decode pod); when no profile found
        # one, the first such error is the answer.
        results: dict[str, ProfileResult | None] = {}
        drained: AllEndpointsFilteredError | None = None
        while True:
            start = perf_counter()
            chosen = handler.pick_profiles(request, self.profile_names, results)
            self._record(PROFILE_PICKER, handler, perf_counter() - start)
            if not chosen:
                break
            for name in chosen:
                profile = self.profiles.get(name)
                if profile is None:
                    raise SchedulingError(
                        f"profile handler {handler.name!r} chose unknown scheduling profile "
                        f"{name!r} (configured: {', '.join(self.profile_names)})"
                    )
                if name in results:
                    raise SchedulingError(
                        f"profile handler {handler.name!r} chose scheduling profile {name!r} "
                        "a second time"
                    )
                try:
                    results[name] = profile.run(request, candidates, hook)
                except AllEndpointsFilteredError as exc:
                    results[name] = None
                    drained = drained or exc
        if drained is not None and not any(results.values()):
            raise drained
        start = perf_counter()
        result = handler.process_results(request, results)
        self._record(PROCESS_PROFILES_RESULTS, handler, perf_counter() - start)
        return result

    def run_pre_request(self, request: LLMRequest, result: SchedulingResult) -> None:
        """Every PreRequest plugin, in configuration order.  A failing plugin is logged and
        does not stop the request: the decision is already made."""
        self._run_each(
            PRE_REQUEST,
            self.pre_request_plugins,
            request,
            lambda plugin: plugin.pre_request(request, result),
        )

    # -- the other extension points, for the server to call --------------------------------------

    def run_response_complete(
        self, request: LLMRequest, endpoint: str, usage: Usage | None
    ) -> None:
        """Every ResponseComplete plugin; failures are logged, never raised."""
        self._run_each(
            RESPONSE_COMPLETE,
            self.response_complete_plugins,
            request,
            lambda plugin: plugin.response_complete(request, endpoint, usage),
        )

    def run_response_header(self, request: LLMRequest, endpoint: Endpoint | None) -> None:
        """Every ResponseHeaderProcessor, when the model server's headers arrive; failures
        are logged, never raised."""
        self._run_each(
            RESPONSE_RECEIVED,
            self.response_header_plugins,
            request,
            lambda plugin: plugin.response_header(request, endpoint),
        )

    def endpoint_added(self, endpoint: Endpoint) -> None:
        self._tell_listeners(endpoint, lambda listener: listener.endpoint_added(endpoint))

    def endpoint_removed(self, endpoint: Endpoint) -> None:
        self._tell_listeners(endpoint, lambda listener: listener.endpoint_removed(endpoint))

    def _tell_listeners(self, endpoint: Endpoint, call: Callable[[EndpointListener], None]) -> None:
        """``call`` on every endpoint listener; one that fails is logged, the others still hear."""
        for listener in self.endpoint_listeners:
            try:
                call(listener)
            except Exception:
                logger.exception("endpoint listener %r failed on %s", listener.name, endpoint)

    async def start(self) -> None:
        """Start the plugins with background work, in configuration order."""
        for plugin in self.lifecycle_plugins:
            await plugin.start()

    async def stop(self) -> None:
        """Stop them in reverse order; every plugin gets its stop even if one fails."""
        for plugin in reversed(self.lifecycle_plugins):
            try:
                await plugin.stop()
            except Exception:
                logger.exception("plugin %r failed to stop", plugin.name)

    def _run_each(
        self,
        extension_point: str,
        plugins: Sequence[_NamedPluginT],
        request: LLMRequest,
        call: Callable[[_NamedPluginT], None],
    ) -> None:
        """``call`` on every plugin of an extension point that runs once the decision is made,
        in configuration order, timed: a plugin that fails is logged and the others still run,
        since the request no longer depends on them."""
        for plugin in plugins:
            start = perf_counter()
            try:
                call(plugin)
            except Exception:
                logger.exception(
                    "request %s: %s plugin %r (%s) failed",
                    request.request_id,
                    extension_point,
                    plugin.name,
                    plugin_type(plugin),
                )
            self._record(extension_point, plugin, perf_counter() - start)

    def _record(self, extension_point: str, plugin: Any, seconds: float) -> None:
        hook = self.on_plugin_duration
        if hook is not None:
            hook(extension_point, plugin_type(plugin), plugin.name, seconds)
