"""The paged engine against a real paged shard (tiny native model) over gRPC."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import torch

from textgate.proto import generate_pb2 as pb
from textgate.router.engine.block_allocator import hash_block
from textgate.router.engine.channel import Channel, ErrorEvent, StepEvent
from textgate.router.engine.kv_tiers import KvTier, KvTierIndex
from textgate.router.engine.paged_engine import PagedEngine
from textgate.router.engine.request import SamplingParams, StoppingParams, ValidRequest
from textgate.router.engine.scheduler import Scheduler, SchedulerConfig
from textgate.router.shard_client import ShardedClient
from textgate.shard_server.loading.shard_loader import load_model
from textgate.shard_server.server import serve
from textgate.shard_server.startup.cache_config import CacheConfig
from textgate.tests.router.fake_shard import fake_shards

BLOCK = 4
PROMPTS = [[5, 17, 42, 8, 9, 10, 11, 12, 13], [9, 3], [11, 12, 13, 14, 15, 16], [7] * 12]


@pytest.fixture(scope="module")
def references(tiny_model_dir: Path) -> dict[tuple[int, ...], list[int]]:
    """Greedy continuations (12 tokens) of every prompt, without any cache."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    result = {}
    with torch.inference_mode():
        for prompt in PROMPTS:
            ids = list(prompt)
            for _ in range(12):
                ids.append(int(model(input_ids=torch.tensor([ids])).logits[0, -1].argmax()))
            result[tuple(prompt)] = ids[len(prompt) :]
    return result


@pytest.fixture
async def shards(tiny_model_dir: Path, tmp_path: Path) -> AsyncIterator[ShardedClient]:
    model = load_model(
        tiny_model_dir, "tiny", "float32", cache_config=CacheConfig(block_size=BLOCK)
    )
    uds = str(tmp_path / "s")
    task = asyncio.create_task(serve(model, uds, rank=0, world_size=1))
    client = await ShardedClient.connect(uds, timeout_s=30)
    await client.warmup(pb.WarmupRequest(max_prefill_tokens=16))
    yield client
    await client.close()
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)


def engine(shards: ShardedClient, num_blocks: int = 64, budget: int = 8) -> PagedEngine:
    config = SchedulerConfig(
        num_blocks=num_blocks,
        block_size=BLOCK,
        max_num_batched_tokens=budget,
        max_num_seqs=4,
        num_reserved_tokens=0,
    )
    return PagedEngine(shards, Scheduler(config), max_concurrent_requests=16)


def greedy(prompt: list[int], max_new_tokens: int) -> ValidRequest:
    return ValidRequest(
        inputs="",
        input_ids=tuple(prompt),
        sampling=SamplingParams(),
        stopping=StoppingParams(max_new_tokens=max_new_tokens, ignore_eos_token=True),
    )


async def tokens_of(channel: Channel) -> list[int]:
    tokens: list[int] = []
    async for event in channel:
        assert isinstance(event, StepEvent), event
        tokens += [t.id for t in event.tokens]
    return tokens


async def test_requests_join_chunk_and_finish_like_greedy(
    shards: ShardedClient, references: dict[tuple[int, ...], list[int]]
) -> None:
    paged = engine(shards)
    lengths = [12, 3, 7, 5]
    first = paged.submit([greedy(PROMPTS[0], lengths[0]), greedy(PROMPTS[1], lengths[1])])
    await asyncio.sleep(0.05)  # the others join a running batch
    rest = paged.submit([greedy(p, n) for p, n in zip(PROMPTS[2:], lengths[2:], strict=True)])
    outputs = await asyncio.gather(*(tokens_of(c) for c in first + rest))
    for prompt, n, output in zip(PROMPTS, lengths, outputs, strict=True):
        assert output == references[tuple(prompt)][:n]
    assert paged.num_active == 0
    await paged.close()


async def test_preemption_recomputes_without_changing_outputs(
    shards: ShardedClient, references: dict[tuple[int, ...], list[int]]
) -> None:
    # 12 blocks of 4 tokens: four requests of up to 24 tokens cannot all keep their KV.
    paged = engine(shards, num_blocks=12)
    channels = paged.submit([greedy(p, 12) for p in PROMPTS])
    outputs = await asyncio.gather(*(tokens_of(c) for c in channels))
    for prompt, output in zip(PROMPTS, outputs, strict=True):
        assert output == references[tuple(prompt)]
    assert paged.scheduler.num_preemptions > 0
    paged.scheduler.check_invariants()
    assert paged.scheduler.allocator.num_free_blocks == 12
    await paged.close()


async def test_cancelled_request_leaves_and_frees_its_blocks(
    shards: ShardedClient, references: dict[tuple[int, ...], list[int]]
) -> None:
    paged = engine(shards)
    cancelled, kept = paged.submit([greedy(PROMPTS[0], 12), greedy(PROMPTS[2], 12)])
    async for _ in cancelled:
        cancelled.cancel()
        break
    assert await tokens_of(kept) == references[tuple(PROMPTS[2])]
    assert paged.num_active == 0 and not paged.scheduler.has_unfinished_requests()
    await paged.close()


