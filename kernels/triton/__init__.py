"""textgate.kernels.triton: Triton kernels for the GPU path, each beside a PyTorch reference.

- `attention`: the "triton" attention backend (paged decode with split-K and a varlen
  prefill over the paged cache; programs in `attention_kernels`).
- `layers`: fused layer ops (residual add + RMSNorm, in-place rotary on q/k, SiLU·mul,
  KV-cache store by slot mapping; programs in `layer_kernels`).
- `int4_matmul`: the 4-bit GPTQ/AWQ matmul.
- `fused_moe`: a mixture-of-experts block as grouped matmuls over expert-sorted (token,
  expert) pairs (programs in `fused_moe_kernels`).
- `lora_sgmv`: LoRA updates of a step's rows sorted by adapter, Punica's SGMV shrink and
  expand (programs in `lora_sgmv_kernels`).
- `dot`: the float32-accumulating `tl.dot` the programs share.

The modules holding `@triton.jit` programs import triton, and are loaded on first use:
importing this package never needs triton. Triton compiles for CUDA GPUs; with
`TRITON_INTERPRET=1` set before triton is first imported it runs the same programs on
CPU tensors through its interpreter (slow; how the tests run without a GPU).
"""

from __future__ import annotations

import functools
import importlib.util
import os

import torch


@functools.cache
def triton_installed() -> bool:
    """Whether the `triton` package can be imported."""
    return importlib.util.find_spec("triton") is not None


def interpreting() -> bool:
    """Whether triton runs its programs in the interpreter (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


def unavailable_reason(device: torch.device | str) -> str | None:
    """Why the Triton kernels cannot run on `device`; None when they can."""
    device = torch.device(device)
    if not triton_installed():
        return "the 'triton' package is not installed (pip install triton)"
    if device.type == "cuda":
        return None
    if interpreting():
        return None
    return f"Triton kernels need a CUDA device (got {device.type}; TRITON_INTERPRET=1 runs them on the CPU, slowly)"


def runs_on(tensor: torch.Tensor) -> bool:
    """Whether the kernels take this tensor: on a CUDA device, or anywhere in the interpreter."""
    return tensor.is_cuda or interpreting()


def next_power_of_2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()
