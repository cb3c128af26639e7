"""llm-d-router's top-level sections of an EndpointPickerConfig beyond plugins and profiles:
``featureGates``, ``dataLayer``, ``requestHandler`` (and its deprecated form ``parser``), and
the references between plugins its split prefix pipeline uses.

* ``featureGates``: a list of ``name`` / ``name=true|false``.  llm-d-router registers two:
  ``flowControl`` (off by default; on, requests wait in priority bands: `epp.flow_control`) and
  ``haPopulateNonLeaderDatastore`` (on by default; every replica here keeps its own datastore,
  so either value describes it).  An unknown gate is an error, as upstream.
* ``dataLayer``: ``sources`` with their ``extractors``, each a declared plugin: a
  ``metrics-data-source`` with ``core-metrics-extractor``, an ``endpoint-notification-source``
  with a precise prefix plugin (its KV-event subscriptions follow the endpoints), a
  ``dcgm-data-source`` with ``dcgm-extractor``, a ``models-data-source`` with
  ``models-data-extractor``.  That is what this EPP does built in, so other pairings, and
  ``discovery`` (use the InferencePool, ``--endpoints`` or ``--endpoints-file``), are errors.
  ``injectDefaults`` is accepted.
* ``requestHandler.parsers``: which parsers run (``openai-parser``, ``anthropic-parser``,
  ``vllmhttp-parser``, ``passthrough-parser``, ``vllmgrpc-parser``, ``sglanghttp-parser``,
  ``vertexai-parser``, each declared); default the first four, llm-d-router's default list.
* ``flowControl.saturationDetector`` (or the deprecated top-level ``saturationDetector``) names
  the ``utilization-detector`` that measures the pool's saturation: when sheddable requests are
  dropped, or, with the ``flowControl`` gate, when waiting requests are dispatched; with the
  gate off the section's queueing keys are logged as not applied, as upstream.
* ``prefixMatchInfoProducerName`` in a plugin's parameters must name a declared prefix
  producer (precise, ``approx-prefix-cache-producer`` or ``burst-prefix-cache-producer``); a
  ``prefix-cache-scorer`` naming none reads the one approximate producer declared, if any; a
  ``token-producer``'s ``modelName`` becomes the ``tokenizer`` of every precise prefix plugin
  that names none.
* The predicted-latency plugins that name no producer get upstream's defaults created, as its
  loader creates them: a ``predicted-latency-producer`` and an ``approx-prefix-cache-producer``
  (`with_latency_producers`).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any, Final

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

logger = logging.getLogger(__name__)

FEATURE_GATES: Final[Mapping[str, bool]] = {
    "flowControl": False,
    "haPopulateNonLeaderDatastore": True,
}
PARSER_TYPES: Final = (
    "openai-parser",
    "anthropic-parser",
    "vllmhttp-parser",
    "passthrough-parser",
    "vllmgrpc-parser",
    "sglanghttp-parser",
    "vertexai-parser",
)
# The parsers that run when the configuration names none, as llm-d-router's loader
# (pkg/epp/config/loader/defaults.go, ensureParsers); the others only when asked for.
DEFAULT_PARSER_TYPES: Final = PARSER_TYPES[:4]
PRECISE_TYPES: Final = ("precise-prefix-cache-producer", "precise-prefix-cache-scorer")
BURST_PRODUCER_TYPE: Final = "burst-prefix-cache-producer"
PREFIX_PRODUCER_TYPES: Final = (
    *PRECISE_TYPES,
    "approx-prefix-cache-producer",
    BURST_PRODUCER_TYPE,
)
# prefix-cache-scorer parameters of its own approximate index (unused with a producer).
_OWN_INDEX_KEYS: Final = frozenset(
    {"blockSize", "hashBlockSize", "maxPrefixBlocksToMatch", "lruCapacityPerServer"}
)
# Which data sources feed which extractors here (what this EPP does built in).
_EXTRACTORS: Final[dict[str, tuple[str, ...]]] = {
    "metrics-data-source": ("core-metrics-extractor",),
    # mm-embeddings-cache-producer: scorers.multimodal_cache (forgets removed endpoints).
    "endpoint-notification-source": (*PRECISE_TYPES, "mm-embeddings-cache-producer"),
    "dcgm-data-source": ("dcgm-extractor",),  # scorers.gpu_metrics, epp.dcgm_scraping
    "models-data-source": ("models-data-extractor",),  # scorers.models_data, epp.models_scraping
}
# token-producer and its deprecated name (scorers.deprecated_types).
TOKEN_PRODUCER_TYPES: Final = ("token-producer", "tokenizer")


@contextmanager
def extra_data_source(source_type: str, extractor_types: Sequence[str] = ()) -> Iterator[None]:
    """Accept ``source_type`` in ``dataLayer.sources`` (feeding ``extractor_types``) while the
    block runs.  For data sources a test suite registers, as llm-d-router's integration harness
    registers its ``mock-metrics-source``; the EPP itself never calls it."""
    if source_type in _EXTRACTORS:
        raise ValueError(f"data source type {source_type!r} is already accepted")
    _EXTRACTORS[source_type] = tuple(extractor_types)
    try:
        yield
    finally:
        del _EXTRACTORS[source_type]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class PluginSpec(_Strict):
    """One plugin instance: ``type`` is a registered type name; ``name`` (default: the type)
    is what profiles reference; ``parameters`` are validated by the type's own model."""

    name: str = Field(min_length=1)
    type: str = Field(min_length=1)
    parameters: dict[str, Any] = Field(default_factory=dict)

    @model_validator(mode="before")
    @classmethod
    def _name_defaults_to_type(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("name") is None and "type" in data:
            return {**data, "name": data["type"]}
        return data

    @field_validator("parameters", mode="before")
    @classmethod
    def _null_parameters_are_empty(cls, value: Any) -> Any:
        return {} if value is None else value


class PluginRef(_Strict):
    pluginRef: str


class DataSourceSpec(_Strict):
    pluginRef: str
    extractors: list[PluginRef] = Field(default_factory=list)


class DataLayerSpec(_Strict):
    sources: list[DataSourceSpec] = Field(default_factory=list)
    discovery: PluginRef | None = None
    injectDefaults: bool = True


class RequestHandlerSpec(_Strict):
    parsers: list[PluginRef] = Field(default_factory=list)


def feature_gates(gates: Sequence[str]) -> tuple[dict[str, bool], list[str]]:
    """The gates' values and the problems with them."""
    values = dict(FEATURE_GATES)
    problems = []
    for i, gate in enumerate(gates):
        name, _, text = gate.partition("=")
        name = name.strip()
        value = text.strip().lower() if text else "true"
        if name not in FEATURE_GATES:
            problems.append(
                f"featureGates[{i}]: feature gate {name!r} is unknown; known: "
                f"{', '.join(FEATURE_GATES)}"
            )
            continue
        if value not in ("true", "false", "1", "0"):
            problems.append(f"featureGates[{i}]: {gate!r}: the value must be true or false")
            continue
        values[name] = value in ("true", "1")
    return values, problems


class FlowControlSpec(_Strict):
    """llm-d-router's ``flowControl`` section (`epp.flow_control.flow_control_settings` reads
    it with the gate on; with it off only ``saturationDetector`` applies, as upstream)."""

    saturationDetector: PluginRef | None = None
    usageLimitPolicyPluginRef: str | None = None
    maxBytes: Any = None
    maxRequests: Any = None
    defaultRequestTTL: Any = None
    noEndpointRequestTTL: Any = None
    defaultPriorityBand: Any = None
    defaultNegativePriorityBand: Any = None
    priorityBands: Any = None
    enableEviction: Any = None


SATURATION_DETECTOR_TYPES: Final = ("utilization-detector", "concurrency-detector")


class SaturationDetectorSpec(_Strict):
    """The top-level ``saturationDetector``: a ``pluginRef`` (the Inference Extension v1.5 and
    llm-d-router, deprecated there for ``flowControl.saturationDetector``), or the utilization
    detector's thresholds inline (the Inference Extension v1.2 to v1.4)."""

    pluginRef: str | None = None
    queueDepthThreshold: int | None = None
    kvCacheUtilThreshold: float | None = None
    metricsStalenessThreshold: str | None = None

    def inline(self) -> dict[str, Any]:
        return {k: v for k, v in self.model_dump(exclude={"pluginRef"}).items() if v is not None}


def with_inline_detector(
    plugins: Sequence[PluginSpec], spec: SaturationDetectorSpec | None
) -> tuple[list[PluginSpec], SaturationDetectorSpec | None]:
    """A top-level ``saturationDetector`` with thresholds becomes a declared
    ``utilization-detector`` with them as parameters, and the section a reference to it."""
    if spec is None or not spec.inline():
        return list(plugins), spec
    if spec.pluginRef is not None:
        return list(plugins), spec  # both forms: reported by saturation_detector
    names = {p.name for p in plugins}
    name, suffix = "utilization-detector", 2
    while name in names:
        name, suffix = f"utilization-detector-{suffix}", suffix + 1
    detector = PluginSpec(name=name, type="utilization-detector", parameters=spec.inline())
    return [*plugins, detector], SaturationDetectorSpec(pluginRef=name)


def saturation_detector(
    flow_control: FlowControlSpec | None,
    deprecated: SaturationDetectorSpec | None,
    types: Mapping[str, str],
    source: str = "<config>",
    gate_on: bool = False,
    warn: bool = True,
) -> tuple[str | None, list[str]]:
    """The detector plugin the configuration names (``flowControl.saturationDetector``, else
    the deprecated top-level ``saturationDetector``), and the problems of these sections
    (``warn``: also log the settings a closed gate leaves unused, once, at load)."""
    problems: list[str] = []
    ref, where = None, ""
    if flow_control is not None:
        unused = sorted(
            k for k, v in flow_control.model_dump(exclude={"saturationDetector"}).items() if v
        )
        if unused and not gate_on and warn:
            logger.warning(
                "%s: flowControl.%s: not applied: the flowControl feature gate is off (as "
                "llm-d-router, which ignores them then)",
                source,
                ", flowControl.".join(unused),
            )
        if flow_control.saturationDetector is not None:
            ref, where = flow_control.saturationDetector.pluginRef, "flowControl.saturationDetector"
    if deprecated is not None and deprecated.pluginRef is not None and deprecated.inline():
        problems.append(
            "saturationDetector: give pluginRef or the thresholds ("
            + ", ".join(deprecated.inline())
            + "), not both"
        )
    if ref is None and deprecated is not None:
        ref, where = deprecated.pluginRef, "saturationDetector"
    if ref is None:
        return None, problems
    kind = types.get(ref)
    if kind is None:
        problems.append(f"{where}.pluginRef: {ref!r} is not a declared plugin")
    elif kind not in SATURATION_DETECTOR_TYPES:
        problems.append(
            f"{where}.pluginRef: {ref!r} ({kind}) is not a saturation detector; detectors: "
            f"{', '.join(SATURATION_DETECTOR_TYPES)}"
        )
    return ref, problems


def data_layer_problems(spec: DataLayerSpec, types: Mapping[str, str]) -> list[str]:
    """``types``: declared plugin name → type."""
    problems = []
    if spec.discovery is not None:
        problems.append(
            "dataLayer.discovery: endpoints come from the InferencePool (--pool-name), "
            "--endpoints or --endpoints-file here"
        )
    for i, source in enumerate(spec.sources):
        where = f"dataLayer.sources[{i}]"
        kind = types.get(source.pluginRef)
        if kind is None:
            problems.append(f"{where}.pluginRef: {source.pluginRef!r} is not a declared plugin")
            continue
        if kind not in _EXTRACTORS:
            problems.append(
                f"{where}.pluginRef: {source.pluginRef!r} ({kind}) is not a data source here; "
                f"sources: {', '.join(_EXTRACTORS)}"
            )
            continue
        for j, extractor in enumerate(source.extractors):
            extractor_type = types.get(extractor.pluginRef)
            if extractor_type is None:
                problems.append(
                    f"{where}.extractors[{j}].pluginRef: {extractor.pluginRef!r} is not a "
                    "declared plugin"
                )
            elif extractor_type not in _EXTRACTORS[kind]:
                problems.append(
                    f"{where}.extractors[{j}].pluginRef: {extractor.pluginRef!r} "
                    f"({extractor_type}) does not read {kind}; it reads: "
                    f"{', '.join(_EXTRACTORS[kind])}"
                )
    return problems


def parser_types(
    handler: RequestHandlerSpec | None, parser: PluginRef | None, types: Mapping[str, str]
) -> tuple[tuple[str, ...], list[str]]:
    """The parser types that run, and the problems with the references."""
    # As llm-d-router's loader: requestHandler.parsers wins; the deprecated parser is used
    # when it names none.
    refs = list(handler.parsers) if handler is not None else []
    if not refs and parser is not None:
        refs, handler = [parser], None
    if not refs:
        return DEFAULT_PARSER_TYPES, []
    chosen, problems = [], []
    for i, ref in enumerate(refs):
        where = f"requestHandler.parsers[{i}]" if handler is not None else "parser"
        kind = types.get(ref.pluginRef)
        if kind is None:
            problems.append(f"{where}.pluginRef: {ref.pluginRef!r} is not a declared plugin")
        elif kind not in PARSER_TYPES:
            problems.append(
                f"{where}.pluginRef: {ref.pluginRef!r} ({kind}) is not a parser; parsers: "
                f"{', '.join(PARSER_TYPES)}"
            )
        else:
            chosen.append(kind)
    return tuple(dict.fromkeys(chosen)), problems


def producer_problems(plugins: Sequence[Any], types: Mapping[str, str]) -> list[str]:
    """``prefixMatchInfoProducerName`` references (``plugins``: the declared `PluginSpec`s)."""
    problems = []
    for i, spec in enumerate(plugins):
        producer = (spec.parameters or {}).get("prefixMatchInfoProducerName")
        if not producer:
            continue
        where = f"plugins[{i}].parameters.prefixMatchInfoProducerName"
        own = sorted(set(spec.parameters or {}) & _OWN_INDEX_KEYS)
        if spec.type == "prefix-cache-scorer" and own:
            problems.append(
                f"plugins[{i}].parameters: {', '.join(own)} size the scorer's own index, which "
                f"is not used when it reads {producer!r}; set them on the producer"
            )
        kind = types.get(producer)
        if kind is None:
            problems.append(f"{where}: {producer!r} is not a declared plugin")
        elif kind not in PREFIX_PRODUCER_TYPES:
            problems.append(
                f"{where}: {producer!r} ({kind}) is not a prefix producer; producers: "
                f"{', '.join(PREFIX_PRODUCER_TYPES)}"
            )
    return problems


def with_prefix_producer(plugins: Sequence[Any]) -> list[Any]:
    """``plugins`` with each ``prefix-cache-scorer`` that names no producer reading the plugin
    named ``approx-prefix-cache-producer``, as llm-d-router wires it by default (without one,
    the scorer keeps its own approximate index, the Inference Extension's)."""
    default = "approx-prefix-cache-producer"  # upstream binds the producer of this name
    if not any(spec.name == default and spec.type == default for spec in plugins):
        return list(plugins)
    out = []
    for spec in plugins:
        params = dict(spec.parameters or {})
        if spec.type == "prefix-cache-scorer" and not params.get("prefixMatchInfoProducerName"):
            params["prefixMatchInfoProducerName"] = default
            spec = spec.model_copy(update={"parameters": params})
        out.append(spec)
    return out


def with_decider_producer(plugins: Sequence[PluginSpec]) -> list[PluginSpec]:
    """``plugins`` with an ``approx-prefix-cache-producer`` added when a
    ``prefix-based-pd-decider`` is declared and no prefix producer is: the decider needs to
    know what the decode pod holds, and llm-d-router creates that producer for it too."""
    types = {spec.type for spec in plugins}
    names = {spec.name for spec in plugins}
    default = "approx-prefix-cache-producer"
    # A burst producer's match is a placement, not what a pod caches; upstream's decider reads
    # only the approximate producer's key and creates one beside a burst producer.
    cache_producers = set(PREFIX_PRODUCER_TYPES) - {BURST_PRODUCER_TYPE}
    if "prefix-based-pd-decider" not in types or types & cache_producers:
        return list(plugins)
    name, suffix = default, 2
    while name in names:  # the decider reads any producer's match, whatever its name
        name, suffix = f"{default}-{suffix}", suffix + 1
    return [*plugins, PluginSpec(name=name, type=default)]


LATENCY_PRODUCER_TYPE: Final = "predicted-latency-producer"
# The plugins that read a predicted-latency producer's predictions, and those that read a prefix
# producer's match, under upstream's default producer names when they name none
# (`scorers.predicted_latency`, `scorers.latency_slo`, `scorers.prefix_affinity_filter`,
# `scorers.p2p_source`).
_LATENCY_CONSUMERS: Final = frozenset(
    {"latency-scorer", "slo-headroom-tier-filter", "latency-slo-admitter"}
)
_PREFIX_CONSUMERS: Final = frozenset(
    {
        LATENCY_PRODUCER_TYPE,
        "latency-scorer",
        "prefix-cache-affinity-filter",
        "p2p-source-producer",
    }
)


def _reads_default_predictions(spec: PluginSpec) -> bool:
    params = spec.parameters or {}
    if params.get("latencyPredictionInfoProducerName"):
        return False
    if spec.type == "prefix-cache-affinity-filter":  # only its load gate reads them
        return (
            params.get("ttftSource") == "latencyPredictor"
            and params.get("maxTTFTPenaltyMs", 18000) != 0  # upstream's default gate: on
        )
    return spec.type in _LATENCY_CONSUMERS


def _reads_default_prefix_match(spec: PluginSpec) -> bool:
    params = spec.parameters or {}
    return spec.type in _PREFIX_CONSUMERS and not params.get("prefixMatchInfoProducerName")


def with_latency_producers(plugins: Sequence[PluginSpec]) -> list[PluginSpec]:
    """``plugins`` with the producers llm-d-router creates for its predicted-latency plugins
    when one names none and no plugin has the default name: a ``predicted-latency-producer``
    for ``latency-scorer``, ``slo-headroom-tier-filter``, ``latency-slo-admitter`` (and a
    ``prefix-cache-affinity-filter`` whose load gate reads predictions), then an
    ``approx-prefix-cache-producer`` for those that read a prefix match, a
    ``p2p-source-producer`` included (which `with_prefix_producer` then also gives a
    ``prefix-cache-scorer`` naming none, as upstream binds that scorer to the producer it
    created)."""
    out = list(plugins)
    for default, reads in (
        (LATENCY_PRODUCER_TYPE, _reads_default_predictions),
        ("approx-prefix-cache-producer", _reads_default_prefix_match),
    ):
        if any(map(reads, out)) and all(spec.name != default for spec in out):
            out.append(PluginSpec(name=default, type=default))
    return out


def with_token_producer(plugins: Sequence[Any], source: str) -> list[Any]:
    """``plugins`` with a ``token-producer``'s ``modelName`` as the ``tokenizer`` of each
    precise prefix plugin that names none (llm-d-router's producers take their tokens from the
    token producer)."""
    models = [
        (spec.parameters or {}).get("modelName")
        for spec in plugins
        if spec.type in TOKEN_PRODUCER_TYPES
    ]
    model = next((m for m in models if m), None)
    if model is None:
        return list(plugins)
    if not any(spec.type in PRECISE_TYPES for spec in plugins):
        # Upstream's approximate producers read its tokens; here they work on characters, so
        # the tokenizer is not even loaded.
        logger.info(
            "%s: token-producer: no plugin of this configuration reads token ids (the "
            "approximate prefix producers work on characters here); %s is not loaded",
            source,
            model,
        )
        return list(plugins)
    out = []
    for spec in plugins:
        params = dict(spec.parameters or {})
        if (
            spec.type in PRECISE_TYPES
            and not params.get("tokenizer")
            and not params.get("tokenizers")
        ):
            params["tokenizer"] = model
            spec = spec.model_copy(update={"parameters": params})
        elif spec.type in TOKEN_PRODUCER_TYPES and params.get("vllm"):
            logger.info(
                "%s: token-producer: prompts are tokenized in this EPP with %s's tokenizer and "
                "chat template (the ids vLLM's /render at %s gives)",
                source,
                model,
                params["vllm"].get("url", "the pod"),
            )
        out.append(spec)
    return out
