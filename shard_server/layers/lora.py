"""LoRA adapters over a native model: many at once, mixed in one step (`--lora-adapters`).

An adapter is a PEFT folder (`adapter_config.json`, `adapter_model.safetensors`): for
each targeted linear W a pair A [r, in], B [out, r], and the update
`x @ A.T @ B.T * scale` (scale = lora_alpha / r, or / sqrt(r) with `use_rslora`).

The base layer runs once over the whole step, then the adapters' updates are added in
place (`LoraLayer.add`). Which rows use which adapter is the step's `LoraRows`, set
around the forward pass (`lora_rows`); without it, or when no row uses an adapter, a
layer is its base alone. A fused layer (q/k/v, gate/up) keeps one update per part,
folded into one pair whose B is block-diagonal over the parts. How a step's updates run:

- on the CPU, every step: one C call per layer (kernels/cpu_lora.c), each row through its
  own adapter's A, then each fused part through that adapter's part of B only, added into
  the output in place;
- on the CPU (`BATCHED_DEVICES`) where that kernel cannot run (no C compiler, x86's
  portable build, float16): the rows of each adapter gathered into one
  batch, padded to the largest adapter's rows, and two batched matmuls through every
  adapter's folded pair at once (`torch.bmm`: x @ A.T, then @ B.T), added back into
  their rows; a row computes only its own adapter's products (the block-diagonal B of a
  fused layer aside), in four ops per layer however many adapters;
- elsewhere, a step of few rows (decodes, short chunks; `DENSE_MAX_ROWS`): every row
  through every adapter's A at once (one matmul), the columns of other adapters zeroed,
  then one matmul per fused part through all its adapters' B's, added into the output;
- on CUDA, the Triton SGMV kernels over the rows sorted by adapter
  (kernels/triton/lora_sgmv.py);
- otherwise two grouped matmuls over the rows sorted by adapter where `F.grouped_mm`
  runs, else one pair of matmuls per adapter on its rows only.

Under tensor parallelism each rank holds its share of every update, split as the base
layer's weight is (`place`): a column-parallel layer's rows of B, a row-parallel layer's
columns of A, whose partial update joins the partial sum before the all-reduce.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from textgate.kernels.cpu_lora import CpuLoraForm
from textgate.kernels.linear import FastLinear
from textgate.kernels.triton.lora_sgmv import lora_sgmv_add, supports
from textgate.quantization.weights import Shard
from textgate.shard_server.layers.lora_adapter import TARGETS, LoraAdapter, LoraError
from textgate.shard_server.layers.moe import GROUPED_MM, grouped_mm_runs
from textgate.shard_server.layers.step_local import StepLocal
from textgate.shard_server.layers.tensor_parallel import (
    TensorParallelColumnLinear,
    TensorParallelRowLinear,
)

BATCHED_DEVICES: tuple[str, ...] = ("cpu",)
"""Devices whose steps run the adapters' updates as two batched matmuls over the rows
padded per adapter (see the module docstring). On the CPU it beats the dense form at
every row count, since a row no longer multiplies the other adapters' columns (the
embedded model's layers at 32 decode rows over four rank-16 adapters, one core: 363 vs
612 us per decoder layer, 2-core AMD EPYC Zen 4), and `F.grouped_mm` (~10 ms a call on a
1024-row prefill there) by far."""

DENSE_MAX_ROWS = 128
"""Off `BATCHED_DEVICES`, steps of at most this many rows run every row through every
adapter (see the module docstring). Past it the products wasted on the other adapters'
columns grow with the rows, and a long prompt's chunk sorts its rows instead."""


