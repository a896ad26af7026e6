"""The batcher against a fake shard over real gRPC: joining, leaving, cancelling, failing."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from textgate.router.engine.admission import OverloadedError
from textgate.router.engine.channel import ErrorEvent, Event, StepEvent
from textgate.router.engine.padded_engine import PaddedEngine
from textgate.router.engine.padded_queue import BatchLimits
from textgate.router.engine.request import SamplingParams, StoppingParams, ValidRequest
from textgate.router.shard_client import ShardedClient
from textgate.tests.router.engine.channel_helpers import events_of, eventually
from textgate.tests.router.fake_shard import FakeShard

LIMITS = BatchLimits(
    max_batch_prefill_tokens=256,
    max_batch_total_tokens=4096,
    waiting_served_ratio=0.0,
    max_waiting_tokens=20,
)


def request(max_new_tokens: int, prompt: tuple[int, ...] = (5,)) -> ValidRequest:
    return ValidRequest(
        inputs=" ".join(f"w{i}" for i in prompt),
        input_ids=prompt,
        sampling=SamplingParams(),
        stopping=StoppingParams(max_new_tokens=max_new_tokens),
    )


def token_ids(events: list[Event]) -> list[int]:
    return [t.id for e in events if isinstance(e, StepEvent) for t in e.tokens]


@pytest.fixture
async def batcher(sharded: ShardedClient) -> AsyncIterator[PaddedEngine]:
    batcher = PaddedEngine(sharded, LIMITS, max_concurrent_requests=8)
    yield batcher
    await batcher.close()


async def test_one_request_runs_to_its_length(batcher: PaddedEngine, fake: FakeShard) -> None:
    (channel,) = batcher.submit([request(3, prompt=(7, 8))])
    events = await events_of(channel)
    assert token_ids(events) == [9, 10, 11]
    final = events[-1]
    assert isinstance(final, StepEvent) and final.finished is not None
    assert final.finished.text == " t9 t10 t11"
    assert final.finished.finish_reason == "length"
    assert len(fake.calls_to("Prefill")) == 1
    assert len(fake.calls_to("Decode")) == 2
    assert batcher.num_active == 0


async def test_a_request_arriving_mid_generation_joins_the_running_batch(
    batcher: PaddedEngine, fake: FakeShard
) -> None:
    fake.step_delay_s = 0.01
    (first,) = batcher.submit([request(12)])
    await asyncio.sleep(0.05)
    (second,) = batcher.submit([request(3, prompt=(100,))])
    first_events, second_events = await asyncio.gather(events_of(first), events_of(second))
    assert token_ids(first_events) == list(range(6, 18))
    assert token_ids(second_events) == [101, 102, 103]
    assert len(fake.calls_to("Prefill")) == 2
    merged = [d for d in fake.calls_to("Decode") if len(d.batches) == 2]
    assert merged, "the new batch was decoded together with the running one"
    assert merged[0].batches[0].id != merged[0].batches[1].id


async def test_finished_requests_leave_and_the_others_continue(
    batcher: PaddedEngine, fake: FakeShard
) -> None:
    channels = batcher.submit([request(n) for n in (1, 2, 5)])
    results = await asyncio.gather(*(events_of(c) for c in channels))
    assert [len(token_ids(r)) for r in results] == [1, 2, 5]
    sizes = [len(d.batches[0].request_ids) for d in fake.calls_to("Decode")]
    assert sizes == [2, 1, 1, 1]
    assert not fake.calls_to("FilterBatch"), "shards drop finished requests themselves"


async def test_a_cancelled_request_is_filtered_out_within_one_step(
    batcher: PaddedEngine, fake: FakeShard
) -> None:
    fake.step_delay_s = 0.01
    keep, leave = batcher.submit([request(30), request(30)])
    await anext(aiter(leave))
    leave.cancel()
    events = await events_of(keep)
    assert len(token_ids(events)) == 30
    assert [r.id for r in fake.calls_to("Prefill")[0].batch.requests] == [0, 1]
    (filtered,) = fake.calls_to("FilterBatch")
    assert list(filtered.request_ids) == [0]
    after = [
        r
        for name, r in fake.calls[fake.calls.index(("FilterBatch", filtered)) :]
        if name == "Decode"
    ]
    assert after and all(list(d.batches[0].request_ids) == [0] for d in after)
    assert batcher.num_active == 0


async def test_cancelling_every_request_clears_the_batch(
    batcher: PaddedEngine, fake: FakeShard
) -> None:
    fake.step_delay_s = 0.01
    (channel,) = batcher.submit([request(50)])
    await anext(aiter(channel))
    channel.cancel()
    await eventually(lambda: fake.calls_to("ClearCache"))
    assert [c.id for c in fake.calls_to("ClearCache")] == [0]
    assert not fake.cache
    assert batcher.num_active == 0


async def test_a_request_cancelled_while_waiting_never_reaches_the_shards(
    batcher: PaddedEngine, fake: FakeShard
) -> None:
    fake.step_delay_s = 0.05
    (running,) = batcher.submit([request(5)])
    await asyncio.sleep(0.01)
    (waiting,) = batcher.submit([request(5, prompt=(200,))])
    waiting.cancel()
    await events_of(running)
    prompts = [r.input_ids[0] for p in fake.calls_to("Prefill") for r in p.batch.requests]
    assert prompts == [5]
    assert batcher.num_active == 0


async def test_a_prefill_error_fails_the_new_requests_only(
    batcher: PaddedEngine, fake: FakeShard
) -> None:
    fake.step_delay_s = 0.01
    (running,) = batcher.submit([request(10)])
    await anext(aiter(running))
    fake.fail["Prefill"] = 1
    (failing,) = batcher.submit([request(10)])
    failed_events = await events_of(failing)
    assert failed_events == [
        ErrorEvent("Request failed during generation: Server error: fake Prefill failure")
    ]
    assert len(token_ids(await events_of(running))) == 9
    await eventually(lambda: fake.calls_to("ClearCache"))
    assert [c.id for c in fake.calls_to("ClearCache")] == [1]


async def test_a_decode_error_fails_every_running_request_and_clears_the_cache(
    batcher: PaddedEngine, fake: FakeShard
) -> None:
    channels = batcher.submit([request(10), request(10)])
    fake.fail["Decode"] = 1
    for channel in channels:
        events = await events_of(channel)
        assert isinstance(events[-1], ErrorEvent)
        assert events[-1].error_type == "generation"
        assert "fake Decode failure" in events[-1].message
    await eventually(lambda: fake.calls_to("ClearCache"))
    clear = fake.calls_to("ClearCache")[-1]
    assert not clear.HasField("id")
    assert batcher.num_active == 0
    (after,) = batcher.submit([request(2)])
    assert len(token_ids(await events_of(after))) == 2


async def test_admission_beyond_max_concurrent_requests_is_refused(
    sharded: ShardedClient, fake: FakeShard
) -> None:
    batcher = PaddedEngine(sharded, LIMITS, max_concurrent_requests=2)
    try:
        first = batcher.submit([request(2), request(2)])
        with pytest.raises(OverloadedError, match="Model is overloaded"):
            batcher.submit([request(2)])
        for channel in first:
            await events_of(channel)
        (again,) = batcher.submit([request(2)])
        await events_of(again)
    finally:
        await batcher.close()


async def test_best_of_candidates_are_admitted_together_or_not_at_all(
    sharded: ShardedClient, fake: FakeShard
) -> None:
    batcher = PaddedEngine(sharded, LIMITS, max_concurrent_requests=2)
    try:
        with pytest.raises(OverloadedError):
            batcher.submit([request(2)] * 3)
        assert batcher.num_active == 0
    finally:
        await batcher.close()


async def test_close_answers_every_waiting_request(batcher: PaddedEngine, fake: FakeShard) -> None:
    fake.step_delay_s = 0.05
    channels = batcher.submit([request(100), request(100)])
    await asyncio.sleep(0.01)
    await batcher.close()
    for channel in channels:
        events = await events_of(channel)
        assert isinstance(events[-1], ErrorEvent)
    with pytest.raises(OverloadedError):
        batcher.submit([request(1)])
