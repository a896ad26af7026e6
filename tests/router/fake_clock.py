"""A monotonic clock the test moves by hand (the quotas' `clock`)."""

from __future__ import annotations


class FakeClock:
    """Seconds that pass only when a test adds to `now`."""

    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now
