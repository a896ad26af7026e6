"""GPTQ (Frantar et al., 2022): round one input column at a time, push its error onto the rest.

For a layer y = W x, the loss ||W X - Q X||² over calibration inputs X has Hessian
H = 2 X Xᵀ. Quantizing column j adds error e_j = (w_j - q_j) / [H⁻¹]_jj, which the
columns not yet quantized absorb through row j of the (upper Cholesky factor of the)
inverse Hessian. Columns go in blocks: inside a block the update is applied column by
column, the rest of the matrix receives the block's errors in one matmul.
"""

from __future__ import annotations

import torch
from torch import Tensor

from textgate.kernels.packing import UnpackedWeight
from textgate.quantization.algorithms.rtn import QuantSpec, fit_grid, quantize_codes


class HessianAccumulator:
    """The running H = 2/n Σ x xᵀ of a layer's inputs x [in_features] over n rows."""

    def __init__(self, in_features: int) -> None:
        self.hessian = torch.zeros(in_features, in_features, dtype=torch.float64)
        self.num_rows = 0

    def add(self, inputs: Tensor) -> None:
        """Fold in a batch of inputs [..., in_features]."""
        rows = inputs.reshape(-1, inputs.shape[-1]).float()
        total = self.num_rows + rows.shape[0]
        self.hessian *= self.num_rows / total
        # The product in float32 (fast), the running sum in float64 (no drift over batches).
        self.hessian += (2.0 / total) * (rows.T @ rows).double()
        self.num_rows = total

    def result(self) -> Tensor:
        """H [in, in] in float32."""
        if self.num_rows == 0:
            raise ValueError("no calibration inputs reached this layer")
        return self.hessian.float()


def gptq_quantize(
    weight: Tensor,
    hessian: Tensor,
    spec: QuantSpec,
    *,
    desc_act: bool = False,
    percdamp: float = 0.01,
    block_size: int = 128,
) -> UnpackedWeight:
    """Quantize `weight` [out, in] given its inputs' Hessian [in, in].

    `desc_act` (act-order) visits columns by decreasing diag(H), the inputs with the most
    energy first; groups then follow that order, and `g_idx` records each column's group.
    `percdamp` adds that fraction of mean(diag(H)) to the diagonal so the inverse exists.
    """
    in_features = weight.shape[1]
    if hessian.shape != (in_features, in_features):
        raise ValueError(f"hessian {tuple(hessian.shape)} does not match weight {weight.shape}")
    W, hinv, perm = _prepare(weight, hessian, desc_act, percdamp)
    group_size = spec.group_size_for(in_features)
    codes, scales, zeros = _quantize_columns(W, hinv, spec, group_size, block_size)
    g_idx = spec.g_idx(in_features)  # the group of each column, in visit order
    if perm is not None:
        inverse = torch.argsort(perm)
        codes, g_idx = codes[:, inverse], g_idx[inverse].contiguous()
    return UnpackedWeight(
        intweight=codes.to(torch.int32),
        scales=scales,
        zeros=zeros.to(torch.int32),
        g_idx=g_idx,
    )


def _prepare(
    weight: Tensor, hessian: Tensor, desc_act: bool, percdamp: float
) -> tuple[Tensor, Tensor, Tensor | None]:
    """W [out, in] and the upper Cholesky factor of the damped H⁻¹ [in, in], both in visit
    order, and that order (None: the natural one)."""
    in_features = weight.shape[1]
    W = weight.detach().float().clone()
    H = hessian.detach().float().clone()
    dead = torch.diag(H) == 0  # inputs that were always zero: any value is exact
    H[dead, dead] = 1.0
    W[:, dead] = 0.0
    perm = torch.argsort(torch.diag(H), descending=True) if desc_act else None
    if perm is not None:
        W, H = W[:, perm], H[perm][:, perm]
    H += percdamp * torch.mean(torch.diag(H)) * torch.eye(in_features)
    return W, _upper_inverse_cholesky(H), perm


def _quantize_columns(
    W: Tensor, hinv: Tensor, spec: QuantSpec, group_size: int, block_size: int
) -> tuple[Tensor, Tensor, Tensor]:
    """Codes [out, in], scales and zeros [groups, out]: W's columns quantized in order, each
    one's error spread over the columns after it (W is updated in place)."""
    out_features, in_features = W.shape
    codes = torch.zeros_like(W)
    scales = torch.zeros(-(-in_features // group_size), out_features)  # ceil: a short last group
    zeros = torch.zeros_like(scales)
    scale = zero = scales[0]
    for start in range(0, in_features, block_size):
        stop = min(start + block_size, in_features)
        # The block's columns as contiguous rows [count, out]: each step reads one row and
        # updates the rows after it.
        block, block_hinv = W[:, start:stop].T.contiguous(), hinv[start:stop, start:stop]
        errors = torch.zeros_like(block)
        for i in range(stop - start):
            column = start + i
            if column % group_size == 0:
                # The group's grid sees its columns as updated so far (this block's
                # running copy, then the rest of W).
                span = block[i : i + group_size].T  # [out, <= group_size]
                ahead = column + group_size - stop
                if ahead > 0:
                    span = torch.cat([span, W[:, stop : stop + ahead]], 1)
                grid = fit_grid(span, spec)
                scale, zero = grid.scale, grid.zero
                scales[column // group_size], zeros[column // group_size] = scale, zero
            w = block[i]
            q = quantize_codes(w, scale, zero, spec.maxq)
            codes[:, column] = q
            err = (w - scale * (q - zero)) / block_hinv[i, i]
            # The columns after i in this block absorb the error (a rank-1 update).
            block[i:].addr_(block_hinv[i, i:], err, alpha=-1)
            errors[i] = err
        W[:, stop:] -= errors.T @ hinv[start:stop, stop:]
    return codes, scales, zeros


def _upper_inverse_cholesky(hessian: Tensor) -> Tensor:
    """The upper Cholesky factor of H⁻¹, adding damping until H is positive definite."""
    diag_mean = torch.mean(torch.diag(hessian))
    for attempt in range(6):
        damped = (
            hessian
            if attempt == 0
            else hessian + (10.0 ** (attempt - 4)) * diag_mean * torch.eye(len(hessian))
        )
        lower, info = torch.linalg.cholesky_ex(damped)
        if int(info) == 0:
            inverse = torch.cholesky_inverse(lower)
            upper, info = torch.linalg.cholesky_ex(inverse, upper=True)
            if int(info) == 0:
                return upper
    raise ValueError("the Hessian is not positive definite even after extra damping")


def split_rows(weight: UnpackedWeight, sizes: list[int]) -> list[UnpackedWeight]:
    """Cut a weight quantized as stacked layers [Σ out, in] back into its layers.

    Layers that read the same input (q/k/v, gate/up) share one Hessian, and GPTQ treats
    every output row alike, so quantizing them stacked is the same as one by one.
    """
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    return [
        UnpackedWeight(
            intweight=weight.intweight[start : start + size].contiguous(),
            scales=weight.scales[:, start : start + size].contiguous(),
            zeros=weight.zeros[:, start : start + size].contiguous(),
            g_idx=weight.g_idx.clone(),  # each layer owns its tensors (safetensors refuses shared ones)
        )
        for start, size in zip(starts, sizes, strict=True)
    ]
