"""A request's channel: pushes never wait, takes hand over what arrived, the bound cancels."""

from __future__ import annotations

import asyncio

import pytest

from textgate.router.engine.channel import (
    STREAM_BUFFER_OVERFLOW,
    Channel,
    ErrorEvent,
    Finished,
    StepEvent,
    TokenInfo,
)


def step(*ids: int, final: bool = False) -> StepEvent:
    done = Finished("", len(ids), "length", None) if final else None
    return StepEvent([TokenInfo(id=i, text=f" t{i}", logprob=-1.0) for i in ids], finished=done)


def ids(events: list[StepEvent | ErrorEvent]) -> list[int]:
    return [t.id for e in events if isinstance(e, StepEvent) for t in e.tokens]


def test_take_hands_over_everything_that_arrived_in_order() -> None:
    channel = Channel(1)
    for i in range(5):
        channel.push(step(i))
    assert channel.num_pending_tokens == 5 and not channel.final_pending
    assert ids(channel.take()) == [0, 1, 2, 3, 4]
    assert channel.num_pending_tokens == 0 and not channel.has_pending
    assert channel.take() == []


def test_take_with_a_token_cap_takes_whole_events_and_at_least_one() -> None:
    channel = Channel(1)
    channel.push(step(1, 2, 3))
    channel.push(step(4))
    channel.push(step(5, final=True))
    assert ids(channel.take(max_tokens=2)) == [1, 2, 3], "one event even when it is larger"
    assert ids(channel.take(max_tokens=2)) == [4, 5]
    assert channel.closed and not channel.has_pending


async def test_iteration_ends_with_the_final_event() -> None:
    channel = Channel(1)

    async def produce() -> None:
        for i in range(3):
            await asyncio.sleep(0)
            channel.push(step(i, final=i == 2))
        channel.push(step(9))  # after the end: ignored

    producer = asyncio.ensure_future(produce())
    events = [e async for e in channel]
    await producer
    assert ids(events) == [0, 1, 2]


def test_past_the_bound_unread_tokens_are_dropped_and_the_request_cancelled() -> None:
    channel = Channel(1)
    woken = []
    channel.on_cancel(lambda: woken.append(True))
    channel.bound(4)
    for i in range(4):
        channel.push(step(i))
    assert not channel.cancelled, "at the bound is still fine"
    channel.push(step(4))
    assert channel.cancelled and channel.closed and woken == [True]
    (error,) = channel.take()
    assert isinstance(error, ErrorEvent) and error.error_type == STREAM_BUFFER_OVERFLOW
    assert "4 tokens" in error.message
    channel.push(step(5, final=True))
    assert not channel.has_pending, "nothing after the error"


def test_taking_keeps_a_stream_under_its_bound() -> None:
    channel = Channel(1)
    channel.bound(2)
    for i in range(10):
        channel.push(step(i))
        assert ids(channel.take()) == [i]
    assert not channel.cancelled


def test_the_final_event_is_accepted_past_the_bound() -> None:
    channel = Channel(1)
    channel.bound(1)
    channel.push(step(1))
    channel.push(step(2, final=True))
    assert not channel.cancelled
    assert ids(channel.take()) == [1, 2]


def test_a_bound_below_one_is_an_error() -> None:
    with pytest.raises(ValueError, match="at least 1"):
        Channel(1).bound(0)


def test_cancel_says_whether_it_cancelled_anything() -> None:
    channel = Channel(1)
    assert channel.cancel() is True
    assert channel.cancel() is False
    finished = Channel(1)
    finished.push(step(1, final=True))
    assert finished.cancel() is False and not finished.cancelled


def test_joined_steps_keep_tokens_alternatives_and_the_last_end() -> None:
    first = StepEvent([TokenInfo(1, "a", -1.0)], top_tokens=[[TokenInfo(2, "b", -2.0)]])
    last = StepEvent(
        [TokenInfo(3, "c", -1.0)],
        top_tokens=[[TokenInfo(4, "d", -2.0)]],
        finished=Finished("ac", 2, "eos_token", 7),
    )
    joined = StepEvent.joined([first, last])
    assert [t.id for t in joined.tokens] == [1, 3]
    assert [[t.id for t in top] for top in joined.top_tokens] == [[2], [4]]
    assert joined.finished == last.finished
    assert StepEvent.joined([first]) is first
