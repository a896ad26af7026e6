"""Shard faults: a request the model chokes on fails its step cleanly (424, or an error
event) and the next request is served; a shard that hangs in any call (a step, the
empty step that drops finished requests, a ClearCache) is detected by
--shard-step-timeout and reported, not waited on forever. (A shard killed mid-stream is
tested end to end in tests/e2e.)"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import httpx
import pytest

from textgate.router.engine.channel import Channel, ErrorEvent, Event, StepEvent
from textgate.router.engine.factory import Engine
from textgate.router.engine.paged_engine import PagedEngine
from textgate.router.engine.request import SamplingParams, StoppingParams, ValidRequest
from textgate.router.engine.scheduler import Scheduler, SchedulerConfig
from textgate.router.shard_client import ShardedClient
from textgate.tests.router.fake_shard import FakeShard, fake_shards
from textgate.tests.router.reliability.conftest import ThreadedRouter

POISON = "w9 w9 w9"
STEP_TIMEOUT_S = 0.5


async def stream_events(client: httpx.AsyncClient, body: dict[str, Any]) -> list[dict[str, Any]]:
    async with client.stream("POST", "/generate_stream", json=body) as response:
        assert response.status_code == 200
        return [
            json.loads(line[5:])
            async for line in response.aiter_lines()
            if line.startswith("data:")
        ]


RECOVERY_TIMEOUT_S = 30.0
"""The step deadline while a test checks that the next request is served: a loaded CI
machine can stall the router's loop past STEP_TIMEOUT_S (a full GC pass late in a long
run), and that check is about being served again, not about speed."""


async def assert_served_and_idle(client: httpx.AsyncClient, router: ThreadedRouter) -> None:
    """The next request is served in full and leaves nothing behind; the step deadline is
    widened to RECOVERY_TIMEOUT_S for it, then put back."""
    calls = router.engine.shard_calls
    deadline = calls.timeout_s
    router.call_soon(lambda: setattr(calls, "timeout_s", RECOVERY_TIMEOUT_S))
    try:
        after = await client.post(
            "/generate", json={"inputs": "w5", "parameters": {"max_new_tokens": 3}}
        )
    finally:
        router.call_soon(lambda: setattr(calls, "timeout_s", deadline))
    assert after.status_code == 200, after.text
    assert after.json()["generated_text"] == " t6 t7 t8"
    assert router.engine.num_active == 0


async def test_a_request_the_shard_fails_on_fails_its_step_only(
    serve_in_thread: Callable[..., Any],
) -> None:
    with serve_in_thread(step_delay_s=0.01) as router:
        router.call_soon(lambda: setattr(router.shard, "fail_on_inputs", POISON))
        async with httpx.AsyncClient(base_url=router.url, timeout=10) as client:
            # Alone: 424 with TGI's body, again and again (nothing sticks).
            for _ in range(3):
                response = await client.post("/generate", json={"inputs": POISON})
                assert response.status_code == 424, response.text
                assert response.json()["error_type"] == "generation"
                assert "fake failure on 'w9 w9 w9'" in response.json()["error"]
                await assert_served_and_idle(client, router)
            # Beside a running stream: the step they share fails; both end with an error,
            # the stream with an error event as its final one.
            body = {"inputs": "w5", "parameters": {"max_new_tokens": 60}}
            stream = asyncio.create_task(stream_events(client, body))
            await asyncio.sleep(0.1)
            poisoned = await client.post("/generate", json={"inputs": POISON})
            events = await stream
            assert poisoned.status_code == 424
            assert events[-1]["error_type"] == "generation", events[-1]
            assert all("token" in event for event in events[:-1])
            await assert_served_and_idle(client, router)


async def test_a_hung_shard_is_reported_within_the_step_timeout(
    serve_in_thread: Callable[..., Any],
) -> None:
    with serve_in_thread(shard_step_timeout=STEP_TIMEOUT_S) as router:
        async with httpx.AsyncClient(base_url=router.url, timeout=10) as client:
            router.call_soon(lambda: router.shard.hang.update(Step=1))
            started = time.monotonic()
            response = await client.post("/generate", json={"inputs": "w5"})
            waited = time.monotonic() - started
            assert response.status_code == 424, response.text
            assert response.json() == {
                "error": "Request failed during generation: the shards did not answer a "
                "prefill step within 0.5 s (--shard-step-timeout)",
                "error_type": "generation",
            }
            print(f"hung shard reported after {waited:.3f} s")
            assert STEP_TIMEOUT_S <= waited < STEP_TIMEOUT_S + 2, waited
            await assert_served_and_idle(client, router)
            # Mid-stream: the stream ends with the error event, not silence.
            body = {"inputs": "w5", "parameters": {"max_new_tokens": 20}}
            router.call_soon(lambda: router.shard.hang.update(Step=0))

            async def hang_soon() -> None:
                await asyncio.sleep(0.05)
                router.call_soon(lambda: router.shard.hang.update(Step=1))

            router.call_soon(lambda: setattr(router.shard, "step_delay_s", 0.01))
            hang = asyncio.create_task(hang_soon())
            events = await stream_events(client, body)
            await hang
            assert events[-1]["error_type"] == "generation", events[-1]
            assert "step within 0.5 s" in events[-1]["error"]
            await assert_served_and_idle(client, router)


# ---- a hang in any shard call, not only a step: the engine loops directly ----

CALL_TIMEOUT_S = 0.3
PATIENCE_S = 10.0
"""Without the deadline these tests would wait forever; they fail after this instead."""


def valid_request(max_new_tokens: int) -> ValidRequest:
    return ValidRequest(
        inputs="w5",
        input_ids=(5,),
        sampling=SamplingParams(),
        stopping=StoppingParams(max_new_tokens=max_new_tokens),
    )


async def events_of(channel: Channel) -> list[Event]:
    return [event async for event in channel]


async def assert_engine_serves(engine: Engine) -> None:
    (channel,) = engine.submit([valid_request(3)])
    events = await events_of(channel)
    assert all(isinstance(e, StepEvent) for e in events), events
    assert sum(len(e.tokens) for e in events if isinstance(e, StepEvent)) == 3
    assert engine.num_active == 0


@pytest.fixture
async def paged(uds_path: str) -> AsyncIterator[tuple[FakeShard, PagedEngine]]:
    async with fake_shards(uds_path) as (shard, *_):
        shards = await ShardedClient.connect(uds_path, timeout_s=5)
        config = SchedulerConfig(
            num_blocks=64,
            block_size=shard.block_size,
            max_num_batched_tokens=64,
            max_num_seqs=8,
            num_reserved_tokens=0,
        )
        engine = PagedEngine(shards, Scheduler(config), max_concurrent_requests=8)
        engine.shard_calls.timeout_s = CALL_TIMEOUT_S
        yield shard, engine
        await engine.close()
        await shards.close()


async def test_a_shard_hung_while_dropping_finished_requests_is_reported(
    paged: tuple[FakeShard, PagedEngine], caplog: pytest.LogCaptureFixture
) -> None:
    shard, engine = paged
    shard.step_delay_s = 0.05
    (channel,) = engine.submit([valid_request(40)])
    await anext(aiter(channel))
    # Wait until the next step is inside the shard, then leave: the step after it has
    # nothing to compute and only tells the shards to drop the request; that call hangs.
    steps = len(shard.calls_to("Step"))
    while len(shard.calls_to("Step")) == steps:
        await asyncio.sleep(0.001)
    channel.cancel()
    shard.hang["Step"] = 1
    with caplog.at_level(logging.ERROR, logger="textgate.router"):
        started = time.monotonic()
        while len(shard.calls_to("Step")) < steps + 2:  # the dropping step is in the shard
            await asyncio.sleep(0.001)
        await asyncio.wait_for(assert_engine_serves(engine), PATIENCE_S)
        waited = time.monotonic() - started
    hung = shard.calls_to("Step")[steps + 1]
    assert not hung.plan.scheduled and set(hung.plan.finished_ids) == {0}, hung
    assert (
        "dropping finished requests from the shards failed: the shards did not answer a Step "
        f"within {CALL_TIMEOUT_S:g} s (--shard-step-timeout)"
    ) in caplog.text
    print(f"a hung flush step was given up after {waited:.3f} s, then the next request served")
    assert CALL_TIMEOUT_S <= waited < CALL_TIMEOUT_S + 2


async def test_a_shard_hung_in_clear_cache_after_a_failed_step_is_reported(
    paged: tuple[FakeShard, PagedEngine], caplog: pytest.LogCaptureFixture
) -> None:
    shard, engine = paged
    shard.fail["Step"] = 1
    shard.hang["ClearCache"] = 1
    (channel,) = engine.submit([valid_request(10)])
    with caplog.at_level(logging.ERROR, logger="textgate.router"):
        events = await asyncio.wait_for(events_of(channel), PATIENCE_S)
        assert isinstance(events[-1], ErrorEvent) and "fake Step failure" in events[-1].message
        await asyncio.wait_for(assert_engine_serves(engine), PATIENCE_S)
    assert shard.calls_to("ClearCache"), "the hang was not in ClearCache"
    assert f"the shards did not answer a ClearCache within {CALL_TIMEOUT_S:g} s" in caplog.text
