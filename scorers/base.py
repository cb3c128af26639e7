"""The plugin framework: what a request and an endpoint look like to a plugin, the one-method
interfaces plugins implement, and the registry that maps YAML type names to plugin classes.

Modelled on the Inference Extension's EPP framework: a plugin is a type name plus parameters; a
scheduling profile runs filters, then weighted scorers, then a picker; a profile handler chooses
profiles.  A scorer returns a score in [0, 1] per candidate, keyed by endpoint address; the
profile clamps it, multiplies by the scorer's weight and sums.

Plugins are pure with respect to I/O: they read the `Endpoint` views the datastore keeps current
and the `LLMRequest` the parser built.  A plugin that needs CPU-heavy per-request work (tokenizing
a prompt) implements `DataProducer.prepare`, which the scheduler awaits before filtering.
"""

from __future__ import annotations

import difflib
import math
import random
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass, field
from typing import (
    TYPE_CHECKING,
    Any,
    ClassVar,
    Final,
    Generic,
    Literal,
    Protocol,
    TypeVar,
    cast,
    get_args,
    get_origin,
    runtime_checkable,
)

from pydantic import BaseModel, ConfigDict, ValidationError

if TYPE_CHECKING:
    from kvcache.views import KVCacheViews

# ---------------------------------------------------------------------------------------------
# Errors


class SchedulingError(Exception):
    """Base class for scheduling failures; each maps to one HTTP status in the ext_proc reply."""

    http_status: ClassVar[int] = 500


class NoReadyEndpointsError(SchedulingError):
    """No ready endpoint could serve the request (empty pool, empty subset hint)."""

    http_status = 503


class AllEndpointsFilteredError(SchedulingError):
    """Filters removed every candidate, or the pool is saturated and the request is shed."""

    http_status = 429


class AdmissionDeniedError(SchedulingError):
    """An admission plugin dropped the request (a sheddable one, under saturation)."""

    http_status = 429


class PluginConfigError(ValueError):
    """A plugin's type or parameters are invalid; the message names the field path."""


# ---------------------------------------------------------------------------------------------
# What plugins see


@dataclass(slots=True)
class EndpointMetrics:
    """The model server's own view of its state, scraped from its ``/metrics``."""

    waiting_requests: int = 0
    running_requests: int = 0
    kv_cache_usage: float = 0.0  # fraction 0..1 (vLLM's kv_cache_usage_perc is a fraction too)
    running_lora_adapters: frozenset[str] = frozenset()
    waiting_lora_adapters: frozenset[str] = frozenset()
    max_lora: int = 0
    block_size: int | None = None  # from vllm:cache_config_info
    num_gpu_blocks: int | None = None
    updated_at: float | None = None  # clock time of the last good scrape; None = never scraped


@dataclass(slots=True)
class EndpointLoad:
    """Load the EPP itself observes: requests it routed there that have not finished."""

    in_flight_requests: int = 0
    # Prompt tokens not served from cache, of requests routed there that have not produced their
    # first token yet: the prefill work queued on that pod, in tokens (docs/design.md,
    # "Decisions weigh work").
    in_flight_prefill_tokens: int = 0
    # The same tokens until their requests finish: the KV blocks this EPP's requests added
    # there (answers' growth not counted).
    in_flight_kv_tokens: int = 0
    # KV tokens this EPP's requests added to the pod since its metrics were last scraped, less
    # those of its requests that finished since (negative when more left than came): the change
    # the scraped KV usage does not show yet.
    kv_tokens_since_scrape: int = 0
    # ∫ in_flight_requests dt up to `area_at` (request-seconds, EPP clock): the time average of
    # the in-flight count over any interval, e.g. over one request's decode.
    in_flight_area: float = 0.0
    area_at: float = 0.0

    def advance_area(self, now: float) -> float:
        """Bring `in_flight_area` up to ``now`` (before any change of the count); returns it."""
        if now > self.area_at:
            self.in_flight_area += self.in_flight_requests * (now - self.area_at)
            self.area_at = now
        return self.in_flight_area


