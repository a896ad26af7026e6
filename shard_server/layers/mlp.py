"""The gated MLP, `down(act(gate(x)) * up(x))`, of the dense Llama-family layers and of
the shared expert of Qwen2-MoE: SwiGLU (silu), or GeGLU (gelu, tanh form) for Gemma."""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor, nn

from textgate.kernels import cpu_layers
from textgate.kernels.triton import layers as gpu_layers
from textgate.quantization.weights import Weights
from textgate.shard_server.layers.tensor_parallel import (
    TensorParallelColumnLinear,
    TensorParallelRowLinear,
)


def silu_and_mul(gate_up: Tensor) -> Tensor:
    """[N, 2 I] (gate then up) → silu(gate) * up [N, I]: the C kernel on the CPU, Triton on
    the GPU, PyTorch elsewhere."""
    activated = cpu_layers.silu_and_mul(gate_up)  # None off the CPU
    if activated is None:
        activated = gpu_layers.silu_and_mul(gate_up)  # None off the GPU
    if activated is None:
        gate, up = gate_up.chunk(2, dim=-1)
        activated = F.silu(gate) * up
    return activated


def gelu_tanh_and_mul(gate_up: Tensor) -> Tensor:
    """[N, 2 I] (gate then up) → gelu(gate, tanh form) * up [N, I] (PyTorch everywhere)."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up


_ACTIVATIONS = {"silu": silu_and_mul, "gelu_pytorch_tanh": gelu_tanh_and_mul}


class GatedMLP(nn.Module):
    """SwiGLU with gate and up fused into one column linear (this rank's intermediate
    features); `reduce=False` leaves the down projection's partial sum for the caller to
    all-reduce together with others (the MoE block does, once per layer).

    `fused_size`, where given, is the intermediate size of a checkpoint that stores gate
    and up as one `gate_up_proj` (Phi-3): each half is split over the ranks on its own.
    `activation` is "silu" or "gelu_pytorch_tanh".
    """

    def __init__(
        self,
        weights: Weights,
        prefix: str,
        *,
        bias: bool,
        reduce: bool = True,
        fused_size: int | None = None,
        activation: str = "silu",
    ) -> None:
        super().__init__()
        self.act_and_mul = _ACTIVATIONS[activation]
        if fused_size is None:
            self.gate_up_proj = TensorParallelColumnLinear.load_multi(
                weights, [f"{prefix}.gate_proj", f"{prefix}.up_proj"], bias=bias
            )
        else:
            self.gate_up_proj = TensorParallelColumnLinear.load_fused(
                weights, f"{prefix}.gate_up_proj", bias=bias, sizes=[fused_size, fused_size]
            )
        self.down_proj = TensorParallelRowLinear.load(
            weights, f"{prefix}.down_proj", bias=bias, reduce=reduce
        )

    def forward(self, hidden: Tensor) -> Tensor:
        return self.down_proj(self.act_and_mul(self.gate_up_proj(hidden)))
