"""gRPC clients for the model shards: `ShardClient` for one socket, `ShardedClient` for all.

Every shard gets the same call (tensor-parallel ranks step together) and rank 0's
answer is the one used. Failures surface as `ShardError` carrying the shard's message.
Shards step with `step` (see proto/generate.proto). While tracing is on,
every call carries the current span's W3C `traceparent` in its gRPC metadata, so the
shards' spans join the router's step (router/tracing.py).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar

import grpc

from textgate.proto import generate_pb2 as pb
from textgate.proto import generate_pb2_grpc as pb_grpc
from textgate.router.tracing import grpc_metadata

T = TypeVar("T")

_CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", 256 * 1024 * 1024),
    ("grpc.max_receive_message_length", 256 * 1024 * 1024),
]


class ShardError(Exception):
    """A shard call failed; the message is the shard's (or the transport's).

    `code` is the call's gRPC status (None: the shard was not reached); `details`, the
    shard's own words."""

    def __init__(
        self, message: str, code: grpc.StatusCode | None = None, details: str = ""
    ) -> None:
        super().__init__(message)
        self.code = code
        self.details = details or message


def shard_url(uds_path: str, rank: int) -> str:
    """The gRPC address of shard `rank` (the launcher's naming)."""
    return f"unix://{uds_path}-{rank}"


class ShardClient:
    """One shard over one unix socket."""

    def __init__(self, url: str) -> None:
        self.url = url
        self._channel = grpc.aio.insecure_channel(url, options=_CHANNEL_OPTIONS)
        self._stub = pb_grpc.TextGenerationServiceStub(self._channel)

    async def wait_ready(self, timeout_s: float) -> None:
        """Wait until the socket accepts connections."""
        try:
            await asyncio.wait_for(self._channel.channel_ready(), timeout_s)
        except asyncio.TimeoutError as exc:
            raise ShardError(f"shard {self.url} not reachable after {timeout_s:.0f}s") from exc

    async def close(self) -> None:
        await self._channel.close()

    async def info(self) -> pb.InfoResponse:
        return await self._call(self._stub.Info, pb.InfoRequest())

    async def health(self, timeout_s: float | None = None) -> None:
        await self._call(self._stub.Health, pb.HealthRequest(), timeout_s)

    async def service_discovery(self) -> list[str]:
        response = await self._call(self._stub.ServiceDiscovery, pb.ServiceDiscoveryRequest())
        return list(response.urls)

    async def clear_cache(self) -> None:
        await self._call(self._stub.ClearCache, pb.ClearCacheRequest())

    async def warmup(self, request: pb.WarmupRequest) -> pb.WarmupResponse:
        """Run the warmup step; the answer carries the KV capacity (tokens, blocks)."""
        return await self._call(self._stub.Warmup, request)

    async def step(self, requests: Sequence[pb.Request], plan: pb.StepPlan) -> pb.StepResponse:
        """Run one planned step; `requests` are those it schedules first."""
        request = pb.StepRequest(requests=list(requests), plan=plan)
        return await self._call(self._stub.Step, request)

    async def load_adapter(self, adapter_id: str, path: str) -> pb.LoadAdapterResponse:
        """Load the PEFT folder `path` as LoRA adapter `adapter_id` (between two steps)."""
        request = pb.LoadAdapterRequest(adapter_id=adapter_id, path=path)
        return await self._call(self._stub.LoadAdapter, request)

    async def unload_adapter(self, adapter_id: str) -> None:
        await self._call(self._stub.UnloadAdapter, pb.UnloadAdapterRequest(adapter_id=adapter_id))

    async def _call(self, method: Any, request: Any, timeout_s: float | None = None) -> Any:
        try:
            return await method(request, timeout=timeout_s, metadata=grpc_metadata())
        except grpc.aio.AioRpcError as exc:
            details = exc.details() or exc.code().name
            raise ShardError(f"Server error: {details}", exc.code(), details) from exc


class ShardedClient:
    """All shards of one model; each call goes to every shard, rank 0 answers."""

    def __init__(self, clients: Sequence[ShardClient]) -> None:
        if not clients:
            raise ValueError("ShardedClient needs at least one shard")
        self.clients = list(clients)

    @classmethod
    async def connect(cls, uds_path: str, timeout_s: float = 60.0) -> ShardedClient:
        """Dial rank 0 at unix://{uds_path}-0, then every shard it lists."""
        master = ShardClient(shard_url(uds_path, 0))
        try:
            await master.wait_ready(timeout_s)
            urls = await master.service_discovery() or [master.url]
        except BaseException:
            await master.close()
            raise
        clients = [master] + [ShardClient(url) for url in urls if url != master.url]
        sharded = cls(clients)
        try:
            await asyncio.gather(*(c.wait_ready(timeout_s) for c in clients[1:]))
        except BaseException:
            await sharded.close()
            raise
        return sharded

    async def close(self) -> None:
        await asyncio.gather(*(c.close() for c in self.clients))

    async def info(self) -> pb.InfoResponse:
        return await self._all(lambda c: c.info())

    async def health(self, timeout_s: float | None = None) -> None:
        await self._all(lambda c: c.health(timeout_s))

    async def clear_cache(self) -> None:
        await self._all(lambda c: c.clear_cache())

    async def warmup(self, request: pb.WarmupRequest) -> pb.WarmupResponse:
        return await self._all(lambda c: c.warmup(request))

    async def step(self, requests: Sequence[pb.Request], plan: pb.StepPlan) -> pb.StepResponse:
        return await self._all(lambda c: c.step(requests, plan))

    async def load_adapter(self, adapter_id: str, path: str) -> pb.LoadAdapterResponse:
        return await self._all(lambda c: c.load_adapter(adapter_id, path))

    async def unload_adapter(self, adapter_id: str) -> None:
        await self._all(lambda c: c.unload_adapter(adapter_id))

    async def _all(self, call: Callable[[ShardClient], Awaitable[T]]) -> T:
        results = await asyncio.gather(*(call(c) for c in self.clients))
        return results[0]
