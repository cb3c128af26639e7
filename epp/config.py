"""The ``EndpointPickerConfig`` file: models, loading, defaults, and building the scheduler.

The format is the Inference Extension's (and llm-d's; both ``apiVersion`` values are accepted)::

    apiVersion: inference.networking.x-k8s.io/v1alpha1   # or llm-d.ai/v1alpha1
    kind: EndpointPickerConfig
    plugins:                          # plugin instances: a type name plus parameters
    - type: prefix-cache-scorer       # `name` defaults to the type; names must be unique
      parameters: {blockSize: 64}
    - name: picker
      type: max-score-picker
    schedulingProfiles:               # filters → weighted scorers → one picker
    - name: default
      plugins:
      - pluginRef: prefix-cache-scorer
        weight: 3                     # scorers only; float ≥ 0, default 1
      - pluginRef: picker

Defaults, as in the Inference Extension:

* no file at all → `DEFAULT_CONFIG_YAML`;
* no ``schedulingProfiles`` → one profile ``default`` with every declared filter, scorer and
  picker, in declaration order, weight 1;
* a profile without a picker → a ``max-score-picker`` (an existing instance of that type is
  reused, otherwise one is declared);
* one profile and no profile handler → a ``single-profile-handler``.

Strictness: a wrong file fails at start-up with one `ConfigError` listing every problem as
``<path of the field>: <what is wrong and what was expected>``; YAML syntax errors and duplicate
keys give the line and column.  Every unknown key or plugin type is an error; the keys of
llm-d-router's ``flowControl`` section that configure its queueing are logged as not applied
(the ``flowControl`` feature gate is off here, and upstream ignores them too then).

Like the Inference Extension, the file is read once at start; changing it needs a restart.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Final, Literal, cast, get_args, get_origin

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

import scorers  # noqa: F401  (registers the built-in plugin types)
from epp.config_sections import (
    PARSER_TYPES,
    DataLayerSpec,
    FlowControlSpec,
    PluginRef,
    PluginSpec,
    RequestHandlerSpec,
    SaturationDetectorSpec,
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
from epp.flow_control import FlowControlSettings, flow_control_settings
from epp.scheduler import PluginDurationHook, Scheduler, SchedulerProfile, WeightedScorer
from scorers.base import (
    Filter,
    Picker,
    Plugin,
    PluginConfigError,
    PluginContext,
    ProfileHandler,
    create_plugin,
    known_types,
    plugin_class,
    unknown_type,
)

logger = logging.getLogger(__name__)

API_VERSIONS: Final = ("inference.networking.x-k8s.io/v1alpha1", "llm-d.ai/v1alpha1")
KIND: Final = "EndpointPickerConfig"
DEFAULT_PROFILE: Final = "default"
DEFAULT_PICKER: Final = "max-score-picker"
DEFAULT_PROFILE_HANDLER: Final = "single-profile-handler"


DEFAULT_CONFIG_YAML: Final = """\
# kv-epp's default: route each request where its first token comes soonest, counting what the
# placement costs the requests after it.
# precise-prefix-cache-scorer is a data producer here (not weighted in the profile): it tokenizes
# and hashes the prompt as vLLM does and looks its blocks up in the index fed by the pods' KV
# events, plus predicted entries for requests routed in the last 2 s whose events have not
# arrived yet.  prefill-cost-scorer turns that into a cost per pod in tokens of prefill work:
# each uncached prompt token costs 1 to 2 (its prefill, plus the delay it imposes as the pod
# is busy) and 2 more when it copies what another pod computed into a full cache (eviction)
# + prefill already queued there + what each request in flight adds + the wait for KV room
# when the request does not fit in the pod's reported cache, the pod's own time scaled by how
# much slower it runs (speeds learned from the requests it served); max-score-picker takes
# the cheapest.  Nothing in it is fixed in tokens: it scales with
# the fleet.  Without a tokenizer for text prompts, or without KV events, this is least-work
# routing with KV room.  Benchmarks: docs/routing-results.md.
apiVersion: inference.networking.x-k8s.io/v1alpha1
kind: EndpointPickerConfig
plugins:
- type: precise-prefix-cache-scorer
  parameters:
    speculativeIndexing: true
    speculativeTTL: 2s
