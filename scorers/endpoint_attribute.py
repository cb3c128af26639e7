"""Filtering and scoring by one numeric endpoint attribute, as llm-d-router's
``endpoint-attribute-filter`` and ``endpoint-attribute-scorer`` (Alpha there and here: they need
``--allow-experimental-plugins``).

An attribute is a number a data-layer plugin publishes per endpoint under a key
``<attribute>/<producer>`` (upstream's ``DataKey``); here, ``GPUUtilization/dcgm-extractor``
(`scorers.gpu_metrics`).  Both plugins name it the way upstream's configuration does: the
attribute (``attribute`` for the filter, ``attributeKey`` for the scorer) and ``producer``.
Omitting ``producer`` means llm-d-router's ``core-metrics-extractor``, whose custom metrics
(``engineConfigs[].customMetrics``) this EPP does not offer, so such an attribute is always
missing here; ``producer: ""`` is upstream's producer-agnostic key.  An attribute containing
``/`` without ``producer`` is refused, as upstream: it is the old combined spelling, whose key
matches nothing and would silently keep (or zero) every endpoint.

Attributes are optional inputs upstream: a key nobody publishes loads with a warning, and every
endpoint then counts as missing it.

* The filter keeps endpoints whose value compares true against ``algorithm.threshold`` (operators
  ``LessThan``, ``LessThanOrEqual``, ``GreaterThan``, ``GreaterThanOrEqual``, ``Equal``,
  ``NotEqual``); an endpoint without the value is kept (``onMissing: Pass``, the default) or
  dropped (``Fail``); with ``fallbackOnEmpty`` an empty result gives back every candidate.
* The scorer maps the value linearly onto [0, 1] (``linear_higher_is_better``) or its
  complement (``linear_lower_is_better``), over ``normalization.fixedRange`` (``min``/``max``,
  values clamped) or, by default, the range of the candidates' values (``adaptiveRange``; all
  equal: 1.0 each).  An endpoint without the value scores 0.
"""

from __future__ import annotations

import logging
import operator
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Final, Literal, Protocol, runtime_checkable

from pydantic import BaseModel, ConfigDict, Field, model_validator

from scorers.base import Endpoint, LLMRequest, Plugin, register

log = logging.getLogger(__name__)

CORE_METRICS_EXTRACTOR: Final = "core-metrics-extractor"
"""The producer an omitted ``producer`` means (llm-d-router's ``ResolveConfiguredKey``)."""


@dataclass(slots=True, frozen=True)
class DataKey:
    """Which attribute, published by which producer (``GPUUtilization/dcgm-extractor``)."""

    attribute: str
    producer: str

    def __str__(self) -> str:
        return f"{self.attribute}/{self.producer}"


@runtime_checkable
class AttributeProducer(Protocol):
    """A plugin that publishes numeric per-endpoint attributes (`scorers.gpu_metrics`'s
    ``dcgm-extractor``).  The filter and the scorer find theirs among the declared plugins."""

    name: str

    def produced_keys(self) -> frozenset[DataKey]: ...

    def attribute(self, key: DataKey, endpoint: Endpoint) -> float | None:
        """The endpoint's current value, or None when it has none (yet, or any more)."""
        ...


def configured_key(attribute: str, producer: str | None) -> DataKey:
    """The key a configuration's attribute and producer name (upstream's rules; module
    docstring).  Raises ValueError for an attribute with ``/`` and no producer."""
    if producer is not None:
        return DataKey(attribute, producer)
    if "/" in attribute:
        name, _, owner = attribute.rpartition("/")
        raise ValueError(
            f"attribute {attribute!r} contains '/' but producer is not set; the attribute and "
            f"its producer are separate parameters: write {name!r} and producer {owner!r}, or "
            "set producer explicitly if the attribute name itself contains '/'"
        )
    return DataKey(attribute, CORE_METRICS_EXTRACTOR)


class _Strict(BaseModel):
    # Strict: llm-d-router decodes parameters into Go numbers, booleans and strings, which
    # refuse "0.9" for a number or "true" for a boolean; so do we.
    model_config = ConfigDict(extra="forbid", strict=True)


class _AttributeReader:
    """What the filter and the scorer share: the key, its producers, and reading a value."""

    key: DataKey
    producers: tuple[AttributeProducer, ...] = ()

    def bind(self, plugins: Mapping[str, object]) -> None:
        self.producers = tuple(
            plugin
            for plugin in plugins.values()
            if isinstance(plugin, AttributeProducer) and self.key in plugin.produced_keys()
        )
        if not self.producers:
            # Upstream accepts an optional input nobody produces, with a warning.
            log.warning(
                "%s: no declared plugin publishes %s; every endpoint counts as missing it",
                getattr(self, "name", "?"),
                self.key,
            )

    def value(self, endpoint: Endpoint) -> float | None:
        for producer in self.producers:
            value = producer.attribute(self.key, endpoint)
            if value is not None:
                return value
        return None


# ---------------------------------------------------------------------------------------------
# The filter

Operator = Literal[
    "LessThan", "LessThanOrEqual", "GreaterThan", "GreaterThanOrEqual", "Equal", "NotEqual"
]
OPERATORS: Final[Mapping[str, Callable[[float, float], bool]]] = {
    "LessThan": operator.lt,
    "LessThanOrEqual": operator.le,
    "GreaterThan": operator.gt,
    "GreaterThanOrEqual": operator.ge,
    "Equal": operator.eq,
    "NotEqual": operator.ne,
}


