"""The ordering policies of flow control (`epp.flow_control`): which waiting request of a flow
leaves first, as llm-d-router's ``pkg/epp/framework/plugins/flowcontrol/ordering/``.

A policy gives each request an order key when it is queued and the flow keeps its requests
sorted by that key (equal keys: arrival order), so a flow's head is the request its policy sends
next, and ``global-strict-fairness-policy`` compares the heads of a band's flows by the same
keys.  Upstream keeps each flow in a heap ordered by the policy's ``Less``; a key that never
changes while the request waits makes a sorted queue the same order.  One band has one policy,
so the keys a band compares are of one kind.

* ``fcfs-ordering-policy`` (the default): arrival in flow control.
* ``edf-ordering-policy``: arrival + the request's TTL (``defaultRequestTTL``; ``0s``, no
  expiry: after every request that has one), then arrival.  No per-request deadline reaches
  flow control here or upstream (``InitialEffectiveTTL`` is always 0 there), so every request
  has the same TTL and EDF orders as FCFS does.
* ``slo-deadline-ordering-policy``: when the EPP received the request (its headers) + its
  time-to-first-token SLO, ``x-llm-d-slo-ttft-ms`` (else the deprecated ``x-slo-ttft-ms``) in
  whole milliseconds; then the receive time.  A value that is empty, not a base-10 integer,
  negative, or more milliseconds than Go's ``time.Duration`` holds puts the request behind
  every request with a valid SLO, as upstream.

Each takes no parameters (upstream's factories ignore theirs; here unknown keys are refused, as
for every plugin).
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from typing import TYPE_CHECKING, ClassVar, Final, Protocol, runtime_checkable

from scorers.base import NoParameters, Plugin, register

if TYPE_CHECKING:
    from epp.flow_control import Item

OrderKey = tuple[float, float]

TTFT_SLO_HEADERS: Final = ("x-llm-d-slo-ttft-ms", "x-slo-ttft-ms")
# Upstream converts the SLO to a time.Duration (int64 nanoseconds): a larger value would wrap.
MAX_SLO_MS: Final = (2**63 - 1) // 1_000_000
_BASE10: Final = re.compile(r"[+-]?[0-9]+")  # what Go's strconv.ParseInt(s, 10, 64) reads


@runtime_checkable
class OrderingPolicy(Protocol):
    """Orders the requests of a flow: smaller keys leave first."""

    name: str
    # True when keys grow with arrival: a flow's longest-waiting requests are then at its head,
    # where the controller looks for expired ones.
    arrival_ordered: bool

    def order_key(self, item: Item, ttl: float) -> OrderKey:
        """``item``'s key; ``ttl`` is the controller's request TTL in seconds (0: none)."""
        ...


@register("fcfs-ordering-policy")
class FCFSOrdering(Plugin[NoParameters]):
    """Oldest first within a flow (upstream's default)."""

    arrival_ordered: ClassVar[bool] = True

    def order_key(self, item: Item, ttl: float) -> OrderKey:
        return (item.enqueued_at, 0.0)


@register("edf-ordering-policy")
class EDFOrdering(Plugin[NoParameters]):
    """Earliest deadline (arrival + TTL) first; with one TTL for all, that is FCFS."""

    arrival_ordered: ClassVar[bool] = True

    def order_key(self, item: Item, ttl: float) -> OrderKey:
        deadline = item.enqueued_at + ttl if ttl > 0 else math.inf
        return (deadline, item.enqueued_at)


def slo_ttft_ms(headers: Mapping[str, str]) -> int | None:
    """The request's TTFT SLO in milliseconds, or None when it has no valid one.  The current
    header is read when present, even empty (upstream stops at the first alias present)."""
    for name in TTFT_SLO_HEADERS:
        if name in headers:
            text = headers[name].strip()
            break
    else:
        return None
    if not _BASE10.fullmatch(text):
        return None
    ms = int(text)
    return ms if 0 <= ms <= MAX_SLO_MS else None


@register("slo-deadline-ordering-policy")
class SLODeadlineOrdering(Plugin[NoParameters]):
    """Earliest SLO deadline (receive time + TTFT SLO) first; see the module docstring."""

    arrival_ordered: ClassVar[bool] = False

    def order_key(self, item: Item, ttl: float) -> OrderKey:
        request = item.request
        if request is None:
            return (math.inf, math.inf)
        # A request built outside an ext_proc stream has no receive time: its arrival in flow
        # control stands for it (both are time.monotonic() in the server).
        received = request.received_at if request.received_at is not None else item.enqueued_at
        ms = slo_ttft_ms(request.headers)
        # In milliseconds, the SLO's unit: whole-millisecond SLOs on equal deadlines compare
        # equal (then the earlier receive time goes first, as upstream).
        deadline_ms = received * 1000 + ms if ms is not None else math.inf
        return (deadline_ms, received)


ORDERING_TYPES: Final = (
    "fcfs-ordering-policy",
    "edf-ordering-policy",
    "slo-deadline-ordering-policy",
)
