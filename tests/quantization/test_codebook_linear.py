"""NF4/FP4 layers: bitsandbytes' codes through `cpu_lut4.c` for decode-sized inputs, against
the weight they stand for and against bitsandbytes' own forward."""

from __future__ import annotations

import pytest
import torch

from textgate.kernels.cpu_build import load_library
from textgate.quantization import codebook_linear
from textgate.quantization.bitsandbytes import FourBitBnbWeight
from textgate.quantization.codebook_linear import CodebookLinear, reference_codebook_weight

bnb = pytest.importorskip("bitsandbytes")
pytestmark = pytest.mark.skipif(
    load_library() is None or not load_library().textgate_lut4_available(),
    reason="the CPU kernels (with AVX512) are not built here",
)


def layer_and_weight(quant_type: str, dtype: torch.dtype, out_f: int = 96, in_f: int = 192):
    generator = torch.Generator().manual_seed(len(quant_type) + out_f)
    weight = torch.randn(out_f, in_f, generator=generator) * in_f**-0.5
    bias = torch.randn(out_f, generator=generator)
    layer = FourBitBnbWeight(weight.to(dtype), quant_type).get_linear(bias.to(dtype))
    assert isinstance(layer, CodebookLinear)
    codes = layer.linear.weight.data
    stood_for = reference_codebook_weight(codes, layer.absmax, layer.codebook, (out_f, in_f))
    return layer, stood_for, layer.linear.bias.float()


@pytest.mark.parametrize("quant_type", ["nf4", "fp4"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 2, 3, 5, codebook_linear.KERNEL_ROWS])
def test_kernel_rows_equal_the_weight_the_codes_stand_for(quant_type, dtype, rows):
    layer, weight, bias = layer_and_weight(quant_type, dtype)
    x = torch.randn(rows, 192).to(dtype)
    want = x.float() @ weight.T + bias
    got = layer(x)
    assert got.dtype == dtype and got.shape == want.shape
    tolerance = 1e-5 if dtype == torch.float32 else 1e-2  # the output's rounding
    assert (got.float() - want).abs().max() <= tolerance * want.abs().max()
    # The same weight as bitsandbytes' own dequantization (to its dtype's rounding).
    package = bnb.functional.dequantize_4bit(
        layer.linear.weight.data, layer.linear.weight.quant_state
    )
    assert (package.float() - weight).abs().max() <= 1e-2 * weight.abs().max()


def test_more_rows_go_to_the_package_and_agree(monkeypatch):
    layer, weight, bias = layer_and_weight("nf4", torch.float32)
    x = torch.randn(2, codebook_linear.KERNEL_ROWS + 1, 192)
    calls = []
    monkeypatch.setattr(
        layer.linear, "forward", lambda t: calls.append(t.shape) or t @ weight.T + bias
    )
    layer(x)
    assert calls == [x.shape]  # the package's forward, with the input as given
    monkeypatch.undo()
    torch.testing.assert_close(layer(x), x @ weight.T + bias, rtol=1e-4, atol=1e-4)
    kernel = layer(x[:, :3])  # 6 rows: the kernel
    torch.testing.assert_close(kernel, layer.linear(x[:, :3]), rtol=1e-4, atol=1e-4)


def test_rows_not_in_whole_blocks_stay_with_the_package():
    generator = torch.Generator().manual_seed(3)
    weight = torch.randn(64, 96, generator=generator)  # 96 inputs: blocks of 64 cross rows
    layer = FourBitBnbWeight(weight, "nf4").get_linear(None)
    assert isinstance(layer, bnb.nn.Linear4bit)
