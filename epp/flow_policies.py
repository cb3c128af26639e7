"""The policy plugins of flow control (`epp.flow_control`): declared in ``plugins`` and named from
the ``flowControl`` section, as llm-d-router's ``pkg/epp/framework/plugins/flowcontrol/``.

* fairness policies choose which flow of a band sends its next request (``pick_flow``, the
  `FairnessPolicy` protocol): ``global-strict-fairness-policy`` (the default),
  ``round-robin-fairness-policy`` and ``program-aware-fairness`` (its own module,
  `epp.program_aware_fairness`, because it also learns from every request's dispatch and
  response);
* ordering policies choose the request within a flow (`epp.flow_ordering`):
  ``fcfs-ordering-policy`` (the default), ``edf-ordering-policy`` (FCFS while every request has
  the same TTL) and ``slo-deadline-ordering-policy`` (earliest TTFT-SLO deadline);
* usage-limit policies give each band the saturation ceiling at or above which it stops
  dispatching (``ceilings``, the `UsageLimitPolicy` protocol): ``static-usage-limit-policy``
  (the default), ``soft-reflective-ceiling-policy`` and ``priority-holdback-policy``.

The controller owns the queues; a policy only reads them and returns its choice.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, ClassVar, Final, Literal, Protocol, Self, runtime_checkable

from pydantic import BaseModel, ConfigDict, Field, model_validator

# The ordering policies, re-exported (FCFS and EDF lived here before); importing them registers
# their plugin types.
from epp.flow_ordering import ORDERING_TYPES as ORDERING_TYPES
from epp.flow_ordering import EDFOrdering as EDFOrdering
from epp.flow_ordering import FCFSOrdering as FCFSOrdering
from epp.flow_ordering import OrderingPolicy as OrderingPolicy
from epp.flow_ordering import SLODeadlineOrdering as SLODeadlineOrdering
from scorers.base import NoParameters, Plugin, register

if TYPE_CHECKING:
    from epp.flow_control import Band, Flow


@runtime_checkable
class FairnessPolicy(Protocol):
    """Chooses the flow whose head (its first request under the band's ordering policy) leaves
    next, among a band's flows with requests waiting.  ``now`` is on the controller's clock, the one `epp.flow_control.Item.enqueued_at`
    is on."""

    name: str

    def pick_flow(self, band: Band, now: float) -> Flow | None: ...


@register("global-strict-fairness-policy")
class GlobalStrictFairness(Plugin[NoParameters]):
    """The band's first request under its ordering policy, whatever its flow (upstream's
    default; with FCFS, the oldest)."""

    def pick_flow(self, band: Band, now: float) -> Flow | None:
        heads = [f for f in band.flows.values() if f.items]
        return min(heads, key=lambda f: f.items[0].order, default=None)


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


@runtime_checkable
class UsageLimitPolicy(Protocol):
    """Each band's saturation ceiling, once per dispatch cycle: ``priorities`` are every band's,
    highest first; the answer is one ceiling per priority, in that order."""

    name: str

    def ceilings(self, saturation: float, priorities: Sequence[int]) -> list[float]: ...


class StaticLimitParameters(BaseModel):
    model_config = ConfigDict(extra="forbid")

    threshold: float = Field(
        default=1.0, gt=0.0, le=1.0, description="Every band's ceiling (default 1.0)."
    )


@register("static-usage-limit-policy")
class StaticUsageLimit(Plugin[StaticLimitParameters]):
    """The same ceiling for every band."""

    def ceilings(self, saturation: float, priorities: Sequence[int]) -> list[float]:
        return [self.p.threshold] * len(priorities)


@register("soft-reflective-ceiling-policy")
class SoftReflectiveCeiling(Plugin[NoParameters]):
    """Band i of N (0 the highest) closes once saturation reaches ``1 - i·s/(N-1)``; between
    half and full saturation lower bands open one cycle in ``round(s/(1-s))`` (upstream's)."""

    experimental: ClassVar[bool] = True

    def __init__(self, name: str, params: BaseModel, context: Any) -> None:
        super().__init__(name, params, context)
        self._tick = 0

    def ceilings(self, saturation: float, priorities: Sequence[int]) -> list[float]:
        bands = len(priorities)
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


class PriorityHoldbackParameters(BaseModel):
    """Upstream's ``apiConfig``: defaults filled in, then every problem reported at once under
    upstream's prefix (its messages, joined by ``; ``)."""

    model_config = ConfigDict(extra="forbid")

    shape: str = Field(
        default="linear", description='How ceilings are spread: "linear" (the only one).'
    )
    domain: str = Field(
        default="rank",
        description='"rank": equal steps by rank; "value": in proportion to the priority values.',
    )
    minCeiling: float | None = Field(
        default=None,
        allow_inf_nan=False,
        description="The lowest priority's ceiling, in [0, 1); required (no default suits all).",
    )
    maxCeiling: float = Field(
        default=1.0, allow_inf_nan=False, description="The highest priority's ceiling, in (0, 1]."
    )

    @model_validator(mode="before")
    @classmethod
    def _null_is_unset(cls, data: Any) -> Any:
        # Upstream's fields are pointers: an explicit null is the default, as when left out.
        if isinstance(data, dict):
            return {k: v for k, v in data.items() if v is not None}
        return data

    @model_validator(mode="after")
    def _valid(self) -> Self:
        prefix = "invalid priority holdback policy configuration: "
        low, high = self.minCeiling, self.maxCeiling
        if low is None:
            raise ValueError(prefix + "minCeiling is required")
        problems = []
        if self.shape != "linear":
            problems.append(f'unsupported shape "{self.shape}", must be "linear"')
        if self.domain not in ("rank", "value"):
            problems.append(f'unsupported domain "{self.domain}", must be one of: "rank", "value"')
        if not 0.0 <= low < 1.0:
            problems.append(f"minCeiling must be in [0.0, 1.0), got {low:f}")
        if not 0.0 < high <= 1.0:
            problems.append(f"maxCeiling must be in (0.0, 1.0], got {high:f}")
        if low >= high:
            problems.append(
                f"minCeiling ({low:f}) must be strictly less than maxCeiling ({high:f})"
            )
        if problems:
            raise ValueError(prefix + "; ".join(problems))
        return self


@register("priority-holdback-policy")
class PriorityHoldback(Plugin[PriorityHoldbackParameters]):
    """Lower priorities stop dispatching at lower saturation: the highest band's ceiling is
    ``maxCeiling``, the lowest's ``minCeiling``; between them, by ``domain``, ``rank`` spaces
    the bands evenly (``cMax - i·(cMax - cMin)/(N - 1)``) and ``value`` places each by its
    priority (``cMin + (p - pMin)/(pMax - pMin)·(cMax - cMin)``; all ``cMax`` when every
    priority is the same).  One band gets ``maxCeiling``: no holdback without competition.
    Saturation itself does not enter; llm-d-router's ``priorityholdback``, Alpha there."""

    experimental: ClassVar[bool] = True

    def __init__(self, name: str, params: BaseModel, context: Any) -> None:
        super().__init__(name, params, context)
        assert self.p.minCeiling is not None  # the parameters' validator requires it
        self._low: float = self.p.minCeiling
        self._by: Literal["rank", "value"] = "value" if self.p.domain == "value" else "rank"

    def ceilings(self, saturation: float, priorities: Sequence[int]) -> list[float]:
        low, high = self._low, self.p.maxCeiling
        n = len(priorities)
        if n <= 1:
            return [high] * n
        spread = high - low
        if self._by == "rank":
            return [high - i * spread / (n - 1) for i in range(n)]
        p_min, p_max = priorities[-1], priorities[0]
        if p_max == p_min:
            return [high] * n
        return [low + (p - p_min) / (p_max - p_min) * spread for p in priorities]


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
    "slo-deadline-ordering-policy",
    "static-usage-limit-policy",
)
USAGE_LIMIT_TYPES: Final = (
    "static-usage-limit-policy",
    "soft-reflective-ceiling-policy",
    "priority-holdback-policy",
)
