"""N-gram speculation through the real engine on the embedded default model (float32):
greedy tokens equal those without speculation, token for token, over 20 prompts (ten that
copy text from the prompt, so drafts are accepted, ten that do not), run in mixed waves (so
steps mix sequences that verify drafts with ones that do not); seeded sampling is the same
token for token too, and a stop sequence or max_new_tokens landing inside an accepted run
ends the request exactly where it would end without speculation. Each request's channel
counts its verified and accepted drafts (TGI `details.speculation`), and they add up to
/metrics' totals. Requests with a grammar (a JSON schema, a regular expression) whose
output copies from the prompt give the same greedy tokens with speculation, drafts
accepted."""

from __future__ import annotations

import json
import re
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import pytest_asyncio

from textgate.router.engine.channel import Channel
from textgate.router.engine.paged_engine import PagedEngine
from textgate.router.engine.request import (
    GrammarSpec,
    SamplingParams,
    StoppingParams,
    ValidRequest,
)
from textgate.router.engine.speculation import SpeculationConfig, SpeculationStats
from textgate.router.metrics import Metrics
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

# One shard for the module (loading and warming the model up is most of a test's time).
pytestmark = [pytest.mark.slow, pytest.mark.asyncio(loop_scope="module")]

PEOPLE = [
    {"name": "Alice Smith", "city": "Paris", "year": 1999},
    {"name": "Bob Jones", "city": "Berlin", "year": 2004},
    {"name": "Carmen Ortega", "city": "Madrid", "year": 1987},
    {"name": "Dmitri Ivanov", "city": "Moscow", "year": 2012},
]
PERSON_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "city": {"type": "string"},
        "year": {"type": "integer"},
    },
    "required": ["name", "city", "year"],
}
DATE_PLACE = r"[A-Z][a-z]+( [A-Z][a-z]+)*, [0-9]{1,2} [A-Z][a-z]+ [0-9]{4}"
EVENTS = ["Paris, 14 July 1789", "Rome, 21 April 753", "Vienna, 9 June 1815"]


@pytest.fixture(scope="module")
def prompts(default_model_dir: Path) -> list[list[int]]:
    return chat_prompts(default_model_dir)


@pytest.fixture(scope="module")
def grammar_requests(default_model_dir: Path) -> list[ValidRequest]:
    """JSON-schema and regex requests whose answers copy from their prompts (xgrammar's
    JSON spacing, as the prompts spell it): JSON quoted whole and fields named in prose,
    then a date and place."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(default_model_dir)

    def chat(message: str) -> tuple[int, ...]:
        ids = tokenizer.apply_chat_template(
            [{"role": "user", "content": message}], add_generation_prompt=True, tokenize=True
        )["input_ids"]
        return tuple(ids)

    stopping = StoppingParams(max_new_tokens=48, ignore_eos_token=True)
    schema = GrammarSpec("json", json.dumps(PERSON_SCHEMA))
    copied = [chat(f"Repeat this JSON exactly:\n\n{json.dumps(p)}") for p in PEOPLE]
    told = [
        chat(f"{p['name']} lives in {p['city']} since {p['year']}. Give name, city, year as JSON.")
        for p in PEOPLE
    ]
    dated = [chat(f"Repeat the place and date exactly: {event}") for event in EVENTS]
    regex = GrammarSpec("regex", DATE_PLACE)
    return [
        ValidRequest("", ids, SamplingParams(), stopping, grammar=schema) for ids in copied + told
    ] + [ValidRequest("", ids, SamplingParams(), stopping, grammar=regex) for ids in dated]


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def shards(
    default_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[ShardedClient]:
    model = load_model(default_model_dir, "smol", "float32")
    async with served(model, str(tmp_path_factory.mktemp("speculative") / "s")) as client:
        yield client


async def make_engine(
    shards: ShardedClient, speculate: int, metrics: Metrics | None = None
) -> PagedEngine:
    speculation = SpeculationConfig(speculate, 1, 3) if speculate else None
    return await make_speculating_engine(shards, speculation, metrics)


def sample(metrics: Metrics, name: str) -> float:
    for line in metrics.render().decode().splitlines():
        if line.startswith(name + " "):
            return float(line.split()[-1])
    raise AssertionError(f"{name} not exported")


async def plain_and_speculated(
    shards: ShardedClient, requests: list[ValidRequest]
) -> tuple[list[list[int]], list[list[int]], SpeculationStats]:
    """The requests' tokens without speculation, then with it (4 drafts), and its stats."""
    plain = await make_engine(shards, 0)
    expected = await run_waves(plain, requests)
    await plain.close()
    engine = await make_engine(shards, 4)
    outputs = await run_waves(engine, requests)
    assert engine.scheduler.speculator is not None
    stats = engine.scheduler.speculator.stats
    await engine.close()
    return expected, outputs, stats


async def test_greedy_tokens_equal_without_speculation(
    shards: ShardedClient, prompts: list[list[int]]
) -> None:
    expected, outputs, stats = await plain_and_speculated(
        shards, [request(p) for p in mixed(prompts)]
    )
    for index, (output, reference) in enumerate(zip(outputs, expected, strict=True)):
        assert output == reference, f"prompt {index}"
    # The copying prompts had drafts verified and accepted, several tokens per step.
    assert stats.num_accepted_tokens > 50, stats
    assert stats.num_emitted_tokens > 1.5 * stats.num_verify_steps, stats


