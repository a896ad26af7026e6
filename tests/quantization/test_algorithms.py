"""RTN, GPTQ and AWQ on small random matrices: the properties each algorithm promises."""

from __future__ import annotations

import pytest
import torch

from textgate.kernels.packing import dequantize, pack_gptq, unpack_gptq
from textgate.quantization.algorithms.awq_search import (
    activation_scales,
    apply_clip,
    search_clip,
    search_scales,
)
from textgate.quantization.algorithms.gptq_solver import (
    HessianAccumulator,
    gptq_quantize,
    split_rows,
)
from textgate.quantization.algorithms.rtn import (
    QuantSpec,
    fake_quantize,
    fake_quantize_grouped,
    fit_grid,
    rtn_quantize,
)


def _generator(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def correlated_inputs(rows: int, features: int, seed: int = 0) -> torch.Tensor:
    """Inputs [rows, features] whose features are strongly correlated and unevenly scaled."""
    g = _generator(seed)
    latent = torch.randn(rows, features // 4, generator=g)
    mixing = torch.randn(features // 4, features, generator=g)
    noise = 0.1 * torch.randn(rows, features, generator=g)
    return (latent @ mixing + noise) * torch.linspace(0.2, 3.0, features)


def output_error(weight: torch.Tensor, approx: torch.Tensor, inputs: torch.Tensor) -> float:
    return float(((inputs @ weight.T) - (inputs @ approx.T)).pow(2).mean())


def hessian_of(inputs: torch.Tensor) -> torch.Tensor:
    acc = HessianAccumulator(inputs.shape[1])
    acc.add(inputs)
    return acc.result()


# --- the grid and RTN -------------------------------------------------------------------------


@pytest.mark.parametrize("sym", [False, True])
def test_rtn_codes_rebuild_the_weight_within_half_a_step(sym):
    weight = torch.randn(16, 96, generator=_generator())
    spec = QuantSpec(bits=4, group_size=32, sym=sym)
    quantized = rtn_quantize(weight, spec)
    assert quantized.intweight.shape == (16, 96) and quantized.scales.shape == (3, 16)
    assert int(quantized.intweight.min()) >= 0 and int(quantized.intweight.max()) <= 15
    step = quantized.scales[quantized.g_idx.long()].T  # [out, in]
    error = (dequantize(quantized) - weight).abs()
    # Half a step, up to the float16 rounding of the stored scale.
    assert bool((error <= step * 0.51).all())
    if sym:
        assert bool((quantized.zeros == 8).all())


def test_a_short_last_group_gets_its_own_grid():
    weight = torch.randn(8, 80, generator=_generator())
    weight[:, 64:] *= 100  # the short last group (16 inputs) has a much wider range
    quantized = rtn_quantize(weight, QuantSpec(bits=4, group_size=32))
    assert quantized.scales.shape == (3, 8)
    assert quantized.g_idx.tolist() == [0] * 32 + [1] * 32 + [2] * 16
    assert bool((quantized.scales[2] > 20 * quantized.scales[1]).all())


def test_grid_range_always_includes_zero_and_survives_flat_rows():
    spec = QuantSpec(bits=4)
    grid = fit_grid(torch.tensor([[1.0, 2.0, 3.0], [0.0, 0.0, 0.0]]), spec)
    assert grid.zero[0] == 0  # the range of [1, 2, 3] is stretched down to 0
    assert bool((grid.scale > 0).all())
    # The all-zero row gets a usable grid on which its zeros stay exact.
    flat = torch.zeros(1, 3)
    flat_grid = fit_grid(flat, spec)
    rebuilt = fake_quantize(flat, flat_grid.scale[:, None], flat_grid.zero[:, None], spec.maxq)
    assert torch.equal(rebuilt, flat)


def test_spec_rejects_bad_settings():
    with pytest.raises(ValueError, match="bits"):
        QuantSpec(bits=5)
    with pytest.raises(ValueError, match="group_size"):
        QuantSpec(group_size=0)


# --- GPTQ -------------------------------------------------------------------------------------


def test_hessian_accumulates_over_batches():
    inputs = torch.randn(50, 12, generator=_generator())
    acc = HessianAccumulator(12)
    for part in inputs.split([7, 30, 13]):
        acc.add(part)
    torch.testing.assert_close(acc.result(), 2 * inputs.T @ inputs / 50, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("desc_act", [False, True])
@pytest.mark.parametrize("group_size", [32, -1])
def test_gptq_beats_rtn_on_correlated_inputs(desc_act, group_size):
    inputs = correlated_inputs(512, 128)
    weight = torch.randn(64, 128, generator=_generator(1))
    spec = QuantSpec(bits=4, group_size=group_size)
    rtn = output_error(weight, dequantize(rtn_quantize(weight, spec)), inputs)
    gptq = gptq_quantize(weight, hessian_of(inputs), spec, desc_act=desc_act)
    assert output_error(weight, dequantize(gptq), inputs) < 0.8 * rtn


def test_gptq_with_a_diagonal_hessian_is_rtn():
    # Uncorrelated inputs: no error can be compensated, every column rounds to nearest.
    weight = torch.randn(32, 64, generator=_generator())
    spec = QuantSpec(bits=4, group_size=16)
    gptq = gptq_quantize(weight, torch.eye(64), spec)
    rtn = rtn_quantize(weight, spec)
    assert torch.equal(gptq.intweight, rtn.intweight)
    torch.testing.assert_close(gptq.scales, rtn.scales)


def test_act_order_g_idx_is_a_permutation_grouping():
    inputs = correlated_inputs(256, 96)
    hessian = hessian_of(inputs)
    weight = torch.randn(16, 96, generator=_generator(2))
    quantized = gptq_quantize(weight, hessian, QuantSpec(bits=4, group_size=32), desc_act=True)
    g_idx = quantized.g_idx
    assert g_idx.dtype == torch.int32 and g_idx.shape == (96,)
    # Every group holds exactly group_size columns, ...
    assert torch.bincount(g_idx.long()).tolist() == [32, 32, 32]
    # ... the ones act-order visits together: by decreasing Hessian diagonal.
    order = torch.argsort(torch.diag(hessian), descending=True)
    assert g_idx[order].tolist() == sorted(g_idx.tolist())
    assert g_idx.tolist() != sorted(g_idx.tolist())  # really permuted on these inputs


def test_act_order_survives_gptq_packing():
    inputs = correlated_inputs(256, 64)
    weight = torch.randn(16, 64, generator=_generator(3))
    quantized = gptq_quantize(weight, hessian_of(inputs), QuantSpec(group_size=16), desc_act=True)
    packed = pack_gptq(quantized.intweight, quantized.scales, quantized.zeros, quantized.g_idx)
    unpacked = unpack_gptq(packed["qweight"], packed["qzeros"], packed["scales"], packed["g_idx"])
    torch.testing.assert_close(dequantize(unpacked), dequantize(quantized))


def test_stacked_layers_split_back_into_each_layer():
    inputs = correlated_inputs(256, 64)
    hessian = hessian_of(inputs)
    first, second = torch.randn(8, 64, generator=_generator(4)), torch.randn(16, 64)
    spec = QuantSpec(group_size=32)
    stacked = gptq_quantize(torch.cat([first, second]), hessian, spec)
    parts = split_rows(stacked, [8, 16])
    alone = gptq_quantize(second, hessian, spec)
    assert torch.equal(parts[1].intweight, alone.intweight)
    torch.testing.assert_close(parts[1].scales, alone.scales)
    assert parts[0].intweight.shape == (8, 64) and parts[0].scales.shape == (2, 8)


def test_gptq_rejects_a_mismatched_hessian():
    with pytest.raises(ValueError, match="hessian"):
        gptq_quantize(torch.randn(4, 8), torch.eye(6), QuantSpec(group_size=4))


# --- AWQ --------------------------------------------------------------------------------------


def outlier_inputs(rows: int = 256, features: int = 64) -> torch.Tensor:
    """Activations where a few channels are much larger than the rest (what AWQ exploits)."""
    inputs = torch.randn(rows, features, generator=_generator(5))
    inputs[:, :4] *= 30
    return inputs


def test_awq_scale_search_is_never_worse_than_alpha_zero():
    inputs = outlier_inputs()
    weights = [torch.randn(32, 64, generator=_generator(6)), torch.randn(16, 64)]
    scales, alpha, losses = search_scales(inputs, weights, QuantSpec(group_size=32))
    assert len(losses) == 21 and min(losses) <= losses[0]
    # With outlier channels the search finds a real improvement, and scales them up.
    assert alpha > 0 and min(losses) < 0.9 * losses[0]
    assert float(scales[:4].min()) > float(scales[4:].max())


def test_awq_scales_are_ones_at_alpha_zero_and_normalized():
    mean_abs = torch.tensor([0.5, 1.0, 4.0, 16.0])
    assert torch.equal(activation_scales(mean_abs, 0.0), torch.ones(4))
    scales = activation_scales(mean_abs, 0.5)
    torch.testing.assert_close(scales.max() * scales.min(), torch.tensor(1.0))
    torch.testing.assert_close(scales / scales[0], (mean_abs / mean_abs[0]).sqrt())


def group_errors(weight, approx, inputs, group_size):
    """Mean squared error of each (output row, group)'s partial output [out, groups]."""
    x = inputs.reshape(inputs.shape[0], -1, group_size)  # [n, groups, size]
    diff = (weight - approx).reshape(weight.shape[0], -1, group_size)  # [out, groups, size]
    return torch.einsum("ngs,ogs->ong", x, diff).pow(2).mean(dim=1)


def test_awq_clip_search_never_increases_a_groups_error():
    inputs = outlier_inputs()
    weight = torch.randn(32, 64, generator=_generator(7))
    weight[0, 5] = 12.0  # one outlier weight that clipping can trade away
    spec = QuantSpec(group_size=32)
    bounds = search_clip(inputs, weight, spec)
    assert bounds.shape == (32, 2)
    assert bool((bounds <= weight.abs().reshape(32, 2, 32).amax(-1) + 1e-6).all())
    clipped = group_errors(
        weight, fake_quantize_grouped(apply_clip(weight, bounds, spec), spec), inputs, 32
    )
    plain = group_errors(weight, fake_quantize_grouped(weight, spec), inputs, 32)
    assert bool((clipped <= plain * (1 + 1e-5)).all())
    assert float(clipped.sum()) < float(plain.sum())  # and clipping helps somewhere


def test_awq_clip_search_handles_a_short_last_group():
    inputs = outlier_inputs(features=80)
    weight = torch.randn(8, 80, generator=_generator(8))
    spec = QuantSpec(group_size=32)
    bounds = search_clip(inputs, weight, spec)
    assert bounds.shape == (8, 3)
    clipped = apply_clip(weight, bounds, spec)
    assert bool((clipped[:, 64:].abs() <= bounds[:, 2:3] + 1e-6).all())
