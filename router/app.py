"""The HTTP app: TGI's routes, the OpenAI and Anthropic ones and the API docs, over one
`RouterState`.

Errors are raised by the handlers as typed exceptions (ValidationError, OverloadedError,
GenerationError, PayloadTooLargeError) and answered here in the shape of the path's API
(`http.errors.error_api`: TGI's body `{"error", "error_type"}` and status by default).
With an API key (or a key file: tenants and their quotas, router/http/tenants.py), the
routes that generate need `Authorization: Bearer <key>` (or Anthropic's `x-api-key: <key>`
on its routes); probes, /info, /metrics and the docs stay open, as in TGI. SIGHUP reloads
the key file.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import time
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from typing import Any

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import BaseRoute
from starlette.types import Scope

import textgate
from textgate.proto import generate_pb2 as pb
from textgate.router.anthropic.routes import anthropic_routes
from textgate.router.config import RouterConfig
from textgate.router.generation.validation import Tokenizer, Validator
from textgate.router.http.access_log import AccessLogMiddleware
from textgate.router.http.audit_log import AuditLog
from textgate.router.http.auth import AuthMiddleware
from textgate.router.http.body_dispatch import merge_by_body
from textgate.router.http.drain import Drain, DrainMiddleware
from textgate.router.http.errors import (
    error_api,
    error_response,
)
from textgate.router.http.playground import PLAYGROUND_PATHS, with_playground
from textgate.router.http.sagemaker import sagemaker_route
from textgate.router.http.state import Engine, RouterState
from textgate.router.http.tenants import Tenants
from textgate.router.http.typed_errors import TYPED_ERRORS, typed_error_response
from textgate.router.metrics import Metrics
from textgate.router.openai.lora_routes import lora_routes
from textgate.router.openai.routes import openai_routes
from textgate.router.openai.tokenize import VLLM_TOKENIZE, is_vllm_tokenize
from textgate.router.openapi import DOCS_ASSETS_PATH, DOCS_PATH, SPEC_PATH, docs_routes
from textgate.router.shard_client import ShardedClient
from textgate.router.tgi.routes import tgi_routes
from textgate.router.tracing import TracingMiddleware

log = logging.getLogger("textgate.router")

# Routes an API key does not guard (TGI's "info routes"): probes and scrapers carry no key.
OPEN_PATHS = frozenset(
    {"/health", "/ping", "/info", "/metrics", "/v1/models", "/chat_tokenize", DOCS_PATH, SPEC_PATH}
    | PLAYGROUND_PATHS
)


def build_app(
    config: RouterConfig,
    shards: ShardedClient,
    tokenizer: Tokenizer,
    *,
    engine: Engine,
    metrics: Metrics,
    shard_info: pb.InfoResponse | None = None,
    autoconfig: dict[str, Any] | None = None,
    clock: Callable[[], float] = time.monotonic,
) -> Starlette:
    """The router's Starlette app over `engine` (`engine.factory.make_engine` picks it).

    `metrics` must be the engine's own, so that its step metrics show at /metrics;
    `shard_info` (rank 0's Info) and `autoconfig` (the startup report) fill /info;
    `clock` times the tenants' quotas. The app closes the engine on shutdown.
    """
    tenants = Tenants.from_config(config, clock)
    validator = Validator(config, tokenizer, adapters=engine.adapters)
    state = RouterState(
        config, shards, tokenizer, validator, engine, shard_info, metrics, autoconfig
    )
    audit = _audit_log(config)
    lifespan = _lifespan(engine, validator, tenants, audit)
    drain = Drain()
    app = Starlette(
        routes=_routes(state),
        middleware=_middleware(config, drain, tenants, metrics, audit),
        exception_handlers={
            **dict.fromkeys(TYPED_ERRORS, _typed_error),
            HTTPException: _http_error,
            Exception: _internal_error,
        },
        lifespan=lifespan,
    )
    app.state.engine = engine
    app.state.drain = drain
    app.state.router = state
    app.state.tenants = tenants
    return app


def _routes(state: RouterState) -> list[BaseRoute]:
    """Every API's routes over `state`, then the ones made from them (SageMaker, docs,
    the playground)."""
    config = state.config
    routes = [*tgi_routes(state), *openai_routes(state)]
    if config.allow_runtime_lora_updating:
        routes += lora_routes(state)
    routes += anthropic_routes(state)
    # TGI's and vLLM's POST /tokenize share the path: the body's shape picks the API.
    routes = merge_by_body(
        routes, "/tokenize", VLLM_TOKENIZE, is_vllm_tokenize, config.payload_limit
    )
    routes.append(sagemaker_route(routes, config.payload_limit))
    routes += docs_routes(routes, textgate.__version__)
    # After the docs: the playground's page and files are not API routes.
    return with_playground(routes)


def _lifespan(
    engine: Engine, validator: Validator, tenants: Tenants | None, audit: AuditLog | None
) -> Callable[[Starlette], AbstractAsyncContextManager[None]]:
    """While serving: the audit log's writer runs and SIGHUP reloads the key file; after,
    the engine, the validator's threads and then the audit log close."""

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        if audit is not None:
            audit.start()
        with _reloads_on_sighup(tenants):
            yield
        await engine.close()
        validator.close()
        if audit is not None:
            audit.close()  # after the engine: the last requests' lines are written

    return lifespan


