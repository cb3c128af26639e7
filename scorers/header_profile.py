"""``header-profile-handler``: one scheduling profile per request, the one a request header names
(llm-d-router's, Alpha there and here: it needs ``--allow-experimental-plugins``).

The caller already knows which stage a call is for: llm-d-router's coordinator sends each
request's encode, prefill and decode legs as separate calls through one EPP, naming the stage in
``EPP-Profile``.  So, unlike ``disagg-profile-handler``, this handler decides nothing and sets
no sidecar header; the profile it ran is the primary one.

Rules (upstream's ``profilehandler/headerprofile/header_profile_handler.go``):

* one configured profile: it runs, whatever the header says;
* the header (trimmed) names a configured profile: that one runs;
* the header is absent or blank: ``defaultProfile`` runs;
* otherwise nothing runs and the request fails with 429, upstream's status (its scheduler
  cannot carry a client error out of a profile handler; a 400 would describe a bad header
  better, but clients of llm-d-router see 429).

``headerName`` is matched without regard to case and its value is trimmed; the value is compared
with the profile names as written.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any, Final

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator

from scorers.affinity import header_value
from scorers.base import (
    AllEndpointsFilteredError,
    LLMRequest,
    Plugin,
    PluginContext,
    ProfileResult,
    SchedulingError,
    SchedulingResult,
    register,
)

logger = logging.getLogger(__name__)

DEFAULT_HEADER: Final = "EPP-Profile"
DEFAULT_PROFILE: Final = "decode"


class NoProfileSelectedError(SchedulingError):
    """The header names no configured profile, or is missing and ``defaultProfile`` is not
    configured either.  429 as upstream (see the module docstring)."""

    http_status = 429


class HeaderProfileParameters(BaseModel):
    model_config = ConfigDict(extra="forbid")

    headerName: str = Field(
        default=DEFAULT_HEADER,
        description="The request header whose value names the profile to run (any case).",
    )
    defaultProfile: str = Field(
        default=DEFAULT_PROFILE,
        description="The profile run when the header is missing or blank and several "
        "profiles are configured.",
    )

    @field_validator("headerName", "defaultProfile", mode="before")
    @classmethod
    def _blank_is_default(cls, value: Any, info: ValidationInfo) -> Any:
        # Go's decoder leaves a null at the zero value, and upstream's constructor turns an
        # empty or blank value into the default: neither can ever match a request.
        if value is None or (isinstance(value, str) and not value.strip()):
            return cls.model_fields[str(info.field_name)].default
        return value.strip() if isinstance(value, str) else value


@register("header-profile-handler")
class HeaderProfileHandler(Plugin[HeaderProfileParameters]):
    """Profile handler: see the module docstring."""

    experimental = True

    def __init__(self, name: str, params: BaseModel, context: PluginContext) -> None:
        super().__init__(name, params, context)
        # Envoy hands header names to the EPP in lower case; the configured one is compared so.
        self.header = self.p.headerName.lower()
        self.default_profile = self.p.defaultProfile

    def requested_profile(self, request: LLMRequest) -> str:
        """The header's trimmed value, "" when it is absent or blank."""
        return (header_value(request.headers, self.header) or "").strip()

    def pick_profiles(
        self,
        request: LLMRequest,
        profiles: Sequence[str],
        results: Mapping[str, ProfileResult | None],
    ) -> list[str]:
        if results:
            return []
        if len(profiles) == 1:
            return [profiles[0]]
        wanted = self.requested_profile(request) or self.default_profile
        if wanted in profiles:
            return [wanted]
        # Logged as upstream logs it (its clients get the bare status; here the 429's body
        # says it too, from process_results).
        logger.info(
            "%s %r: no scheduling profile selected for request %s: %s",
            self.type_name,
            self.name,
            request.request_id,
            self._no_match(request, profiles),
        )
        return []

    def process_results(
        self, request: LLMRequest, results: Mapping[str, ProfileResult | None]
    ) -> SchedulingResult:
        if not results:
            raise NoProfileSelectedError(
                f"{self.type_name} {self.name!r}: {self._no_match(request)}"
            )
        if len(results) > 1:
            raise SchedulingError(
                f"{self.type_name} {self.name!r} runs one profile per request, but "
                f"{len(results)} ran ({', '.join(results)})"
            )
        ((name, result),) = results.items()
        if result is None or not result.targets:
            raise AllEndpointsFilteredError(f"scheduling profile {name!r} chose no endpoint")
        return SchedulingResult(primary_profile=name, profiles={name: result})

    def _no_match(self, request: LLMRequest, profiles: Sequence[str] | None = None) -> str:
        value = self.requested_profile(request)
        configured = f" (configured: {', '.join(profiles)})" if profiles else ""
        if value:
            return (
                f"no scheduling profile configured for {self.header!r} header value "
                f"{value!r}{configured}"
            )
        return (
            f"missing {self.header!r} header, and defaultProfile {self.default_profile!r} is "
            f"not a configured scheduling profile{configured}"
        )
