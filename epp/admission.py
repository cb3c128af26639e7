"""Admission control: what the EPP does with a request when every endpoint is full.

Off by default (``max_in_flight_per_endpoint=None``): the EPP routes everything and the model
servers queue, as the Inference Extension does without flow control.  With a limit, an endpoint
is *full* when its load reaches it, where its load is the larger of

* the requests this EPP routed there that have not finished (immediate, so a burst sees its own
  earlier requests), and
* the running + waiting requests its ``/metrics`` reported (when fresh), which also counts the
  traffic of other EPP replicas.

Only endpoints below the limit are offered to the scheduler.  When none is, the request is

* ``reject`` mode: answered at once with 429 and ``x-epp-request-dropped-reason:
  rejected-saturated``; it costs the EPP the parse of its body, nothing more;
* ``queue`` mode: held in a FIFO queue of at most ``max_queued`` requests for at most
  ``max_queue_wait`` seconds, and routed as soon as an endpoint has room (429
  ``rejected-queue-full`` when the queue is full, 429 ``rejected-ttl-expired`` when the wait runs
  out).  A queued request holds its body in memory: the queue's memory is bounded by
  ``max_queued`` × the body size limit.

Requests admitted but not yet scheduled (tokenizing) reserve room, so a burst cannot overshoot
the pool's capacity while its decisions are being computed.  The reason values are llm-d's
(``x-llm-d-request-dropped-reason`` there); the header is named after this EPP.

Body-less requests (``GET /v1/models``) are cheap and are never queued or rejected.

A *sheddable* request (its InferenceObjective's priority is negative, `epp.request_rules`) is
never queued: with limits it is refused when every endpoint is full; without them it is refused
when the pool is saturated by llm-d-router's utilization-detector rule (the configured
``utilization-detector``'s, else `pool_saturated` with its defaults), with
429 ``rejected-saturated`` "system saturated, sheddable request dropped".
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import ClassVar, Final, Literal, Protocol

from scorers.base import AllEndpointsFilteredError, Endpoint, LLMRequest
from scorers.saturation import DEFAULT_KV_UTILIZATION, DEFAULT_QUEUE_DEPTH, utilization

DROPPED_REASON_HEADER: Final = "x-epp-request-dropped-reason"
REJECTED_SATURATED: Final = "rejected-saturated"
REJECTED_QUEUE_FULL: Final = "rejected-queue-full"
REJECTED_TTL_EXPIRED: Final = "rejected-ttl-expired"
# How often the head of the queue re-reads scraped load (which changes without a release).
_POLL_S: Final = 0.05

AdmissionMode = Literal["reject", "queue"]


class PoolSaturatedError(AllEndpointsFilteredError):
    """Every candidate endpoint is at its in-flight limit; answered with 429 and a reason."""

    http_status = 429
    dropped_reason_header: ClassVar[str] = DROPPED_REASON_HEADER

    def __init__(self, message: str, reason: str) -> None:
        super().__init__(message)
        self.dropped_reason = reason

    @property
    def response_headers(self) -> tuple[tuple[str, str], ...]:
        """Extra headers of the ImmediateResponse (read by ``epp.extproc``)."""
        return ((self.dropped_reason_header, self.dropped_reason),)


class Admission(Protocol):
    """What the director admits requests through: `AdmissionController` (per-endpoint limits,
    off by default) or, with the ``flowControl`` gate, `epp.flow_control.FlowController`."""

    async def admit(
        self,
        candidates: Callable[[], list[Endpoint]],
        *,
        sheddable: bool = False,
        request: LLMRequest | None = None,
    ) -> list[Endpoint]: ...

    def scheduled(self) -> None: ...

    def release(self) -> None: ...


@dataclass(slots=True, frozen=True)
class AdmissionSettings:
    """``--max-in-flight-per-endpoint``, ``--admission-mode``, ``--max-queued-requests``,
    ``--max-queue-wait``."""

    max_in_flight_per_endpoint: int | None = None
    mode: AdmissionMode = "reject"
    max_queued: int = 1000
    max_queue_wait: float = 5.0

    def __post_init__(self) -> None:
        limit = self.max_in_flight_per_endpoint
        if limit is not None and limit < 1:
            raise ValueError(f"max_in_flight_per_endpoint must be >= 1 (or None), got {limit}")
        if self.mode not in ("reject", "queue"):
            raise ValueError(f"admission mode must be 'reject' or 'queue', got {self.mode!r}")
        if self.max_queued < 1:
            raise ValueError(f"max_queued must be >= 1, got {self.max_queued}")
        if not self.max_queue_wait > 0:
            raise ValueError(f"max_queue_wait must be > 0 seconds, got {self.max_queue_wait}")

    @property
    def enabled(self) -> bool:
        return self.max_in_flight_per_endpoint is not None


def pool_saturated(candidates: Sequence[Endpoint]) -> bool:
    """Whether sheddable requests are dropped with admission limits off: llm-d-router's
    utilization-detector with its defaults, metrics stale by the datastore's
    ``--saturation-staleness`` (an empty pool counts as saturated, as upstream)."""
    load, _ = utilization(
        candidates,
        DEFAULT_QUEUE_DEPTH,
        DEFAULT_KV_UTILIZATION,
        None,
        is_stale=lambda ep: ep.metrics_stale,
    )
    return load >= 1.0


def endpoint_load(endpoint: Endpoint) -> int:
    """Requests on ``endpoint`` as admission counts them (module docstring)."""
    routed = endpoint.load.in_flight_requests
    if endpoint.metrics_stale:
        return routed
    reported = endpoint.metrics.running_requests + endpoint.metrics.waiting_requests
    return max(routed, reported)


class AdmissionController:
    """Decides, per request, which candidates may take it, or that it must wait or be shed.

    Use: ``candidates = await admit(get_candidates)`` before scheduling, then `scheduled` once
    the decision is made (or failed), and `release` whenever a routed request finishes.
    """

    def __init__(
        self,
        settings: AdmissionSettings | None = None,
        *,
        clock: Callable[[], float] = time.monotonic,
        saturation: Callable[[Sequence[Endpoint]], float] | None = None,
    ) -> None:
        self.settings = settings or AdmissionSettings()
        self._clock = clock
        # The configured saturation detector's measure (``utilization-detector``), else the
        # built-in rule with its defaults (`pool_saturated`).
        self._saturation = saturation
        self._queue: collections.deque[asyncio.Event] = collections.deque()
        self._reserved = 0  # admitted, not yet scheduled
        # Counters for telemetry (read them, do not write them).
        self.admitted_total = 0
        self.queued_total = 0
        self.rejected_total: dict[str, int] = {
            REJECTED_SATURATED: 0,
            REJECTED_QUEUE_FULL: 0,
            REJECTED_TTL_EXPIRED: 0,
        }

    @property
    def queued(self) -> int:
        """Requests waiting now."""
        return len(self._queue)

    def _open(self, candidates: Sequence[Endpoint]) -> list[Endpoint]:
        """Candidates with room, or [] when the pool's room is taken by reservations."""
        limit = self.settings.max_in_flight_per_endpoint
        assert limit is not None
        room = 0
        open_: list[Endpoint] = []
        for ep in candidates:
            free = limit - endpoint_load(ep)
            if free > 0:
                room += free
                open_.append(ep)
        return open_ if room > self._reserved else []

    def _saturated(self, candidates: Sequence[Endpoint]) -> bool:
        if self._saturation is None:
            return pool_saturated(candidates)
        return self._saturation(candidates) >= 1.0

    async def admit(
        self,
        candidates: Callable[[], list[Endpoint]],
        *,
        sheddable: bool = False,
        request: LLMRequest | None = None,
    ) -> list[Endpoint]:
        """The candidates this request may be scheduled on.  ``candidates`` is called again
        after each wait, since endpoints come and go.  A ``sheddable`` request (an
        InferenceObjective's negative priority) is refused rather than queued.  Raises
        `PoolSaturatedError`.  (``request`` is `Admission`'s: the flow controller's bands
        read it; these limits do not.)"""
        settings = self.settings
        if settings.max_in_flight_per_endpoint is None:
            current = candidates()
            if sheddable and self._saturated(current):
                return self._reject(
                    REJECTED_SATURATED, "system saturated, sheddable request dropped"
                )
            return current
        current = candidates()
        if not current:
            return self._admitted(current)  # no endpoint at all: the scheduler answers 503
        if not self._queue:
            open_ = self._open(current)
            if open_:
                return self._admitted(open_)
        if settings.mode == "reject" or sheddable:
            return self._reject(
                REJECTED_SATURATED,
                f"every endpoint is at its limit of {settings.max_in_flight_per_endpoint} "
                "requests in flight; retry later",
            )
        if len(self._queue) >= settings.max_queued:
            return self._reject(
                REJECTED_QUEUE_FULL,
                f"every endpoint is busy and {settings.max_queued} requests are already "
                "queued; retry later",
            )
        return await self._wait(candidates)

    async def _wait(self, candidates: Callable[[], list[Endpoint]]) -> list[Endpoint]:
        settings = self.settings
        deadline = self._clock() + settings.max_queue_wait
        me = asyncio.Event()
        self._queue.append(me)
        self.queued_total += 1
        try:
            while True:
                remaining = deadline - self._clock()
                if self._queue[0] is me:
                    current = candidates()
                    open_ = self._open(current)
                    if open_ or not current:
                        return self._admitted(open_ or current)
                    remaining = min(remaining, _POLL_S) if remaining > 0 else remaining
                if deadline - self._clock() <= 0:
                    return self._reject(
                        REJECTED_TTL_EXPIRED,
                        f"no endpoint had room within {settings.max_queue_wait:g} s; retry later",
                    )
                me.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(me.wait(), remaining)
        finally:
            self._queue.remove(me)
            if self._queue:
                self._queue[0].set()  # the next in line checks for room now

    def _admitted(self, open_: list[Endpoint]) -> list[Endpoint]:
        self._reserved += 1
        self.admitted_total += 1
        return open_

    def _reject(self, reason: str, message: str) -> list[Endpoint]:
        self.rejected_total[reason] += 1
        raise PoolSaturatedError(message, reason)

    def scheduled(self) -> None:
        """The admitted request was scheduled (its in-flight count now shows) or failed."""
        if self._reserved > 0:
            self._reserved -= 1
        self.release()

    def release(self) -> None:
        """Room may have opened (a request finished): wake the head of the queue."""
        if self._queue:
            self._queue[0].set()
