"""The shard's async gRPC server: generate.proto over one `ShardModel`.

The servicer holds no model state: it runs each call in the model thread (one at a
time), times the step calls, and maps the model's exceptions to gRPC statuses:
`UnsupportedCall` / `InvalidCall` -> INVALID_ARGUMENT, `BatchNotFound` -> NOT_FOUND,
anything else -> INTERNAL with the exception's message.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Protocol, TypeVar

import grpc
import torch

from textgate.proto import generate_pb2 as pb
from textgate.proto import generate_pb2_grpc as pb_grpc
from textgate.shard_server import tracing
from textgate.shard_server.protocols.shard_model import BatchNotFound, InvalidCall, ShardModel

log = logging.getLogger("textgate.shard")


class _Timed(Protocol):
    total_ns: int


T = TypeVar("T")
R = TypeVar("R", bound=_Timed)


class ShardServicer(pb_grpc.TextGenerationServiceServicer):
    """Implements generate.proto by forwarding every call to `model`."""

    def __init__(
        self, model: ShardModel, urls: list[str], executor: ThreadPoolExecutor | None = None
    ) -> None:
        self.model = model
        self.urls = urls
        # Model calls run one at a time in one thread, so the event loop keeps answering
        # Health while a step computes. That thread should be the one that loaded the
        # model (see `model_thread`).
        self._executor = executor or model_thread()
        self._lock = asyncio.Lock()

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
        batch_id = request.id if request.HasField("id") else None
        await self._call(context, self.model.clear, batch_id)
        return pb.ClearCacheResponse()

    async def FilterBatch(
        self, request: pb.FilterBatchRequest, context: Any
    ) -> pb.FilterBatchResponse:
        ids = list(request.request_ids)
        batch = await self._call(context, self.model.filter, request.batch_id, ids)
        return pb.FilterBatchResponse(batch=batch)

    async def Warmup(self, request: pb.WarmupRequest, context: Any) -> pb.WarmupResponse:
        return await self._call(context, self.model.warmup, request)

    async def Prefill(self, request: pb.PrefillRequest, context: Any) -> pb.PrefillResponse:
        return await self._timed(context, self.model.prefill, request.batch)

    async def Decode(self, request: pb.DecodeRequest, context: Any) -> pb.DecodeResponse:
        return await self._timed(context, self.model.decode, list(request.batches))

    async def Step(self, request: pb.StepRequest, context: Any) -> pb.StepResponse:
        return await self._timed(context, self.model.step, list(request.requests), request.plan)

    async def _timed(self, context: Any, call: Callable[..., R], *args: Any) -> R:
        """`_call`, with the call's whole time in the shard (lock wait included) as total_ns."""
        start = time.perf_counter_ns()
        with tracing.rpc_span(context, call.__name__) as span:  # None unless --otlp-endpoint
            response = await self._call(context, call, *args)
            response.total_ns = time.perf_counter_ns() - start
            tracing.record_phases(span, response, len(response.generations))
        return response

    async def _call(self, context: Any, call: Callable[..., T], *args: Any) -> T:
        """Run `call` in the model thread, one at a time; its exceptions become statuses."""
        try:
            async with self._lock:
                return await asyncio.get_running_loop().run_in_executor(self._executor, call, *args)
        except InvalidCall as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except BatchNotFound as exc:
            await context.abort(grpc.StatusCode.NOT_FOUND, str(exc))
        except Exception as exc:
            log.exception("model call failed")
            await context.abort(grpc.StatusCode.INTERNAL, f"{type(exc).__name__}: {exc}")
        raise AssertionError("context.abort returned")  # it raises; this tells type checkers


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
    model: ShardModel,
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
