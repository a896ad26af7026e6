"""The shard's gRPC server over a real unix socket, with a tiny model."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import grpc
import pytest
import torch

from textgate.proto import generate_pb2 as pb
from textgate.proto import generate_pb2_grpc as pb_grpc
from textgate.shard_server.server import serve
from textgate.shard_server.transformers_model import TransformersModel


@pytest.fixture
async def stub(
    tiny_model_dir: Path, tmp_path: Path
) -> AsyncIterator[pb_grpc.TextGenerationServiceStub]:
    model = TransformersModel(tiny_model_dir, torch.float32, torch.device("cpu"), "tiny")
    uds = str(tmp_path / "s")
    task = asyncio.create_task(serve(model, uds, rank=0, world_size=1))
    async with grpc.aio.insecure_channel(f"unix://{uds}-0") as channel:
        stub = pb_grpc.TextGenerationServiceStub(channel)
        await stub.Health(pb.HealthRequest(), wait_for_ready=True, timeout=10)
        yield stub
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


async def test_info_and_discovery(stub: pb_grpc.TextGenerationServiceStub) -> None:
    info = await stub.Info(pb.InfoRequest())
    assert info.model_type == "transformers" and info.dtype == "float32" and info.requires_padding
    urls = await stub.ServiceDiscovery(pb.ServiceDiscoveryRequest())
    assert len(urls.urls) == 1 and urls.urls[0].startswith("unix://")


async def test_prefill_decode_filter_clear(
    stub: pb_grpc.TextGenerationServiceStub,
    request_factory: Callable[..., pb.Request],
    batch_factory: Callable[..., pb.Batch],
) -> None:
    requests = [request_factory(i, [5, 6, 7 + i], 3 + i) for i in range(3)]
    prefill = await stub.Prefill(pb.PrefillRequest(batch=batch_factory(1, *requests)))
    assert [g.request_id for g in prefill.generations] == [0, 1, 2]
    assert list(prefill.batch.request_ids) == [0, 1, 2] and prefill.forward_ns > 0
    filtered = await stub.FilterBatch(pb.FilterBatchRequest(batch_id=1, request_ids=[0, 2]))
    assert list(filtered.batch.request_ids) == [0, 2]
    decode = await stub.Decode(pb.DecodeRequest(batches=[filtered.batch]))
    assert [g.request_id for g in decode.generations] == [0, 2]
    decode = await stub.Decode(pb.DecodeRequest(batches=[decode.batch]))
    finished = [g for g in decode.generations if g.HasField("generated_text")]
    assert [g.request_id for g in finished] == [0]
    assert finished[0].generated_text.finish_reason == pb.FINISH_REASON_LENGTH
    assert list(decode.batch.request_ids) == [2]
    await stub.ClearCache(pb.ClearCacheRequest())
    with pytest.raises(grpc.aio.AioRpcError) as error:
        await stub.Decode(pb.DecodeRequest(batches=[decode.batch]))
    assert error.value.code() == grpc.StatusCode.NOT_FOUND


async def test_model_errors_become_internal_status(
    stub: pb_grpc.TextGenerationServiceStub,
    request_factory: Callable[..., pb.Request],
    batch_factory: Callable[..., pb.Batch],
) -> None:
    bad = request_factory(9, [5, 10_000_000], 2)  # token id beyond the vocabulary
    with pytest.raises(grpc.aio.AioRpcError) as error:
        await stub.Prefill(pb.PrefillRequest(batch=batch_factory(2, bad)))
    assert error.value.code() == grpc.StatusCode.INTERNAL
    ok = await stub.Prefill(pb.PrefillRequest(batch=batch_factory(3, request_factory(1, [5], 1))))
    assert ok.generations[0].HasField("generated_text")
