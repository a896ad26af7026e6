"""The shard's async gRPC server: generate.proto over one `PagedModel`.

The servicer holds no model state: it runs each call in the model thread (one at a
time), times the steps, and answers a model's exception INTERNAL with its message (a LoRA
adapter that cannot be loaded or unloaded: INVALID_ARGUMENT).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

import grpc
import torch

from textgate.proto import generate_pb2 as pb
from textgate.proto import generate_pb2_grpc as pb_grpc
from textgate.shard_server import tracing
from textgate.shard_server.layers.lora_adapter import LoraError
from textgate.shard_server.protocols.paged_model import PagedModel

log = logging.getLogger("textgate.shard")


T = TypeVar("T")


class ShardServicer(pb_grpc.TextGenerationServiceServicer):
    """Implements generate.proto by forwarding every call to `model`."""

    def __init__(
        self, model: PagedModel, urls: list[str], executor: ThreadPoolExecutor | None = None
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
        await self._call(context, self.model.clear)
        return pb.ClearCacheResponse()

    async def Warmup(self, request: pb.WarmupRequest, context: Any) -> pb.WarmupResponse:
        return await self._call(context, self.model.warmup, request)

    async def Step(self, request: pb.StepRequest, context: Any) -> pb.StepResponse:
        """The step, with its whole time in the shard (lock wait included) as total_ns."""
        start = time.perf_counter_ns()
        with tracing.rpc_span(context, "step") as span:  # None unless --otlp-endpoint
            step = self.model.step
            response = await self._call(context, step, list(request.requests), request.plan)
            response.total_ns = time.perf_counter_ns() - start
            tracing.record_phases(span, response, len(response.generations))
        return response

    async def LoadAdapter(
        self, request: pb.LoadAdapterRequest, context: Any
    ) -> pb.LoadAdapterResponse:
        """Read and check the folder while steps go on; keep it between two of them (a
        step's residency attaches it)."""
        lora = self.model.lora
        try:
            read = await asyncio.to_thread(lora.read, request.adapter_id, Path(request.path))
        except LoraError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except Exception as exc:  # an unreadable folder (bad JSON, a truncated file) is its own
            message = f"LoRA adapter {request.adapter_id!r}: {type(exc).__name__}: {exc}"
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, message)
        await self._call(context, lora.add, read, invalid=LoraError)
        adapter = read.adapter
        log.info(
            "LoRA adapter %r loaded from %s: rank %d, %d projections updated (host copy; "
            "resident when a request needs it)",
            adapter.name,
            request.path,
            adapter.rank,
            len(adapter.modules),
        )
        return pb.LoadAdapterResponse(rank=adapter.rank, num_updates=len(adapter.modules))

    async def UnloadAdapter(
        self, request: pb.UnloadAdapterRequest, context: Any
    ) -> pb.UnloadAdapterResponse:
        await self._call(context, self.model.lora.unload, request.adapter_id, invalid=LoraError)
        log.info("LoRA adapter %r unloaded", request.adapter_id)
        return pb.UnloadAdapterResponse()

    async def _call(
        self,
        context: Any,
        call: Callable[..., T],
        *args: Any,
        invalid: type[Exception] | None = None,
    ) -> T:
        """Run `call` in the model thread, one at a time; its exceptions become statuses
        (`invalid`: the call's own refusals, INVALID_ARGUMENT with their message)."""
        try:
            async with self._lock:
                return await asyncio.get_running_loop().run_in_executor(self._executor, call, *args)
        except Exception as exc:
            if invalid is not None and isinstance(exc, invalid):
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
            log.exception("model call failed")
            await context.abort(grpc.StatusCode.INTERNAL, f"{type(exc).__name__}: {exc}")
        raise AssertionError("context.abort returned")  # it raises; this tells type checkers


def gather_urls(own: str, world_size: int) -> list[str]:
    """Every rank's address (`own` is this rank's), gathered over the process group: the
    list ServiceDiscovery answers, so the router finds the ranks of other nodes. Collective:
    every rank calls it once, after loading, in the model thread."""
    if world_size == 1:
        return [own]
    import torch.distributed as dist

    urls: list[Any] = [None] * world_size
    dist.all_gather_object(urls, own)
    return [str(url) for url in urls]


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
    model: PagedModel,
    uds_path: str,
    rank: int,
    world_size: int,
    executor: ThreadPoolExecutor | None = None,
    *,
    tcp_port: int = 0,
    urls: Sequence[str] | None = None,
) -> None:
    """Serve `model` on unix://{uds_path}-{rank} (and on TCP port `tcp_port` of every
    interface, unless 0) until cancelled or SIGTERM.

    `urls` are every rank's address as the router dials it, what ServiceDiscovery answers
    (`gather_urls`); unset: each rank's unix socket, one node's ranks.
    """
    uds_url = f"unix://{uds_path}-{rank}"
    urls = list(urls) if urls is not None else [f"unix://{uds_path}-{r}" for r in range(world_size)]
    server = grpc.aio.server(
        options=[
            ("grpc.max_send_message_length", 256 * 1024 * 1024),
            ("grpc.max_receive_message_length", 256 * 1024 * 1024),
        ]
    )
    pb_grpc.add_TextGenerationServiceServicer_to_server(
        ShardServicer(model, urls, executor), server
    )
    listening = [uds_url]
    server.add_insecure_port(uds_url)
    if tcp_port:
        # [::] takes IPv4 too where the host has IPv6 (gRPC falls back to 0.0.0.0 without).
        server.add_insecure_port(f"[::]:{tcp_port}")
        listening.append(f"TCP port {tcp_port}")
    await server.start()
    log.info("Shard %d ready on %s", rank, " and ".join(listening))
    try:
        await server.wait_for_termination()
    finally:
        await server.stop(grace=1)
