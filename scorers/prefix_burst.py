"""``burst-prefix-cache-producer``: llm-d-router's producer (Alpha upstream, so it needs
``--allow-experimental-plugins``) that places a burst of requests sharing a prompt together.

Why: when many requests with one prompt arrive at once (the ``n`` samples of an RL rollout
group), every pod's prefix cache is still cold, so cache-state scorers score them all zero and
load balancing scatters them; the shared prompt is then prefilled on several pods.  This
producer holds each request for up to ``windowDurationMs``, then places the window's requests
jointly (`assign_burst`) and publishes, for the ``prefix-cache-scorer`` whose
``prefixMatchInfoProducerName`` names it, a full match on the replica a request was steered to
and none elsewhere (`scorers.request_data.PrefixMatchInfo` under this plugin's name).  It does
not score and keeps nothing across windows: warm-cache reuse between bursts is the approximate or
precise producer's job, which can run beside it.

Placement within a window, as upstream (``pkg/epp/framework/plugins/requestcontrol/
dataproducer/burstprefix``, ``assign.go``):

* Requests with the same whole prefix (every block hash equal) form a group.  A group of two or
  more is always placed, whole where ``maxPerReplica`` allows.  A lone request is placed only
  when ``minColocateBlocks`` > 0 and it shares that many leading blocks with another request of
  the window; otherwise, like a request without a prompt, it gets no match and the other
  scorers decide.
* Groups go first, then the prefix-sharing lone requests, longest prefix first in each tier
  (a long prefix seeds more blocks for the shorter ones to match).
* A unit's first replica is the one already holding the longest shared prefix from this window
  (at least ``minColocateBlocks`` blocks) that is still under its fair share of the window
  (ceil(total / replicas)) and under ``maxPerReplica`` for this unit; otherwise the least loaded
  replica.  "Load" is what this window has put there: requests, or with ``balanceBy: tokens``
  prefix blocks, charged once per replica a unit lands on less the leading blocks already held
  there.  Ties go to fewer running requests, then the lower address.
* With ``maxPerReplica`` = k, a group fills a replica to k before spilling to the next least
  loaded one; when k × replicas is less than the group, the rest go one by one to the least
  loaded replicas rather than being dropped.
* Replicas are the candidates of the window's first placed request; a request whose own
  candidates no longer include its replica (a pod left meanwhile) gets no match.

Blocks: upstream hashes the token ids a ``token-producer`` gives (``prefixhash``: chained xxh64,
seeded with the model and cache salt, the shorter last block included).  Here the prompt's bytes
are hashed as the approximate producer does (`scorers.prefix_approx.prompt_bytes`): a token-id
prompt exactly, ``blockSizeTokens`` ids per block; text and chats at
``blockSizeTokens`` × 4 bytes, the Inference Extension's bytes-per-token estimate.  Grouping
only needs equal prompts to hash equal, which bytes give as well as tokens, so no tokenizer is
needed and a declared ``token-producer`` changes nothing; ``minColocateBlocks`` counts blocks
of estimated tokens for text.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Final, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator

from scorers.base import (
    CHARS_PER_TOKEN_ESTIMATE,
    Endpoint,
    LLMRequest,
    Plugin,
    PluginContext,
    register,
)
from scorers.prefix_approx import PrefixBlockIndex, block_hashes, prompt_bytes
from scorers.request_data import PrefixMatchInfo, prefix_match_info_key

logger = logging.getLogger(__name__)

UNLIMITED: Final = -1
"""``maxPerReplica`` / ``maxBatchSize`` sentinel: no cap."""
_DEFAULT_MAX_PREFIX_BLOCKS: Final = 2048  # upstream's block cap when no token cap is set
_MAX_WINDOW_MS: Final = 10_000  # upstream: every request waits the window, so bound it


# ---------------------------------------------------------------------------------------------
# Parameters


class BurstPrefixParameters(BaseModel):
    """llm-d-router's ``burst-prefix-cache-producer`` parameters: its names, defaults and
    checks (``types.go``, ``newDataProducer``)."""

    model_config = ConfigDict(extra="forbid")

    windowDurationMs: int = Field(
        default=100,
        ge=1,
        le=_MAX_WINDOW_MS,
        description="The batch window: every request waits up to this long for the others "
        "sharing its prompt, so keep it small against the requests' own latency.",
    )
    maxPerReplica: int = Field(
        default=UNLIMITED,
        description="Requests of one group per replica (k); -1: the whole group on one replica.",
    )
    blockSizeTokens: int = Field(default=64, ge=1, description="Tokens per prefix block.")
    maxPrefixTokensToMatch: int = Field(
        default=0,
        ge=0,
        description="Tokens of prompt hashed, in whole blocks; 0: 2048 blocks.",
    )
    minColocateBlocks: int = Field(
        default=0,
        ge=0,
        description="Leading blocks two different prompts must share to be placed together (and "
        "for a lone request to be placed at all); 0: only identical prompts, load-balanced.",
    )
    maxBatchSize: int = Field(
        default=1000,
        description="Requests one window may hold; later ones get no match until it seals. "
        "-1: no cap.",
    )
    balanceBy: Literal["requests", "tokens"] = Field(
        default="requests",
        description="What a window balances across replicas: request counts, or prefix blocks "
        "to prefill (a prefix charged once per replica, less what is already there).",
    )

    @field_validator("maxPerReplica", "maxBatchSize")
    @classmethod
    def _unlimited_or_positive(cls, value: int) -> int:
        if value != UNLIMITED and value < 1:
            raise ValueError(f"must be -1 (unlimited) or >= 1, not {value}")
        return value

    @field_validator("maxPrefixTokensToMatch")
    @classmethod
    def _at_least_one_block(cls, value: int, info: ValidationInfo) -> int:
        block = info.data.get("blockSizeTokens")
        if value > 0 and isinstance(block, int) and value < block:
            raise ValueError(
                f"{value} is less than blockSizeTokens ({block}) and would hash no block; use 0 "
                f"(2048 blocks) or at least {block}"
            )
        return value

    @field_validator("balanceBy", mode="before")
    @classmethod
    def _empty_means_requests(cls, value: Any) -> Any:
        return "requests" if value == "" else value  # upstream defaults an empty value


# ---------------------------------------------------------------------------------------------
# Placement of one window (pure)


@dataclass(slots=True, eq=False)
class BurstRequest:
    """One request of a window: its prompt's block hashes (chained, so equal leading hashes
    mean an equal leading prompt) and the endpoints it may go to."""

    hashes: tuple[int, ...]
    endpoints: Sequence[Endpoint]


@dataclass(slots=True, eq=False)
class _Unit:
    """What is placed as one: an identical group, or a lone prefix-sharing request."""

    hashes: tuple[int, ...]
    members: list[int]  # positions in the window

    @property
    def blocks(self) -> int:
        return len(self.hashes)


def assign_burst(
    requests: Sequence[BurstRequest],
    *,
    max_per_replica: int = UNLIMITED,
    min_colocate_blocks: int = 0,
    balance_by_tokens: bool = False,
) -> list[str | None]:
    """The address each request of a window is steered to, in order; None for no affinity.
    The rules are the module docstring's."""
    assigned: list[str | None] = [None] * len(requests)
    groups: dict[tuple[int, ...], _Unit] = {}  # insertion order: first arrival first
    replicas: Sequence[Endpoint] = ()
    for position, req in enumerate(requests):
        if not req.hashes:
            continue
        unit = groups.get(req.hashes)
        if unit is None:
            unit = groups[req.hashes] = _Unit(req.hashes, [])
        unit.members.append(position)
        if not replicas:
            replicas = req.endpoints
    if not replicas:
        return assigned

    shared = _sharing_a_prefix(groups.values(), min_colocate_blocks)
    whole_groups = [u for u in groups.values() if len(u.members) >= 2]
    lone = [u for u in groups.values() if len(u.members) == 1 and u.hashes in shared]
    # Stable: equal lengths keep arrival order.
    whole_groups.sort(key=lambda u: -u.blocks)
    lone.sort(key=lambda u: -u.blocks)
    units = whole_groups + lone
    if not units:
        return assigned

    total = sum(u.blocks if balance_by_tokens else len(u.members) for u in units)
    placement = _Placement(
        replicas,
        max_per_replica=max_per_replica,
        min_colocate_blocks=min_colocate_blocks,
        balance_by_tokens=balance_by_tokens,
        fair_share=math.ceil(total / len(replicas)),
    )
    for unit in units:
        for position, address in placement.place(unit):
            assigned[position] = address
    return assigned