@dataclass(slots=True)
class Endpoint:
    """One routable target: a (pod, port) pair.  ``address`` ("ip:port") is its identity
    everywhere: the destination header, the KV index, the metrics labels."""

    address: str
    name: str = ""
    labels: Mapping[str, str] = field(default_factory=dict)
    metrics: EndpointMetrics = field(default_factory=EndpointMetrics)
    load: EndpointLoad = field(default_factory=EndpointLoad)
    metrics_stale: bool = False  # older than the saturation bound (see epp.datastore)
    metrics_age: float = math.inf  # seconds since the last good scrape (inf: never scraped)
    # Where the pod publishes vLLM KV events (ZMQ PUB) and serves replay (ROUTER), when known
    # from discovery; plugins that subscribe fall back to their own configured ports.
    kv_events_url: str | None = None
    replay_url: str | None = None
    # Data-parallel rank within its pod (0 for a pod with one target port): in central mode a
    # rank's events arrive on the EPP's port + rank under the pod's one topic.
    rank: int = 0

    @property
    def metrics_unknown(self) -> bool:
        """No scrape of the pod has succeeded yet: upstream's metrics "not updated", which its
        load scorers leave unscored.  Metrics that are merely old still describe the pod."""
        return self.metrics.updated_at is None

    @property
    def ip(self) -> str:
        host, _, _ = self.address.rpartition(":")
        return host.strip("[]")


RequestKind = Literal[
    "completions", "chat", "responses", "embeddings", "conversations", "messages", "other"
]

CHARS_PER_TOKEN_ESTIMATE: Final = 4
"""Prompt length estimate without tokens (the Inference Extension's "estimate" tokenizer
backend uses the same 4 bytes per token)."""


@dataclass(slots=True)
class LLMRequest:
    """One inference request as plugins see it, built by ``epp.requests`` from the HTTP body."""

    request_id: str
    model: str
    kind: RequestKind = "completions"
    path: str = ""
    headers: Mapping[str, str] = field(default_factory=dict)
    body: Mapping[str, Any] = field(default_factory=dict)
    prompt: str | list[int] | None = None  # /v1/completions
    # /v1/chat/completions; the conversation of /v1/messages and /v1/responses requests too
    messages: list[dict[str, Any]] | None = None
    cache_salt: str | None = None
    stream: bool = False
    # The model the client named, when a rewrite (header or InferenceModelRewrite) sent the
    # request to ``model`` instead.
    incoming_model: str | None = None
    # Its InferenceObjective's priority (0 without one); below 0 the request is sheddable.
    priority: int = 0
    # Filled by data producers before filtering: the prompt as the model server will tokenize it.
    prompt_token_ids: list[int] | None = None
    # Multimodal items placed in a pre-tokenized prompt's ids, ``(identifier, offset, length)``
    # (vLLM's generate ``features``): they enter the block hashes as vLLM's ``mm`` extra keys.
    prompt_mm_items: tuple[tuple[str, int, int], ...] = ()
    # Per-request data shared between plugins (the Inference Extension's CycleState).
    data: dict[str, Any] = field(default_factory=dict)
    # The body's length as received (flow control's queue bytes).
    body_bytes: int = 0
    # When its headers reached the EPP (time.monotonic()), as llm-d-router's
    # RequestReceivedTimestamp: ``slo-deadline-ordering-policy`` counts its SLO from there.
    # None for requests not built from an ext_proc stream.
    received_at: float | None = None
    # Headers the EPP sets on the forwarded request (a profile handler's or PreRequest plugin's:
    # the P/D sidecar's prefiller); None removes a header the client sent.
    set_headers: dict[str, str | None] = field(default_factory=dict)

    @property
    def client_model(self) -> str:
        """The model name the client sent (metrics' ``model_name``)."""
        return self.incoming_model or self.model

    @property
    def approx_prompt_chars(self) -> int:
        """Length of the prompt text, for plugins that work on characters."""
        if isinstance(self.prompt, str):
            return len(self.prompt)
        if self.messages is not None:
            return sum(_content_chars(m.get("content")) for m in self.messages)
        return 0

    @property
    def prompt_tokens(self) -> int:
        """The prompt's length in tokens: exact when a producer tokenized it or it is token
        ids, else estimated from characters."""
        if self.prompt_token_ids is not None:
            return len(self.prompt_token_ids)
        if isinstance(self.prompt, list):
            return len(self.prompt)
        return self.approx_prompt_chars // CHARS_PER_TOKEN_ESTIMATE


