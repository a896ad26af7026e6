"""SmoothQuant for `--quantize int8`: per-input-channel factors that move activation outliers
into the weights, from activation maxima measured on the shipped calibration text at load.

A linear layer's input has a few channels far louder than the rest (the same channels for
every token), so per-token int8 spends its 255 steps on them. With s = max|x_c|^α /
max|W_:,c|^(1-α) per input channel c, the layer computes (x / s) @ (W * s).T instead: the
same product, with flatter activations and slightly less flat weights (SmoothQuant, Xiao et
al. 2023, α = 0.5). Int8Linear multiplies by `smooth = 1 / s` in the pass that quantizes the
rows, so it costs nothing at run time and needs no folding into the preceding layer.

Measured on the default model (perplexity on 8 held-out windows of 512 tokens, fp32 35.200;
`python -m textgate.bench.model_tools.perplexity --quantize int8 --max-windows 8`). Which layers cost
it, plain W8A8 (36.351, +3.3%) with one kind of layer in int8 and the rest fp32: q/k/v
35.516, down 35.527, gate/up 35.338, head 35.331, o 35.171; all int8 but one kind: q/k/v
35.997, gate/up 35.960, down 36.012, head 36.174, o 36.536. No single layer kind holds the
loss, so smoothing every layer beats keeping one in float. α on every layer (16 x 256
calibration tokens): 0.3 36.274, 0.4 35.850, 0.5 35.567, 0.65 35.886, 0.8 36.130; α 0.5
on all but the head 35.638. Calibration at load with α 0.5: 4 x 256 tokens 35.589 (+1.1%),
8 x 256 35.691, 16 x 256 35.631 - more text does not help, so the load uses 4 x 256.
Then α per kind of layer, the rest at 0.5 (same calibration; 8 windows, and 16 windows
where fp32 scores 35.001): all 0.5 35.589 / 35.340 (+0.97%); down_proj 0.65 35.489 (+0.82%)
/ 35.245 (+0.70%); down_proj 0.35 35.699; q/k/v 0.65 35.694, 0.35 35.635. Shipped: down_proj
at 0.65 (`ALPHA_BY_LAYER`), everything else at 0.5.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from textgate.kernels.int8_linear import Int8Linear, quantize_weight

log = logging.getLogger("textgate.quantization")

ALPHA = 0.5
#: Layers (by checkpoint name suffix) whose inputs have heavier outliers and take more
#: migration: the MLP's down projection reads the SwiGLU product.
ALPHA_BY_LAYER = {"down_proj": 0.65}
#: Calibration at load: windows x tokens of the shipped calibration text (see above).
NUM_SAMPLES, SEQ_LEN = 4, 256
_BLOCK_SIZE = 16
_FLOOR = 1e-5  # channels that never fire (or all-zero weight columns) keep a factor near 1


class ObservedLinear(nn.Module):
    """A float linear layer waiting for its int8 form: it records the per-input-channel
    absmax of what it sees (`input_max` [in]) until `quantize()` replaces it."""

    def __init__(self, weight: Tensor, bias: Tensor | None, alpha: float = ALPHA) -> None:
        super().__init__()
        self.weight, self.bias, self.alpha = weight, bias, alpha
        self.input_max: Tensor | None = None

    def forward(self, x: Tensor) -> Tensor:
        seen = x.detach().reshape(-1, x.shape[-1]).abs().amax(dim=0).float()  # [in]
        self.input_max = seen if self.input_max is None else torch.maximum(self.input_max, seen)
        bias = None if self.bias is None else self.bias.to(x.dtype)
        return F.linear(x, self.weight.to(x.dtype), bias)

    def quantize(self, alpha: float | None = None) -> Int8Linear:
        """The int8 layer, smoothed where this layer saw input (else plain W8A8)."""
        smooth = None
        if self.input_max is not None:
            smooth = smoothing_factors(
                self.input_max, self.weight, self.alpha if alpha is None else alpha
            )
        qweight, scales = quantize_weight(self.weight, smooth)
        return Int8Linear(qweight, scales, self.bias, smooth)


def alpha_for(prefix: str) -> float:
    """SmoothQuant's α for the layer named `prefix` (`model.layers.3.mlp.down_proj`)."""
    return ALPHA_BY_LAYER.get(prefix.rsplit(".", 1)[-1], ALPHA)


def smoothing_factors(input_max: Tensor, weight: Tensor, alpha: float = ALPHA) -> Tensor:
    """`smooth` [in] = max|W_:,c|^(1-α) / max|x_c|^α: what Int8Linear multiplies x by."""
    weight_max = weight.float().abs().amax(dim=0).clamp(min=_FLOOR)  # [in]
    return weight_max.pow(1 - alpha) / input_max.float().clamp(min=_FLOOR).pow(alpha)


def calibration_tokens(model_dir: Path) -> Tensor:
    """[NUM_SAMPLES, SEQ_LEN] token windows of the shipped calibration text."""
    from transformers import AutoTokenizer

    from textgate.quantization.algorithms.calibration import (
        calibration_samples,
        calibration_text_path,
        read_text,
    )

    try:
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
    except (OSError, ValueError) as exc:
        raise ValueError(
            f"--quantize int8 calibrates on text at load and needs the tokenizer in {model_dir}: "
            f"{exc}"
        ) from exc
    return calibration_samples(tokenizer, read_text(calibration_text_path()), NUM_SAMPLES, SEQ_LEN)


@torch.inference_mode()
def smooth_and_quantize(model: nn.Module, model_dir: Path) -> None:
    """Run the calibration text through `model` (its ObservedLinear layers in float), then
    replace each ObservedLinear with its smoothed Int8Linear. Every tensor-parallel rank
    calls this (the forward passes are collective); each smooths its own slices."""
    from textgate.kernels import AttentionMetadata

    observed = [m for m in model.modules() if isinstance(m, ObservedLinear)]
    if not observed:
        return
    started = time.perf_counter()
    tokens = calibration_tokens(model_dir)
    device = next(iter(observed)).weight.device
    num_blocks = -(-SEQ_LEN // _BLOCK_SIZE)
    cache = model.allocate_kv_cache(num_blocks=num_blocks, block_size=_BLOCK_SIZE)
    metadata = AttentionMetadata.build(
        query_lens=[SEQ_LEN],
        context_lens=[0],
        block_tables=[list(range(num_blocks))],
        block_size=_BLOCK_SIZE,
        device=device,
    )
    rows = torch.arange(SEQ_LEN, device=device)  # every row: the head calibrates too
    for window in tokens.to(device):
        model(window, metadata.positions(), cache, metadata, rows)
    del cache
    for parent in list(model.modules()):
        for name, child in parent.named_children():
            if isinstance(child, ObservedLinear):
                setattr(parent, name, child.quantize())
    log.info(
        "int8: smoothed %d layers on %d calibration tokens in %.1f s",
        len(observed),
        tokens.numel(),
        time.perf_counter() - started,
    )
