"""Keys plugins use to share per-request facts through ``LLMRequest.data``.

``LLMRequest.data`` is the Inference Extension's CycleState: one dict per request, written by
data producers and scorers, read by later scorers, PreRequest plugins and the ext_proc layer.
Every key more than one module reads is declared here, with its type and who writes it.

PREFIX_MATCHED_BLOCKS (``"prefix.matched_blocks"``): ``dict[str, int]``
    Endpoint address → number of the request's leading blocks that endpoint is believed to hold
    in its prefix cache (consecutive from block 0).  Written during ``prepare`` (before any
    filter or scorer runs) by every prefix scorer: ``prefix-cache-scorer`` (approximate, blocks of
    characters) and ``precise-prefix-cache-scorer`` (KV-event index, blocks of tokens).  Write it
    with `record_prefix_matches`, which keeps the per-endpoint maximum when several prefix
    scorers run; since the block units may differ, readers should treat it as "is there a hit,
    and which endpoint has the longest", not as an exact length.  An address that is absent
    holds nothing.  Read by ``no-hit-lru-scorer`` (`is_cold_request`).

PREFIX_MATCHED_TOKENS (``"prefix.matched_tokens"``): ``dict[str, int]``
    Endpoint address → prompt tokens that endpoint holds in its prefix cache, exactly (the
    precise scorer's consecutive matched blocks × block size).  Read by the director to account
    the prefill work a routed request adds to its endpoint, and by cost-based scorers.

PREFIX_COMPUTED_TOKENS (``"prefix.computed_tokens"``): ``int``
    The longest prefix of the prompt, in tokens, that any trusted endpoint really holds
    according to the KV-event index (predicted entries excluded): the part of the prompt some
    pod has already computed.  Written by ``precise-prefix-cache-scorer``; read by
    ``prefill-cost-scorer`` to tell copying a prefix from computing it for the first time.

KV_CACHED_TOKENS (``"kv.cached_tokens"``): ``dict[str, int]``
    Endpoint address → tokens of KV cache that endpoint holds for any prompt, per the KV-event
    index (blocks × block size, every tier).  vLLM keeps a block's contents until it reuses
    the block, so a pod that has served enough holds its capacity; one that started recently
    or got little traffic holds less, and a prefix copied into the difference evicts nothing.
    Written by ``precise-prefix-cache-scorer`` for endpoints whose events are trusted; read by
    ``prefill-cost-scorer``.

PREFIX_BLOCK_KEYS (``"precise-prefix.keys"``): ``list[int]``
    The request's prompt block keys, as vLLM hashes its full blocks (64-bit, in order).  Written
    by ``precise-prefix-cache-scorer`` during ``prepare``; read by ``dynamo-cost-scorer`` (its
    per-pod active blocks) and ``prefill-cost-scorer`` (whether a request continues an earlier
    one, `scorers.sessions`).

PREFIX_TOTAL_BLOCKS (``"prefix.total_blocks"``): ``int``
    How many full blocks the request's prompt has, in the unit of PREFIX_MATCHED_BLOCKS of the
    scorer that wrote it last; with it, matched / total is the decision's hit ratio (metric).

PREFIX_MATCH_INFO (``"prefix.match_info/<producer name>"``, see `prefix_match_info_key`): `PrefixMatchInfo`
    One prefix producer's match for the request: per endpoint, the leading blocks it holds
    (and tier-weighted), the request's full blocks and the block size.  Written under its own
    plugin name by ``precise-prefix-cache-producer`` (and ``precise-prefix-cache-scorer``),
    ``approx-prefix-cache-producer``, and ``burst-prefix-cache-producer`` (whose "match" is the
    replica it places a burst's request on, not what a pod caches); read by
    ``prefix-cache-scorer`` when its ``prefixMatchInfoProducerName`` names that producer
    (llm-d-router's split pipeline).

LATENCY_PREDICTION_INFO (``"latency.prediction_info/<producer name>"``, see `latency_prediction_info_key`): ``dict[str, LatencyPredictionInfo]``
    Endpoint address → one ``predicted-latency-producer``'s predicted TTFT and TPOT for the
    request on that endpoint, and their headroom against the request's SLO headers (llm-d-router's
    ``LatencyPredictionInfo`` endpoint attribute).  Written under the producer's name when a
    consumer first asks for it (`scorers.predicted_latency`), absent while the producer has no
    predictions; read by ``latency-scorer``, ``slo-headroom-tier-filter``,
    ``latency-slo-admitter`` and ``prefix-cache-affinity-filter``.

RESPONSE_TIMING (``"response.timing"``): `ResponseTiming`
    When the request was routed, produced its first response byte and finished, on the EPP's
    clock (``PluginContext.clock``).  Written by the director on the response path, before the
    ResponseComplete plugins run; plugins that learn the pods' speeds read it there.

RESPONSE_METADATA (``"response.dynamic_metadata"``): ``dict[str, dict[str, float]]``
    Envoy dynamic metadata for the end of the response: namespace (``envoy.lb``) → key → number.
    Written by ``request-attribute-reporter`` in ResponseComplete; taken by the ext_proc layer
    (`epp.extproc`) right after the ResponseComplete plugins ran and sent as ``dynamic_metadata``
    of the reply to the message that ended the response (its last body chunk, or its trailers).
    Plugins add their keys to what is there (several may share a namespace).

RESPONSE_HEADERS (``"response.headers"``): ``dict[str, str]``
    Headers the ext_proc layer sets on the response to the client, on its reply to the model
    server's response headers.  Written by ResponseHeader plugins
    (``disaggregatedset-rollout-screener`` stamps the serving pod's labels); taken by
    `epp.extproc` right after they ran.

LB_METADATA (``"request.lb_metadata"``): ``dict[str, str]``
    The string fields of the ``envoy.lb`` namespace of the metadata Envoy sent with the
    request's ext_proc messages, the latest value of each (the gateway's report of the endpoint
    that served, ``x-gateway-destination-endpoint-served``, among them).  Written by
    `epp.extproc` before ResponseHeader plugins run; read by
    ``destination-endpoint-served-verifier``.

AGENT_IDENTITY (``"agent-identity"``): ``str``
    The agent session the request belongs to (llm-d-router's ``agent-identity`` request
    attribute): the first non-empty of the session headers ``agent-identity`` checks.  Written
    by that plugin before admission; read by `epp.llmd_metrics.fairness_id`, which makes it
    the request's flow when no fairness header names one.

SESSION_TOKEN (``"session-token"``): ``str``
    The value the ext_proc layer must send back in the ``x-session-token`` response header:
    base64 of the chosen endpoint's address.  Written by ``session-affinity-scorer`` in
    PreRequest and copied to RESPONSE_HEADERS by it when the response headers arrive.  Absent
    when that plugin is not configured.  (``session-affinity-filter`` writes its own header,
    possibly another, straight to RESPONSE_HEADERS.)
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Final

from scorers.base import LLMRequest

PREFIX_MATCHED_BLOCKS: Final = "prefix.matched_blocks"
PREFIX_MATCHED_TOKENS: Final = "prefix.matched_tokens"
PREFIX_COMPUTED_TOKENS: Final = "prefix.computed_tokens"
PREFIX_TOTAL_BLOCKS: Final = "prefix.total_blocks"
PREFIX_BLOCK_KEYS: Final = "precise-prefix.keys"
KV_CACHED_TOKENS: Final = "kv.cached_tokens"
SESSION_TOKEN: Final = "session-token"
PREFIX_MATCH_INFO: Final = "prefix.match_info/"
RESPONSE_TIMING: Final = "response.timing"
RESPONSE_METADATA: Final = "response.dynamic_metadata"
RESPONSE_HEADERS: Final = "response.headers"
LB_METADATA: Final = "request.lb_metadata"
AGENT_IDENTITY: Final = "agent-identity"
LATENCY_PREDICTION_INFO: Final = "latency.prediction_info/"


@dataclass(slots=True, frozen=True)
class PrefixMatchInfo:
    """A prefix producer's answer for one request (see PREFIX_MATCH_INFO)."""

    matched_blocks: Mapping[str, int]  # endpoint → consecutive leading blocks it holds
    weighted_blocks: Mapping[str, float]  # the same, each block weighed by its best tier
    total_blocks: int
    block_size: int  # tokens per block


