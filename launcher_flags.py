"""The launcher's settings: `LauncherConfig`, one field per flag (TGI's names), and the
flag table derived from it. `textgate.launcher.parse_args` turns argv and the environment
into a `LauncherConfig`.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, fields
from typing import Any

from textgate.shard_server.flag_types import cuda_graph_sizes, lora_adapters
from textgate.shard_server.layers.lora_limits import (
    DEFAULT_MAX_LORA_RANK,
    DEFAULT_MAX_LORAS,
    LoraLimits,
)

# TGI's spellings, plus int8 (W8A8 quantized at load) and gguf (a GGUF's 4-bit layers kept
# quantized). The shards' loader registry
# (textgate.quantization) serves each one; tests/test_launcher.py keeps the two in step.
QUANTIZE_METHODS = (
    "awq",
    "gptq",
    "bitsandbytes",
    "bitsandbytes-nf4",
    "bitsandbytes-fp4",
    "int8",
    "gguf",
)
# router/generation/reasoning.py's parsers; tests/test_launcher.py keeps the two in step.
REASONING_PARSERS = ("deepseek_r1", "qwen3")
# TGI's other --quantize values, refused by name.
TGI_ONLY_QUANTIZE = ("compressed-tensors", "eetq", "exl2", "fp8", "marlin")


def parse_bool(text: str) -> bool:
    if text.lower() in ("1", "true", "yes", "on"):
        return True
    if text.lower() in ("0", "false", "no", "off", ""):
        return False
    raise argparse.ArgumentTypeError(f"expected a boolean, got {text!r}")


def _origins(text: str) -> tuple[str, ...]:
    return tuple(o.strip() for o in text.split(",") if o.strip())


def flag(
    default: Any,
    help: str,
    parse: Callable[[str], Any] = str,
    choices: Sequence[str] | None = None,
    env: tuple[str, ...] = (),
) -> Any:
    """A `LauncherConfig` field that is also a flag: `--field-name` and env `FIELD_NAME`
    (then each of `env`, in order, when `FIELD_NAME` is not set)."""
    metadata = {"help": help, "parse": parse, "choices": choices, "env": env}
    return field(default=default, metadata=metadata)


@dataclass(frozen=True)
class Flag:
    """One launcher flag, derived from its `LauncherConfig` field."""

    name: str
    type: Callable[[str], Any]
    default: Any
    help: str
    choices: Sequence[str] | None = None
    env: tuple[str, ...] = ()
    """Env vars read after the flag's own (`FIELD_NAME`) when that one is not set."""

    @property
    def env_names(self) -> tuple[str, ...]:
        """Where the flag's value may come from besides argv, first found wins."""
        return (self.name.upper().replace("-", "_"), *self.env)


