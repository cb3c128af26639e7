"""The director: what happens to one request between the ext_proc stream and the scheduler.

It implements `epp.extproc.Router`: run the request-header plugins (``agent-identity``), pick
the candidates (ready endpoints, narrowed by the proxy's subset hint, without those the scraper
found unreachable unless that leaves none: see `epp.datastore`), pass them through admission
control (`epp.admission`: off by default), run the scheduler, start the in-flight accounting
the load-aware plugins read, and record the request's metrics; on the response side, run the
response-header plugins, release the accounting exactly once and hand the usage to the plugins
that learn from it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from epp.admission import Admission, AdmissionController
from epp.datastore import Datastore, InFlightRequest
from epp.extproc import RoutingDecision
from epp.request_rules import RequestRules
from epp.requests import rewrite_model
from epp.scheduler import Scheduler
from epp.telemetry import Telemetry
from scorers.base import Endpoint, LLMRequest, NoReadyEndpointsError, SchedulingError, Usage
from scorers.request_data import (
    PREFIX_MATCHED_BLOCKS,
    PREFIX_MATCHED_TOKENS,
    PREFIX_TOTAL_BLOCKS,
    RESPONSE_TIMING,
    ResponseTiming,
)

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class TrackedDecision(RoutingDecision):
    """A routing decision plus the state its response path needs."""

    in_flight: InFlightRequest | None = None
    # The other pods computing the request (a P/D request's prefill pod): their work ends
    # when the decode pod's first byte arrives.
    helpers: tuple[InFlightRequest, ...] = ()
    decided_at: float = 0.0
    status: int = 0
    first_byte_seen: bool = False
    candidates: int = field(default=0)


def filter_by_subset(
    endpoints: Sequence[Endpoint], subset: frozenset[str] | None
) -> list[Endpoint]:
    """Candidates allowed by the proxy's subset hint (matched by IP, as the Inference Extension
    does); no hint means every ready endpoint."""
    if subset is None:
        return list(endpoints)
    return [ep for ep in endpoints if ep.ip in subset]


def uncached_prompt_tokens(request: LLMRequest, address: str) -> int:
    """Prefill work this request adds to ``address``: its prompt minus what that endpoint is
    believed to hold (exact tokens from the precise scorer when it ran)."""
    total = request.prompt_tokens
    matched_tokens: dict[str, int] | None = request.data.get(PREFIX_MATCHED_TOKENS)
    if matched_tokens is not None:
        return max(0, total - matched_tokens.get(address, 0))
    return total


class Director:
    """`epp.extproc.Router` over a datastore and a scheduler."""

    def __init__(
        self,
        datastore: Datastore,
        scheduler: Scheduler,
        telemetry: Telemetry | None = None,
        admission: Admission | None = None,
        rules: RequestRules | None = None,
    ) -> None:
        self.datastore = datastore
        self.scheduler = scheduler
        self.telemetry = telemetry
        self.admission: Admission = admission or AdmissionController()
        self.rules = rules  # InferenceModelRewrites and InferenceObjectives (with a pool)
        # time.monotonic() of the last request routed or refused; the server's drain reads it.
        self.last_request_at: float | None = None

    # -- request path -------------------------------------------------------------------------

    def candidates(self, subset: frozenset[str] | None) -> list[Endpoint]:
        """Ready endpoints allowed by the subset hint, without unreachable ones (fail-open)."""
        return self.datastore.routable(filter_by_subset(self.datastore.endpoints(), subset))

    async def route(self, request: LLMRequest, subset: frozenset[str] | None) -> RoutingDecision:
        self.last_request_at = time.monotonic()
        if self.rules is not None:
            self._apply_rules(request, self.rules)
        # Before admission: what they find (the agent session) can decide the request's flow.
        self.scheduler.run_request_header(request)
        admission = self.admission
        try:
            candidates = await admission.admit(
                lambda: self.candidates(subset), sheddable=request.priority < 0, request=request
            )
        except SchedulingError:
            self._count_attempt("failure")
            raise
        started = time.perf_counter()
        try:
            result = await self.scheduler.schedule(request, candidates)
        except SchedulingError:
            self._count_attempt("failure")
            raise
        finally:
            admission.scheduled()
            if self.telemetry is not None:
                self.telemetry.scheduled(time.perf_counter() - started)
        self._count_attempt("success")
        targets = tuple(ep.address for ep in result.targets)
        if not targets:
            raise NoReadyEndpointsError("the picker chose no endpoint")
        primary = targets[0]
        prefill = result.prefill_address
        helpers = (prefill,) if prefill is not None else ()
        self._observe_hit_ratio(request, primary)
        if logger.isEnabledFor(logging.DEBUG):
            # One line per decision at --log-level debug: enough to replay a burst's order,
            # picks and the prefix each candidate was believed to hold.
            logger.debug(
                "request %s -> %s: %d prompt tokens, cached tokens by endpoint %s, "
                "%d candidates, decided in %.1f ms",
                request.request_id,
                primary,
                request.prompt_tokens,
                request.data.get(PREFIX_MATCHED_TOKENS) or {},
                len(candidates),
                1000 * (time.perf_counter() - started),
            )
        return self._track(request, targets, len(candidates), helpers, result.destinations)

    def _apply_rules(self, request: LLMRequest, rules: RequestRules) -> None:
        """The request's objective priority, and the model an InferenceModelRewrite sends it
        to (over a rewrite header, as upstream)."""
        request.priority = rules.priority(request.headers)
        if request.kind in ("other", "conversations"):
            return  # no model in the body to rewrite (passed through)
        chosen = rules.rewrite(request.client_model)
        if chosen is None:
            return
        name, target = chosen
        client = request.client_model
        # Counted only when the request really changed (a vLLM gRPC call names no model).
        if rewrite_model(request, target) and self.telemetry is not None:
            self.telemetry.model_rewritten(name, client, target)

    def route_without_body(
        self, request: LLMRequest, subset: frozenset[str] | None
    ) -> RoutingDecision:
        self.last_request_at = time.monotonic()
        candidates = self.candidates(subset)
        if not candidates:
            raise NoReadyEndpointsError(
                "no ready endpoint to serve the request (the pool, or the subset hint, is empty)"
            )
        # Least loaded by what the EPP routed there and what the server reports queued.
        chosen = min(
            candidates,
            key=lambda ep: (ep.load.in_flight_requests + ep.metrics.waiting_requests, ep.address),
        )
        return self._track(request, (chosen.address,), len(candidates))

    def _track(
        self,
        request: LLMRequest,
        targets: tuple[str, ...],
        candidates: int,
        helpers: tuple[str, ...] = (),
        destinations: tuple[str, ...] | None = None,
    ) -> TrackedDecision:
        primary = targets[0]
        started = self.datastore.request_started
        # A pod that prefills for another computes the prompt; the decode pod then only
        # pulls the KV (its prefill work is the last token).
        in_flight = started(primary, 0 if helpers else uncached_prompt_tokens(request, primary))
        helping = tuple(started(a, uncached_prompt_tokens(request, a)) for a in helpers)
        request.data[RESPONSE_TIMING] = ResponseTiming(routed_at=self.datastore.clock())
        if self.telemetry is not None:
            self.telemetry.request_routed(request)
        return TrackedDecision(
            request=request,
            targets=targets,
            destinations=destinations,
            in_flight=in_flight,
            helpers=helping,
            decided_at=time.perf_counter(),
            candidates=candidates,
        )

    # -- response path ------------------------------------------------------------------------

    def response_headers(self, decision: RoutingDecision, status: int) -> None:
        if isinstance(decision, TrackedDecision):
            decision.status = status
        if decision.targets and self.scheduler.response_header_plugins:
            endpoint = self.datastore.get(decision.targets[0])
            self.scheduler.run_response_header(decision.request, endpoint)

    def response_chunk(self, decision: RoutingDecision) -> None:
        if not isinstance(decision, TrackedDecision):
            return
        if decision.targets:
            self.datastore.saw_alive(decision.targets[0])
        if decision.first_byte_seen:
            return
        decision.first_byte_seen = True
        timing: ResponseTiming | None = decision.request.data.get(RESPONSE_TIMING)
        if timing is not None:
            timing.first_byte_at = self.datastore.clock()
            if decision.targets:
                self.datastore.saw_first_byte(
                    decision.targets[0], timing.first_byte_at - timing.routed_at
                )
            if decision.in_flight is not None:
                timing.in_flight_areas_at_first_byte = decision.in_flight.in_flight_area()
        if decision.in_flight is not None:
            decision.in_flight.first_token()
        for helper in decision.helpers:
            helper.finish()
        if logger.isEnabledFor(logging.DEBUG):
            logger.debug(
                "request %s: first byte from %s %.1f ms after the decision",
                decision.request.request_id,
                decision.targets[0] if decision.targets else "-",
                1000 * (time.perf_counter() - decision.decided_at),
            )
        if self.telemetry is not None:
            self.telemetry.first_byte(decision.request, time.perf_counter() - decision.decided_at)

    def response_complete(
        self, decision: RoutingDecision, usage: Usage | None, status: int
    ) -> None:
        if isinstance(decision, TrackedDecision) and decision.in_flight is not None:
            self._close_timing(decision.request, decision.in_flight)
            decision.in_flight.finish()
            for helper in decision.helpers:
                helper.finish()
            self.admission.release()
        request = decision.request
        if self.telemetry is not None:
            seconds = (
                time.perf_counter() - decision.decided_at
                if isinstance(decision, TrackedDecision)
                else None
            )
            self.telemetry.request_finished(request, seconds, status, usage)
        if decision.targets:
            self.scheduler.run_response_complete(request, decision.targets[0], usage)

    def _close_timing(self, request: LLMRequest, in_flight: InFlightRequest) -> None:
        """The request's end on its timeline, and the mean batch its decode ran in."""
        timing: ResponseTiming | None = request.data.get(RESPONSE_TIMING)
        if timing is None or in_flight.finished:
            return
        now = self.datastore.clock()
        timing.finished_at = now
        first, areas = timing.first_byte_at, timing.in_flight_areas_at_first_byte
        if first is not None and areas is not None and now > first:
            own, pool = in_flight.in_flight_area()
            timing.running_while_decoding = (own - areas[0]) / (now - first)
            timing.pool_running_while_decoding = (pool - areas[1]) / (now - first)

    def request_failed(self, request: LLMRequest | None, status: int, reason: str) -> None:
        if self.telemetry is not None:
            self.telemetry.request_refused(request, status)
        logger.info(
            "request %s answered by the EPP with %d: %s",
            request.request_id if request is not None else "-",
            status,
            reason,
        )

    # -- metrics helpers ----------------------------------------------------------------------

    def _count_attempt(self, status: str) -> None:
        if self.telemetry is not None:
            self.telemetry.scheduler_attempts.labels(status).inc()

    def _observe_hit_ratio(self, request: LLMRequest, primary: str) -> None:
        if self.telemetry is None:
            return
        total = request.data.get(PREFIX_TOTAL_BLOCKS)
        matched: dict[str, int] | None = request.data.get(PREFIX_MATCHED_BLOCKS)
        if isinstance(total, int) and total > 0 and matched is not None:
            self.telemetry.decision_prefix_hit_ratio.observe(matched.get(primary, 0) / total)
