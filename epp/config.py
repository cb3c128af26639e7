"""The ``EndpointPickerConfig`` file: loading, defaults, and building the scheduler (the models
are `epp.config_models`; completing and checking a parsed config is `epp.config_resolve`).

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
while its ``flowControl`` feature gate is off, as upstream ignores them then.

Like the Inference Extension, the file is read once at start; changing it needs a restart.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Final, cast

import yaml
from pydantic import ValidationError

import scorers  # noqa: F401  (registers the built-in plugin types)
from epp.config_models import (
    API_VERSIONS,
    KIND,
    ConfigError,
    EndpointPickerConfig,
    ProfilePluginRef,
    SchedulingProfileSpec,
    describe_errors,
)
from epp.config_resolve import plugin_roles, resolve_config
from epp.config_sections import PluginSpec
from epp.scheduler import PluginDurationHook, Scheduler, SchedulerProfile, WeightedScorer
from scorers.base import (
    Filter,
    Picker,
    Plugin,
    PluginConfigError,
    PluginContext,
    ProfileHandler,
    create_plugin,
    plugin_class,
)

logger = logging.getLogger(__name__)


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
        raise ConfigError(source, describe_errors(exc, EndpointPickerConfig)) from None
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
