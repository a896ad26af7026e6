"""Shard spans: the router's step context crosses the gRPC hop into the real servicer."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind

from textgate.proto import generate_pb2 as pb
from textgate.router import tracing as router_tracing
from textgate.router.shard_client import ShardClient
from textgate.shard_server import tracing as shard_tracing
from textgate.shard_server.loading.shard_loader import load_model
from textgate.shard_server.protocols.paged_model import CacheConfig
from textgate.shard_server.server import serve

BLOCK = 4


@pytest.fixture
def exporter() -> Iterator[InMemorySpanExporter]:
    """Router and shard both trace into one in-memory exporter (two processes in real life)."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    router_tracing.install(provider)
    shard_tracing.install(provider)
    yield exporter
    router_tracing.install(None)
    shard_tracing.install(None)


async def test_shard_spans_are_children_of_the_routers_step(
    tiny_model_dir: Path,
    tmp_path: Path,
    exporter: InMemorySpanExporter,
    request_factory: Callable[..., pb.Request],
) -> None:
    model = load_model(tiny_model_dir, "tiny", "float32", cache_config=CacheConfig(BLOCK))
    uds = str(tmp_path / "s")
    server = asyncio.create_task(serve(model, uds, rank=0, world_size=1))
    client = ShardClient(f"unix://{uds}-0")
    try:
        await client.wait_ready(10)
        await client.warmup(pb.WarmupRequest(max_prefill_tokens=16))
        assert exporter.get_finished_spans() == (), "Warmup is not a traced step"
        prompt = [5, 6, 7]
        plan = pb.StepPlan(
            scheduled=[
                pb.ScheduledRequest(
                    request_id=1,
                    token_ids=prompt,
                    start_position=0,
                    block_table=[0, 1],
                    produces_token=True,
                )
            ]
        )
        with router_tracing.step_span("prefill", []):
            response = await client.step([request_factory(1, prompt, 3)], plan)
    finally:
        await client.close()
        server.cancel()
        await asyncio.gather(server, return_exceptions=True)
    assert len(response.generations) == 1

    spans = {s.name: s for s in exporter.get_finished_spans()}
    assert set(spans) == {"prefill", "shard step", "forward", "decode"}
    step, rpc = spans["prefill"], spans["shard step"]
    assert rpc.kind is SpanKind.SERVER
    assert rpc.context.trace_id == step.context.trace_id
    assert rpc.parent is not None and rpc.parent.span_id == step.context.span_id
    assert rpc.parent.is_remote, "the parent came over gRPC metadata"
    attributes = dict(rpc.attributes or {})
    assert attributes["textgate.num_generations"] == 1
    assert attributes["textgate.forward_ns"] == response.forward_ns > 0
    forward, decode = spans["forward"], spans["decode"]
    for phase in (forward, decode):
        assert phase.parent is not None and phase.parent.span_id == rpc.context.span_id
    # The phases carry the durations the model measured, back to back, inside the call.
    assert forward.end_time - forward.start_time == response.forward_ns
    assert decode.end_time - decode.start_time == response.decode_ns
    assert forward.end_time == decode.start_time
    assert rpc.start_time <= forward.start_time and decode.end_time <= rpc.end_time
    assert step.start_time <= rpc.start_time and rpc.end_time <= step.end_time


async def test_without_tracing_the_servicer_makes_no_spans(
    tiny_model_dir: Path, tmp_path: Path, request_factory: Callable[..., pb.Request]
) -> None:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    # The router traces, the shard does not: the shard ignores the context it is sent.
    router_tracing.install(provider)
    try:
        model = load_model(tiny_model_dir, "tiny", "float32", cache_config=CacheConfig(BLOCK))
        uds = str(tmp_path / "s")
        server = asyncio.create_task(serve(model, uds, rank=0, world_size=1))
        client = ShardClient(f"unix://{uds}-0")
        try:
            await client.wait_ready(10)
            await client.warmup(pb.WarmupRequest(max_prefill_tokens=16))
            plan = pb.StepPlan(
                scheduled=[
                    pb.ScheduledRequest(
                        request_id=1, token_ids=[5], block_table=[0], produces_token=True
                    )
                ]
            )
            with router_tracing.step_span("prefill", []):
                await client.step([request_factory(1, [5], 2)], plan)
        finally:
            await client.close()
            server.cancel()
            await asyncio.gather(server, return_exceptions=True)
    finally:
        router_tracing.install(None)
    assert [s.name for s in exporter.get_finished_spans()] == ["prefill"]
