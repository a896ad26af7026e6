"""A layer's LoRA updates for a step in one C call (cpu_lora.c).

`LoraLayer.add` (shard_server/layers/lora.py) runs them through `CpuLoraForm.add` on the
CPU for every step: at a decode step's sizes PyTorch's gather, two batched matmuls and
index_add cost more in dispatch than the products do, and at a prompt's (4,096 rows
measured) the kernel's blocked dot products still beat `torch.bmm` over the rows padded
per adapter. The form is folded once per change of the layer's adapters: A of every slot [S, C, in]
(each fused part's columns side by side), and each part's B^T times its scale packed per
slot, so that a part multiplies only its own output columns.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch import Tensor

from textgate.kernels import cpu_build, cpu_isa

_DTYPES = {torch.float32: 0, torch.bfloat16: 1}


@dataclass(frozen=True)
class CpuLoraForm:
    """One layer's updates for the kernel: `a` [S, C, in]; `b` [S, block], each slot's parts'
    B^T [rank, width] (times the scale) one after the other; `parts` [P, 5] int64 (first
    low column, rank, first output column, width, offset in a slot's block); `slots` the
    slots (1-based) the layer has an update for."""

    a: Tensor
    b: Tensor
    parts: Tensor
    slots: frozenset[int]

    @classmethod
    def of(
        cls, updates: Mapping[int, list[tuple[int, int, Tensor, Tensor, float]]]
    ) -> CpuLoraForm | None:
        """The form of `updates` (slot -> [(start, end, A [r, in], B [end - start, r], scale)]),
        None where the kernel cannot run it (not on the CPU, not float32/bfloat16, no C
        kernels here, or x86's portable build of them)."""
        first = next(iter(updates.values()))[0][2]
        if first.device.type != "cpu" or first.dtype not in _DTYPES:
            return None
        if cpu_build.load_library() is None:
            return None
        level = cpu_build.loaded_level()
        # x86's portable build (SSE2: no 8-wide vectors, no cheap bf16 widening) ran the
        # bfloat16 updates slower than torch.bmm does: the batched matmuls serve it.
        if level is None or (level == "portable" and cpu_isa.is_x86()):
            return None
        ranges = sorted({(start, end) for parts in updates.values() for start, end, *_ in parts})
        rank = {r: 0 for r in ranges}
        for parts in updates.values():
            for start, end, a, _, _ in parts:
                rank[(start, end)] = max(rank[(start, end)], a.shape[0])
        table, column, offset = [], 0, 0
        where: dict[tuple[int, int], tuple[int, int]] = {}
        for start, end in ranges:
            r = rank[(start, end)]
            table.append((column, r, start, end - start, offset))
            where[(start, end)] = (column, offset)
            column, offset = column + r, offset + r * (end - start)
        num_slots = max(updates)
        a_all = first.new_zeros(num_slots, column, first.shape[1])
        b_all = first.new_zeros(num_slots, offset)
        for slot, parts in updates.items():
            for start, end, a, b, scale in parts:
                c0, off = where[(start, end)]
                r, width = a.shape[0], end - start
                a_all[slot - 1, c0 : c0 + r] = a
                # B^T [r, width] in the part's [rank, width] block (rows past r stay 0).
                block = b_all[slot - 1, off : off + rank[(start, end)] * width]
                block.view(rank[(start, end)], width)[:r] = (b * scale).T
        parts_tensor = torch.tensor(table, dtype=torch.int64)
        return cls(a_all, b_all, parts_tensor, frozenset(updates))

    def add(self, x: Tensor, out: Tensor, row_slot: Tensor) -> Tensor | None:
        """`out` [T, width] plus each row's update, in place, for x [T, in]; `row_slot` [T]
        int64: the row's slot - 1, or -1 (no update here). None where the kernel cannot take
        these tensors (another dtype than the form's, not contiguous): the caller runs its
        PyTorch path."""
        if (
            x.dtype != self.a.dtype
            or out.dtype != x.dtype
            or not (x.is_contiguous() and out.is_contiguous())
            or x.device.type != "cpu"
        ):
            return None
        library = cpu_build.load_library()
        if library is None:
            return None
        rows = x.shape[0]
        low = torch.empty(rows, self.a.shape[1], dtype=torch.float32)
        library.textgate_lora_add(
            x.data_ptr(),
            out.data_ptr(),
            rows,
            x.shape[1],
            out.shape[1],
            row_slot.data_ptr(),
            self.a.data_ptr(),
            self.a.shape[1],
            self.b.data_ptr(),
            self.b.shape[1],
            self.parts.data_ptr(),
            self.parts.shape[0],
            low.data_ptr(),
            _DTYPES[x.dtype],
        )
        return out
