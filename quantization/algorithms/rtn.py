"""The integer grid every algorithm here shares, and round-to-nearest (RTN) on it.

A layer's weight W [out, in] is cut into groups of `group_size` input columns; each
(group, output row) pair gets a scale and an integer zero point, and every weight becomes
the code `q = clamp(round(w / scale) + zero, 0, 2**bits - 1)` standing for
`scale * (q - zero)`. GPTQ and AWQ change *which* weights are rounded (error feedback,
per-channel rescaling), never the grid itself, so they share `fit_grid` and
`quantize_codes` with RTN; their results are `UnpackedWeight`s as `kernels.packing`
describes, ready for `pack_gptq` / `pack_awq`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from textgate.kernels.packing import GPTQ_BITS, UnpackedWeight


@dataclass(frozen=True)
class QuantSpec:
    """What the grid looks like: bit width, inputs per group, symmetric or not."""

    bits: int = 4
    #: Input columns sharing one scale and zero; -1: one group spanning every input.
    group_size: int = 128
    #: Symmetric: the zero point sits mid-range (2**(bits-1)) for every group.
    sym: bool = False

    def __post_init__(self) -> None:
        if self.bits not in GPTQ_BITS:
            raise ValueError(f"bits must be one of {GPTQ_BITS}, got {self.bits}")
        if self.group_size != -1 and self.group_size <= 0:
            raise ValueError(f"group_size must be positive or -1, got {self.group_size}")

    @property
    def maxq(self) -> int:
        """The largest code, 2**bits - 1."""
        return (1 << self.bits) - 1

    def group_size_for(self, in_features: int) -> int:
        """Inputs per group for a layer with `in_features` inputs."""
        return in_features if self.group_size == -1 else self.group_size

    def g_idx(self, in_features: int) -> Tensor:
        """The group of every input [in] (int32): consecutive groups, the last one may be short.

        Layers whose inputs do not divide into whole groups (576 inputs in groups of 128)
        keep a short last group, as GPTQ's layout allows (ceil(in / group_size) groups).
        """
        return (torch.arange(in_features) // self.group_size_for(in_features)).to(torch.int32)


@dataclass(frozen=True)
class Grid:
    """Scales and zero points [rows] (or [rows, 1]) for one group of columns."""

    scale: Tensor
    zero: Tensor  # integer-valued float, in [0, maxq]


def fit_grid(weight: Tensor, spec: QuantSpec) -> Grid:
    """The min/max grid of each row of `weight` [rows, cols] (one group per row).

    The range always includes 0 (as GPTQ's quantizer does), so zero is a whole code.
    Scales are rounded to float16, the precision checkpoints store them in, so what an
    algorithm rounds against is exactly what a loader will rebuild.
    """
    weight = weight.float()
    zeros = torch.zeros(weight.shape[0], device=weight.device)
    xmin = torch.minimum(weight.min(dim=1).values, zeros)
    xmax = torch.maximum(weight.max(dim=1).values, zeros)
    if spec.sym:
        xmax = torch.maximum(xmin.abs(), xmax)
        xmin = -xmax
    flat = (xmin == 0) & (xmax == 0)
    xmin, xmax = torch.where(flat, -1.0, xmin), torch.where(flat, 1.0, xmax)
    scale = ((xmax - xmin) / spec.maxq).half().float()
    scale = torch.where(scale > 0, scale, torch.finfo(torch.float16).tiny)
    if spec.sym:
        zero = torch.full_like(scale, (spec.maxq + 1) // 2)
    else:
        zero = torch.round(-xmin / scale).clamp(0, spec.maxq)
    return Grid(scale, zero)


def quantize_codes(weight: Tensor, scale: Tensor, zero: Tensor, maxq: int) -> Tensor:
    """Integer codes (as floats) of `weight` on the grid; scale/zero broadcast against it."""
    return torch.clamp(torch.round(weight / scale) + zero, 0, maxq)


def fake_quantize(weight: Tensor, scale: Tensor, zero: Tensor, maxq: int) -> Tensor:
    """`weight` rounded onto the grid and mapped back to floats."""
    return scale * (quantize_codes(weight, scale, zero, maxq) - zero)


def _grouped(weight: Tensor, spec: QuantSpec) -> Tensor:
    """`weight` [out, in] as [out, groups, group_size] floats; a short last group is padded
    with zeros, which change no grid (its range includes 0) and are sliced off after."""
    out_features, in_features = weight.shape
    size = spec.group_size_for(in_features)
    padded = F.pad(weight.float(), (0, -in_features % size))
    return padded.view(out_features, -1, size)


def _codes_and_grid(weight: Tensor, spec: QuantSpec) -> tuple[Tensor, Tensor, Tensor]:
    """Codes [out, groups, size] and the grid's scale and zero [out, groups, 1]."""
    grouped = _grouped(weight, spec)
    out_features, num_groups, size = grouped.shape
    grid = fit_grid(grouped.reshape(-1, size), spec)
    scale = grid.scale.view(out_features, num_groups, 1)
    zero = grid.zero.view(out_features, num_groups, 1)
    return quantize_codes(grouped, scale, zero, spec.maxq), scale, zero


def _ungrouped(grouped: Tensor, in_features: int) -> Tensor:
    """[out, groups, size] back to [out, in_features] (padding dropped)."""
    return grouped.reshape(grouped.shape[0], -1)[:, :in_features]


def grouped_grid(weight: Tensor, spec: QuantSpec) -> tuple[Tensor, Tensor]:
    """Scales and zeros [groups, out] of the consecutive input groups of `weight` [out, in]."""
    _, scale, zero = _codes_and_grid(weight, spec)
    return scale.squeeze(-1).T.contiguous(), zero.squeeze(-1).T.contiguous()


def fake_quantize_grouped(weight: Tensor, spec: QuantSpec) -> Tensor:
    """RTN of `weight` [out, in] in consecutive groups, back in floats (AWQ's search uses it)."""
    codes, scale, zero = _codes_and_grid(weight, spec)
    return _ungrouped(scale * (codes - zero), weight.shape[1])


def rtn_quantize(weight: Tensor, spec: QuantSpec) -> UnpackedWeight:
    """Round-to-nearest of `weight` [out, in] in consecutive groups: the baseline."""
    codes, scale, zero = _codes_and_grid(weight, spec)
    return UnpackedWeight(
        intweight=_ungrouped(codes, weight.shape[1]).to(torch.int32).contiguous(),
        scales=scale.squeeze(-1).T.contiguous(),  # [groups, out]
        zeros=zero.squeeze(-1).T.to(torch.int32).contiguous(),
        g_idx=spec.g_idx(weight.shape[1]),
    )
