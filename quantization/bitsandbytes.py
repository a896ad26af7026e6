"""`--quantize bitsandbytes`, `bitsandbytes-nf4`, `bitsandbytes-fp4`: floating-point weights
quantized at load by the `bitsandbytes` package, as TGI does.

- `bitsandbytes`: LLM.int8() (`bnb.nn.Linear8bitLt`): per-row int8 weights, per-token int8
  activations, and input features with outliers above `threshold` (6.0, TGI's and
  transformers' default) multiplied in floating point.
- `bitsandbytes-nf4` / `-fp4`: 4-bit weights in 64-value blocks (`bnb.nn.Linear4bit`),
  multiplied in the activations' dtype.

The lm head stays in the model's dtype, as transformers' bitsandbytes integration leaves
it. bitsandbytes >= 0.49 runs all three on CPU (its own CPU kernels); on CUDA they need a
GPU bitsandbytes supports.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from textgate.quantization.base import Weight
from textgate.quantization.from_float import FromFloatWeightsLoader
from textgate.quantization.registry import register

LLM_INT8_THRESHOLD = 6.0


def _bnb() -> Any:
    """The bitsandbytes module, imported on first use (it loads its native library)."""
    # On CPUs with AVX512-BF16 bitsandbytes tries an optional Hub kernel at import and
    # logs a warning when it is absent; it then uses its own kernel, so say nothing.
    logger = logging.getLogger("bitsandbytes.backends.cpu.ops")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        import bitsandbytes
    except ImportError as exc:  # pragma: no cover - it is a declared dependency
        raise RuntimeError(
            "--quantize bitsandbytes* needs the `bitsandbytes` package (pip install bitsandbytes)"
        ) from exc
    finally:
        logger.setLevel(level)
    return bitsandbytes


def _on(module: nn.Module, device: torch.device) -> nn.Module:
    # bitsandbytes quantizes a parameter when it moves from the CPU to a device.
    return module.to(device)


def _serving(module: nn.Module) -> nn.Module:
    """The layer in inference mode, which is what selects bitsandbytes' fast CPU kernels:
    in training mode (an nn.Module's default) its CPU forward dequantizes the whole weight
    on every call; in eval mode 4-bit weights are repacked once, on the first call, for its
    AVX512-BF16 kernel, and LLM.int8() takes its int8 path. As a ratio to the dense
    FastLinear, 576x1536, 2 threads, same process, train -> eval (`python -m
    textgate.bench.micro.bnb_linear --method nf4 --dtype bfloat16`, `--method int8 --dtype
    float32`): nf4 5.6x -> 1.3x at 1 row, 2.4x -> 1.4x at 32; LLM.int8() 3.2x -> 2.0x at 1
    row, 3.1x -> 1.2x at 32."""
    return module.eval()


@dataclass
class Int8BnbWeight(Weight):
    """A float weight [out, in] that becomes a `bnb.nn.Linear8bitLt` (LLM.int8())."""

    weight: Tensor

    def get_linear(self, bias: Tensor | None) -> nn.Module:
        bnb = _bnb()
        out_features, in_features = self.weight.shape
        linear = bnb.nn.Linear8bitLt(
            in_features,
            out_features,
            bias=False,
            has_fp16_weights=False,
            threshold=LLM_INT8_THRESHOLD,
            device="meta",
        )
        linear.weight = bnb.nn.Int8Params(
            self.weight.cpu(), requires_grad=False, has_fp16_weights=False
        )
        if bias is not None:
            linear.bias = nn.Parameter(bias.cpu(), requires_grad=False)
        return _serving(_on(linear, self.weight.device))


@dataclass
class FourBitBnbWeight(Weight):
    """A float weight [out, in] that becomes a `bnb.nn.Linear4bit` of `quant_type`."""

    weight: Tensor
    quant_type: str

    def get_linear(self, bias: Tensor | None) -> nn.Module:
        bnb = _bnb()
        out_features, in_features = self.weight.shape
        linear = bnb.nn.Linear4bit(
            in_features,
            out_features,
            bias=False,
            compute_dtype=self.weight.dtype,
            quant_type=self.quant_type,
            device="meta",
        )
        linear.weight = bnb.nn.Params4bit(
            self.weight.cpu(), requires_grad=False, quant_type=self.quant_type, module=linear
        )
        if bias is not None:
            linear.bias = nn.Parameter(bias.cpu(), requires_grad=False)
        return _serving(_on(linear, self.weight.device))


class BnbWeightsLoader(FromFloatWeightsLoader):
    """The bitsandbytes loaders' shared device check."""

    @classmethod
    def check_device(cls, device: torch.device) -> None:
        bnb = _bnb()
        if device.type not in bnb.supported_torch_devices:
            raise ValueError(
                f"bitsandbytes {bnb.__version__} does not run on {device.type}; "
                f"it supports {', '.join(sorted(bnb.supported_torch_devices))}"
            )
        from bitsandbytes.cextension import ErrorHandlerMockBNBNativeLibrary, lib

        if device.type == "cuda" and isinstance(lib, ErrorHandlerMockBNBNativeLibrary):
            raise ValueError(
                f"bitsandbytes {bnb.__version__} found no native library for this GPU "
                "(see `python -m bitsandbytes`)"
            )


@register("bitsandbytes")
class Int8BnbWeightsLoader(BnbWeightsLoader):
    """LLM.int8() linears from a floating-point checkpoint."""

    def make_weight(self, weight: Tensor) -> Weight:
        return Int8BnbWeight(weight)


class FourBitBnbWeightsLoader(BnbWeightsLoader):
    """What NF4 and FP4 share: `--dtype auto` on a CPU."""

    def cpu_dtype(self) -> torch.dtype | None:
        """bfloat16 where bitsandbytes' packed CPU kernel runs (AVX512-BF16, its own check):
        its fast path, not a close race. Measured (`python -m textgate.bench.micro.step --quantize
        bitsandbytes-nf4 --batch 1,8,32 --prompt-len 128`, 2-core EPYC, fp32 -> bf16): decode
        11.24 -> 9.46 / 18.07 -> 15.40 / 39.78 -> 37.19 ms at batch 1 / 8 / 32, a 128-token
        prefill 67.5 -> 63.9 ms; `auto`'s timing of the two once picked fp32 by 3%."""
        return torch.bfloat16 if _bnb().functional.has_avx512bf16() else None


@register("bitsandbytes-nf4")
class Nf4BnbWeightsLoader(FourBitBnbWeightsLoader):
    """NF4 linears from a floating-point checkpoint."""

    def make_weight(self, weight: Tensor) -> Weight:
        return FourBitBnbWeight(weight, "nf4")


@register("bitsandbytes-fp4")
class Fp4BnbWeightsLoader(FourBitBnbWeightsLoader):
    """FP4 linears from a floating-point checkpoint."""

    def make_weight(self, weight: Tensor) -> Weight:
        return FourBitBnbWeight(weight, "fp4")
