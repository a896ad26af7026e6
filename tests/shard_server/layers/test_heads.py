from __future__ import annotations

import pytest

from textgate.quantization.weights import Shard
from textgate.shard_server.layers.heads import HeadPartition


@pytest.mark.parametrize(
    ("heads", "kv_heads", "world_size"),
    [(8, 8, 1), (8, 2, 2), (9, 3, 2), (9, 3, 3), (6, 3, 6), (4, 1, 2), (32, 8, 4), (12, 2, 4)],
)
def test_every_query_head_is_owned_once_with_its_kv_head(heads, kv_heads, world_size):
    group = heads // kv_heads
    owned = []
    for rank in range(world_size):
        part = HeadPartition.for_rank(heads, kv_heads, rank, world_size)
        assert part.num_heads % part.num_kv_heads == 0
        for head in range(part.q.start, part.q.stop):
            assert part.kv.start <= head // group < part.kv.stop
        owned.extend(range(part.q.start, part.q.stop))
    assert owned == list(range(heads))


def test_uneven_split_gives_the_first_rank_more():
    assert HeadPartition.for_rank(9, 3, 0, 2) == HeadPartition(Shard(0, 6), Shard(0, 2))
    assert HeadPartition.for_rank(9, 3, 1, 2) == HeadPartition(Shard(6, 9), Shard(2, 3))


def test_kv_heads_are_replicated_past_their_count():
    parts = [HeadPartition.for_rank(4, 1, rank, 2) for rank in range(2)]
    assert [p.kv for p in parts] == [Shard(0, 1), Shard(0, 1)]
    assert [p.q for p in parts] == [Shard(0, 2), Shard(2, 4)]


@pytest.mark.parametrize(("heads", "kv_heads", "world_size"), [(9, 3, 4), (6, 2, 4), (6, 4, 1)])
def test_impossible_splits_are_rejected(heads, kv_heads, world_size):
    with pytest.raises(ValueError):
        HeadPartition.for_rank(heads, kv_heads, 0, world_size)


def test_rows_are_head_features():
    assert HeadPartition.rows(Shard(2, 5), 8) == Shard(16, 40)
