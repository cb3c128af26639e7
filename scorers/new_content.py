"""How much of the content a request brings first is shared by later requests: learned from
the block keys of the requests routed.

A request's *new* blocks are those of its prompt no earlier request named.  Where it lands, they
are cached; if later requests share them (the system prompt of a group of questions, a document
asked about again), those requests follow it to that pod, so placing the new content places
their load too.  One-off content (a unique prompt, a question never asked again) commits
nothing.  `NewContentReuse` counts, of the tokens requests brought first, the share a later
request named again: the probability that a token of new content will be reused.

Reuse by a request that continues a conversation (`scorers.sessions`) does not count, nor does
the new content of such a request: a conversation's turns reuse what it wrote and bring no
other request to its pod, so where its first turn lands commits nobody else's load.

Both counts are exponentially weighted over the requests observed, so the share follows a
workload that changes; the reuse of a request's content is counted when it happens (later), so
the share lags by about the distance between a prefix's first request and its next.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

# Keys remembered: enough for what a large pool caches at once (16 pods × 16k blocks); a key is
# ~80 bytes in the dict and the queue (20 MiB at the bound).  Content not named again within
# that many new blocks has left every cache anyway.
_KEYS = 262_144
# Requests over which both counts are averaged (exponential weights).
_MEMORY = 500


class NewContentReuse:
    """See the module docstring.  One owner: the scorer that routes with it."""

    def __init__(self) -> None:
        # key -> not yet reused (True) / reused once already (False), and the keys oldest first
        # (a dict's own first key is found in time linear in the keys deleted before it).
        self._keys: dict[int, bool] = {}
        self._order: deque[int] = deque()
        self._new = 0.0
        self._reused = 0.0

    def observe(self, keys: Sequence[int], block_tokens: int, *, continues: bool) -> None:
        """A request naming block ``keys`` of ``block_tokens`` tokens each was routed;
        ``continues``: it continues a known conversation."""
        decay = 1.0 - 1.0 / _MEMORY
        self._new *= decay
        self._reused *= decay
        known = self._keys
        new_blocks = 0
        for key in keys:
            fresh = known.get(key)
            if fresh is None:
                if not continues:
                    known[key] = True
                    self._order.append(key)
                    new_blocks += 1
            elif fresh and not continues:
                known[key] = False
                self._reused += block_tokens
        self._new += new_blocks * block_tokens
        while len(self._order) > _KEYS:
            del known[self._order.popleft()]

    @property
    def rate(self) -> float:
        """Share of new content's tokens that a later request named again (0 before any)."""
        if self._new <= 0.0:
            return 0.0
        return min(1.0, self._reused / self._new)