def _content_chars(content: Any) -> int:
    """Characters of a message's text: a list of parts counts its text parts only (an image's
    URL or base64 data is not prompt text)."""
    if isinstance(content, list):
        return sum(
            len(part.get("text") or "")
            for part in content
            if isinstance(part, dict) and isinstance(part.get("text"), str)
        )
    return len(str(content)) if content is not None else 0


@dataclass(slots=True, frozen=True)
class ScoredEndpoint:
    endpoint: Endpoint
    score: float


@dataclass(slots=True, frozen=True)
class ProfileResult:
    """What one scheduling profile chose: targets (primary first, then fallbacks) and the total
    weighted score of every candidate that survived the filters."""

    targets: tuple[Endpoint, ...]
    scores: Mapping[str, float]


@dataclass(slots=True, frozen=True)
class SchedulingResult:
    primary_profile: str
    profiles: Mapping[str, ProfileResult]
    # What Envoy is told when it differs from the primary targets' addresses: the
    # data-parallel handler sends a rank's request to its pod's primary port.
    destinations: tuple[str, ...] | None = None
    # The profile whose pod computes the prompt for the primary one (a P/D request's prefill
    # profile), when there is one: its pod gets the prefill work, the primary pulls the KV.
    prefill_profile: str | None = None

    @property
    def targets(self) -> tuple[Endpoint, ...]:
        return self.profiles[self.primary_profile].targets

    @property
    def prefill_address(self) -> str | None:
        """The pod that prefills for the primary, if another pod does."""
        result = self.profiles.get(self.prefill_profile) if self.prefill_profile else None
        if result is None or not result.targets:
            return None
        address = result.targets[0].address
        return None if self.targets and address == self.targets[0].address else address

    def chosen_addresses(self) -> list[str]:
        """The pods that will compute the request's prompt and so cache it: the primary
        target, and the prefill pod of a P/D request (not an encoder)."""
        chosen = [self.targets[0].address] if self.targets else []
        prefill = self.prefill_address
        return [*chosen, prefill] if prefill is not None else chosen


@dataclass(slots=True, frozen=True)
class Usage:
    """Token usage reported by the model server in its response (OpenAI ``usage``)."""

    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int | None = None


class EndpointSource(Protocol):
    """Read access to the current endpoints (implemented by ``epp.datastore.Datastore``)."""

    def endpoints(self) -> list[Endpoint]: ...

    def get(self, address: str) -> Endpoint | None: ...


class NoEndpoints:
    """An `EndpointSource` with no endpoint (checking a configuration, building plugins that
    need a context but no pool)."""

    def endpoints(self) -> list[Endpoint]:
        return []

    def get(self, address: str) -> Endpoint | None:
        return None


@dataclass(slots=True)
class PluginContext:
    """Services a plugin may use.  Tests and the routing benchmark build it with their own
    endpoint source and clock, which is how plugins stay free of I/O."""

    endpoints: EndpointSource
    clock: Callable[[], float] = time.monotonic
    rng: random.Random = field(default_factory=random.Random)
    executor: Executor | None = None  # bounded pool for CPU-heavy prepare steps
    # Tell the EPP an endpoint showed a sign of life (a KV-event batch from it arrived), so a
    # busy pod whose /metrics answers late is not taken for a dead one (epp.datastore).
    saw_alive: Callable[[str], None] = field(default=lambda address: None)
    # The KV-cache views plugins read (kvcache.views); whoever runs the plugins starts, feeds and
    # stops them.  Built in __post_init__ from this context's clock and saw_alive unless given
    # (the default None only means that).
    kv_caches: KVCacheViews = field(default=None)  # type: ignore[assignment]

    def __post_init__(self) -> None:
        if self.kv_caches is None:
            from kvcache.views import KVCacheViews  # kvcache reads this module's types

            self.kv_caches = KVCacheViews(clock=self.clock, saw_alive=self.saw_alive)


# ---------------------------------------------------------------------------------------------
# Plugin interfaces: one method each.  A plugin class may implement several.


