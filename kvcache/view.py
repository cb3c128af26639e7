"""`KVCacheView`: which pod holds which prompt blocks, kept from the pods' own KV events.

One object owns the whole view: the tokenizers, the block hasher, the index, the event
subscribers, predicted entries and the silent-publisher check.  Two paths go through it:

* the event path: subscriber → decoded `KVEventBatch` → `apply` → index (one endpoint's batches
  in sequence order, on the event loop's thread);
* the request path: `block_keys` (tokenize as vLLM will, hash as vLLM does; CPU work, run it in
  the executor) → `lookup` (the consecutive blocks each endpoint holds, predictions and silent
  publishers taken into account).

Readers (``precise-prefix-cache-scorer``, the server's metrics) see only these methods; who
builds, starts and stops views is `kvcache.views.KVCacheViews`.

The block size is configured, or learned from the pods (``vllm:cache_config_info`` or the first
`BlockStored`): vLLM may pick it per platform.  Predicted entries (``speculativeIndexing``): a
pod's events for a request's blocks arrive only after it has scheduled the prefill, so a burst
of requests with a new prefix would all look cold and scatter; `predict` records a routed
request's blocks on its pod until its own events speak for them or ``speculativeTTL`` passes.
A silent publisher's entries are left out of lookups (kept, not dropped: most still describe its
cache, and the resync when it publishes again replays what it missed onto them).
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

from epp.gauges import GaugeSample
from indexer.errors import TokenizationError
from indexer.events import BlockRemoved, BlockStored, KVEventBatch
from indexer.hashing import HashAlgo, HashConfig, MMItem, PrefixHasher, event_keys
from indexer.subscriber import CentralSubscriber, SubscriberPool
from indexer.subscriber_config import SubscriberConfig, SubscriberStats
from indexer.tokenization import PromptTokenizer, TokenizerRegistry
from kvcache.backend import IndexBackend, build_backend
from kvcache.ownership import StreamOwnership
from kvcache.predictions import PredictedBlocks
from kvcache.settings import KVCacheSettings
from kvcache.silent import SilentPublishers

if TYPE_CHECKING:
    from kvcache.redis_index import RedisStore
    from scorers.base import Endpoint

logger = logging.getLogger(__name__)

_T = TypeVar("_T")
_REBUILD_ATTEMPTS = 10  # tries of a rebuild whose feed is busy (a replay running), 1 s apart


@dataclass(frozen=True, slots=True)
class ChatPrompt:
    """A chat request's messages and the request fields vLLM passes to the chat template."""

    messages: Sequence[Mapping[str, Any]]
    tools: Sequence[Mapping[str, Any]] | None = None
    chat_template_kwargs: Mapping[str, Any] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    # Special tokens added on top of the template's (vLLM's Responses tokenize this way: its
    # prompts start with the template's BOS and the tokenizer's).
    add_special_tokens: bool = False


@dataclass(frozen=True, slots=True)
class PrefixLookup:
    """Per endpoint asked about: the leading blocks of a prompt it holds (``blocks``: real or
    predicted; ``weighted``: the same, each block weighted by its best tier), the blocks its
    own events showed (``indexed``, before predictions) and the blocks it holds in all
    (``held_blocks``).  Silent publishers count as holding nothing and are in neither
    ``indexed`` nor ``held_blocks``."""

    blocks: dict[str, int]
    weighted: dict[str, float]
    indexed: dict[str, int]
    held_blocks: dict[str, int]
    total_blocks: int


