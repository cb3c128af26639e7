"""How much later traffic a placement commits: learned from whether requests continue earlier
ones.

A chat turn resends the whole conversation, so its prompt starts with the previous turn's prompt
(and answer): its block keys contain the previous prompt's last full block key.  Counting how
many requests continue an earlier one (`SessionTracker.observe`) gives the expected number of
follow-ups a request brings with it: with a fraction ``c`` of requests being continuations, a
session has ``1 / (1 − c)`` requests on average, so a new one brings ``c / (1 − c)`` more.  On
a fleet of one-off prompts (shared system prompts, documents, unique questions) ``c`` is about 0
and nothing changes; on multi-turn chat, where a conversation stays on the pod that holds it,
placing its first turn places every later turn too.

Exact repeats of a prompt are not continuations (their keys end at the earlier tip), and a tip
counts once: reuse of a prefix is already priced by the prefix terms, only growth commits
future load.

It also keeps what placements committed on each pod: its recent share of the routed requests
(exponentially weighted), and the cache its live conversations hold there (`footprint`).  A
conversation's footprint on a pod is the prompt tokens its turns wrote there (their uncached
tokens; a turn that moved it starts over on the new pod), and it is live until its next turn
continues it or it has gone unanswered for three times the usual distance between turns (in
routed requests, so the same on any clock).  Clients usually take turns among their
conversations, so a pod whose live conversations outgrow its cache evicts the least recently
used one, which is the next to come back: a new conversation belongs where that demand is
lowest, not merely where fewer requests go.
"""

from __future__ import annotations

import math
from collections import OrderedDict, deque
from collections.abc import Mapping, Sequence
from typing import NamedTuple

# Tips remembered: enough for every conversation open at once on a large pool (a tip is 8 bytes
# of key and a dict slot; 65,536 of them are ~6 MiB).  A continuation arrives after its
# predecessor's answer, seconds to minutes later: remembering the last tips is what matters,
# not how long.
_TIPS = 65_536
# Expected follow-ups are capped: a few endless sessions must not freeze placement.
_CAP_FOLLOWUPS = 64.0
# Requests per pod over which the shares and the continuation fraction are averaged
# (exponential weights): long enough that a share is not one request's noise, short enough to
# follow sessions that end and start.
_MEMORY_PER_POD = 20
# Until warm, the continuation fraction and uncached tokens are plain means with this many
# requests that continued nothing and brought nothing counted in.
_PRIOR = 10
# A conversation not continued within this many times the mean distance between its turns (in
# routed requests) has ended: its footprint no longer counts (a later turn still continues it).
_LIVE_DISTANCES = 3.0


class _Tip(NamedTuple):
    endpoint: str
    written: int
    """Prompt tokens the conversation's turns wrote on ``endpoint``."""
    seq: int
    """The routed request that left it."""
    live: bool = True
    """Its ``written`` counts in the pod's footprint (not yet taken for ended)."""


