"""A sliding-window limit: amounts charged in the last `window_s` seconds stay under `limit`."""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

Clock = Callable[[], float]
"""Monotonic seconds; tests inject their own."""


@dataclass
class Charge:
    """One amount in the window; `amount` may be lowered later (settled to what was used)."""

    at: float
    amount: int


class SlidingWindow:
    """Every charge of the last `window_s` seconds, kept exactly (a log, not buckets), so
    the sum of any `window_s` span never exceeds `limit` and the wait it answers is exact.

    `limit` None is no limit: nothing is kept, everything fits.
    """

    def __init__(self, limit: int | None, window_s: float = 60.0, clock: Clock = time.monotonic):
        self.limit = limit
        self.window_s = window_s
        self._clock = clock
        self._charges: deque[Charge] = deque()

    def used(self) -> int:
        """What the charges still in the window add up to."""
        self._expire(self._clock())
        return sum(c.amount for c in self._charges)

    def wait_s(self, amount: int) -> float | None:
        """Seconds until `amount` more fits (0: now), counting the charges as they stand;
        None when it never can (more than `limit` alone)."""
        if self.limit is None:
            return 0.0
        if amount > self.limit:
            return None
        now = self._clock()
        self._expire(now)
        excess = sum(c.amount for c in self._charges) + amount - self.limit
        if excess <= 0:
            return 0.0
        # Oldest first: the wait ends when enough of them have left the window.
        for charge in self._charges:
            excess -= charge.amount
            if excess <= 0:
                return charge.at + self.window_s - now
        raise AssertionError("amount <= limit fits once every charge has expired")

    def charge(self, amount: int) -> Charge:
        """Charge `amount` now (the caller checked `wait_s` first)."""
        charge = Charge(self._clock(), amount)
        if self.limit is not None:
            self._charges.append(charge)
        return charge

    def _expire(self, now: float) -> None:
        while self._charges and self._charges[0].at + self.window_s <= now:
            self._charges.popleft()
