"""The policy plugins of flow control (`epp.flow_control`): declared in ``plugins`` and named from
the ``flowControl`` section, as llm-d-router's ``pkg/epp/framework/plugins/flowcontrol/``.

* fairness policies choose which flow of a band sends its next request (``pick_flow``, the
  `FairnessPolicy` protocol): ``global-strict-fairness-policy`` (the default),
  ``round-robin-fairness-policy`` and ``program-aware-fairness`` (its own module,
  `epp.program_aware_fairness`, because it also learns from every request's dispatch and
  response);
* ordering policies choose the request within a flow: FCFS, which EDF equals here;
* usage-limit policies give each band the saturation ceiling above which it stops dispatching.

The controller owns the queues; a policy only reads them and returns its choice.
"""

from __future__ import annotations

import itertools
from typing import TYPE_CHECKING, Any, ClassVar, Final, Protocol, runtime_checkable

from pydantic import BaseModel, ConfigDict, Field

from scorers.base import NoParameters, Plugin, register

if TYPE_CHECKING:
    from epp.flow_control import Band, Flow


@runtime_checkable
class FairnessPolicy(Protocol):
    """Chooses the flow whose oldest request leaves next, among a band's flows with requests
    waiting.  ``now`` is on the controller's clock, the one `epp.flow_control.Item.enqueued_at`
    is on."""

    name: str

    def pick_flow(self, band: Band, now: float) -> Flow | None: ...


@register("global-strict-fairness-policy")
class GlobalStrictFairness(Plugin[NoParameters]):
    """The band's oldest waiting request, whatever its flow (upstream's default)."""

    def pick_flow(self, band: Band, now: float) -> Flow | None:
        heads = [f for f in band.flows.values() if f.items]
        return min(heads, key=lambda f: f.items[0].seq, default=None)


@register("round-robin-fairness-policy")
class RoundRobinFairness(Plugin[NoParameters]):
    """Each flow with waiting requests in turn, one request per turn (flows in id order)."""

    def pick_flow(self, band: Band, now: float) -> Flow | None:
        names = sorted(band.flows)
        if not names:
            return None
        last = band.last_flow
        start = names.index(last) + 1 if last is not None and last in band.flows else 0
        for name in itertools.chain(names[start:], names[:start]):
            if band.flows[name].items:
                band.last_flow = name
                return band.flows[name]
        return None


@register("fcfs-ordering-policy")
class FCFSOrdering(Plugin[NoParameters]):
    """Oldest first within a flow (upstream's default)."""


@register("edf-ordering-policy")
class EDFOrdering(Plugin[NoParameters]):
    """Earliest deadline first; every request has the same TTL, so it is FCFS (as upstream)."""


class StaticLimitParameters(BaseModel):
    model_config = ConfigDict(extra="forbid")

    threshold: float = Field(
        default=1.0, gt=0.0, le=1.0, description="Every band's ceiling (default 1.0)."
    )


@register("static-usage-limit-policy")
class StaticUsageLimit(Plugin[StaticLimitParameters]):
    """The same ceiling for every band."""

    def ceilings(self, saturation: float, bands: int) -> list[float]:
        return [self.p.threshold] * bands


@register("soft-reflective-ceiling-policy")
class SoftReflectiveCeiling(Plugin[NoParameters]):
    """Band i of N (0 the highest) closes once saturation reaches ``1 - i·s/(N-1)``; between
    half and full saturation lower bands open one cycle in ``round(s/(1-s))`` (upstream's)."""

    experimental: ClassVar[bool] = True

    def __init__(self, name: str, params: BaseModel, context: Any) -> None:
        super().__init__(name, params, context)
        self._tick = 0

    def ceilings(self, saturation: float, bands: int) -> list[float]:
        if bands <= 1:
            return [1.0] * bands
        s = saturation
        is_open = True
        if 1 - s <= s < 1:
            period = max(1, round(s / (1 - s + 1e-9)))
            self._tick += 1
            is_open = self._tick % period == 0
        out = [1.0]
        for i in range(1, bands):
            reflective = 1 - i * s / (bands - 1)
            if s < reflective:
                out.append(1.0)
            elif s >= 1:
                out.append(0.0)
            else:
                out.append(1.0 if is_open else 0.0)
        return out


FAIRNESS_TYPES: Final = (
    "global-strict-fairness-policy",
    "round-robin-fairness-policy",
    "program-aware-fairness",
)
# Policies a band may name without declaring them (upstream's loader injects the defaults; the
# round-robin one needs no state beyond the band).  ``program-aware-fairness`` must be declared:
# only a declared instance runs on the request and response path it learns from.
UNDECLARED_OK: Final = (
    "global-strict-fairness-policy",
    "round-robin-fairness-policy",
    "fcfs-ordering-policy",
    "edf-ordering-policy",
    "static-usage-limit-policy",
)
ORDERING_TYPES: Final = ("fcfs-ordering-policy", "edf-ordering-policy")
USAGE_LIMIT_TYPES: Final = ("static-usage-limit-policy", "soft-reflective-ceiling-policy")
