"""The W8A8 linear: the oneDNN path against its reference, the reference against the math."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from textgate.kernels import int8_linear
from textgate.kernels.int8_linear import (
    INT8_MAX,
    Int8Linear,
    pack_vnni,
    quantize_rows,
    quantize_weight,
    reference_int8_linear,
    reference_quantize_rows,
    unpack_vnni,
)

needs_onednn = pytest.mark.skipif(not int8_linear.can_pack(), reason="no oneDNN int8 GEMM")
needs_vnni = pytest.mark.skipif(
    not int8_linear.has_vnni_kernel(), reason="no AVX512-VNNI, or no C compiler"
)


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
        pytest.param("vnni", marks=needs_vnni),
        pytest.param("onednn", marks=needs_onednn),
        "reference",
    ]


@pytest.mark.parametrize("kernel", _kernels())
@pytest.mark.parametrize(
    ("rows", "in_features", "out_features", "bias"),
    [(1, 576, 1536, False), (7, 67, 33, True), (37, 1536, 576, True), (300, 64, 200, False)],
)
def test_kernel_matches_the_reference(kernel, rows, in_features, out_features, bias):
    # Odd shapes on purpose: rows not a multiple of the VNNI tile's 4 or its chunk of 16,
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


@needs_vnni
def test_vnni_packing_round_trips():
    qweight = torch.randint(-127, 128, (37, 22), dtype=torch.int8)
    packed = pack_vnni(qweight, torch.rand(37))
    assert packed.packed.shape == (3, 6, 16, 4)  # 37 outputs -> 48, 22 inputs -> 24
    assert torch.equal(unpack_vnni(packed), qweight)
    assert torch.equal(packed.offsets[:37], qweight.sum(dim=1, dtype=torch.int32) * 128)
    assert packed.offsets[37:].eq(0).all()


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
    too_wide = torch.zeros(1, int8_linear.VNNI_MAX_IN_FEATURES + 1, dtype=torch.int8)
    with pytest.raises(ValueError, match="sums at most"):
        Int8Linear(too_wide, torch.ones(1), kernel="vnni")
    assert int8_linear.default_kernel(torch.device("cpu"), too_wide.shape[1]) != "vnni"
    with pytest.raises(ValueError, match="unknown int8 kernel 'amx'"):
        Int8Linear(torch.zeros(4, 4, dtype=torch.int8), torch.ones(4), kernel="amx")
