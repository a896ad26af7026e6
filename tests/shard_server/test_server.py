"""The shard's gRPC server over a real unix socket, with a tiny native model: Info,
discovery, Step to a request's finish, ClearCache, and model errors as statuses."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path

import grpc
import pytest

from textgate.proto import generate_pb2 as pb
from textgate.proto import generate_pb2_grpc as pb_grpc
from textgate.shard_server.loading.shard_loader import load_model
from textgate.shard_server.protocols.paged_model import CacheConfig, PagedModel
from textgate.shard_server.server import serve

Stub = pb_grpc.TextGenerationServiceStub
BLOCK = 4


@asynccontextmanager
async def served(model: PagedModel, tmp_path: Path) -> AsyncIterator[Stub]:
    uds = str(tmp_path / "s")
    task = asyncio.create_task(serve(model, uds, rank=0, world_size=1))
    async with grpc.aio.insecure_channel(f"unix://{uds}-0") as channel:
        stub = Stub(channel)
        await stub.Health(pb.HealthRequest(), wait_for_ready=True, timeout=10)
        yield stub
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


@pytest.fixture
async def paged(tiny_model_dir: Path, tmp_path: Path) -> AsyncIterator[Stub]:
    """A shard, warmed up."""
    model = load_model(tiny_model_dir, "tiny", "float32", cache_config=CacheConfig(BLOCK))
    async with served(model, tmp_path) as stub:
        warmup = await stub.Warmup(pb.WarmupRequest(max_prefill_tokens=16))
        assert warmup.num_blocks > 0
        assert warmup.max_supported_total_tokens == warmup.num_blocks * BLOCK
        yield stub


async def status_of(call: Awaitable[object]) -> tuple[grpc.StatusCode, str]:
    """The status code and details a call fails with."""
    with pytest.raises(grpc.aio.AioRpcError) as error:
        await call
    return error.value.code(), error.value.details() or ""


def scheduled(request_id: int, tokens: list[int], start: int) -> pb.ScheduledRequest:
    return pb.ScheduledRequest(
        request_id=request_id,
        token_ids=tokens,
        start_position=start,
        block_table=[request_id * 4 + b for b in range(4)],
        produces_token=True,
    )


async def test_info_and_discovery(paged: Stub) -> None:
    info = await paged.Info(pb.InfoRequest())
    assert info.model_type == "llama" and info.dtype == "float32"
    assert info.block_size == BLOCK and not info.requires_padding
    urls = await paged.ServiceDiscovery(pb.ServiceDiscoveryRequest())
    assert len(urls.urls) == 1 and urls.urls[0].startswith("unix://")


async def test_model_errors_become_internal_status_and_the_shard_serves_on(
    paged: Stub, request_factory: Callable[..., pb.Request]
) -> None:
    bad = request_factory(9, [5, 10_000_000], 2)  # token id beyond the vocabulary
    plan = pb.StepPlan(scheduled=[scheduled(9, [5, 10_000_000], 0)])
    code, _ = await status_of(paged.Step(pb.StepRequest(requests=[bad], plan=plan)))
    assert code == grpc.StatusCode.INTERNAL
    await paged.ClearCache(pb.ClearCacheRequest())
    plan = pb.StepPlan(scheduled=[scheduled(1, [5], 0)])
    ok = await paged.Step(pb.StepRequest(requests=[request_factory(1, [5], 1)], plan=plan))
    assert ok.generations[0].HasField("generated_text")


async def test_a_block_past_the_cache_is_refused_before_a_kernel_writes_through_it(
    paged: Stub, request_factory: Callable[..., pb.Request]
) -> None:
    """A plan naming a block the cache does not have is an error status, not a write out
    of bounds (the C kernels index the cache by the table: the shard died of SIGSEGV)."""
    warmup = await paged.Warmup(pb.WarmupRequest(max_prefill_tokens=16))
    outside = pb.ScheduledRequest(
        request_id=3, token_ids=[5, 6], block_table=[warmup.num_blocks + 40], produces_token=True
    )
    plan = pb.StepPlan(scheduled=[outside])
    code, details = await status_of(
        paged.Step(pb.StepRequest(requests=[request_factory(3, [5, 6], 2)], plan=plan))
    )
    assert code == grpc.StatusCode.INTERNAL
    assert f"block {warmup.num_blocks + 40} is outside the KV cache" in details
    plan = pb.StepPlan(scheduled=[scheduled(1, [5], 0)])
    ok = await paged.Step(pb.StepRequest(requests=[request_factory(1, [5], 1)], plan=plan))
    assert ok.generations[0].HasField("generated_text")


async def test_paged_info_and_steps_to_the_finish(
    paged: Stub, request_factory: Callable[..., pb.Request]
) -> None:
    prompt = [5, 6, 7, 8, 9]
    request = request_factory(1, prompt, 3)
    first = await paged.Step(
        pb.StepRequest(requests=[request], plan=pb.StepPlan(scheduled=[scheduled(1, prompt, 0)]))
    )
    assert [g.request_id for g in first.generations] == [1]
    assert first.forward_ns > 0 and first.total_ns >= first.forward_ns
    tokens = list(first.generations[0].tokens.ids)
    while not first.generations[0].HasField("generated_text"):
        plan = pb.StepPlan(scheduled=[scheduled(1, tokens[-1:], len(prompt) + len(tokens) - 1)])
        first = await paged.Step(pb.StepRequest(plan=plan))
        tokens += first.generations[0].tokens.ids
    assert len(tokens) == 3
    assert first.generations[0].generated_text.finish_reason == pb.FINISH_REASON_LENGTH


async def test_paged_clear_cache_forgets_requests_and_unknown_ones_are_internal(
    paged: Stub, request_factory: Callable[..., pb.Request]
) -> None:
    request = request_factory(2, [5, 6], 5)
    plan = pb.StepPlan(scheduled=[scheduled(2, [5, 6], 0)])
    await paged.Step(pb.StepRequest(requests=[request], plan=plan))
    await paged.ClearCache(pb.ClearCacheRequest())
    plan = pb.StepPlan(scheduled=[scheduled(2, [7], 2)])
    code, details = await status_of(paged.Step(pb.StepRequest(plan=plan)))
    assert code == grpc.StatusCode.INTERNAL
    assert "request 2 is not known to this shard" in details


async def test_a_multinode_rank_answers_on_tcp_too_and_lists_every_rank(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """With --tcp-port the shard also listens on TCP (where other nodes reach it), and
    ServiceDiscovery answers the gathered addresses of every rank."""
    from textgate.launcher import free_port
    from textgate.shard_server.server import gather_urls

    model = load_model(tiny_model_dir, "tiny", "float32", cache_config=CacheConfig(BLOCK))
    port, uds = free_port(), str(tmp_path / "s")
    urls = ["unix:///elsewhere-0", f"127.0.0.1:{port}"]
    assert gather_urls(urls[1], world_size=1) == [urls[1]]
    task = asyncio.create_task(serve(model, uds, 1, 2, tcp_port=port, urls=urls))
    try:
        for url in (f"unix://{uds}-1", f"127.0.0.1:{port}"):
            async with grpc.aio.insecure_channel(url) as channel:
                stub = Stub(channel)
                await stub.Health(pb.HealthRequest(), wait_for_ready=True, timeout=10)
                found = await stub.ServiceDiscovery(pb.ServiceDiscoveryRequest())
                assert list(found.urls) == urls
    finally:
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
