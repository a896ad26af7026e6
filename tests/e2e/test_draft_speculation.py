"""Draft-model speculation through the real engine: the embedded default model in float32,
drafted for by its own int8 copy (`--speculative-model embedded --speculative-quantize
int8`). Greedy tokens equal those without speculation over 20 prompts in mixed waves, with
most guesses accepted whether or not the text copies its prompt; seeded sampling is the
same token for token; a request cancelled while its guesses are in flight leaves the KV
blocks idle and the others' tokens unchanged."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import pytest_asyncio

from textgate.router.engine.paged_engine import PagedEngine
from textgate.router.engine.speculation import SpeculationConfig
from textgate.router.shard_client import ShardedClient
from textgate.shard_server.loading.shard_loader import load_model
from textgate.tests.e2e.speculation_helpers import (
    chat_prompts,
    events_of,
    mixed,
    request,
    run_waves,
    served,
)
from textgate.tests.e2e.speculation_helpers import make_engine as make_speculating_engine

pytestmark = [pytest.mark.slow, pytest.mark.asyncio(loop_scope="module")]


@pytest.fixture(scope="module")
def prompts(default_model_dir: Path) -> list[list[int]]:
    return chat_prompts(default_model_dir)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def shards(
    default_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[ShardedClient]:
    model = load_model(
        default_model_dir,
        "smol",
        "float32",
        speculative_model=default_model_dir,
        speculative_quantize="int8",
    )
    async with served(model, str(tmp_path_factory.mktemp("draft") / "s")) as client:
        yield client


async def make_engine(shards: ShardedClient, speculate: int) -> PagedEngine:
    speculation = SpeculationConfig(speculate, draft_model=True) if speculate else None
    return await make_speculating_engine(shards, speculation)


async def test_greedy_tokens_equal_without_speculation(
    shards: ShardedClient, prompts: list[list[int]]
) -> None:
    requests = [request(p) for p in mixed(prompts)]
    plain = await make_engine(shards, 0)
    expected = await run_waves(plain, requests)
    await plain.close()
    engine = await make_engine(shards, 4)
    outputs = await run_waves(engine, requests)
    assert engine.scheduler.speculator is not None
    stats = engine.scheduler.speculator.stats
    await engine.close()
    for index, (output, reference) in enumerate(zip(outputs, expected, strict=True)):
        assert output == reference, f"prompt {index}"
    # An int8 copy guesses the float model's text, questions as well as copies.
    assert stats.num_accepted_tokens > 0.6 * stats.num_draft_tokens, stats
    assert stats.num_emitted_tokens > 2 * stats.num_verify_steps, stats


async def test_seeded_sampling_equals_without_speculation(
    shards: ShardedClient, prompts: list[list[int]]
) -> None:
    requests = [
        request(p, do_sample=True, temperature=0.7, top_p=0.95, seed=seed)
        for seed, p in enumerate(mixed(prompts)[:8])
    ]
    plain = await make_engine(shards, 0)
    expected = await run_waves(plain, requests)
    await plain.close()
    engine = await make_engine(shards, 4)
    outputs = await run_waves(engine, requests)
    await engine.close()
    assert outputs == expected


async def test_a_request_cancelled_mid_speculation_leaves_the_cache_idle(
    shards: ShardedClient, prompts: list[list[int]]
) -> None:
    requests = [request(p, n=32) for p in prompts[10:14]]
    plain = await make_engine(shards, 0)
    expected = await run_waves(plain, requests)
    await plain.close()
    engine = await make_engine(shards, 4)
    channels = engine.submit(requests)
    kept = [asyncio.ensure_future(events_of(c)) for c in channels[1:]]
    async for _event in channels[0]:
        if engine.scheduler.speculator.stats.num_verify_steps:  # type: ignore[union-attr]
            channels[0].cancel()
            break
    outputs = [[t.id for e in events for t in e.tokens] for events in await asyncio.gather(*kept)]
    await asyncio.sleep(0.1)
    allocator = engine.scheduler.allocator
    await engine.close()
    assert outputs == expected[1:]
    assert allocator.num_used_blocks == 0
    allocator.check_invariants()
