"""A sparse mixture-of-experts MLP: a router sends each token to its top-k SwiGLU experts.

The tokens of a step are grouped by expert, so every active expert runs once over all
of its tokens (one gate-up and one down matmul), never once per token. Plain experts are
stacked into 3D tensors and the groups run as one grouped matmul (`F.grouped_mm`)
where this torch runs it for the weights' dtype and device and the step has at least as
many (token, expert) pairs as experts, and as one matmul per active expert otherwise; quantized experts (GPTQ, AWQ, int8, ...) keep their
loader's linear layers, one call per active expert. On CUDA, stacked experts run as
Triton's fused MoE kernel instead (`kernels/triton/fused_moe.py`).

Tensor parallel: each expert's intermediate features are split over the ranks (gate/up
column-parallel, down row-parallel, as in a dense MLP); the partial sums of the routed
experts and of the shared expert are all-reduced once per layer.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from textgate.kernels.triton.fused_moe import fused_moe
from textgate.quantization.base import Weight
from textgate.quantization.unquantized import UnquantizedWeight
from textgate.quantization.weights import Weights
from textgate.shard_server.layers.mlp import GatedMLP, silu_and_mul
from textgate.shard_server.layers.tensor_parallel import (
    TensorParallelColumnLinear,
    TensorParallelRowLinear,
    all_reduce,
)

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup


@dataclass(frozen=True)
class ExpertNames:
    """Where a family keeps its experts: `<prefix>.<experts>.<i>.<gate|up|down>`."""

    router: str
    experts: str
    gate: str
    up: str
    down: str


NAMES = {
    "mixtral": ExpertNames("gate", "experts", "w1", "w3", "w2"),
    "qwen": ExpertNames("gate", "experts", "gate_proj", "up_proj", "down_proj"),
}


@dataclass(frozen=True)
class Routing:
    """Each token's experts and weights, flattened and sorted by expert."""

    #: [T * k] the token of each (token, expert) pair, in expert order.
    tokens: Tensor
    #: [T * k] the weight of each pair, in expert order.
    weights: Tensor
    #: [num_experts] how many pairs each expert has (the groups, in order).
    counts: Tensor

    @classmethod
    def top_k(cls, logits: Tensor, k: int, normalize: bool, dtype: torch.dtype) -> Routing:
        """Softmax (float32) over the router's logits [T, E], its top k per token,
        renormalised to sum to 1 when `normalize`, weights cast to `dtype`."""
        probs = torch.softmax(logits.float(), dim=-1)
        weights, experts = torch.topk(probs, k, dim=-1)  # [T, k]
        if normalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        flat = experts.flatten()
        order = flat.argsort(stable=True)
        return cls(
            tokens=order // k,
            weights=weights.to(dtype).flatten().index_select(0, order),
            counts=torch.bincount(flat, minlength=logits.shape[-1]),
        )


class Experts(Protocol):
    def __call__(self, rows: Tensor, counts: Tensor) -> Tensor:
        """The rows [P, H] of each group, in expert order → the experts' outputs [P, H]
        (this rank's partial sums)."""
        ...


class StackedExperts(nn.Module):
    """Plain experts as two 3D tensors: gate-up [E, 2 I, H] and down [E, H, I]."""

    def __init__(self, gate_up: Tensor, down: Tensor) -> None:
        super().__init__()
        self.gate_up = nn.Parameter(gate_up, requires_grad=False)
        self.down = nn.Parameter(down, requires_grad=False)
        # The grouped matmul wants every row of its operands 16-byte aligned: hidden and
        # this rank's intermediate size (an uneven tensor-parallel split may not be).
        row_bytes = [down.shape[1] * down.element_size(), down.shape[2] * down.element_size()]
        aligned = all(size % 16 == 0 for size in row_bytes)
        self.grouped = aligned and grouped_mm_runs(gate_up.dtype, gate_up.device)

    def forward(self, rows: Tensor, counts: Tensor) -> Tensor:
        # Fewer pairs than experts (a decode step of a few sequences): most groups hold
        # one row, and one matmul per active expert beats the grouped one's overhead.
        if self.grouped and rows.shape[0] >= counts.shape[0]:
            grouped_mm = GROUPED_MM
            assert grouped_mm is not None
            ends = counts.cumsum(0, dtype=torch.int32)
            gate_up = grouped_mm(rows, self.gate_up.transpose(1, 2), offs=ends)
            return grouped_mm(silu_and_mul(gate_up), self.down.transpose(1, 2), offs=ends)
        out = torch.empty_like(rows)
        for expert, start, end in active_groups(counts):
            gate_up = rows[start:end] @ self.gate_up[expert].T
            out[start:end] = silu_and_mul(gate_up) @ self.down[expert].T
        return out


class LinearExperts(nn.Module):
    """Experts as their loader's linear layers (quantized ones), one call per active expert."""

    def __init__(self, gate_up: Sequence[nn.Module], down: Sequence[nn.Module]) -> None:
        super().__init__()
        self.gate_up = nn.ModuleList(gate_up)
        self.down = nn.ModuleList(down)

    def forward(self, rows: Tensor, counts: Tensor) -> Tensor:
        out = torch.empty_like(rows)
        for expert, start, end in active_groups(counts):
            gate_up = self.gate_up[expert](rows[start:end])
            out[start:end] = self.down[expert](silu_and_mul(gate_up))
        return out


def active_groups(counts: Tensor) -> list[tuple[int, int, int]]:
    """(expert, start, end) of every non-empty group of rows sorted by expert."""
    groups, start = [], 0
    for expert, count in enumerate(counts.tolist()):
        if count:
            groups.append((expert, start, start + count))
        start += count
    return groups


