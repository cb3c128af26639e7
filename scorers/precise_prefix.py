"""``precise-prefix-cache-scorer``: scores endpoints by the prompt blocks their vLLM prefix cache
really holds, from the pods' own KV events.

Per request (`prepare`, a data producer): tokenize the prompt exactly as vLLM will (chat template
for chat requests), hash its full blocks exactly as vLLM does, and look the keys up in the KV-block
index; `score` is then the tier-weighted count of consecutive matched blocks over the request's
full blocks, in [0, 1].  The matched counts also go to ``request.data`` for other plugins (the
no-hit LRU scorer, the director's prefill accounting).

Predicted entries (``speculativeIndexing``, llm-d's option of the same name): a pod's KV events
for a request's blocks arrive only after it has scheduled the prefill, so a burst of requests with
a new prefix would all look cold and scatter.  With the option on, PreRequest records the routed
request's blocks as *predicted* on its primary target, and lookups treat a block as held by an
endpoint when the index says so *or* an unexpired prediction does (the longest run of blocks held
either way).  A prediction expires ``speculativeTTL`` seconds after the decision, and is dropped
early when that endpoint's own events say the block was stored (the real entry takes over) or
removed (the prediction was wrong or is out of date).

Around requests: the plugin subscribes to every endpoint's KV-event publisher as endpoints come
and go (per-endpoint SUB sockets, or one bound socket the pods connect to), feeds the index, and
drops an endpoint's entries when it is removed.  The block size is configured, or learned from the
pods (``vllm:cache_config_info`` or the first `BlockStored`): vLLM may pick it per platform.

Silent publishers (`SilentPublishers`): a pod that keeps serving but whose KV events stopped (its
publisher thread died, a network path to the PUB port broke, libzmq dropped the connection over an
oversized message) leaves its entries stale with no sequence gap to tell, since nothing arrives.
The evidence that it should have published: a request this EPP routed there completed (its usage
came back) with at least two full prompt blocks the pod did not hold (``cached_tokens``, or the
index when the pod does not report it), so the pod computed them and vLLM published BlockStored
before the first token.  When no batch from that pod has arrived since such a request was routed,
``silentPublisherTimeout`` after its completion, the publisher is marked silent: logged once,
exported, and its entries are left out of scoring (kept, not dropped: see the parameter) until a
batch arrives, which also fetches its replay buffer again (the subscriber's resync).  Its SUB
socket is replaced when it is marked (`SubscriberPool.reconnect`): libzmq never reconnects a
connection it dropped over an oversized message, and the new connection's fetch of the replay
buffer catches up a pod whose publisher still runs (a broken path to its PUB port).
"""

from __future__ import annotations

import asyncio
import logging
import re
import threading
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from indexer.errors import IndexerError, TokenizationError
from indexer.events import BlockRemoved, BlockStored, KVEventBatch, block_key
from indexer.hashing import HASH_ALGOS, HashAlgo, HashConfig, PrefixHasher, event_keys
from indexer.index import DEFAULT_MAX_ENTRIES, KVBlockIndex
from indexer.subscriber import CentralSubscriber, SubscriberConfig, SubscriberPool
from indexer.tokenization import TokenizerRegistry
from scorers.base import (
    Endpoint,
    GaugeSample,
    LLMRequest,
    Plugin,
    PluginContext,
    SchedulingResult,
    Usage,
    register,
)
from scorers.request_data import (
    KV_CACHED_TOKENS,
    PREFIX_BLOCK_KEYS,
    PREFIX_COMPUTED_TOKENS,
    PREFIX_MATCHED_TOKENS,
    PREFIX_TOTAL_BLOCKS,
    record_prefix_matches,
)

logger = logging.getLogger(__name__)

# request.data key private to this plugin: its weighted match per endpoint, read by `score`.
_SCORES = "precise-prefix.scores"
# The request's block keys (scorers.request_data.PREFIX_BLOCK_KEYS): this plugin writes them in
# prepare and reads them in PreRequest for predicted entries.
_KEYS = PREFIX_BLOCK_KEYS
# request.data keys private to this plugin, for the silent-publisher check: when the request was
# prepared (clock time) and how many of its leading blocks each endpoint's own events had shown.
_PREPARED_AT = "precise-prefix.prepared-at"
_INDEXED_BLOCKS = "precise-prefix.indexed-blocks"

