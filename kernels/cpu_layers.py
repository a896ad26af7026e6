"""Fused elementwise layer ops on the CPU (cpu_layers.c), for the native models' layers.

A decode step of a small model is ~200 small PyTorch kernels besides its matmuls (the
residual add and RMSNorm, SiLU·mul, rotary, the KV-cache writes), each a dispatch and a
pass over memory. Each function here does one of those groups in one pass and rounds
where its reference rounds. Each returns None where it does not apply (no compiler, not
on the CPU, not float32/bfloat16, non-contiguous input): the caller then runs its
PyTorch reference, which stays the definition (layers/norm.py, layers/rotary.py,
kv_cache.py, models/llama.py).
"""

from __future__ import annotations

import ctypes

import torch
from torch import Tensor

from textgate.kernels import cpu_build

_DTYPES = {torch.float32: 0, torch.bfloat16: 1}


def _library(*tensors: Tensor) -> ctypes.CDLL | None:
    """The kernels, if they can take these tensors (CPU, one dtype of float32/bfloat16,
    contiguous)."""
    dtype = tensors[0].dtype
    for tensor in tensors:
        if tensor.device.type != "cpu" or tensor.dtype != dtype or not tensor.is_contiguous():
            return None
    if dtype not in _DTYPES:
        return None
    return cpu_build.load_library()


def add_rms_norm(
    x: Tensor, residual: Tensor | None, weight: Tensor, eps: float
) -> tuple[Tensor, Tensor] | None:
    """(rms_norm(x + residual) * weight, x + residual) for x, residual [T, hidden]; without
    a residual the second is x itself."""
    inputs = (x, weight) if residual is None else (x, residual, weight)
    library = _library(*inputs)
    if library is None or x.dim() != 2:
        return None
    normed = torch.empty_like(x)
    total = x if residual is None else torch.empty_like(x)
    library.textgate_add_rms_norm(
        x.data_ptr(),
        None if residual is None else residual.data_ptr(),
        weight.data_ptr(),
        normed.data_ptr(),
        None if residual is None else total.data_ptr(),
        x.shape[0],
        x.shape[1],
        eps,
        _DTYPES[x.dtype],
    )
    return normed, total


def silu_and_mul(gate_up: Tensor) -> Tensor | None:
    """silu(gate) * up for gate_up [T, 2 * width] = [gate | up] → [T, width]."""
    library = _library(gate_up)
    if library is None or gate_up.dim() != 2:
        return None
    width = gate_up.shape[1] // 2
    out = gate_up.new_empty(gate_up.shape[0], width)
    library.textgate_silu_and_mul(
        gate_up.data_ptr(), out.data_ptr(), gate_up.shape[0], width, _DTYPES[gate_up.dtype]
    )
    return out


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
    """Rotate the queries and keys of qkv [T, (H_q + 2 H_kv) * D] (apply_rotary_signed with
    cos, sin_signed [T, D]), store keys and values at `slot_mapping` [T] of the caches
    [num_blocks, block_size, H_kv, D]; return the queries [T, H_q, D]."""
    library = _library(qkv, cos, sin_signed, key_cache, value_cache)
    if library is None or slot_mapping.dtype != torch.int64 or not slot_mapping.is_contiguous():
        return None
    num_tokens, head_dim = qkv.shape[0], key_cache.shape[-1]
    query = qkv.new_empty(num_tokens, num_heads, head_dim)
    library.textgate_rotary_and_store(
        qkv.data_ptr(),
        cos.data_ptr(),
        sin_signed.data_ptr(),
        slot_mapping.data_ptr(),
        key_cache.data_ptr(),
        value_cache.data_ptr(),
        query.data_ptr(),
        num_tokens,
        num_heads,
        num_kv_heads,
        head_dim,
        _DTYPES[qkv.dtype],
    )
    return query
