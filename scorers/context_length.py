"""``context-length-aware``: llm-d-router's scorer (and optional filter) that sends a request to
the pods labelled for its context length (upstream
``pkg/epp/framework/plugins/scheduling/scorer/contextlengthaware``; Beta there and here).

Each pod may carry a label (``label``, default ``llm-d.ai/context-length-range``) whose value is
the range of prompt lengths, in tokens, it is meant for: ``"min-max"``, both ends included
(``"0-2048"``).  The request's context length is its prompt in tokens
(`scorers.base.LLMRequest.prompt_tokens`: exact when a token producer tokenized it or it came as
token ids, else the prompt's characters / 4, as upstream's tokenizer-free ``estimate`` backend
that its loader creates when no ``token-producer`` is configured).

Score, for a pod with a well-formed label:

* inside its range: ``0.3 + 0.7 · (0.7 · w + 0.3 · h)``, in (0.3, 1], where ``w = 1 / (1 +
  width / 10000)`` favours narrow ranges (specialists) and ``h = (max − length) / width`` the
  room left above the request (a zero-width range containing it scores 1);
* outside it: ``0.3 / (1 + distance / 1000)``, in (0, 0.3), ``distance`` being the tokens to the
  nearer end, so an out-of-range request still goes to the closest pod and never beats a pod
  whose range holds it.

A pod without the label scores 0.5 (neutral); one whose label is malformed scores 0.  With
``enableFiltering`` the plugin is also a filter: it keeps the pods whose range holds the request
and the pods without the label, and drops those with a malformed label (as upstream; an empty
result is the profile's 429).  Listed in a profile it runs as both, the filter first.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final

from pydantic import BaseModel, ConfigDict, Field, field_validator

from scorers.base import Endpoint, LLMRequest, Plugin, PluginContext, register

logger = logging.getLogger(__name__)

DEFAULT_CONTEXT_LENGTH_LABEL: Final = "llm-d.ai/context-length-range"
# Upstream's constants: the line between matching and fallback scores, the width at which the
# width term halves, and the distance at which the fallback halves.
_MAX_FALLBACK_SCORE: Final = 0.3
_WIDTH_SCALE: Final = 10_000.0
_DISTANCE_SCALE: Final = 1_000.0
_NEUTRAL_SCORE: Final = 0.5
# Go's strconv.Atoi: an optional sign and ASCII digits, nothing else (no "_", no spaces inside).
_GO_INT: Final = re.compile(r"[+-]?[0-9]+")
_INT64_MAX: Final = 2**63 - 1


@dataclass(slots=True, frozen=True)
class ContextRange:
    low: int
    high: int

    def holds(self, length: int) -> bool:
        return self.low <= length <= self.high


def _bound(text: str, which: str) -> int:
    value = text.strip()
    if not _GO_INT.fullmatch(value) or int(value) > _INT64_MAX:
        raise ValueError(f"invalid {which} value: {text}")
    return int(value)


def parse_context_range(text: str) -> ContextRange:
    """A label value ``"min-max"`` as a range; ValueError saying what is wrong otherwise."""
    if not text:
        raise ValueError("empty range string")
    parts = text.split("-")
    if len(parts) != 2:
        raise ValueError(f"invalid range format: {text} (expected 'min-max')")
    low, high = _bound(parts[0], "min"), _bound(parts[1], "max")
    if low > high:
        raise ValueError(f"min ({low}) cannot be greater than max ({high})")
    return ContextRange(low, high)


def range_score(length: int, span: ContextRange) -> float:
    """How well a pod labelled ``span`` fits a request of ``length`` tokens (module docstring)."""
    if span.holds(length):
        width = span.high - span.low
        if width == 0:
            return 1.0
        narrowness = 1.0 / (1.0 + width / _WIDTH_SCALE)
        headroom = (span.high - length) / width
        raw = 0.7 * narrowness + 0.3 * headroom
        return _MAX_FALLBACK_SCORE + raw * (1.0 - _MAX_FALLBACK_SCORE)
    distance = length - span.high if length > span.high else span.low - length
    return _MAX_FALLBACK_SCORE / (1.0 + distance / _DISTANCE_SCALE)


class ContextLengthAwareParameters(BaseModel):
    # Strict, as upstream's Go decoding: a number is no label, "true" no boolean.
    model_config = ConfigDict(extra="forbid", strict=True)

    label: str = Field(
        default=DEFAULT_CONTEXT_LENGTH_LABEL,
        description="Pod label whose value is the 'min-max' range of prompt tokens it serves.",
    )
    enableFiltering: bool = Field(
        default=False, description="Also drop the pods whose range does not hold the request."
    )

    @field_validator("label")
    @classmethod
    def _label_given(cls, value: str) -> str:
        if not value:
            raise ValueError(
                f"must name the pod label carrying the range (default {DEFAULT_CONTEXT_LENGTH_LABEL})"
            )
        return value


@register("context-length-aware")
class ContextLengthAware(Plugin[ContextLengthAwareParameters]):
    """Scores (and with ``enableFiltering`` filters) pods by their context-length label (module
    docstring)."""

    def __init__(self, name: str, params: BaseModel, context: PluginContext) -> None:
        super().__init__(name, params, context)
        self.label = self.p.label
        self._warned: set[tuple[str, str]] = set()

    def _range(self, endpoint: Endpoint) -> ContextRange | None:
        """The endpoint's range (None: no label); ValueError for a malformed one."""
        text = endpoint.labels.get(self.label)
        return None if text is None else parse_context_range(text)

    def _malformed(self, endpoint: Endpoint, exc: ValueError) -> None:
        # Once per endpoint and value: the same bad label would otherwise log on every request.
        key = (endpoint.address, endpoint.labels.get(self.label, ""))
        if key not in self._warned:
            self._warned.add(key)
            logger.warning(
                "%s: endpoint %s: label %s=%r is not a 'min-max' token range (%s); it %s",
                self.name,
                endpoint.address,
                self.label,
                key[1],
                exc,
                "is filtered out" if self.p.enableFiltering else "scores 0",
            )

    def filter(self, request: LLMRequest, endpoints: Sequence[Endpoint]) -> list[Endpoint]:
        if not self.p.enableFiltering:
            return list(endpoints)
        length = request.prompt_tokens
        kept = []
        for endpoint in endpoints:
            try:
                span = self._range(endpoint)
            except ValueError as exc:
                self._malformed(endpoint, exc)
                continue
            if span is None or span.holds(length):
                kept.append(endpoint)
        return kept

    def score(self, request: LLMRequest, endpoints: Sequence[Endpoint]) -> dict[str, float]:
        length = request.prompt_tokens
        scores: dict[str, float] = {}
        for endpoint in endpoints:
            try:
                span = self._range(endpoint)
            except ValueError as exc:
                self._malformed(endpoint, exc)
                scores[endpoint.address] = 0.0
                continue
            scores[endpoint.address] = _NEUTRAL_SCORE if span is None else range_score(length, span)
        return scores
