"""ShardedClient over two fake shards: discovery, fan-out, rank 0's answer, errors."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from textgate.proto import generate_pb2 as pb
from textgate.router.shard_client import ShardedClient, ShardError
from textgate.tests.router.fake_shard import FakeShard, fake_shards


@pytest.fixture
async def two(uds_path: str) -> AsyncIterator[tuple[list[FakeShard], ShardedClient]]:
    async with fake_shards(uds_path, world_size=2) as shards:
        client = await ShardedClient.connect(uds_path, timeout_s=5)
        yield shards, client
        await client.close()


def batch(batch_id: int, *prompts: int) -> pb.Batch:
    """Greedy requests 0, 1, ... of one prompt token each and 3 new tokens."""
    requests = [
        pb.Request(
            id=i,
            input_ids=[p],
            parameters=pb.NextTokenChooserParameters(temperature=1.0, top_p=1.0, typical_p=1.0),
            stopping_parameters=pb.StoppingCriteriaParameters(max_new_tokens=3),
        )
        for i, p in enumerate(prompts)
    ]
    return pb.Batch(
        id=batch_id, requests=requests, size=len(requests), max_tokens=4 * len(requests)
    )


async def test_connect_discovers_every_shard(
    two: tuple[list[FakeShard], ShardedClient], uds_path: str
) -> None:
    shards, client = two
    assert [c.url for c in client.clients] == [f"unix://{uds_path}-0", f"unix://{uds_path}-1"]
    assert len(shards[0].calls_to("ServiceDiscovery")) == 1
    assert not shards[1].calls_to("ServiceDiscovery")


async def test_every_call_reaches_every_shard(two: tuple[list[FakeShard], ShardedClient]) -> None:
    shards, client = two
    info = await client.info()
    assert info.world_size == 2
    await client.health()
    prefill = await client.prefill(batch(7, 10, 20))
    assert [g.tokens.ids[0] for g in prefill.generations] == [11, 21]
    assert list(prefill.batch.request_ids) == [0, 1]
    kept = await client.filter_batch(7, [1])
    assert list(kept.request_ids) == [1]
    decode = await client.decode([kept])
    assert [g.request_id for g in decode.generations] == [1]
    await client.clear_cache(7)
    for shard in shards:
        names = [name for name, _ in shard.calls if name != "ServiceDiscovery"]
        assert names == ["Info", "Health", "Prefill", "FilterBatch", "Decode", "ClearCache"]
        assert not shard.cache


async def test_warmup_reports_capacity_or_none(two: tuple[list[FakeShard], ShardedClient]) -> None:
    shards, client = two
    response = await client.warmup(pb.WarmupRequest(batch=batch(1, 5)))
    assert not response.HasField("max_supported_total_tokens")
    for shard in shards:
        shard.max_supported_total_tokens = 5000
    response = await client.warmup(pb.WarmupRequest(batch=batch(1, 5)))
    assert response.max_supported_total_tokens == 5000


async def test_a_failing_shard_raises_shard_error_with_its_message(
    two: tuple[list[FakeShard], ShardedClient],
) -> None:
    shards, client = two
    shards[1].fail["Prefill"] = 1
    with pytest.raises(ShardError, match="Server error: fake Prefill failure"):
        await client.prefill(batch(3, 5))
    shards[0].healthy = False
    with pytest.raises(ShardError, match="unhealthy"):
        await client.health()


async def test_connect_gives_up_when_no_shard_listens(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    path = str(tmp_path_factory.mktemp("none") / "s")
    with pytest.raises(ShardError, match="not reachable"):
        await ShardedClient.connect(path, timeout_s=0.2)


async def test_step_reaches_every_paged_shard_and_padded_ones_refuse_it(uds_path: str) -> None:
    request = batch(0, 10).requests[0]
    plan = pb.StepPlan(
        scheduled=[
            pb.ScheduledRequest(request_id=0, token_ids=[10], block_table=[0], produces_token=True)
        ]
    )
    async with fake_shards(uds_path, world_size=2, paged=True) as shards:
        client = await ShardedClient.connect(uds_path, timeout_s=5)
        response = await client.step([request], plan)
        assert isinstance(response, pb.StepResponse)
        assert [g.tokens.ids[0] for g in response.generations] == [11]
        for shard in shards:
            (call,) = shard.calls_to("Step")
            assert list(call.requests) == [request] and call.plan == plan
        with pytest.raises(ShardError, match=r"this shard is paged.*send Step, not Prefill"):
            await client.prefill(batch(1, 5))
        for shard in shards:
            shard.paged = False
        with pytest.raises(ShardError, match=r"this shard is padded.*not Step"):
            await client.step([], pb.StepPlan())
        await client.close()