def _audit_log(config: RouterConfig) -> AuditLog | None:
    if config.audit_log is None:
        return None
    return AuditLog(
        config.audit_log,
        max_bytes=config.audit_log_max_bytes,
        content=config.audit_log_content,
    )


@contextlib.contextmanager
def _reloads_on_sighup(tenants: Tenants | None) -> Iterator[None]:
    """While serving, SIGHUP re-reads the key file (requests in flight carry on)."""
    if tenants is None or tenants.path is None:
        yield
        return
    loop = asyncio.get_running_loop()
    previous = signal.getsignal(signal.SIGHUP)
    loop.add_signal_handler(signal.SIGHUP, tenants.reload)
    try:
        yield
    finally:
        loop.remove_signal_handler(signal.SIGHUP)
        signal.signal(signal.SIGHUP, previous)


async def _typed_error(request: Request, exc: Exception) -> Response:
    return typed_error_response(exc, request.url.path)


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    error_type = exc.detail.lower().replace(" ", "_")
    api = error_api(request.url.path)
    response = error_response(exc.detail, error_type, exc.status_code, api=api)
    response.headers.update(exc.headers or {})
    return response


async def _internal_error(request: Request, exc: Exception) -> Response:
    log.error("%s %s failed: %r", request.method, request.url.path, exc)
    return error_response("Internal server error", "internal", 500, api=error_api(request.url.path))


def _middleware(
    config: RouterConfig,
    drain: Drain,
    tenants: Tenants | None,
    metrics: Metrics,
    audit: AuditLog | None,
) -> list[Middleware]:
    # Outermost: every answer is logged, a 401 or a CORS preflight included.
    # The span closes inside the access log's scope, so it can read the request's record.
    middleware = [
        Middleware(AccessLogMiddleware, audit=audit, model_id=config.model_id),
        Middleware(TracingMiddleware),
    ]
    # Inside the access log: the 503s of a draining router are logged too.
    middleware.append(Middleware(DrainMiddleware, drain=drain))
    if config.cors_allow_origin:
        # Outside the key check: browsers send preflights without credentials.
        middleware.append(
            Middleware(
                CORSMiddleware,
                allow_origins=list(config.cors_allow_origin),
                allow_methods=["GET", "POST"],
                allow_headers=["content-type", "authorization"],
            )
        )
    if tenants is not None:
        middleware.append(
            Middleware(AuthMiddleware, tenants=tenants, metrics=metrics, guarded=_guarded)
        )
    return middleware


def _guarded(scope: Scope) -> bool:
    path = scope.get("path", "")
    if path in OPEN_PATHS or path.startswith(f"{DOCS_ASSETS_PATH}/"):
        return False
    # `GET /` is TGI's health check (the playground page for browsers); `POST /` generates.
    return not (path == "/" and scope.get("method") in ("GET", "HEAD"))
