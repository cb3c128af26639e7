"""Pickers: turn the weighted scores of a profile into targets, primary first, then fallbacks
(Envoy tries them in order when retries are configured).  All randomness comes from
``PluginContext.rng`` so a seeded context replays the same decisions."""

from __future__ import annotations

import math
from collections.abc import Sequence

from pydantic import BaseModel, ConfigDict, Field

from scorers.base import Endpoint, LLMRequest, Plugin, PluginContext, ScoredEndpoint, register


class PickerParameters(BaseModel):
    model_config = ConfigDict(extra="forbid")

    maxNumOfEndpoints: int = Field(
        default=1,
        ge=1,
        le=16,
        description="Targets returned: the primary plus fallbacks (default 1).",
    )


class _Picker(Plugin[PickerParameters]):
    def __init__(self, name: str, params: BaseModel, context: PluginContext) -> None:
        super().__init__(name, params, context)
        self.max_endpoints = self.p.maxNumOfEndpoints


@register("max-score-picker")
class MaxScorePicker(_Picker):
    """The highest total scores, best first; equal scores are ordered at random (shuffle, then a
    stable sort), so ties do not always land on the first endpoint listed."""

    def pick(self, request: LLMRequest, scored: Sequence[ScoredEndpoint]) -> list[Endpoint]:
        ranked = list(scored)
        self.context.rng.shuffle(ranked)
        if self.max_endpoints == 1:
            return [max(ranked, key=_score).endpoint] if ranked else []
        ranked.sort(key=_score, reverse=True)
        return [s.endpoint for s in ranked[: self.max_endpoints]]


@register("random-picker")
class RandomPicker(_Picker):
    """Uniformly random targets, ignoring scores (a baseline, or a profile of filters only)."""

    def pick(self, request: LLMRequest, scored: Sequence[ScoredEndpoint]) -> list[Endpoint]:
        chosen = self.context.rng.sample(list(scored), min(self.max_endpoints, len(scored)))
        return [s.endpoint for s in chosen]


@register("round-robin-picker")
class RoundRobinPicker(_Picker):
    """Each candidate in turn (ordered by address), ignoring scores: the cache-blind policy a
    Kubernetes Service gives, kept as a baseline for benchmarks and the demo."""

    def __init__(self, name: str, params: BaseModel, context: PluginContext) -> None:
        super().__init__(name, params, context)
        self._next = 0

    def pick(self, request: LLMRequest, scored: Sequence[ScoredEndpoint]) -> list[Endpoint]:
        if not scored:
            return []
        ordered = sorted((s.endpoint for s in scored), key=lambda ep: ep.address)
        start = self._next % len(ordered)
        self._next += 1
        count = min(self.max_endpoints, len(ordered))
        return [ordered[(start + i) % len(ordered)] for i in range(count)]


@register("weighted-random-picker")
class WeightedRandomPicker(_Picker):
    """Random targets with probability proportional to score: weighted sampling without
    replacement by A-Res (Efraimidis & Spirakis), key = U^(1/w) with U uniform in (0, 1], the
    largest keys win.  Compared as log(U)/w, which orders the same and does not underflow.
    Endpoints scoring ≤ 0 come after all positive ones, in random order; all ≤ 0 → uniform."""

    def pick(self, request: LLMRequest, scored: Sequence[ScoredEndpoint]) -> list[Endpoint]:
        rng = self.context.rng
        keyed: list[tuple[float, Endpoint]] = []
        zero: list[Endpoint] = []
        for item in scored:
            if item.score > 0.0:
                u = 1.0 - rng.random()  # (0, 1]
                keyed.append((math.log(u) / item.score, item.endpoint))
            else:
                zero.append(item.endpoint)
        keyed.sort(key=lambda pair: pair[0], reverse=True)
        targets = [endpoint for _, endpoint in keyed[: self.max_endpoints]]
        missing = self.max_endpoints - len(targets)
        if missing > 0 and zero:
            targets.extend(rng.sample(zero, min(missing, len(zero))))
        return targets


def _score(item: ScoredEndpoint) -> float:
    return item.score
