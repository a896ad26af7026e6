"""The fake shard: Info / Warmup describe a paged cache, Step runs plans, checks them."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import pytest

from textgate.proto import generate_pb2 as pb
from textgate.router.shard_client import ShardedClient, ShardError
from textgate.tests.router.fake_shard import EOS_TOKEN_ID, FakeShard, fake_shards


@pytest.fixture
async def paged(uds_path: str) -> AsyncIterator[tuple[FakeShard, ShardedClient]]:
    async with fake_shards(uds_path) as shards:
        client = await ShardedClient.connect(uds_path, timeout_s=5)
        yield shards[0], client
        await client.close()


def request(
    request_id: int,
    prompt: list[int],
    max_new_tokens: int,
    *,
    stop: tuple[str, ...] = (),
    seed: int | None = None,
    prefill_logprobs: bool = False,
    top_n_tokens: int = 0,
) -> pb.Request:
    return pb.Request(
        id=request_id,
        input_ids=prompt,
        parameters=pb.NextTokenChooserParameters(do_sample=seed is not None, seed=seed or 0),
        stopping_parameters=pb.StoppingCriteriaParameters(
            max_new_tokens=max_new_tokens, stop_sequences=stop
        ),
        prefill_logprobs=prefill_logprobs,
        top_n_tokens=top_n_tokens,
    )


def share(
    request_id: int, tokens: list[int], start: int, produces: bool = True
) -> pb.ScheduledRequest:
    return pb.ScheduledRequest(
        request_id=request_id,
        token_ids=tokens,
        start_position=start,
        block_table=list(range(4)),
        produces_token=produces,
    )


REQUESTS = [
    request(1, [10, 11, 12], 4, prefill_logprobs=True, top_n_tokens=2),
    request(2, [20], 5, stop=(" t23",)),
    request(3, [30, 31], 3, seed=5),
]


async def run_paged(client: ShardedClient) -> dict[int, list[bytes]]:
    """Every request's generations, prompts in two chunks, all running together."""
    known = {r.id: list(r.input_ids) for r in REQUESTS}
    first = [share(r.id, known[r.id][:1], 0, produces=len(r.input_ids) == 1) for r in REQUESTS]
    out: dict[int, list[bytes]] = {r.id: [] for r in REQUESTS}
    response = await client.step(REQUESTS, pb.StepPlan(scheduled=first))
    rest = [share(r.id, known[r.id][1:], 1) for r in REQUESTS if len(r.input_ids) > 1]
    running = {g.request_id for g in response.generations}
    while True:
        for g in response.generations:
            out[g.request_id].append(g.SerializeToString(deterministic=True))
            known[g.request_id] += g.tokens.ids
            if g.HasField("generated_text"):
                running.discard(g.request_id)
        if not running and not rest:
            return out
        decodes = [share(i, known[i][-1:], len(known[i]) - 1) for i in sorted(running)]
        running |= {s.request_id for s in rest}
        response = await client.step([], pb.StepPlan(scheduled=rest + decodes))
        rest = []


async def test_info_and_warmup_describe_a_paged_cache(
    paged: tuple[FakeShard, ShardedClient],
) -> None:
    fake, client = paged
    info = await client.info()
    assert info.block_size == 16 and not info.requires_padding
    fake.num_blocks = 10
    warmup = await client.warmup(pb.WarmupRequest(max_prefill_tokens=64))
    assert warmup.num_blocks == 10 and warmup.max_supported_total_tokens == 160


async def test_step_runs_chunked_prompts_and_decodes_to_each_finish(
    paged: tuple[FakeShard, ShardedClient],
) -> None:
    fake, client = paged
    paged_out = await run_paged(client)
    tokens = {
        i: [pb.Generation.FromString(g).tokens.ids[0] for g in out] for i, out in paged_out.items()
    }
    assert tokens == {1: [13, 14, 15, 16], 2: [21, 22, 23], 3: [32, 33, 34]}
    fake.eos_after = 2
    paged_out = await run_paged(client)
    assert not fake.held_request_ids(), "finished requests are dropped"
    assert [r.id for r in fake.received_requests()] == [1, 2, 3] * 2
    last = pb.Generation.FromString(paged_out[1][-1])
    assert last.tokens.ids[0] == EOS_TOKEN_ID
    first = pb.Generation.FromString(paged_out[1][0])
    assert list(first.prefill_tokens.ids) == [10, 11, 12] and len(first.top_tokens) == 1
    assert len(paged_out[1]) == 3 and [len(v) for v in paged_out.values()] == [3, 3, 3]


async def test_finished_ids_are_dropped_and_unknown_requests_fail(
    paged: tuple[FakeShard, ShardedClient],
) -> None:
    fake, client = paged
    await client.step([request(5, [40, 41], 9)], pb.StepPlan(scheduled=[share(5, [40, 41], 0)]))
    assert fake.held_request_ids() == {5}
    await client.step([], pb.StepPlan(finished_ids=[5]))
    assert not fake.held_request_ids()
    with pytest.raises(ShardError, match="request 5 is not known to this shard"):
        await client.step([], pb.StepPlan(scheduled=[share(5, [42], 2)]))


@pytest.mark.parametrize(
    ("scheduled", "message"),
    [
        (share(6, [40, 99], 0), r"token_ids at \[0, 2\) are not its tokens"),
        (share(6, [40], 0), "samples at 1 but has 2 known tokens"),
        (pb.ScheduledRequest(request_id=6, token_ids=[40, 41]), "0 blocks hold < 2 tokens"),
    ],
)
async def test_steps_that_contradict_the_request_fail(
    paged: tuple[FakeShard, ShardedClient], scheduled: pb.ScheduledRequest, message: str
) -> None:
    _, client = paged
    with pytest.raises(ShardError, match=message):
        await client.step([request(6, [40, 41], 3)], pb.StepPlan(scheduled=[scheduled]))


async def test_failures_delays_and_calls_cover_step(
    paged: tuple[FakeShard, ShardedClient],
) -> None:
    fake, client = paged
    fake.fail["Step"] = 1
    with pytest.raises(ShardError, match="fake Step failure"):
        await client.step([], pb.StepPlan())
    fake.step_delay_s = 0.05
    started = time.monotonic()
    await asyncio.gather(client.step([], pb.StepPlan()), client.health())
    assert time.monotonic() - started >= 0.05
    assert len(fake.calls_to("Step")) == 2
