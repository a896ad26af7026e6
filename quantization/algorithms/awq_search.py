"""AWQ (Lin et al., 2023): scale up the input channels that carry large activations.

Multiplying input channel c of W by s_c (and dividing the activation by s_c, folded into
the op that produces it) leaves the layer's output unchanged but shrinks the relative
rounding error of the channels that matter most. The scales are s = mean|x|^α, normalized,
with α picked on a grid to minimize the output error of the quantized layer(s) on
calibration activations. Then each group's clipping range is searched the same way.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from textgate.quantization.algorithms.rtn import QuantSpec, fake_quantize_grouped

#: Output of the inspected module for inputs [n, in] with weights in the given list.
Inspect = Callable[[Tensor, list[Tensor]], Tensor]


def activation_scales(mean_abs: Tensor, alpha: float) -> Tensor:
    """s [in] = mean|x|^α (mean over calibration rows), normalized so max(s)·min(s) = 1."""
    scales = mean_abs.float().pow(alpha).clamp(min=1e-4)
    return scales / (scales.max() * scales.min()).sqrt()


def linear_outputs(inputs: Tensor, weights: list[Tensor]) -> Tensor:
    """The default inspected module: the layers' outputs side by side [n, Σ out]."""
    return torch.cat([inputs @ w.T for w in weights], dim=-1)


def search_scales(
    inputs: Tensor,
    weights: list[Tensor],
    spec: QuantSpec,
    *,
    mean_abs: Tensor | None = None,
    inspect: Inspect = linear_outputs,
    num_grid: int = 20,
) -> tuple[Tensor, float, list[float]]:
    """The per-input-channel scales [in] for layers sharing `inputs` [n, in].

    `mean_abs` [in] is mean|x| over all calibration rows (default: over `inputs`). Tries α = 0, 1/num_grid, …, 1; α = 0 is s = 1, plain RTN, so the result is never worse
    than RTN on these inputs. Returns (scales, best α, the loss of every α tried).
    """
    inputs = inputs.float()
    if mean_abs is None:
        mean_abs = inputs.abs().mean(dim=0)
    reference = inspect(inputs, [w.float() for w in weights])
    losses: list[float] = []
    best: tuple[float, float, Tensor] | None = None
    for step in range(num_grid + 1):
        alpha = step / num_grid
        scales = activation_scales(mean_abs, alpha)
        # (Q(W·s) / s) x == Q(W·s) (x / s): the quantized layer after folding the scales.
        quantized = [fake_quantize_grouped(w.float() * scales, spec) / scales for w in weights]
        loss = float((inspect(inputs, quantized) - reference).pow(2).mean())
        losses.append(loss)
        if best is None or loss < best[0]:
            best = (loss, alpha, scales)
    assert best is not None
    return best[2], best[1], losses


def search_clip(
    inputs: Tensor,
    weight: Tensor,
    spec: QuantSpec,
    *,
    num_grid: int = 20,
    max_shrink: float = 0.5,
) -> Tensor:
    """The clipping bound [out, groups] of each group of `weight` [out, in].

    Shrinks each group's max |w| by steps of 1/num_grid down to (1 - max_shrink) and keeps
    the bound with the smallest error of the group's partial outputs on `inputs` [n, in].
    Step 0 is no clipping, so the chosen bounds are never worse than none on these inputs.
    """
    out_features, in_features = weight.shape
    size = spec.group_size_for(in_features)
    # A short last group is padded with zero inputs and weights: they add nothing to the
    # partial outputs, and the grid's range includes 0 anyway.
    pad = -in_features % size
    padded = F.pad(weight.float(), (0, pad))
    x = F.pad(inputs.float(), (0, pad)).reshape(-1, padded.shape[1] // size, size)
    x = x.transpose(0, 1)  # [groups, n, size]
    w = padded.reshape(out_features, -1, size)  # [out, groups, size]

    def partial_outputs(w: Tensor) -> Tensor:
        return torch.bmm(x, w.permute(1, 2, 0))  # [groups, n, out]

    reference = partial_outputs(w)
    original_max = w.abs().amax(dim=-1)  # [out, groups]
    best_max = original_max.clone()
    best_err = torch.full_like(original_max, float("inf"))
    for step in range(int(max_shrink * num_grid)):
        bound = original_max * (1 - step / num_grid)
        clipped = apply_clip(padded, bound, spec)
        quantized = fake_quantize_grouped(clipped, spec).reshape(w.shape)
        err = (partial_outputs(quantized) - reference).pow(2).mean(dim=1).T  # [out, groups]
        better = err < best_err
        best_err = torch.where(better, err, best_err)
        best_max = torch.where(better, bound, best_max)
    return best_max


def apply_clip(weight: Tensor, bounds: Tensor, spec: QuantSpec) -> Tensor:
    """`weight` [out, in] clamped to ±bounds [out, groups] of its consecutive groups."""
    bound = bounds[:, spec.g_idx(weight.shape[1]).long()]  # [out, in]
    return torch.maximum(torch.minimum(weight, bound), -bound)