def _sharing_a_prefix(units: Iterable[_Unit], min_blocks: int) -> set[tuple[int, ...]]:
    """Keys of the units whose first ``min_blocks`` blocks another request of the window has
    too (the gate for a lone request); none when ``min_blocks`` is 0."""
    if min_blocks <= 0:
        return set()
    requests_by_head: dict[tuple[int, ...], int] = {}
    heads: dict[tuple[int, ...], tuple[int, ...]] = {}
    for unit in units:
        if unit.blocks >= min_blocks:
            head = unit.hashes[:min_blocks]
            heads[unit.hashes] = head
            requests_by_head[head] = requests_by_head.get(head, 0) + len(unit.members)
    return {key for key, head in heads.items() if requests_by_head[head] >= 2}


@dataclass(slots=True)
class _Placement:
    """The state of placing one window's units: each replica's load so far (requests, or
    blocks to prefill) and which blocks this window has put where."""

    replicas: Sequence[Endpoint]
    max_per_replica: int
    min_colocate_blocks: int
    balance_by_tokens: bool
    fair_share: int
    load: dict[str, int] = field(default_factory=dict)
    # Every block of a unit lands together, so the index's longest-prefix walk is the
    # shared-prefix length per replica; nothing is evicted within a window.
    index: PrefixBlockIndex = field(default_factory=lambda: PrefixBlockIndex(1 << 62))

    def place(self, unit: _Unit) -> list[tuple[int, str]]:
        """(position, address) for each member of ``unit``, recording its blocks there."""
        needs_matches = self.min_colocate_blocks > 0 or self.balance_by_tokens
        matches = self.index.longest_prefix(unit.hashes) if needs_matches else {}
        prefer_shared = self.min_colocate_blocks > 0  # only for the unit's first replica
        on_replica: dict[str, int] = {}  # this unit's members per replica
        placed: list[tuple[int, str]] = []
        members = unit.members
        while len(placed) < len(members):
            address = self._pick(on_replica, matches, prefer_shared).address
            run = len(members) - len(placed)
            if self.max_per_replica != UNLIMITED:
                # Past k on every replica (more members than k × replicas): one at a time to
                # the least loaded, so nothing is dropped and the window stays balanced.
                run = min(run, max(1, self.max_per_replica - on_replica.get(address, 0)))
            first_here = address not in on_replica
            placed.extend((position, address) for position in members[len(placed) :][:run])
            on_replica[address] = on_replica.get(address, 0) + run
            if not self.balance_by_tokens:
                self.load[address] = self.load.get(address, 0) + run
            elif first_here:
                # The replica prefills the prefix once for all of this unit's members there,
                # and not the leading blocks it already holds from this window.
                missing = max(0, unit.blocks - matches.get(address, 0))
                self.load[address] = self.load.get(address, 0) + missing
            prefer_shared = False
        for address in on_replica:
            self.index.add(address, unit.hashes)
        return placed

    def _rank(self, endpoint: Endpoint) -> tuple[int, int, str]:
        """Lower is preferred: this window's load, then the pod's running requests (a
        tie-breaker only: the window balances what it commits, not observed queues)."""
        address = endpoint.address
        return (self.load.get(address, 0), endpoint.metrics.running_requests, address)

    def _has_room(self, on_replica: dict[str, int], address: str) -> bool:
        k = self.max_per_replica
        return k == UNLIMITED or on_replica.get(address, 0) < k

    def _pick(
        self, on_replica: dict[str, int], matches: dict[str, int], prefer_shared: bool
    ) -> Endpoint:
        if prefer_shared:
            # Co-locate with the longest prefix already placed, but never past the fair share:
            # that bound is what stops many prefix-sharing units stampeding onto one replica.
            sharing = [
                ep
                for ep in self.replicas
                if self._has_room(on_replica, ep.address)
                and self.load.get(ep.address, 0) < self.fair_share
                and matches.get(ep.address, 0) >= self.min_colocate_blocks
            ]
            if sharing:
                return min(sharing, key=lambda ep: (-matches[ep.address], *self._rank(ep)))
        with_room = [ep for ep in self.replicas if self._has_room(on_replica, ep.address)]
        return min(with_room or self.replicas, key=self._rank)


