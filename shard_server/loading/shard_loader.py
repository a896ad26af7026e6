"""Pick and load the implementation that serves a model folder.

Every model runs on the paged engine (continuous batching over the paged KV cache).
Architectures with a native class (`models/`) run it: fused kernels, quantization,
tensor parallel, LoRA. Other decoders run transformers' own modules
(`models.transformers_paged`, one shard); what cannot (recurrent layers,
encoder-decoders, chunked attention; `unsupported_reason` says) is refused at startup.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable, Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch

from textgate.kernels import get_attention_backend, select_attention_backend
from textgate.shard_server.layers.lora_limits import LoraLimits
from textgate.shard_server.layers.lora_slots import LoraSlots
from textgate.shard_server.layers.tensor_parallel import distributed_backend, rank_device
from textgate.shard_server.protocols.paged_model import PagedModel
from textgate.shard_server.startup.cache_config import CacheConfig
from textgate.shard_server.startup.dtype_choice import DtypeChoice, pick_dtype
from textgate.shard_server.startup.hardware import report_line
from textgate.shard_server.step.sequence import TokenizerInfo

log = logging.getLogger("textgate.shard")

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """The dtype `name` names; `auto` without a measurement: bfloat16 on GPU (float16 where
    the GPU has no bf16), float32 on CPU (where `load_model` measures instead)."""
    if name == "auto":
        if device.type == "cuda":
            return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        return torch.float32
    if name not in _DTYPES:
        raise ValueError(f"unsupported dtype {name!r}; use one of auto, {', '.join(_DTYPES)}")
    return _DTYPES[name]


def shard_device(rank: int, world_size: int = 1) -> torch.device:
    """GPU `rank` where GPUs are visible (one per shard), else the CPU."""
    num_gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return rank_device(rank, world_size, num_gpus)


def load_model(
    model_path: Path,
    model_id: str,
    dtype: str,
    rank: int = 0,
    world_size: int = 1,
    trust_remote_code: bool = False,
    local_rank: int | None = None,
    local_world_size: int | None = None,
    cache_config: CacheConfig | None = None,
    native: bool = True,
    quantize: str | None = None,
    attention: str = "auto",
    lora_adapters: Sequence[tuple[str, str]] = (),
    lora_limits: LoraLimits | None = None,
    speculative_model: Path | None = None,
    speculative_quantize: str | None = None,
) -> PagedModel:
    """Load `model_path` for this rank on the paged engine: its native class where one
    exists (unless `native` is False, `--no-native`), else transformers' own modules.

    `quantize` names the weight quantization method (None: the checkpoint's own, if any).
    `attention` is `--attention` (kernels.select_attention_backend).
    `lora_adapters` are (id, PEFT folder) pairs, loaded on a native model (the first
    --max-loras resident); `lora_limits` (--max-loras, --max-cpu-loras, --max-lora-rank)
    bound them and the ones loaded later.
    `local_rank` of `local_world_size`: the rank's place among its node's ranks, which picks
    its GPU (multi-node; unset: `rank` of `world_size`, one node).

    `speculative_model` (quantized as `speculative_quantize`) is the draft model of
    draft-model speculation (`draft_loader`), one shard only.

    `dtype` "auto" on CPU builds the model in each candidate dtype and keeps the one whose
    own step measured fastest (`dtype_choice.pick_dtype`). A model that cannot run paged
    (recurrent layers, an encoder-decoder, ...) is a ValueError saying why.
    """
    if speculative_model is not None and world_size > 1:
        raise ValueError("--speculative-model runs on one shard (--num-shard 1) for now")
    device = shard_device(
        rank if local_rank is None else local_rank,
        world_size if local_world_size is None else local_world_size,
    )
    if device.type == "cpu" and rank == 0:
        log.info(report_line())
    model_type = read_model_type(model_path)
    torch_dtype = resolve_dtype(dtype, device)  # a bad name fails before anything loads
    from textgate.shard_server.models import supported_model_types

    if native and model_type in supported_model_types():
        group = init_distributed(rank, world_size, device) if world_size > 1 else None
        build = paged_builder(
            model_path, model_id, device, group, world_size, cache_config, quantize, attention
        )
        paged = load_native(build, model_path, dtype, torch_dtype, device, quantize)
        attach_adapters(paged, lora_adapters, lora_limits or LoraLimits())
        return attach_draft(paged, speculative_model, speculative_quantize, attention)
    check_transformers_paged(model_path, model_type, world_size, quantize)
    why = "--no-native" if model_type in supported_model_types() else "no native class"
    log.info("model type %r: transformers' modules on the paged engine (%s)", model_type, why)
    build = transformers_paged_builder(
        model_path, model_id, device, cache_config, attention, trust_remote_code, why
    )
    paged = load_paged(build, dtype, torch_dtype, device)
    attach_adapters(paged, lora_adapters, lora_limits or LoraLimits())
    return attach_draft(paged, speculative_model, speculative_quantize, attention)


def load_native(
    build: Callable[[torch.dtype], PagedModel],
    model_path: Path,
    dtype: str,
    torch_dtype: torch.dtype,
    device: torch.device,
    quantize: str | None,
) -> PagedModel:
    """`load_paged` for a native class: "auto" on CPU takes the dtype of the quantization
    method's kernel where it has one."""
    from textgate.shard_server.models.loader import quantized_cpu_dtype

    auto_on_cpu = dtype == "auto" and device.type == "cpu"
    method_dtype = quantized_cpu_dtype(model_path, quantize) if auto_on_cpu else None
    return load_paged(build, dtype, torch_dtype, device, method_dtype)


def attach_adapters(
    paged: PagedModel, adapters: Sequence[tuple[str, str]], limits: LoraLimits
) -> None:
    """Give the paged model its LoRA slots (`limits`) and load each (id, folder)
    adapter (each rank its share of every update, `layers.lora.place`), resident while
    slots are free."""
    paged.lora = LoraSlots(paged.model, limits)
    for name, path in adapters:
        adapter = paged.lora.load(name, Path(path))
        log.info(
            "LoRA adapter %r: rank %d, scale %g, %d projections updated, %s",
            adapter.name,
            adapter.rank,
            adapter.scale,
            len(adapter.modules),
            "resident" if name in paged.lora.slots else "on the host until a request needs it",
        )


def attach_draft(
    paged: PagedModel, path: Path | None, quantize: str | None, attention: str
) -> PagedModel:
    """Give `paged` the draft model in `path` (None: none), before its cache is sized."""
    if path is not None:
        from textgate.shard_server.loading.draft_loader import load_draft

        block_size = paged.cache_config.block_size
        tokenizer = paged.info.tokenizer
        paged.draft = load_draft(path, quantize, paged.model, tokenizer, block_size, attention)
    return paged


def read_model_type(model_path: Path) -> str | None:
    """`model_type` of the folder's config.json (None where it names none)."""
    model_type: str | None = json.loads((model_path / "config.json").read_text()).get("model_type")
    return model_type


def paged_builder(
    model_path: Path,
    model_id: str,
    device: torch.device,
    group: Any,
    world_size: int,
    cache_config: CacheConfig | None,
    quantize: str | None,
    attention: str,
) -> Callable[[torch.dtype], PagedModel]:
    """A function that loads the native model in a given dtype and wraps it paged (the
    attention backend depends on the dtype, so it is picked per candidate)."""
    from textgate.shard_server.models import load_model as load_native

    tokenizer = load_tokenizer(model_path)
    config = cache_config or CacheConfig()

    def build(dtype: torch.dtype) -> PagedModel:
        backend = select_attention_backend(
            attention, device, dtype, config.block_size, config.kv_cache_dtype != "auto"
        )
        model = load_native(
            model_path, dtype, device, group, quantize=quantize, attention_backend=backend
        )
        return PagedModel(model, tokenizer, model_id, config, world_size, group)

    return build


def check_transformers_paged(
    model_path: Path,
    model_type: str | None,
    world_size: int,
    quantize: str | None,
) -> None:
    """Refuse, naming the model type and why, a model transformers' modules cannot run
    on the paged engine, and flags that path cannot honour."""
    from textgate.shard_server.models.transformers_paged import unsupported_reason

    reason = unsupported_reason(json.loads((model_path / "config.json").read_text()))
    if reason is not None:
        raise ValueError(f"model type {model_type!r} cannot be served: {reason}")
    where = f"model type {model_type!r} runs transformers' modules (no native class)"
    if quantize is not None:
        raise ValueError(f"--quantize needs a native implementation; {where}, unquantized")
    if world_size > 1:
        raise ValueError(
            f"tensor parallel (--num-shard > 1) needs a native implementation; {where} on one shard"
        )


def transformers_paged_builder(
    model_path: Path,
    model_id: str,
    device: torch.device,
    cache_config: CacheConfig | None,
    attention: str,
    trust_remote_code: bool,
    why: str = "no native class",
) -> Callable[[torch.dtype], PagedModel]:
    """`paged_builder`'s counterpart for transformers' modules (`why`: no native class, or
    --no-native)."""
    from textgate.shard_server.models.transformers_paged import TransformersPagedModel

    tokenizer = load_tokenizer(model_path)
    config = cache_config or CacheConfig()

    def build(dtype: torch.dtype) -> PagedModel:
        backend = select_attention_backend(
            attention, device, dtype, config.block_size, config.kv_cache_dtype != "auto"
        )
        model = TransformersPagedModel.load(
            model_path, dtype, device, get_attention_backend(backend), trust_remote_code, why
        )
        return PagedModel(model, tokenizer, model_id, config, 1, None)

    return build


def load_paged(
    build: Callable[[torch.dtype], PagedModel],
    dtype: str,
    torch_dtype: torch.dtype,
    device: torch.device,
    method_dtype: torch.dtype | None = None,
) -> PagedModel:
    """`build` in `torch_dtype` (what the `dtype` flag resolved to); "auto" on CPU takes
    `method_dtype` where the quantization method needs one (its kernel's), else measures
    every candidate (`dtype_choice.pick_dtype`). The model records how its dtype was chosen."""
    if dtype == "auto" and device.type == "cpu":
        if method_dtype is None:
            return pick_dtype(build)
        log.info(
            "--dtype auto: %s, the dtype of the quantization method's CPU kernel", method_dtype
        )
        paged = build(method_dtype)
        paged.dtype_choice = DtypeChoice(method_dtype, "quantization")
        return paged
    paged = build(torch_dtype)
    paged.dtype_choice = DtypeChoice(torch_dtype, "default" if dtype == "auto" else "flag")
    return paged


def load_tokenizer(model_path: Path) -> TokenizerInfo:
    """The tokenizer plus every eos id the model's generation config names."""
    from transformers import AutoTokenizer, GenerationConfig

    tokenizer = AutoTokenizer.from_pretrained(model_path)
    eos: Any = None
    if (model_path / "generation_config.json").is_file():
        eos = GenerationConfig.from_pretrained(model_path).eos_token_id
    return TokenizerInfo.from_tokenizer(tokenizer, eos)


def init_distributed(rank: int, world_size: int, device: torch.device) -> Any:
    """Join the shards' process group (gloo on CPU, nccl on GPU) from MASTER_ADDR/PORT."""
    import torch.distributed as dist

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29500")
    backend = distributed_backend(device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(
        backend,
        rank=rank,
        world_size=world_size,
        timeout=timedelta(minutes=10),
        # NCCL binds its communicator to this rank's GPU at once (no device guessing).
        device_id=device if device.type == "cuda" else None,
    )
    return dist.group.WORLD
