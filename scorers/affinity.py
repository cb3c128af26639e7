"""Affinity scorers: keep a session, an adapter or a cold prefix where it does the most good."""

from __future__ import annotations

import base64
import binascii
import logging
from collections import OrderedDict
from collections.abc import Mapping, Sequence

from pydantic import BaseModel, ConfigDict, Field

from scorers.base import (
    Endpoint,
    LLMRequest,
    NoParameters,
    Plugin,
    PluginContext,
    SchedulingResult,
    register,
)
from scorers.request_data import (
    RESPONSE_HEADERS,
    SESSION_TOKEN,
    PrefixMatchInfo,
    is_cold_request,
    prefix_match_info_key,
)

logger = logging.getLogger(__name__)

SESSION_TOKEN_HEADER = "x-session-token"


def header_value(headers: Mapping[str, str], name: str) -> str | None:
    """Look a header up by its lower-case name (HTTP/2 and Envoy lower-case header names; a
    hand-built request may not)."""
    value = headers.get(name)
    if value is not None:
        return value
    for key, candidate in headers.items():
        if key.lower() == name:
            return candidate
    return None


def encode_session_token(address: str) -> str:
    return base64.b64encode(address.encode()).decode("ascii")


def decode_session_token(token: str) -> str | None:
    """The endpoint address in a session token, or None if it is not one of ours."""
    token = token.strip()
    padded = token + "=" * (-len(token) % 4)
    altchars = b"-_" if "-" in token or "_" in token else None  # tolerate the URL-safe alphabet
    try:
        address = base64.b64decode(padded, altchars=altchars, validate=True).decode()
    except (binascii.Error, ValueError):  # UnicodeDecodeError is a ValueError
        return None
    return address or None


@register("session-affinity-scorer")
class SessionAffinityScorer(Plugin[NoParameters]):
    """Sends a session's requests back to the endpoint that served it before.

    Score: 1.0 for the endpoint named by the request header ``x-session-token``, 0 for the
    others (and 0 for all when the header is absent, malformed or names an endpoint that is no
    longer a candidate).  The token is base64 (standard alphabet) of the endpoint address
    ``ip:port`` (llm-d encodes the pod's ``namespace/name``; the address is what identifies an
    endpoint here, and it is what the destination header already reveals).

    PreRequest: stores the token of the chosen endpoint in
    ``request.data["session-token"]`` (`scorers.request_data.SESSION_TOKEN`); ResponseHeader
    hands it to the ext_proc layer, which sends it to the client in the ``x-session-token``
    response header, which the client echoes on its next request.
    """

    def score(self, request: LLMRequest, endpoints: Sequence[Endpoint]) -> dict[str, float]:
        token = header_value(request.headers, SESSION_TOKEN_HEADER)
        wanted = decode_session_token(token) if token else None
        return {e.address: 1.0 if e.address == wanted else 0.0 for e in endpoints}

    def pre_request(self, request: LLMRequest, result: SchedulingResult) -> None:
        targets = result.targets
        if targets:
            request.data[SESSION_TOKEN] = encode_session_token(targets[0].address)

    def response_header(self, request: LLMRequest, endpoint: Endpoint | None) -> None:
        token = request.data.get(SESSION_TOKEN)
        if isinstance(token, str):
            request.data.setdefault(RESPONSE_HEADERS, {})[SESSION_TOKEN_HEADER] = token


@register("lora-affinity-scorer")
class LoraAffinityScorer(Plugin[NoParameters]):
    """Prefers endpoints that already run the requested LoRA adapter (``request.model``), from
    vLLM's ``vllm:lora_requests_info``:

    * 1.0 the adapter is running there;
    * 0.8 it is not running but the endpoint has a free adapter slot
      (``len(running_lora_adapters) < max_lora``);
    * 0.6 it is waiting to be loaded there and no slot is free;
    * 0.0 the endpoint's adapter slots are full with others.

    A request for a model no candidate lists as an adapter, on candidates without LoRA
    (``max_lora == 0`` everywhere), is not a LoRA request: every candidate scores 1.0.
    (Limitation shared with the Inference Extension: without the base model's name, a base
    model request on LoRA-enabled pods is scored like a cold adapter.)
    """

    def score(self, request: LLMRequest, endpoints: Sequence[Endpoint]) -> dict[str, float]:
        model = request.model
        listed = any(
            model in e.metrics.running_lora_adapters or model in e.metrics.waiting_lora_adapters
            for e in endpoints
        )
        if not listed and all(e.metrics.max_lora <= 0 for e in endpoints):
            return {e.address: 1.0 for e in endpoints}
        scores: dict[str, float] = {}
        for endpoint in endpoints:
            metrics = endpoint.metrics
            if model in metrics.running_lora_adapters:
                scores[endpoint.address] = 1.0
            elif len(metrics.running_lora_adapters) < metrics.max_lora:
                scores[endpoint.address] = 0.8
            elif model in metrics.waiting_lora_adapters:
                scores[endpoint.address] = 0.6
            else:
                scores[endpoint.address] = 0.0
        return scores


