"""How a stream's events leave for its client: each write carries what is due.

The first token goes out at once. After that a stream follows its reader: while the
previous write is still being sent (the client reads slower than tokens come), new
events wait in their channels, and the next write takes all of them together — nothing
dropped, order kept. Pacing for UIs holds tokens back on purpose: `interval` tokens per
write (vLLM's `--stream-interval`), at most `max_rate` tokens per second, and `smooth`:
the tokens one step brings at once (speculation's accepted drafts) spread over the
stream's recent step interval (`smoothed_due`). What waits
unread is bounded by `max_buffer` tokens per channel (`guard_stream`, `Channel.bound`):
past it the request is cancelled and the stream ends with an error event.

The engine never waits on any of this: it pushes into channels and moves on.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections.abc import AsyncGenerator, Callable, Sequence
from dataclasses import dataclass

from textgate.router.config import DEFAULT_MAX_STREAM_BUFFER, RouterConfig
from textgate.router.engine.channel import (
    STREAM_BUFFER_OVERFLOW,
    Channel,
    ErrorEvent,
    Event,
    StepEvent,
    is_final,
)
from textgate.router.metrics import Metrics

CLIENT_DISCONNECTED = "client_disconnected"
"""The `reason` a request counts as cancelled when its client leaves before its end."""

Write = list[tuple[int, Event]]
"""One write's events: (index of the channel, event), in order within each channel."""


@dataclass(frozen=True)
class StreamPacing:
    """How a stream's tokens go out after its first one (checked by `RouterConfig`)."""

    interval: int = 1
    """Tokens per write (vLLM's --stream-interval); the last write may carry fewer."""
    max_rate: float | None = None
    """Most tokens per second per channel; None = as fast as the client reads."""
    max_buffer: int = DEFAULT_MAX_STREAM_BUFFER
    """Tokens a channel may hold unread before its request is cancelled."""
    smooth: bool = False
    """Spread the tokens a step brings at once over the stream's step interval
    (--smooth-speculative-streams)."""

    @classmethod
    def from_config(cls, config: RouterConfig) -> StreamPacing:
        return cls(
            config.stream_interval,
            config.max_stream_rate,
            config.max_stream_buffer,
            config.smooth_speculative_streams,
        )


async def deliveries(
    channels: Sequence[Channel], pacing: StreamPacing
) -> AsyncGenerator[Write, None]:
    """The writes of a stream reading `channels`, until each has given its final event.

    Waits for the next write only when the caller asks for it, i.e. once the previous
    one was sent: that is what makes a slow client's writes carry several events.
    """
    arrived = asyncio.Event()
    readers = [_Reader(channel, pacing) for channel in channels]
    for channel in channels:
        channel.listen(arrived)
    open_readers = list(enumerate(readers))
    while open_readers:
        arrived.clear()
        now = time.monotonic()
        write: Write = []
        wake_at: float | None = None
        for index, reader in open_readers:
            events, retry_at = reader.take(now)
            write += [(index, event) for event in events]
            if retry_at is not None:
                wake_at = retry_at if wake_at is None else min(wake_at, retry_at)
        if write:
            open_readers = [(i, r) for i, r in open_readers if not r.done]
            yield write
        elif wake_at is None:
            await arrived.wait()
        else:
            await _wait_until(arrived, wake_at)


def guard_stream(
    channels: Sequence[Channel], pacing: StreamPacing, metrics: Metrics
) -> Callable[[], None]:
    """Bound what each of a stream's channels may hold unread, and give the response's
    `on_disconnect`: cancel the unfinished channels.

    Either way the request counts as cancelled once, when it happens (a stuck client may
    never read its error event), and not when it had already ended.
    """
    counted = False

    def count(reason: str) -> None:
        nonlocal counted
        if not counted:
            counted = True
            metrics.request_cancelled(reason)

    for channel in channels:
        channel.bound(pacing.max_buffer, on_overflow=lambda: count(STREAM_BUFFER_OVERFLOW))

    def disconnected() -> None:
        if any([channel.cancel() for channel in channels]):
            count(CLIENT_DISCONNECTED)

    return disconnected


def smoothed_due(channel: Channel, now: float) -> tuple[int, float | None]:
    """How many of `channel`'s waiting tokens are due at `now` when steps are smoothed, and
    when the next one held back is due (None: none is held).

    A step that brought k tokens spreads them over the request's recent step interval T
    (`Channel.step_interval`): its token j is due T * j / k after the step came, so the
    stream's pace follows its rate instead of arriving in bursts. Only the newest step's
    tokens are ever held: once a later step came, or the step ends the request (its last
    token and final event), all of it is due; so nothing waits past the next step, and
    the end of a request is never delayed.
    """
    newest = channel.newest_pending
    num_pending = channel.num_pending_tokens
    interval = channel.step_interval
    if newest is None or not interval or is_final(newest[0]):
        return num_pending, None
    event, arrival = newest
    assert isinstance(event, StepEvent)  # an error event is final
    num_left = len(event.tokens)
    num_step = arrival.num_step_tokens
    spacing = interval / max(num_step, 1)
    # The epsilon: at a due time computed below, that token counts as due.
    num_due_in_step = min(num_step, math.floor((now - arrival.at) / spacing + 1e-9) + 1)
    num_released = max(num_due_in_step, num_step - num_left)
    if num_released >= num_step:
        return num_pending, None
    return num_pending - (num_step - num_released), arrival.at + num_released * spacing


class _Reader:
    """Takes one channel's events when they are due under the pacing."""

    def __init__(self, channel: Channel, pacing: StreamPacing) -> None:
        self._channel = channel
        self._interval = pacing.interval
        self._rate = pacing.max_rate
        self._smooth = pacing.smooth
        self._started = False
        self._allowance = 0.0
        """Tokens the rate allows now (a bucket of `interval` tokens, refilled at `rate`)."""
        self._refilled_at = 0.0
        self.done = False
        """The final event was taken."""

    def take(self, now: float) -> tuple[list[Event], float | None]:
        """The events due now, or none and when to look again (None: when one arrives)."""
        channel = self._channel
        if not channel.has_pending:
            return [], None
        if not self._started:
            # The first token goes out at once, whatever the pacing.
            self._started = True
            self._refilled_at = now
            first = channel.take(None if self._rate is None else self._interval)
            return self._taken(first), None
        pending = channel.num_pending_tokens
        due, held_until = smoothed_due(channel, now) if self._smooth else (pending, None)
        need = min(self._interval, pending) if channel.final_pending else self._interval
        if due < need:
            return [], held_until
        if self._rate is None:
            return self._taken(channel.take(due, split=self._smooth)), None
        self._allowance = min(
            float(self._interval), self._allowance + (now - self._refilled_at) * self._rate
        )
        self._refilled_at = now
        if self._allowance < need:
            return [], now + (need - self._allowance) / self._rate
        events = channel.take(min(max(math.floor(self._allowance), 1), due), split=self._smooth)
        self._allowance -= sum(0 if isinstance(e, ErrorEvent) else len(e.tokens) for e in events)
        return self._taken(events), None

    def _taken(self, events: list[Event]) -> list[Event]:
        self.done = bool(events) and is_final(events[-1])
        return events


async def _wait_until(arrived: asyncio.Event, deadline: float) -> None:
    """Until an event arrives or `deadline` (monotonic seconds) passes."""
    with contextlib.suppress(asyncio.TimeoutError):
        await asyncio.wait_for(arrived.wait(), max(deadline - time.monotonic(), 0.0))
