"""Which requests continue a conversation, and each pod's recent share of the routed requests.

A chat turn resends the whole conversation, so its prompt starts with the previous turn's prompt
(and answer): its block keys contain the previous prompt's last full block key, its *tip*.
`SessionTracker.observe` remembers each routed request's tip and tells whether the request
continued an earlier one.  The placement term of ``prefill-cost-scorer`` leaves continued
conversations out (`scorers.new_content`): their reuse follows them to their pod and brings no
other request there.

Exact repeats of a prompt are not continuations (their keys end at the earlier tip), and a tip
continues once: a tip that many prompts contain is a shared prefix's last block, not a
conversation.

It also keeps each pod's recent share of the routed requests (exponentially weighted), which the
share term of ``prefill-cost-scorer`` reads: a pod taking more than its share is busier than its
requests in flight show.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

# Tips remembered: enough for every conversation open at once on a large pool (a tip is 8 bytes
# of key and a dict slot; 65,536 of them are ~6 MiB).  A continuation arrives after its
# predecessor's answer, seconds to minutes later: remembering the last tips is what matters,
# not how long.
_TIPS = 65_536
# Requests per pod over which the shares are averaged (exponential weights): long enough that a
# share is not one request's noise, short enough to follow a fleet whose load shifts.
_MEMORY_PER_POD = 20


class SessionTracker:
    """See the module docstring.  One owner: the scorer that routes with it."""

    def __init__(self) -> None:
        self._tips: OrderedDict[int, None] = OrderedDict()
        self._shares: dict[str, float] = {}

    def observe(
        self, keys: Sequence[int] | None, endpoint: str, *, pods: int, new_tip: bool = True
    ) -> bool:
        """A request routed to ``endpoint`` (one of ``pods``) with prompt block keys ``keys``
        (None: unknown); ``new_tip``: no pod held its last full block yet (else it is no
        conversation's tip: a prompt whose text ends within a shared prefix's last block).
        Returns whether it continued a conversation (`continues` before this call)."""
        # Shares start at 0 and move by exponential weights over _MEMORY_PER_POD requests per
        # pod: a few requests on one pod at start-up are not yet an imbalance.
        alpha = 1.0 / (_MEMORY_PER_POD * max(1, pods))
        for address in self._shares:
            self._shares[address] *= 1.0 - alpha
        self._shares[endpoint] = self._shares.get(endpoint, 0.0) + alpha
        if not keys:
            return False
        tips = self._tips
        # A continuation holds an earlier tip before its own last block; the tip is used up,
        # and the request's own tip takes its place.
        continued = False
        for key in keys[:-1]:
            if key in tips:
                del tips[key]
                continued = True
        if new_tip:
            tips[keys[-1]] = None
            tips.move_to_end(keys[-1])
            if len(tips) > _TIPS:
                tips.popitem(last=False)
        return continued

    def continues(self, keys: Sequence[int] | None) -> bool:
        """Whether a prompt with block keys ``keys`` continues a conversation seen before (it
        holds an earlier tip before its own last block)."""
        if not keys:
            return False
        tips = self._tips
        return any(key in tips for key in keys[:-1])

    def share(self, endpoint: str) -> float:
        """``endpoint``'s recent share of the routed requests (0 before any)."""
        return self._shares.get(endpoint, 0.0)

    def forget(self, endpoint: str) -> None:
        """``endpoint`` left the pool: its share no longer counts."""
        self._shares.pop(endpoint, None)
