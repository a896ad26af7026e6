"""AWQ GEMM loader: layers against the dequantized reference, TP splits, bad configs."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file

from textgate.kernels.int4_linear import Int4PackedLinear
from textgate.kernels.linear import FastLinear
from textgate.kernels.packing import dequantize_awq, pack_awq
from textgate.quantization import Weights, get_weights_loader
from textgate.quantization.awq import AwqConfig
from textgate.quantization.gptq import QuantizedWeight
from textgate.tests.fake_group import FakeGroup


def make_layer(out_f: int, in_f: int, group: int, seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    groups = in_f // group
    intweight = torch.randint(0, 16, (out_f, in_f), generator=gen, dtype=torch.int32)
    zeros = torch.randint(0, 16, (groups, out_f), generator=gen, dtype=torch.int32)
    scales = torch.rand(groups, out_f, generator=gen) * 0.01 + 1e-3
    return pack_awq(intweight, scales, zeros)


def open_weights(path, tensors, group, dtype, rank=0, world_size=1) -> Weights:
    if not path.exists():
        save_file(tensors, path)
    config = {
        "quant_method": "awq",
        "bits": 4,
        "group_size": group,
        "zero_point": True,
        "version": "gemm",
    }
    return Weights(
        [path],
        device="cpu",
        dtype=dtype,
        process_group=FakeGroup(rank, world_size),
        loader=get_weights_loader("awq", config),
    )


@pytest.mark.parametrize("group", [64, 128])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_layer_matches_dequantized_reference(tmp_path, group, dtype):
    layer = make_layer(96, 1536, group, seed=group)
    weights = open_weights(
        tmp_path / "l.safetensors", {f"l.{k}": v for k, v in layer.items()}, group, dtype
    )
    weight = weights.get_weights("l")
    assert isinstance(weight, QuantizedWeight)
    linear = weight.get_linear(None)
    assert isinstance(linear, Int4PackedLinear if dtype == torch.bfloat16 else FastLinear)
    x = torch.randn(4, 1536).to(dtype)
    want = x.float() @ dequantize_awq(**layer).T
    tol = 1e-4 if dtype == torch.float32 else 2e-2 * want.abs().max().item()
    assert (linear(x).float() - want).abs().max().item() <= tol


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_two_way_split_equals_whole_layer(tmp_path, dtype):
    q = make_layer(128, 576, 64, seed=1)
    k = make_layer(64, 576, 64, seed=2)
    tensors = {f"q.{n}": t for n, t in q.items()} | {f"k.{n}": t for n, t in k.items()}
    path = tmp_path / "m.safetensors"
    x = torch.randn(3, 576).to(dtype)
    whole = open_weights(path, tensors, 64, dtype)
    full_row = whole.get_weights_row("q").get_linear(None)(x)
    full_multi = whole.get_multi_weights_col(["q", "k"]).get_linear(None)(x)
    rows, multis = [], []
    for rank in range(2):
        part = open_weights(path, tensors, 64, dtype, rank, 2)
        rows.append(part.get_weights_row("q").get_linear(None)(x[:, rank * 288 : (rank + 1) * 288]))
        multis.append(part.get_multi_weights_col(["q", "k"]).get_linear(None)(x))
    tol = {"rtol": 1e-4, "atol": 1e-4} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 2e-2}
    torch.testing.assert_close(rows[0].float() + rows[1].float(), full_row.float(), **tol)
    want = torch.cat(
        [full_multi[:, :64], full_multi[:, 128:160], full_multi[:, 64:128], full_multi[:, 160:]],
        dim=-1,
    )
    torch.testing.assert_close(torch.cat(multis, dim=-1), want, **tol)


def test_column_split_off_word_boundaries_is_refused(tmp_path):
    layer = make_layer(48, 64, 64, seed=3)
    weights = open_weights(
        tmp_path / "m.safetensors",
        {f"q.{n}": t for n, t in layer.items()},
        64,
        torch.float32,
        rank=0,
        world_size=4,
    )
    with pytest.raises(ValueError, match="whole AWQ words"):
        weights.get_weights_col("q")  # 48 outputs over 4 ranks: 12 is not a multiple of 8


def test_groups_that_do_not_cover_the_inputs_are_refused(tmp_path):
    layer = make_layer(32, 256, 64, seed=4)
    weights = open_weights(
        tmp_path / "m.safetensors", {f"q.{n}": t for n, t in layer.items()}, 128, torch.float32
    )
    with pytest.raises(ValueError, match="do not cover"):
        weights.get_weights("q")


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({"version": "gemv"}, "'gemv'"),
        ({"version": "GEMV_FAST"}, "'gemv_fast'"),
        ({"bits": 8}, "bits=8"),
        ({"zero_point": False}, "zero_point"),
        ({"group_size": -1}, "group_size"),
    ],
)
def test_bad_configs_are_refused(config, message):
    with pytest.raises(ValueError, match=message):
        AwqConfig.from_dict(config)


def test_autoawq_spelling():
    assert AwqConfig.from_dict({"w_bit": 4, "q_group_size": 64, "version": "GEMM"}).group_size == 64
