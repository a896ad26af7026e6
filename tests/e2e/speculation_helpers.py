"""What the speculation tests through the real engine share: 20 chat prompts on the embedded
model (ten that ask to repeat a text, so drafts copying it are right, ten questions), and
running requests in mixed waves."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

from textgate.proto import generate_pb2 as pb
from textgate.router.engine.channel import Channel, StepEvent
from textgate.router.engine.paged_engine import PagedEngine
from textgate.router.engine.request import SamplingParams, StoppingParams, ValidRequest
from textgate.router.engine.scheduler import Scheduler, SchedulerConfig
from textgate.router.engine.speculation import SpeculationConfig
from textgate.router.metrics import Metrics
from textgate.router.shard_client import ShardedClient
from textgate.shard_server.server import serve

TEXTS = [
    "The quick brown fox jumps over the lazy dog near the river bank.",
    "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b",
    "Paris is the capital of France and Berlin is the capital of Germany.",
    "Roses are red, violets are blue, sugar is sweet, and so are you.",
    "One, two, three, four, five, six, seven, eight, nine, ten.",
    "The meeting is moved to Tuesday at ten in the large conference room.",
    "import os\nimport sys\n\nprint(os.getcwd())\nprint(sys.argv)",
    "Water boils at one hundred degrees Celsius at sea level pressure.",
    "Alice sent Bob a letter, and Bob sent Alice a parcel in return.",
    "Monday, Tuesday, Wednesday, Thursday, Friday, Saturday, Sunday.",
]
QUESTIONS = [
    "What is the tallest mountain in Africa?",
    "Name three kinds of clouds.",
    "Write a limerick about a cat.",
    "How many days are there in a leap year?",
    "Explain gravity in one sentence.",
    "What is 15 plus 27?",
    "Translate 'thank you' into French.",
    "Give me an antonym for cold.",
    "Why do leaves change colour in autumn?",
    "Tell me a fun fact about octopuses.",
]
MAX_NEW = 24


def chat_prompts(model_dir: Path) -> list[list[int]]:
    """The repeat-this-text prompts, then the questions, as chat-template token ids."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    messages = [f"Repeat this text exactly:\n\n{text}" for text in TEXTS] + QUESTIONS
    return [
        list(
            tokenizer.apply_chat_template(
                [{"role": "user", "content": m}], add_generation_prompt=True, tokenize=True
            )["input_ids"]
        )
        for m in messages
    ]


def mixed(prompts: list[list[int]]) -> list[list[int]]:
    """Copying and plain prompts interleaved."""
    return [p for pair in zip(prompts[:10], prompts[10:], strict=True) for p in pair]


def request(prompt: list[int], n: int = MAX_NEW, **sampling: object) -> ValidRequest:
    stopping = StoppingParams(max_new_tokens=n, ignore_eos_token=True)
    return ValidRequest("", tuple(prompt), SamplingParams(**sampling), stopping)  # type: ignore[arg-type]


async def events_of(channel: Channel) -> list[StepEvent]:
    events: list[StepEvent] = []
    async for event in channel:
        assert isinstance(event, StepEvent), event
        events.append(event)
    return events


async def run_waves(
    engine: PagedEngine, requests: list[ValidRequest], ended: list[Channel] | None = None
) -> list[list[int]]:
    """Four requests at a time, copying and plain ones mixed in each wave; their channels
    are added to `ended`."""
    outputs: list[list[int]] = []
    for start in range(0, len(requests), 4):
        channels = engine.submit(requests[start : start + 4])
        for events in await asyncio.gather(*(events_of(c) for c in channels)):
            outputs.append([t.id for e in events for t in e.tokens])
        if ended is not None:
            ended += channels
    return outputs


@asynccontextmanager
async def served(model: Any, uds: str) -> AsyncIterator[ShardedClient]:
    """`model` (a loaded PagedModel) served at `uds` and warmed up, as a client; the
    cache's block count is on the client as `num_blocks`."""
    task = asyncio.create_task(serve(model, uds, rank=0, world_size=1))
    client = await ShardedClient.connect(uds, timeout_s=60)
    warm = await client.warmup(pb.WarmupRequest(max_prefill_tokens=128))
    client.num_blocks = warm.num_blocks  # type: ignore[attr-defined]
    try:
        yield client
    finally:
        await client.close()
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


async def make_engine(
    shards: ShardedClient, speculation: SpeculationConfig | None, metrics: Metrics | None = None
) -> PagedEngine:
    """A fresh engine over `shards` (their cache cleared), speculating as `speculation` says."""
    await shards.clear_cache()
    config = SchedulerConfig(
        num_blocks=shards.num_blocks,  # type: ignore[attr-defined]
        block_size=16,
        max_num_batched_tokens=128,
        max_num_seqs=16,
        speculation=speculation,
    )
    return PagedEngine(shards, Scheduler(config), max_concurrent_requests=64, metrics=metrics)
