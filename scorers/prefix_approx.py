"""``prefix-cache-scorer``: the Inference Extension's approximate prefix-cache scorer, or, with
``prefixMatchInfoProducerName``, llm-d-router's scorer of a precise producer's match.

With a producer named (``token-producer`` → ``precise-prefix-cache-producer`` →
``prefix-cache-scorer``), the score of an endpoint is the producer's tier-weighted matched
blocks over the request's blocks, blended with the matched length when ``matchLengthWeight``
is set; the approximate index below is not used.  The producer may also be this module's
``approx-prefix-cache-producer`` or a ``burst-prefix-cache-producer`` (`scorers.prefix_burst`,
a full match on the replica a burst of requests sharing a prompt is steered to).  Without one:

It never sees the model servers' caches; it remembers where it sent each prompt prefix and
assumes the prefix is still cached there, up to a per-endpoint capacity.  The prompt text is cut
into fixed-size blocks of bytes and each block gets a chained hash, so a block hash identifies
the whole prefix up to and including that block:

    block 0 = xxh64(model ‖ 0x00 ‖ [cache_salt ‖ 0x00] ‖ bytes[0:B])
    block i = xxh64(bytes[i·B:(i+1)·B] ‖ little-endian-u64(block i-1))

(the Inference Extension hashes the model name alone as an extra block 0; folding it into the
first block instead keeps "one block = B bytes of prompt", and the cache salt separates tenants
the way vLLM's ``cache_salt`` does).  Only full blocks count, at most
``maxPrefixBlocksToMatch`` of them.

Score of an endpoint = consecutive leading blocks it holds / blocks in the request.

Prompt bytes: a completions prompt as UTF-8; a token-id prompt as little-endian u32 per token;
chat messages rendered deterministically (see `render_chat`), which is not the model's chat
template but is stable, so equal conversation prefixes give equal block hashes.
"""

from __future__ import annotations

import json
import struct
from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import xxhash
from pydantic import AliasChoices, BaseModel, ConfigDict, Field

from scorers.base import (
    CHARS_PER_TOKEN_ESTIMATE,
    Endpoint,
    LLMRequest,
    Plugin,
    PluginContext,
    SchedulingResult,
    register,
)
from scorers.request_data import PrefixMatchInfo, prefix_match_info_key, record_prefix_matches

_xxh64 = xxhash.xxh64_intdigest


# ---------------------------------------------------------------------------------------------
# Prompt → bytes → block hashes (pure)


def render_chat(messages: Iterable[Mapping[str, Any]], limit: int | None = None) -> str:
    """Chat messages as one string: per message ``\\x1e role \\x1f content`` plus, when the
    message has other fields (``name``, ``tool_calls``...), their canonical JSON.  Text parts of
    multi-part content are used as is, other parts as canonical JSON.  Stops once ``limit``
    characters are rendered (the caller only hashes a bounded prefix)."""
    parts: list[str] = []
    length = 0
    for message in messages:
        content = message.get("content")
        if content is None:
            text = ""
        elif isinstance(content, str):
            text = content
        elif isinstance(content, list):
            text = "".join(
                part["text"]
                if isinstance(part, dict)
                and part.get("type") == "text"
                and isinstance(part.get("text"), str)
                else _canonical_json(part)
                for part in content
            )
        else:
            text = _canonical_json(content)
        rendered = f"\x1e{message.get('role', '')}\x1f{text}"
        extra = {k: v for k, v in message.items() if k not in ("role", "content")}
        if extra:
            rendered += _canonical_json(extra)
        parts.append(rendered)
        length += len(rendered)
        if limit is not None and length >= limit:
            break
    return "".join(parts)


def _canonical_json(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False, default=str)


