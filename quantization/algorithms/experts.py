"""A mixture-of-experts block for the quantizers: each expert calibrated on the tokens routed to it.

transformers 5 keeps a block's experts fused in memory (`mlp.experts.gate_up_proj`
[E, 2 I, H], `down_proj` [E, H, I]) and runs them as `experts(hidden [T, H], top_k_index
[T, k], top_k_weights)`, after the router (`mlp.gate`) picked each token's experts. A hook
on that call sees exactly the tokens each expert receives, so expert e's gate/up Hessian is
built from its own tokens and its down projection's from their intermediate features
(before the routing weight, which scales the expert's output). The router and Qwen2-MoE's
`shared_expert_gate` are never quantized (as GPTQModel and vLLM keep them): their errors
would move tokens between experts.

The checkpoint stores experts one linear each, under the names its family's
`save_pretrained` writes and the shard's `layers/moe.py` loads (`CHECKPOINT_NAMES`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, cast

import torch
from torch import Tensor, nn

from textgate.kernels.packing import UnpackedWeight, dequantize
from textgate.quantization.algorithms.gptq_solver import HessianAccumulator, split_rows

log = logging.getLogger("textgate.quantization")


@dataclass(frozen=True)
class ExpertNames:
    """Where a family's checkpoint keeps a layer's experts: `<block>.experts.<e>.<linear>`."""

    block: str
    gate: str
    up: str
    down: str

    def expert(self, index: int) -> str:
        return f"{self.block}.experts.{index}"


#: By model type: the names on disk (transformers 5 renames them to `mlp.*` in memory).
CHECKPOINT_NAMES = {
    "mixtral": ExpertNames("block_sparse_moe", "w1", "w3", "w2"),
    "qwen2_moe": ExpertNames("mlp", "gate_proj", "up_proj", "down_proj"),
    "qwen3_moe": ExpertNames("mlp", "gate_proj", "up_proj", "down_proj"),
}


class FusedExperts:
    """One block's experts as transformers 5 holds them: gate_up [E, 2 I, H] (each expert's
    gate rows, then its up rows) and down [E, H, I]."""

    def __init__(self, module: nn.Module) -> None:
        gate_up, down = getattr(module, "gate_up_proj", None), getattr(module, "down_proj", None)
        if not isinstance(gate_up, Tensor) or not isinstance(down, Tensor):
            raise ValueError(f"{type(module).__name__} has no fused gate_up_proj/down_proj")
        num, hidden, inter = down.shape if down.dim() == 3 else (0, 0, 0)
        other_layout = getattr(module, "is_transposed", False) or getattr(module, "has_bias", False)
        if gate_up.shape != (num, 2 * inter, hidden) or num == 0 or other_layout:
            raise ValueError(
                f"{type(module).__name__}: gate_up_proj {tuple(gate_up.shape)} and down_proj "
                f"{tuple(down.shape)} are not the [E, 2I, H] / [E, H, I] layout without bias"
            )
        self.module = module
        self._gate_up, self._down = gate_up, down
        self._act = cast(Callable[[Tensor], Tensor], module.act_fn)
        self.num_experts, self.hidden_size, self.intermediate_size = num, hidden, inter

    def gate_up(self, expert: int) -> Tensor:
        return self._gate_up[expert]  # [2 I, H]

    def down(self, expert: int) -> Tensor:
        return self._down[expert]  # [H, I]

    def intermediate(self, expert: int, rows: Tensor) -> Tensor:
        """What the expert's down projection reads for `rows` [n, H]: act(gate) * up [n, I]."""
        gate, up = (rows @ self.gate_up(expert).T).chunk(2, dim=-1)
        return self._act(gate) * up

    def assign(self, expert: int, gate_up: Tensor, down: Tensor) -> None:
        """Replace one expert's float weights (by their quantized values)."""
        self._gate_up.data[expert] = gate_up
        self._down.data[expert] = down


def layer_experts(layer: nn.Module) -> FusedExperts | None:
    """The decoder layer's experts; None for a dense MLP."""
    experts = getattr(getattr(layer, "mlp", None), "experts", None)
    return None if experts is None else FusedExperts(experts)


