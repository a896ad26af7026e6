"""TGI's routes: /generate, /generate_stream, the compat route `/`, /tokenize, /health,
/ping, /info and /metrics (SageMaker's /invocations is `sagemaker.py`).

Every generation request counts in `tgi_request_count` before it is parsed, and ends
in exactly one of `tgi_request_success` or `tgi_request_failure{err}` (unless its
client leaves first), as in TGI.
"""

from __future__ import annotations

import asyncio
import secrets
import time
from collections.abc import Sequence
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import BaseRoute, Route

import textgate
from textgate.proto import generate_pb2 as pb
from textgate.router.config import RouterConfig
from textgate.router.engine.channel import Channel, ErrorEvent
from textgate.router.engine.request import ValidRequest
from textgate.router.generation.result import Generated, StreamEnd, best_of, collect
from textgate.router.generation.schemas import GenerateRequest
from textgate.router.http.delivery import (
    CLIENT_DISCONNECTED,
    StreamPacing,
    guard_stream,
)
from textgate.router.http.errors import error_response
from textgate.router.http.request_io import (
    ClientDisconnectedError,
    read_json,
    unless_disconnected,
    with_request_timeout,
)
from textgate.router.http.sse import SseResponse
from textgate.router.http.state import RouterState
from textgate.router.metrics import CONTENT_TYPE, RequestTimings
from textgate.router.tgi.output import generate_response, stream_frames
from textgate.router.tgi.schemas import CostInfo, Info

HEALTH_TIMEOUT_S = 5.0
# nginx's code for "client closed request": nobody reads it, but logs show why.
CLIENT_CLOSED_REQUEST = 499


def tgi_routes(state: RouterState) -> list[BaseRoute]:
    """TGI's routes over `state`; `GET /` is the health check, `POST /` generates."""
    handlers = TgiHandlers(state)
    return [
        Route("/", handlers.compat_generate, methods=["POST"]),
        Route("/", handlers.health, methods=["GET"]),
        Route("/generate", handlers.generate, methods=["POST"]),
        Route("/generate_stream", handlers.generate_stream, methods=["POST"]),
        Route("/tokenize", handlers.tokenize, methods=["POST"]),
        Route("/health", handlers.health, methods=["GET"]),
        Route("/ping", handlers.health, methods=["GET"]),
        Route("/info", handlers.info, methods=["GET"]),
        Route("/metrics", handlers.metrics, methods=["GET"]),
    ]


class TgiHandlers:
    """The route handlers; errors are raised as typed exceptions the app turns into TGI bodies."""

    def __init__(self, state: RouterState) -> None:
        self._state = state
        self._metrics = state.metrics
        self._info = info_response(state.config, state.shard_info, state.autoconfig)
        device = self._info.model_device_type
        self._compute_type = f"{'gpu' if device == 'cuda' else device}+optimized"
        self._pacing = StreamPacing.from_config(state.config)

    async def generate(self, request: Request) -> Response:
        """POST /generate: the whole answer as one JSON object."""
        received = time.monotonic()
        self._metrics.request_received()
        with self._metrics.count_failures():
            body = await self._read(request)
            return await self._generate(request, body, received, as_list=False)

    async def generate_stream(self, request: Request) -> Response:
        """POST /generate_stream: one SSE event per token (those due together in one write)."""
        received = time.monotonic()
        self._metrics.request_received()
        with self._metrics.count_failures():
            body = await self._read(request)
            return await self._stream(body, received)

    async def compat_generate(self, request: Request) -> Response:
        """POST /: `stream` picks SSE or a one-element list (TGI's compat route).

        As in TGI for a text-generation model, `return_full_text` defaults to true here.
        """
        received = time.monotonic()
        self._metrics.request_received()
        with self._metrics.count_failures():
            body = await self._read(request)
            if body.parameters.return_full_text is None:
                parameters = body.parameters.model_copy(update={"return_full_text": True})
                body = body.model_copy(update={"parameters": parameters})
            if body.stream:
                return await self._stream(body, received)
            return await self._generate(request, body, received, as_list=True)

    async def tokenize(self, request: Request) -> Response:
        """POST /tokenize: the prompt's tokens as `[{id, text, start, stop}]`."""
        body = await read_json(request, GenerateRequest, self._state.config.payload_limit)
        tokens = await self._state.validator.tokenize(body)
        return JSONResponse([token.model_dump(mode="json") for token in tokens])

    async def health(self, request: Request) -> Response:
        """GET /health, /ping and /: 200 when every shard answers its health check."""
        try:
            await self._state.shards.health(timeout_s=HEALTH_TIMEOUT_S)
        except Exception:
            return error_response("unhealthy", "healthcheck", 503)
        return Response(status_code=200)

    async def info(self, request: Request) -> Response:
        # Adapters come and go at runtime (/v1/load_lora_adapter): listed as they are now.
        adapters = list(self._state.validator.adapters) or None
        cost = self._state.engine.cost
        report = CostInfo.from_report(cost.report()) if cost is not None else None
        info = self._info.model_copy(update={"lora_adapters": adapters, "cost": report})
        return JSONResponse(info.model_dump(mode="json"))

    async def metrics(self, request: Request) -> Response:
        return Response(self._metrics.render(), headers={"content-type": CONTENT_TYPE})

    async def _read(self, request: Request) -> GenerateRequest:
        """A generating route's body, with the `X-Request-Timeout` header's deadline."""
        body = await read_json(request, GenerateRequest, self._state.config.payload_limit)
        parameters = with_request_timeout(body.parameters, request)
        return body.model_copy(update={"parameters": parameters})

    async def _validate(
        self, body: GenerateRequest, received: float, *, stream: bool = False
    ) -> ValidRequest:
        valid = await self._state.validator.validate(body, stream=stream, received_at=received)
        self._metrics.request_validated(valid.input_length, valid.max_new_tokens)
        return valid

    async def _generate(
        self, request: Request, body: GenerateRequest, received: float, *, as_list: bool
    ) -> Response:
        valid = await self._validate(body, received)
        candidates = [valid]
        if valid.best_of > 1:
            candidates = [valid.with_seed(secrets.randbits(64)) for _ in range(valid.best_of)]
        channels = self._state.engine.submit(candidates)
        try:
            results = await unless_disconnected(request, _collect_all(channels))
        except ClientDisconnectedError:
            if any(c.cancelled for c in channels):
                self._metrics.request_cancelled(CLIENT_DISCONNECTED)
            return Response(status_code=CLIENT_CLOSED_REQUEST)
        best, others = best_of(results)
        answer = generate_response(
            best, others, body.parameters, body.inputs, sampled=valid.sampling.do_sample
        )
        self._metrics.request_succeeded(_timings(received, best))
        payload = answer.model_dump(mode="json")
        headers = _timing_headers(received, best, len(body.inputs), self._compute_type)
        return JSONResponse([payload] if as_list else payload, headers=headers)

    async def _stream(self, body: GenerateRequest, received: float) -> Response:
        valid = await self._validate(body, received, stream=True)
        (channel,) = self._state.engine.submit([valid])

        def on_end(end: StreamEnd) -> None:
            if isinstance(end, ErrorEvent):
                self._metrics.request_failed(end.error_type)
                return
            started = channel.started_at or channel.queued_at
            self._metrics.request_succeeded(
                RequestTimings(
                    received,
                    channel.queued_at,
                    started,
                    time.monotonic(),
                    end.generated_tokens,
                    channel.first_token_at,
                )
            )

        frames = stream_frames(
            channel,
            body.parameters,
            body.inputs,
            sampled=valid.sampling.do_sample,
            on_end=on_end,
            pacing=self._pacing,
        )
        headers = {
            "x-compute-type": self._compute_type,
            "x-compute-characters": str(len(body.inputs)),
        }
        on_disconnect = guard_stream([channel], self._pacing, self._metrics)
        return SseResponse(frames, on_disconnect=on_disconnect, headers=headers)


