"""The engines' shared parts without shards: admission, wake-ups, recovery after a bug, close."""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import AsyncIterator

import pytest

from textgate.router.engine.admission import Admitted, Entry, OverloadedError
from textgate.router.engine.channel import (
    Channel,
    ErrorEvent,
    Finished,
    StepEvent,
    TokenInfo,
)
from textgate.router.engine.request import SamplingParams, StoppingParams, ValidRequest
from textgate.router.engine.step_task import SHUTDOWN_MESSAGE, StepTask
from textgate.tests.router.engine.channel_helpers import events_of, eventually


def request(prompt: tuple[int, ...] = (5,)) -> ValidRequest:
    return ValidRequest(
        inputs=" ".join(f"w{i}" for i in prompt),
        input_ids=prompt,
        sampling=SamplingParams(),
        stopping=StoppingParams(max_new_tokens=1),
    )


class OneAtATime:
    """An engine of the parts the real ones are made of (an Admitted table, a StepTask):
    it finishes the oldest waiting request per step, once `open` is set; raises on demand."""

    def __init__(self, max_concurrent_requests: int) -> None:
        self.admitted = Admitted(max_concurrent_requests)
        self.task = StepTask("test-loop", self.step, lambda: bool(self.waiting), self.recover)
        self.waiting: deque[Entry] = deque()
        self.open = asyncio.Event()
        self.raise_next = False
        self.recovered: list[str] = []

    @property
    def num_active(self) -> int:
        return len(self.admitted)

    def submit(self, requests: list[ValidRequest]) -> list[Channel]:
        entries = self.admitted.admit(requests, on_cancel=self.task.wake)
        for entry in entries:
            if not entry.request.input_ids:
                self.admitted.fail([entry], "empty prompt", "validation")
            else:
                self.waiting.append(entry)
        self.task.wake()
        return [entry.channel for entry in entries]

    async def close(self) -> None:
        self.admitted.closed = True
        await self.task.close()
        self.waiting.clear()
        self.admitted.fail(self.admitted, SHUTDOWN_MESSAGE)

    async def step(self) -> None:
        await self.open.wait()
        for entry in [e for e in self.waiting if e.channel.cancelled]:
            self.waiting.remove(entry)
            self.admitted.release(entry)
        if self.raise_next:
            self.raise_next = False
            raise RuntimeError("boom")
        if self.waiting:
            entry = self.waiting.popleft()
            finished = Finished("x", 1, "length", None)
            entry.channel.push(StepEvent([TokenInfo(7, "x", -0.1)], finished=finished))
            self.admitted.release(entry)

    async def recover(self, exc: Exception) -> None:
        self.recovered.append(str(exc))
        self.waiting.clear()
        self.admitted.fail(self.admitted, f"failed: {exc}")


@pytest.fixture
async def loop() -> AsyncIterator[OneAtATime]:
    loop = OneAtATime(max_concurrent_requests=3)
    yield loop
    await loop.close()


async def test_admitted_requests_run_and_stop_counting(loop: OneAtATime) -> None:
    channels = loop.submit([request(), request()])
    assert loop.num_active == 2
    loop.open.set()
    for channel in channels:
        events = await events_of(channel)
        assert isinstance(events[-1], StepEvent) and events[-1].finished is not None
    assert loop.num_active == 0


async def test_admission_is_all_or_none(loop: OneAtATime) -> None:
    loop.submit([request(), request()])
    with pytest.raises(OverloadedError, match="Model is overloaded"):
        loop.submit([request(), request()])
    assert loop.num_active == 2
    loop.submit([request()])
    assert loop.num_active == 3


async def test_an_entry_failed_at_enqueue_gets_its_error_and_frees_its_slot(
    loop: OneAtATime,
) -> None:
    (channel,) = loop.submit([request(prompt=())])
    assert await events_of(channel) == [ErrorEvent("empty prompt", "validation")]
    assert loop.num_active == 0


async def test_a_cancellation_wakes_the_loop_and_frees_the_slot(loop: OneAtATime) -> None:
    (channel,) = loop.submit([request()])
    channel.cancel()
    loop.open.set()
    await eventually(lambda: loop.num_active == 0)


async def test_a_step_that_raises_is_recovered_and_the_loop_goes_on(loop: OneAtATime) -> None:
    loop.raise_next = True
    (failed,) = loop.submit([request()])
    loop.open.set()
    assert await events_of(failed) == [ErrorEvent("failed: boom")]
    assert loop.recovered == ["boom"]
    (ok,) = loop.submit([request()])
    events = await events_of(ok)
    assert isinstance(events[-1], StepEvent) and events[-1].finished is not None


async def test_close_fails_what_is_left_and_refuses_new_requests() -> None:
    loop = OneAtATime(max_concurrent_requests=3)
    channels = loop.submit([request(), request()])
    await asyncio.sleep(0)
    await loop.close()
    for channel in channels:
        assert await events_of(channel) == [ErrorEvent(SHUTDOWN_MESSAGE)]
    assert loop.num_active == 0
    with pytest.raises(OverloadedError):
        loop.submit([request()])
