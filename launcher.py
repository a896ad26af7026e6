"""`textgate-launcher`: parse TGI's flags, start the shards and the router, supervise them.

Every flag can also come from the environment variable of the same name in upper case
(`--max-total-tokens` <- `MAX_TOTAL_TOKENS`), as with TGI's launcher. A child that dies
stops the others; the launcher then exits non-zero and shows the child's last stderr lines.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from textgate.logs import setup_logging
from textgate.shard_server.flag_types import cuda_graph_sizes

log = logging.getLogger("textgate.launcher")

# TGI's spellings, plus int8 (W8A8 quantized at load). The shards' loader registry
# (textgate.quantization) serves each one; tests/test_launcher.py keeps the two in step.
QUANTIZE_METHODS = ("awq", "gptq", "bitsandbytes", "bitsandbytes-nf4", "bitsandbytes-fp4", "int8")
# TGI's other --quantize values, refused by name.
TGI_ONLY_QUANTIZE = ("compressed-tensors", "eetq", "exl2", "fp8", "marlin")
_STDERR_TAIL = 40
# After its drain, the router still closes connections (router.server.DRAIN_EXIT_TIMEOUT_S)
# and flushes its last spans (telemetry.SHUTDOWN_TIMEOUT_S).
ROUTER_EXIT_MARGIN_S = 10.0
SHARD_EXIT_TIMEOUT_S = 10.0


def _bool(text: str) -> bool:
    if text.lower() in ("1", "true", "yes", "on"):
        return True
    if text.lower() in ("0", "false", "no", "off", ""):
        return False
    raise argparse.ArgumentTypeError(f"expected a boolean, got {text!r}")


def _origins(text: str) -> tuple[str, ...]:
    return tuple(o.strip() for o in text.split(",") if o.strip())


def _graph_sizes_text(sizes: Sequence[int]) -> str:
    return ",".join(map(str, sizes)) or "0"


def flag(
    default: Any,
    help: str,
    parse: Callable[[str], Any] = str,
    choices: Sequence[str] | None = None,
) -> Any:
    """A `LauncherConfig` field that is also a flag: `--field-name` and env `FIELD_NAME`."""
    return field(default=default, metadata={"help": help, "parse": parse, "choices": choices})


@dataclass(frozen=True)
class Flag:
    """One launcher flag, derived from its `LauncherConfig` field."""

    name: str
    type: Callable[[str], Any]
    default: Any
    help: str
    choices: Sequence[str] | None = None


@dataclass(frozen=True)
class LauncherConfig:
    """Validated launcher settings: each field is one flag (TGI's name, `_` as `-`)."""

    model_id: str | None = flag(None, "Local model folder or hub id; unset = embedded SmolLM2-135M")
    revision: str | None = flag(None, "Hub revision (branch, tag or commit) of --model-id")
    num_shard: int = flag(1, "Number of shards (tensor-parallel ranks), one process each", int)
    quantize: str | None = flag(
        None,
        "Weight quantization: gptq, awq (checkpoints quantized with them); int8, bitsandbytes, "
        "bitsandbytes-nf4, bitsandbytes-fp4 (quantized at load); unset = the checkpoint's own",
    )
    dtype: str = flag(
        "auto",
        "Weights dtype; auto = bf16 on GPU (fp16 without bf16), on CPU whichever of fp32 and "
        "bf16 measured faster at startup (native models; else fp32)",
        str,
        ("auto", "float32", "bfloat16", "float16"),
    )
    trust_remote_code: bool = flag(False, "Allow custom model code from the model folder", _bool)
    max_concurrent_requests: int = flag(128, "Requests in flight before answering 429", int)
    max_best_of: int = flag(2, "Largest best_of a request may ask for", int)
    max_stop_sequences: int = flag(4, "Most stop sequences per request", int)
    max_top_n_tokens: int = flag(5, "Largest top_n_tokens a request may ask for", int)
    max_input_tokens: int | None = flag(
        None, "Longest prompt in tokens (default: max-total-tokens - 1)", int
    )
    max_total_tokens: int | None = flag(
        None, "Longest prompt + generation (default: min(model, 4096))", int
    )
    default_max_new_tokens: int = flag(
        256, "Tokens generated when a request sets no max_new_tokens/max_tokens", int
    )
    max_batch_prefill_tokens: int | None = flag(
        None,
        "Tokens one prefill (paged engine: one step) may compute; native models: derived "
        "from the step measured at startup, else max-input-tokens + 50",
        int,
    )
    max_batch_total_tokens: int | None = flag(
        None, "Tokens (prompt + generation) a batch may hold", int
    )
    max_batch_size: int | None = flag(
        None, "Most requests in one batch; native models: derived from the measured step", int
    )
    waiting_served_ratio: float = flag(0.3, "Waiting/running ratio that triggers a prefill", float)
    max_waiting_tokens: int = flag(20, "Decode steps before waiting requests are forced in", int)
    max_client_batch_size: int = flag(4, "Most inputs in one client request", int)
    block_size: int = flag(16, "Tokens per KV-cache block (native models)", int)
    prefix_caching: bool = flag(
        True, "Reuse the KV of shared prompt prefixes (native models)", _bool
    )
    kv_cache_memory: int = flag(1 << 30, "Bytes of KV cache per shard on CPU", int)
    kv_cache_dtype: str = flag(
        "auto",
        "KV cache element dtype (native models): auto = the weights' dtype; int8 or fp8 "
        "(= fp8_e4m3) store each token's K/V with a float32 scale per head, ~half of bf16",
        str,
        ("auto", "fp8", "fp8_e4m3", "int8"),
    )
    target_itl_ms: float | None = flag(
        None,
        "Inter-token latency the adaptive batch controller keeps each step under (native "
        "models); unset = derived from the step measured at startup; 0 = fixed budgets",
        float,
    )
    no_adaptive: bool = flag(
        False,
        "Fixed step budgets instead of the adaptive batch controller (= --target-itl-ms 0)",
        _bool,
    )
    cuda_memory_fraction: float = flag(0.9, "Share of free GPU memory the KV cache may take", float)
    attention: str = flag(
        "auto",
        "Attention backend (native models): auto = flash where flash-attn runs, else triton "
        "on GPU, cpu (C kernel) on CPU; torch = the PyTorch reference",
        str,
        ("auto", "flash", "triton", "torch", "cpu"),
    )
    cuda_graphs: tuple[int, ...] = flag(
        (1, 2, 4, 8, 16, 32),
        "Decode batch sizes captured as CUDA graphs (GPU, native models; comma-separated); "
        "0 = none; ignored on CPU",
        cuda_graph_sizes,
    )
    stream_interval: int = flag(
        1, "Tokens per SSE write after a stream's first (vLLM's name); 1 = each as it comes", int
    )
    max_stream_rate: float | None = flag(
        None,
        "Most tokens per second sent to one stream (a steady pace for UIs); unset = unpaced",
        float,
    )
    max_stream_buffer: int = flag(
        2048, "Tokens a stream may leave unread before its request is cancelled", int
    )
    hostname: str = flag("0.0.0.0", "Address the HTTP server binds")
    port: int = flag(8080, "Port the HTTP server binds", int)
    shard_uds_path: str = flag("/tmp/textgate-server", "Prefix of the shards' unix sockets")
    master_addr: str = flag("127.0.0.1", "torch.distributed rendezvous address")
    master_port: int = flag(29500, "torch.distributed rendezvous port", int)
    api_key: str | None = flag(
        None, "Require `Authorization: Bearer <key>` on the routes that generate"
    )
    cors_allow_origin: tuple[str, ...] = flag(
        (), "Comma-separated origins allowed by CORS", _origins
    )
    payload_limit: int = flag(2_000_000, "Largest request body in bytes", int)
    otlp_endpoint: str | None = flag(
        None,
        "OpenTelemetry collector (OTLP/gRPC), e.g. http://otel-collector:4317; unset = no tracing",
    )
    otlp_service_name: str = flag("textgate", "service.name of the traces (shards: NAME.shard)")
    graceful_termination_timeout: float = flag(
        90.0,
        "Seconds in-flight requests get to finish after SIGTERM before they are ended",
        float,
    )
    shard_step_timeout: float = flag(
        600.0,
        "Seconds a shard may take for one call (step, filter, clear) before it counts as hung",
        float,
    )
    header_timeout: float = flag(
        30.0, "Seconds a client has to send a request's headers, else it is disconnected", float
    )
    body_timeout: float = flag(
        60.0,
        "Seconds a client has to send a request's body once its headers arrived, else 408",
        float,
    )
    json_output: bool = flag(False, "Log JSON lines", _bool)

    def __post_init__(self) -> None:
        if self.num_shard < 1:
            raise ValueError("--num-shard must be at least 1")
        if self.quantize is not None and self.quantize not in QUANTIZE_METHODS:
            known = (
                "is TGI's, but not supported by textgate"
                if self.quantize in TGI_ONLY_QUANTIZE
                else "is unknown"
            )
            raise ValueError(
                f"--quantize {self.quantize} {known}; use one of: {', '.join(QUANTIZE_METHODS)}"
            )
        if self.otlp_endpoint is not None and not self.otlp_endpoint.startswith(
            ("http://", "https://")
        ):
            raise ValueError(
                f"--otlp-endpoint {self.otlp_endpoint} needs a scheme: http:// (plaintext) "
                "or https:// (TLS)"
            )
        if not self.graceful_termination_timeout >= 0:
            raise ValueError("--graceful-termination-timeout must be >= 0 seconds")
        for name in ("shard_step_timeout", "header_timeout", "body_timeout"):
            if not getattr(self, name) > 0:
                raise ValueError(f"--{name.replace('_', '-')} must be > 0 seconds")
        if self.block_size < 1:
            raise ValueError("--block-size must be at least 1")
        if self.target_itl_ms is not None and not self.target_itl_ms >= 0:
            raise ValueError("--target-itl-ms must be >= 0 (0 = fixed budgets)")
        if self.no_adaptive and self.target_itl_ms:
            raise ValueError("--no-adaptive contradicts --target-itl-ms > 0")
        if self.kv_cache_memory < 1:
            raise ValueError("--kv-cache-memory must be a positive number of bytes")
        if not 0 < self.cuda_memory_fraction <= 1:
            raise ValueError("--cuda-memory-fraction must lie in (0, 1]")
        if not 0 < self.port < 65536:
            raise ValueError(f"--port {self.port} is out of range")
        if (
            self.max_input_tokens is not None
            and self.max_total_tokens is not None
            and self.max_input_tokens >= self.max_total_tokens
        ):
            raise ValueError("--max-input-tokens must be smaller than --max-total-tokens")


def _flags() -> tuple[Flag, ...]:
    flags = []
    for f in fields(LauncherConfig):
        meta = f.metadata
        name = f.name.replace("_", "-")
        flags.append(Flag(name, meta["parse"], f.default, meta["help"], meta["choices"]))
    return tuple(flags)


FLAGS = _flags()
"""Every launcher flag, in `LauncherConfig`'s field order."""


def parse_args(
    argv: Sequence[str] | None = None, env: dict[str, str] | None = None
) -> LauncherConfig:
    """Flags first, then the upper-case env var of each flag, then its default."""
    env = dict(os.environ) if env is None else env
    parser = argparse.ArgumentParser(prog="textgate-launcher", description=__doc__)
    for flag in FLAGS:
        env_name = flag.name.upper().replace("-", "_")
        default = flag.type(env[env_name]) if env_name in env else flag.default
        kwargs: dict[str, Any] = {"default": default, "help": f"{flag.help} [env: {env_name}]"}
        if flag.type is _bool:
            kwargs.update(nargs="?", const=True, type=_bool)
        else:
            kwargs.update(type=flag.type, choices=flag.choices)
        names = [f"--{flag.name}"]
        if flag.name == "max-input-tokens":
            names.append("--max-input-length")  # TGI's older name
        parser.add_argument(*names, **kwargs)
    namespace = parser.parse_args(argv)
    try:
        return LauncherConfig(**vars(namespace))
    except ValueError as exc:
        parser.error(str(exc))
        raise


class Child:
    """A supervised process whose stderr is echoed and whose last lines are kept."""

    def __init__(self, name: str, argv: list[str], env: dict[str, str]) -> None:
        self.name = name
        self.tail: deque[str] = deque(maxlen=_STDERR_TAIL)
        self.process = subprocess.Popen(
            argv, env=env, stderr=subprocess.PIPE, text=True, start_new_session=True
        )
        self._reader = threading.Thread(target=self._pump, daemon=True)
        self._reader.start()

    def _pump(self) -> None:
        assert self.process.stderr is not None
        for line in self.process.stderr:
            self.tail.append(line.rstrip("\n"))
            sys.stderr.write(line)

    def poll(self) -> int | None:
        return self.process.poll()

    def stop(self, timeout: float = 10.0) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self._reader.join(timeout=2)


class ChildFailed(RuntimeError):
    def __init__(self, child: Child) -> None:
        self.child = child
        code = child.poll()
        lines = "\n".join(f"    {line}" for line in child.tail) or "    (no stderr)"
        super().__init__(f"{child.name} exited with code {code}. Its last stderr lines:\n{lines}")


def model_limits(model_path: Path, config: LauncherConfig) -> dict[str, int]:
    """TGI's defaults: total = min(model, 4096), input = total - 1."""
    model_config = json.loads((model_path / "config.json").read_text())
    model_max = int(model_config.get("max_position_embeddings") or 4096)
    total = config.max_total_tokens or min(model_max, 4096)
    max_input = config.max_input_tokens or total - 1
    if max_input >= total:
        raise ValueError(f"max input tokens {max_input} must be below max total tokens {total}")
    return {
        "max_total_tokens": total,
        "max_input_tokens": max_input,
        # Unset: the router picks it once it knows the shards (router/config.py).
        "max_batch_prefill_tokens": config.max_batch_prefill_tokens,
    }


def shard_argv(model_path: Path, config: LauncherConfig) -> list[str]:
    argv = [sys.executable, "-m", "textgate.shard_server", "--model-path", str(model_path)]
    argv += ["--model-id", served_model_id(config)]
    argv += ["--uds-path", config.shard_uds_path, "--dtype", config.dtype]
    argv += [
        "--block-size",
        str(config.block_size),
        "--kv-cache-memory",
        str(config.kv_cache_memory),
    ]
    argv += ["--cuda-memory-fraction", str(config.cuda_memory_fraction)]
    argv += ["--kv-cache-dtype", config.kv_cache_dtype]
    argv += ["--attention", config.attention]
    argv += ["--cuda-graphs", _graph_sizes_text(config.cuda_graphs)]
    if config.quantize is not None:
        argv += ["--quantize", config.quantize]
    if config.trust_remote_code:
        argv.append("--trust-remote-code")
    if config.json_output:
        argv.append("--json-output")
    if config.otlp_endpoint is not None:
        argv += ["--otlp-endpoint", config.otlp_endpoint]
        argv += ["--otlp-service-name", config.otlp_service_name]
    return argv


def served_model_id(config: LauncherConfig) -> str:
    """The name /info and /v1/models show: --model-id, or the embedded model's hub name."""
    from textgate.shard_server.model_source import DEFAULT_MODEL_ID

    return config.model_id or DEFAULT_MODEL_ID


def router_config(model_path: Path, config: LauncherConfig) -> dict[str, Any]:
    """The router's settings: every `RouterConfig` field the launcher has a flag for, by
    name, plus the model's limits and where its tokenizer is."""
    from textgate.router.config import RouterConfig  # no torch: a plain dataclass

    launcher_fields = {f.name for f in fields(LauncherConfig)}
    settings: dict[str, Any] = {
        f.name: getattr(config, f.name) for f in fields(RouterConfig) if f.name in launcher_fields
    }
    settings.update(model_limits(model_path, config))
    if config.no_adaptive:
        settings["target_itl_ms"] = 0.0
    settings["model_id"] = served_model_id(config)
    settings["tokenizer_path"] = str(model_path)
    return settings


class StopRequested(Exception):
    """A stop signal arrived while the model was loading."""


def wait_for_shards(
    children: list[Child],
    uds_path: str,
    timeout: float = 600.0,
    stop: threading.Event | None = None,
) -> None:
    """Poll every shard's Health until all answer; fail fast if one dies, and raise
    StopRequested as soon as `stop` is set."""
    import grpc

    from textgate.proto import generate_pb2 as pb
    from textgate.proto import generate_pb2_grpc as pb_grpc

    deadline = time.monotonic() + timeout
    for rank, child in enumerate(children):
        with grpc.insecure_channel(f"unix://{uds_path}-{rank}") as channel:
            stub = pb_grpc.TextGenerationServiceStub(channel)
            while True:
                if stop is not None and stop.is_set():
                    raise StopRequested()
                if child.poll() is not None:
                    raise ChildFailed(child)
                if time.monotonic() > deadline:
                    raise TimeoutError(f"shard {rank} not ready after {timeout:.0f}s")
                try:
                    stub.Health(pb.HealthRequest(), timeout=1.0)
                    break
                except grpc.RpcError:
                    time.sleep(0.2)
        log.info("Shard %d ready", rank)


def start_shards(model_path: Path, config: LauncherConfig) -> list[Child]:
    children = []
    for rank in range(config.num_shard):
        Path(f"{config.shard_uds_path}-{rank}").unlink(missing_ok=True)
        env = dict(os.environ)
        env.update(
            RANK=str(rank),
            WORLD_SIZE=str(config.num_shard),
            MASTER_ADDR=config.master_addr,
            MASTER_PORT=str(config.master_port),
        )
        children.append(Child(f"shard {rank}", shard_argv(model_path, config), env))
    return children


def start_router(model_path: Path, config: LauncherConfig) -> Child:
    settings = json.dumps(router_config(model_path, config))
    argv = [sys.executable, "-m", "textgate.router", "--config-json", settings]
    return Child("router", argv, dict(os.environ))


def supervise(children: list[Child], stop: threading.Event) -> None:
    """Block until a stop signal (return) or a child's exit (raise ChildFailed)."""
    while not stop.wait(0.2):
        for child in children:
            if child.poll() is not None:
                raise ChildFailed(child)


def run(config: LauncherConfig) -> int:
    from textgate.shard_server.model_source import resolve_model

    stop = threading.Event()
    # Resolving (downloading, converting) runs in this thread: a signal interrupts it.
    # Once children exist, a signal only sets `stop`, which every wait polls.
    interrupt = True

    def on_signal(signum: int, frame: Any) -> None:
        stop.set()
        if interrupt:
            raise StopRequested()

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, on_signal)
    children: list[Child] = []
    try:
        model_path = resolve_model(config.model_id, config.revision)
        interrupt = False
        log.info("Serving %s from %s", config.model_id or "the embedded default model", model_path)
        children = start_shards(model_path, config)
        wait_for_shards(children, config.shard_uds_path, stop=stop)
        if stop.is_set():
            raise StopRequested()
        children.append(start_router(model_path, config))
        supervise(children, stop)
        log.info("Stopping")
        return 0
    except StopRequested:
        log.info("Stopping while the model loads")
        return 0
    except ChildFailed as exc:
        log.error("%s", exc)
        return 1
    finally:
        interrupt = False
        # The router goes first: it drains (in-flight requests finish, within
        # --graceful-termination-timeout) while the shards still serve it.
        for child in reversed(children):
            child.stop(_stop_timeout(child, config))


def _stop_timeout(child: Child, config: LauncherConfig) -> float:
    """How long a child may take to exit after SIGTERM before it is killed."""
    if child.name == "router":
        return config.graceful_termination_timeout + ROUTER_EXIT_MARGIN_S
    return SHARD_EXIT_TIMEOUT_S


def main(argv: Sequence[str] | None = None) -> None:
    config = parse_args(argv)
    setup_logging(config.json_output, "launcher")
    log.info("Args %s", json.dumps(dataclasses.asdict(config)))
    sys.exit(run(config))


def free_port() -> int:
    """A TCP port that is free right now on the loopback interface (for tests and bench)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


if __name__ == "__main__":
    main()
