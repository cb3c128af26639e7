"""Disaggregated serving: which pods prefill, encode and decode one request, as llm-d-router
schedules it (docs/disaggregation.md).

``disagg-profile-handler`` runs the ``decode`` profile first; once the decode pod is known, a
decider per optional stage says whether that stage runs on a pod of its own: the encoder (images,
audio, video) and the prefill.  The decode pod is always the destination Envoy is given; the
routing sidecar beside it reads ``x-prefiller-host-port`` (one ``ip:port``) and
``x-encoder-hosts-ports`` (a comma list), has the prefill pod compute the prompt's KV, and pulls
it.  A stage whose filters leave no pod falls back to the decode pod (its decision counts as not
disaggregated).  With ``stageOrder: prefill-first`` the prefill profile always runs, before
decode, and no prefill decider may be set.

Deciders read what the request carries: ``prefix-based-pd-decider`` disaggregates when the
prompt tokens the chosen decode pod does not hold reach ``nonCachedTokens``;
``always-disagg-pd-decider`` always does; ``always-disagg-multimodal-decider`` sends requests
with image, audio or video parts to an encoder.

``data-parallel-profile-handler`` (llm-d-router's, deprecated there in favour of routing to each
rank's port directly) runs one profile, tells Envoy ``<pod ip>:primaryPort`` and names the chosen
rank's endpoint in ``x-data-parallel-host-port`` for the sidecar to forward to.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Final, Literal, Protocol, Self, runtime_checkable

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationInfo,
    field_validator,
    model_validator,
)

from scorers.base import (
    AllEndpointsFilteredError,
    Endpoint,
    LLMRequest,
    NoParameters,
    Plugin,
    PluginConfigError,
    ProfileResult,
    SchedulingResult,
    register,
)
from scorers.filters import PREFILL_ROLES, ROLE_LABEL
from scorers.request_data import (
    PREFIX_MATCH_INFO,
    PREFIX_MATCHED_TOKENS,
    PrefixMatchInfo,
    prefix_match_info_key,
)

logger = logging.getLogger(__name__)

PREFILLER_HEADER: Final = "x-prefiller-host-port"
ENCODERS_HEADER: Final = "x-encoder-hosts-ports"
DATA_PARALLEL_HEADER: Final = "x-data-parallel-host-port"

DISAGG_DECISION: Final = "disagg.decision"
"""``request.data`` key of the request's `DisaggDecision` (counted by the EPP's metrics)."""

PEER_ENDPOINT: Final = "disagg.peer_endpoint"
"""``request.data`` key of the `Endpoint` the stage being scheduled works with (the chosen decode
pod, while the prefill profile runs; the prefill pod, while decode runs after it with
``stageOrder: prefill-first``): what topology plugins measure proximity to."""

DecisionType = Literal["decode-only", "prefill-decode", "encode-decode", "encode-prefill-decode"]

MULTIMODAL_PART_TYPES: Final = frozenset({"image_url", "video_url", "input_audio", "audio_url"})
"""Chat content parts an encoder serves (llm-d-router's multimodal decider)."""

UPSTREAM_PREFIX_PRODUCER: Final = "approx-prefix-cache-producer"

DEFAULT_NON_CACHED_TOKENS: Final = 1024
"""``prefix-based-pd-decider``'s default threshold.  llm-d-router's is 0, which never
disaggregates.  Over ``python -m benchmarks.pd``'s grid (docs/disaggregation.md), 1,024 has the
smallest worst-case loss against the best threshold of each fleet and load: most chat turns stay
on the decode pod holding their conversation, so prefill pods that are few or busy do not
queue; a fleet whose prefill pods have room does better with a low threshold."""


@dataclass(slots=True, frozen=True)
class DisaggDecision:
    """What the profile handler decided for one request (``llm_d_epp_disagg_decision_total``)."""

    plugin_name: str
    plugin_type: str
    decision: DecisionType


def decision_type(encode: bool, prefill: bool) -> DecisionType:
    if encode:
        return "encode-prefill-decode" if prefill else "encode-decode"
    return "prefill-decode" if prefill else "decode-only"


def host_port(endpoint: Endpoint) -> str:
    """``ip:port`` as Go's ``net.JoinHostPort`` writes it (IPv6 in brackets): an endpoint's
    address already is (`epp.datastore.EndpointSpec`)."""
    return endpoint.address


# ---------------------------------------------------------------------------------------------
# Deciders


@runtime_checkable
class Decider(Protocol):
    """Says whether a stage runs on a pod of its own, given the chosen decode pod."""

    name: str

    def disaggregate(self, request: LLMRequest, decode: Endpoint | None) -> bool: ...


class PrefixDeciderParameters(BaseModel):
    model_config = ConfigDict(extra="forbid")

    nonCachedTokens: int = Field(
        default=DEFAULT_NON_CACHED_TOKENS,
        ge=0,
        description="Disaggregate when at least this many prompt tokens are not cached on the "
        "chosen decode pod (default 1024, from benchmarks.pd; 0 never disaggregates, which is "
        "upstream's default).",
    )
    promptTokens: int = Field(
        default=0,
        ge=0,
        description="And only prompts of at least this many tokens (0: no such bound).",
    )


def cached_tokens_on(request: LLMRequest, address: str) -> int | None:
    """Prompt tokens ``address`` holds, per the best evidence the request carries: the exact
    count from the KV-event index when a precise prefix plugin ran, else upstream's key (the
    ``approx-prefix-cache-producer``'s match), else any other producer's match; None when no
    prefix plugin looked at the request."""
    exact: Mapping[str, int] | None = request.data.get(PREFIX_MATCHED_TOKENS)
    if exact is not None:
        return exact.get(address, 0)
    info = request.data.get(prefix_match_info_key(UPSTREAM_PREFIX_PRODUCER))
    if not isinstance(info, PrefixMatchInfo):
        info = next(
            (
                value
                for key, value in request.data.items()
                if key.startswith(PREFIX_MATCH_INFO) and isinstance(value, PrefixMatchInfo)
            ),
            None,
        )
    if info is None:
        return None
    return info.matched_blocks.get(address, 0) * info.block_size


@register("prefix-based-pd-decider")
class PrefixBasedPDDecider(Plugin[PrefixDeciderParameters]):
    """Disaggregates when the prompt is at least ``nonCachedTokens`` long (and ``promptTokens``)
    and the part the chosen decode pod does not hold is at least ``nonCachedTokens``."""

    def disaggregate(self, request: LLMRequest, decode: Endpoint | None) -> bool:
        return uncached_on_decode(request, decode, self.p.nonCachedTokens, self.p.promptTokens) > 0


def uncached_on_decode(
    request: LLMRequest, decode: Endpoint | None, threshold: int, min_prompt: int = 0
) -> int:
    """The prompt tokens ``decode`` does not hold when ``prefix-based-pd-decider``'s rule
    would disaggregate the request (the prompt at least ``threshold`` and ``min_prompt``
    tokens, that many or more of them uncached), else 0."""
    if threshold == 0 or decode is None:
        return 0
    prompt = request.prompt_tokens
    if prompt < min_prompt or prompt < threshold:
        return 0
    cached = cached_tokens_on(request, decode.address)
    if cached is None:
        logger.debug("request %s: no prefix plugin matched the prompt", request.request_id)
        return 0
    uncached = prompt - cached
    return uncached if uncached >= threshold else 0


class LoadAwareDeciderParameters(BaseModel):
    model_config = ConfigDict(extra="forbid")

    nonCachedTokens: int = Field(
        default=16,
        ge=0,
        description="As prefix-based-pd-decider's: no smaller uncached part is disaggregated "
        "(default 16; 0 never disaggregates).",
    )


@register("load-aware-pd-decider")
class LoadAwarePDDecider(Plugin[LoadAwareDeciderParameters]):
    """``prefix-based-pd-decider``'s rule, and a prefill pod must have the prompt done no later
    than the decode pod would: the least prefill work queued on a prefill pod (tokens routed
    there and not yet computed, plus the part of this prompt it does not hold) is at most what
    the decode pod would have (its queued prefill plus its uncached part).  So prefill pods that
    keep up take every long enough prompt, and busy ones are not queued behind."""

    def disaggregate(self, request: LLMRequest, decode: Endpoint | None) -> bool:
        uncached = uncached_on_decode(request, decode, self.p.nonCachedTokens)
        if not uncached or decode is None:
            return False
        local = uncached + decode.load.in_flight_prefill_tokens
        prompt = request.prompt_tokens
        remote = None
        for endpoint in self.context.endpoints.endpoints():
            if endpoint.labels.get(ROLE_LABEL) not in PREFILL_ROLES:
                continue
            there = prompt - (cached_tokens_on(request, endpoint.address) or 0)
            work = endpoint.load.in_flight_prefill_tokens + there
            remote = work if remote is None else min(remote, work)
        return remote is not None and remote <= local


@register("always-disagg-pd-decider")
class AlwaysDisaggPDDecider(Plugin[NoParameters]):
    """Always prefills on a pod of its own (tests and benchmarks)."""

    def disaggregate(self, request: LLMRequest, decode: Endpoint | None) -> bool:
        return True


def has_multimodal_content(request: LLMRequest) -> bool:
    """True when a chat message carries an image, audio or video part."""
    for message in request.messages or ():
        content = message.get("content") if isinstance(message, Mapping) else None
        if isinstance(content, list) and any(
            isinstance(part, Mapping) and part.get("type") in MULTIMODAL_PART_TYPES
            for part in content
        ):
            return True
    return False


@register("always-disagg-multimodal-decider")
class AlwaysDisaggMultimodalDecider(Plugin[NoParameters]):
    """Sends a request to an encoder whenever it has image, audio or video parts."""

    def disaggregate(self, request: LLMRequest, decode: Endpoint | None) -> bool:
        return has_multimodal_content(request)


# ---------------------------------------------------------------------------------------------
# disagg-profile-handler


_STAGE_DEFAULTS: Final = {"decode": "decode", "prefill": "prefill", "encode": "encode"}


class StageProfiles(BaseModel):
    """Profile names per stage; an empty name means the default, as upstream."""

    model_config = ConfigDict(extra="forbid")

    decode: str = "decode"
    prefill: str = "prefill"
    encode: str = "encode"

    @field_validator("decode", "prefill", "encode", mode="before")
    @classmethod
    def _empty_is_default(cls, value: Any, info: ValidationInfo) -> Any:
        return _STAGE_DEFAULTS[str(info.field_name)] if value in ("", None) else value


class StageDeciders(BaseModel):
    """Decider plugin names per stage; empty or absent: that stage is not disaggregated."""

    model_config = ConfigDict(extra="forbid")

    prefill: str | None = None
    encode: str | None = None

    @field_validator("prefill", "encode", mode="before")
    @classmethod
    def _empty_is_none(cls, value: Any) -> Any:
        return None if value == "" else value


_LEGACY_KEYS: Final = {
    "decodeProfile": ("profiles", "decode"),
    "prefillProfile": ("profiles", "prefill"),
    "encodeProfile": ("profiles", "encode"),
    "prefillDeciderPluginName": ("deciders", "prefill"),
    "encodeDeciderPluginName": ("deciders", "encode"),
    "deciderPluginName": ("deciders", "prefill"),
}


class DisaggParameters(BaseModel):
    """``stageOrder``, ``profiles`` and ``deciders`` (llm-d-router's nested schema); its
    earlier flat keys (``decodeProfile``, ``prefillDeciderPluginName``, ...) are accepted alone,
    never mixed with the nested ones."""

    model_config = ConfigDict(extra="forbid")

    stageOrder: Literal["decode-first", "prefill-first"] = "decode-first"
    profiles: StageProfiles = Field(default_factory=StageProfiles)
    deciders: StageDeciders = Field(default_factory=StageDeciders)

    @model_validator(mode="before")
    @classmethod
    def _legacy_keys(cls, data: Any) -> Any:
        if not isinstance(data, Mapping):
            return data
        legacy = [k for k in data if k in _LEGACY_KEYS]
        if not legacy:
            return data
        nested = [k for k in data if k in ("profiles", "deciders")]
        if nested:
            raise ValueError(
                f"mixes the nested keys ({', '.join(nested)}) with the flat ones "
                f"({', '.join(legacy)}); use one format exclusively"
            )
        out: dict[str, Any] = {k: v for k, v in data.items() if k not in _LEGACY_KEYS}
        for key in sorted(legacy, key=lambda k: k == "deciderPluginName"):
            section, field = _LEGACY_KEYS[key]
            # deciderPluginName is the lower-priority alias of prefillDeciderPluginName.
            out.setdefault(section, {}).setdefault(field, data[key])
        return out

    @field_validator("stageOrder", mode="before")
    @classmethod
    def _stage_order(cls, value: Any) -> Any:
        if not isinstance(value, str):
            return value
        folded = value.lower().replace("-", "").replace("_", "")
        if folded in ("", "decodefirst", "decode"):
            return "decode-first"
        if folded in ("prefillfirst", "prefill"):
            return "prefill-first"
        raise ValueError(
            f'invalid stage order {value!r}, must be "decode-first" or "prefill-first"'
        )

    @model_validator(mode="after")
    def _prefill_first_has_no_decider(self) -> Self:
        if self.stageOrder == "prefill-first" and self.deciders.prefill is not None:
            raise ValueError("deciders.prefill is not supported with stageOrder prefill-first")
        return self


Results = Mapping[str, ProfileResult | None]


def _first(results: Results, profile: str) -> Endpoint | None:
    result = results.get(profile)
    return result.targets[0] if result is not None and result.targets else None


@register("disagg-profile-handler")
class DisaggProfileHandler(Plugin[DisaggParameters]):
    """Profile handler and PreRequest: see the module docstring."""

    def __init__(self, name: str, params: BaseModel, context: Any) -> None:
        super().__init__(name, params, context)
        self.profile_names = self.p.profiles
        self.prefill_decider: Decider | None = None
        self.encode_decider: Decider | None = None

    def bind(self, plugins: Mapping[str, object]) -> None:
        """Find the configured deciders among the declared plugins (by name, as upstream)."""
        for stage in ("prefill", "encode"):
            ref = getattr(self.p.deciders, stage)
            if ref is None:
                continue
            plugin = plugins.get(ref)
            if plugin is None:
                raise PluginConfigError(
                    f"{self.type_name} {self.name!r}: parameters.deciders.{stage}: no plugin "
                    f"named {ref!r} is declared"
                )
            if not isinstance(plugin, Decider):
                raise PluginConfigError(
                    f"{self.type_name} {self.name!r}: parameters.deciders.{stage}: {ref!r} "
                    f"({getattr(plugin, 'type_name', type(plugin).__name__)}) is not a decider; "
                    f"deciders: {', '.join(DECIDER_TYPES)}"
                )
            setattr(self, f"{stage}_decider", plugin)

    def pick_profiles(
        self, request: LLMRequest, profiles: Sequence[str], results: Results
    ) -> list[str]:
        names = self.profile_names
        if names.decode not in profiles:
            raise PluginConfigError(
                f"{self.type_name} {self.name!r}: no scheduling profile named "
                f"{names.decode!r} (configured: {', '.join(profiles)})"
            )
        if self.p.stageOrder == "prefill-first":
            return self._prefill_first(request, profiles, results)
        if names.decode not in results:
            return [names.decode]
        decode = _first(results, names.decode)
        if decode is None:
            return []
        for stage, decider in (("encode", self.encode_decider), ("prefill", self.prefill_decider)):
            profile = getattr(names, stage)
            if profile not in profiles or profile in results or decider is None:
                continue
            if decider.disaggregate(request, decode):
                if stage == "prefill":
                    request.data[PEER_ENDPOINT] = decode
                return [profile]
        return []

    def _prefill_first(
        self, request: LLMRequest, profiles: Sequence[str], results: Results
    ) -> list[str]:
        names = self.profile_names
        if names.decode in results:
            return []
        if names.prefill in profiles and names.prefill not in results:
            return [names.prefill]
        encoder = self.encode_decider
        if (
            names.encode in profiles
            and names.encode not in results
            and encoder is not None
            and encoder.disaggregate(request, None)
        ):
            return [names.encode]
        prefill = _first(results, names.prefill)
        if prefill is not None:
            request.data[PEER_ENDPOINT] = prefill
        return [names.decode]

    def process_results(self, request: LLMRequest, results: Results) -> SchedulingResult:
        names = self.profile_names
        if _first(results, names.decode) is None:
            raise AllEndpointsFilteredError(
                f"{self.type_name} {self.name!r}: no decode endpoint in profile "
                f"{names.decode!r} for the request"
            )
        kept = {name: r for name, r in results.items() if r is not None and r.targets}
        request.data[DISAGG_DECISION] = DisaggDecision(
            self.name,
            self.type_name,
            decision_type(names.encode in kept, names.prefill in kept),
        )
        return SchedulingResult(
            primary_profile=names.decode, profiles=kept, prefill_profile=names.prefill
        )

    def pre_request(self, request: LLMRequest, result: SchedulingResult) -> None:
        set_sidecar_headers(request, result, self.profile_names.prefill, self.profile_names.encode)


def set_sidecar_headers(
    request: LLMRequest, result: SchedulingResult, prefill_profile: str, encode_profile: str
) -> None:
    """The routing sidecar's headers from the results of the prefill and encode profiles: the
    first prefill target, every encode target; a header whose stage did not run (or found no
    pod) is removed, so a client's own value never reaches the sidecar."""
    prefill = result.profiles.get(prefill_profile)
    encode = result.profiles.get(encode_profile)
    request.set_headers[PREFILLER_HEADER] = (
        host_port(prefill.targets[0]) if prefill is not None and prefill.targets else None
    )
    request.set_headers[ENCODERS_HEADER] = (
        ",".join(host_port(e) for e in encode.targets)
        if encode is not None and encode.targets
        else None
    )


DECIDER_TYPES: Final = (
    "prefix-based-pd-decider",
    "load-aware-pd-decider",
    "always-disagg-pd-decider",
    "always-disagg-multimodal-decider",
)


# ---------------------------------------------------------------------------------------------
# data-parallel-profile-handler


class DataParallelParameters(BaseModel):
    model_config = ConfigDict(extra="forbid")

    primaryPort: int = Field(
        default=8000,
        ge=1,
        le=65535,
        description="The port Envoy is sent to on the chosen pod (the sidecar's rank-0 port).",
    )


@register("data-parallel-profile-handler")
class DataParallelProfileHandler(Plugin[DataParallelParameters]):
    """Runs the one profile; the destination is the chosen pod's ``primaryPort`` and the chosen
    rank's own ``ip:port`` goes in ``x-data-parallel-host-port``."""

    max_profiles: ClassVar[int] = 1

    def pick_profiles(
        self, request: LLMRequest, profiles: Sequence[str], results: Results
    ) -> list[str]:
        if len(profiles) != 1:
            raise PluginConfigError(
                f"{self.type_name} {self.name!r} runs exactly one scheduling profile, "
                f"but {len(profiles)} are configured ({', '.join(profiles)})"
            )
        return [] if results else [profiles[0]]

    def process_results(self, request: LLMRequest, results: Results) -> SchedulingResult:
        ((name, result),) = results.items()
        if result is None or not result.targets:
            raise AllEndpointsFilteredError(f"scheduling profile {name!r} chose no endpoint")
        port = self.p.primaryPort
        request.set_headers[DATA_PARALLEL_HEADER] = host_port(result.targets[0])
        destinations = tuple(f"{e.address.rpartition(':')[0]}:{port}" for e in result.targets)
        return SchedulingResult(
            primary_profile=name, profiles={name: result}, destinations=destinations
        )
