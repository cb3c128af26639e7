"""llm-d-router's earlier P/D plugins, still registered there (deprecated, Beta) and still used by
its well-lit-path configs (``test/integration/epp/wellknown_configs_test.go``): the
``pd-profile-handler`` and the ``disagg-headers-handler`` PreRequest plugin (also registered as
``prefill-header-handler``).  `scorers.disagg`'s ``disagg-profile-handler`` replaces both.

``pd-profile-handler`` (upstream ``profilehandler/disagg/pd_profile_handler.go``; deprecated in
v0.7.0) runs the ``decode`` profile, asks one decider (``deciderPluginName``, default the plugin
named ``prefix-based-pd-decider``) about the chosen decode pod and, on yes, runs ``prefill``.  It
sets no sidecar header itself: that is the ``disagg-headers-handler``'s job.  Its ``primaryPort``
is the data-parallel workaround of ``data-parallel-profile-handler``: Envoy is sent to the decode
pod's ``primaryPort`` and the chosen rank goes in ``x-data-parallel-host-port``.

``disagg-headers-handler`` (upstream ``profilehandler/disagg/disagg_headers_handler.go``;
deprecated in v0.9.0) writes ``x-prefiller-host-port`` and ``x-encoder-hosts-ports`` from the
results of the profiles it is told (``prefillProfile``, ``encodeProfile``), exactly as
``disagg-profile-handler`` does after its decision.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any, Final

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator

from scorers.base import (
    AllEndpointsFilteredError,
    LLMRequest,
    Plugin,
    PluginConfigError,
    PluginContext,
    ProfileResult,
    SchedulingResult,
    register,
)
from scorers.disagg import (
    DATA_PARALLEL_HEADER,
    DECIDER_TYPES,
    Decider,
    DisaggDecision,
    host_port,
    set_sidecar_headers,
)

logger = logging.getLogger(__name__)

PD_DECISION: Final = "disagg.pd_decision"
"""``request.data`` key of the `DisaggDecision` of a ``pd-profile-handler``
(``llm_d_epp_pd_decision_total``; the ``disagg-profile-handler``'s goes to its own counter)."""

REPLACEMENT: Final = "disagg-profile-handler"

Results = Mapping[str, ProfileResult | None]


def _warn_deprecated(plugin: Plugin[Any], since: str, removal: str) -> None:
    # llm-d-router logs every deprecated plugin type it loads; the replacement here is the same.
    logger.warning(
        "plugin %r (type %s) is deprecated in llm-d-router since %s (removal planned for %s); "
        "use %s",
        plugin.name,
        plugin.type_name,
        since,
        removal,
        REPLACEMENT,
    )


# ---------------------------------------------------------------------------------------------
# disagg-headers-handler / prefill-header-handler


class HeadersHandlerParameters(BaseModel):
    model_config = ConfigDict(extra="forbid")

    prefillProfile: str = Field(
        default="prefill",
        description="The profile whose first target goes in x-prefiller-host-port.",
    )
    encodeProfile: str = Field(
        default="encode",
        description="The profile whose targets go, comma-separated, in x-encoder-hosts-ports.",
    )

    @field_validator("prefillProfile", "encodeProfile", mode="before")
    @classmethod
    def _null_is_default(cls, value: Any, info: ValidationInfo) -> Any:
        # Go's decoder leaves a field at its default when the YAML value is null.
        return cls.model_fields[str(info.field_name)].default if value is None else value


@register("disagg-headers-handler")
class DisaggHeadersHandler(Plugin[HeadersHandlerParameters]):
    """PreRequest: the routing sidecar's headers from the named profiles' results."""

    def __init__(self, name: str, params: BaseModel, context: PluginContext) -> None:
        super().__init__(name, params, context)
        _warn_deprecated(self, "v0.9.0", "v0.11.0")

    def pre_request(self, request: LLMRequest, result: SchedulingResult) -> None:
        set_sidecar_headers(request, result, self.p.prefillProfile, self.p.encodeProfile)


@register("prefill-header-handler")
class PrefillHeaderHandler(DisaggHeadersHandler):
    """The older name of ``disagg-headers-handler``, with the same parameters (upstream builds
    both with one factory)."""


# ---------------------------------------------------------------------------------------------
# pd-profile-handler


class PdProfileHandlerParameters(BaseModel):
    model_config = ConfigDict(extra="forbid")

    decodeProfile: str = Field(
        default="decode",
        min_length=1,
        description="The profile that runs first; its pod is the destination.",
    )
    prefillProfile: str = Field(
        default="prefill",
        min_length=1,
        description="The profile that runs when the decider says yes.",
    )
    deciderPluginName: str = Field(
        default="prefix-based-pd-decider",
        description="The declared decider plugin asked about the chosen decode pod.",
    )
    primaryPort: int = Field(
        default=0,
        description="Non-zero: send the request to the decode pod's primaryPort and name the "
        "chosen rank in x-data-parallel-host-port (deprecated upstream: not needed with Istio "
        ">= 1.28.1).",
    )
    prefixMatchInfoProducerName: str = Field(
        default="",
        description="The prefix producer the handler depends on (must be declared when set).",
    )
    prefixPluginType: str = Field(default="", description="Deprecated; unused.")
    prefixPluginName: str = Field(
        default="",
        description="Deprecated; unused, but must name a declared plugin when set (or when "
        "prefixPluginType is set and this is not), as upstream resolves it as a dependency.",
    )

    @field_validator("deciderPluginName")
    @classmethod
    def _a_decider_is_named(cls, value: str) -> str:
        if not value:
            raise ValueError(
                f"names no decider; name a declared decider plugin ({', '.join(DECIDER_TYPES)})"
            )
        return value

    @field_validator("primaryPort")
    @classmethod
    def _port_in_range(cls, value: int) -> int:
        if value != 0 and not 1 <= value <= 65535:
            raise ValueError("must be between 1 and 65535, or 0 (off)")
        return value

    @property
    def prefix_plugin(self) -> str:
        """The plugin the deprecated prefix keys name (upstream's name defaults to the type)."""
        return self.prefixPluginName or self.prefixPluginType


@register("pd-profile-handler")
class PdProfileHandler(Plugin[PdProfileHandlerParameters]):
    """Profile handler: decode, then prefill when the decider says so; see the module docs."""

    def __init__(self, name: str, params: BaseModel, context: PluginContext) -> None:
        super().__init__(name, params, context)
        _warn_deprecated(self, "v0.7.0", "v0.9.0")
        if self.p.primaryPort:
            logger.warning(
                "%s %r: primaryPort is deprecated in llm-d-router (not needed with Istio >= "
                "1.28.1, which sends each rank's requests to its own port)",
                self.type_name,
                self.name,
            )
        if self.p.prefix_plugin:
            logger.warning(
                "%s %r: prefixPluginType and prefixPluginName are deprecated and unused",
                self.type_name,
                self.name,
            )
        self.decider: Decider | None = None

    def bind(self, plugins: Mapping[str, object]) -> None:
        """Find the decider, and the plugin the deprecated prefix keys name, by name."""
        ref = self.p.deciderPluginName
        plugin = plugins.get(ref)
        if plugin is None:
            raise PluginConfigError(
                f"{self.type_name} {self.name!r}: parameters.deciderPluginName: no plugin named "
                f"{ref!r} is declared (the default is a plugin named prefix-based-pd-decider)"
            )
        if not isinstance(plugin, Decider):
            raise PluginConfigError(
                f"{self.type_name} {self.name!r}: parameters.deciderPluginName: {ref!r} "
                f"({getattr(plugin, 'type_name', type(plugin).__name__)}) is not a decider; "
                f"deciders: {', '.join(DECIDER_TYPES)}"
            )
        self.decider = plugin
        prefix = self.p.prefix_plugin
        if prefix and prefix not in plugins:
            key = "prefixPluginName" if self.p.prefixPluginName else "prefixPluginType"
            raise PluginConfigError(
                f"{self.type_name} {self.name!r}: parameters.{key}: no plugin named {prefix!r} "
                "is declared; the key is unused, remove it"
            )

    def pick_profiles(
        self, request: LLMRequest, profiles: Sequence[str], results: Results
    ) -> list[str]:
        decode, prefill = self.p.decodeProfile, self.p.prefillProfile
        if decode not in profiles:
            raise PluginConfigError(
                f"{self.type_name} {self.name!r}: no scheduling profile named {decode!r} "
                f"(configured: {', '.join(profiles)})"
            )
        if decode not in results:
            return [decode]
        result = results[decode]
        # Upstream stops once every profile ran; asking only for an unrun prefill profile also
        # ends a configuration with more profiles than these two.
        if result is None or not result.targets or prefill not in profiles or prefill in results:
            return []
        # Recorded before the prefill profile runs, as upstream: a prefill stage whose filters
        # then leave no pod still counts as prefill-decode (unlike disagg-profile-handler).
        disaggregate = self.decider is not None and self.decider.disaggregate(
            request, result.targets[0]
        )
        request.data[PD_DECISION] = DisaggDecision(
            self.name, self.type_name, "prefill-decode" if disaggregate else "decode-only"
        )
        return [prefill] if disaggregate else []

    def process_results(self, request: LLMRequest, results: Results) -> SchedulingResult:
        decode_name, prefill_name = self.p.decodeProfile, self.p.prefillProfile
        decode = results.get(decode_name)
        if decode is None or not decode.targets:
            raise AllEndpointsFilteredError(
                f"{self.type_name} {self.name!r}: no decode endpoint in profile "
                f"{decode_name!r} for the request"
            )
        kept = {decode_name: decode}
        prefill = results.get(prefill_name)
        if prefill is not None and prefill.targets:
            kept[prefill_name] = prefill
        destinations = None
        if self.p.primaryPort:
            # The targets stay the ranks chosen (in-flight counts, the prefix index); only what
            # Envoy is told changes, as data-parallel-profile-handler does.
            request.set_headers[DATA_PARALLEL_HEADER] = host_port(decode.targets[0])
            destinations = tuple(
                f"{e.address.rpartition(':')[0]}:{self.p.primaryPort}" for e in decode.targets
            )
        return SchedulingResult(
            primary_profile=decode_name,
            profiles=kept,
            destinations=destinations,
            prefill_profile=prefill_name,
        )
