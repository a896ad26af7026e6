"""Every adapter's LoRA update of one layer as two Triton segmented matmuls (Punica's SGMV), beside its PyTorch reference.

`sgmv_add(x, y, a, b, segments)` adds to the base layer's output y [T, N], on each
segment's rows only, the update `x[rows] @ A[s].T @ B[s].T * scale` of its adapter s, with
every adapter's pair stacked: A [S, r, K], B [S, N, r] (a smaller rank zero-padded):

1. the rows are sorted by adapter (`Segments.rows`) and cut into runs, one adapter each
   (-1: none, left alone); each run is cut into blocks of BLOCK_M rows (its last block
   partial) and a block → (adapter, first position, end of its run) map is built on the
   device, for a grid sized by the most blocks any R sorted rows can need (no host sync);
2. shrink: each program gathers its block's rows of x, times its adapter's A → [R, r];
3. expand: each program multiplies a BLOCK_N slice of its adapter's B into those and adds
   the tile into y's rows in place (each row is in one run: no atomics).

Two launches, not one: expand spreads over y's columns (thousands) where a fused program
per row block would walk them all alone, and a decode step has only a few row blocks.
Every matmul accumulates in float32 and rounds to the activations' dtype where the
PyTorch path (`reference_sgmv_add`) rounds. The entry points return None where they do not
apply: off the `enabled_devices`, off CUDA unless triton interprets, dtypes other than
float16/bfloat16/float32 or mixed, no triton. The caller then runs its own path.
`lora_sgmv_add` takes what `shard_server/layers/lora.py` holds: `LoraRows.order`/`ends`.
"""

from __future__ import annotations

import functools
import types
from dataclasses import dataclass

import torch
from torch import Tensor

from textgate.kernels.triton import interpreting, next_power_of_2, runs_on, triton_installed
from textgate.kernels.triton.fused_moe import block_m_for

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)

#: Devices the kernels run on. CUDA only: on the CPU the grouped matmul or the per-adapter
#: loop serves. Tests add "cpu" to run them in triton's interpreter.
enabled_devices: tuple[str, ...] = ("cuda",)

BLOCK_N = 64
BLOCK_K = 64
MAX_BLOCK_R = 64  # ranks past it take more programs (shrink) or more steps (expand)


@functools.cache
def _programs() -> types.ModuleType:
    from textgate.kernels.triton import lora_sgmv_kernels

    return lora_sgmv_kernels


@dataclass(frozen=True)
class RowBlocks:
    """Segments cut into blocks of `block_m` sorted positions, one program each: block i
    is positions first[i] .. min(first[i] + block_m, end[i]) of adapter slot[i]; slot -1
    past the last block (the grid is sized for the most any segmentation can need)."""

    rows: Tensor  # [R] int64, the row of x and y at each sorted position
    slot: Tensor  # [num_blocks] int64
    first: Tensor  # [num_blocks] int64
    end: Tensor  # [num_blocks] int64
    block_m: int


@dataclass(frozen=True)
class Segments:
    """Rows sorted by adapter, cut into runs: run i is the sorted positions starts[i] ..
    ends[i] (rows[starts[i]:ends[i]] of x and y), of adapter slots[i] (an index into the
    stacked weights; -1: no adapter, its rows left alone). Runs do not overlap."""

    rows: Tensor  # [R] int64
    starts: Tensor  # [G] int64
    ends: Tensor  # [G] int64
    slots: Tensor  # [G] int64

    @classmethod
    def from_ends(cls, order: Tensor, ends: Tensor, num_adapters: int) -> Segments:
        """lora.py's `LoraRows`: `order` [R] the rows sorted by slot, `ends` [G] each
        slot's end in it (slot 1 first); slot g + 1 is stacked adapter g, and slots past
        `num_adapters` (adapters this layer has no update for) have none."""
        ends = ends.long()
        starts = torch.cat([ends.new_zeros(1), ends[:-1]])
        slots = torch.arange(ends.numel(), device=ends.device)
        return cls(order, starts, ends, torch.where(slots < num_adapters, slots, -1))

    def blocks(self, block_m: int | None = None) -> RowBlocks:
        """The block → (adapter, first position, end of its run) map, on the device."""
        num_rows, num_runs = self.rows.numel(), self.slots.numel()
        block_m = block_m or block_m_for(num_rows, max(num_runs, 1))
        counts = torch.where(self.slots >= 0, self.ends - self.starts, 0)  # [G]
        run_blocks = (counts + block_m - 1) // block_m  # [G]; none for runs without adapter
        block_ends = run_blocks.cumsum(0)  # [G]
        # Each run wastes under one block: at most min(G, R) of them have rows.
        num_blocks = (num_rows + min(num_runs, num_rows) * (block_m - 1)) // block_m
        blocks = torch.arange(num_blocks, device=self.rows.device)
        run = torch.searchsorted(block_ends, blocks, right=True)  # [num_blocks]; G past the last
        known = run.clamp(max=max(num_runs - 1, 0))
        first = self.starts[known] + (blocks - (block_ends - run_blocks)[known]) * block_m
        slot = torch.where(run < num_runs, self.slots[known], -1)
        return RowBlocks(self.rows, slot, first, self.ends[known], block_m)


def supports(tensor: Tensor) -> bool:
    """Whether the kernels take activations and weights like `tensor` (dtype, device):
    where a layer should keep its pairs stacked for them."""
    return (
        tensor.dtype in FLOAT_DTYPES
        and tensor.device.type in enabled_devices
        and runs_on(tensor)
        and triton_installed()
    )


