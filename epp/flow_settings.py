"""The ``flowControl`` section of an EndpointPickerConfig, read into `FlowControlSettings` for
`epp.flow_control` (llm-d-router's ``apix/config/v1alpha1`` ``FlowControlConfig`` and its
loader's checks): Kubernetes quantities and Go durations, bands and the policies they name.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Final

from epp.flow_policies import FAIRNESS_TYPES, ORDERING_TYPES, UNDECLARED_OK, USAGE_LIMIT_TYPES
from kvcache.settings import parse_duration

DEFAULT_TTL_S: Final = 60.0
DEFAULT_BAND_REQUESTS: Final = 5000
DEFAULT_BAND_BYTES: Final = 1_000_000_000

# ---------------------------------------------------------------------------------------------
# Quantities and durations as Kubernetes writes them


_QUANTITY = re.compile(r"^(\d+(?:\.\d+)?)(Ki|Mi|Gi|Ti|k|M|G|T)?$")
_SUFFIX: Final = {
    None: 1, "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12,
    "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40,
}  # fmt: skip


def quantity(value: Any, what: str) -> int:
    """A Kubernetes quantity (``500``, ``1k``, ``10Gi``) as an integer >= 0."""
    if isinstance(value, bool):
        raise ValueError(f"{what}: {value!r} is not a quantity")
    if isinstance(value, int):
        number = value
    else:
        match = _QUANTITY.match(str(value).strip())
        if match is None:
            raise ValueError(f"{what}: {value!r} is not a quantity such as 500, 1k or 10Gi")
        number = math.ceil(float(match.group(1)) * _SUFFIX[match.group(2)])
    if number < 0:
        raise ValueError(f"{what} must be non-negative, got {number}")
    return number


def duration(value: Any, what: str) -> float:
    """A Go duration (``60s``, ``1m30s``, ``500ms``) in seconds, >= 0."""
    try:
        return parse_duration(value)
    except ValueError:
        raise ValueError(
            f"{what}: {value!r} is not a duration such as 60s, 1m30s or 500ms"
        ) from None


# ---------------------------------------------------------------------------------------------
# Settings


@dataclass(slots=True, frozen=True)
class BandSettings:
    max_requests: int = DEFAULT_BAND_REQUESTS
    max_bytes: int = DEFAULT_BAND_BYTES
    fairness: str = "global-strict-fairness-policy"
    ordering: str = "fcfs-ordering-policy"


@dataclass(slots=True, frozen=True)
class FlowControlSettings:
    """The ``flowControl`` section, parsed (`flow_control_settings`)."""

    max_requests: int = 0  # 0: no global limit
    max_bytes: int = 0
    ttl: float = DEFAULT_TTL_S  # 0: no expiry while the pool has endpoints
    no_endpoint_ttl: float = DEFAULT_TTL_S
    default_band: BandSettings = BandSettings()
    negative_band: BandSettings | None = None
    bands: Mapping[int, BandSettings] = field(default_factory=dict)
    usage_limit_policy: str = "static-usage-limit-policy"

    def band(self, priority: int) -> BandSettings:
        if priority in self.bands:
            return self.bands[priority]
        if priority < 0 and self.negative_band is not None:
            return self.negative_band
        return self.default_band


def _band(raw: Any, where: str, plugins: Mapping[str, str]) -> BandSettings:
    if not isinstance(raw, Mapping):
        raise ValueError(f"{where}: expected a mapping, got {raw!r}")
    unknown = sorted(set(raw) - {"priority", "maxRequests", "maxBytes", "fairnessPolicyRef",
                                 "orderingPolicyRef"})  # fmt: skip
    if unknown:
        raise ValueError(f"{where}: unknown key(s) {', '.join(unknown)}")
    fairness = raw.get("fairnessPolicyRef") or "global-strict-fairness-policy"
    ordering = raw.get("orderingPolicyRef") or "fcfs-ordering-policy"
    for ref, kinds, key in (
        (fairness, FAIRNESS_TYPES, "fairnessPolicyRef"),
        (ordering, ORDERING_TYPES, "orderingPolicyRef"),
    ):
        kind = plugins.get(ref, ref if ref in UNDECLARED_OK else None)
        if kind is None and ref in kinds:
            raise ValueError(
                f"{where}.{key}: {ref!r} is not declared; add `- type: {ref}` to plugins "
                "(it learns from every request's dispatch and response, so it must be declared)"
            )
        if kind not in kinds:
            raise ValueError(
                f"{where}.{key}: {ref!r} is not a declared {' or '.join(kinds)} plugin"
            )
    # 0 means unset for a band, as upstream.
    requests = quantity(raw.get("maxRequests", 0), f"{where}.maxRequests") or DEFAULT_BAND_REQUESTS
    size = quantity(raw.get("maxBytes", 0), f"{where}.maxBytes") or DEFAULT_BAND_BYTES
    return BandSettings(requests, size, fairness, ordering)


def flow_control_settings(section: Any, plugins: Mapping[str, str]) -> FlowControlSettings:
    """The ``flowControl`` section (a `epp.config_sections.FlowControlSpec`) with the gate on;
    ``plugins``: declared name → type.  Raises ValueError naming the key."""
    if section is None:
        return FlowControlSettings()
    if section.enableEviction:
        raise ValueError(
            "flowControl.enableEviction: evicting running requests is not implemented here; "
            "waiting requests leave by their TTL or the band's capacity"
        )
    ttl = (
        duration(section.defaultRequestTTL, "flowControl.defaultRequestTTL")
        if (section.defaultRequestTTL is not None)
        else DEFAULT_TTL_S
    )
    no_endpoint = (
        duration(section.noEndpointRequestTTL, "flowControl.noEndpointRequestTTL")
        if section.noEndpointRequestTTL is not None
        else ttl
        if section.defaultRequestTTL is not None
        else DEFAULT_TTL_S
    )
    default_band = (
        _band(section.defaultPriorityBand, "flowControl.defaultPriorityBand", plugins)
        if section.defaultPriorityBand is not None
        else BandSettings()
    )
    negative = (
        _band(section.defaultNegativePriorityBand, "flowControl.defaultNegativePriorityBand",
              plugins)
        if section.defaultNegativePriorityBand is not None
        else None
    )  # fmt: skip
    bands: dict[int, BandSettings] = {}
    for i, raw in enumerate(section.priorityBands or ()):
        where = f"flowControl.priorityBands[{i}]"
        priority = raw.get("priority") if isinstance(raw, Mapping) else None
        if not isinstance(priority, int) or isinstance(priority, bool):
            raise ValueError(f"{where}.priority: an integer is required")
        if priority in bands:
            raise ValueError(f"{where}.priority: duplicate priority level {priority}")
        bands[priority] = _band(raw, where, plugins)
    policy = section.usageLimitPolicyPluginRef or "static-usage-limit-policy"
    kind = plugins.get(policy, policy if policy == "static-usage-limit-policy" else None)
    if kind not in USAGE_LIMIT_TYPES:
        raise ValueError(
            f"flowControl.usageLimitPolicyPluginRef: {policy!r} is not a declared usage limit "
            f"policy ({', '.join(USAGE_LIMIT_TYPES)})"
        )
    return FlowControlSettings(
        max_requests=quantity(section.maxRequests or 0, "flowControl.maxRequests"),
        max_bytes=quantity(section.maxBytes or 0, "flowControl.maxBytes"),
        ttl=ttl,
        no_endpoint_ttl=no_endpoint,
        default_band=default_band,
        negative_band=negative,
        bands=bands,
        usage_limit_policy=policy,
    )