class ThresholdParameters(_Strict):
    operator: Operator
    value: float = Field(allow_inf_nan=False)


class FilterAlgorithm(_Strict):
    type: Literal["threshold"] = Field(
        description="Only threshold, as upstream (percentile, topK and range are planned there)."
    )
    threshold: ThresholdParameters | None = None

    @model_validator(mode="after")
    def _threshold_given(self) -> FilterAlgorithm:
        if self.threshold is None:
            raise ValueError("algorithm.threshold is required when algorithm.type is 'threshold'")
        return self


class FilterParameters(_Strict):
    attribute: str = Field(min_length=1, description="The attribute to read, e.g. GPUUtilization.")
    producer: str | None = Field(
        default=None, description="Who publishes it (omitted: core-metrics-extractor)."
    )
    # "" is what upstream's Go zero value means: Pass.
    onMissing: Literal["Pass", "Fail", ""] = "Pass"
    fallbackOnEmpty: bool = False
    algorithm: FilterAlgorithm

    @model_validator(mode="after")
    def _key(self) -> FilterParameters:
        configured_key(self.attribute, self.producer)
        return self


@register("endpoint-attribute-filter")
class EndpointAttributeFilter(_AttributeReader, Plugin[FilterParameters]):
    """Endpoints whose attribute satisfies the threshold (module docstring)."""

    experimental: ClassVar[bool] = True

    def __init__(self, name: str, params: BaseModel, context: Any) -> None:
        super().__init__(name, params, context)
        p = self.p
        self.key = configured_key(p.attribute, p.producer)
        threshold = p.algorithm.threshold
        assert threshold is not None  # FilterAlgorithm requires it
        self.compare = OPERATORS[threshold.operator]
        self.threshold = threshold.value
        self.keep_missing = p.onMissing != "Fail"

    def matches(self, value: float) -> bool:
        return self.compare(value, self.threshold)

    def filter(self, request: LLMRequest, endpoints: Sequence[Endpoint]) -> list[Endpoint]:
        kept = []
        for endpoint in endpoints:
            value = self.value(endpoint)
            if value is None:
                if self.keep_missing:
                    kept.append(endpoint)
            elif self.matches(value):
                kept.append(endpoint)
        if not kept and self.p.fallbackOnEmpty:
            return list(endpoints)
        return kept


# ---------------------------------------------------------------------------------------------
# The scorer


class FixedRange(_Strict):
    # Go's zero values: ``fixedRange: {max: 1}`` means [0, 1].
    min: float = Field(default=0.0, allow_inf_nan=False)
    max: float = Field(default=0.0, allow_inf_nan=False)

    @model_validator(mode="after")
    def _ordered(self) -> FixedRange:
        if not self.min < self.max:
            raise ValueError(f"fixedRange needs min < max, got min {self.min}, max {self.max}")
        return self


class AdaptiveRange(_Strict):
    """The candidates' own range, each scheduling cycle (no parameters)."""


class Normalization(_Strict):
    fixedRange: FixedRange | None = None
    adaptiveRange: AdaptiveRange | None = None

    @model_validator(mode="after")
    def _at_most_one(self) -> Normalization:
        if self.fixedRange is not None and self.adaptiveRange is not None:
            raise ValueError("give at most one of fixedRange and adaptiveRange")
        return self


class ScorerAlgorithm(_Strict):
    type: Literal["linear_lower_is_better", "linear_higher_is_better"]
    normalization: Normalization = Field(default_factory=Normalization)


class ScorerParameters(_Strict):
    attributeKey: str = Field(min_length=1, description="The attribute to read.")
    producer: str | None = Field(
        default=None, description="Who publishes it (omitted: core-metrics-extractor)."
    )
    algorithm: ScorerAlgorithm

    @model_validator(mode="after")
    def _key(self) -> ScorerParameters:
        configured_key(self.attributeKey, self.producer)
        return self


@register("endpoint-attribute-scorer")
class EndpointAttributeScorer(_AttributeReader, Plugin[ScorerParameters]):
    """The attribute, normalized onto [0, 1] (module docstring)."""

    experimental: ClassVar[bool] = True

    def __init__(self, name: str, params: BaseModel, context: Any) -> None:
        super().__init__(name, params, context)
        p = self.p
        self.key = configured_key(p.attributeKey, p.producer)
        self.lower_is_better = p.algorithm.type == "linear_lower_is_better"
        self.fixed_range = p.algorithm.normalization.fixedRange

    def score(self, request: LLMRequest, endpoints: Sequence[Endpoint]) -> dict[str, float]:
        values = {e.address: self.value(e) for e in endpoints}
        present = [v for v in values.values() if v is not None]
        if self.fixed_range is not None:
            low, high = self.fixed_range.min, self.fixed_range.max
        else:
            low, high = (min(present), max(present)) if present else (0.0, 0.0)
        out: dict[str, float] = {}
        for address, value in values.items():
            if value is None:
                out[address] = 0.0
            elif self.fixed_range is None and low == high:
                out[address] = 1.0  # every candidate with a value has the same one: neutral
            else:
                position = min(1.0, max(0.0, (value - low) / (high - low)))
                out[address] = 1.0 - position if self.lower_is_better else position
        return out