class KVCacheView:
    """See the module docstring.  Built by `KVCacheViews.view` from `KVCacheSettings`."""

    def __init__(
        self,
        settings: KVCacheSettings,
        *,
        clock: Callable[[], float],
        saw_alive: Callable[[str], None],
    ) -> None:
        self.settings = s = settings
        self._clock = clock
        self._saw_alive = saw_alive
        self._tokenizers = TokenizerRegistry(dict(s.tokenizers)) if s.tokenizers else None
        self._default_tokenizer = TokenizerRegistry({"*": s.tokenizer}) if s.tokenizer else None
        self._block_size: int | None = s.blockSize
        self._hasher: PrefixHasher | None = None
        self._hasher_lock = threading.Lock()  # PrefixHasher's cache is not thread-safe
        self.index: IndexBackend | None = None
        redis = s.kvBlockIndexConfig.redisConfig
        self._store: RedisStore | None = None
        if redis is not None:
            from kvcache.redis_index import RedisStore  # the client only when configured

            self._store = RedisStore(redis.address, redis.namespace)
        self._subscriber: SubscriberPool | CentralSubscriber | None = None
        self._pending: dict[str, Endpoint] = {}  # endpoints added before start()
        # With a shared store: which pods' streams this replica ingests.
        self._ownership: StreamOwnership | None = None
        self._warned: set[str] = set()
        self.predictions = PredictedBlocks(s.speculativeTTL)
        timeout = s.silentPublisherTimeout
        self.silent_publishers = None if timeout is None else SilentPublishers(timeout)
        # Fail at start-up, not on the first request, when the hash settings are impossible.
        HashConfig(block_size=s.blockSize or 16, algo=self._algo, seed=s.hashSeed)
        if s.blockSize is not None:
            self._configure(s.blockSize)

    @property
    def _algo(self) -> HashAlgo:
        algo: HashAlgo = self.settings.hashAlgo  # type: ignore[assignment]  # validated
        return algo

    # -- block size and the index ------------------------------------------------------------

    @property
    def block_size(self) -> int | None:
        return self._block_size

    @property
    def subscriber_stats(self) -> SubscriberStats | None:
        """The event subscribers' counters, once started."""
        return None if self._subscriber is None else self._subscriber.stats

    def _configure(self, block_size: int) -> None:
        s = self.settings
        config = HashConfig(block_size=block_size, algo=self._algo, seed=s.hashSeed)
        self._block_size = block_size
        self._hasher = PrefixHasher(config)
        self.index = build_backend(s, config, self._store)
        logger.info(
            "KV-cache view: block size %d, hash %s, PYTHONHASHSEED %s",
            block_size,
            s.hashAlgo,
            "unset" if s.hashSeed is None else repr(s.hashSeed),
        )

    def learn_block_size(self, endpoints: Iterable[Endpoint]) -> bool:
        """Whether the block size is known, learning it from the endpoints' metrics if not;
        warns once while it is not."""
        if self._block_size is None:
            sizes = {ep.metrics.block_size for ep in endpoints if ep.metrics.block_size}
            if sizes:
                self._configure(min(s for s in sizes if s is not None))
        if self._block_size is None:
            self.warn_once(
                "block-size",
                "block size not known yet (set blockSize, or wait for the pods' "
                "vllm:cache_config_info metric or first KV event); scoring without prefixes",
            )
            return False
        return True

    # -- lifecycle and endpoints --------------------------------------------------------------

    async def start(self, executor: Executor | None) -> None:
        """Check the store (a wrong address or a server that does not answer fails the start,
        with `kvcache.redis_index.KVStoreError`), load and warm the tokenizers (a transformers
        import and a tokenizer load take seconds, which would stall every request of the first
        burst), then subscribe."""
        loop = asyncio.get_running_loop()
        if self._store is not None:
            await loop.run_in_executor(executor, self._store.check)

            def recovered(lost: set[str]) -> None:  # on the store's threads
                loop.call_soon_threadsafe(self._rebuild, lost)

            self._store.on_recovered = recovered
            self._store.start()
        for model in self.settings.tokenizers or (["*"] if self.settings.tokenizer else []):
            try:
                await loop.run_in_executor(executor, self._tokenizer_for, model)
            except TokenizationError as exc:
                self.warn_once(f"tokenize:{model}", f"tokenizer for {model!r} unusable: {exc}")
        events = self.settings.kvEvents
        config = SubscriberConfig(
            topic_prefix=events.topicPrefix, replay_timeout_s=events.replayTimeoutSeconds
        )
        if events.mode == "central":
            self._subscriber = CentralSubscriber(self, events.bindAddress, config)
        else:
            self._subscriber = SubscriberPool(self, config)
            redis = self.settings.kvBlockIndexConfig.redisConfig
            if self._store is not None and redis is not None:
                self._ownership = StreamOwnership(
                    self._store, redis.leaseSeconds, self._subscribe, self._unsubscribe
                )
                await self._ownership.start(executor)
        pending, self._pending = self._pending, {}
        for endpoint in pending.values():
            self.endpoint_added(endpoint)

    async def stop(self) -> None:
        if self._ownership is not None:
            await self._ownership.stop()
            self._ownership = None
        if self._subscriber is not None:
            await self._subscriber.close()
            self._subscriber = None
        if self._store is not None:
            await asyncio.get_running_loop().run_in_executor(None, self._store.stop)

    def _rebuild(self, endpoints: set[str], attempt: int = 0) -> None:
        """The store lost writes of ``endpoints`` during an outage: drop their entries and
        apply each pod's replay buffer again (what the buffer still holds comes back; a pod
        whose buffer has moved past the outage is complete again only with its next events).
        Endpoints whose feed is busy are tried again, a few times, a second apart."""
        subscriber = self._subscriber
        if subscriber is None:
            return
        pending = {e for e in endpoints if not subscriber.rebuild(e)}
        if endpoints - pending:
            logger.warning(
                "KV-cache store lost writes of %d endpoint(s) while unreachable: rebuilding "
                "their entries from the pods' replay buffers",
                len(endpoints - pending),
            )
        if pending and attempt < _REBUILD_ATTEMPTS:
            asyncio.get_running_loop().call_later(1.0, self._rebuild, pending, attempt + 1)

    def flush(self, timeout_s: float = 30.0) -> bool:
        """Wait until the store has the writes queued so far (benchmarks and tests that need a
        lookup to see every event applied before it, as the in-memory index always does)."""
        return self._store.flush(timeout_s) if self._store is not None else True

    def endpoint_added(self, endpoint: Endpoint) -> None:
        if self._subscriber is None:
            self._pending[endpoint.address] = endpoint
        elif self._ownership is not None:
            self._ownership.endpoint_added(endpoint)  # subscribes if this replica owns it
        else:
            self._subscribe(endpoint)

    def _subscribe(self, endpoint: Endpoint) -> None:
        subscriber = self._subscriber
        if subscriber is None:
            return
        if isinstance(subscriber, CentralSubscriber):
            subscriber.add_endpoint(endpoint.address, endpoint.replay_url, rank=endpoint.rank)
        elif endpoint.kv_events_url:
            subscriber.add_endpoint(endpoint.address, endpoint.kv_events_url, endpoint.replay_url)

    def _unsubscribe(self, address: str) -> None:
        """Another replica owns the pod's stream now: stop ingesting it (its entries stay)."""
        if self._subscriber is not None:
            self._subscriber.remove_endpoint(address)

    def endpoint_removed(self, endpoint: Endpoint) -> None:
        self._pending.pop(endpoint.address, None)
        if self._ownership is not None:
            self._ownership.endpoint_removed(endpoint.address)
        if self._subscriber is not None:
            self._subscriber.remove_endpoint(endpoint.address)
        if self.index is not None:
            self.index.remove_endpoint(endpoint.address)
        self.predictions.remove_endpoint(endpoint.address)
        if self.silent_publishers is not None:
            self.silent_publishers.forget(endpoint.address)

    # -- the event path (`indexer.subscriber_config.KVEventSink`) -----------------------------

    def apply(self, endpoint: str, batch: KVEventBatch) -> None:
        self._saw_alive(endpoint)
        if self.index is None:
            first = next((e for e in batch.events if isinstance(e, BlockStored)), None)
            if first is None or not first.block_size:
                return  # nothing indexed yet, so removals and clears change nothing
            self._configure(first.block_size)
        assert self.index is not None
        self.index.apply(endpoint, batch)
        silent = self.silent_publishers
        if silent is not None and silent.batch_arrived(endpoint, self._clock()):
            logger.info(
                "KV events from %s arrive again; its entries are used again and its replay "
                "buffer is fetched to catch up",
                endpoint,
            )
            self._soon(self._subscriber, "resync", endpoint)
        if self.predictions:
            for event in batch.events:
                if type(event) is BlockStored or type(event) is BlockRemoved:
                    self.predictions.discard(endpoint, event.block_hashes)

    def clear_endpoint(self, endpoint: str) -> int:
        self.predictions.remove_endpoint(endpoint)
        return self.index.clear_endpoint(endpoint) if self.index is not None else 0

    @staticmethod
    def _soon(subscriber: object, method: str, endpoint: str) -> None:
        """Call the subscriber's ``method`` outside the call running now (its feed may be in the
        middle of applying a batch); nothing outside a loop (tests, benchmarks have no
        sockets)."""
        if subscriber is None:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return
        loop.call_soon(getattr(subscriber, method), endpoint)

    # -- the request path ---------------------------------------------------------------------

    def token_ids(
        self, model: str, *, prompt: str | None = None, chat: ChatPrompt | None = None
    ) -> list[int] | None:
        """The prompt's token ids as vLLM computes them (chat template for a chat), or None
        (warned once per model) when no tokenizer is configured for ``model``.  CPU work."""
        s = self.settings
        if model in s.loraAdapters and s.baseModel:
            model = s.baseModel
        tokenizer = self._tokenizer_for(model)
        if tokenizer is None:
            self.warn_once(
                f"no-tokenizer:{model}",
                f"no tokenizer configured for model {model!r} (set tokenizers or tokenizer); "
                "its requests are scored without prefixes",
            )
            return None
        if chat is not None:
            return tokenizer.encode_chat(
                chat.messages,
                tools=chat.tools,
                chat_template_kwargs=chat.chat_template_kwargs,
                add_generation_prompt=chat.add_generation_prompt,
                continue_final_message=chat.continue_final_message,
                add_special_tokens=chat.add_special_tokens,
            )
        if prompt is not None:
            return tokenizer.encode_completion(prompt)
        return None

    def block_keys(
        self,
        token_ids: Sequence[int],
        *,
        model: str,
        cache_salt: str | None = None,
        mm: Sequence[MMItem] = (),
    ) -> list[int] | None:
        """The keys vLLM publishes for the prompt's full blocks (``model`` names a LoRA adapter
        or the base model; ``mm``: the multimodal items placed in ``token_ids``), or None while
        the block size is unknown.  CPU work."""
        hasher = self._hasher
        if hasher is None:
            return None
        adapters = self.settings.loraAdapters
        lora = model if model in adapters else None
        with self._hasher_lock:
            digests = hasher.digests(
                token_ids,
                lora_name=lora,
                lora_path=adapters.get(lora) if lora else None,
                cache_salt=cache_salt,
                mm=mm,
            )
        return event_keys(digests)

    async def lookup(
        self, keys: list[int], addresses: Sequence[str], executor: Executor | None = None
    ) -> PrefixLookup:
        """What each of ``addresses`` holds of the prompt whose block keys are ``keys``.  A
        store's lookups run in ``executor``, off the event loop."""
        untrusted = self._silent_now()
        index = self.index
        blocks: dict[str, int] = dict.fromkeys(addresses, 0)
        weighted: dict[str, float] = dict.fromkeys(addresses, 0.0)
        if index is None or not keys:
            return PrefixLookup(blocks, weighted, {}, {}, len(keys))
        trusted = [a for a in addresses if a not in untrusted] if untrusted else list(addresses)
        found = await self._call(executor, index.match, keys, trusted)
        for address, match in found.prefix.items():
            blocks[address] = match.blocks
            weighted[address] = match.weighted
        indexed = {a: blocks[a] for a in trusted}
        held = {a: found.held_blocks.get(a, 0) for a in trusted}
        predictions = self.predictions
        if predictions:
            now = self._clock()
            predictions.expire(now)
            for address in predictions.endpoints(trusted):
                extended = await self._extend_with_predictions(
                    keys, address, blocks[address], now, executor
                )
                if extended > blocks[address]:
                    # Predicted blocks will be on GPU once the routed prefill runs.
                    weighted[address] += extended - blocks[address]
                    blocks[address] = extended
        return PrefixLookup(blocks, weighted, indexed, held, len(keys))

    async def _call(self, executor: Executor | None, fn: Callable[..., _T], *args: Any) -> _T:
        """``fn(*args)``: in ``executor`` when the index answers over the network."""
        index = self.index
        if executor is None or index is None or not index.blocking:
            return fn(*args)
        return await asyncio.get_running_loop().run_in_executor(executor, fn, *args)

    async def _extend_with_predictions(
        self, keys: list[int], address: str, real: int, now: float, executor: Executor | None
    ) -> int:
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
                held = await self._call(executor, index.longest_prefix, keys[position:], (address,))
                position += held[address]
        return position

    def predict(self, address: str, keys: Sequence[int]) -> None:
        """``address`` was sent a request with these block keys: with ``speculativeIndexing``,
        count them as held there until its own events arrive or the TTL passes."""
        if self.settings.speculativeIndexing and keys:
            self.predictions.add(address, keys, self._clock())

    def completed(
        self, endpoint: str, routed_at: float, prompt_tokens: int, held_blocks: int
    ) -> None:
        """Evidence for the silent-publisher check: a request routed to ``endpoint`` at
        ``routed_at`` completed now with ``prompt_tokens``, of which the pod held
        ``held_blocks`` full blocks."""
        silent = self.silent_publishers
        block_size = self._block_size
        if silent is None or not block_size:
            return
        new_blocks = prompt_tokens // block_size - held_blocks
        silent.completed(endpoint, routed_at, new_blocks, self._clock())

    def _silent_now(self) -> Mapping[str, float]:
        """Endpoints whose publisher is silent, after marking any whose evidence is overdue."""
        silent = self.silent_publishers
        if silent is None:
            return {}
        for endpoint in silent.check(self._clock()):
            logger.warning(
                "%s served a request with new prompt blocks %gs ago and has published no KV "
                "events since it was routed; its publisher is silent, its index entries are "
                "not used for scoring until it publishes again (subscribing to it again)",
                endpoint,
                silent.timeout,
            )
            # A new SUB socket: libzmq never reconnects a connection it dropped over a protocol
            # error (a message over the size limit), which looks exactly like a silent pod.  The
            # new connection fetches the pod's replay buffer; if the pod kept publishing (only
            # the path to this EPP broke), that catches the index up.  Per-endpoint SUBs only:
            # in central mode the pods connect to the EPP.
            if isinstance(self._subscriber, SubscriberPool):
                self._soon(self._subscriber, "reconnect", endpoint)
        return silent.silent

    def _tokenizer_for(self, model: str) -> PromptTokenizer | None:
        if self._tokenizers is not None and model in self._tokenizers:
            return self._tokenizers.get(model)
        if self._default_tokenizer is not None and model not in self.settings.tokenizers:
            return self._default_tokenizer.get("*")
        return None

    def warn_once(self, key: str, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            logger.warning("KV-cache view: %s", message)

    # -- telemetry -----------------------------------------------------------------------------

    def telemetry_samples(self) -> Iterable[GaugeSample]:
        if self.settings.speculativeIndexing:
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
            yield from index.telemetry_samples()
        ownership = self._ownership
        if ownership is not None:
            yield from ownership.telemetry_samples()
        subscriber = self._subscriber
        if subscriber is not None:
            stats = subscriber.stats
            for field, help_text in _SUBSCRIBER_COUNTERS:
                yield GaugeSample(
                    f"inference_extension_kv_events_{field}", help_text, getattr(stats, field)
                )


_SUBSCRIBER_COUNTERS = (
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
)