class SessionTracker:
    """See the module docstring."""

    def __init__(self) -> None:
        self._tips: OrderedDict[int, _Tip] = OrderedDict()
        # (seq, key) of the tips whose footprint counts, oldest first.  A tip taken for ended
        # stays a tip: a turn after a long pause still continues its conversation.
        self._live: deque[tuple[int, int]] = deque()
        self._continued = 0.0
        self._observed = 0
        self._shares: dict[str, float] = {}
        self._uncached = 0.0
        self._footprints: dict[str, int] = {}
        self._distance: float | None = None  # mean routed requests between a tip and its turn

    def observe(
        self,
        keys: Sequence[int] | None,
        endpoint: str,
        *,
        pods: int,
        uncached: int,
        new_tip: bool = True,
    ) -> bool:
        """A request routed to ``endpoint`` (one of ``pods``) with prompt block keys ``keys``
        (None: unknown), ``uncached`` of its prompt tokens not cached there; ``new_tip``: no pod
        held its last full block yet (else it is no conversation's tip: see `observe`).
        Returns whether it continued a conversation (`continues` before this call)."""
        # Shares start at 0 and move by exponential weights over _MEMORY_PER_POD requests per
        # pod: a few requests on one pod at start-up are not yet an imbalance.
        alpha = 1.0 / (_MEMORY_PER_POD * max(1, pods))
        for address in self._shares:
            self._shares[address] *= 1.0 - alpha
        self._shares[endpoint] = self._shares.get(endpoint, 0.0) + alpha
        # The means start as plain means over the requests seen plus _PRIOR that continued
        # nothing (one continuation among the first two is no session pattern yet).
        self._observed += 1
        mean = max(alpha, 1.0 / (self._observed + _PRIOR))
        self._uncached += mean * (uncached - self._uncached)
        self._expire()
        if not keys:
            return False
        tips = self._tips
        # A continuation holds an earlier tip before its own last block.  A tip continues once:
        # the next turn of a conversation extends it, and then that turn's own tip; a tip that
        # many prompts contain is a shared prefix's last block (a prompt whose own text ended
        # inside its first block after a system prompt), not a conversation.
        previous: _Tip | None = None
        for key in keys[:-1]:
            tip = tips.pop(key, None)
            if tip is not None:
                self._drop(tip)
                if previous is None or tip.seq > previous.seq:
                    previous = tip
        continued = previous is not None
        self._continued += mean * (float(continued) - self._continued)
        if previous is not None:
            distance = float(self._observed - previous.seq)
            self._distance = (
                distance
                if self._distance is None
                else self._distance + mean * (distance - self._distance)
            )
        if not new_tip:
            return continued
        written = uncached
        if previous is not None and previous.endpoint == endpoint:
            written += previous.written
        tip = _Tip(endpoint, written, self._observed)
        tips[keys[-1]] = tip
        tips.move_to_end(keys[-1])
        self._live.append((tip.seq, keys[-1]))
        self._footprints[endpoint] = self._footprints.get(endpoint, 0) + written
        if len(tips) > _TIPS:
            self._drop(tips.popitem(last=False)[1])
        return continued

    def _drop(self, tip: _Tip) -> None:
        """``tip``'s footprint no longer counts."""
        left = self._footprints.get(tip.endpoint)
        if tip.live and left is not None:
            self._footprints[tip.endpoint] = max(0, left - tip.written)

    def _expire(self) -> None:
        """Conversations not continued for `_LIVE_DISTANCES` times the mean distance between
        turns have ended: their footprints stop counting (they stay tips)."""
        live, tips = self._live, self._tips
        oldest = (
            -math.inf
            if self._distance is None  # no conversation continued yet: none known to have ended
            else self._observed - _LIVE_DISTANCES * self._distance
        )
        while live and (live[0][0] < oldest or len(live) > _TIPS):
            seq, key = live.popleft()
            tip = tips.get(key)
            if tip is not None and tip.seq == seq and tip.live:
                self._drop(tip)
                tips[key] = tip._replace(live=False)  # (an existing key keeps its place)

    def continues(self, keys: Sequence[int] | None) -> bool:
        """Whether a prompt with block keys ``keys`` continues a conversation seen before (it
        holds an earlier tip before its own last block)."""
        if not keys:
            return False
        tips = self._tips
        return any(key in tips for key in keys[:-1])

    @property
    def expected_followups(self) -> float:
        """Requests expected to follow a request on the pod that holds it: c / (1 − c)."""
        c = min(self._continued, 1.0 - 1.0 / (_CAP_FOLLOWUPS + 1.0))
        return c / (1.0 - c)

    @property
    def uncached(self) -> float:
        """Uncached prompt tokens per routed request: the prefill a session's next turn brings."""
        return self._uncached

    def share(self, endpoint: str) -> float:
        """``endpoint``'s recent share of the routed requests (0 before any)."""
        return self._shares.get(endpoint, 0.0)

    def footprint(self, endpoint: str) -> int:
        """Prompt tokens ``endpoint``'s live conversations wrote there (module docstring)."""
        return self._footprints.get(endpoint, 0)

    def footprint_shares(self, capacities: Mapping[str, int | None]) -> dict[str, float]:
        """Each pod's share of the live conversations' cache demand, each footprint over the
        pod's capacity (all taken equal when one is unknown); all 0 before any."""
        known = all(capacities.values())
        load = {a: self.footprint(a) / (c if known and c else 1) for a, c in capacities.items()}
        total = sum(load.values())
        if total <= 0:
            return dict.fromkeys(capacities, 0.0)
        return {a: x / total for a, x in load.items()}

    def forget(self, endpoint: str) -> None:
        self._shares.pop(endpoint, None)
        self._footprints.pop(endpoint, None)
