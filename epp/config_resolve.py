"""Completing and checking a parsed ``EndpointPickerConfig``: what the models alone cannot check
(plugin types and parameters, references between plugins, profiles and sections, each plugin's
roles), and the defaults llm-d-router fills in (injected producers, the profile handler and
picker).  `resolve_config` is idempotent; `epp.config` calls it on every config it loads and
again before building a scheduler."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any, Final

from pydantic import ValidationError

import scorers  # noqa: F401  (registers the built-in plugin types)
from epp.config_models import (
    DEFAULT_PICKER,
    DEFAULT_PROFILE,
    DEFAULT_PROFILE_HANDLER,
    ConfigError,
    EndpointPickerConfig,
    ProfilePluginRef,
    SchedulingProfileSpec,
    describe_errors,
)
from epp.config_sections import (
    PARSER_TYPES,
    PluginSpec,
    data_layer_problems,
    feature_gates,
    parser_types,
    producer_problems,
    saturation_detector,
    with_decider_producer,
    with_inline_detector,
    with_latency_producers,
    with_prefix_producer,
    with_token_producer,
)
from epp.flow_control import flow_control_settings
from scorers.base import (
    Plugin,
    PluginConfigError,
    known_types,
    plugin_class,
    unknown_type,
)

logger = logging.getLogger(__name__)


def plugin_roles(cls: type[Plugin[Any]]) -> frozenset[str]:
    """The scheduling roles a plugin class can play, from the methods it has: ``filter``,
    ``scorer``, ``picker``, ``profile-handler``.  (The protocols have a ``name`` attribute,
    so ``issubclass`` cannot check a class against them.)"""
    roles = set()
    if callable(getattr(cls, "filter", None)):
        roles.add("filter")
    if callable(getattr(cls, "score", None)):
        roles.add("scorer")
    if callable(getattr(cls, "pick", None)):
        roles.add("picker")
    if callable(getattr(cls, "pick_profiles", None)) and callable(
        getattr(cls, "process_results", None)
    ):
        roles.add("profile-handler")
    return frozenset(roles)


_PROFILE_ROLES: Final = frozenset({"filter", "scorer", "picker"})
_REQUEST_HOOKS: Final = (
    "request_header",
    "screen",
    "prepare",
    "admit",
    "pre_request",
    "response_header",
    "response_complete",
)


def _runs_per_request(cls: type[Plugin[Any]]) -> bool:
    """A request parser or a request-control plugin (request-header processor, screener, data
    producer, admitter, PreRequest, response-header processor, ResponseComplete): it acts on
    every request once declared, whatever the profiles say."""
    return cls.type_name in PARSER_TYPES or any(
        callable(getattr(cls, hook, None)) for hook in _REQUEST_HOOKS
    )


def resolve_config(config: EndpointPickerConfig, source: str = "<config>") -> EndpointPickerConfig:
    """Check what the models alone cannot (plugin types and parameters, references, roles)
    and fill in the defaults.  Returns a new, complete config; idempotent."""
    problems: list[str] = []
    plugins: list[PluginSpec] = []
    classes: dict[str, type[Plugin[Any]]] = {}  # name → class, for plugins whose type is known
    first_index: dict[str, int] = {}
    bad_handlers: list[str] = []
    last_unknown: int | None = None  # the known types are listed once, on the last of these

    with_detector, detector = with_inline_detector(config.plugins, config.saturationDetector)
    specs_in = with_prefix_producer(
        with_latency_producers(with_decider_producer(with_token_producer(with_detector, source)))
    )
    for index, spec in enumerate(specs_in):
        where = f"plugins[{index}]"
        if spec.name in first_index:
            problems.append(
                f"{where}.name: duplicate plugin name {spec.name!r} (also plugins"
                f"[{first_index[spec.name]}]); give each instance of a type its own name"
            )
            continue
        first_index[spec.name] = index
        try:
            cls = plugin_class(spec.type)
        except PluginConfigError:
            problems.append(f"{where}.type: {unknown_type(spec.type)}")
            last_unknown = len(problems) - 1
            continue
        try:
            cls.Parameters.model_validate(spec.parameters)
        except ValidationError as exc:
            problems.extend(describe_errors(exc, cls.Parameters, f"{where}.parameters"))
            if "profile-handler" in plugin_roles(cls):
                bad_handlers.append(spec.name)  # declared: only its parameters are wrong
            continue
        classes[spec.name] = cls
        plugins.append(spec)

    def roles_of(name: str) -> frozenset[str]:
        cls = classes.get(name)
        return plugin_roles(cls) if cls is not None else frozenset()

    def has_type(name: str, type_name: str) -> bool:
        cls = classes.get(name)
        return cls is not None and cls.type_name == type_name

    declared = list(dict.fromkeys(s.name for s in config.plugins))
    specs = list(config.schedulingProfiles)
    synthesized = not specs
    if synthesized:
        in_default = [n for n in declared if roles_of(n) & _PROFILE_ROLES]
        pickers = [n for n in in_default if "picker" in roles_of(n)]
        if len(pickers) > 1:
            problems.append(
                f"schedulingProfiles: none given, so every declared filter, scorer and picker "
                f"goes into one {DEFAULT_PROFILE!r} profile, but {len(pickers)} pickers are "
                f"declared ({', '.join(pickers)}); declare one picker or write the profiles"
            )
        specs = [
            SchedulingProfileSpec(
                name=DEFAULT_PROFILE, plugins=[ProfilePluginRef(pluginRef=n) for n in in_default]
            )
        ]

    profile_index: dict[str, int] = {}
    profiles: list[SchedulingProfileSpec] = []
    for p_index, profile in enumerate(specs):
        where = f"schedulingProfiles[{p_index}]"
        if profile.name in profile_index:
            problems.append(
                f"{where}.name: duplicate profile name {profile.name!r} "
                f"(also schedulingProfiles[{profile_index[profile.name]}])"
            )
            continue
        profile_index[profile.name] = p_index
        refs: list[ProfilePluginRef] = []
        pickers = []
        seen_refs: set[str] = set()
        for r_index, ref in enumerate(profile.plugins):
            ref_where = f"{where}.plugins[{r_index}].pluginRef"
            name = ref.pluginRef
            if name not in first_index:
                problems.append(
                    f"{ref_where}: {name!r} is not a declared plugin; declared plugins: "
                    f"{', '.join(declared) or '(none)'}"
                )
                continue
            if name in seen_refs:
                problems.append(f"{ref_where}: {name!r} is listed twice in this profile")
                continue
            seen_refs.add(name)
            if name in classes:
                roles = roles_of(name)
                if not roles & _PROFILE_ROLES:
                    if "profile-handler" not in roles and _runs_per_request(classes[name]):
                        # llm-d-router's profiles keep a plugin's filter, scorer and picker
                        # parts and skip the rest; its integration configs list parsers and
                        # request-control plugins there.
                        logger.info(
                            "%s: %r (%s) is not a filter, scorer or picker; the profile skips "
                            "it (it runs for every request, as declared in plugins)",
                            ref_where,
                            name,
                            classes[name].type_name,
                        )
                        continue
                    problems.append(
                        f"{ref_where}: {name!r} ({classes[name].type_name}) is not a filter, "
                        "scorer or picker, so it cannot be part of a profile"
                        + (
                            "; profile handlers are declared in plugins only"
                            if "profile-handler" in roles
                            else "; it runs for every request once declared in plugins"
                        )
                    )
                    continue
                if "picker" in roles:
                    pickers.append(name)
            refs.append(ref)
        if len(pickers) > 1 and not synthesized:  # else reported above
            problems.append(
                f"{where}.plugins: {len(pickers)} pickers ({', '.join(pickers)}); "
                "a profile uses exactly one"
            )
        if not pickers:
            picker = next((n for n in classes if has_type(n, DEFAULT_PICKER)), None)
            if picker is None:
                picker = _unused_name(DEFAULT_PICKER, first_index)
                spec = PluginSpec(name=picker, type=DEFAULT_PICKER)
                plugins.append(spec)
                first_index[picker] = -1  # added by default: taken, but not in the file
                classes[picker] = plugin_class(DEFAULT_PICKER)
            refs.append(ProfilePluginRef(pluginRef=picker))
        profiles.append(SchedulingProfileSpec(name=profile.name, plugins=refs))

    handlers = [n for n in classes if "profile-handler" in roles_of(n)]
    if len(handlers) > 1:
        problems.append(
            f"plugins: {len(handlers)} profile handlers ({', '.join(handlers)}); declare one"
        )
    elif bad_handlers:
        pass  # its parameters are reported; whether it fits the profiles is checked once fixed
    elif not handlers:
        if len(profiles) == 1:
            name = _unused_name(DEFAULT_PROFILE_HANDLER, first_index)
            plugins.append(PluginSpec(name=name, type=DEFAULT_PROFILE_HANDLER))
        elif len(profiles) > 1:
            problems.append(
                f"plugins: {len(profiles)} scheduling profiles need a profile handler to choose "
                f"between them; declare one ({DEFAULT_PROFILE_HANDLER} runs a single profile)"
            )
    else:
        limit = getattr(classes[handlers[0]], "max_profiles", None)
        if isinstance(limit, int) and len(profiles) > limit:
            problems.append(
                f"schedulingProfiles: {len(profiles)} profiles, but the profile handler "
                f"{handlers[0]!r} ({classes[handlers[0]].type_name}) runs at most {limit}"
            )

    types = {spec.name: spec.type for spec in with_detector}
    gates, gate_problems = feature_gates(config.featureGates)
    problems += gate_problems
    if gates["flowControl"]:
        try:
            flow_control_settings(config.flowControl, types)
        except ValueError as exc:
            problems.append(str(exc))
    if config.dataLayer is not None:
        problems += data_layer_problems(config.dataLayer, types)
    problems += parser_types(config.requestHandler, config.parser, types)[1]
    # With the producers added for a decider (`with_decider_producer`): a scorer wired to one
    # by `with_prefix_producer` names a plugin the file does not declare.
    problems += producer_problems(specs_in, {spec.name: spec.type for spec in specs_in})
    problems += saturation_detector(
        config.flowControl, detector, types, source, gate_on=gates["flowControl"]
    )[1]
    if last_unknown is not None:
        problems[last_unknown] += f"; {known_types()}"
    if problems:
        raise ConfigError(source, problems)
    return EndpointPickerConfig(
        apiVersion=config.apiVersion,
        kind=config.kind,
        plugins=plugins,
        schedulingProfiles=profiles,
        featureGates=config.featureGates,
        dataLayer=config.dataLayer,
        requestHandler=config.requestHandler,
        parser=config.parser,
        flowControl=config.flowControl,
        saturationDetector=detector,
    )


def _type_of(config: EndpointPickerConfig, name: str) -> str:
    return next((spec.type for spec in config.plugins if spec.name == name), "")


def _unused_name(base: str, taken: Mapping[str, object]) -> str:
    name, suffix = base, 2
    while name in taken:
        name, suffix = f"{base}-{suffix}", suffix + 1
    return name