- type: prefill-cost-scorer
  parameters:
    uncachedTokenWeight: 4
    uncomputedTokenWeight: 2
- type: max-score-picker
- type: single-profile-handler
schedulingProfiles:
- name: default
  plugins:
  - pluginRef: prefill-cost-scorer
  - pluginRef: max-score-picker
"""
"""Used when no config file is given."""


class ConfigError(ValueError):
    """The configuration is invalid.  ``problems`` holds one ``path: message`` line per
    problem; the message starts with the source (file path, or ``<config text>``)."""

    def __init__(self, source: str, problems: Sequence[str]) -> None:
        self.source = source
        self.problems = tuple(problems)
        if len(self.problems) == 1:
            message = f"{source}: invalid EndpointPickerConfig: {self.problems[0]}"
        else:
            lines = "\n".join(f"  {p}" for p in self.problems)
            message = (
                f"{source}: invalid EndpointPickerConfig ({len(self.problems)} problems):\n{lines}"
            )
        super().__init__(message)


# ---------------------------------------------------------------------------------------------
# Models


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ProfilePluginRef(_Strict):
    """A plugin used by a profile; ``weight`` applies to scorers (float ≥ 0, default 1)."""

    pluginRef: str = Field(min_length=1)
    weight: float = Field(default=1.0, ge=0.0, allow_inf_nan=False)


class SchedulingProfileSpec(_Strict):
    name: str = Field(min_length=1)
    plugins: list[ProfilePluginRef] = Field(default_factory=list)

    @field_validator("plugins", mode="before")
    @classmethod
    def _null_plugins_are_empty(cls, value: Any) -> Any:
        return [] if value is None else value


class EndpointPickerConfig(_Strict):
    apiVersion: Literal[
        "inference.networking.x-k8s.io/v1alpha1",
        "llm-d.ai/v1alpha1",
    ]
    kind: Literal["EndpointPickerConfig"]
    plugins: list[PluginSpec] = Field(default_factory=list)
    schedulingProfiles: list[SchedulingProfileSpec] = Field(default_factory=list)
    # llm-d-router's sections (`epp.config_sections`).
    featureGates: list[str] = Field(default_factory=list)
    dataLayer: DataLayerSpec | None = None
    requestHandler: RequestHandlerSpec | None = None
    parser: PluginRef | None = None  # deprecated upstream: requestHandler.parsers
    flowControl: FlowControlSpec | None = None
    saturationDetector: SaturationDetectorSpec | None = None  # deprecated: flowControl's

    @property
    def plugin_types(self) -> dict[str, str]:
        """Declared plugin name → type."""
        return {spec.name: spec.type for spec in self.plugins}

    @property
    def flow_control_enabled(self) -> bool:
        """The ``flowControl`` feature gate."""
        return feature_gates(self.featureGates)[0]["flowControl"]

    @property
    def flow_control_settings(self) -> FlowControlSettings:
        """The ``flowControl`` section as `epp.flow_control` runs it (gate on)."""
        return flow_control_settings(self.flowControl, self.plugin_types)

    @property
    def saturation_detector(self) -> str | None:
        """The name of the plugin that says when sheddable requests are dropped, if named."""
        return saturation_detector(
            self.flowControl,
            self.saturationDetector,
            self.plugin_types,
            gate_on=self.flow_control_enabled,
            warn=False,  # resolve_config did, at load
        )[0]

    @property
    def parser_types(self) -> tuple[str, ...]:
        """The request parsers that run (``requestHandler.parsers``; all by default)."""
        return parser_types(self.requestHandler, self.parser, self.plugin_types)[0]

    @field_validator("plugins", "schedulingProfiles", "featureGates", mode="before")
    @classmethod
    def _null_lists_are_empty(cls, value: Any) -> Any:
        return [] if value is None else value


# ---------------------------------------------------------------------------------------------
# Loading


def load_config(path: str | Path | None = None, text: str | None = None) -> EndpointPickerConfig:
    """Read, validate and complete a configuration (see the module docstring for defaults).

    ``path``: a YAML file; ``text``: YAML text (``--config-text``); neither: the built-in
    default.  Raises `ConfigError`."""
    if path is not None and text is not None:
        raise ConfigError(str(path), ["give a config file or config text, not both"])
    if path is not None:
        source = str(path)
        try:
            text = Path(path).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
            raise ConfigError(source, [f"cannot read the file: {reason}"]) from None
    elif text is not None:
        source = "<config text>"
    else:
        source, text = "<built-in default config>", DEFAULT_CONFIG_YAML
    return parse_config(text, source)


def parse_config(text: str, source: str = "<config text>") -> EndpointPickerConfig:
    data = _load_yaml(text, source)
    if data is None:
        raise ConfigError(
            source, [f"the document is empty; expected a mapping with apiVersion and kind: {KIND}"]
        )
    if not isinstance(data, dict):
        raise ConfigError(
            source,
            [
                f"the document must be a mapping (apiVersion, kind, plugins, "
                f"schedulingProfiles), not a {type(data).__name__}"
            ],
        )
    try:
        config = EndpointPickerConfig.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(source, _describe(exc, EndpointPickerConfig)) from None
    return resolve_config(config, source)


class _StrictSafeLoader(yaml.SafeLoader):
    """A safe loader that rejects duplicate mapping keys (PyYAML silently keeps the last)."""


def _construct_mapping(loader: _StrictSafeLoader, node: yaml.MappingNode) -> dict[Any, Any]:
    loader.flatten_mapping(node)
    seen: dict[Any, yaml.Node] = {}
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=True)
        if key in seen:
            raise yaml.constructor.ConstructorError(
                "while constructing a mapping",
                node.start_mark,
                f"found duplicate key {key!r}",
                key_node.start_mark,
            )
        seen[key] = key_node
    return dict(loader.construct_pairs(node, deep=True))


_StrictSafeLoader.add_constructor(
    yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping
)


def _load_yaml(text: str, source: str) -> Any:
    try:
        return yaml.load(text, Loader=_StrictSafeLoader)  # a SafeLoader subclass
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark else ""
        problem = exc.problem or exc.context or "invalid YAML"
        context = f" ({exc.context})" if exc.context and exc.problem else ""
        raise ConfigError(source, [f"YAML syntax error at {where}{problem}{context}"]) from None
    except yaml.YAMLError as exc:
        raise ConfigError(source, [f"YAML syntax error: {exc}"]) from None


def _describe(exc: ValidationError, root: type[BaseModel], prefix: str = "") -> list[str]:
    """pydantic errors as ``path: message`` lines with Kubernetes-style paths
    (``plugins[2].parameters.threshold``)."""
    problems = []
    for error in exc.errors():
        loc = error["loc"]
        path = _format_path(loc, prefix)
        kind = error["type"]
        if kind == "extra_forbidden":
            allowed = _allowed_keys(root, loc)
            message = "unknown key" + (
                f"; expected one of: {', '.join(allowed)}" if allowed else ""
            )
        elif kind == "missing":
            message = "required field is missing"
        else:
            message = error["msg"].removeprefix("Value error, ")
            given = error.get("input")
            if not isinstance(given, dict | list):
                shown = repr(given)
                message += f" (got {shown if len(shown) <= 80 else shown[:77] + '...'})"
        problems.append(f"{path}: {message}" if path else message)
    return problems


def _format_path(loc: Sequence[int | str], prefix: str = "") -> str:
    path = prefix
    for part in loc:
        if isinstance(part, int):
            path += f"[{part}]"
        else:
            path += f".{part}" if path else str(part)
    return path


def _allowed_keys(root: type[BaseModel], loc: Sequence[int | str]) -> list[str]:
    """Field names of the model that holds the key at ``loc`` (for "did you mean" messages)."""
    model: type[BaseModel] = root
    for part in loc[:-1]:
        if isinstance(part, int):
            continue
        field = model.model_fields.get(part)
        if field is None:
            return []
        annotation = field.annotation
        while get_origin(annotation) in (list, tuple):
            annotation = get_args(annotation)[0]
        if not (isinstance(annotation, type) and issubclass(annotation, BaseModel)):
            return []
        model = annotation
    return [info.alias or name for name, info in model.model_fields.items()]


# ---------------------------------------------------------------------------------------------
# Completing and checking a parsed config


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
            problems.extend(_describe(exc, cls.Parameters, f"{where}.parameters"))
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


# ---------------------------------------------------------------------------------------------
# Building the scheduler


def build_scheduler(
    config: EndpointPickerConfig,
    context: PluginContext,
    *,
    on_plugin_duration: PluginDurationHook | None = None,
    prepare_timeout: float | None = None,
    allow_experimental_plugins: bool = False,
) -> Scheduler:
    """Instantiate every declared plugin (``scorers.base.create_plugin``) and assemble the
    profiles; Alpha plugins only with ``allow_experimental_plugins``.  Accepts a config straight from `load_config` or built in code (it is completed
    and checked again).  Raises `ConfigError`."""
    config = resolve_config(config)
    source = "<config>"
    instances: dict[str, Plugin[Any]] = {}
    problems: list[str] = []
    for index, spec in enumerate(config.plugins):
        if plugin_class(spec.type).experimental and not allow_experimental_plugins:
            problems.append(
                f"plugins[{index}]: plugin {spec.name!r} (type: {spec.type!r}) is Alpha "
                "(experimental) in llm-d-router; start the EPP with --allow-experimental-plugins "
                "to use it"
            )
            continue
        try:
            instances[spec.name] = create_plugin(spec.type, spec.name, spec.parameters, context)
        except PluginConfigError as exc:
            problems.append(f"plugins[{index}]: {exc}")
        except Exception as exc:
            raise ConfigError(
                source, [f"plugins[{index}] ({spec.type} {spec.name!r}): failed to start: {exc!r}"]
            ) from exc
    if problems:
        raise ConfigError(source, problems)
    for index, spec in enumerate(config.plugins):
        # Plugins that name others in their parameters (a profile handler's deciders) find
        # them once every plugin exists, as llm-d-router's plugin handle does.
        bind = getattr(instances[spec.name], "bind", None)
        if callable(bind):
            try:
                bind(instances)
            except PluginConfigError as exc:
                problems.append(f"plugins[{index}]: {exc}")
    if problems:
        raise ConfigError(source, problems)

    profiles = []
    for profile in config.schedulingProfiles:
        filters: list[Filter] = []
        weighted: list[WeightedScorer] = []
        picker: Picker | None = None
        for ref in profile.plugins:
            plugin: Any = instances[ref.pluginRef]
            roles = plugin_roles(type(plugin))
            if "filter" in roles:
                filters.append(plugin)
            if "scorer" in roles:
                weighted.append(WeightedScorer(plugin, ref.weight))
            if "picker" in roles:
                picker = plugin
        assert picker is not None  # resolve_config adds one
        profiles.append(SchedulerProfile(profile.name, filters, weighted, picker))

    handler = cast(
        ProfileHandler,
        next(p for p in instances.values() if "profile-handler" in plugin_roles(type(p))),
    )
    return Scheduler(
        profiles,
        handler,
        instances.values(),
        on_plugin_duration=on_plugin_duration,
        prepare_timeout=prepare_timeout,
    )


__all__ = [
    "API_VERSIONS",
    "DEFAULT_CONFIG_YAML",
    "ConfigError",
    "EndpointPickerConfig",
    "PluginSpec",
    "ProfilePluginRef",
    "SchedulingProfileSpec",
    "build_scheduler",
    "load_config",
    "parse_config",
    "plugin_roles",
    "resolve_config",
]