@dataclass(frozen=True)
class LauncherConfig:
    """Validated launcher settings: each field is one flag (TGI's name, `_` as `-`)."""

    model_id: str | None = flag(
        None, "Local model folder, .gguf file or hub id; unset = embedded SmolLM2-135M"
    )
    revision: str | None = flag(None, "Hub revision (branch, tag or commit) of --model-id")
    num_shard: int = flag(1, "Number of shards (tensor-parallel ranks), one process each", int)
    quantize: str | None = flag(
        None,
        "Weight quantization: gptq, awq (checkpoints quantized with them); int8, bitsandbytes, "
        "bitsandbytes-nf4, bitsandbytes-fp4 (quantized at load); gguf (a GGUF model's "
        "Q4_0/Q4_1/Q4_K layers kept quantized); unset = the checkpoint's own",
    )
    dtype: str = flag(
        "auto",
        "Weights dtype; auto = bf16 on GPU (fp16 without bf16), on CPU whichever of fp32 and "
        "bf16 measured faster at startup (native models; else fp32; bf16 without timing for "
        "4-bit gptq, awq, gguf and bitsandbytes-nf4/fp4 where the CPU has bf16 arithmetic, "
        "their CPU kernels' dtype)",
        str,
        ("auto", "float32", "bfloat16", "float16"),
    )
    trust_remote_code: bool = flag(
        False, "Allow custom model code from the model folder", parse_bool
    )
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
    waiting_served_ratio: float = flag(
        0.3,
        "TGI's padded-batch admission ratio: accepted and shown in /info; the paged scheduler "
        "admits by its step budget instead",
        float,
    )
    max_waiting_tokens: int = flag(20, "Decode steps before waiting requests are forced in", int)
    max_client_batch_size: int = flag(4, "Most inputs in one client request", int)
    block_size: int = flag(16, "Tokens per KV-cache block (native models)", int)
    prefix_caching: bool = flag(
        True, "Reuse the KV of shared prompt prefixes (native models)", parse_bool
    )
    kv_cache_memory: int = flag(1 << 30, "Bytes of KV cache per shard on CPU", int)
    kv_offload_bytes: int = flag(
        0,
        "Bytes of host memory per shard for prefix-cache blocks evicted from the KV cache: "
        "they come back on a prefix hit instead of being recomputed (docs/scaling.md); "
        "0 = no host tier",
        int,
    )
    kv_offload_dir: str | None = flag(
        None,
        "Directory for prefix-cache blocks the host tier evicts (a disk tier below it); "
        "a restart with the same model, KV dtype and layout restores from it",
    )
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
    target_ttft_ms: float | None = flag(
        None,
        "Time to first token the adaptive batch controller defends (native models): steps "
        "take more waiting prompt tokens, up to 2x the inter-token target, while a prompt "
        "would otherwise miss it; unset = 16 inter-token targets",
        float,
    )
    lora_adapters: tuple[tuple[str, str], ...] = flag(
        (),
        "LoRA adapters to serve beside the base model, TGI's syntax: comma-separated "
        "id=path or path (a PEFT folder; its id is the folder's name); requests pick one "
        "with adapter_id (TGI) or model (OpenAI); native models, split over --num-shard "
        "like their base layers",
        lora_adapters,
    )
    max_loras: int = flag(
        DEFAULT_MAX_LORAS,
        "Most LoRA adapters resident at once (attached to the layers); a request for another "
        "evicts the least recently used idle one (its host copy kept), or waits for a slot",
        int,
    )
    max_cpu_loras: int | None = flag(
        None,
        "Most LoRA adapters loaded at once, resident or not, each with a host copy of its "
        "weights (--lora-adapters and POST /v1/load_lora_adapter; a load past it is "
        "refused); default 4 x --max-loras",
        int,
    )
    max_lora_rank: int = flag(
        DEFAULT_MAX_LORA_RANK,
        "Highest rank (PEFT's r) a LoRA adapter may have; a larger one is refused at startup "
        "and at load (vLLM's default is 16)",
        int,
    )
    allow_runtime_lora_updating: bool = flag(
        False,
        "Serve POST /v1/load_lora_adapter and /v1/unload_lora_adapter (vLLM's routes; its "
        "VLLM_ALLOW_RUNTIME_LORA_UPDATING): they make the shards read folders on their "
        "disk, so they are off unless asked for, and behind --api-key when one is set",
        parse_bool,
    )
    max_logit_bias: float = flag(
        100.0,
        "Largest logit_bias magnitude a request may set (OpenAI's 100; lower it to stop "
        "clients from forcing or banning tokens outright)",
        float,
    )
    reasoning_parser: str | None = flag(
        None,
        "Answers of a reasoning model: the text between <think> and </think> is the "
        "thinking (chat's `reasoning_content`, a Responses `reasoning` item, an Anthropic "
        "`thinking` block), the rest the answer (deepseek_r1: the prompt opens the "
        "thinking; qwen3: the answer opens it); unset = all of it is the answer",
        str,
        REASONING_PARSERS,
    )
    no_adaptive: bool = flag(
        False,
        "Fixed step budgets instead of the adaptive batch controller (= --target-itl-ms 0)",
        parse_bool,
    )
    speculate: int = flag(
        0,
        "Speculative decoding (native models): propose up to N tokens per step, from the "
        "sequence's own prompt and output (n-gram prompt lookup) or --speculative-model's "
        "guesses, and verify them in one step; 0 = off (docs/speculative.md)",
        int,
    )
    speculative_ngram: str = flag(
        "1:3",
        "MIN:MAX n-gram lengths --speculate matches, longest first: the sequence's last MAX "
        "tokens down to its last MIN, looked up in its earlier tokens",
        str,
    )
    speculative_model: str | None = flag(
        None,
        "Draft model whose greedy guesses --speculate verifies instead of n-grams: a local "
        "folder, .gguf file or hub id sharing the served model's tokenizer, or 'embedded' "
        "(the embedded default model); one shard",
    )
    speculative_quantize: str | None = flag(
        None,
        "Weight quantization of --speculative-model (as --quantize: int8, gguf, ...); unset = "
        "the checkpoint's own",
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
    smooth_speculative_streams: bool = flag(
        False,
        "Spread the tokens one step brings at once (--speculate's accepted drafts) over the "
        "stream's recent step interval instead of sending them in a burst",
        parse_bool,
    )
    hostname: str = flag("0.0.0.0", "Address the HTTP server binds")
    port: int = flag(8080, "Port the HTTP server binds", int)
    shard_uds_path: str = flag("/tmp/textgate-server", "Prefix of the shards' unix sockets")
    nnodes: int = flag(
        1,
        "Nodes the --num-shard ranks are split over, evenly, one launcher each (multi-node "
        "tensor parallel, docs/scaling.md); node 0 runs the router",
        int,
        env=("LWS_GROUP_SIZE",),
    )
    node_rank: int = flag(
        0,
        "This node's index, 0 .. --nnodes - 1: it runs ranks node_rank * (num_shard / "
        "nnodes) onwards; 0 also runs the router, the others are headless (shards only)",
        int,
        env=("LWS_WORKER_INDEX",),
    )
    master_addr: str = flag(
        "127.0.0.1",
        "torch.distributed rendezvous address: node 0's, reachable from every node",
        env=("LWS_LEADER_ADDRESS",),
    )
    master_port: int = flag(29500, "torch.distributed rendezvous port (on node 0)", int)
    shard_port: int = flag(
        29600,
        "Multi-node: rank r's gRPC server listens on TCP port shard_port + r (plaintext, no "
        "TLS), where the router reaches the other nodes' ranks and they watch rank 0; the "
        "same on every node",
        int,
    )
    shard_host: str | None = flag(
        None,
        "Multi-node: the address the router dials this node's shards at; unset = this "
        "host's address on its route to --master-addr",
    )
    api_key: str | None = flag(
        None, "Require `Authorization: Bearer <key>` on the routes that generate"
    )
    api_keys_file: str | None = flag(
        None,
        "YAML or JSON file of API keys, each of a tenant with optional quotas (requests and "
        "tokens per minute, concurrency, max_new_tokens, models); reloaded on SIGHUP",
    )
    audit_log: str | None = flag(
        None,
        "File of one JSON line per finished request (time, tenant, route, model, tokens, "
        "status, latency, finish reason), rotated by size; unset = no audit log",
    )
    audit_log_content: bool = flag(
        False, "Put each request's prompt and output text in the audit log too", parse_bool
    )
    audit_log_max_bytes: int = flag(
        100 * 1024 * 1024, "Size in bytes past which the audit log is rotated (5 kept)", int
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
        "Seconds a shard may take for one call (a step, a ClearCache) before it counts as hung",
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
    device_hour_cost: float | None = flag(
        None,
        "USD one hour of this server's devices (all its shards, every node) costs: /metrics "
        "and /info then report cost per 1k input and output tokens, overall and per tenant, "
        "from the busy time measured (docs/scaling.md); unset = no costs",
        float,
    )
    json_output: bool = flag(False, "Log JSON lines", parse_bool)

    def __post_init__(self) -> None:
        self._check_model()
        self._check_serving()
        self._check_batching()
        self._check_speculation()
        self._check_cache()
        self._check_nodes()

    def _check_model(self) -> None:
        """--num-shard, --quantize, --lora-adapters and the model's token limits."""
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
        limits = LoraLimits(self.max_loras, self.max_lora_rank, self.max_cpu_loras)
        if len(self.lora_adapters) > limits.max_loaded:
            raise ValueError(
                f"--lora-adapters names {len(self.lora_adapters)} adapters, over --max-cpu-loras "
                f"{limits.max_loaded}"
            )
        if (
            self.max_input_tokens is not None
            and self.max_total_tokens is not None
            and self.max_input_tokens >= self.max_total_tokens
        ):
            raise ValueError("--max-input-tokens must be smaller than --max-total-tokens")

    def _check_serving(self) -> None:
        """The HTTP side: tracing, keys, costs, timeouts, the port, logit bias."""
        if self.otlp_endpoint is not None and not self.otlp_endpoint.startswith(
            ("http://", "https://")
        ):
            raise ValueError(
                f"--otlp-endpoint {self.otlp_endpoint} needs a scheme: http:// (plaintext) "
                "or https:// (TLS)"
            )
        if self.api_keys_file is not None:
            from textgate.router.http.tenants import load_keys_file  # no torch: pydantic, yaml

            load_keys_file(self.api_keys_file)  # a bad file fails before the model loads
        if self.device_hour_cost is not None and not (
            math.isfinite(self.device_hour_cost) and self.device_hour_cost > 0
        ):
            raise ValueError(
                f"--device-hour-cost must be a number of USD > 0, got {self.device_hour_cost}"
            )
        if not self.graceful_termination_timeout >= 0:
            raise ValueError("--graceful-termination-timeout must be >= 0 seconds")
        for name in ("shard_step_timeout", "header_timeout", "body_timeout"):
            if not getattr(self, name) > 0:
                raise ValueError(f"--{name.replace('_', '-')} must be > 0 seconds")
        if not 0 < self.max_logit_bias <= 100:
            raise ValueError(f"--max-logit-bias must be > 0 and <= 100, got {self.max_logit_bias}")
        if not 0 < self.port < 65536:
            raise ValueError(f"--port {self.port} is out of range")

    def _check_batching(self) -> None:
        """The batch controller's targets."""
        if self.target_itl_ms is not None and not self.target_itl_ms >= 0:
            raise ValueError("--target-itl-ms must be >= 0 (0 = fixed budgets)")
        if self.target_ttft_ms is not None and not self.target_ttft_ms > 0:
            raise ValueError("--target-ttft-ms must be > 0")
        if self.no_adaptive and self.target_itl_ms:
            raise ValueError("--no-adaptive contradicts --target-itl-ms > 0")

    def _check_speculation(self) -> None:
        """--speculate, --speculative-ngram and the draft model's flags."""
        if self.speculate < 0:
            raise ValueError("--speculate must be >= 0 (0 = off)")
        from textgate.router.config import parse_ngram_range  # no torch: a plain dataclass

        parse_ngram_range(self.speculative_ngram)  # ValueError naming the flag
        if self.speculative_model is not None and self.speculate < 1:
            raise ValueError("--speculative-model needs --speculate N (the most drafts per step)")
        if self.speculative_model is not None and self.num_shard > 1:
            raise ValueError("--speculative-model runs on one shard (--num-shard 1) for now")
        if self.speculative_quantize is not None and self.speculative_model is None:
            raise ValueError("--speculative-quantize needs --speculative-model")

    def _check_cache(self) -> None:
        """The KV cache, its tiers and the GPU memory share."""
        if self.block_size < 1:
            raise ValueError("--block-size must be at least 1")
        if self.kv_cache_memory < 1:
            raise ValueError("--kv-cache-memory must be a positive number of bytes")
        if self.kv_offload_bytes < 0:
            raise ValueError("--kv-offload-bytes must be >= 0 (0 = no host tier)")
        if (self.kv_offload_bytes or self.kv_offload_dir) and not self.prefix_caching:
            raise ValueError("--kv-offload-bytes and --kv-offload-dir need --prefix-caching")
        if not 0 < self.cuda_memory_fraction <= 1:
            raise ValueError("--cuda-memory-fraction must lie in (0, 1]")

    def _check_nodes(self) -> None:
        """--nnodes, --node-rank and the ports of a multi-node group."""
        if self.nnodes < 1:
            raise ValueError(f"--nnodes must be at least 1, got {self.nnodes}")
        if not 0 <= self.node_rank < self.nnodes:
            raise ValueError(
                f"--node-rank {self.node_rank} is not a node of --nnodes {self.nnodes} "
                f"(0 .. {self.nnodes - 1})"
            )
        if self.num_shard % self.nnodes:
            raise ValueError(
                f"--num-shard {self.num_shard} does not split evenly over --nnodes "
                f"{self.nnodes}: it is the whole tensor-parallel size, num_shard / nnodes "
                "shards on each node"
            )
        if not 0 < self.master_port < 65536:
            raise ValueError(f"--master-port {self.master_port} is out of range")
        if self.nnodes == 1:
            return
        last = self.shard_port + self.num_shard - 1
        if not (self.shard_port > 0 and last < 65536):
            raise ValueError(
                f"--shard-port {self.shard_port}: ranks listen on {self.shard_port} .. {last}, "
                "which must lie in 1 .. 65535"
            )
        if self.shard_port <= self.master_port <= last:
            raise ValueError(
                f"--master-port {self.master_port} is one of the shards' ports "
                f"(--shard-port {self.shard_port} .. {last})"
            )

    @property
    def shards_per_node(self) -> int:
        return self.num_shard // self.nnodes

    @property
    def node_ranks(self) -> range:
        """The global ranks this node's shards run."""
        first = self.node_rank * self.shards_per_node
        return range(first, first + self.shards_per_node)

    @property
    def headless(self) -> bool:
        """A node other than 0: shards only, no router."""
        return self.node_rank > 0


def _flags() -> tuple[Flag, ...]:
    flags = []
    for f in fields(LauncherConfig):
        meta = f.metadata
        name = f.name.replace("_", "-")
        flags.append(
            Flag(name, meta["parse"], f.default, meta["help"], meta["choices"], meta["env"])
        )
    return tuple(flags)


FLAGS = _flags()
"""Every launcher flag, in `LauncherConfig`'s field order."""
