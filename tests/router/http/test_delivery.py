"""Writes of a stream: first token at once, a slow reader's backlog in one write, pacing."""

from __future__ import annotations

import asyncio
import time

from textgate.router.engine.channel import (
    STREAM_BUFFER_OVERFLOW,
    Channel,
    ErrorEvent,
    Event,
    Finished,
    StepEvent,
    TokenInfo,
)
from textgate.router.http.delivery import (
    CLIENT_DISCONNECTED,
    StreamPacing,
    deliveries,
    guard_stream,
)
from textgate.router.metrics import Metrics


def step(i: int, final: bool = False) -> StepEvent:
    done = Finished("", i, "length", None) if final else None
    return StepEvent([TokenInfo(id=i, text=f" t{i}", logprob=-1.0)], finished=done)


def token_ids(write: list[tuple[int, Event]]) -> list[int]:
    return [t.id for _, e in write if isinstance(e, StepEvent) for t in e.tokens]


async def test_a_slow_reader_gets_everything_that_waited_in_one_write() -> None:
    channel = Channel(1)
    writes = deliveries([channel], StreamPacing())
    channel.push(step(1))
    assert token_ids(await anext(writes)) == [1], "the first token at once"
    for i in range(2, 6):  # produced while the first write was being sent
        channel.push(step(i))
    assert token_ids(await anext(writes)) == [2, 3, 4, 5]
    channel.push(step(6, final=True))
    assert token_ids(await anext(writes)) == [6]
    assert [w async for w in writes] == [], "the stream ends after the final event"


async def test_an_interval_sends_that_many_tokens_per_write_and_the_rest_at_the_end() -> None:
    channel = Channel(1)

    async def produce() -> None:
        for i in range(1, 9):
            channel.push(step(i, final=i == 8))
            await asyncio.sleep(0.001)

    producer = asyncio.ensure_future(produce())
    writes = [token_ids(w) async for w in deliveries([channel], StreamPacing(interval=3))]
    await producer
    assert writes == [[1], [2, 3, 4], [5, 6, 7], [8]]


async def test_a_rate_never_sends_faster_and_loses_nothing() -> None:
    channel = Channel(1)
    for i in range(1, 11):
        channel.push(step(i, final=i == 10))
    started = time.monotonic()
    sent_at: list[tuple[float, list[int]]] = []
    async for write in deliveries([channel], StreamPacing(max_rate=200.0)):
        sent_at.append((time.monotonic() - started, token_ids(write)))
    assert [i for _, ids in sent_at for i in ids] == list(range(1, 11))
    assert sent_at[0][1] == [1], "the first token is not held back"
    # Nine tokens after the first at 200/s: at least 45 ms (scheduling only adds to it).
    assert sent_at[-1][0] >= 9 / 200 - 0.002
    assert all(len(ids) == 1 for _, ids in sent_at), "a one-token bucket: one token per write"


async def test_past_the_buffer_the_request_is_cancelled_and_counted_at_once() -> None:
    metrics = Metrics()
    channel = Channel(1)
    pacing = StreamPacing(max_buffer=3)
    guard_stream([channel], pacing, metrics)
    writes = deliveries([channel], pacing)
    channel.push(step(1))
    await anext(writes)
    for i in range(2, 6):  # the client reads nothing meanwhile
        channel.push(step(i))
    assert channel.cancelled
    overflow = f'textgate_request_cancelled{{reason="{STREAM_BUFFER_OVERFLOW}"}} 1.0'
    assert overflow in metrics.render().decode(), "counted before the reader looks"
    ((_, event),) = await anext(writes)
    assert isinstance(event, ErrorEvent) and event.error_type == STREAM_BUFFER_OVERFLOW
    assert [w async for w in writes] == []


async def test_several_channels_keep_each_ones_order_until_all_ended() -> None:
    first, second = Channel(1), Channel(1)
    writes = deliveries([first, second], StreamPacing())
    first.push(step(1))
    second.push(step(10))
    first.push(step(2, final=True))
    write = await anext(writes)
    assert [(i, token_ids([(i, e)])) for i, e in write] == [(0, [1]), (0, [2]), (1, [10])]
    second.push(ErrorEvent("boom"))
    assert [i for i, _ in await anext(writes)] == [1]
    assert [w async for w in writes] == []


def test_a_disconnect_counts_a_cancellation_only_when_something_was_running() -> None:
    metrics = Metrics()
    running, finished = Channel(1), Channel(1)
    finished.push(step(1, final=True))
    disconnected = guard_stream([running, finished], StreamPacing(), metrics)
    disconnected()
    disconnected()  # a second notice changes nothing
    guard_stream([finished], StreamPacing(), metrics)()
    assert running.cancelled and not finished.cancelled
    text = metrics.render().decode()
    assert f'textgate_request_cancelled{{reason="{CLIENT_DISCONNECTED}"}} 1.0' in text
