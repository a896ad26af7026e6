"""ShardedClient over two fake shards: discovery, fan-out, rank 0's answer, errors."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from textgate.proto import generate_pb2 as pb
from textgate.router.engine.request import SamplingParams, StoppingParams, ValidRequest
from textgate.router.shard_client import ShardedClient, ShardError
from textgate.tests.router.fake_shard import FakeShard, fake_shards


@pytest.fixture
async def two(uds_path: str) -> AsyncIterator[tuple[list[FakeShard], ShardedClient]]:
    async with fake_shards(uds_path, world_size=2) as shards:
        client = await ShardedClient.connect(uds_path, timeout_s=5)
        yield shards, client
        await client.close()


def batch(batch_id: int, *prompts: int) -> pb.Batch:
    requests = [
        ValidRequest(
            inputs="",
            input_ids=(p,),
            sampling=SamplingParams(),
            stopping=StoppingParams(max_new_tokens=3),
        ).to_pb(i)
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