def _applies(x: Tensor, index: Tensor, *tensors: Tensor) -> bool:
    return (
        x.dim() == 2
        and supports(x)
        and index.device == x.device
        and all(t.device == x.device and t.dtype == x.dtype for t in tensors)
        and all(t.stride(-1) == 1 for t in (x, *tensors))
    )


def _check(x: Tensor, y: Tensor, a: Tensor, b: Tensor) -> None:
    num_adapters, rank = a.shape[0], a.shape[1]
    if (
        a.dim() != 3
        or tuple(b.shape) != (num_adapters, y.shape[1], rank)
        or (x.shape[0], a.shape[2]) != (y.shape[0], x.shape[1])
    ):
        raise ValueError(
            f"LoRA A {tuple(a.shape)} and B {tuple(b.shape)} do not fit inputs "
            f"{tuple(x.shape)} and outputs {tuple(y.shape)}"
        )


def _block_r(rank: int) -> int:
    """Ranks per step: tl.dot needs 16 at least; a smaller rank is masked."""
    return min(max(16, next_power_of_2(rank)), MAX_BLOCK_R)


def _upcast(x: Tensor) -> bool:
    # The interpreter's bfloat16 dot is wrong; float32 wants an exact (not tf32) dot.
    return interpreting() or x.dtype == torch.float32


def sgmv_shrink(x: Tensor, a: Tensor, blocks: RowBlocks) -> Tensor | None:
    """x [T, K] rows of each block @ its adapter's A [S, r, K] transposed → [R, r] in
    sorted order, x's dtype (zero where no adapter). None where the kernel does not apply."""
    if not _applies(x, blocks.rows, a):
        return None
    num_adapters, rank, inputs = a.shape
    v = x.new_zeros(blocks.rows.numel(), rank)  # [R, r]
    if v.numel() == 0 or num_adapters == 0:
        return v
    block_r = _block_r(rank)
    grid = (blocks.slot.numel(), -(-rank // block_r))
    _programs().sgmv_shrink_kernel[grid](
        x, a, v, blocks.rows, blocks.slot, blocks.first, blocks.end,
        rank, inputs, x.stride(0), a.stride(0), a.stride(1), v.stride(0),
        BLOCK_M=blocks.block_m, BLOCK_R=block_r, BLOCK_K=BLOCK_K, UPCAST=_upcast(x),
    )  # fmt: skip
    return v


def sgmv_expand(
    v: Tensor, b: Tensor, y: Tensor, blocks: RowBlocks, scale: float = 1.0
) -> Tensor | None:
    """y [T, N] plus, on each block's rows, v [R, r] @ its adapter's B [S, N, r]
    transposed times `scale`, in place → y. None where the kernel does not apply."""
    if not _applies(v, blocks.rows, b, y):
        return None
    num_adapters, outputs, rank = b.shape
    if v.shape[0] == 0 or num_adapters == 0 or outputs == 0:
        return y
    grid = (blocks.slot.numel(), -(-outputs // BLOCK_N))
    _programs().sgmv_expand_kernel[grid](
        v, b, y, blocks.rows, blocks.slot, blocks.first, blocks.end,
        outputs, rank, v.stride(0), b.stride(0), b.stride(1), y.stride(0), scale,
        BLOCK_M=blocks.block_m, BLOCK_N=BLOCK_N, BLOCK_R=_block_r(rank), UPCAST=_upcast(v),
    )  # fmt: skip
    return y


def sgmv_add(
    x: Tensor, y: Tensor, a: Tensor, b: Tensor, segments: Segments, scale: float = 1.0
) -> Tensor | None:
    """y [T, N] (the base layer's output for x [T, K]) plus each segment's update
    x[rows] @ A[s].T @ B[s].T * scale, A [S, r, K] and B [S, N, r] stacked, in place → y.
    None where the kernels do not apply."""
    if not _applies(x, segments.rows, y, a, b):
        return None
    _check(x, y, a, b)
    blocks = segments.blocks()
    v = sgmv_shrink(x, a, blocks)
    assert v is not None  # x and a passed _applies
    return sgmv_expand(v, b, y, blocks, scale)


def lora_sgmv_add(
    x: Tensor, out: Tensor, order: Tensor, ends: Tensor, a: Tensor, b: Tensor
) -> Tensor | None:
    """`LoraLayer.add` over its stacked pairs A [S, r, in], B [S, out, r] (scale folded
    into B): `out` [T, out] plus the update of every row in `order` (`LoraRows`), in
    place → out. None where the kernels do not apply (off CUDA, by default)."""
    if not _applies(x, order, out, a, b):
        return None
    return sgmv_add(x, out, a, b, Segments.from_ends(order, ends, a.shape[0]))


def reference_sgmv_add(
    x: Tensor, y: Tensor, a: Tensor, b: Tensor, segments: Segments, scale: float = 1.0
) -> Tensor:
    """What `sgmv_add` computes, in PyTorch: one matmul pair per segment with an adapter,
    its update added into its rows of y in place → y."""
    bounds = zip(
        segments.starts.tolist(), segments.ends.tolist(), segments.slots.tolist(), strict=True
    )
    for start, end, slot in bounds:
        if slot < 0 or start == end:
            continue
        rows = segments.rows[start:end]
        y.index_add_(0, rows, ((x[rows] @ a[slot].T) @ b[slot].T) * scale)
    return y
