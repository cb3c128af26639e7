"""What a write on a pod evicts, and whether anyone comes back for it.

vLLM frees the least recently used cached blocks first when a prompt needs room.  So what a new
prompt costs the requests after it is the content at the *tail* of the pod's least-recently-used
order, and that costs a later hit only if the content is reused: a document many questions
share, a system prompt, a conversation still going.  The tail of a pod full of one-off prompts
costs nothing; the tail of a pod whose documents were last asked about a while ago costs a
document.

`ReuseTail` keeps, per pod, the blocks of the prompts routed there, in the order they were last
routed (the order vLLM's LRU follows when every request reaches the pod through this EPP), each
with how many requests named it, as many as the pod's cache holds.  `reused_evicted` walks the
tail and counts the tokens of the blocks that two or more requests named, among those a write
of ``tokens`` would evict.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Collection, Sequence

# Blocks remembered per pod while its capacity is unknown (no metrics yet): a 32k-token cache at
# 16-token blocks.  Once the capacity is known it bounds the memory instead.
_DEFAULT_BLOCKS = 2048


class ReuseTail:
    """See the module docstring.  One owner: the scorer that routes with it."""

    def __init__(self) -> None:
        self._pods: dict[str, OrderedDict[int, int]] = {}

    def observe(self, endpoint: str, keys: Sequence[int], capacity_blocks: int | None) -> None:
        """A request naming block ``keys`` was routed to ``endpoint``, whose cache holds
        ``capacity_blocks`` blocks (None while unknown)."""
        touches = self._pods.get(endpoint)
        if touches is None:
            touches = self._pods[endpoint] = OrderedDict()
        for key in keys:
            touches[key] = touches.get(key, 0) + 1
            touches.move_to_end(key)
        limit = capacity_blocks if capacity_blocks else _DEFAULT_BLOCKS
        while len(touches) > limit:
            touches.popitem(last=False)

    def named(self, endpoint: str, key: int) -> int:
        """How many requests routed to ``endpoint`` named block ``key`` (0 once it has left the
        tail's memory)."""
        touches = self._pods.get(endpoint)
        return touches.get(key, 0) if touches else 0

    def reused_evicted(self, endpoint: str, blocks: int, keep: Collection[int] = ()) -> int:
        """How many of the ``blocks`` least recently routed blocks of ``endpoint`` (``keep``
        aside: the request's own, which it touches) were named by two or more requests."""
        touches = self._pods.get(endpoint)
        if not touches or blocks <= 0:
            return 0
        reused = 0
        walked = 0
        for key, count in touches.items():
            if key in keep:
                continue
            walked += 1
            if count >= 2:
                reused += 1
            if walked >= blocks:
                break
        return reused

    def forget(self, endpoint: str) -> None:
        """``endpoint`` left the pool or restarted: nothing it held survives."""
        self._pods.pop(endpoint, None)
