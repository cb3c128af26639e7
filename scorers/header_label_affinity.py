"""``header-label-affinity-scorer``: llm-d-router's soft affinity between a request header and a
pod label (upstream ``pkg/epp/framework/plugins/scheduling/scorer/headerlabelaffinity``; Alpha
there and here: it needs ``--allow-experimental-plugins``).

A pod whose label ``labelKey`` equals the value of the request header ``headerName`` scores 1,
every other pod 0 and stays a candidate: a missing or empty header, a value no pod carries and a
pod without the label all contribute nothing.  One instance per header-to-label mapping, so
that each preference has its own weight (upstream's example: ``x-disagg-slice`` against
``disaggregatedset.x-k8s.io/slice`` to keep a decode request in the slice its prefill pod was
in).  The header name is matched case-insensitively (HTTP/2 header names are lower case), the
values exactly.  The scorer writes no response header.
"""

from __future__ import annotations

from collections.abc import Sequence

from pydantic import BaseModel, ConfigDict, Field, field_validator

from scorers.affinity import header_value
from scorers.base import Endpoint, LLMRequest, Plugin, PluginContext, register


class HeaderLabelAffinityParameters(BaseModel):
    # Strict, as upstream's Go decoding of two strings; the defaults are checked too (both
    # are required).
    model_config = ConfigDict(extra="forbid", strict=True, validate_default=True)

    headerName: str = Field(default="", description="Request header holding the wanted value.")
    labelKey: str = Field(default="", description="Pod label compared with the header's value.")

    @field_validator("headerName", "labelKey")
    @classmethod
    def _required(cls, value: str) -> str:
        if not value:
            raise ValueError(
                "is required (a header-label-affinity-scorer maps one header to one pod label)"
            )
        return value


@register("header-label-affinity-scorer")
class HeaderLabelAffinityScorer(Plugin[HeaderLabelAffinityParameters]):
    """1 for the pods whose ``labelKey`` label equals the ``headerName`` header, else 0."""

    experimental = True

    def __init__(self, name: str, params: BaseModel, context: PluginContext) -> None:
        super().__init__(name, params, context)
        self.header = self.p.headerName.lower()
        self.label = self.p.labelKey

    def score(self, request: LLMRequest, endpoints: Sequence[Endpoint]) -> dict[str, float]:
        wanted = header_value(request.headers, self.header)
        if not wanted:
            return {e.address: 0.0 for e in endpoints}
        return {e.address: 1.0 if e.labels.get(self.label) == wanted else 0.0 for e in endpoints}
