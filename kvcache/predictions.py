"""Predicted index entries: the blocks a routed request will make its pod cache, until the pod's
own KV events arrive (llm-d's ``speculativeIndexing``)."""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Sequence

from indexer.events import block_key


class PredictedBlocks:
    """Predicted (endpoint, block) entries with a common time to live.

    Per endpoint, block key → expiry time; a FIFO of insertions expires them in order (the TTL
    is fixed, so expiries are in insertion order).  A key predicted again gets the later expiry;
    the earlier insertion then finds a newer expiry and leaves the entry alone.  Empty (falsy)
    when nothing is predicted, so callers skip it at no cost."""

    __slots__ = ("_by_endpoint", "_queue", "ttl")

    def __init__(self, ttl: float) -> None:
        self.ttl = ttl
        self._by_endpoint: dict[str, dict[int, float]] = {}
        self._queue: deque[tuple[float, str, list[int]]] = deque()

    def __bool__(self) -> bool:
        return bool(self._queue)

    def __len__(self) -> int:
        """(endpoint, block) entries held (expired ones included until `expire` runs)."""
        return sum(len(held) for held in self._by_endpoint.values())

    def add(self, endpoint: str, keys: Sequence[int], now: float) -> None:
        expiry = now + self.ttl
        held = self._by_endpoint.setdefault(endpoint, {})
        held.update(dict.fromkeys(keys, expiry))
        self._queue.append((expiry, endpoint, list(keys)))

    def expire(self, now: float) -> None:
        queue = self._queue
        while queue and queue[0][0] <= now:
            expiry, endpoint, keys = queue.popleft()
            held = self._by_endpoint.get(endpoint)
            if held is None:
                continue
            for key in keys:
                if held.get(key, expiry) <= expiry:
                    held.pop(key, None)
            if not held:
                del self._by_endpoint[endpoint]

    def endpoints(self, candidates: Iterable[str]) -> list[str]:
        """The candidates that hold any prediction."""
        held = self._by_endpoint
        return [c for c in candidates if c in held]

    def run(self, endpoint: str, keys: Sequence[int], start: int, now: float) -> int:
        """How many of ``keys[start:]`` ``endpoint`` holds predictively, consecutively."""
        held = self._by_endpoint.get(endpoint)
        if not held:
            return 0
        count = 0
        get = held.get
        for key in keys[start:]:
            if get(key, 0.0) <= now:
                break
            count += 1
        return count

    def discard(self, endpoint: str, keys: Iterable[int | bytes]) -> None:
        """The endpoint's own events speak for these blocks now."""
        held = self._by_endpoint.get(endpoint)
        if held:
            for key in keys:
                held.pop(key if type(key) is int else block_key(key), None)

    def remove_endpoint(self, endpoint: str) -> None:
        self._by_endpoint.pop(endpoint, None)