# ---------------------------------------------------------------------------------------------
# The plugin


@dataclass(slots=True, eq=False)
class _Window:
    """Requests gathered until the window seals; then ``assigned`` holds their replicas."""

    requests: list[BurstRequest] = field(default_factory=list)
    sealed: asyncio.Event = field(default_factory=asyncio.Event)
    assigned: list[str | None] = field(default_factory=list)
    overflow_logged: bool = False


@register("burst-prefix-cache-producer")
class BurstPrefixCacheProducer(Plugin[BurstPrefixParameters]):
    """DataProducer only (see the module docstring): ``prepare`` waits for its window to seal,
    then writes this producer's `PrefixMatchInfo` for the request."""

    experimental: ClassVar[bool] = True

    def __init__(self, name: str, params: BaseModel, context: PluginContext) -> None:
        super().__init__(name, params, context)
        p = self.p
        self.window_seconds = p.windowDurationMs / 1000
        self.max_blocks = (
            p.maxPrefixTokensToMatch // p.blockSizeTokens
            if p.maxPrefixTokensToMatch > 0
            else _DEFAULT_MAX_PREFIX_BLOCKS
        )
        self._key = prefix_match_info_key(name)
        self._window: _Window | None = None

    def request_hashes(self, request: LLMRequest) -> tuple[int, ...]:
        """The prompt's chained block hashes, the shorter last block included (as upstream),
        at most ``max_blocks``."""
        block = self.p.blockSizeTokens * CHARS_PER_TOKEN_ESTIMATE
        data = prompt_bytes(request, block * self.max_blocks)
        hashes = block_hashes(
            data, block, self.max_blocks, request.model, request.cache_salt, partial_last=True
        )
        return tuple(hashes)

    async def prepare(self, request: LLMRequest, endpoints: Sequence[Endpoint]) -> None:
        entry = BurstRequest(self.request_hashes(request), tuple(endpoints))
        window = self._window
        if window is None:
            window = self._window = _Window()
            asyncio.get_running_loop().call_later(self.window_seconds, self._seal, window)
        cap = self.p.maxBatchSize
        if cap != UNLIMITED and len(window.requests) >= cap:
            # Upstream's Produce fails here and the request goes on without this producer's
            # data; one warning per window rather than a traceback per request.
            if not window.overflow_logged:
                window.overflow_logged = True
                logger.warning(
                    "%s: a burst window is full (maxBatchSize %d); later requests of this "
                    "window are routed without its placement",
                    self.name,
                    cap,
                )
            return
        position = len(window.requests)
        window.requests.append(entry)
        await window.sealed.wait()

        total = len(entry.hashes)
        address = window.assigned[position]
        held = {address: total} if total and address in {e.address for e in endpoints} else {}
        request.data[self._key] = PrefixMatchInfo(
            held, {a: float(n) for a, n in held.items()}, total, self.p.blockSizeTokens
        )

    def _seal(self, window: _Window) -> None:
        """Close ``window`` (later requests open a new one), place it, release its requests."""
        if self._window is window:
            self._window = None
        p = self.p
        try:
            window.assigned = assign_burst(
                window.requests,
                max_per_replica=p.maxPerReplica,
                min_colocate_blocks=p.minColocateBlocks,
                balance_by_tokens=p.balanceBy == "tokens",
            )
        except Exception:  # a waiting request must never hang on a failed placement
            logger.exception("%s: placing a burst window failed; it gets no placement", self.name)
            window.assigned = [None] * len(window.requests)
        logger.debug(
            "%s: window of %d requests sealed, %d placed",
            self.name,
            len(window.requests),
            sum(a is not None for a in window.assigned),
        )
        window.sealed.set()
