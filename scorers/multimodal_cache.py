"""``mm-embeddings-cache-producer`` and ``mm-embeddings-cache-scorer``: send a request whose
images, videos or audio clips a pod has recently encoded back to that pod, so vLLM's encoder
cache there skips encoding them again (llm-d-router, Beta; upstream sources
``pkg/epp/framework/plugins/requestcontrol/dataproducer/multimodal/`` and
``pkg/epp/framework/plugins/scheduling/scorer/mmcacheaffinity/``).

Neither plugin sees a pod's real encoder cache: the producer remembers, per endpoint, the media
items of the requests it routed there, in an LRU with room for ``cacheSizeInMBPerServer`` MiB at
an assumed 2 MiB per item (upstream's fixed estimate, not a measurement), so the default 4096
MiB remembers 2048 items per endpoint.  It is a best-effort routing signal, never a correctness
dependency.

* The producer's `prepare` lists the request's distinct media items and counts, for each
  candidate, how many its LRU holds; the answer goes to ``request.data`` under
  `encoder_cache_match_key` (its plugin name).  Looking up does not refresh an item (upstream's
  ``Contains``).  PreRequest adds the items to the LRU of every target of the primary profile,
  refreshing those already there; removing an endpoint forgets its LRU.
* The scorer gives each candidate the fraction of the request's items it holds, in [0, 1]; a
  request without media scores 0 everywhere, which changes no ranking.

What identifies an item: upstream takes the content hashes its ``token-producer`` reports (vLLM's
``mm_hashes`` from ``/render``, or with the tokenizer-free backend an xxhash of the image or
video URL).  This EPP tokenizes in-process and has no vLLM hashes, so an item is its part's
``uuid`` when the client sent one (vLLM then caches the item under that id instead of hashing
its pixels) and otherwise its URL, data URL or base64 payload.  Unlike vLLM's pixel hash, the
same image sent once by URL and once inline counts as two items.  Parts read: a chat request's
``image_url``, ``video_url``, ``input_audio`` and ``audio_url``; an Anthropic Messages request's
``image`` blocks, also inside ``tool_result`` blocks.  Like upstream, Responses and completions
requests carry no items.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final, Literal

import xxhash
from pydantic import BaseModel, ConfigDict, Field, StrictInt, StrictStr

from scorers.base import (
    Endpoint,
    LLMRequest,
    Plugin,
    PluginConfigError,
    PluginContext,
    SchedulingResult,
    register,
)

PRODUCER_TYPE: Final = "mm-embeddings-cache-producer"
SCORER_TYPE: Final = "mm-embeddings-cache-scorer"

DEFAULT_CACHE_SIZE_MB: Final = 4096
"""Upstream's default per-endpoint budget (4 GiB), also used for values <= 0."""
MB_PER_ITEM: Final = 2
"""Upstream's fixed assumption of the encoder-cache room one item takes, in MiB."""

Modality = Literal["image", "video", "audio"]

# Chat content part type → (modality, the part's field holding the media).
_CHAT_PARTS: Final[Mapping[str, tuple[Modality, str]]] = {
    "image_url": ("image", "image_url"),
    "video_url": ("video", "video_url"),
    "input_audio": ("audio", "input_audio"),
    "audio_url": ("audio", "audio_url"),
}

_MATCH_KEY_PREFIX: Final = "mm-embeddings-cache.match/"


def encoder_cache_match_key(producer: str) -> str:
    """The ``request.data`` key of producer ``producer``'s `EncoderCacheMatch`."""
    return _MATCH_KEY_PREFIX + producer