@dataclass(frozen=True)
class LoraRows:
    """One step's rows by adapter: slot -> the rows [R] (int64) that use it (base rows,
    slot 0, are not listed); and all of them sorted by slot (`order`), with each slot's
    end in that order (`ends`, for slots 1..the largest used), for the grouped matmul;
    each row's slot (`slots` [T]) for the dense path."""

    groups: Mapping[int, Tensor]
    order: Tensor
    ends: Tensor
    slots: Tensor
    _masks: dict[tuple[tuple[int, int], ...], Tensor] = field(
        default_factory=dict, compare=False, repr=False
    )
    _batches: dict[tuple[int, torch.dtype], _Batch | None] = field(
        default_factory=dict, compare=False, repr=False
    )
    _kernel_slots: dict[frozenset[int], Tensor] = field(
        default_factory=dict, compare=False, repr=False
    )

    @property
    def dense(self) -> bool:
        """The step runs every row through every adapter (few rows)."""
        return self.slots.shape[0] <= DENSE_MAX_ROWS

    def mask(self, layout: tuple[tuple[int, int], ...], dtype: torch.dtype) -> Tensor:
        """[T, C] 1 where row t's adapter owns column c of a dense layer whose columns are
        `layout` ((slot, rank), ... in order), else 0; made once per layout and step."""
        mask = self._masks.get(layout)
        if mask is None:
            owners = torch.cat(
                [torch.full((rank,), slot, dtype=torch.int64) for slot, rank in layout]
            ).to(self.slots.device)
            mask = (self.slots[:, None] == owners[None, :]).to(dtype)
            self._masks[layout] = mask
        return mask

    def kernel_slots(self, slots: frozenset[int]) -> Tensor:
        """[T] int64 for the CPU kernel of a layer with updates for `slots`: each row's slot
        - 1 where the layer has its update, else -1; made once per set of slots and step."""
        index = self._kernel_slots.get(slots)
        if index is None:
            index = torch.tensor(
                [slot - 1 if slot in slots else -1 for slot in self.slots.tolist()],
                dtype=torch.int64,
            )
            self._kernel_slots[slots] = index
        return index

    def batch(self, num_slots: int, dtype: torch.dtype) -> _Batch | None:
        """The rows of slots 1..`num_slots` (a layer's stacked pairs) gathered per slot for
        the batched matmuls (None: no row uses one of them); made once per count and step."""
        key = (num_slots, dtype)
        if key not in self._batches:
            self._batches[key] = _Batch.of(self.groups, num_slots, dtype)
        return self._batches[key]

    @classmethod
    def from_slots(cls, slots: Sequence[int], device: torch.device) -> LoraRows | None:
        """Rows by slot for a step whose row i uses adapter slot `slots[i]` (0: base);
        None when no row uses one."""
        if not any(slots):
            return None
        by_slot: dict[int, list[int]] = {}
        for row, slot in enumerate(slots):
            if slot:
                by_slot.setdefault(slot, []).append(row)
        order: list[int] = []
        ends: list[int] = []
        for slot in range(1, max(by_slot) + 1):
            order += by_slot.get(slot, [])
            ends.append(len(order))

        def tensor(values: list[int], dtype: torch.dtype = torch.int64) -> Tensor:
            return torch.tensor(values, dtype=dtype, device=device)

        groups = {s: tensor(r) for s, r in by_slot.items()}
        return cls(groups, tensor(order), tensor(ends, torch.int32), tensor(list(slots)))


@dataclass(frozen=True)
class _Batch:
    """A step's rows of some adapter slots, one batch entry per slot used, for
    `LoraLayer`'s batched path: `index` [U * R] the rows of the used slots in turn, each
    slot's padded to R (the most any of them has) with row 0; `slots` [U] which of a
    layer's stacked pairs each entry takes (None: all of them, in order); `valid` [U, R, 1]
    1 on real rows, 0 on the padding (None: no padding), so that padding adds zeros."""

    index: Tensor
    slots: Tensor | None
    valid: Tensor | None
    num_rows: int

    @classmethod
    def of(cls, groups: Mapping[int, Tensor], num_slots: int, dtype: torch.dtype) -> _Batch | None:
        used = [slot for slot in sorted(groups) if slot <= num_slots]
        if not used:
            return None
        device = groups[used[0]].device
        num_rows = max(groups[slot].shape[0] for slot in used)
        index = torch.zeros(len(used), num_rows, dtype=torch.int64, device=device)
        valid = torch.zeros(len(used), num_rows, 1, dtype=dtype, device=device)
        for entry, slot in enumerate(used):
            rows = groups[slot]
            index[entry, : rows.shape[0]] = rows
            valid[entry, : rows.shape[0]] = 1
        padded = any(groups[slot].shape[0] < num_rows for slot in used)
        every = used == list(range(1, num_slots + 1))
        picked = None if every else torch.tensor([s - 1 for s in used], device=device)
        return cls(index.view(-1), picked, valid if padded else None, num_rows)