def prompt_bytes(request: LLMRequest, limit: int) -> bytes:
    """The request's prompt as bytes, cut to at most ``limit`` bytes."""
    prompt = request.prompt
    if isinstance(prompt, str):
        # UTF-8 never has fewer bytes than characters: encoding `limit` characters is enough.
        return prompt[:limit].encode()[:limit]
    if isinstance(prompt, list):
        tokens = prompt[: (limit + 3) // 4]
        try:
            return struct.pack(f"<{len(tokens)}I", *tokens)[:limit]
        except struct.error:  # ids outside u32: hash their decimal form instead
            return ",".join(str(t) for t in tokens).encode()[:limit]
    if request.messages is not None:
        return render_chat(request.messages, limit).encode()[:limit]
    return b""


def block_hashes(
    data: bytes,
    block_size: int,
    max_blocks: int,
    model: str,
    cache_salt: str | None = None,
    *,
    partial_last: bool = False,
) -> list[int]:
    """Chained xxh64 hashes of the full ``block_size`` blocks of ``data`` (at most
    ``max_blocks``), seeded with the model name and cache salt (see the module docstring).

    ``partial_last`` hashes a shorter last block too, as llm-d-router's ``prefixhash`` does for
    its burst producer: a prompt shorter than one block still has a key, and prompts that differ
    only in their tail are told apart (`scorers.prefix_burst`)."""
    whole, rest = divmod(len(data), block_size)
    count = min(whole + (1 if partial_last and rest else 0), max_blocks)
    if count == 0:
        return []
    seed = model.encode() + b"\x00"
    if cache_salt:
        seed += cache_salt.encode() + b"\x00"
    current = _xxh64(seed + data[:block_size])
    hashes = [current]
    for start in range(block_size, count * block_size, block_size):
        current = _xxh64(data[start : start + block_size] + current.to_bytes(8, "little"))
        hashes.append(current)
    return hashes


# ---------------------------------------------------------------------------------------------
# The index of where prefixes were sent


class PrefixBlockIndex:
    """Which endpoints hold which block hashes, with an LRU of ``capacity`` blocks per endpoint.

    Each endpoint gets one bit; ``_holders`` maps a block hash to the bitmask of endpoints
    holding it, so the longest-prefix walk costs one integer AND per block whatever the number
    of endpoints (a set intersection per block measured ~20x slower at 64 endpoints)."""

    def __init__(self, capacity_per_endpoint: int) -> None:
        self.capacity = capacity_per_endpoint
        self._holders: dict[int, int] = {}
        self._blocks: dict[str, OrderedDict[int, None]] = {}  # least recently added first
        self._bit_of: dict[str, int] = {}
        self._address_of: dict[int, str] = {}
        self._free_bits: list[int] = []

    def __len__(self) -> int:
        """(block, endpoint) entries held."""
        return sum(len(blocks) for blocks in self._blocks.values())

    def blocks_held(self, address: str) -> int:
        """Blocks ``address`` holds: the size of its tree, which SGLang's and Ray's routers
        fall back to (fewest first) when no endpoint matches enough of the prompt."""
        return len(self._blocks.get(address, ()))

    def add(self, address: str, hashes: Sequence[int]) -> None:
        """Record that ``address`` now holds these blocks.  Touched last block first, so the
        leading blocks are the most recent and a prefix is evicted from its tail."""
        if not hashes:
            return
        blocks = self._blocks.get(address)
        if blocks is None:
            blocks = self._blocks[address] = OrderedDict()
            bit = self._free_bits.pop() if self._free_bits else len(self._bit_of)
            self._bit_of[address] = bit
            self._address_of[bit] = address
        mask = 1 << self._bit_of[address]
        holders = self._holders
        for block in reversed(hashes):
            if block in blocks:
                blocks.move_to_end(block)
            else:
                blocks[block] = None
                holders[block] = holders.get(block, 0) | mask
        while len(blocks) > self.capacity:
            evicted, _ = blocks.popitem(last=False)
            self._unhold(evicted, mask)

    def _unhold(self, block: int, mask: int) -> None:
        remaining = self._holders.get(block, 0) & ~mask
        if remaining:
            self._holders[block] = remaining
        else:
            self._holders.pop(block, None)

    def record(self, hashes: Sequence[int], result: SchedulingResult) -> None:
        """A routed request's blocks, on the pods chosen to compute its prompt."""
        if hashes:
            for address in result.chosen_addresses():
                self.add(address, hashes)

    def remove_endpoint(self, address: str) -> None:
        blocks = self._blocks.pop(address, None)
        bit = self._bit_of.pop(address, None)
        if blocks is None or bit is None:
            return
        mask = 1 << bit
        for block in blocks:
            self._unhold(block, mask)
        del self._address_of[bit]
        self._free_bits.append(bit)

    def longest_prefix(self, hashes: Sequence[int]) -> dict[str, int]:
        """Endpoint address → number of leading blocks of ``hashes`` it holds consecutively
        (endpoints holding none are absent)."""
        if not hashes:
            return {}
        holders = self._holders
        active = holders.get(hashes[0], 0)
        matched: dict[str, int] = {}
        if not active:
            return matched
        for index in range(1, len(hashes)):
            still = active & holders.get(hashes[index], 0)
            if still != active:
                self._record(active & ~still, index, matched)
                active = still
                if not active:
                    return matched
        else:
            index = len(hashes)
        self._record(active, index, matched)
        return matched

    def _record(self, mask: int, length: int, matched: dict[str, int]) -> None:
        address_of = self._address_of
        while mask:
            low = mask & -mask
            matched[address_of[low.bit_length() - 1]] = length
            mask ^= low


# ---------------------------------------------------------------------------------------------
# The plugin


class PrefixCacheParameters(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    blockSize: int = Field(
        default=64,
        ge=4,
        le=1 << 20,
        validation_alias=AliasChoices("blockSize", "hashBlockSize"),
        description="Bytes of prompt per block (Inference Extension: hashBlockSize, 64: vLLM's "
        "16-token blocks at ~4 characters per token).",
    )
    maxPrefixBlocksToMatch: int = Field(
        default=256, ge=1, le=1 << 20, description="Blocks hashed and matched per request (256)."
    )
    lruCapacityPerServer: int = Field(
        default=31250,
        ge=1,
        le=1 << 30,
        description="Blocks remembered per endpoint (31250: ~500k tokens of Llama-3-8B KV on an "
        "80 GB H100 in vLLM's 16-token blocks).",
    )
    prefixMatchInfoProducerName: str = Field(
        default="",
        description="llm-d-router's split pipeline: the name of a prefix producer (precise, "
        "approximate or burst) whose match this scorer scores, instead of its own approximate "
        "index.",
    )
    matchLengthWeight: float = Field(
        default=0.0,
        ge=0.0,
        le=1.0,
        description="Share of the score given to the matched length in tokens (llm-d-router): "
        "w * min(1, matched tokens / matchLengthScaleTokens)^2 + (1 - w) * matched blocks / "
        "blocks.",
    )
    matchLengthScaleTokens: int = Field(
        default=8192, gt=0, description="Matched tokens that earn the full length score."
    )


@dataclass(slots=True, frozen=True)
class _RequestState:
    hashes: list[int]
    matched: dict[str, int]


@register("prefix-cache-scorer")
class PrefixCacheScorer(Plugin[PrefixCacheParameters]):
    """Approximate prefix-cache affinity from routing history (see the module docstring).

    Roles: DataProducer (hashes the prompt and matches it before filtering, publishing
    ``request.data["prefix.matched_blocks"]``), Scorer, PreRequest (records the request's blocks
    on the primary target of each profile that ran), EndpointListener (forgets removed
    endpoints)."""

    def __init__(self, name: str, params: BaseModel, context: PluginContext) -> None:
        super().__init__(name, params, context)
        self.block_size = self.p.blockSize
        self.max_blocks = self.p.maxPrefixBlocksToMatch
        self.index = PrefixBlockIndex(self.p.lruCapacityPerServer)
        self._state_key = f"{self.type_name}/{name}"
        # With a producer named, this scorer only scores the producer's match.
        producer = self.p.prefixMatchInfoProducerName
        self._producer_key = prefix_match_info_key(producer) if producer else None

    def request_hashes(self, request: LLMRequest) -> list[int]:
        data = prompt_bytes(request, self.block_size * self.max_blocks)
        return block_hashes(
            data, self.block_size, self.max_blocks, request.model, request.cache_salt
        )

    def _state(self, request: LLMRequest) -> _RequestState:
        state: _RequestState | None = request.data.get(self._state_key)
        if state is None:
            hashes = self.request_hashes(request)
            state = _RequestState(hashes, self.index.longest_prefix(hashes))
            request.data[self._state_key] = state
            record_prefix_matches(request, state.matched)
        return state

    async def prepare(self, request: LLMRequest, endpoints: Sequence[Endpoint]) -> None:
        if self._producer_key is None:
            self._state(request)

    def score(self, request: LLMRequest, endpoints: Sequence[Endpoint]) -> dict[str, float]:
        if self._producer_key is not None:
            info: PrefixMatchInfo | None = request.data.get(self._producer_key)
            if info is None or info.total_blocks == 0:
                return {e.address: 0.0 for e in endpoints}
            weighted, total, block = info.weighted_blocks, info.total_blocks, info.block_size
            return {
                e.address: self._blend(
                    weighted.get(e.address, 0.0) / total,
                    info.matched_blocks.get(e.address, 0) * block,
                )
                for e in endpoints
            }
        state = self._state(request)
        total = len(state.hashes)
        if total == 0:
            return {e.address: 0.0 for e in endpoints}
        matched = state.matched
        chars = self.block_size  # approximate blocks are bytes of prompt: ~4 per token
        return {
            e.address: self._blend(
                matched.get(e.address, 0) / total,
                matched.get(e.address, 0) * chars // CHARS_PER_TOKEN_ESTIMATE,
            )
            for e in endpoints
        }

    def _blend(self, share: float, tokens: int) -> float:
        weight = self.p.matchLengthWeight
        if not weight:
            return share
        length = min(1.0, tokens / self.p.matchLengthScaleTokens) ** 2
        return weight * length + (1.0 - weight) * share

    def pre_request(self, request: LLMRequest, result: SchedulingResult) -> None:
        if self._producer_key is not None:
            return  # the producer's pods publish what they cache
        self.index.record(self._state(request).hashes, result)

    def endpoint_added(self, endpoint: Endpoint) -> None:
        pass

    def endpoint_removed(self, endpoint: Endpoint) -> None:
        self.index.remove_endpoint(endpoint.address)


class ApproxPrefixProducerParameters(BaseModel):
    """llm-d-router's ``approx-prefix-cache-producer`` parameters, its names and defaults."""

    model_config = ConfigDict(extra="forbid")

    autoTune: bool = Field(
        default=True,
        description="Blocks of the candidates' own block size (vllm:cache_config_info of the "
        "first that reports one) instead of blockSizeTokens.",
    )
    blockSizeTokens: int = Field(default=16, ge=1, le=1 << 16)
    blockSize: int = Field(
        default=0, ge=0, le=1 << 16, description="Deprecated upstream name of blockSizeTokens."
    )
    maxPrefixTokensToMatch: int = Field(
        default=131072, ge=0, le=1 << 24, description="Wins over maxPrefixBlocksToMatch when > 0."
    )
    maxPrefixBlocksToMatch: int = Field(
        default=2048, ge=0, le=1 << 20, description="0 (with no token cap): the whole prompt."
    )
    lruCapacityPerServer: int = Field(default=31250, ge=1, le=1 << 30)


# A block of N tokens is N × 4 bytes of prompt (the Inference Extension's estimate).
_BYTES_PER_TOKEN = CHARS_PER_TOKEN_ESTIMATE
# llm-d-router's floor on the block size: its index holds one entry per (pod, block), and
# vLLM's 16-token blocks made it 4× larger than needed (llm-d-router #1158).
_MIN_BLOCK_TOKENS = 64
_UNLIMITED_BLOCKS = 1 << 20


@register("approx-prefix-cache-producer")
class ApproxPrefixCacheProducer(Plugin[ApproxPrefixProducerParameters]):
    """llm-d-router's approximate prefix producer: this module's routing-history index, in
    blocks of the block size in tokens × 4 bytes of prompt, publishing its match for a
    ``prefix-cache-scorer`` (`scorers.request_data.PrefixMatchInfo`, under its name).  It does
    not score.  As upstream: the block size is ``blockSizeTokens`` (or, with ``autoTune``, the
    first candidate's reported one), at least 64; the token cap wins over the block cap, and
    both at 0 match the whole prompt."""

    def __init__(self, name: str, params: BaseModel, context: PluginContext) -> None:
        super().__init__(name, params, context)
        p = self.p
        # The deprecated blockSize maps to blockSizeTokens when that is left at its default.
        self.configured_tokens = (
            p.blockSize if p.blockSize and p.blockSizeTokens == 16 else p.blockSizeTokens
        )
        self.index = PrefixBlockIndex(p.lruCapacityPerServer)
        self._state_key = f"{self.type_name}/{name}"

    def block_tokens(self, endpoints: Sequence[Endpoint]) -> int:
        size = self.configured_tokens
        if self.p.autoTune:
            reported = next(
                (ep.metrics.block_size for ep in endpoints if ep.metrics.block_size), None
            )
            size = reported or size
        return max(size, _MIN_BLOCK_TOKENS)

    def max_blocks(self, block_tokens: int) -> int:
        p = self.p
        if p.maxPrefixTokensToMatch > 0:
            return p.maxPrefixTokensToMatch // block_tokens
        return p.maxPrefixBlocksToMatch or _UNLIMITED_BLOCKS

    async def prepare(self, request: LLMRequest, endpoints: Sequence[Endpoint]) -> None:
        tokens = self.block_tokens(endpoints)
        block = tokens * _BYTES_PER_TOKEN
        limit = self.max_blocks(tokens)
        data = prompt_bytes(request, block * limit) if limit else b""
        hashes = (
            block_hashes(data, block, limit, request.model, request.cache_salt) if limit else []
        )
        matched = self.index.longest_prefix(hashes)
        request.data[self._state_key] = _RequestState(hashes, matched)
        record_prefix_matches(request, matched)
        request.data[prefix_match_info_key(self.name)] = PrefixMatchInfo(
            matched, {a: float(n) for a, n in matched.items()}, len(hashes), tokens
        )

    def pre_request(self, request: LLMRequest, result: SchedulingResult) -> None:
        state: _RequestState | None = request.data.get(self._state_key)
        if state is not None:
            self.index.record(state.hashes, result)

    def endpoint_added(self, endpoint: Endpoint) -> None:
        pass

    def endpoint_removed(self, endpoint: Endpoint) -> None:
        self.index.remove_endpoint(endpoint.address)
