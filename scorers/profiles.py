"""Profile handlers: which scheduling profiles run for a request, and which one's result is
the primary (the destination Envoy is given)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import ClassVar

from scorers.base import (
    AllEndpointsFilteredError,
    LLMRequest,
    NoParameters,
    Plugin,
    PluginConfigError,
    ProfileResult,
    SchedulingResult,
    register,
)


@register("single-profile-handler")
class SingleProfileHandler(Plugin[NoParameters]):
    """Runs the one configured profile once; its result is the primary.  The config loader
    rejects a configuration with more than one profile and this handler (`max_profiles`)."""

    max_profiles: ClassVar[int] = 1

    def pick_profiles(
        self,
        request: LLMRequest,
        profiles: Sequence[str],
        results: Mapping[str, ProfileResult | None],
    ) -> list[str]:
        if len(profiles) != 1:
            raise PluginConfigError(
                f"{self.type_name} {self.name!r} runs exactly one scheduling profile, "
                f"but {len(profiles)} are configured ({', '.join(profiles)})"
            )
        return [] if results else [profiles[0]]

    def process_results(
        self, request: LLMRequest, results: Mapping[str, ProfileResult | None]
    ) -> SchedulingResult:
        ((name, result),) = results.items()
        if result is None:
            raise AllEndpointsFilteredError(f"scheduling profile {name!r} chose no endpoint")
        return SchedulingResult(primary_profile=name, profiles={name: result})
