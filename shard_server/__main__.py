"""`python -m textgate.shard_server`: load a model and serve it over gRPC (one process per shard).

The launcher starts one of these per shard with RANK / WORLD_SIZE / MASTER_ADDR /
MASTER_PORT set (and LOCAL_RANK / LOCAL_WORLD_SIZE, this node's share of the ranks, which
picks the GPU); it is rarely run by hand.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from textgate.heap import freeze_startup_heap
from textgate.logs import setup_logging
from textgate.shard_server import tracing
from textgate.shard_server.flag_types import (
    cuda_graph_sizes,
    lora_adapters,
    route_address,
    tcp_url,
)
from textgate.shard_server.layers.lora_limits import (
    DEFAULT_MAX_LORA_RANK,
    DEFAULT_MAX_LORAS,
    LoraLimits,
)
from textgate.shard_server.loading.shard_loader import load_model
from textgate.shard_server.protocols.paged_model import PagedModel
from textgate.shard_server.server import gather_urls, model_thread, serve
from textgate.shard_server.startup.cache_config import CacheConfig
from textgate.telemetry import start_tracing, stop_tracing


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m textgate.shard_server")
    _model_flags(parser)
    _cache_flags(parser)
    _adapter_flags(parser)
    _network_flags(parser)
    parser.add_argument("--json-output", action="store_true")
    parser.add_argument(
        "--otlp-endpoint", default=None, help="OTLP/gRPC collector for traces (unset: none)"
    )
    parser.add_argument(
        "--otlp-service-name", default="textgate", help="shards trace as NAME.shard"
    )
    return parser.parse_args(argv)


def _network_flags(parser: argparse.ArgumentParser) -> None:
    """Where the shard listens besides its unix socket, and the address the router dials
    it at (multi-node: the other nodes' ranks over TCP)."""
    parser.add_argument(
        "--tcp-port", type=int, default=0, help="also listen on this TCP port (0: none)"
    )
    parser.add_argument(
        "--advertise-host",
        default=None,
        help="the router dials this rank at HOST:--tcp-port (auto: this host's address on "
        "its route to MASTER_ADDR); unset: at its unix socket",
    )


def advertised_url(args: argparse.Namespace, rank: int) -> str:
    """The address ServiceDiscovery lists for this rank."""
    if args.advertise_host is None:
        return f"unix://{args.uds_path}-{rank}"
    if not args.tcp_port:
        raise ValueError("--advertise-host needs --tcp-port")
    host = args.advertise_host
    if host == "auto":
        host = route_address(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]))
    return tcp_url(host, args.tcp_port)


def _model_flags(parser: argparse.ArgumentParser) -> None:
    """Which model, in which dtype and quantization, run by which implementation."""
    parser.add_argument("--model-path", type=Path, required=True, help="local model folder")
    parser.add_argument("--model-id", default=None, help="name reported by Info")
    parser.add_argument("--uds-path", default="/tmp/textgate-server", help="socket path prefix")
    parser.add_argument("--dtype", default="auto", help="float32, bfloat16, float16 or auto")
    parser.add_argument("--trust-remote-code", action="store_true")
    parser.add_argument(
        "--quantize", default=None, help="weight quantization method (unset: the checkpoint's)"
    )
    parser.add_argument(
        "--attention",
        default="auto",
        help="attention backend: auto, flash, triton, torch or cpu (docs/kernels.md)",
    )
    parser.add_argument(
        "--no-native",
        action="store_true",
        help="run transformers' modules on the paged engine even where a native class exists",
    )
    parser.add_argument(
        "--speculative-model-path",
        type=Path,
        default=None,
        help="local folder of the draft model of draft-model speculation (unset: none)",
    )
    parser.add_argument(
        "--speculative-quantize",
        default=None,
        help="the draft model's weight quantization method (unset: the checkpoint's)",
    )