_ROWS: StepLocal[LoraRows] = StepLocal("textgate_lora_rows")


def lora_rows(rows: LoraRows | None) -> contextlib.AbstractContextManager[None]:
    """Run a forward pass whose LoRA layers read `rows`."""
    return _ROWS.bound(rows)


@dataclass(frozen=True)
class _DenseUpdates:
    """One layer's updates for the dense path: every (part, slot) A stacked part by part
    (`a`, packed for the CPU's matmul library: [C, in]), which slot owns how many of those
    C columns in order (`layout`), and per part the output columns it updates with its
    slots' B's (times their scales) side by side, transposed: (start, end, first column,
    end column, B^T [c1 - c0, end - start])."""

    a: FastLinear
    layout: tuple[tuple[int, int], ...]
    expands: tuple[tuple[int, int, int, int, Tensor], ...]

    @classmethod
    def of(
        cls, updates: Mapping[int, list[tuple[int, int, Tensor, Tensor, float]]]
    ) -> _DenseUpdates:
        by_part: dict[tuple[int, int], list[tuple[int, Tensor, Tensor]]] = {}
        for slot, parts in sorted(updates.items()):
            for start, end, a, b, scale in parts:
                by_part.setdefault((start, end), []).append((slot, a, b * scale))
        rows: list[Tensor] = []
        layout: list[tuple[int, int]] = []
        expands: list[tuple[int, int, int, int, Tensor]] = []
        for (start, end), entries in sorted(by_part.items()):
            first = sum(rank for _, rank in layout)
            rows += [a for _, a, _ in entries]
            layout += [(slot, a.shape[0]) for slot, a, _ in entries]
            b_t = torch.cat([b for _, _, b in entries], dim=1).T.contiguous()
            expands.append((start, end, first, first + b_t.shape[0], b_t))
        return cls(FastLinear(torch.cat(rows)), tuple(layout), tuple(expands))

    def add(self, x: Tensor, out: Tensor, rows: LoraRows) -> Tensor:
        """`out` [T, out] plus every row's update, in place: one matmul through every A,
        the columns of the other adapters zeroed, then one per part through its B's (a
        block-diagonal B would multiply its zeros too)."""
        low = self.a(x).mul_(rows.mask(self.layout, x.dtype))  # [T, C]
        for start, end, first, last, b_t in self.expands:
            out[:, start:end].addmm_(low[:, first:last], b_t)
        return out


