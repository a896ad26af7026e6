"""How attention heads are split over tensor-parallel ranks (GQA-aware)."""

from __future__ import annotations

from dataclasses import dataclass

from textgate.quantization.weights import Shard, even_shard


@dataclass(frozen=True)
class HeadPartition:
    """The query and key/value heads one rank owns.

    A query head always sits on the rank that holds its kv head: with world_size ≤
    num_kv_heads the kv heads are split (unevenly if need be, e.g. 3 kv heads on 2
    ranks) and each takes its whole query group; with more ranks than kv heads each kv
    head is replicated over world_size / num_kv_heads ranks that split its group.
    """

    q: Shard
    kv: Shard

    @classmethod
    def for_rank(
        cls, num_heads: int, num_kv_heads: int, rank: int, world_size: int
    ) -> HeadPartition:
        if num_heads % num_kv_heads:
            raise ValueError(
                f"num_attention_heads={num_heads} is not a multiple of "
                f"num_key_value_heads={num_kv_heads}"
            )
        group = num_heads // num_kv_heads
        if world_size <= num_kv_heads:
            kv = even_shard(num_kv_heads, rank, world_size)
            return cls(Shard(kv.start * group, kv.stop * group), kv)
        if world_size % num_kv_heads or num_heads % world_size:
            raise ValueError(
                f"cannot split {num_heads} query / {num_kv_heads} kv heads over {world_size} "
                "ranks: with more ranks than kv heads, the ranks must be a multiple of the kv "
                "heads and divide the query heads"
            )
        per_rank = num_heads // world_size
        kv_head = rank // (world_size // num_kv_heads)
        return cls(Shard(rank * per_rank, (rank + 1) * per_rank), Shard(kv_head, kv_head + 1))

    @property
    def num_heads(self) -> int:
        return self.q.size

    @property
    def num_kv_heads(self) -> int:
        return self.kv.size

    @staticmethod
    def rows(heads: Shard, head_dim: int) -> Shard:
        """The weight rows (features) of a range of heads."""
        return Shard(heads.start * head_dim, heads.stop * head_dim)