GROUPED_MM: Callable[..., Tensor] | None = getattr(
    F, "grouped_mm", getattr(torch, "_grouped_mm", None)
)
"""`F.grouped_mm` (torch >= 2.10), else the private `torch._grouped_mm` it grew from."""

_GROUPED_MM: dict[tuple[torch.dtype, str], bool] = {}


def grouped_mm_runs(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether the grouped matmul runs, and agrees with plain matmuls, for `dtype` on
    `device` (probed once per pair: its support varies by build, device and dtype)."""
    key = (dtype, device.type)
    if key not in _GROUPED_MM:
        _GROUPED_MM[key] = _probe_grouped_mm(dtype, device)
    return _GROUPED_MM[key]


def _probe_grouped_mm(dtype: torch.dtype, device: torch.device) -> bool:
    grouped_mm = GROUPED_MM
    if grouped_mm is None:
        return False
    generator = torch.Generator().manual_seed(0)
    rows = torch.randn(5, 16, generator=generator).to(device, dtype)
    weights = torch.randn(3, 32, 16, generator=generator).to(device, dtype)
    ends = torch.tensor([2, 2, 5], dtype=torch.int32, device=device)
    try:
        got = grouped_mm(rows, weights.transpose(1, 2), offs=ends)
    except (RuntimeError, NotImplementedError, TypeError):
        return False
    want = torch.cat([rows[:2] @ weights[0].T, rows[2:] @ weights[2].T])
    return bool(torch.allclose(got.float(), want.float(), atol=0.05, rtol=0.02))


class SparseMoE(nn.Module):
    """Router, experts and the optional shared expert of one layer (this rank's part)."""

    def __init__(
        self,
        router: Tensor,
        experts: Experts,
        *,
        top_k: int,
        normalize_top_k: bool,
        process_group: ProcessGroup | None,
        shared: tuple[GatedMLP, Tensor] | None = None,
    ) -> None:
        super().__init__()
        self.router = nn.Parameter(router, requires_grad=False)  # [E, H], every rank
        self.experts = experts
        self.top_k, self.normalize_top_k = top_k, normalize_top_k
        self.process_group = process_group
        self.shared_expert = shared[0] if shared else None
        self.shared_gate = nn.Parameter(shared[1], requires_grad=False) if shared else None

    @classmethod
    def load(
        cls,
        weights: Weights,
        prefix: str,
        *,
        num_experts: int,
        top_k: int,
        normalize_top_k: bool,
        naming: str,
        shared_expert: bool = False,
    ) -> SparseMoE:
        """The block under `prefix` (`...mlp` or `...block_sparse_moe`), named as `naming`
        says (a key of NAMES); Qwen2-MoE's `shared_expert` and its `shared_expert_gate`."""
        names = NAMES[naming]
        experts = load_experts(weights, f"{prefix}.{names.experts}", num_experts, names)
        shared = None
        if shared_expert:
            mlp = GatedMLP(weights, f"{prefix}.shared_expert", bias=False, reduce=False)
            shared = (mlp, weights.get_tensor(f"{prefix}.shared_expert_gate.weight"))
        return cls(
            weights.get_tensor(f"{prefix}.{names.router}.weight"),
            experts,
            top_k=top_k,
            normalize_top_k=normalize_top_k,
            process_group=weights.process_group,
            shared=shared,
        )

    def forward(self, hidden: Tensor) -> Tensor:
        """hidden [T, H] → the weighted sum of each token's experts (and the shared one)."""
        logits = hidden @ self.router.T  # [T, E]
        routing = Routing.top_k(logits, self.top_k, self.normalize_top_k, hidden.dtype)
        out = self._routed(hidden, routing)
        if self.shared_expert is not None and self.shared_gate is not None:
            # The gate scales every rank's partial sum alike: one all-reduce covers both.
            scale = torch.sigmoid(hidden @ self.shared_gate.T)  # [T, 1]
            out = out + scale * self.shared_expert(hidden)
        return all_reduce(out, self.process_group)

    def _routed(self, hidden: Tensor, routing: Routing) -> Tensor:
        """The routed experts' weighted sums [T, H]: the fused kernel where it runs (None
        off CUDA), else the rows grouped by expert through `self.experts`."""
        experts = self.experts
        if isinstance(experts, StackedExperts):
            pairs = (routing.tokens, routing.weights, routing.counts)
            fused = fused_moe(hidden, experts.gate_up, experts.down, *pairs)
            if fused is not None:
                return fused
        rows = hidden.index_select(0, routing.tokens)  # [T * k, H], grouped by expert
        outputs = self.experts(rows, routing.counts) * routing.weights[:, None]
        return torch.zeros_like(hidden).index_add_(0, routing.tokens, outputs)


def load_experts(weights: Weights, prefix: str, num_experts: int, names: ExpertNames) -> Experts:
    """Experts 0..num_experts-1 under `prefix`: stacked when the loader reads them as plain
    weights, its linear layers otherwise."""
    gate_up, down = [], []
    for expert in range(num_experts):
        at = f"{prefix}.{expert}"
        gate_up.append(weights.get_multi_weights_col([f"{at}.{names.gate}", f"{at}.{names.up}"]))
        down.append(weights.get_weights_row(f"{at}.{names.down}"))
    if all(isinstance(w, UnquantizedWeight) for w in [*gate_up, *down]):
        return StackedExperts(_stacked(gate_up), _stacked(down))
    return LinearExperts(
        [TensorParallelColumnLinear(w.get_linear(None)) for w in gate_up],
        [TensorParallelRowLinear(w.get_linear(None), None) for w in down],
    )


def _stacked(parts: Sequence[Weight]) -> Tensor:
    return torch.stack([cast(UnquantizedWeight, part).weight for part in parts])