_DURATION = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*(ms|s|m)?\s*$")
_DURATION_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, None: 1.0}


def parse_duration(value: object) -> float:
    """Seconds from a number or a Go-style duration string (``"2s"``, ``"500ms"``, ``"1m"``),
    as llm-d writes ``speculativeTTL``."""
    if isinstance(value, bool):
        raise ValueError("expected seconds or a duration such as '2s' or '500ms'")
    if isinstance(value, int | float):
        return float(value)
    if isinstance(value, str):
        match = _DURATION.match(value)
        if match:
            return float(match.group(1)) * _DURATION_UNITS[match.group(2)]
    raise ValueError(f"expected seconds or a duration such as '2s' or '500ms', got {value!r}")


class KVEventsParameters(BaseModel):
    model_config = ConfigDict(extra="forbid")

    mode: Literal["per-endpoint", "central"] = "per-endpoint"
    """``per-endpoint``: a SUB socket connects to each pod's publisher (pods run vLLM with
    ``"endpoint": "tcp://*:5557"``); needed for active-active EPP replicas.  ``central``: the EPP
    binds ``bindAddress`` and pods connect to it (``"endpoint": "tcp://<epp>:5557"``)."""
    bindAddress: str = "tcp://*:5557"
    topicPrefix: str = ""
    replayTimeoutSeconds: float = Field(default=1.0, gt=0, le=60)


class PrecisePrefixParameters(BaseModel):
    """Parameters of ``precise-prefix-cache-scorer``; defaults match vLLM's own defaults, so a
    fleet started without prefix-caching flags works unchanged."""

    model_config = ConfigDict(extra="forbid")

    blockSize: int | None = Field(default=None, ge=1, le=4096)
    """The pods' ``--block-size``; unset = learned from the pods (metrics or events)."""
    hashAlgo: str = "sha256"
    """The pods' ``--prefix-caching-hash-algo`` (vLLM's default is ``sha256``)."""
    hashSeed: str | None = None
    """The pods' ``PYTHONHASHSEED`` as a string; unset when the pods leave it unset."""
    tokenizer: str | None = None
    """Tokenizer directory (or HF cache id) for every model not listed in ``tokenizers``."""
    tokenizers: dict[str, str] = Field(default_factory=dict)
    """Model name → tokenizer directory."""
    loraAdapters: dict[str, str] = Field(default_factory=dict)
    """LoRA adapter name → the path it was registered with on the pods (vLLM hashes both);
    requests naming an adapter use the tokenizer of ``baseModel``."""
    baseModel: str | None = None
    tierWeights: dict[str, float] = Field(default_factory=dict)
    """Weight of a hit per medium: defaults GPU 1.0, CPU 0.8, STORAGE 0.5."""
    maxIndexEntries: int = Field(default=DEFAULT_MAX_ENTRIES, ge=1_000)
    selfCheck: bool = True
    """Recompute the pods' hashes from their events and re-key pods that disagree."""
    selfCheckBlocks: int | None = Field(default=10_000, ge=1)
    """With ``selfCheck``: trust a pod's later events once this many of its blocks verified with
    no mismatch (until it restarts, the only time its hash configuration can change); null checks
    every event.  Checking costs about four times the ingestion of an unchecked block; a pod
    that disagrees is re-keyed for good, whatever this says."""
    kvEvents: KVEventsParameters = Field(default_factory=KVEventsParameters)
    speculativeIndexing: bool = False
    """Record each routed request's blocks as predicted on its endpoint until its events arrive
    (llm-d's option; off by default there and here, on in the project's default profile)."""
    silentPublisherTimeout: float | None = Field(default=10.0, gt=0, le=3600)
    """Seconds (or a duration: ``"10s"``), in (0, 3600]; null turns the check off.  A pod is
    marked a *silent publisher* when a request routed there completed with at least two full
    prompt blocks it did not hold, no KV-event batch from it has arrived since that request was
    routed, and this long has passed since the completion.  The batch is published before the
    first token, so the wait only needs to cover delivery: the default 10 s leaves room for the
    subscriber holding live batches behind a replay (``replayTimeoutSeconds`` per frame) on a
    loaded EPP; shorter detects sooner, at a higher risk of flagging a pod whose events were
    merely late (harmless: the first batch restores it).  A silent pod's entries are left out of
    scoring, not dropped: entries it evicted meanwhile are stale and new ones missing, so they
    cannot be trusted, but most still describe its cache, and the resync when it publishes again
    replays what it missed onto them (a pod restarted meanwhile is noticed and cleared then)."""
    speculativeTTL: float = Field(default=2.0, gt=0, le=3600)
    """How long a prediction lives, in seconds or as a duration (``"2s"``, llm-d's default).
    Long enough to cover the decision-to-event gap (queueing + the first prefill chunk + event
    delivery); too long and a prediction outlives a prefill that never happened."""

    @field_validator("speculativeTTL", mode="before")
    @classmethod
    def _duration(cls, value: object) -> float:
        return parse_duration(value)

    @field_validator("silentPublisherTimeout", mode="before")
    @classmethod
    def _optional_duration(cls, value: object) -> float | None:
        return None if value is None else parse_duration(value)

    @field_validator("hashAlgo")
    @classmethod
    def _known_algo(cls, value: str) -> str:
        if value not in HASH_ALGOS:
            raise ValueError(f"must be one of {', '.join(HASH_ALGOS)}")
        return value


