"""Self-check of the pods' block keys: are they the keys this EPP computes from the same tokens?

A pod whose hash algorithm, ``PYTHONHASHSEED`` or block size differs from the EPP's publishes keys
no request will ever look up: every decision about it would be silently wrong.  `KeyCheck`
recomputes the hashes of each `BlockStored` from the event's own tokens and says under which keys
its blocks are to be indexed: the pod's own while they agree, this EPP's hashes of the tokens
once they do not (re-keying, with a per-endpoint map from the pod's keys to ours so `BlockRemoved`
finds the right entries).  What can and cannot be verified, and what re-keying costs, is in the
docstring of `KeyCheck`.  Where the keys are then stored is the index's business
(`indexer.index`); this module holds no entries.

Pure and single-threaded, like the index that calls it.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable, Container
from dataclasses import dataclass, field
from itertools import islice
from typing import Final

from indexer.errors import HashConfigError
from indexer.events import BlockStored, block_key
from indexer.hashing import HASH_ALGOS, HashConfig, PrefixHasher, event_key

logger = logging.getLogger("indexer.index")  # the name operators already filter on

_REKEY_HASHER_BLOCKS: Final = 65_536  # PrefixHasher cache for re-keying mismatched pods
# PYTHONHASHSEED values seen in deployments (docs/vllm-interop.md §7): unset, llm-d's "0" and "42".
_DIAGNOSIS_SEEDS: Final = (None, "0", "42")


@dataclass(slots=True, frozen=True)
class _Link:
    """Where an engine block of a mismatched pod sits in the EPP's own chain: the EPP keys of the
    blocks it completed, the EPP digest to chain its children from (None: the chain start), and
    the tokens after that digest that do not fill an EPP block yet (non-empty only when the pod's
    block size is not a multiple of the EPP's)."""

    our_keys: tuple[int, ...]
    digest: bytes | None
    tail: tuple[int, ...]


@dataclass(slots=True, eq=False)
class EndpointKeyState:
    """One endpoint's self-check state.  ``rekey`` is the mismatch mode: events are keyed by our
    own hashes of their tokens and ``links`` maps the pod's engine keys to ours (for
    BlockRemoved and parents).  Counters are cumulative over the endpoint's life."""

    name: str
    rekey: bool = False
    logged_mismatch: bool = False
    links: dict[int, _Link] = field(default_factory=dict)
    mismatch_events: int = 0
    verified_blocks: int = 0
    verified_since_restart: int = 0  # for self_check_blocks
    unverified_blocks: int = 0
    unchecked_blocks: int = 0
    rekeyed_blocks: int = 0
    skipped_events: int = 0

    def restarted(self) -> None:
        """The pod restarted: it may come back with another configuration."""
        self.links = {}
        self.rekey = False
        self.verified_since_restart = 0


class KeyCheck:
    """Under which keys to index each endpoint's blocks.

    * ``hash_config``: the EPP's own block size, algorithm and seed.  None trusts the pods' keys
      (nothing is checked).
    * ``self_check_blocks``: stop verifying an endpoint once this many of its blocks verified
      with no mismatch (its later events are trusted and counted as unchecked).  A pod's hash
      configuration can only change across a restart (`EndpointKeyState.restarted`).  None
      verifies every event.
    * ``verify_cache_blocks``: how many recently verified block digests are kept, shared across
      endpoints, to verify events that continue an earlier block.

    Per `BlockStored`:

    * Verified: the event's blocks have no extra keys (``extra_keys`` None or all None,
      ``lora_name`` None, no lookahead tokens), its tokens fill exactly its blocks, and the
      parent's digest is known (no parent: the chain starts at NONE_HASH; otherwise a block
      verified recently).  Its ``block_size`` must equal ours and every key must equal
      ``event_key`` of our digest.  A key equal to a digest we computed earlier is accepted
      without rehashing: only a hasher that agrees with ours can produce it.
    * Unverified: the parent's digest is unknown (the EPP started after the parent was stored,
      or the parent fell out of the cache).  The pod's keys are trusted.
    * Unchecked: blocks with extra keys (LoRA, cache_salt, multimodal, prompt embeds) or no
      tokens (offloading connectors).  Events publish LoRA names but not the adapter path vLLM
      hashes, so these cannot be recomputed; the pod's keys are trusted as they are.
    * Mismatch: the block size or a key differs.  Counted, logged once per endpoint (logger
      ``indexer.index``), and the endpoint switches to re-keying: its blocks are keyed by our
      hashes of the event tokens (chunked at our block size, chained from our digest of the
      parent), with a per-endpoint map from its keys to ours so `BlockRemoved` removes the right
      entries.  A pod block size that is a multiple of ours re-keys exactly; otherwise the tokens
      that do not fill one of our blocks are carried into the child event's first block, which is
      exact too.  An event whose parent cannot be mapped is skipped and counted; extra-key events
      keep the pod's keys.  Re-keying costs about three times the memory per entry (a link with
      the EPP digest per pod block: ~380 bytes instead of ~128, measured with tracemalloc).
    """

    def __init__(
        self,
        hash_config: HashConfig | None,
        *,
        self_check_blocks: int | None,
        verify_cache_blocks: int,
    ) -> None:
        self.hash_config = hash_config
        self._self_check_blocks = self_check_blocks
        self._none_hash = hash_config.none_hash if hash_config is not None else b""
        self._digests: OrderedDict[int, bytes] = OrderedDict()
        self._digests_capacity = verify_cache_blocks
        self._rekey_hasher: PrefixHasher | None = None
        # Counters for metrics (read them, do not write them).
        self.mismatch_events_total = 0
        self.verified_blocks_total = 0
        self.unverified_blocks_total = 0
        self.unchecked_blocks_total = 0
        self.rekeyed_blocks_total = 0
        self.skipped_events_total = 0

    def stored_keys(
        self,
        ep: EndpointKeyState,
        event: BlockStored,
        keys: list[int],
        link_bound: Callable[[], int],
    ) -> list[int] | None:
        """The keys to index ``event``'s blocks under (``keys`` are the pod's, as uint64): the
        pod's own, or ours when it hashes differently; None when the event cannot be placed
        (skipped and counted).  ``link_bound`` bounds a re-keyed endpoint's map of links."""
        config = self.hash_config
        if config is None:
            return keys
        count = len(keys)
        plain = (
            event.lora_name is None
            and event.lookahead_token_ids is None
            and (event.extra_keys is None or all(k is None for k in event.extra_keys))
        )
        checkable = (
            plain and event.block_size > 0 and len(event.token_ids) == count * event.block_size
        )
        if not ep.rekey:
            limit = self._self_check_blocks
            if not checkable or (limit is not None and ep.verified_since_restart >= limit):
                ep.unchecked_blocks += count
                self.unchecked_blocks_total += count
                return keys
            problem = self._verify(ep, event, keys, config)
            if problem is None:
                return keys
            self._enter_rekey(ep, event, keys, config, problem)
        if not plain:
            ep.unchecked_blocks += count
            self.unchecked_blocks_total += count
            return keys
        if checkable:
            return self._rekey(ep, event, keys, config, link_bound)
        # No tokens (e.g. an offloading connector's location-only event): map the pod's keys
        # through the blocks already re-keyed.
        links = ep.links
        if all(k in links for k in keys):
            ep.rekeyed_blocks += count
            self.rekeyed_blocks_total += count
            return [k for engine in keys for k in links[engine].our_keys]
        ep.skipped_events += 1
        self.skipped_events_total += 1
        return None

    @staticmethod
    def removed_keys(ep: EndpointKeyState, keys: list[int]) -> list[int]:
        """The keys a `BlockRemoved` of the pod's ``keys`` removes."""
        if not ep.rekey:
            return keys
        links = ep.links
        mapped: list[int] = []
        for engine in keys:
            link = links.get(engine)
            if link is None:
                # Stored before the mismatch was seen, or with extra keys: under its own key.
                mapped.append(engine)
            else:
                mapped.extend(link.our_keys)
        return mapped

    @staticmethod
    def forget_removed(ep: EndpointKeyState, keys: list[int], held: Container[int]) -> None:
        """After a removal of the pod's ``keys``: drop the links none of whose blocks the
        endpoint still holds (``held``), keeping those another tier still holds (a GPU eviction
        of a block offloaded to CPU), so the later CPU removal still maps."""
        if not ep.rekey:
            return
        links = ep.links
        for engine in keys:
            link = links.get(engine)
            if link is not None and not any(k in held for k in link.our_keys):
                del links[engine]

    def _verify(
        self, ep: EndpointKeyState, event: BlockStored, keys: list[int], config: HashConfig
    ) -> str | None:
        """None when the event agrees with our hashing (or cannot be verified: then counted as
        unverified), else what differs."""
        size = config.block_size
        if event.block_size != size:
            return f"its events have block size {event.block_size}"
        count = len(keys)
        digests = self._digests
        parent_hash = event.parent_block_hash
        if parent_hash is None:
            parent: bytes | None = self._none_hash
        else:
            parent = digests.get(block_key(parent_hash))
        if parent is None:
            ep.unverified_blocks += count
            self.unverified_blocks_total += count
            return None
        tokens = event.token_ids
        computed: list[tuple[int, bytes]] = []
        for i, key in enumerate(keys):
            digest = digests.get(key)
            if digest is None:
                digest = config.hash_block(parent, tokens[i * size : (i + 1) * size], None)
                ours = event_key(digest)
                if ours != key:
                    return (
                        f"block {i} of a BlockStored has key {key:#018x} where this EPP "
                        f"computes {ours:#018x}"
                    )
                computed.append((key, digest))
            else:
                digests.move_to_end(key)
            parent = digest
        if self._digests_capacity:
            for key, digest in computed:
                digests[key] = digest
            while len(digests) > self._digests_capacity:
                digests.popitem(last=False)
        ep.verified_blocks += count
        ep.verified_since_restart += count
        self.verified_blocks_total += count
        return None

    def _enter_rekey(
        self,
        ep: EndpointKeyState,
        event: BlockStored,
        keys: list[int],
        config: HashConfig,
        problem: str,
    ) -> None:
        ep.rekey = True
        ep.mismatch_events += 1
        self.mismatch_events_total += 1
        if ep.logged_mismatch:
            return
        ep.logged_mismatch = True
        guess, fixable = _diagnose(event, keys, config)
        logger.warning(
            "endpoint %s hashes KV blocks differently from this EPP: %s (configured: algo %s, "
            "PYTHONHASHSEED %s, block size %d). %s Its blocks are indexed under the EPP's own "
            "hashes of their tokens from now on, so routing stays correct.%s",
            ep.name,
            problem,
            config.algo,
            "unset" if config.seed is None else repr(config.seed),
            config.block_size,
            guess,
            " Align the pod's --prefix-caching-hash-algo, PYTHONHASHSEED and --block-size with "
            "the EPP's hash configuration to save that work."
            if fixable
            else "",
        )

    def _rekey(
        self,
        ep: EndpointKeyState,
        event: BlockStored,
        keys: list[int],
        config: HashConfig,
        link_bound: Callable[[], int],
    ) -> list[int] | None:
        links = ep.links
        parent_hash = event.parent_block_hash
        if parent_hash is None:
            chain: bytes | None = None
            tail: tuple[int, ...] = ()
        else:
            link = links.get(block_key(parent_hash))
            if link is None:
                ep.skipped_events += 1
                self.skipped_events_total += 1
                return None
            chain, tail = link.digest, link.tail
        hasher = self._rekey_hasher
        if hasher is None:
            hasher = self._rekey_hasher = PrefixHasher(config, cache_blocks=_REKEY_HASHER_BLOCKS)
        tokens = tail + event.token_ids if tail else event.token_ids
        digests = hasher.digests(tokens, parent=chain)
        ours = [event_key(d) for d in digests]
        size = config.block_size
        pod_size = event.block_size
        done = 0
        for i, engine in enumerate(keys):
            end = len(tail) + (i + 1) * pod_size  # tokens up to the end of engine block i
            complete = end // size
            links[engine] = _Link(
                tuple(ours[done:complete]),
                digests[complete - 1] if complete else chain,
                tokens[complete * size : end],
            )
            done = complete
        count = len(keys)
        ep.rekeyed_blocks += count
        self.rekeyed_blocks_total += count
        # Links of blocks the pod never removes (lost events) must not grow without bound.
        bound = link_bound()
        if len(links) > bound:
            for engine in list(islice(links, len(links) - bound)):
                del links[engine]
        return ours


def _diagnose(event: BlockStored, keys: list[int], config: HashConfig) -> tuple[str, bool]:
    """A guess at the pod's hash configuration from one event that starts a chain, for the
    mismatch log line (runs once per endpoint), and whether the pod's flags can fix it."""
    size = event.block_size
    if event.parent_block_hash is not None or size <= 0:
        return "Its configuration cannot be told from an event that continues a chain.", True
    first = event.token_ids[:size]
    if size % config.block_size == 0 and size > config.block_size:
        # Hybrid/multi-group models hash at a smaller unit and report the last hash per KV block
        # (docs/vllm-interop.md §3): same algorithm and seed, coarser blocks.
        chain = config.none_hash
        for start in range(0, size, config.block_size):
            chain = config.hash_block(chain, first[start : start + config.block_size], None)
        if event_key(chain) == keys[0]:
            guess = (
                f"It hashes like this EPP at block size {config.block_size} but reports "
                f"{size}-token KV blocks (a hybrid or multi-group model), which is expected."
            )
            return guess, False
    seeds = list(dict.fromkeys((config.seed, *_DIAGNOSIS_SEEDS)))
    for algo in HASH_ALGOS:
        for seed in seeds:
            try:
                candidate = HashConfig(block_size=size, algo=algo, seed=seed)  # type: ignore[arg-type]
            except HashConfigError:
                continue
            digest = candidate.hash_block(candidate.none_hash, first, None)
            if event_key(digest) == keys[0]:
                shown = "unset" if seed is None else repr(seed)
                return (
                    f"Its keys match algo {algo}, PYTHONHASHSEED {shown}, block size {size}.",
                    True,
                )
    guess = (
        "No algorithm with PYTHONHASHSEED unset, '0', '42' or the configured seed reproduces its "
        "keys (another seed, or extra keys the event does not show)."
    )
    return guess, True