@dataclass
class LoraLayer:
    """The adapters' updates of one native layer of `out_features` outputs.

    `updates`: slot -> [(columns start, end, A, B, scale)], one entry per fused part the
    adapter targets. The forms a step runs are folded from them when first needed (`fused`:
    each slot's parts in one pair, so a step runs two matmuls per adapter and layer however
    many parts it updates; `dense`; `stacked`), and forgotten when they change (`fuse`)."""

    out_features: int
    updates: dict[int, list[tuple[int, int, Tensor, Tensor, float]]] = field(default_factory=dict)
    _fused: dict[int, tuple[Tensor, Tensor]] | None = None
    """Each slot's folded pair (None: not folded since the last change)."""
    _stacked: tuple[Tensor, Tensor] | None = None
    """Every slot's pair zero-padded to one rank and stacked (slot 1 first), where the
    batched path, the grouped matmul or the SGMV kernel runs: A [S, r, in], B [S, out, r]."""
    _stacked_folded: bool = False
    _dense: _DenseUpdates | None = None
    _cpu: CpuLoraForm | None = None
    _cpu_folded: bool = False

    def fuse(self) -> None:
        """Forget the folded forms (after an adapter came or went). Each is folded again
        when a step first runs it, so the step after a swap pays only for the form it runs
        (a decode step the dense one, a long prompt's chunk the stacked one)."""
        self._fused, self._stacked, self._stacked_folded, self._dense = None, None, False, None
        self._cpu, self._cpu_folded = None, False

    def fused(self) -> dict[int, tuple[Tensor, Tensor]]:
        """Each slot's parts folded into one pair: A stacked [sum r, in], B (times scale)
        block-diagonal [out, sum r]."""
        if self._fused is None:
            self._fused = {}
            for slot, parts in self.updates.items():
                a = torch.cat([part[2] for part in parts])  # [sum r, in]
                b = a.new_zeros(self.out_features, a.shape[0])
                offset = 0
                for start, end, part_a, part_b, scale in parts:
                    rank = part_a.shape[0]
                    b[start:end, offset : offset + rank] = part_b * scale
                    offset += rank
                self._fused[slot] = (a, b)
        return self._fused

    def dense(self) -> _DenseUpdates | None:
        """The dense path's form of every update (None: the layer has none)."""
        if self._dense is None and self.updates:
            self._dense = _DenseUpdates.of(self.updates)
        return self._dense

    def cpu_form(self) -> CpuLoraForm | None:
        """The C kernel's form of every update (None: not on the CPU, or no kernels here)."""
        if not self._cpu_folded:
            self._cpu = CpuLoraForm.of(self.updates) if self.updates else None
            self._cpu_folded = True
        return self._cpu

    def stacked(self) -> tuple[Tensor, Tensor] | None:
        """Every slot's pair stacked, where the batched path, the grouped matmul (16-byte
        aligned rows) or the SGMV kernel runs; None elsewhere."""
        if not self._stacked_folded:
            self._stacked, self._stacked_folded = self._stack(), True
        return self._stacked

    def _stack(self) -> tuple[Tensor, Tensor] | None:
        """Stacked straight from the updates (each slot's parts side by side in A's rows
        and B's block-diagonal columns), without the per-slot fused pairs' copies."""
        if not self.updates:
            return None
        first = next(iter(self.updates.values()))[0][2]
        inputs, size = first.shape[1], first.element_size()
        aligned = all(n * size % 16 == 0 for n in (inputs, self.out_features))
        grouped = aligned and grouped_mm_runs(first.dtype, first.device)
        if not grouped and not supports(first) and first.device.type not in BATCHED_DEVICES:
            return None
        ranks = [sum(part[2].shape[0] for part in parts) for parts in self.updates.values()]
        rank = -(-max(ranks) // 4) * 4
        a_all = first.new_zeros(max(self.updates), rank, inputs)
        b_all = first.new_zeros(max(self.updates), self.out_features, rank)
        for slot, parts in self.updates.items():
            offset = 0
            for start, end, a, b, scale in parts:
                part_rank = a.shape[0]
                a_all[slot - 1, offset : offset + part_rank] = a
                b_all[slot - 1, start:end, offset : offset + part_rank] = b
                b_all[slot - 1, start:end, offset : offset + part_rank] *= scale
                offset += part_rank
        return a_all, b_all

    def add(self, x: Tensor, out: Tensor) -> Tensor:
        """`out` (the base layer's output for inputs `x` [T, in]) plus every row's update."""
        rows = _ROWS.get()
        if rows is None:
            return out
        if x.device.type == "cpu":
            form = self.cpu_form()
            if form is not None:
                done = form.add(x, out, rows.kernel_slots(form.slots))
                if done is not None:
                    return done
        if x.device.type in BATCHED_DEVICES and not supports(x):
            stacked = self.stacked()
            assert stacked is not None  # folded for these devices
            return self._add_batched(x, out, rows, *stacked)
        dense = self.dense() if rows.dense else None
        if dense is not None:
            return dense.add(x, out, rows)
        stacked = self.stacked()
        if stacked is not None:
            done = lora_sgmv_add(x, out, rows.order, rows.ends, *stacked)
            if done is not None:
                return done
            if GROUPED_MM is not None:
                return self._add_grouped(x, out, rows, *stacked)
        fused = self.fused()
        for slot, index in rows.groups.items():
            pair = fused.get(slot)
            if pair is not None:
                a, b = pair
                out.index_add_(0, index, (x.index_select(0, index) @ a.T) @ b.T)
        return out

    def _add_batched(self, x: Tensor, out: Tensor, rows: LoraRows, a: Tensor, b: Tensor) -> Tensor:
        """Every adapter's rows at once: gathered per slot (padded to one count), then
        x @ A.T and @ B.T as two batched matmuls over the slots, added back into the rows."""
        batch = rows.batch(a.shape[0], x.dtype)
        if batch is None:
            return out
        if batch.slots is not None:  # some slots have no row in this step
            a, b = a.index_select(0, batch.slots), b.index_select(0, batch.slots)
        xs = x.index_select(0, batch.index).view(a.shape[0], batch.num_rows, x.shape[1])
        low = torch.bmm(xs, a.transpose(1, 2))  # [U, R, rank]
        if batch.valid is not None:
            low.mul_(batch.valid)
        up = torch.bmm(low, b.transpose(1, 2))  # [U, R, out]
        return out.index_add_(0, batch.index, up.view(-1, out.shape[1]))

    def _add_grouped(self, x: Tensor, out: Tensor, rows: LoraRows, a: Tensor, b: Tensor) -> Tensor:
        """All adapters' rows at once: two grouped matmuls over the rows sorted by slot."""
        assert GROUPED_MM is not None
        slots, ends, order = a.shape[0], rows.ends, rows.order
        if ends.shape[0] > slots:  # rows of adapters this layer has no update for
            order = order[: int(ends[slots - 1])]
            ends = ends[:slots]
        elif ends.shape[0] < slots:  # adapters of this layer no row uses
            ends = torch.cat([ends, ends[-1:].expand(slots - ends.shape[0])])
        low = GROUPED_MM(x.index_select(0, order), a.transpose(1, 2), offs=ends)
        return out.index_add_(0, order, GROUPED_MM(low, b.transpose(1, 2), offs=ends))


@dataclass(frozen=True)
class Placement:
    """One of an adapter's updates checked against the layer it goes to and cut to this
    rank's share of it: that layer (`holder`, whose `lora` it joins), its fused output size
    on this rank and the part's columns there."""

    holder: torch.nn.Module
    out_features: int
    start: int
    end: int
    a: Tensor
    b: Tensor

    def to(self, device: torch.device) -> Placement:
        """The same update with A and B on `device` (itself where they are there already)."""
        if self.a.device == device and self.b.device == device:
            return self
        a, b = (t.to(device, non_blocking=True) for t in (self.a, self.b))
        return dataclasses.replace(self, a=a, b=b)

    def pinned(self) -> Placement:
        """The same update in pinned host memory, so that attaching it copies asynchronously."""
        return dataclasses.replace(self, a=self.a.pin_memory(), b=self.b.pin_memory())


def place(model: torch.nn.Module, adapter: LoraAdapter) -> list[Placement]:
    """Where each of `adapter`'s updates goes in a native model's layers; changes nothing.

    Every update is checked against its layer's whole shapes (LoraError naming the
    adapter, the layer and both), then split over the ranks as the layer is (`_split`)."""
    layers = model.layers  # type: ignore[attr-defined]
    placements = []
    for (index, target), (a, b) in adapter.weights.items():
        if index >= len(layers):
            raise LoraError(
                f"LoRA adapter {adapter.name!r} targets layer {index}; the model has {len(layers)}"
            )
        holder_name, part = TARGETS[target]
        try:
            holder = layers[index].get_submodule(holder_name)
        except AttributeError:
            raise LoraError(
                f"LoRA adapter {adapter.name!r} targets {target} of layer {index}, which "
                "has none: its MLP is a mixture of experts, and LoRA on experts is not "
                "supported (adapters on its attention are)"
            ) from None
        in_features, sizes = _layout(model.config, holder_name)  # type: ignore[attr-defined]
        start = 0 if part is None else sum(sizes[:part])
        end = sum(sizes) if part is None else start + sizes[part]
        if a.shape[1] != in_features or b.shape != (end - start, a.shape[0]):
            raise LoraError(
                f"LoRA adapter {adapter.name!r} layer {index} {target}: A {tuple(a.shape)} "
                f"and B {tuple(b.shape)} do not fit the base layer ({in_features} inputs, "
                f"{end - start} outputs)"
            )
        placements.append(_split(holder, part, sizes, a, b))
    return placements


def place_modules(
    model: torch.nn.Module, adapter: LoraAdapter, head: torch.nn.Module | None = None
) -> list[Placement]:
    """Where each of `adapter`'s updates goes in a model run by transformers' own modules
    (one shard, so nothing is split): the linear layer at its path, whole; changes nothing.
    `head` (the output head, which runs on the sampled rows only, not the step's) is refused,
    as is any module that is not a linear layer or whose shapes do not fit."""
    placements = []
    for path, (a, b) in adapter.modules.items():
        try:
            holder = model.get_submodule(path)
        except AttributeError:
            raise LoraError(
                f"LoRA adapter {adapter.name!r} targets {path}, which the model does not have"
            ) from None
        if holder is head or not isinstance(holder, torch.nn.Linear):
            what = "the output head" if holder is head else f"a {type(holder).__name__}"
            raise LoraError(
                f"LoRA adapter {adapter.name!r} targets {path}, {what}; supported: the "
                "linear layers inside the model's decoder layers"
            )
        if a.shape[1] != holder.in_features or b.shape != (holder.out_features, a.shape[0]):
            raise LoraError(
                f"LoRA adapter {adapter.name!r} {path}: A {tuple(a.shape)} and B "
                f"{tuple(b.shape)} do not fit the base layer ({holder.in_features} inputs, "
                f"{holder.out_features} outputs)"
            )
        placements.append(Placement(holder, holder.out_features, 0, holder.out_features, a, b))
    return placements


def _add_to_output(module: torch.nn.Module, inputs: tuple[Tensor, ...], output: Tensor) -> Tensor:
    """A transformers linear layer's forward hook: its output [..., out] plus the step's
    updates of its inputs [..., in] (the step's rows in order: one row of T tokens)."""
    layer: LoraLayer | None = module.lora  # type: ignore[assignment]
    if layer is None:
        return output
    x = inputs[0]
    out = layer.add(x.reshape(-1, x.shape[-1]), output.reshape(-1, output.shape[-1]))
    return out.view(output.shape)


def _split(
    holder: torch.nn.Module, part: int | None, sizes: list[int], a: Tensor, b: Tensor
) -> Placement:
    """Part `part`'s update A [r, in], B [sizes[part], r] (None: the whole fused layer's,
    B [sum(sizes), r]) cut as `holder`'s weight was at load (its `layout`, the ranges the
    loader read): a row-parallel layer takes its input columns of A and all of B, since the
    ranks' partial x @ A.T sum to the whole one before B (the layer adds its update before
    the all-reduce); a column-parallel layer all of A and its output rows of B, part by part
    (q/k/v by head, gate/up each on its own; a whole fused B is cut into its parts, each cut,
    and joined again in the rank's order)."""
    if isinstance(holder, TensorParallelRowLinear):
        columns = holder.layout.part(0, a.shape[1])
        a = a[:, columns.start : columns.stop].contiguous()  # [r, in / ranks]
        return Placement(holder, sizes[0], 0, sizes[0], a, b)
    assert isinstance(holder, TensorParallelColumnLinear)  # the fused q/k/v and gate/up
    local = [holder.layout.part(i, size) for i, size in enumerate(sizes)]
    out_features = sum(shard.size for shard in local)
    if part is None:  # [sum(sizes), r] -> this rank's rows of each part, in order
        pieces = b.split(sizes)
        b = torch.cat([piece[s.start : s.stop] for piece, s in zip(pieces, local, strict=True)])
        return Placement(holder, out_features, 0, out_features, a, b)
    start = sum(shard.size for shard in local[:part])
    b = _rows(b, local[part])  # [this rank's outputs of the part, r]
    return Placement(holder, out_features, start, start + b.shape[0], a, b)


def _rows(tensor: Tensor, shard: Shard) -> Tensor:
    """Rows `shard` of `tensor`, copied when they are a part, so the whole can be freed."""
    if (shard.start, shard.stop) == (0, tensor.shape[0]):
        return tensor
    return tensor[shard.start : shard.stop].clone()


def apply(
    slot: int, scale: float, placements: Sequence[Placement], fold: bool = True
) -> list[LoraLayer]:
    """Add an adapter's checked updates (`place`, on the model's device) to its layers under
    `slot`, which must be free, and fold each layer's pairs again (unless not `fold`: the
    caller folds the layers returned, once for several changes)."""
    touched: dict[int, LoraLayer] = {}
    for p in placements:
        if not hasattr(p.holder, "lora"):  # a transformers module: updates join by a hook
            p.holder.lora = None
            p.holder.register_forward_hook(_add_to_output)
        if p.holder.lora is None:
            p.holder.lora = LoraLayer(p.out_features)
        p.holder.lora.updates.setdefault(slot, []).append((p.start, p.end, p.a, p.b, scale))
        touched[id(p.holder)] = p.holder.lora
    if fold:
        for layer in touched.values():
            layer.fuse()
    return list(touched.values())


def attach(
    model: torch.nn.Module, adapters: Sequence[LoraAdapter], first_slot: int = 1
) -> dict[str, int]:
    """Add `adapters` to a native model's layers (slots first_slot, first_slot + 1, ...,
    which must be free); their slots by name. Every adapter is checked (`place`) before
    any layer changes."""
    placed = [(adapter, place(model, adapter)) for adapter in adapters]
    slots: dict[str, int] = {}
    for slot, (adapter, placements) in enumerate(placed, start=first_slot):
        apply(slot, adapter.scale, placements)
        slots[adapter.name] = slot
    return slots


def detach(model: torch.nn.Module, slot: int, fold: bool = True) -> list[LoraLayer]:
    """Remove slot `slot`'s updates from every layer; a layer left with none is its base
    alone again. The layers left with others are folded again (unless not `fold`: the
    caller folds the layers returned)."""
    touched = []
    for module in model.modules():
        layer = getattr(module, "lora", None)
        if isinstance(layer, LoraLayer) and layer.updates.pop(slot, None) is not None:
            if layer.updates:
                touched.append(layer)
            else:
                module.lora = None
    if fold:
        for layer in touched:
            layer.fuse()
    return touched


def _layout(config: object, holder: str) -> tuple[int, list[int]]:
    """(inputs, output sizes of its fused parts) of a Llama-family layer, whole (before
    tensor parallelism splits it)."""
    hidden = config.hidden_size  # type: ignore[attr-defined]
    q = config.num_heads * config.head_dim  # type: ignore[attr-defined]
    kv = config.num_kv_heads * config.head_dim  # type: ignore[attr-defined]
    inner = config.intermediate_size  # type: ignore[attr-defined]
    return {
        "self_attn.qkv_proj": (hidden, [q, kv, kv]),
        "self_attn.o_proj": (q, [hidden]),
        "mlp.gate_up_proj": (hidden, [inner, inner]),
        "mlp.down_proj": (inner, [hidden]),
    }[holder]
