"""llm-d-router's flow control (``featureGates: [flowControl]``): requests wait in priority bands
and leave when the pool has room, instead of piling onto the model servers.

Every request with a body enters its band's queue (its InferenceObjective's priority; its flow
is its fairness id, ``x-llm-d-inference-fairness-id``, else ``default-flow``).  A dispatch cycle
runs on each arrival, on each release and every few milliseconds while anything waits:

1. requests whose TTL ran out leave; the pool's saturation comes from the saturation detector (``utilization-detector``), per
   stage: prefill pods (``llm-d.ai/role`` prefill / encode-prefill), decode pods (decode or no
   role) and pods that do both counted in both; the effective saturation is the larger;
2. the usage-limit policy gives each band a ceiling from the saturation and every band's
   priority (``static-usage-limit-policy``: the same ``threshold`` for all, default 1.0;
   ``soft-reflective-ceiling-policy`` and ``priority-holdback-policy``: lower bands close
   first);
3. bands are walked from the highest priority: the first whose ceiling the saturation reaches
   stops the cycle (head-of-line, lower bands wait too); else its fairness policy picks a flow
   (``global-strict-fairness-policy``: the first head across flows; ``round-robin-fairness-
   policy``: flows in turn; ``program-aware-fairness``: the flow whose program received the
   least service, `epp.program_aware_fairness`) and the flow's head is dispatched.  A flow
   keeps its requests in its band's order (``orderingPolicyRef``: ``fcfs-ordering-policy``,
   ``edf-ordering-policy``, ``slo-deadline-ordering-policy``; `epp.flow_ordering`).  One
   request leaves per cycle.

The policies are plugins (`epp.flow_policies`, `epp.flow_ordering`); the section is read by
`epp.flow_settings`; this module holds the queues and the controller.

A request leaves unscheduled when its band or the whole queue is full (429
``rejected-saturated``; 503 ``rejected-no-endpoints`` while the pool is empty), when it waited
``defaultRequestTTL`` (429 ``rejected-ttl-expired``) or ``noEndpointRequestTTL`` with no endpoint
(503 ``rejected-no-endpoints``), or when its client goes away.  The reason is in
``x-llm-d-request-dropped-reason``.

Bands exist from the start for priority 0 and every configured priority, as upstream's
registry provisions them.  Differences from upstream, by design: a band for a priority no band
is configured for is created from ``defaultPriorityBand`` (or ``defaultNegativePriorityBand``)
when its first request arrives, not only from the InferenceObjectives seen; and running requests
are never evicted (``enableEviction`` is refused).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time
from bisect import insort
from collections import OrderedDict, deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final, Literal

from epp.admission import PoolSaturatedError

# The `as` imports are re-exports (the names lived here before); importing the policies
# registers their plugin types, program-aware-fairness's included.
from epp.flow_policies import EDFOrdering as EDFOrdering
from epp.flow_policies import FairnessPolicy, OrderingPolicy, UsageLimitPolicy
from epp.flow_policies import FCFSOrdering as FCFSOrdering
from epp.flow_policies import GlobalStrictFairness as GlobalStrictFairness
from epp.flow_policies import RoundRobinFairness as RoundRobinFairness
from epp.flow_policies import SoftReflectiveCeiling as SoftReflectiveCeiling
from epp.flow_policies import StaticLimitParameters as StaticLimitParameters
from epp.flow_policies import StaticUsageLimit as StaticUsageLimit
from epp.flow_settings import DEFAULT_BAND_BYTES as DEFAULT_BAND_BYTES
from epp.flow_settings import DEFAULT_BAND_REQUESTS as DEFAULT_BAND_REQUESTS
from epp.flow_settings import DEFAULT_TTL_S as DEFAULT_TTL_S
from epp.flow_settings import BandSettings as BandSettings
from epp.flow_settings import FlowControlSettings as FlowControlSettings
from epp.flow_settings import duration as duration
from epp.flow_settings import flow_control_settings as flow_control_settings
from epp.flow_settings import quantity as quantity
from epp.llmd_metrics import DEFAULT_FAIRNESS_ID, fairness_id
from epp.program_aware_fairness import ProgramAwareFairness as ProgramAwareFairness
from scorers.base import (
    Endpoint,
    LLMRequest,
    NoEndpoints,
    NoReadyEndpointsError,
    PluginConfigError,
    PluginContext,
    create_plugin,
)
from scorers.filters import ROLE_LABEL

DROPPED_REASON_HEADER: Final = "x-llm-d-request-dropped-reason"
_TICK_S: Final = 0.005  # how often waiting requests re-read the pool's saturation

Outcome = Literal[
    "Dispatched",
    "RejectedCapacity",
    "RejectedNoEndpoints",
    "EvictedTTL",
    "EvictedNoEndpoints",
    "EvictedContextCancelled",
]


class FlowObserver:
    """What flow control reports; each hook does nothing here (`epp.telemetry.Telemetry`
    overrides them with llm-d-router's ``flow_control_*`` metrics)."""

    def flow_control_outcome(
        self, request: LLMRequest | None, outcome: str, priority: int, waited: float
    ) -> None:
        """A request left flow control (``waited`` seconds after it arrived)."""

    def flow_control_enqueue(
        self, request: LLMRequest | None, outcome: str, priority: int, seconds: float
    ) -> None:
        """A request was queued (outcome ``NotYetFinalized``) or refused at the door."""

    def flow_control_queue(self, request: LLMRequest | None, count: int, size: int) -> None:
        """A request started (+1, +bytes) or stopped (-1, -bytes) waiting."""

    def flow_control_cycle(self, seconds: float) -> None:
        """One dispatch cycle ran."""

    def flow_control_saturation(self, stages: Mapping[str, float]) -> None:
        """The pool's saturation per stage, as this cycle measured it."""

    def flow_control_capacity(
        self,
        bands: Mapping[int, tuple[float, float]],
        whole: tuple[float | None, float | None],
    ) -> None:
        """The share of each band's (priority → requests, bytes) and of the global capacity
        in use (None where no global limit is configured)."""


class FlowControlRejected(PoolSaturatedError):
    """429 with llm-d-router's dropped reason, under llm-d-router's header name."""

    dropped_reason_header = DROPPED_REASON_HEADER

    def __init__(self, message: str, reason: str, outcome: Outcome) -> None:
        super().__init__(message, reason)
        self.outcome = outcome


class FlowControlNoEndpoints(NoReadyEndpointsError):
    """503 ``rejected-no-endpoints``: the pool had no endpoint while the request waited."""

    def __init__(self, message: str, outcome: Outcome) -> None:
        super().__init__(message)
        self.dropped_reason = "rejected-no-endpoints"
        self.outcome = outcome

    @property
    def response_headers(self) -> tuple[tuple[str, str], ...]:
        return ((DROPPED_REASON_HEADER, self.dropped_reason),)


# ---------------------------------------------------------------------------------------------
# Queues


@dataclass(slots=True, eq=False)
class Item:
    seq: int
    size: int
    enqueued_at: float  # the controller's clock
    done: asyncio.Future[Outcome]
    request: LLMRequest | None = None  # for policies that follow it past dispatch
    order: tuple[float, float, int] = (0.0, 0.0, 0)  # its band's ordering key, then `seq`


@dataclass(slots=True)
class Flow:
    name: str
    items: deque[Item] = field(default_factory=deque)


@dataclass(slots=True)
class Band:
    priority: int
    settings: BandSettings
    flows: OrderedDict[str, Flow] = field(default_factory=OrderedDict)
    waiting: int = 0
    bytes: int = 0
    last_flow: str | None = None


def stage_saturation(
    endpoints: Sequence[Endpoint], saturation: Callable[[Sequence[Endpoint]], float]
) -> dict[str, float]:
    """Saturation per stage, as upstream's processor splits the pool by role."""
    prefill, decode = [], []
    for ep in endpoints:
        role = ep.labels.get(ROLE_LABEL)
        if role in ("prefill", "encode-prefill"):
            prefill.append(ep)
        elif role is None or role in ("", "decode"):
            decode.append(ep)
        elif role in ("prefill-decode", "both", "encode-prefill-decode"):
            prefill.append(ep)
            decode.append(ep)
    out = {}
    if prefill:
        out["prefill"] = saturation(prefill)
    if decode:
        out["decode"] = saturation(decode)
    out["effective"] = max(out.values()) if out else saturation(endpoints)
    return out


class FlowController:
    """The admission of `epp.director.Director` when the ``flowControl`` gate is on."""

    def __init__(
        self,
        settings: FlowControlSettings,
        saturation: Callable[[Sequence[Endpoint]], float],
        usage_limit: UsageLimitPolicy,
        fairness: Mapping[str, FairnessPolicy],
        pool: Callable[[], list[Endpoint]],
        *,
        ordering: Mapping[str, OrderingPolicy] | None = None,
        clock: Callable[[], float] = time.monotonic,
        observer: FlowObserver | None = None,
    ) -> None:
        self.settings = settings
        self._saturation = saturation
        self._limit = usage_limit
        self._fairness = fairness
        # By name; a band whose policy is missing here keeps arrival order.
        self._ordering = dict(ordering or {})
        self._pool = pool
        self._clock = clock
        self._observer = observer if observer is not None else FlowObserver()
        self._bands: dict[int, Band] = {}
        self._seq = itertools.count()
        self._waiting = 0
        self._bytes = 0
        self._ticker: asyncio.Task[None] | None = None
        for priority in sorted({0, *settings.bands}):
            self._band(priority)

    # -- the director's interface (as `epp.admission.AdmissionController`) ---------------------

    async def admit(
        self,
        candidates: Callable[[], list[Endpoint]],
        *,
        sheddable: bool = False,
        request: LLMRequest | None = None,
    ) -> list[Endpoint]:
        """Wait in the request's band until dispatched; the candidates then.  Raises
        `FlowControlRejected` (429) or `FlowControlNoEndpoints` (503) with the reason."""
        priority = request.priority if request is not None else 0
        flow = fairness_id(request) if request is not None else DEFAULT_FAIRNESS_ID
        size = request.body_bytes if request is not None else 0
        band = self._band(priority)
        start = self._clock()
        observer = self._observer
        if not self._has_room(band, size):
            empty = not self._pool()
            outcome: Outcome = "RejectedNoEndpoints" if empty else "RejectedCapacity"
            observer.flow_control_enqueue(request, outcome, priority, self._clock() - start)
            observer.flow_control_outcome(request, outcome, priority, 0.0)
            if empty:
                raise FlowControlNoEndpoints(
                    "no endpoint to serve the request and its queue is full", outcome
                )
            raise FlowControlRejected(
                f"flow control: priority band {priority} is at capacity; retry later",
                "rejected-saturated",
                outcome,
            )
        done: asyncio.Future[Outcome] = asyncio.get_running_loop().create_future()
        item = Item(next(self._seq), size, start, done, request)
        policy = self._ordering.get(band.settings.ordering)
        key = policy.order_key(item, self.settings.ttl) if policy is not None else (start, 0.0)
        item.order = (*key, item.seq)
        observer.flow_control_queue(request, 1, size)
        queue = band.flows.setdefault(flow, Flow(flow)).items
        if queue and queue[-1].order > item.order:
            insort(queue, item, key=lambda i: i.order)  # an earlier deadline than the tail's
        else:
            queue.append(item)
        band.waiting += 1
        band.bytes += size
        self._waiting += 1
        self._bytes += size
        observer.flow_control_enqueue(request, "NotYetFinalized", priority, self._clock() - start)
        try:
            self._dispatch()
            self._ensure_ticker()
            outcome = await item.done
        except asyncio.CancelledError:
            observer.flow_control_outcome(
                request, "EvictedContextCancelled", priority, self._clock() - start
            )
            raise
        finally:
            if not item.done.done():
                item.done.cancel()
            self._remove(band, flow, item)
            observer.flow_control_queue(request, -1, -size)
        observer.flow_control_outcome(request, outcome, priority, self._clock() - start)
        if outcome == "Dispatched":
            return candidates()
        if outcome == "EvictedNoEndpoints":
            raise FlowControlNoEndpoints(
                f"no endpoint appeared within {self.settings.no_endpoint_ttl:g} s", outcome
            )
        raise FlowControlRejected(
            f"flow control: the pool stayed saturated for {self.settings.ttl:g} s; retry later",
            "rejected-ttl-expired",
            outcome,
        )

    def scheduled(self) -> None:
        """The dispatched request was scheduled: its load now shows in the pool."""
        self._dispatch()

    def release(self) -> None:
        """A routed request finished: there may be room now."""
        self._dispatch()

    @property
    def queued(self) -> int:
        return self._waiting

    # -- internals ----------------------------------------------------------------------------

    def _band(self, priority: int) -> Band:
        band = self._bands.get(priority)
        if band is None:
            band = self._bands[priority] = Band(priority, self.settings.band(priority))
        return band

    def _has_room(self, band: Band, size: int) -> bool:
        s = self.settings
        if s.max_requests and self._waiting + 1 > s.max_requests:
            return False
        if s.max_bytes and self._bytes + size > s.max_bytes:
            return False
        return (
            band.waiting + 1 <= band.settings.max_requests
            and band.bytes + size <= band.settings.max_bytes
        )

    def _remove(self, band: Band, flow: str, item: Item) -> None:
        queue = band.flows.get(flow)
        if queue is None or item not in queue.items:
            return
        queue.items.remove(item)
        self._forget(band, item)

    def _forget(self, band: Band, item: Item) -> None:
        """The counts, once ``item`` left its band's queue."""
        band.waiting -= 1
        band.bytes -= item.size
        self._waiting -= 1
        self._bytes -= item.size

    def _dispatch(self) -> None:
        """One dispatch cycle (module docstring): at most one request leaves per cycle, as
        upstream, so the pool's measured load can catch up between dispatches."""
        if not self._waiting:
            return
        started = time.perf_counter()
        try:
            self._cycle()
        finally:
            self._observer.flow_control_cycle(time.perf_counter() - started)

    def _cycle(self) -> None:
        pool = self._pool()
        now = self._clock()
        self._expire(now, empty=not pool)
        if not pool:
            return
        stages = stage_saturation(pool, self._saturation)
        s = self.settings
        self._observer.flow_control_saturation(stages)
        self._observer.flow_control_capacity(
            {
                b.priority: (b.waiting / b.settings.max_requests, b.bytes / b.settings.max_bytes)
                for b in self._bands.values()
            },
            (
                self._waiting / s.max_requests if s.max_requests else None,
                self._bytes / s.max_bytes if s.max_bytes else None,
            ),
        )
        saturation = stages["effective"]
        bands = sorted(self._bands.values(), key=lambda b: -b.priority)
        ceilings = self._limit.ceilings(saturation, [b.priority for b in bands])
        for band, ceiling in zip(bands, ceilings, strict=True):
            if saturation >= ceiling:
                return  # head-of-line: lower bands wait too
            if not band.waiting:
                continue
            policy = self._fairness.get(band.settings.fairness)
            flow = policy.pick_flow(band, now) if policy is not None else None
            if flow is None:
                continue
            item = flow.items.popleft()
            self._forget(band, item)
            if not item.done.done():
                item.done.set_result("Dispatched")
            return

    def _expire(self, now: float, *, empty: bool) -> None:
        ttl = self.settings.no_endpoint_ttl if empty else self.settings.ttl
        if ttl <= 0:
            return
        outcome: Outcome = "EvictedNoEndpoints" if empty else "EvictedTTL"
        for band in self._bands.values():
            policy = self._ordering.get(band.settings.ordering)
            in_arrival_order = policy is None or policy.arrival_ordered
            for flow in band.flows.values():
                for item in flow.items:
                    if now - item.enqueued_at < ttl:
                        if in_arrival_order:
                            break  # the expired requests lead the flow
                        continue
                    if not item.done.done():
                        item.done.set_result(outcome)

    def _ensure_ticker(self) -> None:
        if self._ticker is None or self._ticker.done():
            self._ticker = asyncio.get_running_loop().create_task(self._tick(), name="flow-ctl")

    async def _tick(self) -> None:
        """While requests wait: metrics change without a release (scrapes), TTLs run out."""
        while self._waiting:
            await asyncio.sleep(_TICK_S)
            self._dispatch()

    async def stop(self) -> None:
        if self._ticker is not None:
            self._ticker.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._ticker


def build_flow_controller(
    settings: FlowControlSettings,
    plugins: Mapping[str, object],
    saturation: Callable[[Sequence[Endpoint]], float],
    pool: Callable[[], list[Endpoint]],
    **kwargs: Any,
) -> FlowController:
    """The controller with the configured policy instances (``plugins``: name → instance; the
    default policies are made when not declared, as upstream injects them)."""
    context = PluginContext(endpoints=NoEndpoints())

    def instance(name: str) -> object:
        found = plugins.get(name)
        if found is None:
            found = create_plugin(name, name, None, context)
        return found

    limit = instance(settings.usage_limit_policy)
    if not isinstance(limit, UsageLimitPolicy):
        raise PluginConfigError(f"{settings.usage_limit_policy!r} is not a usage limit policy")
    fairness: dict[str, FairnessPolicy] = {}
    ordering: dict[str, OrderingPolicy] = {}
    bands = [settings.default_band, *settings.bands.values()]
    if settings.negative_band is not None:
        bands.append(settings.negative_band)
    for band in bands:
        policy = instance(band.fairness)
        if not isinstance(policy, FairnessPolicy):
            raise PluginConfigError(f"{band.fairness!r} is not a fairness policy")
        fairness[band.fairness] = policy
        order = instance(band.ordering)
        if not isinstance(order, OrderingPolicy):
            raise PluginConfigError(f"{band.ordering!r} is not an ordering policy")
        ordering[band.ordering] = order
    return FlowController(settings, saturation, limit, fairness, pool, ordering=ordering, **kwargs)