def _cache_flags(parser: argparse.ArgumentParser) -> None:
    """The paged KV cache and the decode graphs. The launcher always passes these;
    CacheConfig holds their defaults for manual runs."""
    cache = CacheConfig()
    parser.add_argument(
        "--block-size", type=int, default=cache.block_size, help="tokens per KV block"
    )
    parser.add_argument(
        "--kv-cache-memory", type=int, default=cache.kv_cache_memory, help="KV cache bytes on CPU"
    )
    parser.add_argument(
        "--cuda-memory-fraction",
        type=float,
        default=cache.cuda_memory_fraction,
        help="free GPU memory for the cache",
    )
    parser.add_argument(
        "--kv-cache-dtype",
        default=cache.kv_cache_dtype,
        help="KV element dtype: auto (the model's), int8, fp8 or fp8_e4m3",
    )
    parser.add_argument(
        "--cuda-graphs",
        type=cuda_graph_sizes,
        default=cache.cuda_graphs,
        help="decode batch sizes captured as CUDA graphs, comma-separated; 0 = none",
    )
    parser.add_argument(
        "--kv-offload-dir",
        default=cache.kv_offload_dir,
        help="root of the disk KV tier (blocks the host tier demotes; found again at restart)",
    )


def _adapter_flags(parser: argparse.ArgumentParser) -> None:
    """LoRA adapters at startup, and the limits runtime loads keep to."""
    parser.add_argument(
        "--lora-adapters",
        type=lora_adapters,
        default=(),
        help="LoRA adapters as id=path or path, comma-separated (PEFT folders)",
    )
    parser.add_argument(
        "--max-loras",
        type=int,
        default=DEFAULT_MAX_LORAS,
        help="most LoRA adapters resident at once; past it the least recently used idle "
        "one is evicted (its host copy kept)",
    )
    parser.add_argument(
        "--max-cpu-loras",
        type=int,
        default=None,
        help="most LoRA adapters loaded at once, resident or not (default: 4 x --max-loras)",
    )
    parser.add_argument(
        "--max-lora-rank",
        type=int,
        default=DEFAULT_MAX_LORA_RANK,
        help="highest LoRA rank an adapter may have",
    )


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    rank = int(os.environ.get("RANK", "0"))
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", str(rank)))
    local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", str(world_size)))
    setup_logging(args.json_output, f"shard-{rank}")
    executor = model_thread()
    model = executor.submit(
        load_model,
        args.model_path,
        model_id=args.model_id or str(args.model_path),
        dtype=args.dtype,
        rank=rank,
        world_size=world_size,
        local_rank=local_rank,
        local_world_size=local_world_size,
        trust_remote_code=args.trust_remote_code,
        cache_config=CacheConfig(
            block_size=args.block_size,
            kv_cache_memory=args.kv_cache_memory,
            cuda_memory_fraction=args.cuda_memory_fraction,
            kv_cache_dtype=args.kv_cache_dtype,
            cuda_graphs=args.cuda_graphs,
            kv_offload_dir=args.kv_offload_dir,
        ),
        native=not args.no_native,
        quantize=args.quantize,
        attention=args.attention,
        lora_adapters=args.lora_adapters,
        lora_limits=LoraLimits(args.max_loras, args.max_lora_rank, args.max_cpu_loras),
        speculative_model=args.speculative_model_path,
        speculative_quantize=args.speculative_quantize,
    ).result()
    # Every rank's address, for the router: after loading, the process group exists.
    urls = executor.submit(gather_urls, advertised_url(args, rank), world_size).result()
    telemetry = start_tracing(
        args.otlp_endpoint,
        f"{args.otlp_service_name}.shard",
        tracing.install,
        **{"service.instance.id": f"shard-{rank}"},
    )
    # The model is loaded: from here on, collections walk only what steps allocate.
    freeze_startup_heap()
    try:
        asyncio.run(
            _serve_until_signal(
                model, args.uds_path, rank, world_size, executor, args.tcp_port, urls
            )
        )
    finally:
        stop_tracing(telemetry)


async def _serve_until_signal(
    model: PagedModel,
    uds_path: str,
    rank: int,
    world_size: int,
    executor: ThreadPoolExecutor,
    tcp_port: int,
    urls: list[str],
) -> None:
    task = asyncio.ensure_future(
        serve(model, uds_path, rank, world_size, executor, tcp_port=tcp_port, urls=urls)
    )
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, task.cancel)
    try:
        await task
    except asyncio.CancelledError:
        logging.getLogger("textgate.shard").info("Shard %d stopped", rank)


if __name__ == "__main__":
    main()
