"""textgate.kernels: compute kernels, each beside a pure-PyTorch reference.

Attention backends are registered by name (docs/kernels.md):
- "torch" (also "sdpa"): the pure-PyTorch reference (kernels/sdpa.py), anywhere;
- "cpu": a C kernel on CPU tensors (SDPA elsewhere);
- "triton": Triton paged-attention kernels (CUDA; CPU tensors under TRITON_INTERPRET=1);
- "flash": the flash-attn package's paged kernels (CUDA, float16/bfloat16).
`select_attention_backend` resolves `--attention auto|<name>` for a device, dtype and
block size: auto is flash where it can run, else triton on CUDA, cpu on the CPU; a name
that cannot run there is a clear error. `cpu_layers` holds fused C versions of the
layers' small ops, `triton` their Triton versions; `cpu_build` compiles the C kernels on
first use. The linears: `linear.FastLinear` (dense), and the packed ones,
`int8_linear` (W8A8) and `int4_linear` (GPTQ/AWQ/GGUF 4-bit codes, in the checkpoint
layouts of `packing`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from textgate.kernels.attention import AttentionBackend, AttentionMetadata
from textgate.kernels.cpu_attention import CpuAttentionBackend
from textgate.kernels.flash import FlashAttentionBackend
from textgate.kernels.sdpa import SdpaAttentionBackend
from textgate.kernels.triton.attention import TritonAttentionBackend
from textgate.registry import Registry

DEFAULT_ATTENTION_BACKEND = "cpu"
#: `--attention` values: auto, then the backends in the order auto prefers them on a GPU.
ATTENTION_CHOICES = ("auto", "flash", "triton", "torch", "cpu")

_ATTENTION_BACKENDS: Registry[type[AttentionBackend[Any]]] = Registry("attention backend")


def register_attention_backend(
    name: str,
) -> Callable[[type[AttentionBackend[Any]]], type[AttentionBackend[Any]]]:
    """Class decorator: make an `AttentionBackend` available as `name`."""
    return _ATTENTION_BACKENDS.register(name)


def get_attention_backend(name: str = DEFAULT_ATTENTION_BACKEND) -> AttentionBackend[Any]:
    """A new instance of the backend registered as `name`."""
    return _ATTENTION_BACKENDS.lookup(name)()


def attention_backend_name(backend: AttentionBackend[Any]) -> str:
    """The name `backend` is registered under (`torch` rather than its alias `sdpa`)."""
    for name in (*ATTENTION_CHOICES[1:], *_ATTENTION_BACKENDS):
        if type(backend) is _ATTENTION_BACKENDS.get(name):
            return name
    return type(backend).__name__


def attention_unavailable_reason(
    name: str,
    device: torch.device | str,
    dtype: torch.dtype,
    block_size: int,
    quantized_kv: bool = False,
) -> str | None:
    """Why backend `name` cannot serve a model on `device` in `dtype` with `block_size`
    blocks (and an int8/fp8 KV cache if `quantized_kv`); None when it can."""
    device = torch.device(device)
    backend = _ATTENTION_BACKENDS.get(name)
    if quantized_kv and backend is not None and not backend.supports_quantized_kv:
        return "it reads no quantized (int8/fp8) KV cache"
    if name == "cpu" and device.type != "cpu":
        return f"the C kernel runs on CPU tensors, not {device.type}"
    if name == "triton":
        return TritonAttentionBackend.unavailable_reason(device, dtype, block_size)
    if name == "flash":
        return FlashAttentionBackend.unavailable_reason(device, dtype, block_size)
    if name not in _ATTENTION_BACKENDS:
        return f"unknown attention backend {name!r}; choose one of {', '.join(ATTENTION_CHOICES)}"
    return None


def select_attention_backend(
    name: str,
    device: torch.device | str,
    dtype: torch.dtype,
    block_size: int,
    quantized_kv: bool = False,
) -> str:
    """The backend `--attention name` means here: auto picks flash where it can run, else
    triton on CUDA (torch without triton), else cpu. Raises ValueError, saying why, for a
    named backend that cannot run on this device, dtype, block size or KV cache dtype."""
    device = torch.device(device)
    args = (device, dtype, block_size, quantized_kv)
    if name == "auto":
        if device.type != "cuda":
            return "cpu" if device.type == "cpu" else "torch"
        for candidate in ("flash", "triton"):
            if attention_unavailable_reason(candidate, *args) is None:
                return candidate
        return "torch"
    reason = attention_unavailable_reason(name, *args)
    if reason is not None:
        raise ValueError(f"--attention {name} cannot run here: {reason}")
    return name


register_attention_backend("sdpa")(SdpaAttentionBackend)
register_attention_backend("torch")(SdpaAttentionBackend)
register_attention_backend("cpu")(CpuAttentionBackend)
register_attention_backend("triton")(TritonAttentionBackend)
register_attention_backend("flash")(FlashAttentionBackend)

__all__ = [
    "ATTENTION_CHOICES",
    "DEFAULT_ATTENTION_BACKEND",
    "AttentionBackend",
    "AttentionMetadata",
    "CpuAttentionBackend",
    "FlashAttentionBackend",
    "SdpaAttentionBackend",
    "TritonAttentionBackend",
    "attention_backend_name",
    "attention_unavailable_reason",
    "get_attention_backend",
    "register_attention_backend",
    "select_attention_backend",
]
