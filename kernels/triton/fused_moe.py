"""The sparse MoE block's experts as two Triton grouped matmuls, beside its PyTorch reference.

`fused_moe(hidden, gate_up, down, tokens, weights, counts)` runs the (token, expert)
pairs of `shard_server/layers/moe.py`'s `Routing` (sorted by expert) through stacked
SwiGLU experts, gate-up [E, 2 I, H] and down [E, H, I], and sums each token's top k:

1. each expert's run of pairs is cut into blocks of BLOCK_M (its last block partial), and
   a block → (expert, first pair, end of the expert's pairs) map is built on the device,
   for a grid sized by the most blocks any routing of P pairs can need (no host sync);
2. gate-up: each program gathers its block's token rows of `hidden` and computes a
   BLOCK_M × BLOCK_N tile of silu(gate) * up for one expert → [P, I] in pair order;
3. down: the same program over those rows and the down weights, each row times its
   routing weight, written in token order → [T, k, H];
4. the k rows of each token are summed (float32 accumulation, no atomics).

Every matmul accumulates in float32; results are rounded to the activations' dtype where
the PyTorch path (`reference_fused_moe`) rounds. `fused_moe` returns None where it does
not apply: off the `enabled_devices`, off CUDA unless triton interprets, dtypes other than
float16/bfloat16/float32 or mixed, no triton. The caller then runs its own path.
"""

from __future__ import annotations

import functools
import types

import torch
import torch.nn.functional as F
from torch import Tensor

from textgate.kernels.triton import interpreting, runs_on, triton_installed

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)

#: Devices the kernel runs on. CUDA only: on the CPU the grouped matmul or the per-expert
#: loop serves. Tests add "cpu" to run it in triton's interpreter.
enabled_devices: tuple[str, ...] = ("cuda",)

BLOCK_N = 64
BLOCK_K = 64


@functools.cache
def _programs() -> types.ModuleType:
    from textgate.kernels.triton import fused_moe_kernels

    return fused_moe_kernels


def _applies(hidden: Tensor, *tensors: Tensor) -> bool:
    dtype, device = hidden.dtype, hidden.device
    return (
        hidden.dim() == 2
        and dtype in FLOAT_DTYPES
        and device.type in enabled_devices
        and runs_on(hidden)
        and all(t.device == device and t.dtype == dtype for t in tensors)
        and all(t.stride(-1) == 1 for t in (hidden, *tensors))
        and triton_installed()
    )


def block_m_for(num_pairs: int, num_experts: int) -> int:
    """Rows per program: tl.dot needs 16 at least; more where experts get many pairs."""
    per_expert = num_pairs / num_experts
    return 16 if per_expert <= 16 else 32 if per_expert <= 32 else 64


def block_map(counts: Tensor, num_pairs: int, block_m: int) -> tuple[Tensor, Tensor, Tensor]:
    """(expert, first pair, end of the expert's pairs) of each row block, for pairs sorted
    by expert with `counts` [E] per expert; blocks past the last have expert -1."""
    num_experts = counts.numel()
    # Each active expert wastes under one block: at most min(E, P) of them are active.
    num_blocks = (num_pairs + min(num_experts, num_pairs) * (block_m - 1)) // block_m
    counts = counts.long()
    expert_blocks = (counts + block_m - 1) // block_m  # [E]
    block_ends = expert_blocks.cumsum(0)  # [E]
    blocks = torch.arange(num_blocks, device=counts.device)
    expert = torch.searchsorted(block_ends, blocks, right=True)  # [num_blocks]; E past the last
    known = expert.clamp(max=num_experts - 1)
    pair_starts = counts.cumsum(0) - counts  # [E]
    first_block = block_ends - expert_blocks  # [E]
    first = pair_starts[known] + (blocks - first_block[known]) * block_m
    end = pair_starts[known] + counts[known]
    return torch.where(expert < num_experts, expert, -1), first, end


def fused_moe(
    hidden: Tensor, gate_up: Tensor, down: Tensor, tokens: Tensor, weights: Tensor, counts: Tensor
) -> Tensor | None:
    """hidden [T, H] through the experts gate-up [E, 2 I, H] and down [E, H, I] for the
    pairs sorted by expert: `tokens` [T * k] and `weights` [T * k] of each pair, `counts`
    [E] pairs per expert → [T, H] each token's weighted sum (this rank's partial sum).
    Every token has k pairs (top-k picks k experts each). None where the kernel does not
    apply."""
    if not _applies(hidden, gate_up, down, weights):
        return None
    num_tokens, hidden_size = hidden.shape
    num_pairs, width = tokens.numel(), down.shape[2]
    num_experts = gate_up.shape[0]
    shapes = ((num_experts, 2 * width, hidden_size), (num_experts, hidden_size, width))
    if (tuple(gate_up.shape), tuple(down.shape)) != shapes:
        raise ValueError(
            f"experts gate-up {tuple(gate_up.shape)} and down {tuple(down.shape)} do not fit "
            f"hidden {hidden_size}"
        )
    if num_tokens == 0:
        return torch.zeros_like(hidden)
    top_k = num_pairs // num_tokens
    block_m = block_m_for(num_pairs, num_experts)
    block_expert, block_first, block_end = block_map(counts, num_pairs, block_m)
    # The output row of each pair: its place when the pairs are ordered by token.
    by_token = tokens.argsort(stable=True)
    dest = torch.empty_like(by_token).scatter_(
        0, by_token, torch.arange(num_pairs, device=tokens.device)
    )
    activated = hidden.new_empty(num_pairs, width)  # [P, I], pair order
    out = hidden.new_empty(num_pairs, hidden_size)  # [T * k, H], token order
    program = _programs().expert_matmul_kernel
    # The interpreter's bfloat16 dot is wrong; float32 wants an exact (not tf32) dot.
    upcast = interpreting() or hidden.dtype == torch.float32
    for gate_up_pass, a, w, result in (
        (True, hidden, gate_up, activated),
        (False, activated, down, out),
    ):
        n = result.shape[1]
        grid = (block_expert.numel(), -(-n // BLOCK_N))
        program[grid](
            a, w, result, tokens, dest, weights, block_expert, block_first, block_end,
            n, a.shape[1], a.stride(0), w.stride(0), w.stride(1), result.stride(0),
            GATE_UP=gate_up_pass, BLOCK_M=block_m, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K,
            UPCAST=upcast,
        )  # fmt: skip
    return out.view(num_tokens, top_k, hidden_size).sum(1)


def reference_fused_moe(
    hidden: Tensor, gate_up: Tensor, down: Tensor, tokens: Tensor, weights: Tensor, counts: Tensor
) -> Tensor:
    """What `fused_moe` computes, in PyTorch: one matmul pair per active expert over its
    pairs' token rows, each row times its weight, added into its token's row."""
    out = torch.zeros_like(hidden)
    start = 0
    for expert, count in enumerate(counts.tolist()):
        pairs = slice(start, start + count)
        start += count
        if not count:
            continue
        gate, up = (hidden[tokens[pairs]] @ gate_up[expert].T).chunk(2, dim=-1)
        rows = (F.silu(gate) * up) @ down[expert].T
        out.index_add_(0, tokens[pairs], rows * weights[pairs, None])
    return out
