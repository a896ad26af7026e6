"""The HTTP app: TGI's routes over the validator, the batcher and the shards."""

from __future__ import annotations

import asyncio
import hmac
import secrets
import time
from collections.abc import AsyncIterator, Awaitable, Sequence
from contextlib import asynccontextmanager
from typing import Protocol, TypeVar

import pydantic
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

import textgate
from textgate.proto import generate_pb2 as pb
from textgate.router.batcher import Batcher, OverloadedError
from textgate.router.channel import Channel
from textgate.router.config import RouterConfig
from textgate.router.errors import PayloadTooLargeError, error_response
from textgate.router.generate import (
    Generated,
    GenerationError,
    best_of,
    collect,
    generate_response,
    stream_frames,
)
from textgate.router.queue import BatchLimits
from textgate.router.request import ValidRequest
from textgate.router.schemas import GenerateRequest, Info
from textgate.router.shard_client import ShardedClient
from textgate.router.sse import SseResponse
from textgate.router.validation import Tokenizer, ValidationError, Validator

T = TypeVar("T")
HEALTH_TIMEOUT_S = 5.0


class ClientDisconnectedError(Exception):
    """The client closed the connection before its answer was ready."""


class Engine(Protocol):
    """What the handlers need from the loop that steps the shards (Batcher, PagedEngine)."""

    @property
    def num_active(self) -> int: ...

    def submit(self, requests: Sequence[ValidRequest]) -> list[Channel]: ...

    async def close(self) -> None: ...


def build_app(
    config: RouterConfig,
    shards: ShardedClient,
    tokenizer: Tokenizer,
    *,
    shard_info: pb.InfoResponse | None = None,
    engine: Engine | None = None,
) -> Starlette:
    """The router's Starlette app.

    `shard_info` (rank 0's Info) fills /info; `engine` defaults to a `Batcher` for
    padded shards under the config's budgets. The app closes the engine on shutdown.
    """
    if engine is None:
        limits = batch_limits(config, shard_info)
        engine = Batcher(shards, limits, config.max_concurrent_requests)
    validator = Validator(config, tokenizer)
    handlers = _Handlers(config, shards, validator, engine, shard_info)

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        yield
        await engine.close()
        validator.close()

    app = Starlette(
        routes=[
            Route("/generate", handlers.generate, methods=["POST"]),
            Route("/generate_stream", handlers.generate_stream, methods=["POST"]),
            Route("/health", handlers.health, methods=["GET"]),
            Route("/info", handlers.info, methods=["GET"]),
        ],
        middleware=_middleware(config),
        exception_handlers={
            ValidationError: _typed_error,
            OverloadedError: _typed_error,
            GenerationError: _typed_error,
            PayloadTooLargeError: _typed_error,
        },
        lifespan=lifespan,
    )
    app.state.engine = engine
    return app


def batch_limits(config: RouterConfig, shard_info: pb.InfoResponse | None) -> BatchLimits:
    """The batcher's budgets from the (warmup-resolved) config."""
    return BatchLimits(
        max_batch_prefill_tokens=config.max_batch_prefill_tokens,
        max_batch_total_tokens=config.max_batch_total_tokens or config.default_batch_total_tokens(),
        max_batch_size=config.max_batch_size,
        waiting_served_ratio=config.waiting_served_ratio,
        max_waiting_tokens=config.max_waiting_tokens,
        requires_padding=bool(shard_info and shard_info.requires_padding),
    )


class _Handlers:
    def __init__(
        self,
        config: RouterConfig,
        shards: ShardedClient,
        validator: Validator,
        engine: Engine,
        shard_info: pb.InfoResponse | None,
    ) -> None:
        self._config = config
        self._shards = shards
        self._validator = validator
        self._engine = engine
        self._info = _info(config, shard_info)
        device = self._info.model_device_type
        self._compute_type = f"{'gpu' if device == 'cuda' else device}+optimized"

    async def generate(self, request: Request) -> Response:
        start = time.monotonic()
        body = await _read_generate_request(request, self._config.payload_limit)
        valid = await self._validator.validate(body)
        candidates = [valid]
        if valid.best_of > 1:
            candidates = [valid.with_seed(secrets.randbits(64)) for _ in range(valid.best_of)]
        channels = self._engine.submit(candidates)
        try:
            results = await _unless_disconnected(request, _collect_all(channels))
        except ClientDisconnectedError:
            return Response(status_code=499)
        best, others = best_of(results)
        answer = generate_response(best, others, body.parameters, body.inputs)
        headers = _timing_headers(start, best, len(body.inputs), self._compute_type)
        return JSONResponse(answer.model_dump(mode="json"), headers=headers)

    async def generate_stream(self, request: Request) -> Response:
        body = await _read_generate_request(request, self._config.payload_limit)
        valid = await self._validator.validate(body, stream=True)
        (channel,) = self._engine.submit([valid])
        headers = {
            "x-compute-type": self._compute_type,
            "x-compute-characters": str(len(body.inputs)),
        }
        frames = stream_frames(channel, body.parameters, body.inputs)
        return SseResponse(frames, on_disconnect=channel.cancel, headers=headers)

    async def health(self, request: Request) -> Response:
        try:
            await self._shards.health(timeout_s=HEALTH_TIMEOUT_S)
        except Exception:
            return error_response("unhealthy", "healthcheck", 503)
        return Response(status_code=200)

    async def info(self, request: Request) -> Response:
        return JSONResponse(self._info.model_dump(mode="json"))


