"""A stream's writes from its channels, in any API's frames: joined steps, the opening and
closing frames, failures and cancellation."""

from __future__ import annotations

from textgate.router.engine.channel import Channel, ErrorEvent, Finished, StepEvent, TokenInfo
from textgate.router.http.event_stream import event_stream, per_channel


def step(text: str, finished: str | None = None) -> StepEvent:
    done = None if finished is None else Finished(text, 1, finished, None)  # type: ignore[arg-type]
    return StepEvent(tokens=[TokenInfo(id=1, text=text, logprob=-0.5)], finished=done)


class Recorder:
    """A FrameWriter that spells each call as one line."""

    def opening(self) -> bytes:
        return b"open\n"

    def step(self, index: int, event: StepEvent) -> bytes:
        return f"{index}:{''.join(t.text for t in event.tokens)}\n".encode()

    def closing(self, failure: ErrorEvent | None, generated_tokens: int) -> bytes:
        return f"close {failure and failure.message} {generated_tokens}\n".encode()


def test_per_channel_joins_each_run_of_a_channels_steps_in_order() -> None:
    boom = ErrorEvent("boom")
    write = [(0, step("a")), (0, step("b", "length")), (1, step("x")), (1, boom)]
    joined = per_channel(write)
    assert [(i, e.tokens[0].text if isinstance(e, StepEvent) else e) for i, e in joined] == [
        (0, "a"),
        (1, "x"),
        (1, boom),
    ]
    first = joined[0][1]
    assert isinstance(first, StepEvent)
    assert [t.text for t in first.tokens] == ["a", "b"]
    assert first.finished is not None and first.finished.finish_reason == "length"


async def test_the_writer_frames_the_opening_each_step_and_the_closing() -> None:
    channel = Channel(3)
    channel.push(step("a"))
    channel.push(step("b", "length"))
    ended: list[object] = []
    frames = event_stream([channel], Recorder(), lambda f, n: ended.append((f, n)))
    writes = [w async for w in frames]
    assert b"".join(writes) == b"open\n0:ab\nclose None 1\n"
    assert ended == [(None, 1)]


async def test_a_failure_closes_the_stream_and_cancels_the_others() -> None:
    failing, other = Channel(1), Channel(1)
    failing.push(ErrorEvent("boom"))
    writes = [w async for w in event_stream([failing, other], Recorder())]
    assert writes[-1] == b"close boom 0\n"
    assert other.cancelled
