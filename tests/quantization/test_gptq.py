"""GPTQ loader: every bits/group/desc_act/sym/format combination against the dequantized
reference, the fast CPU layer against the dequantize-then-matmul reference, and 2-way
tensor-parallel splits that add up (row) or concatenate (column) to the whole layer."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from textgate.kernels.int4_linear import (
    PROMPT_ROWS,
    Int4PackedLinear,
    build_quantized_linear,
    expand_int4,
    reference_expand_int4,
)
from textgate.kernels.linear import FastLinear
from textgate.kernels.packing import (
    GPTQ_V1,
    GPTQ_V2,
    contiguous_g_idx,
    dequantize_gptq,
    pack_gptq,
    unpack_gptq,
)
from textgate.quantization import Weights, get_weights_loader
from textgate.quantization.gptq import GptqConfig, QuantizedWeight
from textgate.quantization.unquantized import UnquantizedWeight
from textgate.tests.fake_group import FakeGroup


def make_layer(
    out_f: int,
    in_f: int,
    bits: int,
    group: int,
    desc_act: bool,
    sym: bool,
    seed: int,
    fmt: str = GPTQ_V1,
) -> dict[str, torch.Tensor]:
    """A random GPTQ layer as a checkpoint stores it."""
    gen = torch.Generator().manual_seed(seed)
    g_idx = contiguous_g_idx(in_f, group)
    if desc_act:
        g_idx = g_idx[torch.randperm(in_f, generator=gen)]
    groups = int(g_idx.max()) + 1
    intweight = torch.randint(0, 1 << bits, (out_f, in_f), generator=gen, dtype=torch.int32)
    if sym:
        zeros = torch.full((groups, out_f), 1 << (bits - 1), dtype=torch.int32)
    else:
        zeros = torch.randint(0, 1 << bits, (groups, out_f), generator=gen, dtype=torch.int32)
    scales = torch.rand(groups, out_f, generator=gen) * (0.1 / (1 << bits)) + 1e-3
    return pack_gptq(intweight, scales, zeros, g_idx, bits, checkpoint_format=fmt)


def reference(layer: dict[str, torch.Tensor], bits: int, fmt: str = GPTQ_V1) -> torch.Tensor:
    return dequantize_gptq(**layer, bits=bits, checkpoint_format=fmt)  # [out, in] fp32


def open_weights(
    path: Path,
    tensors: dict[str, torch.Tensor],
    config: dict,
    dtype: torch.dtype,
    rank: int = 0,
    world_size: int = 1,
) -> Weights:
    if not path.exists():
        save_file(tensors, path)
    return Weights(
        [path],
        device="cpu",
        dtype=dtype,
        process_group=FakeGroup(rank, world_size),
        loader=get_weights_loader("gptq", config),
    )


def check_close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    else:  # bf16 activations and scales: ~3 significant digits per product
        scale = want.abs().max().item()
        assert (got.float() - want).abs().max().item() <= 2e-2 * scale


@pytest.mark.parametrize("bits", [2, 4, 8])
@pytest.mark.parametrize("group", [-1, 32, 64, 128])
@pytest.mark.parametrize(
    ("desc_act", "sym", "fmt"),
    [
        (False, True, GPTQ_V1),
        (False, False, GPTQ_V1),
        (True, True, GPTQ_V1),
        (True, False, GPTQ_V1),
        (False, False, GPTQ_V2),
        (True, False, GPTQ_V2),
    ],
)
def test_layer_matches_dequantized_reference(tmp_path, bits, group, desc_act, sym, fmt):
    # 576 inputs: g128 leaves a last group of 64, as on the default model.
    layer = make_layer(96, 576, bits, group, desc_act, sym, seed=bits * 1000 + group, fmt=fmt)
    config = {
        "quant_method": "gptq",
        "bits": bits,
        "group_size": group,
        "desc_act": desc_act,
        "sym": sym,
        "checkpoint_format": fmt,
    }
    want_w = reference(layer, bits, fmt)
    x = torch.randn(5, 576, generator=torch.Generator().manual_seed(7))
    bias = torch.randn(96)
    for dtype in (torch.float32, torch.bfloat16):
        weights = open_weights(
            tmp_path / "l.safetensors", {f"l.{k}": v for k, v in layer.items()}, config, dtype
        )
        weight = weights.get_weights("l")
        assert isinstance(weight, QuantizedWeight)
        linear = weight.get_linear(bias.to(dtype))
        fast = dtype == torch.bfloat16 and bits <= 4
        assert isinstance(linear, Int4PackedLinear if fast else FastLinear)
        want = x.to(dtype).float() @ want_w.T + bias.to(dtype).float()
        check_close(linear(x.to(dtype)), want, dtype)


@pytest.mark.parametrize("shape", [(40, 96), (24, 64)])
def test_ragged_shapes_take_the_dequantized_path(tmp_path, shape):
    out_f, in_f = shape  # out not a multiple of 16: the int4 kernel cannot take it
    layer = make_layer(out_f, in_f, 4, 32, False, False, seed=3)
    weights = open_weights(
        tmp_path / "l.safetensors",
        {f"l.{k}": v for k, v in layer.items()},
        {"bits": 4, "group_size": 32},
        torch.bfloat16,
    )
    linear = weights.get_weights("l").get_linear(None)
    assert isinstance(linear, FastLinear)
    x = torch.randn(3, in_f)
    check_close(linear(x.bfloat16()), x.bfloat16().float() @ reference(layer, 4).T, torch.bfloat16)


def test_int4_kernel_matches_the_reference_and_the_switch_selects_it(monkeypatch):
    # The kernel's (q - 8) * s + s * (8 - z) is s * (q - z): the act-order layer (inputs
    # gathered at run time) against dequantize-then-matmul on the same bf16 inputs.
    layer = make_layer(64, 256, 4, 64, True, False, seed=11)
    unpacked = unpack_gptq(**layer, bits=4)
    fast = build_quantized_linear(unpacked, 4, torch.bfloat16)
    assert isinstance(fast, Int4PackedLinear) and fast.perm is not None
    x = torch.randn(4, 256).bfloat16()
    want = x.float() @ reference(layer, 4).T
    check_close(fast(x), want, torch.bfloat16)
    monkeypatch.setenv("TEXTGATE_CPU_KERNELS", "0")  # the reference, as for the C kernels
    slow = build_quantized_linear(unpacked, 4, torch.bfloat16)
    assert isinstance(slow, FastLinear)
    check_close(slow(x), want, torch.bfloat16)


@pytest.mark.parametrize("group", [32, 64, 128])
def test_prompt_sized_inputs_expand_the_codes(group):
    # From PROMPT_ROWS rows the layer expands its codes to bf16 (cpu_int4.c) and runs a
    # dense matmul: the expansion equals its PyTorch reference (to one bf16 rounding, where
    # the compiler fuses the multiply-add) and both row counts compute the same layer.
    layer = make_layer(192, 320, 4, group, True, False, seed=group)
    fast = build_quantized_linear(unpack_gptq(**layer, bits=4), 4, torch.bfloat16)
    assert isinstance(fast, Int4PackedLinear)
    dense = expand_int4(fast.packed, fast.scales_and_zeros, fast.group_size)
    assert dense is not None and dense.shape == (320, 192)
    want = reference_expand_int4(fast.packed, fast.scales_and_zeros, fast.group_size)
    torch.testing.assert_close(dense.float(), want.float(), rtol=2**-8, atol=0)
    perm = fast.perm if fast.perm is not None else torch.arange(320)
    full = reference(layer, 4)  # [out, in], the checkpoint's input order
    # bf16 scales and zeros: within a few bf16 steps of the largest weight.
    atol = full.abs().max().item() * 2**-6
    torch.testing.assert_close(want.float(), full[:, perm].T, rtol=0, atol=atol)
    x = torch.randn(PROMPT_ROWS + 3, 320).bfloat16()
    want_out = x.float() @ full.T
    check_close(fast(x), want_out, torch.bfloat16)  # expanded
    check_close(fast(x[:5]), want_out[:5], torch.bfloat16)  # the int4 kernel


def test_four_bit_methods_ask_for_bfloat16_under_auto_on_a_bf16_cpu(monkeypatch):
    # The int4 kernel runs in bf16 only: `--dtype auto` must not time float32, where the
    # codes would be dequantized to 8x their bytes, on a CPU with bf16 arithmetic. Without
    # it (AVX2) bf16 may crawl: both are timed. 8-bit codes leave the choice open.
    from textgate.quantization import gptq

    monkeypatch.setattr(gptq, "has_bf16_arithmetic", lambda: False)
    assert get_weights_loader("gptq", {"bits": 4, "group_size": 128}).cpu_dtype() is None
    monkeypatch.setattr(gptq, "has_bf16_arithmetic", lambda: True)
    assert get_weights_loader("gptq", {"bits": 4, "group_size": 128}).cpu_dtype() == torch.bfloat16
    assert get_weights_loader("awq", {"bits": 4, "group_size": 64}).cpu_dtype() == torch.bfloat16
    assert get_weights_loader("gptq", {"bits": 8, "group_size": 128}).cpu_dtype() is None
    assert get_weights_loader(None).cpu_dtype() is None
    monkeypatch.setenv("TEXTGATE_CPU_KERNELS", "0")
    assert get_weights_loader("gptq", {"bits": 4, "group_size": 128}).cpu_dtype() is None


@pytest.mark.parametrize("desc_act", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_two_way_split_equals_whole_layer(tmp_path, desc_act, dtype):
    # 576 inputs over 2 ranks: 288 each, so g128's group 2 straddles the ranks.
    q = make_layer(192, 576, 4, 128, desc_act, False, seed=21)
    k = make_layer(64, 576, 4, 128, desc_act, False, seed=22)
    if desc_act:  # q/k/v share their input, so act-order gives them the same g_idx
        k["g_idx"] = q["g_idx"].clone()
    tensors = {f"q.{n}": t for n, t in q.items()} | {f"k.{n}": t for n, t in k.items()}
    config = {"bits": 4, "group_size": 128, "desc_act": desc_act, "sym": False}
    path = tmp_path / "m.safetensors"
    x = torch.randn(3, 576).to(dtype)
    whole = open_weights(path, tensors, config, dtype)
    full_row = whole.get_weights_row("q").get_linear(None)(x)
    full_col = whole.get_weights_col("q").get_linear(None)(x)
    full_multi = whole.get_multi_weights_col(["q", "k"]).get_linear(None)(x)
    rows, cols, multis = [], [], []
    for rank in range(2):
        part = open_weights(path, tensors, config, dtype, rank, 2)
        rows.append(part.get_weights_row("q").get_linear(None)(x[:, rank * 288 : (rank + 1) * 288]))
        cols.append(part.get_weights_col("q").get_linear(None)(x))
        multis.append(part.get_multi_weights_col(["q", "k"]).get_linear(None)(x))
    tol = {"rtol": 1e-4, "atol": 1e-4} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 2e-2}
    torch.testing.assert_close(rows[0].float() + rows[1].float(), full_row.float(), **tol)
    torch.testing.assert_close(torch.cat(cols, dim=-1), full_col, **tol)
    # fused: rank r holds q's r-th half then k's r-th half
    want = torch.cat(
        [full_multi[:, :96], full_multi[:, 192:224], full_multi[:, 96:192], full_multi[:, 224:]],
        dim=-1,
    )
    torch.testing.assert_close(torch.cat(multis, dim=-1), want, **tol)


def test_fused_layers_with_different_act_order_fall_back_to_float(tmp_path):
    q = make_layer(64, 128, 4, 32, True, False, seed=31)
    k = make_layer(32, 128, 4, 32, True, False, seed=32)
    weights = open_weights(
        tmp_path / "m.safetensors",
        {f"q.{n}": t for n, t in q.items()} | {f"k.{n}": t for n, t in k.items()},
        {"bits": 4, "group_size": 32, "desc_act": True},
        torch.float32,
    )
    fused = weights.get_multi_weights_col(["q", "k"])
    assert isinstance(fused, UnquantizedWeight)
    torch.testing.assert_close(fused.weight, torch.cat([reference(q, 4), reference(k, 4)]))


def test_float_layers_in_a_gptq_checkpoint_load_as_float(tmp_path):
    layer = make_layer(32, 64, 4, 32, False, True, seed=41)
    dense = torch.randn(16, 64)
    weights = open_weights(
        tmp_path / "m.safetensors",
        {f"q.{n}": t for n, t in layer.items()} | {"head.weight": dense},
        {"bits": 4, "group_size": 32},
        torch.float32,
    )
    assert isinstance(weights.get_weights("head"), UnquantizedWeight)
    assert isinstance(weights.get_weights_col("q"), QuantizedWeight)


def test_row_split_off_word_boundaries_is_refused(tmp_path):
    layer = make_layer(32, 64, 4, 32, False, True, seed=51)
    weights = open_weights(
        tmp_path / "m.safetensors",
        {f"q.{n}": t for n, t in layer.items()},
        {"bits": 4, "group_size": 32},
        torch.float32,
        rank=0,
        world_size=3,
    )
    with pytest.raises(ValueError, match="whole 4-bit words"):
        weights.get_weights_row("q")  # 64 inputs over 3 ranks: 22 is not a multiple of 8


def test_tensors_that_disagree_with_the_config_are_refused(tmp_path):
    layer = make_layer(32, 64, 4, 32, False, True, seed=61)
    weights = open_weights(
        tmp_path / "m.safetensors",
        {f"q.{n}": t for n, t in layer.items()},
        {"bits": 8, "group_size": 32},
        torch.float32,
    )
    with pytest.raises(ValueError, match="disagree"):
        weights.get_weights("q")


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({"bits": 3}, "bits=3"),
        ({"group_size": 0}, "group_size"),
        ({"checkpoint_format": "marlin"}, "'marlin'"),
        ({"format": "bitblas"}, "'bitblas'"),
        ({"pack_dtype": "int16"}, "pack_dtype"),
        ({"lm_head": True}, "lm_head"),
        ({"dynamic": {"-:.*mlp.*": {}}}, "dynamic"),
    ],
)
def test_bad_configs_are_refused(config, message):
    with pytest.raises(ValueError, match=message):
        GptqConfig.from_dict(config)


def test_config_spellings():
    assert GptqConfig.from_dict({}) == GptqConfig()
    v2 = GptqConfig.from_dict(
        {
            "format": "GPTQ_V2",
            "bits": 8,
            "group_size": -1,
            "desc_act": True,
            "sym": False,
            "pack_dtype": "torch.int32",
        }
    )
    assert v2 == GptqConfig(
        bits=8, group_size=-1, desc_act=True, sym=False, checkpoint_format=GPTQ_V2
    )
