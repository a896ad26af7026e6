"""The shard's async gRPC server: a cache of batches and the model that steps them."""

from __future__ import annotations

import asyncio
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import grpc
import torch

from textgate.proto import generate_pb2 as pb
from textgate.proto import generate_pb2_grpc as pb_grpc
from textgate.shard_server.model import Model, StepOutput
from textgate.shard_server.paged_model import PagedModel

log = logging.getLogger("textgate.shard")
T = TypeVar("T")


class ShardServicer(pb_grpc.TextGenerationServiceServicer):
    """Implements generate.proto over one model; batches live in `cache` between calls."""

    def __init__(
        self,
        model: Model[Any] | PagedModel,
        urls: list[str],
        executor: ThreadPoolExecutor | None = None,
    ) -> None:
        self.model = model
        self.urls = urls
        self.cache: dict[int, Any] = {}
        # Model calls run one at a time in one thread, so the event loop keeps answering
        # Health and FilterBatch while a step computes. That thread should be the one
        # that loaded the model (see `model_thread`).
        self._executor = executor or model_thread()
        self._lock = asyncio.Lock()

    async def _run(self, fn: Any, *args: Any) -> Any:
        async with self._lock:
            return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    async def Info(self, request: pb.InfoRequest, context: Any) -> pb.InfoResponse:
        return self.model.describe()

    async def Health(self, request: pb.HealthRequest, context: Any) -> pb.HealthResponse:
        return pb.HealthResponse()

    async def ServiceDiscovery(
        self, request: pb.ServiceDiscoveryRequest, context: Any
    ) -> pb.ServiceDiscoveryResponse:
        return pb.ServiceDiscoveryResponse(urls=self.urls)

    async def ClearCache(
        self, request: pb.ClearCacheRequest, context: Any
    ) -> pb.ClearCacheResponse:
        if request.HasField("id"):
            self.cache.pop(request.id, None)
        else:
            self.cache.clear()
            if isinstance(self.model, PagedModel):
                await self._run(self.model.reset)
        return pb.ClearCacheResponse()

    async def FilterBatch(
        self, request: pb.FilterBatchRequest, context: Any
    ) -> pb.FilterBatchResponse:
        await self._padded(context)
        batch = await self._pop(request.batch_id, context)
        kept = await self._run(batch.filter, list(request.request_ids))
        if kept is None:
            return pb.FilterBatchResponse(batch=pb.CachedBatch(id=request.batch_id))
        self.cache[kept.batch_id] = kept
        return pb.FilterBatchResponse(batch=kept.to_pb())

    async def Warmup(self, request: pb.WarmupRequest, context: Any) -> pb.WarmupResponse:
        self.cache.clear()
        response: pb.WarmupResponse = await self._guard(
            context, self._run(self.model.warmup, request)
        )
        return response

    async def Prefill(self, request: pb.PrefillRequest, context: Any) -> pb.PrefillResponse:
        start = time.perf_counter_ns()
        if request.HasField("plan"):
            out = await self._paged_step(context, list(request.batch.requests), request.plan)
        else:
            model = await self._padded(context)
            batch = await self._guard(context, self._run(model.batch_from_pb, request.batch))
            out = await self._guard(context, self._run(model.generate_token, batch))
        response = pb.PrefillResponse(
            generations=out.generations, forward_ns=out.forward_ns, decode_ns=out.decode_ns
        )
        self._keep(out, response)
        response.total_ns = time.perf_counter_ns() - start
        return response

    async def Decode(self, request: pb.DecodeRequest, context: Any) -> pb.DecodeResponse:
        start = time.perf_counter_ns()
        if request.HasField("plan"):
            out = await self._paged_step(context, [], request.plan)
            concat_ns = 0
        else:
            model = await self._padded(context)
            batches = [await self._pop(b.id, context) for b in request.batches]
            if not batches:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "Decode needs a batch")
            merged = await self._guard(context, self._run(model.concatenate, batches))
            concat_ns = time.perf_counter_ns() - start
            out = await self._guard(context, self._run(model.generate_token, merged))
        response = pb.DecodeResponse(
            generations=out.generations,
            forward_ns=out.forward_ns,
            decode_ns=out.decode_ns,
            concat_ns=concat_ns,
        )
        self._keep(out, response)
        response.total_ns = time.perf_counter_ns() - start
        return response

    async def _paged_step(
        self, context: Any, requests: list[pb.Request], plan: pb.StepPlan
    ) -> StepOutput[Any]:
        if not isinstance(self.model, PagedModel):
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT, "this shard is not paged: send batches, no plan"
            )
        assert isinstance(self.model, PagedModel)
        out: StepOutput[Any] = await self._guard(
            context, self._run(self.model.step, requests, plan)
        )
        return out

    async def _padded(self, context: Any) -> Model[Any]:
        if isinstance(self.model, PagedModel):
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT, "this shard is paged: every step needs a plan"
            )
        assert not isinstance(self.model, PagedModel)
        return self.model

    def _keep(self, out: StepOutput[Any], response: Any) -> None:
        if out.batch is not None:
            self.cache[out.batch.batch_id] = out.batch
            response.batch.CopyFrom(out.batch.to_pb())

    async def _pop(self, batch_id: int, context: Any) -> Any:
        batch = self.cache.pop(batch_id, None)
        if batch is None:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"batch {batch_id} not found")
        return batch

    async def _guard(self, context: Any, awaitable: Any) -> Any:
        """Turn a model exception into an INTERNAL status carrying its message."""
        try:
            return await awaitable
        except Exception as exc:
            log.exception("model call failed")
            await context.abort(grpc.StatusCode.INTERNAL, f"{type(exc).__name__}: {exc}")


def model_thread() -> ThreadPoolExecutor:
    """The single thread all of a shard's torch work runs in, loading included.

    With OpenMP, a thread's parallel team is its own: once the main thread has run
    parallel ops, the same ops issued from another thread ran ~1.5x slower here (2 cores).
    Loading, warmup and every step therefore share one thread.
    """
    return ThreadPoolExecutor(
        max_workers=1,
        thread_name_prefix="model",
        initializer=torch.set_grad_enabled,
        initargs=(False,),
    )


async def serve(
    model: Model[Any] | PagedModel,
    uds_path: str,
    rank: int,
    world_size: int,
    executor: ThreadPoolExecutor | None = None,
) -> None:
    """Serve `model` on unix://{uds_path}-{rank} until cancelled or SIGTERM."""
    urls = [f"unix://{uds_path}-{r}" for r in range(world_size)]
    server = grpc.aio.server(
        options=[
            ("grpc.max_send_message_length", 256 * 1024 * 1024),
            ("grpc.max_receive_message_length", 256 * 1024 * 1024),
        ]
    )
    pb_grpc.add_TextGenerationServiceServicer_to_server(
        ShardServicer(model, urls, executor), server
    )
    server.add_insecure_port(urls[rank])
    await server.start()
    log.info("Shard %d ready on %s", rank, urls[rank])
    try:
        await server.wait_for_termination()
    finally:
        await server.stop(grace=1)
