"""A clock the test moves by hand, for code that takes a ``clock: Callable[[], float]``."""

from __future__ import annotations


class ManualClock:
    """Calling it gives ``now``; a test advances time with ``clock.now += seconds``."""

    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now
