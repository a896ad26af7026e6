from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file

from textgate.quantization.weights import Shard, Weights, even_shard
from textgate.tests.fake_group import FakeGroup


@pytest.fixture
def files(tmp_path):
    torch.manual_seed(0)
    first = {"w": torch.randn(5, 4), "ids": torch.arange(6, dtype=torch.int32)}
    second = {"emb": torch.randn(7, 3).to(torch.bfloat16)}
    paths = [tmp_path / "model-00001.safetensors", tmp_path / "model-00002.safetensors"]
    save_file(first, paths[0])
    save_file(second, paths[1])
    return paths, {**first, **second}


def _weights(paths, rank=0, world_size=1, **kwargs) -> Weights:
    return Weights(
        paths,
        device="cpu",
        dtype=torch.float32,
        process_group=FakeGroup(rank, world_size),
        **kwargs,
    )


def test_reads_tensors_from_every_file_in_the_model_dtype(files):
    paths, tensors = files
    weights = _weights(paths)
    assert sorted(weights.names()) == ["emb", "ids", "w"]
    torch.testing.assert_close(weights.get_tensor("w"), tensors["w"])
    emb = weights.get_tensor("emb")
    assert emb.dtype == torch.float32
    torch.testing.assert_close(emb, tensors["emb"].float())
    assert weights.get_tensor("emb", to_dtype=False).dtype == torch.bfloat16


def test_integer_tensors_keep_their_dtype(files):
    paths, _ = files
    assert _weights(paths).get_tensor("ids").dtype == torch.int32


def test_rank_and_world_size_come_from_the_group(files):
    paths, _ = files
    weights = _weights(paths, 1, 3)
    assert (weights.rank, weights.world_size) == (1, 3)
    solo = Weights(paths, device="cpu", dtype=torch.float32)
    assert (solo.rank, solo.world_size) == (0, 1)


@pytest.mark.parametrize("world_size", [1, 2, 3, 5])
@pytest.mark.parametrize("dim", [0, 1])
def test_sharded_slices_tile_the_tensor(files, world_size, dim):
    paths, tensors = files
    parts = [_weights(paths, r, world_size).get_sharded("w", dim) for r in range(world_size)]
    torch.testing.assert_close(torch.cat(parts, dim), tensors["w"])


def test_explicit_shard_and_partial(files):
    paths, tensors = files
    weights = _weights(paths)
    torch.testing.assert_close(weights.get_sharded("w", 0, Shard(1, 3)), tensors["w"][1:3])
    torch.testing.assert_close(weights.get_partial("w", 1, Shard(2, 4)), tensors["w"][:, 2:4])
    with pytest.raises(ValueError, match="cannot slice dim 2"):
        weights.get_partial("w", 2, Shard(0, 1))


def test_even_shard_gives_the_remainder_to_the_first_ranks():
    assert [even_shard(7, r, 3) for r in range(3)] == [Shard(0, 3), Shard(3, 5), Shard(5, 7)]
    assert even_shard(2, 2, 3) == Shard(2, 2)
    assert Shard(3, 5).size == 2


def test_aliases_stand_in_for_missing_names(files):
    paths, tensors = files
    weights = _weights(paths, aliases={"lm_head.weight": ["missing", "emb"]})
    assert weights.has_tensor("lm_head.weight")
    assert not weights.has_tensor("nope")
    assert weights.get_shape("lm_head.weight") == [7, 3]
    torch.testing.assert_close(weights.get_tensor("lm_head.weight"), tensors["emb"].float())
    with pytest.raises(KeyError, match="'nope' is not in the checkpoint"):
        weights.get_tensor("nope")


def test_a_name_in_two_files_is_an_error(tmp_path):
    paths = [tmp_path / "a.safetensors", tmp_path / "b.safetensors"]
    for path in paths:
        save_file({"w": torch.zeros(1)}, path)
    with pytest.raises(ValueError, match="'w' is in both"):
        _weights(paths)


def test_no_files_is_an_error():
    with pytest.raises(ValueError, match="no safetensors"):
        _weights([])