def prefix_match_info_key(producer: str) -> str:
    """The ``request.data`` key of ``producer``'s `PrefixMatchInfo`."""
    return PREFIX_MATCH_INFO + producer


@dataclass(slots=True, frozen=True)
class LatencyPredictionInfo:
    """A predicted-latency producer's answer for one endpoint (see LATENCY_PREDICTION_INFO);
    times in milliseconds, headroom = SLO − prediction (negative: the SLO is missed)."""

    ttft_valid: bool
    tpot_valid: bool
    ttft_headroom_ms: float
    tpot_headroom_ms: float
    ttft_ms: float
    tpot_ms: float
    dispatched_requests: int  # requests the producer routed there that have not finished

    @property
    def is_valid(self) -> bool:
        return self.ttft_valid and self.tpot_valid


def latency_prediction_info_key(producer: str) -> str:
    """The ``request.data`` key of ``producer``'s `LatencyPredictionInfo` per endpoint."""
    return LATENCY_PREDICTION_INFO + producer


@dataclass(slots=True)
class ResponseTiming:
    """A routed request's timeline on the EPP's clock (seconds); None until it happened."""

    routed_at: float
    first_byte_at: float | None = None
    finished_at: float | None = None
    running_while_decoding: float | None = None
    """Time average of the requests in flight on its endpoint (itself included) from its first
    byte to its end: the batch its decode steps ran in."""
    pool_running_while_decoding: float | None = None
    """The same over the whole pool: what the machines shared by several pods were busy with."""
    in_flight_areas_at_first_byte: tuple[float, float] | None = None


def record_prefix_matches(request: LLMRequest, matches: Mapping[str, int]) -> None:
    """Merge one prefix scorer's matches into ``request.data[PREFIX_MATCHED_BLOCKS]``."""
    merged: dict[str, int] | None = request.data.get(PREFIX_MATCHED_BLOCKS)
    if merged is None:
        request.data[PREFIX_MATCHED_BLOCKS] = {a: n for a, n in matches.items() if n > 0}
        return
    for address, blocks in matches.items():
        if blocks > merged.get(address, 0):
            merged[address] = blocks


def is_cold_request(request: LLMRequest) -> bool:
    """True when no prefix scorer found any endpoint holding a prefix of this request.  A
    request no prefix scorer looked at counts as cold (llm-d's no-hit-lru does the same)."""
    matches: Mapping[str, int] | None = request.data.get(PREFIX_MATCHED_BLOCKS)
    return not matches or not any(n > 0 for n in matches.values())
