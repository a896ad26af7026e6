"""The W8A8 linear: every kernel (cpu_int8.c at each level this CPU runs, oneDNN) against
its reference, the reference against the math, and oneDNN's saturation caught."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from textgate.kernels import cpu_build, cpu_isa, int8_linear
from textgate.kernels.int8_linear import (
    INT8_MAX,
    Int8Linear,
    cpu_int8_linear,
    pack_int8,
    quantize_rows,
    quantize_weight,
    reference_int8_linear,
    reference_quantize_rows,
    unpack_int8,
)

needs_onednn = pytest.mark.skipif(
    not int8_linear.onednn_is_exact(), reason="no oneDNN int8 GEMM, or it saturates on this CPU"
)
needs_cpu_kernel = pytest.mark.skipif(int8_linear.cpu_kernel_isa() is None, reason="no C compiler")
#: Every level of the C kernels this CPU runs: each one's int8 path is checked here.
LEVELS = [level.name for level in cpu_isa.runnable_levels()]


def _layer(out_features: int, in_features: int, bias: bool, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    weight = torch.randn(out_features, in_features, generator=generator) * in_features**-0.5
    bias_tensor = torch.randn(out_features, generator=generator) if bias else None
    return weight, bias_tensor


def test_weights_quantize_per_output_channel_within_half_a_step():
    weight, _ = _layer(37, 53, bias=False)
    weight[3] *= 100  # one loud channel must not cost the others precision
    qweight, scales = quantize_weight(weight)
    assert qweight.dtype == torch.int8 and scales.shape == (37,)
    assert qweight.abs().amax(dim=1).eq(INT8_MAX).all()
    error = (qweight.float() * scales[:, None] - weight).abs()
    assert (error <= scales[:, None] / 2 + 1e-7).all()


def test_activations_quantize_per_token():
    x = torch.randn(4, 19)
    x[0] *= 1000  # a token with huge activations leaves the other rows' scales alone
    quantized, row_max = quantize_rows(x)
    assert quantized.dtype == torch.uint8
    torch.testing.assert_close(row_max[:, 0], x.abs().amax(dim=1))
    dequantized = (quantized.float() - 128) * row_max / INT8_MAX
    assert ((dequantized - x).abs() <= row_max / INT8_MAX / 2 + 1e-6).all()
    assert quantized.min() >= 1  # symmetric: q_x in [-127, 127]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(1, 576), (33, 67), (300, 200)])
def test_c_quantization_matches_the_reference_byte_for_byte(shape, dtype):
    from textgate.kernels import cpu_build

    if cpu_build.load_library() is None:
        pytest.skip("no C compiler")
    x = (torch.randn(shape) * torch.rand(shape[0], 1) * 10).to(dtype)
    x[0, :3] = torch.tensor([0.5, -0.5, 1.5]) * x[0].abs().max() / 127 * 2  # ties
    quantized, row_max = quantize_rows(x)
    expected, expected_max = reference_quantize_rows(x)
    assert torch.equal(row_max, expected_max)
    assert torch.equal(quantized, expected)
    zeros, _ = quantize_rows(torch.zeros(2, 8, dtype=dtype))
    assert zeros.eq(128).all()


def test_reference_is_close_to_the_float_linear():
    weight, bias = _layer(64, 96, bias=True)
    qweight, scales = quantize_weight(weight)
    x = torch.randn(8, 96)
    expected = F.linear(x, weight, bias)
    got = reference_int8_linear(x, qweight, scales, bias)
    assert (got - expected).norm() / expected.norm() < 0.02


def _kernels():
    """Every int8 kernel this machine runs, each skipped with a reason where it cannot."""
    return [
        pytest.param("cpu", marks=needs_cpu_kernel),
        pytest.param("onednn", marks=needs_onednn),
        "reference",
    ]


@pytest.mark.parametrize("kernel", _kernels())
@pytest.mark.parametrize(
    ("rows", "in_features", "out_features", "bias"),
    [(1, 576, 1536, False), (7, 67, 33, True), (37, 1536, 576, True), (300, 64, 200, False)],
)
def test_kernel_matches_the_reference(kernel, rows, in_features, out_features, bias):
    # Odd shapes on purpose: rows not a multiple of the C tile's 4 or its chunk of 16,
    # outputs not a multiple of 16, inputs not a multiple of 4.
    weight, bias_tensor = _layer(out_features, in_features, bias, seed=rows)
    qweight, scales = quantize_weight(weight)
    layer = Int8Linear(qweight, scales, bias_tensor, kernel=kernel)
    assert layer.kernel == kernel and (layer.qweight is None) == (kernel != "reference")
    x = torch.randn(rows, in_features)
    expected = reference_int8_linear(x, qweight, scales, bias_tensor)
    # Equal up to float summation order: the int8 products are summed exactly.
    torch.testing.assert_close(layer(x), expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kernel", _kernels())
def test_1d_3d_bfloat16_and_empty_inputs(kernel):
    weight, bias = _layer(24, 40, bias=True)
    qweight, scales = quantize_weight(weight)
    layer = Int8Linear(qweight, scales, bias, kernel=kernel)
    x = torch.randn(2, 3, 40)
    out = layer(x)
    assert out.shape == (2, 3, 24)
    torch.testing.assert_close(out, reference_int8_linear(x, qweight, scales, bias))
    torch.testing.assert_close(layer(x[0, 0]), out[0, 0], atol=1e-5, rtol=1e-5)
    half = layer(x.bfloat16())
    assert half.dtype == torch.bfloat16
    # One bfloat16 step: the float sums differ in order before rounding.
    torch.testing.assert_close(
        half, reference_int8_linear(x.bfloat16(), qweight, scales, bias), atol=2e-2, rtol=1e-2
    )
    assert layer(torch.empty(0, 40)).shape == (0, 24)


@pytest.mark.parametrize("kernel", _kernels())
def test_a_batch_row_does_not_depend_on_its_neighbours(kernel):
    weight, _ = _layer(48, 64, bias=False)
    layer = Int8Linear(*quantize_weight(weight), kernel=kernel)
    x = torch.randn(5, 64)
    loud = torch.cat([x, 500 * torch.randn(1, 64)])
    torch.testing.assert_close(layer(loud)[:5], layer(x), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kernel", _kernels())
def test_smoothing_moves_an_outlier_channel_into_the_weights(kernel):
    weight, bias = _layer(64, 96, bias=True)
    x = torch.randn(16, 96)
    x[:, 5] *= 60  # one loud input channel, as LLM activations have
    expected = F.linear(x, weight, bias)
    plain = Int8Linear(*quantize_weight(weight), bias, kernel=kernel)
    smooth = x.abs().amax(dim=0).rsqrt() * weight.abs().amax(dim=0).sqrt()  # alpha 0.5
    smoothed = Int8Linear(*quantize_weight(weight, smooth), bias, smooth, kernel=kernel)
    torch.testing.assert_close(
        smoothed(x),
        reference_int8_linear(x, *quantize_weight(weight, smooth), bias, smooth),
        atol=1e-5,
        rtol=1e-5,
    )
    error = {
        name: (layer(x) - expected).norm() / expected.norm()
        for name, layer in (("plain", plain), ("smoothed", smoothed))
    }
    assert error["smoothed"] < 0.5 * error["plain"]
    torch.testing.assert_close(smoothed.weight, plain.weight, atol=0.05, rtol=0)


@pytest.mark.parametrize(("isa", "lane"), [(2, 4), (1, 2), (0, 4)])
def test_packing_round_trips(isa, lane):
    qweight = torch.randint(-127, 128, (37, 22), dtype=torch.int8)
    packed = pack_int8(qweight, torch.rand(37), isa=isa)
    # 37 outputs -> 48, 22 inputs -> 24, in groups of `lane` inputs per output channel.
    assert packed.packed.shape == (3, 24 // lane, 16, lane)
    assert torch.equal(unpack_int8(packed), qweight)
    assert torch.equal(packed.offsets[:37], qweight.sum(dim=1, dtype=torch.int32) * 128)
    assert packed.offsets[37:].eq(0).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize(
    ("rows", "in_features", "out_features", "bias"),
    [(1, 576, 1536, False), (6, 67, 33, True), (37, 1536, 40, True), (70, 64, 200, False)],
)
def test_every_level_this_cpu_runs_matches_the_reference(
    level, rows, in_features, out_features, bias, dtype
):
    # Each level's build sums with its own instructions (VNNI, AVX2's int16 vpmaddwd, plain
    # C) on its own layout; all must give the reference's exact int32 sums.
    library = cpu_build.load_library(level=level)
    if library is None:
        pytest.skip("no C compiler")
    weight, bias_tensor = _layer(out_features, in_features, bias, seed=rows)
    qweight, scales = quantize_weight(weight)
    packed = pack_int8(qweight, scales, bias_tensor, int(library.textgate_int8_isa()))
    x = (torch.randn(rows, in_features) * 3).to(dtype)
    got = cpu_int8_linear(x, packed, None, library)
    expected = reference_int8_linear(x, qweight, scales, bias_tensor)
    tolerance = {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {}
    torch.testing.assert_close(got, expected, **tolerance)


@pytest.mark.parametrize("level", LEVELS)
def test_the_largest_products_do_not_saturate(level):
    # 255 * 127 twice overflows int16: the AVX2 path must widen before it sums.
    library = cpu_build.load_library(level=level)
    if library is None:
        pytest.skip("no C compiler")
    qweight = torch.full((16, 1024), INT8_MAX, dtype=torch.int8)
    qweight[1::2] = -INT8_MAX
    packed = pack_int8(qweight, torch.ones(16), None, int(library.textgate_int8_isa()))
    x = torch.ones(3, 1024)
    expected = reference_int8_linear(x, qweight, torch.ones(16))
    assert expected[0, 0] == 1024 * INT8_MAX
    torch.testing.assert_close(cpu_int8_linear(x, packed, None, library), expected)


def test_a_saturating_onednn_is_caught_and_not_used():
    # Capped at AVX2 (as on a CPU without VNNI), oneDNN sums u8 x s8 pairs in int16 and
    # saturates: the startup probe must see it, and no layer may take that path.
    if not int8_linear.can_pack() or not cpu_isa.is_x86():
        pytest.skip("no oneDNN int8 GEMM on x86 here")
    code = (
        "import torch\n"
        "from textgate.kernels import int8_linear as il\n"
        "print(il.onednn_is_exact(), il.default_kernel(torch.device('cpu'), 576))\n"
    )
    env = {**os.environ, "ONEDNN_MAX_CPU_ISA": "AVX2", "TEXTGATE_CPU_KERNELS": "0"}
    result = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    )
    assert result.stdout.split() == ["False", "reference"]


def test_reference_path_without_onednn(monkeypatch):
    monkeypatch.setenv("TEXTGATE_CPU_KERNELS", "0")
    weight, bias = _layer(16, 32, bias=True)
    qweight, scales = quantize_weight(weight)
    layer = Int8Linear(qweight, scales, bias)
    assert layer.kernel == "reference" and torch.equal(layer.qweight, qweight)
    x = torch.randn(3, 32)
    torch.testing.assert_close(layer(x), reference_int8_linear(x, qweight, scales, bias))


@pytest.mark.parametrize("kernel", _kernels())
def test_weight_property_unpacks_the_dequantized_weight(kernel):
    weight, _ = _layer(20, 30, bias=False)
    qweight, scales = quantize_weight(weight)
    layer = Int8Linear(qweight, scales, kernel=kernel)
    torch.testing.assert_close(layer.weight, qweight.float() * scales[:, None])


def test_rejects_bad_weights():
    with pytest.raises(ValueError, match="int8 weight"):
        Int8Linear(torch.zeros(4, 4), torch.ones(4))
    with pytest.raises(ValueError, match="4 scales"):
        Int8Linear(torch.zeros(4, 4, dtype=torch.int8), torch.ones(3))
    with pytest.raises(ValueError, match="4 smoothing factors"):
        Int8Linear(torch.zeros(4, 4, dtype=torch.int8), torch.ones(4), smooth=torch.ones(5))
    too_wide = torch.zeros(1, int8_linear.MAX_IN_FEATURES + 1, dtype=torch.int8)
    if int8_linear.cpu_kernel_isa() is not None:
        with pytest.raises(ValueError, match="sums at most"):
            Int8Linear(too_wide, torch.ones(1), kernel="cpu")
    assert int8_linear.default_kernel(torch.device("cpu"), too_wide.shape[1]) != "cpu"
    with pytest.raises(ValueError, match="unknown int8 kernel 'amx'"):
        Int8Linear(torch.zeros(4, 4, dtype=torch.int8), torch.ones(4), kernel="amx")