def lru_capacity(cache_size_mb: int) -> int:
    """Items one endpoint's LRU remembers for a budget of ``cache_size_mb`` MiB (<= 0: the
    default); at least one."""
    mb = cache_size_mb if cache_size_mb > 0 else DEFAULT_CACHE_SIZE_MB
    return max(1, mb // MB_PER_ITEM)


# ---------------------------------------------------------------------------------------------
# What a request's media items are


@dataclass(slots=True, frozen=True)
class MediaItem:
    """One distinct image, video or audio clip of a request.  ``key`` is a 128-bit hash of its
    modality and identity: the LRUs hold keys, not the (possibly megabytes of) base64 data."""

    key: int
    modality: Modality


def media_item(modality: Modality, identity: str, *, is_uuid: bool = False) -> MediaItem:
    """The item ``identity`` names: a client-given uuid, or the media's URL or inline data."""
    tag = "uuid" if is_uuid else "content"
    # JSON strings may hold lone surrogates; they must still hash, not raise.
    data = f"{modality}\0{tag}\0{identity}".encode("utf-8", "surrogatepass")
    return MediaItem(xxhash.xxh3_128_intdigest(data), modality)


def request_media_items(request: LLMRequest) -> tuple[MediaItem, ...]:
    """The request's distinct media items, in order of first appearance; empty for requests
    other than chat completions and Anthropic Messages, as upstream."""
    if request.kind == "chat":
        found = _chat_items(request.messages or ())
    elif request.kind == "messages":
        found = _anthropic_items(request.messages or ())
    else:
        return ()
    return tuple({item.key: item for item in found}.values())


def _chat_items(messages: Sequence[Any]) -> Iterator[MediaItem]:
    for message in messages:
        content = message.get("content") if isinstance(message, Mapping) else None
        if not isinstance(content, list):
            continue
        for part in content:
            if not isinstance(part, Mapping):
                continue
            part_type = part.get("type")
            kind = _CHAT_PARTS.get(part_type) if isinstance(part_type, str) else None
            if kind is None:
                continue
            modality, field = kind
            uuid = part.get("uuid")
            if isinstance(uuid, str) and uuid:
                # vLLM caches an item the client named under that name (its pixels unhashed).
                yield media_item(modality, uuid, is_uuid=True)
                continue
            identity = _chat_media(part.get(field))
            if identity:
                yield media_item(modality, identity)


def _chat_media(media: Any) -> str:
    """The URL (``{"url": ...}`` or a bare string, which vLLM accepts too) or, for
    ``input_audio``, the format and base64 data of a chat media part."""
    if isinstance(media, str):
        return media
    if not isinstance(media, Mapping):
        return ""
    url = media.get("url")
    if isinstance(url, str) and url:
        return url
    data = media.get("data")
    if isinstance(data, str) and data:
        audio_format = media.get("format")
        return f"{audio_format if isinstance(audio_format, str) else ''}\0{data}"
    return ""


def _anthropic_items(messages: Sequence[Any]) -> Iterator[MediaItem]:
    for message in messages:
        content = message.get("content") if isinstance(message, Mapping) else None
        if not isinstance(content, list):
            continue
        for block in content:
            if not isinstance(block, Mapping):
                continue
            if block.get("type") == "image":
                yield from _anthropic_image(block)
            elif block.get("type") == "tool_result" and isinstance(block.get("content"), list):
                for inner in block["content"]:
                    if isinstance(inner, Mapping) and inner.get("type") == "image":
                        yield from _anthropic_image(inner)


def _anthropic_image(block: Mapping[str, Any]) -> Iterator[MediaItem]:
    """An image block's item: its source URL, else its base64 data (upstream's choice; a
    ``file`` source has neither and is skipped)."""
    source = block.get("source")
    if not isinstance(source, Mapping):
        return
    for field in ("url", "data"):
        value = source.get(field)
        if isinstance(value, str) and value:
            yield media_item("image", value)
            return


# ---------------------------------------------------------------------------------------------
# What the producer tells the scorer


@dataclass(slots=True, frozen=True)
class EncoderCacheMatch:
    """One producer's answer for one request: its distinct items, and how many of them each
    candidate's LRU holds (a candidate holding none is absent)."""

    items: tuple[MediaItem, ...]
    held: Mapping[str, int]

    def fraction_held(self, address: str) -> float:
        """The share of the request's items ``address`` holds, in [0, 1]."""
        return self.held.get(address, 0) / len(self.items) if self.items else 0.0


class ProducerParameters(BaseModel):
    model_config = ConfigDict(extra="forbid")

    cacheSizeInMBPerServer: StrictInt = Field(
        default=DEFAULT_CACHE_SIZE_MB,
        description=(
            "The model servers' encoder-cache capacity in MiB, per endpoint; each remembered "
            f"item counts {MB_PER_ITEM} MiB.  Values <= 0 mean the default "
            f"({DEFAULT_CACHE_SIZE_MB}), as upstream."
        ),
    )


@register(PRODUCER_TYPE)
class MMEmbeddingsCacheProducer(Plugin[ProducerParameters]):
    """Remembers which endpoints were sent which media items, and tells the scorer how many of a
    request's items each candidate holds (see the module docstring).

    DataProducer (writes `EncoderCacheMatch`), PreRequest (records the primary profile's
    targets), EndpointListener (forgets removed endpoints)."""

    def __init__(self, name: str, params: BaseModel, context: PluginContext) -> None:
        super().__init__(name, params, context)
        self.capacity = lru_capacity(self.p.cacheSizeInMBPerServer)
        self._key = encoder_cache_match_key(name)
        # address → item keys it was sent, least recently sent first.
        self._caches: dict[str, OrderedDict[int, None]] = {}

    async def prepare(self, request: LLMRequest, endpoints: Sequence[Endpoint]) -> None:
        items = request_media_items(request)
        if not items:
            return
        held: dict[str, int] = {}
        for endpoint in endpoints:
            cache = self._caches.get(endpoint.address)
            if cache:
                count = sum(1 for item in items if item.key in cache)
                if count:
                    held[endpoint.address] = count
        request.data[self._key] = EncoderCacheMatch(items, held)

    def pre_request(self, request: LLMRequest, result: SchedulingResult) -> None:
        match = request.data.get(self._key)
        if not isinstance(match, EncoderCacheMatch):
            return
        # Upstream records every target of the primary profile (fallbacks included), not the
        # prefill or encode stage's pods.
        for target in result.targets:
            self._remember(target.address, match.items)

    def _remember(self, address: str, items: Sequence[MediaItem]) -> None:
        cache = self._caches.setdefault(address, OrderedDict())
        for item in items:
            cache[item.key] = None
            cache.move_to_end(item.key)
        while len(cache) > self.capacity:
            cache.popitem(last=False)

    def items_held(self, address: str) -> int:
        """How many items ``address``'s LRU holds (upstream's state dump shows the same)."""
        return len(self._caches.get(address, ()))

    def endpoint_added(self, endpoint: Endpoint) -> None:
        pass

    def endpoint_removed(self, endpoint: Endpoint) -> None:
        self._caches.pop(endpoint.address, None)


# ---------------------------------------------------------------------------------------------
# The scorer


class ScorerParameters(BaseModel):
    model_config = ConfigDict(extra="forbid")

    producerName: StrictStr = Field(
        default="",
        description=(
            f"The {PRODUCER_TYPE} whose matches to read; empty means the one named "
            f"{PRODUCER_TYPE!r}, created with its defaults when none is declared (as upstream)."
        ),
    )


@register(SCORER_TYPE)
class MMEmbeddingsCacheScorer(Plugin[ScorerParameters]):
    """Scores each candidate by the fraction of the request's media items its producer says it
    holds (see the module docstring).

    llm-d-router creates the default producer when a scorer reads it and none is declared; here
    the scorer keeps that producer itself and runs it (its DataProducer, PreRequest and
    EndpointListener methods delegate to it) unless `bind` finds the declared one.  A
    ``producerName`` naming no declared producer is an error, as upstream."""

    def __init__(self, name: str, params: BaseModel, context: PluginContext) -> None:
        super().__init__(name, params, context)
        self.producer_name: str = self.p.producerName or PRODUCER_TYPE
        self._key = encoder_cache_match_key(self.producer_name)
        self._own_producer: MMEmbeddingsCacheProducer | None = None
        if self.producer_name == PRODUCER_TYPE:
            self._own_producer = MMEmbeddingsCacheProducer(
                PRODUCER_TYPE, ProducerParameters(), context
            )

    def bind(self, plugins: Mapping[str, object]) -> None:
        producer = plugins.get(self.producer_name)
        if isinstance(producer, MMEmbeddingsCacheProducer):
            self._own_producer = None
            return
        if producer is None and self._own_producer is not None:
            return  # none declared under the default name: keep running the default one
        found = "no plugin" if producer is None else f"a {type(producer).__name__}"
        raise PluginConfigError(
            f"{self.type_name} {self.name!r}: parameters.producerName {self.producer_name!r} "
            f"names {found}; declare an {PRODUCER_TYPE} of that name"
        )

    def score(self, request: LLMRequest, endpoints: Sequence[Endpoint]) -> dict[str, float]:
        match = request.data.get(self._key)
        if not isinstance(match, EncoderCacheMatch):
            return {e.address: 0.0 for e in endpoints}
        return {e.address: match.fraction_held(e.address) for e in endpoints}

    async def prepare(self, request: LLMRequest, endpoints: Sequence[Endpoint]) -> None:
        if self._own_producer is not None:
            await self._own_producer.prepare(request, endpoints)

    def pre_request(self, request: LLMRequest, result: SchedulingResult) -> None:
        if self._own_producer is not None:
            self._own_producer.pre_request(request, result)

    def endpoint_added(self, endpoint: Endpoint) -> None:
        pass

    def endpoint_removed(self, endpoint: Endpoint) -> None:
        if self._own_producer is not None:
            self._own_producer.endpoint_removed(endpoint)