class NoHitLRUParameters(BaseModel):
    model_config = ConfigDict(extra="forbid")

    lruSize: int = Field(
        default=1024,
        ge=1,
        le=1_000_000,
        description="Endpoints remembered in the LRU (llm-d: 1024).",
    )
    prefillProfile: str = Field(
        default="prefill",
        min_length=1,
        description="Profile whose target is also marked used (P/D setups; llm-d: prefill).",
    )
    prefixMatchInfoProducerName: str = Field(
        default="",
        description="The prefix producer (precise, approximate or burst) whose match tells "
        "cold from warm requests; empty: any prefix plugin's match.",
    )
    prefixPluginType: str = Field(default="", description="Deprecated upstream; unused.")
    prefixPluginName: str = Field(default="", description="Deprecated upstream; unused.")


@register("no-hit-lru-scorer")
class NoHitLRUScorer(Plugin[NoHitLRUParameters]):
    """Spreads cold requests (no prefix scorer found a hit) over the endpoints that received a
    cold request longest ago, so new prefixes — and the cache growth they cause — spread
    evenly (llm-d).

    Cold request: with ``prefixMatchInfoProducerName``, no candidate holds a block of the
    request in that producer's match (or the producer has no match for it), as upstream reads
    the named producer's ``PrefixCacheMatchInfo``; without it, no prefix plugin found any
    endpoint holding one (`scorers.request_data.is_cold_request`).  Endpoints that never got a
    cold request score 1.0; the others are ranked from least to most recently used after them,
    ``score = 1 - rank / (n - 1)`` over the ``n`` candidates, so the most recently used scores
    0 when every candidate has been used.  (llm-d also ranks never-used endpoints among
    themselves by input order; here they tie and the picker breaks the tie at random.)
    Warm request: 0.5 for every candidate (neutral).

    PreRequest: for cold requests (as the last scoring of the request judged it, as upstream),
    marks the primary target (and the ``prefillProfile`` profile's target, if that profile ran)
    as most recently used.  EndpointListener: forgets removed endpoints.
    """

    def __init__(self, name: str, params: BaseModel, context: PluginContext) -> None:
        super().__init__(name, params, context)
        self.lru_size = self.p.lruSize
        self.prefill_profile = self.p.prefillProfile
        producer = self.p.prefixMatchInfoProducerName
        self._producer_key = prefix_match_info_key(producer) if producer else None
        # Score's verdict, for PreRequest: the candidates it judged are gone by then.
        self._cold_key = f"{self.type_name}/{name}/cold"
        # address → None, least recently used first.
        self._used: OrderedDict[str, None] = OrderedDict()
        if self.p.prefixPluginType or self.p.prefixPluginName:
            logger.warning(
                "%s %r: prefixPluginType and prefixPluginName are deprecated in llm-d-router "
                "and unused; name the producer with prefixMatchInfoProducerName",
                self.type_name,
                self.name,
            )

    def is_cold(self, request: LLMRequest, endpoints: Sequence[Endpoint] | None = None) -> bool:
        """Whether no endpoint (of ``endpoints``, when given) holds a prefix of the request."""
        if self._producer_key is None:
            return is_cold_request(request)
        info = request.data.get(self._producer_key)
        if not isinstance(info, PrefixMatchInfo):
            return True  # the producer matched nothing for this request, as upstream counts it
        held = info.matched_blocks
        addresses = held.keys() if endpoints is None else [e.address for e in endpoints]
        return not any(held.get(address, 0) > 0 for address in addresses)

    def score(self, request: LLMRequest, endpoints: Sequence[Endpoint]) -> dict[str, float]:
        cold = request.data[self._cold_key] = self.is_cold(request, endpoints)
        if not cold:
            return {e.address: 0.5 for e in endpoints}
        n = len(endpoints)
        if n <= 1:
            return {e.address: 1.0 for e in endpoints}
        used = self._used
        scores = {e.address: 1.0 for e in endpoints if e.address not in used}
        rank = len(scores)
        if rank == n:
            return scores
        candidates = {e.address for e in endpoints}
        for address in used:  # least recently used first
            if address in candidates:
                scores[address] = max(0.0, 1.0 - rank / (n - 1))
                rank += 1
        return scores

    def pre_request(self, request: LLMRequest, result: SchedulingResult) -> None:
        cold = request.data.get(self._cold_key)
        if not (self.is_cold(request) if cold is None else cold):
            return
        self.mark_used(result.targets[0].address if result.targets else None)
        prefill = result.profiles.get(self.prefill_profile)
        if prefill is not None and self.prefill_profile != result.primary_profile:
            self.mark_used(prefill.targets[0].address if prefill.targets else None)

    def mark_used(self, address: str | None) -> None:
        if address is None:
            return
        self._used[address] = None
        self._used.move_to_end(address)
        while len(self._used) > self.lru_size:
            self._used.popitem(last=False)

    def endpoint_added(self, endpoint: Endpoint) -> None:
        pass

    def endpoint_removed(self, endpoint: Endpoint) -> None:
        self._used.pop(endpoint.address, None)
