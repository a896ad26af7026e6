"""The paged engine's batch gauges over the fake paged shard: true while running, and back at
their idle values once the engine is idle, a mass cancellation included."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
from prometheus_client.parser import text_string_to_metric_families

from textgate.router.engine.channel import Channel
from textgate.router.engine.paged_engine import PagedEngine
from textgate.router.engine.request import SamplingParams, StoppingParams, ValidRequest
from textgate.router.engine.scheduler import Scheduler, SchedulerConfig
from textgate.router.metrics import Metrics
from textgate.router.shard_client import ShardedClient
from textgate.tests.router.fake_shard import fake_shards

NUM_BLOCKS = 512
STEP_TOKENS = 128


@pytest.fixture
async def engine(uds_path: str) -> AsyncIterator[tuple[PagedEngine, Metrics]]:
    async with fake_shards(uds_path) as shards:
        shards[0].step_delay_s = 0.002
        client = await ShardedClient.connect(uds_path, timeout_s=5)
        config = SchedulerConfig(
            num_blocks=NUM_BLOCKS,
            block_size=16,
            max_num_batched_tokens=STEP_TOKENS,
            max_num_seqs=64,
            adaptive=True,
            target_itl_s=0.5,
        )
        metrics = Metrics()
        paged = PagedEngine(client, Scheduler(config), 64, metrics=metrics)
        yield paged, metrics
        await paged.close()
        await client.close()


def request(length: int = 8) -> ValidRequest:
    return ValidRequest(
        inputs="",
        input_ids=tuple(range(3, 3 + length)),
        sampling=SamplingParams(),
        stopping=StoppingParams(max_new_tokens=200, ignore_eos_token=True),
    )


def gauges(metrics: Metrics) -> dict[str, float]:
    """Every sample of the scrape by name (a `kind` label joins the name: name{kind})."""
    values = {}
    for family in text_string_to_metric_families(metrics.render().decode()):
        for sample in family.samples:
            kind = sample.labels.get("kind")
            values[f"{sample.name}{{{kind}}}" if kind else sample.name] = sample.value
    return values


async def first_tokens(channels: list[Channel]) -> None:
    for channel in channels:
        async for _ in channel:
            break


async def until_idle(paged: PagedEngine) -> None:
    for _ in range(100):
        if paged.num_active == 0 and not paged.scheduler.has_unfinished_requests():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("the engine did not go idle within a second")


IDLE = {
    "tgi_queue_size": 0,
    "tgi_batch_current_size": 0,
    "tgi_batch_current_max_tokens": 0,
    "textgate_kv_cache_blocks_used": 0,
    "textgate_scheduler_prefill_budget": STEP_TOKENS,
    "textgate_scheduler_utilization": 0,
    "textgate_scheduler_step_latency_seconds{decode}": 0,
    "textgate_scheduler_step_latency_seconds{mixed}": 0,
}


async def test_gauges_show_the_running_batch_then_idle_after_a_mass_cancellation(
    engine: tuple[PagedEngine, Metrics],
) -> None:
    paged, metrics = engine
    channels = paged.submit([request() for _ in range(50)])
    await asyncio.wait_for(first_tokens(channels[:4]), timeout=5)
    for _ in range(5):  # a few decode steps
        await asyncio.sleep(0.01)
    busy = gauges(metrics)
    assert busy["tgi_batch_current_size"] > 0 and busy["textgate_kv_cache_blocks_used"] > 0
    assert busy["textgate_scheduler_utilization"] > 0
    assert (
        busy["textgate_scheduler_step_latency_seconds{decode}"]
        + busy["textgate_scheduler_step_latency_seconds{mixed}"]
        > 0
    )
    assert busy["textgate_scheduler_itl_target_seconds"] == 0.5
    assert 1 <= busy["textgate_scheduler_batch_limit"] <= 64

    for channel in channels:
        channel.cancel()
    await until_idle(paged)
    idle = gauges(metrics)
    assert {name: idle[name] for name in IDLE} == IDLE
    assert idle["textgate_scheduler_batch_limit"] >= 1
    assert paged.scheduler.allocator.num_free_blocks == NUM_BLOCKS


async def test_gauges_are_idle_after_requests_finish(engine: tuple[PagedEngine, Metrics]) -> None:
    paged, metrics = engine
    assert {name: gauges(metrics)[name] for name in IDLE} == IDLE  # before any request
    short = ValidRequest(
        inputs="",
        input_ids=(3, 4, 5),
        sampling=SamplingParams(),
        stopping=StoppingParams(max_new_tokens=5, ignore_eos_token=True),
    )
    channels = paged.submit([short for _ in range(6)])
    for channel in channels:
        assert len([event async for event in channel]) == 5
    await until_idle(paged)
    idle = gauges(metrics)
    assert {name: idle[name] for name in IDLE} == IDLE