def info_response(
    config: RouterConfig,
    shard_info: pb.InfoResponse | None,
    autoconfig: dict[str, Any] | None = None,
) -> Info:
    """The /info body: the config's limits, with dtype and device from the shards when unset,
    and the startup `autoconfig` report."""
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
        max_batch_total_tokens=config.batch_total_tokens,
        max_waiting_tokens=config.max_waiting_tokens,
        max_batch_size=config.max_batch_size,
        validation_workers=config.validation_workers,
        max_client_batch_size=config.max_client_batch_size,
        router="textgate-router",
        version=textgate.__version__,
        autoconfig=autoconfig,
        quantize=(shard_info.quantize or None) if shard_info else None,
        model_weight_bytes=(shard_info.weight_bytes or None) if shard_info else None,
        kv_cache_dtype=(shard_info.kv_cache_dtype or None) if shard_info else None,
        attention_backend=(shard_info.attention_backend or None) if shard_info else None,
        model_implementation=(shard_info.model_implementation or None) if shard_info else None,
        lora_adapters=(list(shard_info.lora_adapters) or None) if shard_info else None,
        max_loras=(shard_info.max_loras or None) if shard_info else None,
        max_lora_rank=(shard_info.max_lora_rank or None) if shard_info else None,
        cpu_kernels=(dict(shard_info.cpu_kernels) or None) if shard_info else None,
        kv_cache_bytes_per_token=(shard_info.kv_cache_bytes_per_token or None)
        if shard_info
        else None,
    )


async def _collect_all(channels: Sequence[Channel]) -> list[Generated]:
    try:
        return list(await asyncio.gather(*(collect(c) for c in channels)))
    finally:
        # Stop the other best_of candidates when one failed (no-op for finished ones).
        for channel in channels:
            channel.cancel()


def _timings(received: float, generated: Generated) -> RequestTimings:
    return RequestTimings(
        received_at=received,
        queued_at=generated.queued_at,
        started_at=generated.started_at,
        ended_at=generated.ended_at,
        generated_tokens=generated.finished.generated_tokens,
        first_token_at=generated.first_token_at,
    )


def _timing_headers(
    received: float, generated: Generated, num_chars: int, compute_type: str
) -> dict[str, str]:
    """TGI's response headers: x-compute-time in seconds, the other durations in milliseconds."""
    total = time.monotonic() - received
    inference = generated.ended_at - generated.started_at
    num_tokens = generated.finished.generated_tokens
    return {
        "x-compute-type": compute_type,
        "x-compute-time": str(max(total, 0.0)),
        "x-compute-characters": str(num_chars),
        "x-total-time": _ms(total),
        "x-validation-time": _ms(generated.queued_at - received),
        "x-queue-time": _ms(generated.started_at - generated.queued_at),
        "x-inference-time": _ms(inference),
        "x-time-per-token": _ms(inference / max(num_tokens, 1)),
        "x-prompt-tokens": str(generated.input_length),
        "x-generated-tokens": str(num_tokens),
    }


def _ms(seconds: float) -> str:
    return str(max(int(seconds * 1000), 0))