class PredictedBlocks:
    """Predicted (endpoint, block) entries with a common time to live.

    Per endpoint, block key → expiry time; a FIFO of insertions expires them in order (the TTL
    is fixed, so expiries are in insertion order).  A key predicted again gets the later expiry;
    the earlier insertion then finds a newer expiry and leaves the entry alone.  Empty (falsy)
    when nothing is predicted, so callers skip it at no cost."""

    __slots__ = ("_by_endpoint", "_queue", "ttl")

    def __init__(self, ttl: float) -> None:
        self.ttl = ttl
        self._by_endpoint: dict[str, dict[int, float]] = {}
        self._queue: deque[tuple[float, str, list[int]]] = deque()

    def __bool__(self) -> bool:
        return bool(self._queue)

    def __len__(self) -> int:
        """(endpoint, block) entries held (expired ones included until `expire` runs)."""
        return sum(len(held) for held in self._by_endpoint.values())

    def add(self, endpoint: str, keys: Sequence[int], now: float) -> None:
        expiry = now + self.ttl
        held = self._by_endpoint.setdefault(endpoint, {})
        held.update(dict.fromkeys(keys, expiry))
        self._queue.append((expiry, endpoint, list(keys)))

    def expire(self, now: float) -> None:
        queue = self._queue
        while queue and queue[0][0] <= now:
            expiry, endpoint, keys = queue.popleft()
            held = self._by_endpoint.get(endpoint)
            if held is None:
                continue
            for key in keys:
                if held.get(key, expiry) <= expiry:
                    held.pop(key, None)
            if not held:
                del self._by_endpoint[endpoint]

    def endpoints(self, candidates: Iterable[str]) -> list[str]:
        """The candidates that hold any prediction."""
        held = self._by_endpoint
        return [c for c in candidates if c in held]

    def run(self, endpoint: str, keys: Sequence[int], start: int, now: float) -> int:
        """How many of ``keys[start:]`` ``endpoint`` holds predictively, consecutively."""
        held = self._by_endpoint.get(endpoint)
        if not held:
            return 0
        count = 0
        get = held.get
        for key in keys[start:]:
            if get(key, 0.0) <= now:
                break
            count += 1
        return count

    def discard(self, endpoint: str, keys: Iterable[int | bytes]) -> None:
        """The endpoint's own events speak for these blocks now."""
        held = self._by_endpoint.get(endpoint)
        if held:
            for key in keys:
                held.pop(key if type(key) is int else block_key(key), None)

    def remove_endpoint(self, endpoint: str) -> None:
        self._by_endpoint.pop(endpoint, None)


