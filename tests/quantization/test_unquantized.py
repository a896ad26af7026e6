from __future__ import annotations

import torch
from safetensors.torch import save_file

from textgate.kernels.linear import FastLinear
from textgate.quantization import Shard, Weights
from textgate.quantization.unquantized import UnquantizedWeight
from textgate.tests.fake_group import FakeGroup


def _weights(tmp_path, rank=0, world_size=1) -> tuple[Weights, dict[str, torch.Tensor]]:
    torch.manual_seed(0)
    tensors = {"q.weight": torch.randn(8, 4), "k.weight": torch.randn(4, 4)}
    path = tmp_path / "model.safetensors"
    if not path.exists():
        save_file(tensors, path)
    weights = Weights(
        [path], device="cpu", dtype=torch.float32, process_group=FakeGroup(rank, world_size)
    )
    return weights, tensors


def test_weight_becomes_a_fast_linear(tmp_path):
    weights, tensors = _weights(tmp_path)
    weight = weights.get_weights("q")
    assert isinstance(weight, UnquantizedWeight)
    bias = torch.randn(8)
    linear = weight.get_linear(bias)
    assert isinstance(linear, FastLinear)
    assert not linear.weight.requires_grad
    x = torch.randn(2, 4)
    torch.testing.assert_close(linear(x), x @ tensors["q.weight"].T + bias)


def test_column_row_and_fused_slices(tmp_path):
    weights, tensors = _weights(tmp_path, rank=1, world_size=2)
    q, k = tensors["q.weight"], tensors["k.weight"]
    col = weights.get_weights_col("q")
    row = weights.get_weights_row("q")
    fused = weights.get_multi_weights_col(["q", "k"])
    chosen = weights.get_multi_weights_col(["q", "k"], shards=[Shard(0, 6), Shard(3, 4)])
    assert all(isinstance(w, UnquantizedWeight) for w in (col, row, fused, chosen))
    torch.testing.assert_close(col.weight, q[4:])
    torch.testing.assert_close(row.weight, q[:, 2:])
    torch.testing.assert_close(fused.weight, torch.cat([q[4:], k[2:]]))
    torch.testing.assert_close(chosen.weight, torch.cat([q[:6], k[3:]]))
