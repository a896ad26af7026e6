"""A fake model shard: the real gRPC service on a unix socket, a deterministic toy model.

The toy model (fake_model.py) emits token id = previous id + 1. A fake shard serves
one step protocol of generate.proto, like a real one:

- padded (default): batches live in a cache by id; Prefill caches a new batch, Decode
  merges cached batches and steps them, FilterBatch drops requests.
- paged (`paged=True`): Info reports `block_size`, Warmup `num_blocks`, and Step runs a
  StepPlan, emitting a token for every scheduled request with `produces_token`. The
  plan is checked against what the shard knows (fake_model.plan_error).

The other protocol's calls are answered INVALID_ARGUMENT. Both modes emit the same
tokens, so HTTP tests hold under either engine. Tests reuse it to drive the router
without torch:

    async with fake_shards(tmp_path / "s", world_size=2, paged=True) as shards:
        shards[0].step_delay_s = 0.01
        client = await ShardedClient.connect(str(tmp_path / "s"))
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
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

    def __init__(self, urls: list[str], paged: bool = False) -> None:
        self.urls = urls
        self.paged = paged
        """Serve Step (paged) instead of Prefill / Decode / FilterBatch (padded)."""
        self.cache: dict[int, list[FakeSequence]] = {}
        """Padded: the cached batches by id."""
        self.sequences: dict[int, FakeSequence] = {}
        """Paged: the requests the shard knows, by id."""
        self.calls: list[tuple[str, Any]] = []
        """(method, request) of every call, in order."""
        self.step_delay_s = 0.0
        """Sleep in every Prefill / Decode / Step, so requests can arrive mid-generation."""
        self.eos_after: int | None = None
        """Emit the EOS token after this many ordinary tokens."""
        self.fail: dict[str, int] = {}
        """Method name -> number of upcoming calls that fail with INTERNAL."""
        self.fail_on_inputs: str | None = None
        """A step that brings a request with these `inputs` fails with INTERNAL (a request
        the model chokes on): every time, until reset."""
        self.hang: dict[str, int] = {}
        self.lora_adapters: list[str] = []
        """The adapters Info reports (the fake model ignores them when generating)."""
        """Method name -> number of upcoming calls that never answer (a hung shard)."""
        self.healthy = True
        self.max_supported_total_tokens: int | None = None
        """Padded: what Warmup reports; None leaves the field unset."""
        self.block_size = 16
        """Paged: tokens per KV block, as Info reports (padded shards report 0)."""
        self.num_blocks = 4096
        """Paged: KV blocks Warmup reports (and num_blocks * block_size tokens)."""
        self.warmup_measurements: pb.WarmupResponse | None = None
        """Paged: the measured step (decode timings, prefill rate, dtype) Warmup adds to
        its answer; None = it measured nothing, so the router keeps its static defaults."""

    def calls_to(self, method: str) -> list[Any]:
        return [request for name, request in self.calls if name == method]

    def step_method(self, *, prefill: bool = False) -> str:
        """The RPC a step of this shard's protocol arrives as: Step when paged, else
        Prefill (`prefill`) or Decode; for `fail` and `calls_to` in either mode."""
        if self.paged:
            return "Step"
        return "Prefill" if prefill else "Decode"

    def received_requests(self) -> list[pb.Request]:
        """Every request the router sent to be generated, in order, in either mode."""
        received: list[pb.Request] = []
        for name, call in self.calls:
            if name == "Prefill":
                received += call.batch.requests
            elif name == "Step":
                received += call.requests
        return received

    def held_request_ids(self) -> set[int]:
        """Ids of the requests the shard holds state for (cached batches or sequences)."""
        cached = {s.request.id for batch in self.cache.values() for s in batch}
        return cached | set(self.sequences)

    async def _enter(self, method: str, request: Any, context: Any) -> None:
        """Record the call, inject a planned failure, refuse the other protocol's calls."""
        self.calls.append((method, request))
        if self.fail.get(method, 0) > 0:
            self.fail[method] -= 1
            await context.abort(grpc.StatusCode.INTERNAL, f"fake {method} failure")
        if self.hang.get(method, 0) > 0:
            self.hang[method] -= 1
            await asyncio.Event().wait()  # until the router gives up and cancels the call
        new_requests = request.batch.requests if method == "Prefill" else []
        new_requests = request.requests if method == "Step" else new_requests
        if any(r.inputs == self.fail_on_inputs for r in new_requests):
            await context.abort(
                grpc.StatusCode.INTERNAL, f"fake failure on {self.fail_on_inputs!r}"
            )
        if method in ("Prefill", "Decode", "FilterBatch") and self.paged:
            message = f"this shard is paged (block_size > 0): send Step, not {method}"
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, message)
        if method == "Step" and not self.paged:
            message = "this shard is padded (block_size 0): send Prefill / Decode / FilterBatch"
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"{message}, not Step")
        if method in ("Prefill", "Decode", "Step"):
            await asyncio.sleep(self.step_delay_s)

    async def Info(self, request: pb.InfoRequest, context: Any) -> pb.InfoResponse:
        await self._enter("Info", request, context)
        return pb.InfoResponse(
            requires_padding=False,
            block_size=self.block_size if self.paged else 0,
            dtype="float32",
            device_type="cpu",
            max_position_embeddings=4096,
            model_id="fake",
            model_type="fake",
            world_size=len(self.urls),
            lora_adapters=self.lora_adapters,
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
        if request.HasField("id"):
            self.cache.pop(request.id, None)
        else:
            self.cache.clear()
            self.sequences.clear()
        return pb.ClearCacheResponse()

    async def Warmup(self, request: pb.WarmupRequest, context: Any) -> pb.WarmupResponse:
        await self._enter("Warmup", request, context)
        self.cache.clear()
        self.sequences.clear()
        if self.paged:
            response = pb.WarmupResponse(
                max_supported_total_tokens=self.num_blocks * self.block_size,
                num_blocks=self.num_blocks,
            )
            if self.warmup_measurements is not None:
                response.MergeFrom(self.warmup_measurements)
            return response
        return pb.WarmupResponse(max_supported_total_tokens=self.max_supported_total_tokens)

    # ---- padded protocol ----

    async def FilterBatch(
        self, request: pb.FilterBatchRequest, context: Any
    ) -> pb.FilterBatchResponse:
        await self._enter("FilterBatch", request, context)
        sequences = await self._pop(request.batch_id, context)
        keep = set(request.request_ids)
        sequences = [s for s in sequences if s.request.id in keep]
        self.cache[request.batch_id] = sequences
        return pb.FilterBatchResponse(batch=_cached(request.batch_id, sequences))

    async def Prefill(self, request: pb.PrefillRequest, context: Any) -> pb.PrefillResponse:
        await self._enter("Prefill", request, context)
        sequences = [FakeSequence.from_pb(r) for r in request.batch.requests]
        generations = [next_generation(s, self.eos_after) for s in sequences]
        return self._respond(pb.PrefillResponse, request.batch.id, sequences, generations)

    async def Decode(self, request: pb.DecodeRequest, context: Any) -> pb.DecodeResponse:
        await self._enter("Decode", request, context)
        if not request.batches:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "no batches")
        sequences = []
        for batch in request.batches:
            sequences += await self._pop(batch.id, context)
        generations = [next_generation(s, self.eos_after) for s in sequences]
        return self._respond(pb.DecodeResponse, request.batches[0].id, sequences, generations)

    def _respond(
        self, kind: Any, batch_id: int, sequences: list[FakeSequence], generations: list[Any]
    ) -> Any:
        running = [
            s
            for s, g in zip(sequences, generations, strict=True)
            if not g.HasField("generated_text")
        ]
        response = kind(generations=generations)
        if running:
            self.cache[batch_id] = running
            response.batch.CopyFrom(_cached(batch_id, running))
        return response

    async def _pop(self, batch_id: int, context: Any) -> list[FakeSequence]:
        if batch_id not in self.cache:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"batch {batch_id} not found")
        return self.cache.pop(batch_id)

    # ---- paged protocol ----

    async def Step(self, request: pb.StepRequest, context: Any) -> pb.StepResponse:
        await self._enter("Step", request, context)
        plan = request.plan
        for request_id in plan.finished_ids:
            self.sequences.pop(request_id, None)
        for new in request.requests:
            self.sequences[new.id] = FakeSequence.from_pb(new)
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


def _cached(batch_id: int, sequences: list[FakeSequence]) -> pb.CachedBatch:
    return pb.CachedBatch(
        id=batch_id,
        request_ids=[s.request.id for s in sequences],
        size=len(sequences),
        max_tokens=sum(
            len(s.request.input_ids) + s.request.stopping_parameters.max_new_tokens
            for s in sequences
        ),
    )


@asynccontextmanager
async def fake_shards(
    uds_path: str, world_size: int = 1, *, paged: bool = False
) -> AsyncIterator[list[FakeShard]]:
    """Serve `world_size` fake shards on unix://{uds_path}-{rank}; yields their servicers.

    `paged` picks the step protocol they serve (each shard's `paged` can change later).
    """
    urls = [f"unix://{uds_path}-{rank}" for rank in range(world_size)]
    servers = []
    shards = []
    try:
        for url in urls:
            shard = FakeShard(urls, paged=paged)
            server = grpc.aio.server()
            pb_grpc.add_TextGenerationServiceServicer_to_server(shard, server)
            server.add_insecure_port(url)
            await server.start()
            servers.append(server)
            shards.append(shard)
        yield shards
    finally:
        await asyncio.gather(*(server.stop(grace=None) for server in servers))
