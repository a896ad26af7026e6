"""The quantized KV cache's layout and its PyTorch reference ops (`--kv-cache-dtype`).

Values of `--kv-cache-dtype` (TGI and vLLM spell them this way):
  auto            the model's dtype, unquantized (the default)
  int8            symmetric int8, torch.int8
  fp8, fp8_e4m3   float8 e4m3 (OCP "fn" variant: no infinities, max 448), torch.float8_e4m3fn

Layout, per layer (block_size slots per block, slot = block_id * block_size + offset):
  key/value cache   [num_blocks, block_size, num_kv_heads, head_dim]   int8 or float8_e4m3fn
  key/value scales  [num_blocks, block_size, num_kv_heads]             float32
The cache tensors have exactly the shape of an unquantized cache; the scales add one
float32 per (slot, kv head). Each token's head vector x [head_dim] is quantized on its
own when it is stored, so writing a token never touches another token's values:
  scale = max(|x|) * (1 / QMAX)        QMAX = 127 (int8), 448 (fp8 e4m3); float32 math
  q     = round(x / scale)             int8: round half to even, then clamp to [-127, 127]
          (x / scale).to(float8_e4m3fn)  fp8: round to nearest even, clamped to [-448, 448]
  x'    = float(q) * scale             dequantized, in float32, then cast to the compute dtype
(q is computed as x * (1 / scale), clamped, then rounded; the C store in cpu_attention.c
repeats these float32 operations in this order and writes the same bits.)
An all-zero vector gets scale 0 and q 0 (never a division by zero), so zeroed caches
dequantize to zeros like unquantized ones: unwritten slots are finite.

Readers (attention backends) receive the scales beside the caches:
`AttentionBackend.forward(query, key_cache, value_cache, plan, *, scale, sliding_window,
key_scales=None, value_scales=None)`; the scales are None for an unquantized cache.
A backend that reads quantized caches says so with `supports_quantized_kv = True`.

fp8 tensors are moved through uint8 views (`.view(torch.uint8)`): PyTorch on the CPU has
no index_copy_ for float8.
"""

from __future__ import annotations

import torch
from torch import Tensor

#: The accepted `--kv-cache-dtype` values.
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3", "int8")

_QUANTIZED = {"int8": torch.int8, "fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn}

#: Largest magnitude a quantized element holds, per cache dtype.
QMAX: dict[torch.dtype, float] = {torch.int8: 127.0, torch.float8_e4m3fn: 448.0}


def resolve_kv_cache_dtype(name: str, model_dtype: torch.dtype) -> torch.dtype:
    """The cache's element dtype for a `--kv-cache-dtype` value (auto: the model's dtype)."""
    if name == "auto":
        return model_dtype
    if name not in _QUANTIZED:
        raise ValueError(
            f"unknown KV cache dtype {name!r}; expected one of: {', '.join(KV_CACHE_DTYPES)}"
        )
    return _QUANTIZED[name]


def is_quantized(dtype: torch.dtype) -> bool:
    """Whether a cache of `dtype` stores quantized values with per-token scales."""
    return dtype in QMAX


def kv_dtype_name(dtype: torch.dtype) -> str:
    """How logs and /info name a cache dtype: int8, fp8_e4m3, or the float dtype's name."""
    if dtype == torch.float8_e4m3fn:
        return "fp8_e4m3"
    return str(dtype).removeprefix("torch.")


def quantize_kv(x: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """x [..., head_dim] (any float dtype) → (q [..., head_dim] of `dtype`, scale [...] float32)."""
    if dtype not in QMAX:
        raise ValueError(f"{dtype} is not a quantized KV cache dtype")
    qmax = QMAX[dtype]
    x = x.float()
    scale = x.abs().amax(dim=-1) * (1.0 / qmax)  # [...]
    inverse = torch.where(scale > 0, 1.0 / scale, torch.zeros_like(scale))
    scaled = (x * inverse[..., None]).clamp_(-qmax, qmax)
    if dtype == torch.int8:
        return scaled.round_().to(torch.int8), scale
    return scaled.to(dtype), scale


def dequantize_kv(q: Tensor, scale: Tensor, dtype: torch.dtype) -> Tensor:
    """q [..., head_dim] with scale [...] → values [..., head_dim] in `dtype`."""
    return (q.float() * scale[..., None]).to(dtype)


def store_kv(cache: Tensor, scales: Tensor, x: Tensor, slot_mapping: Tensor) -> None:
    """Quantize x [T, H_kv, D] and write it to slots slot_mapping [T] of
    cache [num_blocks, block_size, H_kv, D] and scales [num_blocks, block_size, H_kv]."""
    heads, dim = cache.shape[2], cache.shape[3]
    q, scale = quantize_kv(x, cache.dtype)
    slots = slot_mapping.long()
    _bytes(cache).view(-1, heads, dim).index_copy_(0, slots, _bytes(q))
    scales.view(-1, heads).index_copy_(0, slots, scale)


def gather_dequantized(cache: Tensor, scales: Tensor, blocks: Tensor, dtype: torch.dtype) -> Tensor:
    """Blocks `blocks` [n] of cache [N, bs, H, D] / scales [N, bs, H] → [n, bs, H, D] in `dtype`."""
    q = _bytes(cache).index_select(0, blocks).view(cache.dtype)
    return dequantize_kv(q, scales.index_select(0, blocks), dtype)


def _bytes(t: Tensor) -> Tensor:
    """fp8 as its uint8 bits (CPU PyTorch cannot index_copy_ float8); others unchanged."""
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t
