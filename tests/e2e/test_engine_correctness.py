"""The engine on the embedded default model: greedy tokens equal transformers' `generate`,
alone and inside a batch of 16 requests of mixed lengths joining at different steps."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import torch

from textgate.proto import generate_pb2 as pb
from textgate.router.engine.channel import Channel, StepEvent
from textgate.router.engine.paged_engine import PagedEngine
from textgate.router.engine.request import SamplingParams, StoppingParams, ValidRequest
from textgate.router.engine.scheduler import Scheduler, SchedulerConfig
from textgate.router.shard_client import ShardedClient
from textgate.shard_server.loading.shard_loader import load_model
from textgate.shard_server.server import serve

pytestmark = pytest.mark.slow

QUESTIONS = [
    "What is the capital of France?",
    "Name three primary colors.",
    "Write a haiku about the sea.",
    "How many legs does a spider have?",
    "Explain photosynthesis in one sentence.",
    "What is 12 times 12?",
    "Translate 'good morning' into Spanish.",
    "Give me a synonym for happy.",
]
MAX_NEW = [16, 5, 12, 3, 16, 8, 10, 6]


@pytest.fixture(scope="module")
def prompts(default_model_dir: Path) -> list[list[int]]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(default_model_dir)
    return [
        list(
            tokenizer.apply_chat_template(
                [{"role": "user", "content": q}], add_generation_prompt=True, tokenize=True
            )["input_ids"]
        )
        for q in QUESTIONS
    ]


@pytest.fixture(scope="module")
def expected(default_model_dir: Path, prompts: list[list[int]]) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(default_model_dir, dtype=torch.float32)
    outputs = []
    for prompt, n in zip(prompts, MAX_NEW, strict=True):
        ids = torch.tensor([prompt])
        out = model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False)
        outputs.append(out[0, len(prompt) :].tolist())
    return outputs


@pytest.fixture
async def engine(default_model_dir: Path, tmp_path: Path) -> AsyncIterator[PagedEngine]:
    model = load_model(default_model_dir, "smol", "float32")
    uds = str(tmp_path / "s")
    task = asyncio.create_task(serve(model, uds, rank=0, world_size=1))
    shards = await ShardedClient.connect(uds, timeout_s=60)
    warm = await shards.warmup(pb.WarmupRequest(max_prefill_tokens=128))
    config = SchedulerConfig(
        num_blocks=warm.num_blocks, block_size=16, max_num_batched_tokens=128, max_num_seqs=16
    )
    yield PagedEngine(shards, Scheduler(config), max_concurrent_requests=64)
    await shards.close()
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)


def greedy(prompt: list[int], n: int) -> ValidRequest:
    # min_new_tokens = max_new_tokens, as in the reference: eos cannot end either early.
    stopping = StoppingParams(max_new_tokens=n, min_new_tokens=n)
    return ValidRequest("", tuple(prompt), SamplingParams(), stopping)


async def tokens_of(channel: Channel) -> list[int]:
    tokens: list[int] = []
    async for event in channel:
        assert isinstance(event, StepEvent), event
        tokens += [t.id for t in event.tokens]
    return tokens


async def test_greedy_alone_equals_transformers_generate(
    engine: PagedEngine, prompts: list[list[int]], expected: list[list[int]]
) -> None:
    for prompt, n, reference in zip(prompts[:3], MAX_NEW, expected, strict=False):
        (channel,) = engine.submit([greedy(prompt, n)])
        assert await tokens_of(channel) == reference
    await engine.close()


async def test_sixteen_mixed_requests_joining_late_keep_their_greedy_tokens(
    engine: PagedEngine, prompts: list[list[int]], expected: list[list[int]]
) -> None:
    channels: list[Channel] = []
    order: list[int] = []
    for wave in range(4):
        for i in range(4):
            index = (wave * 4 + i) % len(prompts)
            channels += engine.submit([greedy(prompts[index], MAX_NEW[index])])
            order.append(index)
        await asyncio.sleep(0.3)  # the next wave joins a running batch
    outputs = await asyncio.gather(*(tokens_of(c) for c in channels))
    for index, output in zip(order, outputs, strict=True):
        assert output == expected[index], QUESTIONS[index]
    await engine.close()
