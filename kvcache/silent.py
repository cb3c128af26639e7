"""Silent KV-event publishers: pods that keep serving while their events stopped.

A pod whose publisher thread died, whose path to this EPP's SUB socket broke, or whose
connection libzmq dropped over an oversized message leaves its entries stale with no sequence
gap to tell, since nothing arrives.  The evidence that it should have published: a request this
EPP routed there completed (its usage came back) with at least two full prompt blocks the pod
did not hold, so the pod computed them and vLLM published BlockStored before the first token.
When no batch from that pod has arrived since such a request was routed, the view's
``silentPublisherTimeout`` after its completion, the publisher is marked silent until a batch
arrives.
"""

from __future__ import annotations

from collections.abc import Iterable

# A request's new full blocks below this are no evidence: when a whole prompt was cached, vLLM
# recomputes its last token, and the block holding it may already be cached (no BlockStored).
_MIN_NEW_BLOCKS = 2


class SilentPublishers:
    """Which endpoints' KV-event publishers are silent, from evidence that they should have
    published (see the module docstring).  Pure: times come from the caller's clock.

    Any batch resolves every piece of evidence pending for its endpoint (each was recorded at a
    completion, after its request was routed, so before the batch), and completions come in time
    order, so the first unresolved one has the earliest deadline: one deadline per endpoint is
    all the state needed."""

    __slots__ = ("_deadline", "_last_batch", "detected_total", "silent", "timeout")

    def __init__(self, timeout: float) -> None:
        self.timeout = timeout
        self._last_batch: dict[str, float] = {}  # endpoint → clock time of its last batch
        self._deadline: dict[str, float] = {}  # endpoint → when its oldest evidence is overdue
        self.silent: dict[str, float] = {}  # endpoint → clock time it was marked silent
        self.detected_total = 0

    def batch_arrived(self, endpoint: str, now: float) -> bool:
        """A batch from ``endpoint`` was applied; True if it had been marked silent."""
        self._last_batch[endpoint] = now
        self._deadline.pop(endpoint, None)
        return self.silent.pop(endpoint, None) is not None

    def completed(self, endpoint: str, routed_at: float, new_blocks: int, now: float) -> None:
        """A request routed to ``endpoint`` at ``routed_at`` completed at ``now``, after the
        pod computed ``new_blocks`` full prompt blocks it did not hold."""
        last = self._last_batch.get(endpoint)
        if new_blocks < _MIN_NEW_BLOCKS or last is None or last >= routed_at:
            # Not evidence, a pod never heard from (events off: nothing of it is indexed), or
            # the pod has published since the request was routed.
            return
        if endpoint not in self.silent:
            self._deadline.setdefault(endpoint, now + self.timeout)

    def check(self, now: float) -> list[str]:
        """Mark endpoints silent whose evidence is overdue; returns the newly marked ones."""
        if not self._deadline:
            return []
        marked = [endpoint for endpoint, due in self._deadline.items() if due <= now]
        for endpoint in marked:
            del self._deadline[endpoint]
            self.silent[endpoint] = now
            self.detected_total += 1
        return marked

    def forget(self, endpoint: str) -> None:
        self._last_batch.pop(endpoint, None)
        self._deadline.pop(endpoint, None)
        self.silent.pop(endpoint, None)

    def known(self) -> Iterable[str]:
        """Endpoints that have published at least once."""
        return self._last_batch.keys()