# A request's new full blocks below this are no evidence: when a whole prompt was cached, vLLM
# recomputes its last token, and the block holding it may already be cached (no BlockStored).
_MIN_NEW_BLOCKS = 2


class SilentPublishers:
    """Which endpoints' KV-event publishers are silent, from evidence that they should have
    published (see the module docstring).  Pure: times come from the caller's clock.

    Any batch resolves every piece of evidence pending for its endpoint (each was recorded at a
    completion, after its request was routed, so before the batch), and completions come in time
    order, so the first unresolved one has the earliest deadline: one deadline per endpoint is
    all the state needed."""

    __slots__ = ("_deadline", "_last_batch", "detected_total", "silent", "timeout")

    def __init__(self, timeout: float) -> None:
        self.timeout = timeout
        self._last_batch: dict[str, float] = {}  # endpoint → clock time of its last batch
        self._deadline: dict[str, float] = {}  # endpoint → when its oldest evidence is overdue
        self.silent: dict[str, float] = {}  # endpoint → clock time it was marked silent
        self.detected_total = 0

    def batch_arrived(self, endpoint: str, now: float) -> bool:
        """A batch from ``endpoint`` was applied; True if it had been marked silent."""
        self._last_batch[endpoint] = now
        self._deadline.pop(endpoint, None)
        return self.silent.pop(endpoint, None) is not None

    def completed(self, endpoint: str, routed_at: float, new_blocks: int, now: float) -> None:
        """A request routed to ``endpoint`` at ``routed_at`` completed at ``now``, after the
        pod computed ``new_blocks`` full prompt blocks it did not hold."""
        last = self._last_batch.get(endpoint)
        if new_blocks < _MIN_NEW_BLOCKS or last is None or last >= routed_at:
            # Not evidence, a pod never heard from (events off: nothing of it is indexed), or
            # the pod has published since the request was routed.
            return
        if endpoint not in self.silent:
            self._deadline.setdefault(endpoint, now + self.timeout)

    def check(self, now: float) -> list[str]:
        """Mark endpoints silent whose evidence is overdue; returns the newly marked ones."""
        if not self._deadline:
            return []
        marked = [endpoint for endpoint, due in self._deadline.items() if due <= now]
        for endpoint in marked:
            del self._deadline[endpoint]
            self.silent[endpoint] = now
            self.detected_total += 1
        return marked

    def forget(self, endpoint: str) -> None:
        self._last_batch.pop(endpoint, None)
        self._deadline.pop(endpoint, None)
        self.silent.pop(endpoint, None)

    def known(self) -> Iterable[str]:
        """Endpoints that have published at least once."""
        return self._last_batch.keys()


