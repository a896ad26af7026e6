"""The router process: reach the shards, warm them up, serve HTTP until SIGTERM/SIGINT.

Startup order: connect to rank 0 (ServiceDiscovery gives the others), ClearCache,
Info, Health, Warmup with a batch as large as the prefill budget (paged shards also
time their step then: `autoconfig` derives the budgets left unset from it), then uvicorn.
`engine.factory.make_engine` picks the engine from what Info and Warmup report; what
startup built is then kept out of the cyclic collector's walks (`heap.py`).
`Router listening on http://{hostname}:{port}` is logged once connections are
accepted. On a signal the router drains (`http/drain.py`: 503 to new requests and
/health, in-flight ones finish within `graceful_termination_timeout`), then the engine
closes and the process exits 0. With `otlp_endpoint` set, spans go to the collector
(`tracing.py`) and the last ones are flushed on the way out.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import signal
import time
from collections.abc import Callable
from typing import Any, cast

import uvicorn
from starlette.applications import Starlette

from textgate.heap import freeze_startup_heap
from textgate.proto import generate_pb2 as pb
from textgate.router import autoconfig, tracing
from textgate.router.app import build_app
from textgate.router.autoconfig import Measurements
from textgate.router.config import RouterConfig
from textgate.router.engine.factory import make_engine
from textgate.router.generation.validation import Tokenizer
from textgate.router.http.drain import DrainingServer
from textgate.router.http.guarded_h11 import guarded_h11
from textgate.router.metrics import Metrics
from textgate.router.shard_client import ShardedClient
from textgate.telemetry import start_tracing, stop_tracing

log = logging.getLogger("textgate.router")

CONNECT_TIMEOUT_S = 120.0
DRAIN_EXIT_TIMEOUT_S = 5


async def serve(config: RouterConfig) -> None:
    """Run the router until a signal; raises if the shards cannot be reached or warmed up."""
    telemetry = start_tracing(config.otlp_endpoint, config.otlp_service_name, tracing.install)
    try:
        shards = await ShardedClient.connect(config.shard_uds_path, CONNECT_TIMEOUT_S)
        try:
            tokenizer = await asyncio.to_thread(load_tokenizer, config.tokenizer_path)
            app = await build_router(config, shards, tokenizer)
            freeze_startup_heap()
            await run_http(app, config)
        finally:
            await shards.close()
    finally:
        stop_tracing(telemetry)


async def build_router(
    config: RouterConfig,
    shards: ShardedClient,
    tokenizer: Tokenizer,
    *,
    clock: Callable[[], float] = time.monotonic,
) -> Starlette:
    """Warm the shards up, then build the app over the engine they call for.

    The budgets left unset are resolved from what the shards report (Info, Warmup);
    `clock` times the tenants' quotas (tests inject one).
    """
    await shards.clear_cache()
    info = await shards.info()
    await shards.health()
    log.info("Warming up the model")
    # Until the shards have measured their step, the static default budget sizes warmup.
    probe = config.with_prefill_default(device_type=info.device_type)
    warmup = await shards.warmup(warmup_request(probe))
    supported = (
        warmup.max_supported_total_tokens if warmup.HasField("max_supported_total_tokens") else None
    )
    measured = Measurements.from_warmup(warmup)
    requested, config = config, resolve_config(config, info, supported, measured)
    autoconfig_report = None
    if measured is not None:
        autoconfig_report = autoconfig.report(requested, config, measured)
        autoconfig.log_report(autoconfig_report)
    log.info("%s", limits_line(config, info, warmup))
    metrics = Metrics(config.max_input_tokens, config.max_total_tokens)
    engine = make_engine(config, shards, info, warmup, metrics=metrics)
    engine.shard_calls.timeout_s = config.shard_step_timeout
    return build_app(
        config,
        shards,
        tokenizer,
        engine=engine,
        metrics=metrics,
        shard_info=info,
        autoconfig=autoconfig_report,
        clock=clock,
    )


def limits_line(config: RouterConfig, info: pb.InfoResponse, warmup: pb.WarmupResponse) -> str:
    """One line with every limit in force once flags, model and warmup are resolved."""
    kv = (
        f"{warmup.num_blocks} blocks x {info.block_size} tokens "
        f"({info.kv_cache_dtype}, {info.kv_cache_bytes_per_token} bytes/token)"
    )
    return (
        f"Limits in force: max_input_tokens={config.max_input_tokens} "
        f"max_total_tokens={config.max_total_tokens} "
        f"default_max_new_tokens={config.default_max_new_tokens} "
        f"max_batch_prefill_tokens={config.prefill_tokens} "
        f"max_batch_total_tokens={config.batch_total_tokens} "
        f"max_batch_size={config.max_batch_size or 'unlimited'} "
        f"max_concurrent_requests={config.max_concurrent_requests} kv_cache={kv} "
        f"dtype={info.dtype} device={info.device_type} quantize={info.quantize or 'none'}"
    )


def load_tokenizer(path: str) -> Tokenizer:
    """The model's tokenizer from a local folder (transformers' AutoTokenizer)."""
    from transformers import AutoTokenizer  # heavy: imported only by the router process

    return cast(Tokenizer, AutoTokenizer.from_pretrained(path))


def warmup_request(config: RouterConfig) -> pb.WarmupRequest:
    """The limits the shards warm up for: their largest prefill step, their KV cache."""
    return pb.WarmupRequest(
        max_input_tokens=config.max_input_tokens,
        max_prefill_tokens=config.prefill_tokens,
        max_total_tokens=config.max_total_tokens,
        max_batch_size=config.max_batch_size or 0,
    )


def resolve_config(
    config: RouterConfig,
    info: pb.InfoResponse,
    supported_total_tokens: int | None,
    measured: Measurements | None = None,
) -> RouterConfig:
    """The config with the batch budget and the /info facts the shards reported filled in.

    Paged shards' warmup `measured` their step: the step budget, max batch size and ITL
    target the user left unset derive from it (`router/autoconfig.py`); without
    measurements the step budget takes its static default (`with_prefill_default`).
    """
    if measured is not None:
        config = autoconfig.apply_measurements(config, measured, info.block_size)
    config = config.with_prefill_default(device_type=info.device_type)
    total = config.batch_total_tokens
    if supported_total_tokens is not None:
        if supported_total_tokens < config.max_total_tokens:
            raise RuntimeError(
                f"the KV cache holds {supported_total_tokens} tokens, less than "
                f"max_total_tokens ({config.max_total_tokens}): lower max_total_tokens"
            )
        if config.max_batch_total_tokens is None:
            total = supported_total_tokens
        elif total > supported_total_tokens:
            log.warning(
                "max_batch_total_tokens lowered to the %d tokens the cache holds",
                supported_total_tokens,
            )
            total = supported_total_tokens
    return dataclasses.replace(
        config,
        max_batch_total_tokens=total,
        # A prefill can never use more tokens than the whole cache.
        max_batch_prefill_tokens=min(config.prefill_tokens, total),
        model_dtype=config.model_dtype or info.dtype or None,
        model_device_type=config.model_device_type or info.device_type or None,
    )


async def run_http(app: Starlette, router_config: RouterConfig) -> None:
    """Serve `app` (`build_app`'s) with uvicorn until SIGTERM/SIGINT, then drain it."""
    hostname, port = router_config.hostname, router_config.port
    config = uvicorn.Config(
        app,
        host=hostname,
        port=port,
        log_config=None,
        access_log=False,
        # Request headers and bodies must arrive within deadlines (slow-loris clients).
        http=guarded_h11(router_config.header_timeout, router_config.body_timeout),
        # After the drain: what a connection that still will not close gets.
        timeout_graceful_shutdown=DRAIN_EXIT_TIMEOUT_S,
    )
    server = DrainingServer(
        config,
        app.state.drain,
        router_config.graceful_termination_timeout,
        app.state.engine.close,
    )
    # uvicorn re-raises the signal it caught once it has drained; a no-op handler
    # turns that into a clean return (exit code 0) instead of a kill.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, _ignore_signal)
    task = asyncio.create_task(server.serve())
    while not server.started and not task.done():
        await asyncio.sleep(0.05)
    if server.started:
        log.info("Router listening on http://%s:%d", hostname, bound_port(server, port))
    await task


def bound_port(server: uvicorn.Server, default: int) -> int:
    """The port uvicorn actually bound (differs from the config's when that is 0)."""
    for listener in server.servers:
        for sock in listener.sockets:
            return int(sock.getsockname()[1])
    return default


def _ignore_signal(signum: int, frame: Any) -> None:
    """Replaced by uvicorn's handler while serving; see run_http."""
