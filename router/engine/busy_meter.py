"""Utilization on the CPU path: the share of recent wall time spent inside shard steps."""

from __future__ import annotations

from collections import deque


class BusyMeter:
    """Busy fraction of the last `window_s` seconds, from the intervals the engine records.

    The engine records each shard call's [start, end); time between calls is the device
    waiting on the router (scheduling, routing tokens, HTTP work on the event loop) or on
    requests. A GPU deployment can feed the controller NVML's utilization instead: the
    controller only ever sees the number.
    """

    def __init__(self, window_s: float = 1.0) -> None:
        if window_s <= 0:
            raise ValueError(f"window_s must be > 0, got {window_s}")
        self.window_s = window_s
        self._intervals: deque[tuple[float, float]] = deque()
        self._origin: float | None = None

    def record(self, start: float, end: float) -> None:
        """One busy interval (monotonic seconds); intervals arrive in time order."""
        if end < start:
            raise ValueError(f"busy interval ends before it starts: [{start}, {end})")
        if self._origin is None:
            self._origin = start
        self._intervals.append((start, end))

    def utilization(self, now: float) -> float:
        """Busy share of [now - window_s, now], or of the time since the first interval
        when that is shorter; 0.0 before any interval."""
        if self._origin is None:
            return 0.0
        since = max(now - self.window_s, self._origin)
        while self._intervals and self._intervals[0][1] <= since:
            self._intervals.popleft()
        span = now - since
        if span <= 0:
            return 0.0
        busy = sum(min(end, now) - max(start, since) for start, end in self._intervals)
        return min(1.0, max(0.0, busy / span))

    def reset(self) -> None:
        """Forget every interval: the engine went idle, utilization is 0 from here."""
        self._intervals.clear()
        self._origin = None