@register("precise-prefix-cache-scorer")
class PrecisePrefixCacheScorer(Plugin[PrecisePrefixParameters]):
    """Scorer, data producer, endpoint listener and lifecycle plugin; see the module docstring."""

    def __init__(self, name: str, params: BaseModel, context: PluginContext) -> None:
        super().__init__(name, params, context)
        self.tokenizers = TokenizerRegistry(dict(self.p.tokenizers)) if self.p.tokenizers else None
        self._default_registry = (
            TokenizerRegistry({"*": self.p.tokenizer}) if self.p.tokenizer else None
        )
        self._block_size: int | None = self.p.blockSize
        self._hasher: PrefixHasher | None = None
        self._hasher_lock = threading.Lock()
        self.index: KVBlockIndex | None = None
        self._subscriber: SubscriberPool | CentralSubscriber | None = None
        self._pending: dict[str, Endpoint] = {}  # endpoints added before start()
        self._warned: set[str] = set()
        self.predictions = PredictedBlocks(self.p.speculativeTTL)
        timeout = self.p.silentPublisherTimeout
        self.silent_publishers = None if timeout is None else SilentPublishers(timeout)
        if self._block_size is not None:
            self._configure(self._block_size)
        # Fail at start-up, not on the first request, when the hash settings are impossible.
        HashConfig(block_size=self._block_size or 16, algo=self._algo, seed=self.p.hashSeed)

    @property
    def _algo(self) -> HashAlgo:
        algo: HashAlgo = self.p.hashAlgo  # type: ignore[assignment]  # validated above
        return algo

    # -- block size and the index ------------------------------------------------------------

    @property
    def block_size(self) -> int | None:
        return self._block_size

    def _configure(self, block_size: int) -> None:
        config = HashConfig(block_size=block_size, algo=self._algo, seed=self.p.hashSeed)
        self._block_size = block_size
        self._hasher = PrefixHasher(config)
        self.index = KVBlockIndex(
            max_entries=self.p.maxIndexEntries,
            hash_config=config if self.p.selfCheck else None,
            tier_weights=self.p.tierWeights or None,
            self_check_blocks=self.p.selfCheckBlocks,
        )
        logger.info(
            "precise prefix index: block size %d, hash %s, PYTHONHASHSEED %s",
            block_size,
            self.p.hashAlgo,
            "unset" if self.p.hashSeed is None else repr(self.p.hashSeed),
        )

    def _learn_block_size(self, endpoints: Iterable[Endpoint]) -> None:
        sizes = {ep.metrics.block_size for ep in endpoints if ep.metrics.block_size}
        if sizes:
            self._configure(min(s for s in sizes if s is not None))

    # -- KVEventSink (the subscriber delivers here) ------------------------------------------

    def apply(self, endpoint: str, batch: KVEventBatch) -> None:
        self.context.saw_alive(endpoint)
        if self.index is None:
            first = next((e for e in batch.events if isinstance(e, BlockStored)), None)
            if first is None or not first.block_size:
                return  # nothing indexed yet, so removals and clears change nothing
            self._configure(first.block_size)
        assert self.index is not None
        self.index.apply(endpoint, batch)
        silent = self.silent_publishers
        if silent is not None and silent.batch_arrived(endpoint, self.context.clock()):
            logger.info(
                "%s: KV events from %s arrive again; its entries are used again and its replay "
                "buffer is fetched to catch up",
                self.name,
                endpoint,
            )
            self._resync_soon(endpoint)
        if self.predictions:
            for event in batch.events:
                if type(event) is BlockStored or type(event) is BlockRemoved:
                    self.predictions.discard(endpoint, event.block_hashes)

    def _resync_soon(self, endpoint: str) -> None:
        """Ask the subscriber to fetch the pod's replay buffer, outside the delivery call that
        is running now (the subscriber's feed is in the middle of applying a batch)."""
        subscriber = self._subscriber
        if subscriber is None:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return  # batches applied outside a loop (tests, benchmarks): nothing to fetch from
        loop.call_soon(subscriber.resync, endpoint)

    def clear_endpoint(self, endpoint: str) -> int:
        self.predictions.remove_endpoint(endpoint)
        return self.index.clear_endpoint(endpoint) if self.index is not None else 0

    # -- lifecycle and endpoints --------------------------------------------------------------

    async def start(self) -> None:
        # Load tokenizers now rather than on the first request: a transformers import and a
        # tokenizer load take seconds, which would stall every request of the first burst.
        loop = asyncio.get_running_loop()
        for model in self.p.tokenizers or ([] if self.p.tokenizer is None else ["*"]):
            try:
                await loop.run_in_executor(self.context.executor, self._tokenizer_for, model)
            except TokenizationError as exc:
                self._warn_once(f"tokenize:{model}", f"tokenizer for {model!r} unusable: {exc}")
        events = self.p.kvEvents
        config = SubscriberConfig(
            topic_prefix=events.topicPrefix, replay_timeout_s=events.replayTimeoutSeconds
        )
        if events.mode == "central":
            self._subscriber = CentralSubscriber(self, events.bindAddress, config)
        else:
            self._subscriber = SubscriberPool(self, config)
        pending, self._pending = self._pending, {}
        for endpoint in pending.values():
            self.endpoint_added(endpoint)

    async def stop(self) -> None:
        if self._subscriber is not None:
            await self._subscriber.close()
            self._subscriber = None

    def endpoint_added(self, endpoint: Endpoint) -> None:
        subscriber = self._subscriber
        if subscriber is None:
            self._pending[endpoint.address] = endpoint
            return
        if isinstance(subscriber, CentralSubscriber):
            subscriber.add_endpoint(endpoint.address, endpoint.replay_url)
        elif endpoint.kv_events_url:
            subscriber.add_endpoint(endpoint.address, endpoint.kv_events_url, endpoint.replay_url)

    def endpoint_removed(self, endpoint: Endpoint) -> None:
        self._pending.pop(endpoint.address, None)
        if self._subscriber is not None:
            self._subscriber.remove_endpoint(endpoint.address)
        if self.index is not None:
            self.index.remove_endpoint(endpoint.address)
        self.predictions.remove_endpoint(endpoint.address)
        if self.silent_publishers is not None:
            self.silent_publishers.forget(endpoint.address)

    # -- the request path ---------------------------------------------------------------------

    async def prepare(self, request: LLMRequest, endpoints: Sequence[Endpoint]) -> None:
        request.data[_PREPARED_AT] = self.context.clock()
        untrusted = self._silent_now()
        if self._block_size is None:
            self._learn_block_size(endpoints)
            if self._block_size is None:
                self._warn_once(
                    "block-size",
                    "block size not known yet (set blockSize, or wait for the pods' "
                    "vllm:cache_config_info metric or first KV event); scoring without prefixes",
                )
                return
        executor = self.context.executor
        try:
            if executor is None:
                keys = self._tokenize_and_hash(request)
            else:
                loop = asyncio.get_running_loop()
                keys = await loop.run_in_executor(executor, self._tokenize_and_hash, request)
        except TokenizationError as exc:
            self._warn_once(
                f"tokenize:{request.model}", f"cannot tokenize for {request.model!r}: {exc}"
            )
            return
        except IndexerError as exc:
            self._warn_once(f"hash:{request.model}", f"cannot hash for {request.model!r}: {exc}")
            return
        if keys is None:
            return
        block_size = self._block_size or 0
        request.data[PREFIX_TOTAL_BLOCKS] = len(keys)
        request.data[_KEYS] = keys
        index = self.index
        if index is None or not keys:
            request.data[_SCORES] = {}
            return
        addresses = [ep.address for ep in endpoints]
        trusted = [a for a in addresses if a not in untrusted] if untrusted else addresses
        matches = index.prefix_match(keys, trusted)
        blocks = {a: m.blocks for a, m in matches.items()}
        weighted = {a: m.weighted for a, m in matches.items()}
        request.data[_INDEXED_BLOCKS] = dict(blocks)
        for address in addresses:
            if address in untrusted:  # a silent publisher: as if it held nothing
                blocks[address] = 0
                weighted[address] = 0.0
        computed = max((blocks[a] for a in trusted), default=0)
        request.data[PREFIX_COMPUTED_TOKENS] = computed * block_size
        request.data[KV_CACHED_TOKENS] = {a: index.endpoint_blocks(a) * block_size for a in trusted}
        predictions = self.predictions
        if predictions:
            now = self.context.clock()
            predictions.expire(now)
            for address in predictions.endpoints(trusted):
                extended = self._extend_with_predictions(keys, address, blocks[address], now)
                if extended > blocks[address]:
                    # Predicted blocks will be on GPU once the routed prefill runs.
                    weighted[address] += extended - blocks[address]
                    blocks[address] = extended
        total = len(keys)
        request.data[_SCORES] = {a: weighted[a] / total for a, n in blocks.items() if n}
        record_prefix_matches(request, blocks)
        tokens: dict[str, int] = request.data.setdefault(PREFIX_MATCHED_TOKENS, {})
        for address, count in blocks.items():
            if count:
                tokens[address] = max(tokens.get(address, 0), count * block_size)

    def _extend_with_predictions(self, keys: list[int], address: str, real: int, now: float) -> int:
        """The longest run of leading blocks ``address`` holds really or predictively, given
        that it really holds the first ``real``: alternate predicted and real runs."""
        index = self.index
        assert index is not None
        position = real
        while position < len(keys):
            predicted = self.predictions.run(address, keys, position, now)
            if not predicted:
                break
            position += predicted
            if position < len(keys):
                position += index.longest_prefix(keys[position:], (address,))[address]
        return position

    def pre_request(self, request: LLMRequest, result: SchedulingResult) -> None:
        """With ``speculativeIndexing``: predict the request's blocks on each profile's primary
        target (the pod will cache them when it runs the prefill)."""
        if not self.p.speculativeIndexing:
            return
        keys: list[int] | None = request.data.get(_KEYS)
        if not keys:
            return
        now = self.context.clock()
        recorded: set[str] = set()
        for profile in result.profiles.values():
            if profile.targets and (address := profile.targets[0].address) not in recorded:
                recorded.add(address)
                self.predictions.add(address, keys, now)

    def response_complete(self, request: LLMRequest, endpoint: str, usage: Usage | None) -> None:
        """Evidence for the silent-publisher check: a completed request that made the pod
        compute full prompt blocks it did not hold."""
        silent = self.silent_publishers
        block_size = self._block_size
        routed_at = request.data.get(_PREPARED_AT)
        if silent is None or usage is None or not block_size or routed_at is None:
            return  # no usage: the request failed, or the response did not report it
        if usage.cached_tokens is not None:
            held = usage.cached_tokens // block_size
        else:
            indexed: dict[str, int] | None = request.data.get(_INDEXED_BLOCKS)
            if indexed is None:
                return  # not tokenized here: no way to tell what the pod held
            held = indexed.get(endpoint, 0)
        new_blocks = usage.prompt_tokens // block_size - held
        silent.completed(endpoint, routed_at, new_blocks, self.context.clock())

    def _silent_now(self) -> Mapping[str, float]:
        """Endpoints whose publisher is silent, after marking any whose evidence is overdue."""
        silent = self.silent_publishers
        if silent is None:
            return {}
        for endpoint in silent.check(self.context.clock()):
            logger.warning(
                "%s: %s served a request with new prompt blocks %gs ago and has published no "
                "KV events since it was routed; its publisher is silent, its index entries are "
                "not used for scoring until it publishes again (subscribing to it again)",
                self.name,
                endpoint,
                silent.timeout,
            )
            self._reconnect_soon(endpoint)
        return silent.silent

    def _reconnect_soon(self, endpoint: str) -> None:
        """A new SUB socket for a silent publisher: libzmq never reconnects a connection it
        dropped over a protocol error (a message over the size limit), which looks exactly like
        a silent pod.  The new connection fetches the pod's replay buffer; if the pod kept
        publishing (only the path to this EPP broke), that catches the index up and, being
        batches from the pod, trusts it again.  Per-endpoint SUBs only: in central mode the
        pods connect to the EPP."""
        subscriber = self._subscriber
        if not isinstance(subscriber, SubscriberPool):
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return  # marked outside a loop (tests, benchmarks): no sockets to replace
        loop.call_soon(subscriber.reconnect, endpoint)

    def score(self, request: LLMRequest, endpoints: Sequence[Endpoint]) -> dict[str, float]:
        scores: Mapping[str, float] = request.data.get(_SCORES, {})
        return {ep.address: scores.get(ep.address, 0.0) for ep in endpoints}

    def _tokenize_and_hash(self, request: LLMRequest) -> list[int] | None:
        """The request's block keys as vLLM publishes them.  Runs in the CPU executor:
        tokenization and hashing are the request path's heavy work."""
        token_ids = request.prompt_token_ids
        if token_ids is None:
            token_ids = self._tokenize(request)
            if token_ids is None:
                return None
            request.prompt_token_ids = token_ids
        lora = request.model if request.model in self.p.loraAdapters else None
        hasher = self._hasher
        if hasher is None:
            return None
        with self._hasher_lock:  # PrefixHasher's cache is not thread-safe
            digests = hasher.digests(
                token_ids,
                lora_name=lora,
                lora_path=self.p.loraAdapters.get(lora) if lora else None,
                cache_salt=request.cache_salt,
            )
        return event_keys(digests)

    def _tokenize(self, request: LLMRequest) -> list[int] | None:
        if request.kind == "completions" and isinstance(request.prompt, list):
            return list(request.prompt)
        model = request.model
        if model in self.p.loraAdapters and self.p.baseModel:
            model = self.p.baseModel
        tokenizer = self._tokenizer_for(model)
        if tokenizer is None:
            self._warn_once(
                f"no-tokenizer:{model}",
                f"no tokenizer configured for model {model!r} (set tokenizers or tokenizer); "
                "its requests are scored without prefixes",
            )
            return None
        if request.kind == "chat" and request.messages is not None:
            body = request.body
            kwargs: dict[str, Any] = {
                "tools": body.get("tools"),
                "chat_template_kwargs": body.get("chat_template_kwargs"),
                "add_generation_prompt": body.get("add_generation_prompt", True),
                "continue_final_message": body.get("continue_final_message", False),
            }
            ids: list[int] = tokenizer.encode_chat(request.messages, **kwargs)
            return ids
        if isinstance(request.prompt, str):
            ids = tokenizer.encode_completion(request.prompt)
            return ids
        return None

    def _tokenizer_for(self, model: str) -> Any:
        if self.tokenizers is not None and model in self.tokenizers:
            return self.tokenizers.get(model)
        if self._default_registry is not None and model not in self.p.tokenizers:
            return self._default_registry.get("*")
        return None

    def _warn_once(self, key: str, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            logger.warning("%s: %s", self.name, message)

    # -- telemetry -----------------------------------------------------------------------------

    def telemetry_samples(self) -> Iterable[GaugeSample]:
        if self.p.speculativeIndexing:
            yield GaugeSample(
                "inference_extension_kv_index_predicted_entries",
                "Predicted (block, endpoint) entries awaiting their KV events (speculative "
                "indexing).",
                len(self.predictions),
            )
        silent = self.silent_publishers
        if silent is not None:
            now_silent = self._silent_now()
            yield GaugeSample(
                "inference_extension_kv_events_silent_publishers_detected",
                "Times an endpoint's KV-event publisher was found silent: it served requests "
                "with new prompt blocks and published nothing within silentPublisherTimeout "
                "(cumulative).",
                silent.detected_total,
            )
            for endpoint in silent.known():
                yield GaugeSample(
                    "inference_extension_kv_events_silent_publisher",
                    "1 while the endpoint's KV-event publisher is silent (its index entries are "
                    "not used for scoring), 0 once it has published.",
                    1.0 if endpoint in now_silent else 0.0,
                    (("endpoint", endpoint),),
                )
        index = self.index
        if index is not None:
            yield GaugeSample(
                "inference_extension_kv_index_entries",
                "(block, endpoint) entries in the precise KV-block index.",
                index.entries,
            )
            yield GaugeSample(
                "inference_extension_prefix_indexer_size",
                "Distinct block keys in the precise KV-block index.",
                index.blocks,
            )
            yield GaugeSample(
                "inference_extension_kv_index_evictions",
                "Index entries evicted because maxIndexEntries was reached (cumulative).",
                index.evictions_total,
            )
            for endpoint, count in index.mismatches.items():
                yield GaugeSample(
                    "inference_extension_kv_hash_mismatches",
                    "KV events whose block hashes disagreed with the EPP's (cumulative); the "
                    "endpoint is then indexed by the EPP's own hashes of its tokens.",
                    count,
                    (("endpoint", endpoint),),
                )
        subscriber = self._subscriber
        if subscriber is not None:
            stats = subscriber.stats
            for field, help_text in (
                ("events", "KV events ingested (cumulative)."),
                ("batches_applied", "KV-event batches applied (cumulative)."),
                ("decode_errors", "KV-event payloads dropped as undecodable (cumulative)."),
                ("malformed_frames", "KV-event messages dropped as malformed (cumulative)."),
                ("gaps_detected", "Sequence gaps in KV-event streams (cumulative)."),
                ("gaps_recovered", "Sequence gaps recovered by replay (cumulative)."),
                ("gaps_unrecovered", "Sequence gaps that replay could not fill (cumulative)."),
                ("restarts_detected", "Pod restarts detected by sequence resets (cumulative)."),
                (
                    "full_resyncs",
                    "Endpoints whose entries were dropped and rebuilt from their whole replay "
                    "buffer, which no longer reached back to a gap (cumulative).",
                ),
            ):
                yield GaugeSample(
                    f"inference_extension_kv_events_{field}", help_text, getattr(stats, field)
                )
