"""The paged engine's cost per token over the fake paged shard: every served step's busy time
and tokens reach the cost meter, and /metrics shows the costs only with a price."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from textgate.router.engine.channel import Channel, StepEvent
from textgate.router.engine.cost_meter import CostMeter
from textgate.router.engine.paged_engine import PagedEngine
from textgate.router.engine.request import SamplingParams, StoppingParams, ValidRequest
from textgate.router.engine.scheduler import Scheduler, SchedulerConfig
from textgate.router.metrics import Metrics
from textgate.router.shard_client import ShardedClient
from textgate.tests.router.fake_shard import fake_shards


async def serve(uds_path: str, cost: CostMeter | None) -> AsyncIterator[PagedEngine]:
    async with fake_shards(uds_path) as shards:
        shards[0].step_delay_s = 0.002
        client = await ShardedClient.connect(uds_path, timeout_s=5)
        # 8-token chunks: a 20-token prompt takes three steps, the last also sampling.
        config = SchedulerConfig(
            num_blocks=64, block_size=4, max_num_batched_tokens=8, max_num_seqs=8
        )
        paged = PagedEngine(client, Scheduler(config), 16, metrics=Metrics(), cost=cost)
        yield paged
        await paged.close()
        await client.close()


@pytest.fixture
async def priced(uds_path: str) -> AsyncIterator[PagedEngine]:
    async for paged in serve(uds_path, CostMeter(device_hour_cost=2.0)):
        yield paged


@pytest.fixture
async def unpriced(uds_path: str) -> AsyncIterator[PagedEngine]:
    async for paged in serve(uds_path, None):
        yield paged


def request(first: int, length: int, new: int, tenant: str = "") -> ValidRequest:
    return ValidRequest(
        inputs="",
        input_ids=tuple(range(first, first + length)),
        sampling=SamplingParams(),
        stopping=StoppingParams(max_new_tokens=new, ignore_eos_token=True),
        tenant=tenant,
    )


async def num_tokens(channel: Channel) -> int:
    count = 0
    async for event in channel:
        assert isinstance(event, StepEvent), event
        count += len(event.tokens)
    return count


def scrape(paged: PagedEngine) -> dict[str, float]:
    """Every cost sample line of the scrape, `name{labels}` -> value."""
    values = {}
    for line in paged._metrics.render().decode().splitlines():
        if "cost" in line and not line.startswith("#"):
            key, value = line.rsplit(" ", 1)
            values[key] = float(value)
    return values


async def test_served_steps_are_priced_per_token_and_tenant(priced: PagedEngine) -> None:
    channels = priced.submit([request(3, 20, 6, "acme"), request(100, 5, 4)])
    assert await asyncio.gather(*(num_tokens(c) for c in channels)) == [6, 4]
    assert priced.cost is not None
    report = priced.cost.report()
    # Every prompt token computed once, every generated token (the first ones included).
    assert report.lifetime.num_input_tokens == 25
    assert report.lifetime.num_output_tokens == 10
    assert report.window.input_busy_s > 0 and report.window.output_busy_s > 0
    acme = report.tenants["acme"]
    assert (acme.num_input_tokens, acme.num_output_tokens) == (20, 6)
    assert list(report.tenants) == ["acme"]
    values = scrape(priced)
    assert values["textgate_device_hour_cost_usd"] == 2.0
    for kind in ("input", "output"):
        assert values[f"textgate_cost_per_1k_{kind}_tokens_usd"] > 0
        assert values[f'textgate_tenant_cost_per_1k_{kind}_tokens_usd{{tenant="acme"}}'] > 0
    assert values['textgate_cost_tokens{kind="input"}'] == 25
    assert values['textgate_cost_tokens{kind="output"}'] == 10
    spent = values['textgate_tenant_cost_usd{tenant="acme"}']
    assert spent == pytest.approx(2.0 * (acme.input_busy_s + acme.output_busy_s) / 3600)
    # The split is of the busy time measured: at most the wall time the requests took.
    busy = sum(values[f'textgate_cost_busy_seconds{{kind="{k}"}}'] for k in ("input", "output"))
    assert 0 < busy < 5


async def test_without_a_price_nothing_is_reported(unpriced: PagedEngine) -> None:
    [channel] = unpriced.submit([request(3, 6, 3)])
    assert await num_tokens(channel) == 3
    assert unpriced.cost is None
    assert scrape(unpriced) == {}
