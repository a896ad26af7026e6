"""A streamed answer's writes, from its requests' channels, in any API's frames.

`event_stream` reads the channels together through `deliveries` (what each write
carries) and asks a `FrameWriter` for the API's frames: an opening, one piece per
request's run of steps in a write (`per_channel` joins them, as vLLM's
--stream-interval does), a closing once every request ended or one failed. A failure
cancels the others; leaving the generator early (client gone, server closing) cancels
every request.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import aclosing
from typing import Protocol

from textgate.router.engine.channel import Channel, ErrorEvent, Event, StepEvent
from textgate.router.http.delivery import StreamPacing, Write, deliveries

UNPACED = StreamPacing()

OnEnd = Callable[[ErrorEvent | None, int], None]
"""Hears how a stream ended (the failure, or None when every request finished) and the
number of tokens generated, before the last frames are sent."""


class FrameWriter(Protocol):
    """Turns a stream's events into one API's frames (b"" where there are none)."""

    def opening(self) -> bytes:
        """The frames the stream starts with."""

    def step(self, index: int, event: StepEvent) -> bytes:
        """The frames of one (joined) step event of request `index`."""

    def closing(self, failure: ErrorEvent | None, generated_tokens: int) -> bytes:
        """The last frames: after every request finished, or one failed (`failure`)."""


async def event_stream(
    channels: Sequence[Channel],
    writer: FrameWriter,
    on_end: OnEnd | None = None,
    pacing: StreamPacing = UNPACED,
) -> AsyncIterator[bytes]:
    """The writes of a stream whose request i reads `channels[i]`. `on_end` is not
    called when the client leaves first."""
    generated_tokens = 0
    failure: ErrorEvent | None = None
    try:
        opening = writer.opening()
        if opening:
            yield opening
        async with aclosing(deliveries(channels, pacing)) as writes:
            async for write in writes:
                frames: list[bytes] = []
                for index, event in per_channel(write):
                    if isinstance(event, ErrorEvent):
                        failure = event
                        break
                    if event.finished is not None:
                        generated_tokens += event.finished.generated_tokens
                    frames.append(writer.step(index, event))
                joined = b"".join(frames)
                if joined:
                    yield joined
                if failure is not None:
                    break
        if on_end is not None:
            on_end(failure, generated_tokens)
        yield writer.closing(failure, generated_tokens)
    finally:
        # No-op for finished requests; stops the others (error, client gone, closing).
        for channel in channels:
            channel.cancel()


def per_channel(write: Write) -> list[tuple[int, Event]]:
    """A write's events with each run of one channel's steps joined into one event."""
    joined: list[tuple[int, Event]] = []
    run: list[StepEvent] = []
    run_index = 0
    for index, event in write:
        if run and (index != run_index or not isinstance(event, StepEvent)):
            joined.append((run_index, StepEvent.joined(run)))
            run = []
        if isinstance(event, StepEvent):
            run.append(event)
            run_index = index
        else:
            joined.append((index, event))
    if run:
        joined.append((run_index, StepEvent.joined(run)))
    return joined
