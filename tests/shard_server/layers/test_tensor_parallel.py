"""Each rank's slice of a TP layer recombines into the full layer (collectives faked)."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file

from textgate.quantization.weights import Weights
from textgate.shard_server.layers import tensor_parallel as tp
from textgate.shard_server.layers.tensor_parallel import (
    TensorParallelColumnLinear,
    TensorParallelEmbedding,
    TensorParallelHead,
    TensorParallelRowLinear,
)
from textgate.tests.fake_group import FakeGroup


@pytest.fixture
def checkpoint(tmp_path):
    torch.manual_seed(0)
    tensors = {
        "a.weight": torch.randn(10, 6),
        "a.bias": torch.randn(10),
        "b.weight": torch.randn(4, 6),
        "b.bias": torch.randn(4),
        "emb.weight": torch.randn(11, 6),
    }
    path = tmp_path / "model.safetensors"
    save_file(tensors, path)
    return path, tensors


def _weights(path, rank: int, world_size: int) -> Weights:
    return Weights(
        [path], device="cpu", dtype=torch.float32, process_group=FakeGroup(rank, world_size)
    )


@pytest.fixture
def no_collectives(monkeypatch):
    """Make all-reduce a no-op so each rank's partial result can be summed by the test."""
    monkeypatch.setattr(tp.dist, "all_reduce", lambda tensor, group=None: None)


def test_column_slices_concatenate_to_the_full_output(checkpoint):
    path, tensors = checkpoint
    x = torch.randn(3, 6)
    parts = [
        TensorParallelColumnLinear.load(_weights(path, r, 3), "a", bias=True)(x) for r in range(3)
    ]
    torch.testing.assert_close(torch.cat(parts, -1), x @ tensors["a.weight"].T + tensors["a.bias"])


def test_fused_columns_hold_each_prefix_slice_in_order(checkpoint):
    path, tensors = checkpoint
    x = torch.randn(3, 6)
    full_a = x @ tensors["a.weight"].T + tensors["a.bias"]
    full_b = x @ tensors["b.weight"].T + tensors["b.bias"]
    out = [
        TensorParallelColumnLinear.load_multi(_weights(path, r, 2), ["a", "b"], bias=True)(x)
        for r in range(2)
    ]
    torch.testing.assert_close(out[0], torch.cat([full_a[:, :5], full_b[:, :2]], -1))
    torch.testing.assert_close(out[1], torch.cat([full_a[:, 5:], full_b[:, 2:]], -1))


@pytest.mark.usefixtures("no_collectives")
@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_row_partial_sums_add_up_with_the_bias_once(checkpoint, world_size):
    path, tensors = checkpoint
    x = torch.randn(3, 6)
    total = torch.zeros(3, 10)
    for rank in range(world_size):
        weights = _weights(path, rank, world_size)
        layer = TensorParallelRowLinear.load(weights, "a", bias=True)
        total += layer(x[:, weights.even_shard(6).start : weights.even_shard(6).stop])
    torch.testing.assert_close(total, x @ tensors["a.weight"].T + tensors["a.bias"])


@pytest.mark.usefixtures("no_collectives")
@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_vocab_parallel_embedding_sums_to_the_lookup(checkpoint, world_size):
    path, tensors = checkpoint
    ids = torch.tensor([0, 10, 3, 7, 5, 5])
    total = sum(
        TensorParallelEmbedding.load(_weights(path, r, world_size), "emb")(ids)
        for r in range(world_size)
    )
    torch.testing.assert_close(total, tensors["emb.weight"][ids])


def test_head_splits_an_even_vocab_and_replicates_an_odd_one(checkpoint):
    path, tensors = checkpoint
    even = [TensorParallelHead.load(_weights(path, r, 2), "a") for r in range(2)]
    assert all(head.gather for head in even)
    torch.testing.assert_close(torch.cat([h.weight for h in even]), tensors["a.weight"])
    odd = TensorParallelHead.load(_weights(path, 1, 2), "emb")
    assert not odd.gather
    torch.testing.assert_close(odd.weight, tensors["emb.weight"])


def test_tied_head_shares_an_evenly_split_embedding(checkpoint):
    path, _ = checkpoint
    weights = _weights(path, 0, 1)
    embedding = TensorParallelEmbedding.load(weights, "emb")
    head = TensorParallelHead.load(weights, "emb", embedding)
    # No second plain copy: the head packed the embedding's tensor, or holds that tensor.
    dense = head.linear.dense
    assert dense is None or dense.data_ptr() == embedding.weight.data_ptr()
    x = torch.randn(2, 6)
    torch.testing.assert_close(head(x), x @ embedding.weight.T)


def test_one_gpu_per_shard_over_nccl_and_gloo_between_cpus() -> None:
    assert tp.rank_device(0, 1, num_gpus=0) == torch.device("cpu")
    assert tp.rank_device(3, 4, num_gpus=0) == torch.device("cpu")
    assert tp.rank_device(2, 4, num_gpus=8) == torch.device("cuda", 2)
    with pytest.raises(ValueError, match=r"--num-shard 4 needs 4 GPUs.*2 are visible"):
        tp.rank_device(0, 4, num_gpus=2)
    assert tp.distributed_backend(torch.device("cuda", 1)) == "nccl"
    assert tp.distributed_backend(torch.device("cpu")) == "gloo"
