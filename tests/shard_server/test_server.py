"""The shard's gRPC server over a real unix socket, with a tiny model of each kind.

A padded shard (the transformers fallback) serves Prefill / Decode / FilterBatch, a
paged shard (native model) serves Step; each answers the other's calls INVALID_ARGUMENT.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path

import grpc
import pytest
import torch

from textgate.proto import generate_pb2 as pb
from textgate.proto import generate_pb2_grpc as pb_grpc
from textgate.shard_server.loading.shard_loader import load_model
from textgate.shard_server.protocols.paged_model import CacheConfig
from textgate.shard_server.protocols.shard_model import ShardModel
from textgate.shard_server.protocols.transformers_model import TransformersModel
from textgate.shard_server.server import serve

Stub = pb_grpc.TextGenerationServiceStub
BLOCK = 4


@asynccontextmanager
async def served(model: ShardModel, tmp_path: Path) -> AsyncIterator[Stub]:
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
async def stub(tiny_model_dir: Path, tmp_path: Path) -> AsyncIterator[Stub]:
    """A padded shard."""
    model = TransformersModel(tiny_model_dir, torch.float32, torch.device("cpu"), "tiny")
    async with served(model, tmp_path) as stub:
        yield stub


@pytest.fixture
async def paged(tiny_model_dir: Path, tmp_path: Path) -> AsyncIterator[Stub]:
    """A paged shard, warmed up."""
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


async def test_info_and_discovery(stub: Stub) -> None:
    info = await stub.Info(pb.InfoRequest())
    assert info.model_type == "transformers" and info.dtype == "float32" and info.requires_padding
    assert info.block_size == 0
    urls = await stub.ServiceDiscovery(pb.ServiceDiscoveryRequest())
    assert len(urls.urls) == 1 and urls.urls[0].startswith("unix://")


async def test_prefill_decode_filter_clear(
    stub: Stub,
    request_factory: Callable[..., pb.Request],
    batch_factory: Callable[..., pb.Batch],
) -> None:
    requests = [request_factory(i, [5, 6, 7 + i], 3 + i) for i in range(3)]
    prefill = await stub.Prefill(pb.PrefillRequest(batch=batch_factory(1, *requests)))
    assert [g.request_id for g in prefill.generations] == [0, 1, 2]
    assert list(prefill.batch.request_ids) == [0, 1, 2] and prefill.forward_ns > 0
    assert prefill.total_ns >= prefill.forward_ns
    filtered = await stub.FilterBatch(pb.FilterBatchRequest(batch_id=1, request_ids=[0, 2]))
    assert list(filtered.batch.request_ids) == [0, 2]
    decode = await stub.Decode(pb.DecodeRequest(batches=[filtered.batch]))
    assert [g.request_id for g in decode.generations] == [0, 2]
    decode = await stub.Decode(pb.DecodeRequest(batches=[decode.batch]))
    finished = [g for g in decode.generations if g.HasField("generated_text")]
    assert [g.request_id for g in finished] == [0]
    assert finished[0].generated_text.finish_reason == pb.FINISH_REASON_LENGTH
    assert list(decode.batch.request_ids) == [2] and decode.HasField("concat_ns")
    await stub.ClearCache(pb.ClearCacheRequest())
    code, details = await status_of(stub.Decode(pb.DecodeRequest(batches=[decode.batch])))
    assert code == grpc.StatusCode.NOT_FOUND and details == "batch 1 not found"


async def test_unknown_batches_are_not_found_and_leave_the_cache_as_it_was(
    stub: Stub,
    request_factory: Callable[..., pb.Request],
    batch_factory: Callable[..., pb.Batch],
) -> None:
    prefill = await stub.Prefill(
        pb.PrefillRequest(batch=batch_factory(4, request_factory(0, [5], 3)))
    )
    missing = pb.CachedBatch(id=99, request_ids=[7], size=1)
    code, _ = await status_of(stub.Decode(pb.DecodeRequest(batches=[prefill.batch, missing])))
    assert code == grpc.StatusCode.NOT_FOUND
    code, _ = await status_of(stub.FilterBatch(pb.FilterBatchRequest(batch_id=99)))
    assert code == grpc.StatusCode.NOT_FOUND
    decode = await stub.Decode(pb.DecodeRequest(batches=[prefill.batch]))
    assert [g.request_id for g in decode.generations] == [0]
    code, details = await status_of(stub.Decode(pb.DecodeRequest()))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "at least one" in details


async def test_model_errors_become_internal_status(
    stub: Stub,
    request_factory: Callable[..., pb.Request],
    batch_factory: Callable[..., pb.Batch],
) -> None:
    bad = request_factory(9, [5, 10_000_000], 2)  # token id beyond the vocabulary
    code, _ = await status_of(stub.Prefill(pb.PrefillRequest(batch=batch_factory(2, bad))))
    assert code == grpc.StatusCode.INTERNAL
    ok = await stub.Prefill(pb.PrefillRequest(batch=batch_factory(3, request_factory(1, [5], 1))))
    assert ok.generations[0].HasField("generated_text")


async def test_a_padded_shard_refuses_step(
    stub: Stub, request_factory: Callable[..., pb.Request]
) -> None:
    step = pb.StepRequest(requests=[request_factory(0, [5], 2)], plan=pb.StepPlan())
    code, details = await status_of(stub.Step(step))
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert details.startswith("this shard is padded") and "send Prefill" in details


async def test_paged_info_and_steps_to_the_finish(
    paged: Stub, request_factory: Callable[..., pb.Request]
) -> None:
    info = await paged.Info(pb.InfoRequest())
    assert info.block_size == BLOCK and not info.requires_padding
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


async def test_a_paged_shard_refuses_the_padded_calls(
    paged: Stub, request_factory: Callable[..., pb.Request], batch_factory: Callable[..., pb.Batch]
) -> None:
    calls = {
        "Prefill": paged.Prefill(
            pb.PrefillRequest(batch=batch_factory(1, request_factory(0, [5], 2)))
        ),
        "Decode": paged.Decode(pb.DecodeRequest(batches=[pb.CachedBatch(id=1)])),
        "FilterBatch": paged.FilterBatch(pb.FilterBatchRequest(batch_id=1)),
    }
    for name, call in calls.items():
        code, details = await status_of(call)
        assert code == grpc.StatusCode.INVALID_ARGUMENT
        assert details == f"this shard is paged (block_size > 0): send Step, not {name}"


async def test_paged_clear_cache_forgets_requests_and_unknown_ones_are_internal(
    paged: Stub, request_factory: Callable[..., pb.Request]
) -> None:
    request = request_factory(2, [5, 6], 5)
    plan = pb.StepPlan(scheduled=[scheduled(2, [5, 6], 0)])
    await paged.Step(pb.StepRequest(requests=[request], plan=plan))
    await paged.ClearCache(pb.ClearCacheRequest(id=2))  # no batches: nothing to drop
    await paged.ClearCache(pb.ClearCacheRequest())
    plan = pb.StepPlan(scheduled=[scheduled(2, [7], 2)])
    code, details = await status_of(paged.Step(pb.StepRequest(plan=plan)))
    assert code == grpc.StatusCode.INTERNAL
    assert "request 2 is not known to this shard" in details
