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


def requests(*prompts: int) -> list[pb.Request]:
    """Greedy requests 0, 1, ... of one prompt token each and 3 new tokens."""
    return [
        pb.Request(
            id=i,
            input_ids=[p],
            parameters=pb.NextTokenChooserParameters(temperature=1.0, top_p=1.0, typical_p=1.0),
            stopping_parameters=pb.StoppingCriteriaParameters(max_new_tokens=3),
        )
        for i, p in enumerate(prompts)
    ]


def first_step(*prompts: int) -> pb.StepPlan:
    """Each request's prompt token in a block of its own, sampling its first token."""
    return pb.StepPlan(
        scheduled=[
            pb.ScheduledRequest(request_id=i, token_ids=[p], block_table=[i], produces_token=True)
            for i, p in enumerate(prompts)
        ]
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
    warmup = await client.warmup(pb.WarmupRequest(max_prefill_tokens=16))
    assert warmup.num_blocks == shards[0].num_blocks
    assert warmup.max_supported_total_tokens == shards[0].num_blocks * shards[0].block_size
    step = await client.step(requests(10, 20), first_step(10, 20))
    assert [g.tokens.ids[0] for g in step.generations] == [11, 21]
    await client.clear_cache()
    for shard in shards:
        names = [name for name, _ in shard.calls if name != "ServiceDiscovery"]
        assert names == ["Info", "Health", "Warmup", "Step", "ClearCache"]
        (call,) = shard.calls_to("Step")
        assert list(call.requests) == requests(10, 20) and call.plan == first_step(10, 20)
        assert not shard.held_request_ids()


async def test_a_failing_shard_raises_shard_error_with_its_message(
    two: tuple[list[FakeShard], ShardedClient],
) -> None:
    shards, client = two
    shards[1].fail["Step"] = 1
    with pytest.raises(ShardError, match="Server error: fake Step failure"):
        await client.step(requests(5), first_step(5))
    shards[0].healthy = False
    with pytest.raises(ShardError, match="unhealthy"):
        await client.health()


async def test_connect_gives_up_when_no_shard_listens(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    path = str(tmp_path_factory.mktemp("none") / "s")
    with pytest.raises(ShardError, match="not reachable"):
        await ShardedClient.connect(path, timeout_s=0.2)
