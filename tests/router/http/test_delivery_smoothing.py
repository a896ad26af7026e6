"""--smooth-speculative-streams: the tokens one step brings at once go out spread over the
stream's step interval; nothing waits past the next step, a request's end is never held,
and a stream that is left or cancelled while tokens are held frees everything."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Sequence
from contextlib import aclosing
from pathlib import Path

import pytest

from textgate.router.config import RouterConfig
from textgate.router.engine.channel import (
    STREAM_BUFFER_OVERFLOW,
    Channel,
    ErrorEvent,
    Event,
    Finished,
    StepEvent,
    TokenInfo,
)
from textgate.router.generation.schemas import GenerateParameters
from textgate.router.http.delivery import (
    CLIENT_DISCONNECTED,
    StreamPacing,
    deliveries,
    guard_stream,
    smoothed_due,
)
from textgate.router.http.event_stream import event_stream
from textgate.router.metrics import Metrics
from textgate.router.tgi.output import stream_frames
from textgate.tests.router.fake_clock import FakeClock

SMOOTH = StreamPacing(smooth=True)


def step(*ids: int, final: bool = False) -> StepEvent:
    done = Finished("".join(f" t{i}" for i in range(1, ids[-1] + 1)), ids[-1], "length", None)
    tokens = [TokenInfo(id=i, text=f" t{i}", logprob=-1.0) for i in ids]
    return StepEvent(tokens, finished=done if final else None)


def token_ids(events: Sequence[Event]) -> list[int]:
    return [t.id for e in events if isinstance(e, StepEvent) for t in e.tokens]


def paced_channel(clock: FakeClock, gap: float = 0.1) -> Channel:
    """A channel that got three one-token steps `gap` apart (its step interval), all taken."""
    channel = Channel(1, clock=clock)
    for i in range(1, 4):
        channel.push(step(i))
        clock.now += gap
    channel.take()
    return channel


def test_a_steps_tokens_are_due_one_interval_share_apart() -> None:
    clock = FakeClock()
    channel = paced_channel(clock)
    arrived = clock.now
    channel.push(step(4, 5, 6, 7))
    assert smoothed_due(channel, arrived) == (1, pytest.approx(arrived + 0.025))
    assert token_ids(channel.take(1, split=True)) == [4]
    assert smoothed_due(channel, arrived + 0.01) == (0, pytest.approx(arrived + 0.025))
    assert smoothed_due(channel, arrived + 0.06) == (2, pytest.approx(arrived + 0.075))
    assert token_ids(channel.take(2, split=True)) == [5, 6]
    assert smoothed_due(channel, arrived + 0.08) == (1, None)
    assert token_ids(channel.take(1, split=True)) == [7]
    assert not channel.has_pending


def test_nothing_waits_past_the_next_step() -> None:
    clock = FakeClock()
    channel = paced_channel(clock)
    channel.push(step(4, 5, 6, 7))
    assert token_ids(channel.take(1, split=True)) == [4]
    clock.now += 0.03  # the next step came early: all of the last one is due at once
    channel.push(step(8, 9))
    due, held_until = smoothed_due(channel, clock.now)
    assert due == 3 + 1 and held_until is not None
    assert token_ids(channel.take(due, split=True)) == [5, 6, 7, 8]


def test_a_requests_end_and_an_unknown_pace_are_never_held() -> None:
    clock = FakeClock()
    channel = paced_channel(clock)
    channel.push(step(4, 5, 6, 7, final=True))
    assert smoothed_due(channel, clock.now) == (4, None), "the last token and final event"
    fresh = Channel(1, clock=clock)
    fresh.push(step(1, 2, 3))
    assert smoothed_due(fresh, clock.now) == (3, None), "no step interval yet"


def test_a_split_step_keeps_its_alternatives_and_its_end_on_the_last_part() -> None:
    tokens = [TokenInfo(id=i, text=str(i), logprob=None) for i in (1, 2, 3)]
    tops = [[TokenInfo(id=i + 10, text="x", logprob=None)] for i in (1, 2, 3)]
    done = Finished("123", 3, "length", None)
    head, rest = StepEvent(tokens, top_tokens=tops, finished=done).split(1)
    assert head.tokens == tokens[:1] and head.top_tokens == tops[:1] and head.finished is None
    assert rest.tokens == tokens[1:] and rest.top_tokens == tops[1:] and rest.finished == done
    with pytest.raises(ValueError, match="cannot split 3 tokens at 3"):
        StepEvent(tokens).split(3)


async def produce(channel: Channel, steps: Sequence[StepEvent], gap: float) -> None:
    for event in steps:
        channel.push(event)
        await asyncio.sleep(gap)


SPECULATING = [
    step(1),
    step(2),
    step(3),  # three one-token steps: the stream's pace
    step(4, 5, 6, 7),
    step(8, 9, 10, 11),
    step(12, 13, 14, 15),
    step(16, 17, 18, 19, final=True),
]
GAP = 0.2


async def written_at(pacing: StreamPacing) -> list[tuple[float, list[int]]]:
    """(seconds since the start, token ids) of each write of a speculating stream."""
    channel = Channel(1)
    producer = asyncio.ensure_future(produce(channel, SPECULATING, GAP))
    started = time.monotonic()
    writes = [
        (time.monotonic() - started, token_ids([e for _, e in write]))
        async for write in deliveries([channel], pacing)
    ]
    await producer
    return writes


async def test_smoothed_gaps_are_spread_and_bounded_and_the_tokens_the_same() -> None:
    writes = await written_at(SMOOTH)
    assert [i for _, ids in writes for i in ids] == list(range(1, 20))
    token_at = {i: at for at, ids in writes for i in ids}
    for first in (4, 8, 12):  # a smoothed step: four writes, a quarter interval apart
        gaps = [token_at[i + 1] - token_at[i] for i in range(first, first + 3)]
        assert all(GAP / 4 * 0.6 < g < GAP / 4 * 2.5 for g in gaps), gaps
        # Its last token goes out before the next step (bounded: no tail behind it).
        assert token_at[first + 3] < token_at[first + 4]
    # The final step is not smoothed: its tokens and its end go out at once.
    assert [ids for _, ids in writes][-1] == [16, 17, 18, 19]
    assert token_at[19] - token_at[15] < GAP * 1.5


async def test_unsmoothed_a_step_is_one_write() -> None:
    writes = await written_at(StreamPacing())
    assert [ids for _, ids in writes] == [
        [1],
        [2],
        [3],
        [4, 5, 6, 7],
        [8, 9, 10, 11],
        [12, 13, 14, 15],
        [16, 17, 18, 19],
    ]


def tgi_events(frames: list[bytes]) -> list[dict[str, object]]:
    text = b"".join(frames).decode()
    return [json.loads(line[5:]) for line in text.splitlines() if line.startswith("data:")]


async def tgi_stream(pacing: StreamPacing) -> list[dict[str, object]]:
    channel = Channel(1)
    producer = asyncio.ensure_future(produce(channel, SPECULATING, 0.02))
    params = GenerateParameters(details=True)
    frames = [f async for f in stream_frames(channel, params, "", pacing=pacing)]
    await producer
    return tgi_events(frames)


async def test_tgi_events_stay_one_per_token_and_the_text_identical() -> None:
    smoothed, plain = await tgi_stream(SMOOTH), await tgi_stream(StreamPacing())
    assert smoothed == plain
    assert [e["index"] for e in smoothed] == list(range(1, 20))
    assert smoothed[-1]["generated_text"] == "".join(f" t{i}" for i in range(1, 20))


async def test_a_client_that_leaves_while_tokens_are_held_frees_its_request() -> None:
    metrics = Metrics()
    channel = Channel(1)
    disconnected = guard_stream([channel], SMOOTH, metrics)
    frames = stream_frames(channel, GenerateParameters(), "", pacing=SMOOTH)
    for event in SPECULATING[:3]:
        channel.push(event)
        await anext(frames)
        await asyncio.sleep(0.3)  # a slow step interval: a step's tokens are held long
    channel.push(SPECULATING[3])
    assert len(tgi_events([await anext(frames)])) == 1, "the others of its step are held"
    reader = asyncio.ensure_future(anext(frames))
    await asyncio.sleep(0.01)
    assert not reader.done()
    disconnected()  # the response's disconnect watcher
    reader.cancel()  # ... and the server ending the response's body
    with pytest.raises(asyncio.CancelledError):
        await reader
    await frames.aclose()
    assert channel.cancelled
    assert f'reason="{CLIENT_DISCONNECTED}"}} 1.0' in metrics.render().decode()


async def test_an_overflow_while_tokens_are_held_ends_the_stream_at_once() -> None:
    metrics = Metrics()
    channel = Channel(1)
    pacing = StreamPacing(max_buffer=4, smooth=True)
    guard_stream([channel], pacing, metrics)
    async with aclosing(deliveries([channel], pacing)) as writes:
        for event in SPECULATING[:3]:
            channel.push(event)
            await anext(writes)
            await asyncio.sleep(0.3)
        channel.push(SPECULATING[3])
        assert token_ids([e for _, e in await anext(writes)]) == [4]
        channel.push(SPECULATING[4])  # 3 held + 4 new > 4: cancelled, the error is due
        started = time.monotonic()
        rest = [[e for _, e in w] async for w in writes]
    assert channel.cancelled and time.monotonic() - started < 0.1
    ((error,),) = rest
    assert isinstance(error, ErrorEvent) and error.error_type == STREAM_BUFFER_OVERFLOW


def test_the_flag_reaches_every_streams_pacing(tiny_model_dir: Path) -> None:
    from textgate import launcher

    args = launcher.parse_args(["--smooth-speculative-streams", "true"], env={})
    config = RouterConfig.from_json(json.dumps(launcher.router_config(tiny_model_dir, args)))
    assert StreamPacing.from_config(config).smooth
    default = launcher.parse_args([], env={"SMOOTH_SPECULATIVE_STREAMS": "0"})
    plain = RouterConfig.from_json(json.dumps(launcher.router_config(tiny_model_dir, default)))
    assert not StreamPacing.from_config(plain).smooth


class Chunks:
    """A FrameWriter keeping each chunk's text (an OpenAI chunk's `delta.content`)."""

    def __init__(self) -> None:
        self.texts: list[str] = []

    def opening(self) -> bytes:
        return b""

    def step(self, index: int, event: StepEvent) -> bytes:
        self.texts.append("".join(t.text for t in event.tokens))
        return b"x"

    def closing(self, failure: ErrorEvent | None, generated_tokens: int) -> bytes:
        return b""


async def chunk_texts(pacing: StreamPacing) -> list[str]:
    channel, chunks = Channel(1), Chunks()
    producer = asyncio.ensure_future(produce(channel, SPECULATING, 0.1))
    async for _ in event_stream([channel], chunks, pacing=pacing):
        pass
    await producer
    return chunks.texts


async def test_chunked_streams_carry_fewer_tokens_each_and_the_same_text() -> None:
    smoothed, plain = await chunk_texts(SMOOTH), await chunk_texts(StreamPacing())
    assert "".join(smoothed) == "".join(plain) == "".join(f" t{i}" for i in range(1, 20))
    assert plain[3:] == [" t4 t5 t6 t7", " t8 t9 t10 t11", " t12 t13 t14 t15", " t16 t17 t18 t19"]
    assert smoothed[3:6] == [" t4", " t5", " t6"] and smoothed[-1] == " t16 t17 t18 t19"


def test_steps_that_came_at_once_hold_nothing() -> None:
    clock = FakeClock()
    channel = Channel(1, clock=clock)
    channel.push(step(1))
    channel.push(step(2, 3))  # the same instant: a step interval of 0
    assert channel.step_interval == 0
    assert smoothed_due(channel, clock.now) == (3, None)