class NoParameters(BaseModel):
    """The parameters of a plugin that takes none: ``class QueueScorer(Plugin[NoParameters])``."""

    model_config = ConfigDict(extra="forbid")


ParamsT = TypeVar("ParamsT", bound=BaseModel)


class Plugin(Generic[ParamsT]):
    """Base class of every plugin, generic over its pydantic parameter model (documented
    defaults and ranges; `NoParameters` for none)::

        @register("dynamo-cost-scorer")
        class DynamoCostScorer(Plugin[DynamoCostParameters]):
            ...  # self.p is a DynamoCostParameters

    `register` sets ``type_name``; the class attribute ``Parameters`` (what `create_plugin` and
    the config loader validate YAML against) is derived from the type argument.  Subclasses of
    a plugin inherit both.  The scheduler and the registry hold plugins as ``Plugin[Any]``."""

    type_name: ClassVar[str] = ""
    Parameters: ClassVar[type[BaseModel]] = NoParameters
    # Alpha in llm-d-router: the EPP refuses it unless started with --allow-experimental-plugins.
    experimental: ClassVar[bool] = False

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        # Only the class's own bases: ``class MaxScorePicker(_Picker)`` has none of its own and
        # keeps the ``Parameters`` it inherits.  A type variable (a generic intermediate class)
        # is not a model and leaves ``Parameters`` alone too.
        for base in cls.__dict__.get("__orig_bases__", ()):
            origin = get_origin(base)
            if isinstance(origin, type) and issubclass(origin, Plugin):
                (model,) = get_args(base)
                if isinstance(model, type) and issubclass(model, BaseModel):
                    cls.Parameters = model

    def __init__(self, name: str, params: BaseModel, context: PluginContext) -> None:
        if not isinstance(params, self.Parameters):
            raise TypeError(
                f"{type(self).__name__} {name!r} takes parameters of type "
                f"{self.Parameters.__name__}, not {type(params).__name__}; build them with "
                f"{type(self).__name__}.Parameters(...) or use create_plugin()"
            )
        self.name = name
        # `Parameters` is the ParamsT of this class (`__init_subclass__`), checked just above.
        self.p = cast(ParamsT, params)
        self.context = context


@runtime_checkable
class Filter(Protocol):
    name: str

    def filter(self, request: LLMRequest, endpoints: Sequence[Endpoint]) -> list[Endpoint]: ...


@runtime_checkable
class Scorer(Protocol):
    name: str

    def score(self, request: LLMRequest, endpoints: Sequence[Endpoint]) -> dict[str, float]: ...


@runtime_checkable
class Picker(Protocol):
    name: str

    def pick(self, request: LLMRequest, scored: Sequence[ScoredEndpoint]) -> list[Endpoint]: ...


@runtime_checkable
class ProfileHandler(Protocol):
    name: str

    def pick_profiles(
        self,
        request: LLMRequest,
        profiles: Sequence[str],
        results: Mapping[str, ProfileResult | None],
    ) -> list[str]:
        """Profiles to run next (empty when done), given the results so far (None: the
        profile's filters left no endpoint)."""
        ...

    def process_results(
        self, request: LLMRequest, results: Mapping[str, ProfileResult | None]
    ) -> SchedulingResult: ...


@runtime_checkable
class DataProducer(Protocol):
    """Computes per-request data before filtering (tokenization, prefix lookups)."""

    name: str

    async def prepare(self, request: LLMRequest, endpoints: Sequence[Endpoint]) -> None: ...


@runtime_checkable
class Admitter(Protocol):
    """Runs after the data producers, before scheduling: None admits the request, a string
    says why it is dropped (llm-d-router's Admitter)."""

    name: str

    def admit(self, request: LLMRequest, endpoints: Sequence[Endpoint]) -> str | None: ...


@runtime_checkable
class SaturationDetector(Protocol):
    """How full a set of endpoints is, 1.0 meaning saturated (llm-d-router's
    SaturationDetector): the ``utilization-detector`` and ``concurrency-detector``."""

    name: str

    def saturation(self, endpoints: Sequence[Endpoint]) -> float: ...