class ExpertInputs:
    """Per expert of one block: the Hessians of its gate/up inputs (the tokens routed to
    it) and of its down projection's inputs, over the calibration set."""

    def __init__(self, experts: FusedExperts, min_tokens: int) -> None:
        self.experts, self.min_tokens = experts, min_tokens
        num = experts.num_experts
        self.routed = [HessianAccumulator(experts.hidden_size) for _ in range(num)]
        self.intermediate = [HessianAccumulator(experts.intermediate_size) for _ in range(num)]
        # Every token entering the block: the fallback for an expert that received few.
        self.every_token = HessianAccumulator(experts.hidden_size)

    def observe(self, hidden: Tensor, top_k_index: Tensor) -> None:
        """Fold in one call: hidden [T, H], each token's experts top_k_index [T, k]."""
        self.every_token.add(hidden)
        for expert in top_k_index.unique().tolist():
            if not 0 <= expert < self.experts.num_experts:
                continue  # an expert another (expert-parallel) rank owns, as transformers marks it
            rows = hidden[(top_k_index == expert).any(dim=-1)]  # [n, H]
            self.routed[expert].add(rows)
            self.intermediate[expert].add(self.experts.intermediate(expert, rows))

    @contextmanager
    def observing(self) -> Iterator[None]:
        """Observe every call of the experts while inside."""

        def hook(module: nn.Module, args: tuple[Any, ...], output: Tensor) -> None:
            hidden, top_k_index = args[0], args[1]
            self.observe(hidden.detach(), top_k_index)

        handle = self.experts.module.register_forward_hook(hook)
        try:
            yield
        finally:
            handle.remove()

    def num_tokens(self, expert: int) -> int:
        return self.routed[expert].num_rows

    def hessians(self, expert: int) -> tuple[Tensor, Tensor]:
        """(gate/up Hessian [H, H], down Hessian [I, I]) for GPTQ.

        An expert routed fewer than `min_tokens` tokens would fit its rounding to those
        few: its gate/up use every token's inputs instead (they share the block's input
        distribution, the router only partitions it), its down projection, whose inputs
        no other token measured, the identity (plain rounding).
        """
        if self.num_tokens(expert) >= self.min_tokens:
            return self.routed[expert].result(), self.intermediate[expert].result()
        return self.every_token.result(), torch.eye(self.experts.intermediate_size)

    def log_fallbacks(self, layer: str) -> None:
        few = {
            e: self.num_tokens(e)
            for e in range(self.experts.num_experts)
            if self.num_tokens(e) < self.min_tokens
        }
        if few:
            log.warning(
                "%s: %d of %d experts got fewer than %d calibration tokens %s: their gate/up "
                "are quantized on every token's inputs, their down projection rounded to nearest",
                layer,
                len(few),
                self.experts.num_experts,
                self.min_tokens,
                few,
            )


#: (weight [out, in], its inputs' Hessian [in, in], or None without calibration) -> codes.
Solver = Callable[[Tensor, Tensor | None], UnpackedWeight]


def quantize_experts(
    experts: FusedExperts, names: ExpertNames, solve: Solver, inputs: ExpertInputs | None
) -> dict[str, UnpackedWeight]:
    """Every expert's gate, up and down codes by checkpoint name (under the decoder layer);
    the block then computes with the quantized values."""
    quantized: dict[str, UnpackedWeight] = {}
    size = experts.intermediate_size
    for expert in range(experts.num_experts):
        gate_up_h, down_h = inputs.hessians(expert) if inputs is not None else (None, None)
        gate_up = solve(experts.gate_up(expert), gate_up_h)  # gate and up stacked: one input
        down = solve(experts.down(expert), down_h)
        gate, up = split_rows(gate_up, [size, size])
        at = names.expert(expert)
        quantized |= {
            f"{at}.{names.gate}": gate,
            f"{at}.{names.up}": up,
            f"{at}.{names.down}": down,
        }
        dtype = experts.gate_up(expert).dtype
        experts.assign(expert, dequantize(gate_up, dtype), dequantize(down, dtype))
    return quantized
