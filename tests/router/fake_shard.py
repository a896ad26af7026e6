"""A fake model shard: the real gRPC service on a unix socket, a deterministic toy model.

The toy model (fake_model.py) emits token id = previous id + 1. Like a real shard, Info
reports `block_size`, Warmup `num_blocks`, and Step runs a StepPlan, emitting a token for
every scheduled request with `produces_token`; the plan is checked against what the
shard knows (fake_model.plan_error). Tests use it to drive the router without torch:

    async with fake_shards(tmp_path / "s", world_size=2) as shards:
        shards[0].step_delay_s = 0.01
        client = await ShardedClient.connect(str(tmp_path / "s"))
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import grpc

from textgate.proto import generate_pb2 as pb
from textgate.proto import generate_pb2_grpc as pb_grpc
from textgate.tests.router.fake_model import (
    EOS_TEXT,
    EOS_TOKEN_ID,
    VOCAB_SIZE,
    FakeSequence,
    FakeTokenizer,
    next_generation,
    plan_error,
)

__all__ = ["EOS_TEXT", "EOS_TOKEN_ID", "VOCAB_SIZE", "FakeShard", "FakeTokenizer", "fake_shards"]


class FakeShard(pb_grpc.TextGenerationServiceServicer):
    """The servicer; tweak its attributes to change the model or inject failures."""

    def __init__(self, urls: list[str]) -> None:
        self.urls = urls
        self.sequences: dict[int, FakeSequence] = {}
        """The requests the shard knows, by id."""
        self.adapters: dict[int, str] = {}
        """Each request's LoRA adapter, by id."""
        self.calls: list[tuple[str, Any]] = []
        """(method, request) of every call, in order."""
        self.step_delay_s = 0.0
        """Sleep in every Step, so requests can arrive mid-generation."""
        self.eos_after: int | None = None
        """Emit the EOS token after this many ordinary tokens."""
        self.fail: dict[str, int] = {}
        """Method name -> number of upcoming calls that fail with INTERNAL."""
        self.fail_on_inputs: str | None = None
        """A step that brings a request with these `inputs` fails with INTERNAL (a request
        the model chokes on): every time, until reset."""
        self.hang: dict[str, int] = {}
        """Method name -> number of upcoming calls that never answer (a hung shard)."""
        self.lora_adapters: list[str] = []
        """The adapters Info reports (the fake model ignores them when generating);
        LoadAdapter adds to them (any existing folder loads), UnloadAdapter takes away."""
        self.max_loras = 0
        """Info's --max-loras; above 0 the shard holds a residency (`resident`) as a step's
        StepPlan.lora_residency sets it, and a step that runs a request on an adapter not
        resident fails."""
        self.resident: list[str] = []
        """The adapters resident (the router's last StepPlan.lora_residency)."""
        self.healthy = True
        self.block_size = 16
        """Tokens per KV block, as Info reports."""
        self.num_blocks = 4096
        """KV blocks Warmup reports (and num_blocks * block_size tokens)."""
        self.warmup_measurements: pb.WarmupResponse | None = None
        """The measured step (decode timings, prefill rate, dtype) Warmup adds to
        its answer; None = it measured nothing, so the router keeps its static defaults."""

    def calls_to(self, method: str) -> list[Any]:
        return [request for name, request in self.calls if name == method]

    def received_requests(self) -> list[pb.Request]:
        """Every request the router sent to be generated, in order."""
        return [request for call in self.calls_to("Step") for request in call.requests]

    def held_request_ids(self) -> set[int]:
        """Ids of the requests the shard holds state for."""
        return set(self.sequences)

    async def _enter(self, method: str, request: Any, context: Any) -> None:
        """Record the call, inject a planned failure or hang."""
        self.calls.append((method, request))
        if self.fail.get(method, 0) > 0:
            self.fail[method] -= 1
            await context.abort(grpc.StatusCode.INTERNAL, f"fake {method} failure")
        if self.hang.get(method, 0) > 0:
            self.hang[method] -= 1
            await asyncio.Event().wait()  # until the router gives up and cancels the call
        if method == "Step":
            if any(r.inputs == self.fail_on_inputs for r in request.requests):
                await context.abort(
                    grpc.StatusCode.INTERNAL, f"fake failure on {self.fail_on_inputs!r}"
                )
            await asyncio.sleep(self.step_delay_s)

    async def Info(self, request: pb.InfoRequest, context: Any) -> pb.InfoResponse:
        await self._enter("Info", request, context)
        return pb.InfoResponse(
            requires_padding=False,
            block_size=self.block_size,
            dtype="float32",
            device_type="cpu",
            max_position_embeddings=4096,
            model_id="fake",
            model_type="fake",
            world_size=len(self.urls),
            lora_adapters=self.lora_adapters,
            max_loras=self.max_loras,
            resident_lora_adapters=self.resident,
        )

    async def Health(self, request: pb.HealthRequest, context: Any) -> pb.HealthResponse:
        await self._enter("Health", request, context)
        if not self.healthy:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "fake shard is unhealthy")
        return pb.HealthResponse()

    async def ServiceDiscovery(
        self, request: pb.ServiceDiscoveryRequest, context: Any
    ) -> pb.ServiceDiscoveryResponse:
        await self._enter("ServiceDiscovery", request, context)
        return pb.ServiceDiscoveryResponse(urls=self.urls)

    async def ClearCache(
        self, request: pb.ClearCacheRequest, context: Any
    ) -> pb.ClearCacheResponse:
        await self._enter("ClearCache", request, context)
        self.sequences.clear()
        return pb.ClearCacheResponse()

    async def Warmup(self, request: pb.WarmupRequest, context: Any) -> pb.WarmupResponse:
        await self._enter("Warmup", request, context)
        self.sequences.clear()
        response = pb.WarmupResponse(
            max_supported_total_tokens=self.num_blocks * self.block_size,
            num_blocks=self.num_blocks,
        )
        if self.warmup_measurements is not None:
            response.MergeFrom(self.warmup_measurements)
        return response

    async def Step(self, request: pb.StepRequest, context: Any) -> pb.StepResponse:
        await self._enter("Step", request, context)
        plan = request.plan
        for request_id in plan.finished_ids:
            self.sequences.pop(request_id, None)
        if plan.HasField("lora_residency"):
            resident = [a for a in plan.lora_residency.adapter_ids if a in self.lora_adapters]
            if len(resident) > self.max_loras:
                await context.abort(grpc.StatusCode.INTERNAL, f"over max_loras: {resident}")
            self.resident = resident
        self.adapters.update({new.id: new.adapter_id for new in request.requests})
        for new in request.requests:
            self.sequences[new.id] = FakeSequence.from_pb(new)
        if self.max_loras:
            for item in plan.scheduled:
                adapter = self.adapters.get(item.request_id, "")
                if adapter and adapter not in self.resident:
                    message = f"request {item.request_id} runs on {adapter!r}, not resident"
                    await context.abort(grpc.StatusCode.INTERNAL, message)
        for item in plan.scheduled:
            seq = self.sequences.get(item.request_id)
            error = (
                f"request {item.request_id} is not known to this shard"
                if seq is None
                else plan_error(seq, item, self.block_size)
            )
            if error is not None:
                await context.abort(grpc.StatusCode.INTERNAL, error)
        generations = []
        for item in plan.scheduled:
            if item.produces_token:
                generation = next_generation(self.sequences[item.request_id], self.eos_after)
                generations.append(generation)
                if generation.HasField("generated_text"):
                    del self.sequences[item.request_id]
        return pb.StepResponse(generations=generations)

    async def LoadAdapter(
        self, request: pb.LoadAdapterRequest, context: Any
    ) -> pb.LoadAdapterResponse:
        await self._enter("LoadAdapter", request, context)
        name = request.adapter_id
        if name in self.lora_adapters:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"{name!r} is already loaded")
        if not Path(request.path).is_dir():
            message = f"LoRA adapter {name!r}: {request.path} has no adapter_config.json"
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, message)
        self.lora_adapters.append(name)
        return pb.LoadAdapterResponse(rank=8, num_updates=1)

    async def UnloadAdapter(
        self, request: pb.UnloadAdapterRequest, context: Any
    ) -> pb.UnloadAdapterResponse:
        await self._enter("UnloadAdapter", request, context)
        if request.adapter_id not in self.lora_adapters:
            message = f"LoRA adapter {request.adapter_id!r} is not loaded"
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, message)
        self.lora_adapters.remove(request.adapter_id)
        if request.adapter_id in self.resident:
            self.resident.remove(request.adapter_id)
        return pb.UnloadAdapterResponse()


@asynccontextmanager
async def fake_shards(uds_path: str, world_size: int = 1) -> AsyncIterator[list[FakeShard]]:
    """Serve `world_size` fake shards on unix://{uds_path}-{rank}; yields their servicers."""
    urls = [f"unix://{uds_path}-{rank}" for rank in range(world_size)]
    servers = []
    shards = []
    try:
        for url in urls:
            shard = FakeShard(urls)
            server = grpc.aio.server()
            pb_grpc.add_TextGenerationServiceServicer_to_server(shard, server)
            server.add_insecure_port(url)
            await server.start()
            servers.append(server)
            shards.append(shard)
        yield shards
    finally:
        await asyncio.gather(*(server.stop(grace=None) for server in servers))
