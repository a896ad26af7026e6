"""Fused layer ops in Triton for the native models' GPU path, each beside its PyTorch reference.

The GPU twin of kernels/cpu_layers.py: a decode step runs ~200 small kernels besides its
matmuls (residual add and RMSNorm, SiLU·mul, rotary, KV-cache writes); each op here is
one launch and one pass over memory. Every op returns None (or False) where it does not
apply: tensors off the `enabled_devices`, dtypes other than float16/bfloat16/float32,
a quantized cache (its store is kv_quant.store_kv), no triton. The caller then runs the
reference, which stays the definition (layers/norm.py, layers/rotary.py, kv_cache.py,
models/llama.py); the `reference_*` functions here restate them for the tests.
"""

from __future__ import annotations

import functools
import types

import torch
import torch.nn.functional as F
from torch import Tensor

from textgate.kernels.triton import next_power_of_2, triton_installed

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)

#: Devices the ops run on. CUDA only: on the CPU the C kernels (cpu_layers) and the
#: references serve. Tests add "cpu" to run the ops in triton's interpreter.
enabled_devices: tuple[str, ...] = ("cuda",)


@functools.cache
def _programs() -> types.ModuleType:
    from textgate.kernels.triton import layer_kernels

    return layer_kernels


def _applies(*tensors: Tensor) -> bool:
    dtype = tensors[0].dtype
    return (
        dtype in FLOAT_DTYPES
        and all(t.device.type in enabled_devices and t.dtype == dtype for t in tensors)
        and all(t.stride(-1) == 1 for t in tensors)
        and triton_installed()
    )


def add_rms_norm(
    x: Tensor, residual: Tensor | None, weight: Tensor, eps: float
) -> tuple[Tensor, Tensor] | None:
    """(rms_norm(x + residual) * weight, x + residual) for x, residual [T, hidden]; without
    a residual the second is x itself."""
    inputs = (x, weight) if residual is None else (x, residual, weight)
    if x.dim() != 2 or not _applies(*inputs):
        return None
    normed = torch.empty_like(x)
    total = x if residual is None else torch.empty_like(x)
    hidden = x.shape[1]
    block = next_power_of_2(hidden)
    _programs().add_rms_norm_kernel[(x.shape[0],)](
        x, x if residual is None else residual, weight, normed, total, hidden, eps,
        x.stride(0), 0 if residual is None else residual.stride(0), normed.stride(0),
        total.stride(0), HAS_RESIDUAL=residual is not None, BLOCK=block,
        num_warps=min(16, max(1, block // 256)),
    )  # fmt: skip
    return normed, total


def rotary(query_key: Tensor, cos: Tensor, sin_signed: Tensor) -> bool:
    """Rotate heads query_key [T, H, D] in place (apply_rotary_signed with cos, sin_signed
    [T, D]); the head and token strides may be anything (a view into the fused qkv).
    False, untouched, where the op does not apply."""
    if query_key.dim() != 3 or not _applies(query_key, cos, sin_signed):
        return False
    num_tokens, heads, dim = query_key.shape
    block_h = min(next_power_of_2(heads), 16)
    _programs().rotary_kernel[(num_tokens, -(-heads // block_h))](
        query_key, cos, sin_signed, heads, query_key.stride(0), query_key.stride(1),
        cos.stride(0), sin_signed.stride(0),
        HALF=dim // 2, BLOCK_H=block_h, BLOCK_HALF=next_power_of_2(dim // 2),
    )  # fmt: skip
    return True


def silu_and_mul(gate_up: Tensor) -> Tensor | None:
    """silu(gate) * up for gate_up [T, 2 * width] = [gate | up] → [T, width]."""
    if gate_up.dim() != 2 or not _applies(gate_up):
        return None
    width = gate_up.shape[1] // 2
    out = gate_up.new_empty(gate_up.shape[0], width)
    block = min(next_power_of_2(width), 1024)
    _programs().silu_and_mul_kernel[(gate_up.shape[0], -(-width // block))](
        gate_up, out, width, gate_up.stride(0), out.stride(0), BLOCK=block
    )
    return out


def store_kv(
    key: Tensor, value: Tensor, key_cache: Tensor, value_cache: Tensor, slot_mapping: Tensor
) -> bool:
    """Write key/value [T, H_kv, D] into slots slot_mapping [T] of the caches
    [num_blocks, block_size, H_kv, D] (slots < 0 are skipped). False where it does not
    apply (a quantized cache among them: kv_quant.store_kv quantizes)."""
    if key.dim() != 3 or key.shape != value.shape or not _applies(key, value):
        return False
    if not _applies(key_cache, value_cache) or key_cache.stride() != value_cache.stride():
        return False
    if slot_mapping.device != key.device:
        return False
    _, block_size, kv_heads, dim = key_cache.shape
    _programs().store_kv_kernel[(key.shape[0],)](
        key, value, key_cache, value_cache, slot_mapping, kv_heads,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        *key_cache.stride()[:3],
        HEAD_DIM=dim, BLOCK_SIZE=block_size, BLOCK_H=next_power_of_2(kv_heads),
        BLOCK_D=next_power_of_2(dim),
    )  # fmt: skip
    return True


def rotary_and_store(
    qkv: Tensor,
    cos: Tensor,
    sin_signed: Tensor,
    key_cache: Tensor,
    value_cache: Tensor,
    slot_mapping: Tensor,
    num_heads: int,
    num_kv_heads: int,
) -> Tensor | None:
    """cpu_layers.rotary_and_store on the GPU: rotate the queries and keys of
    qkv [T, (H_q + 2 H_kv) * D] in place, store keys and values at `slot_mapping` [T];
    return the queries [T, H_q, D] (a view into qkv). None, qkv untouched, where either
    op does not apply."""
    num_tokens, head_dim = qkv.shape[0], key_cache.shape[-1]
    heads = qkv.view(num_tokens, num_heads + 2 * num_kv_heads, head_dim)
    if not _applies(qkv, cos, sin_signed, key_cache, value_cache):
        return None
    query_key = heads[:, : num_heads + num_kv_heads]
    key, value = (
        heads[:, num_heads : num_heads + num_kv_heads],
        heads[:, num_heads + num_kv_heads :],
    )
    if not rotary(query_key, cos, sin_signed):
        return None
    stored = store_kv(key, value, key_cache, value_cache, slot_mapping)
    assert stored, "store_kv applies wherever rotary did"
    return heads[:, :num_heads]


# The references: what each op computes, in plain PyTorch.


def reference_add_rms_norm(
    x: Tensor, residual: Tensor | None, weight: Tensor, eps: float
) -> tuple[Tensor, Tensor]:
    if residual is not None:
        x = x + residual
    variance = x.float().pow(2).mean(-1, keepdim=True)
    normed = (x.float() * torch.rsqrt(variance + eps)).to(x.dtype)
    return normed * weight, x


def reference_rotary(query_key: Tensor, cos: Tensor, sin_signed: Tensor) -> Tensor:
    half = query_key.shape[-1] // 2
    return query_key * cos[:, None, :] + query_key.roll(half, -1) * sin_signed[:, None, :]


def reference_silu_and_mul(gate_up: Tensor) -> Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def reference_store_kv(
    key: Tensor, value: Tensor, key_cache: Tensor, value_cache: Tensor, slot_mapping: Tensor
) -> None:
    heads, dim = key_cache.shape[2], key_cache.shape[3]
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    key_cache.view(-1, heads, dim).index_copy_(0, slots, key[keep].to(key_cache.dtype))
    value_cache.view(-1, heads, dim).index_copy_(0, slots, value[keep].to(value_cache.dtype))