async def test_prefix_cache_hit_keeps_the_output(
    shards: ShardedClient, references: dict[tuple[int, ...], list[int]]
) -> None:
    paged = engine(shards)
    (first,) = paged.submit([greedy(PROMPTS[3], 4)])
    assert await tokens_of(first) == references[tuple(PROMPTS[3])][:4]
    hits_before = paged.scheduler.allocator.num_prefix_hit_tokens
    (second,) = paged.submit([greedy(PROMPTS[3], 6)])
    assert await tokens_of(second) == references[tuple(PROMPTS[3])][:6]
    assert paged.scheduler.allocator.num_prefix_hit_tokens > hits_before
    await paged.close()


async def test_request_larger_than_the_cache_is_refused(shards: ShardedClient) -> None:
    paged = engine(shards, num_blocks=2)
    (channel,) = paged.submit([greedy(PROMPTS[0], 12)])
    events = [event async for event in channel]
    assert isinstance(events[-1], ErrorEvent) and events[-1].error_type == "validation"
    await paged.close()


async def logprobs_of(channel: Channel) -> list[tuple[int, float | None]]:
    events = [event async for event in channel]
    return [(t.id, t.logprob) for e in events if isinstance(e, StepEvent) for t in e.tokens]


async def test_a_prefix_evicted_to_the_host_tier_comes_back_with_the_same_output(
    shards: ShardedClient,
) -> None:
    """8 blocks: the other prompts evict PROMPTS[0]'s blocks, which the shard copies to its
    host pool; asked again, they are restored, not recomputed, and the tokens and their
    logprobs are the first run's."""
    config = SchedulerConfig(
        num_blocks=8, block_size=BLOCK, max_num_batched_tokens=16, max_num_seqs=1,
        num_reserved_tokens=0,
    )  # fmt: skip
    tiers = KvTierIndex(16)
    paged = PagedEngine(shards, Scheduler(config, kv_tiers=tiers), max_concurrent_requests=16)
    (channel,) = paged.submit([greedy(PROMPTS[0], 8)])
    first = await logprobs_of(channel)
    for prompt in (PROMPTS[3], PROMPTS[2]):
        (channel,) = paged.submit([greedy(prompt, 8)])
        await tokens_of(channel)
    assert tiers.num_offloaded_blocks >= 2
    (again,) = paged.submit([greedy(PROMPTS[0], 8)])
    restored = await logprobs_of(again)
    assert [t for t, _ in restored] == [t for t, _ in first]
    assert [lp for _, lp in restored] == pytest.approx([lp for _, lp in first], abs=1e-4)
    assert paged.scheduler.allocator.num_prefix_hit_tokens_by_tier[KvTier.HOST] == 2 * BLOCK
    await paged.close()


async def test_a_failed_step_drops_the_host_tier_and_what_it_may_have_restored(
    tmp_path: Path,
) -> None:
    """Which of a failed step's transfers ran is unknown: the router trusts no host block
    and no block that step restored, and clears the shards (their pools go too)."""
    uds = str(tmp_path / "f")
    async with fake_shards(uds) as (shard, *_):
        shards = await ShardedClient.connect(uds, timeout_s=5)
        config = SchedulerConfig(
            num_blocks=16, block_size=shard.block_size, max_num_batched_tokens=64,
            max_num_seqs=4, num_reserved_tokens=0,
        )  # fmt: skip
        tiers = KvTierIndex(8)
        paged = PagedEngine(shards, Scheduler(config, kv_tiers=tiers), max_concurrent_requests=4)
        prompt = list(range(1, 2 * shard.block_size + 2))
        size = shard.block_size
        first = hash_block(b"", prompt[:size])  # the host tier holds the prompt's 2 blocks
        tiers.offload(0, first)
        tiers.offload(1, hash_block(first, prompt[size : 2 * size]))
        tiers.take_transfers()
        shard.fail["Step"] = 1
        (channel,) = paged.submit([greedy(prompt, 2)])
        events = [event async for event in channel]
        assert isinstance(events[-1], ErrorEvent)
        allocator = paged.scheduler.allocator
        assert allocator.num_prefix_hit_tokens_by_tier[KvTier.HOST] == 2 * size  # planned
        assert tiers.num_host_used == 0 and allocator.num_evictable_blocks == 0
        restore = shard.calls_to("Step")[0].plan.kv_transfers
        assert [t.kind for t in restore] == [pb.KV_TRANSFER_KIND_RESTORE] * 2
        for _ in range(100):  # the ClearCache follows the failed requests' answers
            if shard.calls_to("ClearCache"):
                break
            await asyncio.sleep(0.05)
        assert shard.calls_to("ClearCache")
        await paged.close()
        await shards.close()