async def test_each_requests_drafts_add_up_to_the_metrics(
    shards: ShardedClient, prompts: list[list[int]]
) -> None:
    metrics = Metrics()
    engine = await make_engine(shards, 4, metrics)
    channels: list[Channel] = []
    await run_waves(engine, [request(p) for p in mixed(prompts)[:8]], channels)
    await engine.close()
    drafts = sum(c.num_draft_tokens for c in channels)
    accepted = sum(c.num_accepted_tokens for c in channels)
    assert accepted > 10 and drafts >= accepted
    assert sample(metrics, "textgate_speculative_draft_tokens") == drafts
    assert sample(metrics, "textgate_speculative_accepted_tokens") == accepted
    assert sample(metrics, "textgate_speculative_acceptance_rate") == pytest.approx(
        accepted / drafts
    )
    steps = sample(metrics, "textgate_speculative_verify_steps")
    emitted = sample(metrics, "textgate_speculative_emitted_tokens")
    assert sample(metrics, "textgate_speculative_tokens_per_step") == pytest.approx(emitted / steps)
    assert emitted / steps > 1.5, "copying prompts: several tokens per verifying step"
    # TGI's skipped tokens: each finished request's tokens beyond one per step.
    skipped = sum(c.num_skipped_tokens for c in channels)
    assert sample(metrics, "tgi_request_skipped_tokens_sum") == skipped
    assert sample(metrics, "tgi_request_skipped_tokens_count") == len(channels)


async def test_seeded_sampling_equals_without_speculation(
    shards: ShardedClient, prompts: list[list[int]]
) -> None:
    requests = [
        request(p, do_sample=True, temperature=0.7, top_p=0.95, seed=seed)
        for seed, p in enumerate(mixed(prompts)[:8])
    ]
    expected, outputs, stats = await plain_and_speculated(shards, requests)
    assert outputs == expected
    assert stats.num_accepted_tokens > 0, stats


async def test_max_new_tokens_and_stop_sequence_inside_an_accepted_run(
    shards: ShardedClient, prompts: list[list[int]]
) -> None:
    prompt = prompts[4]  # "One, two, three, ...": copied with long accepted runs
    engine = await make_engine(shards, 6)
    (channel,) = engine.submit([request(prompt, n=40)])
    full = [t for e in await events_of(channel) for t in e.tokens]
    text = "".join(t.text for t in full)
    assert "seven" in text, text
    for n in (7, 13, 19):  # budgets that end inside a run of drafts
        (channel,) = engine.submit([request(prompt, n=n)])
        events = await events_of(channel)
        tokens = [t.id for e in events for t in e.tokens]
        assert tokens == [t.id for t in full[:n]]
        assert events[-1].finished is not None
        assert events[-1].finished.finish_reason == "length"
        assert events[-1].finished.generated_tokens == n
    stop = StoppingParams(max_new_tokens=40, ignore_eos_token=True, stop_sequences=("seven",))
    (channel,) = engine.submit([ValidRequest("", tuple(prompt), SamplingParams(), stop)])
    events = await events_of(channel)
    stats = engine.scheduler.speculator.stats  # type: ignore[union-attr]
    await engine.close()
    got = "".join(t.text for e in events for t in e.tokens)
    assert got.endswith("seven") and got == text[: text.index("seven") + len("seven")]
    assert events[-1].finished is not None
    assert events[-1].finished.finish_reason == "stop_sequence"
    assert stats.num_emitted_tokens > 2 * stats.num_verify_steps, stats


async def test_grammar_requests_give_the_greedy_tokens_without_speculation(
    shards: ShardedClient, grammar_requests: list[ValidRequest], default_model_dir: Path
) -> None:
    from transformers import AutoTokenizer

    metrics = Metrics()
    plain = await make_engine(shards, 0)
    expected = await run_waves(plain, grammar_requests)
    await plain.close()
    engine = await make_engine(shards, 4, metrics)
    channels: list[Channel] = []
    outputs = await run_waves(engine, grammar_requests, channels)
    await engine.close()
    for index, (output, reference) in enumerate(zip(outputs, expected, strict=True)):
        assert output == reference, f"request {index}"
    tokenizer = AutoTokenizer.from_pretrained(default_model_dir)
    texts = [tokenizer.decode(ids, skip_special_tokens=True) for ids in outputs]
    for text in texts[: 2 * len(PEOPLE)]:
        assert set(json.loads(text)) == {"name", "city", "year"}, text
    for text in texts[2 * len(PEOPLE) :]:
        assert re.fullmatch(DATE_PLACE, text), text
    assert texts[0] == json.dumps(PEOPLE[0]), texts[0]  # copied: drafts can be accepted
    # Drafts were verified under the grammars and accepted, per request and in /metrics.
    # Whether a step speculates depends on the measured step costs (a loaded machine
    # turns more steps down), so the counts are loose; a quiet run accepts over 100.
    accepted = [c.num_accepted_tokens for c in channels]
    assert sum(accepted) >= 10 and sum(1 for a in accepted if a > 0) >= 2, accepted
    assert sample(metrics, "textgate_speculative_accepted_tokens") == sum(accepted)
    assert sample(metrics, "textgate_speculative_tokens_per_step") > 1.5
