"""Per-request deadlines in the paged engine over the fake paged shard: a request still
queued at its deadline fails with a `timeout` error and frees its slot, one that runs
ends with what it has (finish reason length); the others are untouched."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import AsyncIterator

import pytest

from textgate.router.engine.channel import Channel, ErrorEvent, Finished, StepEvent
from textgate.router.engine.paged_engine import TIMEOUT_MESSAGE, PagedEngine
from textgate.router.engine.request import SamplingParams, StoppingParams, ValidRequest
from textgate.router.engine.scheduler import Scheduler, SchedulerConfig
from textgate.router.shard_client import ShardedClient
from textgate.tests.router.fake_shard import FakeShard, fake_shards

STEP_DELAY_S = 0.02

# Each test checks when a timer fires: no full collection of the pytest process between.
pytestmark = pytest.mark.usefixtures("frozen_heap")


@pytest.fixture
async def shard_and_engine(uds_path: str) -> AsyncIterator[tuple[FakeShard, PagedEngine]]:
    async with fake_shards(uds_path) as shards:
        shards[0].step_delay_s = STEP_DELAY_S
        client = await ShardedClient.connect(uds_path, timeout_s=5)
        # Two running requests at most: the others queue behind them.
        config = SchedulerConfig(
            num_blocks=256, block_size=16, max_num_batched_tokens=64, max_num_seqs=2
        )
        paged = PagedEngine(client, Scheduler(config), 128)
        yield shards[0], paged
        await paged.close()
        await client.close()


def request(max_new_tokens: int, timeout_s: float | None = None) -> ValidRequest:
    return ValidRequest(
        inputs="",
        input_ids=tuple(range(3, 11)),
        sampling=SamplingParams(),
        stopping=StoppingParams(max_new_tokens=max_new_tokens, ignore_eos_token=True),
        timeout_s=timeout_s,
    )


async def ending(channel: Channel) -> tuple[StepEvent | ErrorEvent, float]:
    """The channel's last event, and when it came."""
    async for event in channel:
        if isinstance(event, ErrorEvent) or event.finished is not None:
            return event, time.monotonic()
    raise AssertionError("the channel ended without a final event")


async def test_queued_requests_past_their_deadline_fail_and_free_everything(
    shard_and_engine: tuple[FakeShard, PagedEngine],
) -> None:
    shard, paged = shard_and_engine
    # Issue 28's bound: 50 requests with a 1 s deadline behind a long queue all end with
    # the timeout error within 1.2 s. Each step takes STEP_DELAY_S, so the two long ones
    # hold both seats for ~2 s.
    deadline_s = 1.0
    long_ones = paged.submit([request(100), request(100)])
    await asyncio.sleep(0.05)
    patient = paged.submit([request(2)])  # no deadline: it waits its turn and finishes
    submitted = time.monotonic()
    hurried = paged.submit([request(2, timeout_s=deadline_s) for _ in range(50)])
    endings = await asyncio.gather(*(ending(c) for c in hurried))
    for event, at in endings:
        assert event == ErrorEvent(TIMEOUT_MESSAGE, "timeout")
        assert deadline_s <= at - submitted <= 1.2
    # Their slots and queue entries are gone at once; the shards never saw them.
    assert paged.num_active == 3
    assert paged.scheduler.num_waiting == 1
    paged.scheduler.check_invariants()
    assert len(shard.received_requests()) == 2
    for channel in [*long_ones, *patient]:
        event, _ = await ending(channel)
        assert isinstance(event, StepEvent) and event.finished is not None
        assert event.finished.finish_reason == "length"
    assert [c.num_generated for c in [*long_ones, *patient]] == [100, 100, 2]
    while paged.scheduler.has_unfinished_requests():
        await asyncio.sleep(0.01)
    assert paged.scheduler.allocator.num_used_blocks == 0
    assert paged.num_active == 0


async def test_a_running_request_past_its_deadline_ends_with_what_it_has(
    shard_and_engine: tuple[FakeShard, PagedEngine],
) -> None:
    shard, paged = shard_and_engine
    deadline_s = 0.2
    submitted = time.monotonic()
    hurried, calm = paged.submit([request(200, timeout_s=deadline_s), request(30)])
    event, at = await ending(hurried)
    assert isinstance(event, StepEvent) and isinstance(event.finished, Finished)
    assert event.finished.finish_reason == "length"
    assert event.tokens, "the last event carries the last token"
    assert 0 < event.finished.generated_tokens == hurried.num_generated < 200
    assert deadline_s <= at - submitted < deadline_s + 0.3
    assert not paged.scheduler.has_request(0)
    calm_event, _ = await ending(calm)
    assert isinstance(calm_event, StepEvent) and calm.num_generated == 30
    while paged.scheduler.has_unfinished_requests():
        await asyncio.sleep(0.01)
    assert paged.scheduler.allocator.num_used_blocks == 0
    # Dropped by the shards too (the calm one finished there on its own).
    assert shard.held_request_ids() == set()


async def test_a_slow_step_in_flight_does_not_make_queued_timeouts_late(
    shard_and_engine: tuple[FakeShard, PagedEngine],
) -> None:
    shard, paged = shard_and_engine
    # Steps of 1.5 s (a long prompt's chunk on a CPU): the queued requests' 0.3 s deadline
    # passes during the first one and they fail then, not when it ends.
    shard.step_delay_s = 1.5
    long_ones = paged.submit([request(2), request(2)])
    await asyncio.sleep(0.05)  # the first slow step is in flight
    submitted = time.monotonic()
    hurried = paged.submit([request(2, timeout_s=0.3) for _ in range(10)])
    endings = await asyncio.gather(*(ending(c) for c in hurried))
    for event, at in endings:
        assert event == ErrorEvent(TIMEOUT_MESSAGE, "timeout")
        assert 0.3 <= at - submitted < 0.6
    assert paged.scheduler.num_waiting == 0
    for channel in long_ones:
        event, _ = await ending(channel)
        assert isinstance(event, StepEvent) and event.finished is not None
    while paged.scheduler.has_unfinished_requests():
        await asyncio.sleep(0.01)
    paged.scheduler.check_invariants()
    assert paged.scheduler.allocator.num_used_blocks == 0
    assert len(shard.received_requests()) == 2


async def test_a_deadline_counts_from_the_requests_arrival_not_its_admission(
    shard_and_engine: tuple[FakeShard, PagedEngine],
) -> None:
    _, paged = shard_and_engine
    # 0.4 s went to its template and tokenizer before the engine saw it: of its 0.5 s
    # deadline, 0.1 s is left when it queues behind the two long ones.
    long_ones = paged.submit([request(100), request(100)])
    await asyncio.sleep(0.05)
    submitted = time.monotonic()
    late = dataclasses.replace(request(2, timeout_s=0.5), received_at=submitted - 0.4)
    (hurried,) = paged.submit([late])
    event, at = await ending(hurried)
    assert event == ErrorEvent(TIMEOUT_MESSAGE, "timeout")
    assert 0.1 <= at - submitted < 0.3
    # One past its deadline on arrival fails at once.
    (gone,) = paged.submit([dataclasses.replace(late, received_at=time.monotonic() - 1)])
    assert (await ending(gone))[0] == ErrorEvent(TIMEOUT_MESSAGE, "timeout")
    for channel in long_ones:
        channel.cancel()
    while paged.scheduler.has_unfinished_requests():
        await asyncio.sleep(0.01)
    assert paged.scheduler.allocator.num_used_blocks == 0
