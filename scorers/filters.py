"""Filters: keep the candidates that may serve the request, by their Kubernetes pod labels."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Literal, Self

from pydantic import BaseModel, ConfigDict, Field, model_validator

from scorers.base import Endpoint, LLMRequest, NoParameters, Plugin, PluginContext, register
from scorers.deprecated_types import warn_deprecated

ROLE_LABEL = "llm-d.ai/role"
"""llm-d's disaggregation role label on model server pods."""

DECODE_ROLES = frozenset({"decode", "prefill-decode", "both", "encode-prefill-decode"})
PREFILL_ROLES = frozenset(
    {"prefill", "encode-prefill", "prefill-decode", "both", "encode-prefill-decode"}
)


@register("decode-filter")
class DecodeFilter(Plugin[NoParameters]):
    """Keeps endpoints that can decode: label ``llm-d.ai/role`` in {decode, prefill-decode,
    both, encode-prefill-decode}, or no role label at all (a plain aggregated server)."""

    def filter(self, request: LLMRequest, endpoints: Sequence[Endpoint]) -> list[Endpoint]:
        return [
            e
            for e in endpoints
            if (role := e.labels.get(ROLE_LABEL)) is None or role in DECODE_ROLES
        ]


@register("prefill-filter")
class PrefillFilter(Plugin[NoParameters]):
    """Keeps endpoints labelled to prefill: ``llm-d.ai/role`` in {prefill, encode-prefill,
    prefill-decode, both, encode-prefill-decode}.  Unlabelled endpoints are dropped."""

    def filter(self, request: LLMRequest, endpoints: Sequence[Endpoint]) -> list[Endpoint]:
        return [e for e in endpoints if e.labels.get(ROLE_LABEL) in PREFILL_ROLES]


ENCODE_ROLES = frozenset({"encode", "encode-prefill", "encode-prefill-decode"})


@register("encode-filter")
class EncodeFilter(Plugin[NoParameters]):
    """Keeps endpoints labelled to encode multimodal inputs: ``llm-d.ai/role`` in {encode,
    encode-prefill, encode-prefill-decode}.  Unlabelled endpoints are dropped."""

    def filter(self, request: LLMRequest, endpoints: Sequence[Endpoint]) -> list[Endpoint]:
        return [e for e in endpoints if e.labels.get(ROLE_LABEL) in ENCODE_ROLES]


class LabelSelectorRequirement(BaseModel):
    """One ``matchExpressions`` entry, as in Kubernetes' ``metav1.LabelSelectorRequirement``."""

    model_config = ConfigDict(extra="forbid")

    key: str = Field(min_length=1, max_length=317)  # 253-char prefix + "/" + 63-char name
    operator: Literal["In", "NotIn", "Exists", "DoesNotExist"]
    values: list[str] = Field(default_factory=list)

    @model_validator(mode="after")
    def _values_match_operator(self) -> Self:
        if self.operator in ("In", "NotIn") and not self.values:
            raise ValueError(f"operator {self.operator} needs a non-empty 'values' list")
        if self.operator in ("Exists", "DoesNotExist") and self.values:
            raise ValueError(f"operator {self.operator} takes no 'values' (got {self.values!r})")
        return self

    def matches(self, labels: Mapping[str, str]) -> bool:
        value = labels.get(self.key)
        if self.operator == "In":
            return value is not None and value in self.values
        if self.operator == "NotIn":
            return value is None or value not in self.values
        if self.operator == "Exists":
            return value is not None
        return value is None  # DoesNotExist


class LabelSelectorParameters(BaseModel):
    """A Kubernetes label selector: every ``matchLabels`` pair and every ``matchExpressions``
    requirement must hold (AND).  An empty selector keeps every endpoint, as in Kubernetes."""

    model_config = ConfigDict(extra="forbid")

    matchLabels: dict[str, str] = Field(default_factory=dict)
    matchExpressions: list[LabelSelectorRequirement] = Field(default_factory=list)


@register("label-selector-filter")
class LabelSelectorFilter(Plugin[LabelSelectorParameters]):
    """Keeps endpoints whose pod labels match a Kubernetes label selector
    (``matchLabels``, ``matchExpressions`` with In / NotIn / Exists / DoesNotExist)."""

    def __init__(self, name: str, params: BaseModel, context: PluginContext) -> None:
        super().__init__(name, params, context)
        self.match_labels = tuple(self.p.matchLabels.items())
        self.match_expressions = tuple(self.p.matchExpressions)

    def matches(self, labels: Mapping[str, str]) -> bool:
        return all(labels.get(k) == v for k, v in self.match_labels) and all(
            r.matches(labels) for r in self.match_expressions
        )

    def filter(self, request: LLMRequest, endpoints: Sequence[Endpoint]) -> list[Endpoint]:
        return [e for e in endpoints if self.matches(e.labels)]


@register("by-label-selector")
class ByLabelSelectorFilter(LabelSelectorFilter):
    """llm-d v0.3 name of ``label-selector-filter`` (deprecated in llm-d-router, which warns)."""

    def __init__(self, name: str, params: BaseModel, context: PluginContext) -> None:
        super().__init__(name, params, context)
        warn_deprecated(self, "label-selector-filter")