@runtime_checkable
class RequestHeaderProcessor(Protocol):
    """Runs once the request is assembled, before admission and flow control (llm-d-router's
    RequestHeaderProcessor): it may annotate ``request.data`` (``agent-identity``); raising a
    `SchedulingError` fails the request."""

    name: str

    def request_header(self, request: LLMRequest) -> None: ...


@runtime_checkable
class Screener(Protocol):
    """Narrows the candidates before data producers and every scheduling profile run
    (llm-d-router's Screener); each screener sees all candidates and only the endpoints every
    one of them keeps go on."""

    name: str

    def screen(self, request: LLMRequest, endpoints: Sequence[Endpoint]) -> list[Endpoint]: ...


@runtime_checkable
class ResponseHeaderProcessor(Protocol):
    """Runs when the model server's response headers arrive (llm-d-router's
    ResponseHeaderProcessor); ``endpoint`` is the one serving the request (None once it left
    the pool).  Headers for the client go in ``request.data`` (RESPONSE_HEADERS)."""

    name: str

    def response_header(self, request: LLMRequest, endpoint: Endpoint | None) -> None: ...


@runtime_checkable
class PreRequest(Protocol):
    """Runs after a decision, before the request is forwarded (record routing history, ...)."""

    name: str

    def pre_request(self, request: LLMRequest, result: SchedulingResult) -> None: ...


@runtime_checkable
class ResponseComplete(Protocol):
    """Runs when the response has been fully streamed back."""

    name: str

    def response_complete(
        self, request: LLMRequest, endpoint: str, usage: Usage | None
    ) -> None: ...


@runtime_checkable
class EndpointListener(Protocol):
    """Told when endpoints come and go (to subscribe to their KV events, drop their state)."""

    name: str

    def endpoint_added(self, endpoint: Endpoint) -> None: ...

    def endpoint_removed(self, endpoint: Endpoint) -> None: ...


@runtime_checkable
class Lifecycle(Protocol):
    """Plugins with background work (ZMQ subscriptions) start and stop with the server."""

    name: str

    async def start(self) -> None: ...

    async def stop(self) -> None: ...


# ---------------------------------------------------------------------------------------------
# Registry

PluginT = TypeVar("PluginT", bound=type[Plugin[Any]])
_REGISTRY: dict[str, type[Plugin[Any]]] = {}


def register(type_name: str) -> Callable[[PluginT], PluginT]:
    """Class decorator: make a plugin available under the type name users write in YAML."""

    def decorate(cls: PluginT) -> PluginT:
        if type_name in _REGISTRY and _REGISTRY[type_name] is not cls:
            raise PluginConfigError(f"plugin type {type_name!r} is registered twice")
        cls.type_name = type_name
        _REGISTRY[type_name] = cls
        return cls

    return decorate


def registered_types() -> list[str]:
    return sorted(_REGISTRY)


def unknown_type(type_name: str) -> str:
    """The problem with an unregistered ``type_name``, naming the nearest known types: a typo
    is the usual cause, and the whole list (60-odd names) is too long to read per plugin."""
    near = difflib.get_close_matches(type_name, registered_types(), n=3, cutoff=0.6)
    hint = f" (did you mean {' or '.join(repr(n) for n in near)}?)" if near else ""
    return f"unknown plugin type {type_name!r}{hint}"


def known_types() -> str:
    return f"known types: {', '.join(registered_types())}"


def plugin_class(type_name: str) -> type[Plugin[Any]]:
    try:
        return _REGISTRY[type_name]
    except KeyError:
        raise PluginConfigError(f"{unknown_type(type_name)}; {known_types()}") from None


def create_plugin(
    type_name: str, name: str, parameters: Mapping[str, Any] | None, context: PluginContext
) -> Plugin[Any]:
    """Instantiate a registered plugin, validating its parameters.  Errors name the bad field
    as ``parameters.<path>``; the config loader prefixes the plugin's position."""
    cls = plugin_class(type_name)
    try:
        params = cls.Parameters.model_validate(dict(parameters or {}))
    except ValidationError as exc:
        problems = "; ".join(
            f"parameters.{'.'.join(str(p) for p in err['loc'])}: {err['msg']}"
            for err in exc.errors()
        )
        raise PluginConfigError(f"plugin {name!r} ({type_name}): {problems}") from None
    return cls(name, params, context)
