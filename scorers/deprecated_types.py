"""llm-d-router plugin types that are deprecated there (since v0.9.0, removal planned for
v0.11.0; Beta) and still accepted, here as there, each logging a deprecation warning when
created (upstream's loader and factories log one too):

* ``by-label`` (upstream ``scheduling/filter/bylabel/filter.go``): keeps the pods whose label
  ``label`` has one of ``validValues``, and, with ``allowsNoLabel``, the pods without the label.
  ``label`` is required, and so is a non-empty ``validValues`` unless ``allowsNoLabel``.  As
  upstream, a pod without the label also passes when ``validValues`` lists ``""``.  Replaced by
  ``label-selector-filter`` (or the role filters ``decode-filter``, ``prefill-filter``,
  ``encode-filter``).
* ``tokenizer`` (upstream ``requestcontrol/dataproducer/tokenizer``'s ``LegacyPluginType``): the
  old name of ``token-producer``, with its parameters and behaviour (`scorers.data_layer`).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any, Final, Self

from pydantic import BaseModel, ConfigDict, Field, model_validator

from scorers.base import Endpoint, LLMRequest, Plugin, PluginContext, register
from scorers.data_layer import TokenProducer

logger = logging.getLogger(__name__)

DEPRECATED_IN: Final = "v0.9.0"
REMOVAL_IN: Final = "v0.11.0"


def warn_deprecated(plugin: Plugin[Any], replacement: str) -> None:
    """The warning llm-d-router's loader logs for a deprecated type, naming what replaces it."""
    logger.warning(
        "plugin %r (type %s) is deprecated in llm-d-router since %s (removal planned for %s); "
        "use %s",
        plugin.name,
        plugin.type_name,
        DEPRECATED_IN,
        REMOVAL_IN,
        replacement,
    )


class ByLabelParameters(BaseModel):
    # Strict, as upstream's Go decoding: "yes" is no boolean, "a" no list of values.
    model_config = ConfigDict(extra="forbid", strict=True)

    label: str = Field(default="", description="The pod label to read.")
    validValues: list[str] = Field(default_factory=list, description="Values that pass.")
    allowsNoLabel: bool = Field(default=False, description="Pods without the label pass.")

    @model_validator(mode="after")
    def _selects_something(self) -> Self:
        if not self.label:
            raise ValueError("label must be specified (the pod label to filter on)")
        if not self.validValues and not self.allowsNoLabel:
            raise ValueError(
                "either validValues must be non-empty or allowsNoLabel must be true "
                "(otherwise no pod passes)"
            )
        return self


@register("by-label")
class ByLabelFilter(Plugin[ByLabelParameters]):
    """Keeps the pods whose label value is valid, or that lack the label when allowed."""

    def __init__(self, name: str, params: BaseModel, context: PluginContext) -> None:
        super().__init__(name, params, context)
        self.label = self.p.label
        self.valid = frozenset(self.p.validValues)
        self.allows_no_label = self.p.allowsNoLabel
        warn_deprecated(
            self,
            "label-selector-filter (or decode-filter, prefill-filter, encode-filter for roles)",
        )

    def filter(self, request: LLMRequest, endpoints: Sequence[Endpoint]) -> list[Endpoint]:
        kept = []
        for endpoint in endpoints:
            value = endpoint.labels.get(self.label)
            # A missing label reads as "" (Go's map lookup), which validValues may list.
            if (value is None and self.allows_no_label) or (value or "") in self.valid:
                kept.append(endpoint)
        return kept


@register("tokenizer")
class LegacyTokenizer(TokenProducer):
    """``token-producer`` under its old name (same parameters, same wiring)."""

    def __init__(self, name: str, params: BaseModel, context: PluginContext) -> None:
        super().__init__(name, params, context)
        warn_deprecated(self, "token-producer")