def _info(config: RouterConfig, shard_info: pb.InfoResponse | None) -> Info:
    return Info(
        model_id=config.model_id,
        model_dtype=config.model_dtype or (shard_info.dtype if shard_info else "") or "unknown",
        model_device_type=config.model_device_type
        or (shard_info.device_type if shard_info else "")
        or "unknown",
        max_concurrent_requests=config.max_concurrent_requests,
        max_best_of=config.max_best_of,
        max_stop_sequences=config.max_stop_sequences,
        max_input_tokens=config.max_input_tokens,
        max_input_length=config.max_input_tokens,
        max_total_tokens=config.max_total_tokens,
        waiting_served_ratio=config.waiting_served_ratio,
        max_batch_total_tokens=batch_limits(config, shard_info).max_batch_total_tokens,
        max_waiting_tokens=config.max_waiting_tokens,
        max_batch_size=config.max_batch_size,
        validation_workers=config.validation_workers,
        max_client_batch_size=config.max_client_batch_size,
        router="textgate-router",
        version=textgate.__version__,
    )


async def _read_generate_request(request: Request, limit: int) -> GenerateRequest:
    body = await _read_body(request, limit)
    try:
        return GenerateRequest.model_validate_json(body)
    except pydantic.ValidationError as exc:
        raise ValidationError(_describe(exc)) from exc


async def _read_body(request: Request, limit: int) -> bytes:
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise PayloadTooLargeError(limit)
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise PayloadTooLargeError(limit)
    return bytes(body)


def _describe(exc: pydantic.ValidationError) -> str:
    first = exc.errors()[0]
    where = ".".join(str(part) for part in first["loc"])
    detail = f"{where}: {first['msg']}" if where else first["msg"]
    return f"Failed to deserialize the JSON body into the target type: {detail}"


async def _collect_all(channels: Sequence[Channel]) -> list[Generated]:
    try:
        return list(await asyncio.gather(*(collect(c) for c in channels)))
    finally:
        # Stop the other best_of candidates when one failed (no-op for finished ones).
        for channel in channels:
            channel.cancel()


async def _unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    """`await work`, unless the client disconnects first (ClientDisconnectedError)."""
    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(_disconnected(request.receive))
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
    if task.done():
        return task.result()
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    raise ClientDisconnectedError()


async def _disconnected(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


def _timing_headers(
    start: float, generated: Generated, num_chars: int, compute_type: str
) -> dict[str, str]:
    """TGI's response headers; durations in milliseconds."""
    total = time.monotonic() - start
    inference = generated.ended_at - generated.started_at
    num_tokens = generated.finished.generated_tokens
    return {
        "x-compute-type": compute_type,
        "x-compute-time": _ms(total),
        "x-compute-characters": str(num_chars),
        "x-total-time": _ms(total),
        "x-validation-time": _ms(generated.queued_at - start),
        "x-queue-time": _ms(generated.started_at - generated.queued_at),
        "x-inference-time": _ms(inference),
        "x-time-per-token": _ms(inference / max(num_tokens, 1)),
        "x-prompt-tokens": str(generated.input_length),
        "x-generated-tokens": str(num_tokens),
    }


def _ms(seconds: float) -> str:
    return str(max(int(seconds * 1000), 0))


async def _typed_error(request: Request, exc: Exception) -> Response:
    return error_response(str(exc), getattr(exc, "error_type", "generation"))


def _middleware(config: RouterConfig) -> list[Middleware]:
    middleware = []
    if config.cors_allow_origin:
        middleware.append(
            Middleware(
                CORSMiddleware,
                allow_origins=list(config.cors_allow_origin),
                allow_methods=["GET", "POST"],
                allow_headers=["content-type", "authorization"],
            )
        )
    if config.api_key is not None:
        middleware.append(Middleware(ApiKeyMiddleware, api_key=config.api_key))
    return middleware


class ApiKeyMiddleware:
    """Answers 401 unless the request carries `Authorization: Bearer <api_key>`."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self._app = app
        self._expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and not self._authorized(scope):
            response = error_response("Unauthorized", "unauthorized", 401)
            await response(scope, receive, send)
            return
        await self._app(scope, receive, send)

    def _authorized(self, scope: Scope) -> bool:
        headers: list[tuple[bytes, bytes]] = scope.get("headers", [])
        given = next((v for k, v in headers if k == b"authorization"), b"")
        return hmac.compare_digest(given, self._expected)
