"""Tensor-parallel linears, vocab-parallel embedding and the lm head.

Megatron-style: a column-parallel linear owns a slice of the output features and needs
no communication; a row-parallel linear owns a slice of the input features and sums
the partial outputs over the process group. With one rank every collective is skipped.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import accumulate
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from textgate.quantization.weights import Shard, Weights, even_shard

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

    from textgate.shard_server.layers.lora import LoraLayer


def rank_device(rank: int, world_size: int, num_gpus: int) -> torch.device:
    """The device of shard `rank`: GPU `rank` of the visible ones (TGI's rule; the launcher
    passes CUDA_VISIBLE_DEVICES through), or the CPU on a machine without GPUs.

    One process per GPU: NCCL refuses two ranks on one device, so a group larger than the
    visible GPUs is an error here rather than a hang at the first collective.
    """
    if num_gpus == 0:
        return torch.device("cpu")
    if world_size > num_gpus:
        raise ValueError(
            f"--num-shard {world_size} needs {world_size} GPUs, one per shard; "
            f"{num_gpus} are visible (CUDA_VISIBLE_DEVICES selects them)"
        )
    return torch.device("cuda", rank)


def distributed_backend(device: torch.device) -> str:
    """The process group's backend: NCCL between GPUs, gloo between CPU shards."""
    return "nccl" if device.type == "cuda" else "gloo"


def world_size_of(group: ProcessGroup | None) -> int:
    """Ranks in `group` (1 when there is no group)."""
    return 1 if group is None else group.size()


def all_reduce(x: Tensor, group: ProcessGroup | None) -> Tensor:
    """Sum `x` in place over `group`; a no-op on one rank."""
    if world_size_of(group) > 1:
        dist.all_reduce(x, group=group)
    return x


@dataclass(frozen=True)
class ShardLayout:
    """The range of a linear's split dimension (a column linear's outputs, a row linear's
    inputs) that this rank loaded, per fused part; a LoRA update of the layer is split by
    it (`layers.lora.place`), so the two cannot split differently."""

    parts: tuple[Shard | None, ...] = ()
    """Each part's range as the load was given it; None (or absent): the loaders' own
    default, an even split (`Weights.even_shard`)."""
    rank: int = 0
    world_size: int = 1

    @classmethod
    def of(cls, weights: Weights, parts: Sequence[Shard | None]) -> ShardLayout:
        return cls(tuple(parts), weights.rank, weights.world_size)

    def part(self, index: int, size: int) -> Shard:
        """This rank's range of part `index`, a dimension of `size` features."""
        shard = self.parts[index] if index < len(self.parts) else None
        return shard if shard is not None else even_shard(size, self.rank, self.world_size)


class TensorParallelColumnLinear(nn.Module):
    """A linear whose output features are split over the ranks (no communication)."""

    def __init__(self, linear: nn.Module, layout: ShardLayout | None = None) -> None:
        super().__init__()
        self.linear = linear
        self.layout = layout or ShardLayout()
        """The output rows of each fused part this rank holds."""
        self.lora: LoraLayer | None = None
        """LoRA adapters' updates of this layer (layers.lora.attach); None: none."""

    @classmethod
    def load(
        cls, weights: Weights, prefix: str, *, bias: bool, shard: Shard | None = None
    ) -> TensorParallelColumnLinear:
        """This rank's output rows of `<prefix>.weight` (and bias)."""
        weight = weights.get_weights_col(prefix, shard)
        bias_tensor = weights.get_sharded(f"{prefix}.bias", 0, shard) if bias else None
        return cls(weight.get_linear(bias_tensor), ShardLayout.of(weights, [shard]))

    @classmethod
    def load_multi(
        cls,
        weights: Weights,
        prefixes: Sequence[str],
        *,
        bias: bool,
        shards: Sequence[Shard] | None = None,
    ) -> TensorParallelColumnLinear:
        """Several column linears fused into one (q/k/v, gate/up), each sliced for this rank."""
        weight = weights.get_multi_weights_col(prefixes, 0, shards)
        per_prefix = shards if shards is not None else [None] * len(prefixes)
        bias_tensor = None
        if bias:
            bias_tensor = torch.cat(
                [
                    weights.get_sharded(f"{prefix}.bias", 0, shard)
                    for prefix, shard in zip(prefixes, per_prefix, strict=True)
                ]
            )
        return cls(weight.get_linear(bias_tensor), ShardLayout.of(weights, per_prefix))

    @classmethod
    def load_fused(
        cls,
        weights: Weights,
        prefix: str,
        *,
        bias: bool,
        sizes: Sequence[int],
        shards: Sequence[Shard] | None = None,
    ) -> TensorParallelColumnLinear:
        """`load_multi` over parts stored back to back in one tensor (Phi-3's qkv_proj and
        gate_up_proj): part i holds `sizes[i]` rows, of which this rank takes `shards[i]`
        (an even split by default), so the result is laid out as `load_multi`'s."""
        per_part = shards if shards is not None else [weights.even_shard(n) for n in sizes]
        if len(per_part) != len(sizes):
            raise ValueError(f"{len(sizes)} parts but {len(per_part)} shards")
        rows = [
            Shard(offset + shard.start, offset + shard.stop)
            for offset, shard in zip(accumulate(sizes[:-1], initial=0), per_part, strict=True)
        ]
        layer = cls.load_multi(weights, [prefix] * len(rows), bias=bias, shards=rows)
        layer.layout = ShardLayout.of(weights, per_part)  # each part's rows, not the tensor's
        return layer

    def forward(self, x: Tensor) -> Tensor:
        out = self.linear(x)
        return out if self.lora is None else self.lora.add(x, out)


class TensorParallelRowLinear(nn.Module):
    """A linear whose input features are split over the ranks; partial sums are all-reduced."""

    def __init__(
        self,
        linear: nn.Module,
        process_group: ProcessGroup | None,
        layout: ShardLayout | None = None,
    ) -> None:
        super().__init__()
        self.linear = linear
        self.process_group = process_group
        self.layout = layout or ShardLayout()
        """The input columns this rank holds."""
        self.lora: LoraLayer | None = None
        """LoRA adapters' updates, added to the partial sum before the all-reduce."""

    @classmethod
    def load(
        cls,
        weights: Weights,
        prefix: str,
        *,
        bias: bool,
        shard: Shard | None = None,
        reduce: bool = True,
    ) -> TensorParallelRowLinear:
        """This rank's input columns of `<prefix>.weight`; `reduce=False` returns the partial
        sum, for a caller that all-reduces it together with others."""
        weight = weights.get_weights_row(prefix, shard)
        # The bias is added once, by rank 0, so the all-reduce does not multiply it.
        bias_tensor = weights.get_tensor(f"{prefix}.bias") if bias and weights.rank == 0 else None
        group = weights.process_group if reduce else None
        return cls(weight.get_linear(bias_tensor), group, ShardLayout.of(weights, [shard]))

    def forward(self, x: Tensor) -> Tensor:
        out = self.linear(x)
        if self.lora is not None:
            out = self.lora.add(x, out)
        return all_reduce(out, self.process_group)


class TensorParallelEmbedding(nn.Module):
    """Token embedding with the vocabulary split over the ranks.

    Each rank looks up the ids it owns, writes zeros for the others, and the
    all-reduce assembles the full embedding on every rank.
    """

    def __init__(self, weight: Tensor, shard: Shard, process_group: ProcessGroup | None) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.shard = shard
        self.process_group = process_group

    @classmethod
    def load(cls, weights: Weights, prefix: str) -> TensorParallelEmbedding:
        """This rank's rows of `<prefix>.weight` [vocab, hidden]."""
        shard = weights.even_shard(weights.get_shape(f"{prefix}.weight")[0])
        return cls(weights.get_sharded(f"{prefix}.weight", 0, shard), shard, weights.process_group)

    def forward(self, input_ids: Tensor) -> Tensor:
        """input_ids [T] → embeddings [T, hidden]."""
        if world_size_of(self.process_group) == 1:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.shard.start
        foreign = (local < 0) | (local >= self.shard.size)
        out = F.embedding(local.masked_fill(foreign, 0), self.weight)
        out.masked_fill_(foreign[:, None], 0)
        return all_reduce(out, self.process_group)


class TensorParallelHead(nn.Module):
    """The lm head: hidden states [N, hidden] → logits [N, vocab] on every rank.

    The vocabulary is split over the ranks and the logits gathered when it divides
    evenly; otherwise every rank holds the whole head (no gather needed). The layer is
    the loader's (`WeightsLoader.get_head`): plain, or quantized where the method says so.
    """

    def __init__(self, linear: nn.Module, process_group: ProcessGroup | None, gather: bool) -> None:
        super().__init__()
        self.linear = linear
        self.process_group = process_group
        self.gather = gather and world_size_of(process_group) > 1

    @property
    def weight(self) -> Tensor:
        """This rank's weight [vocab or vocab / world_size, hidden] (a copy when packed)."""
        weight: Tensor = self.linear.weight
        return weight

    @classmethod
    def load(
        cls, weights: Weights, prefix: str, tied: TensorParallelEmbedding | None = None
    ) -> TensorParallelHead:
        """Read `<prefix>.weight`, or start from the embedding's slice when the two are tied."""
        name = f"{prefix}.weight"
        vocab_size = weights.get_shape(name)[0]
        gather = vocab_size % weights.world_size == 0
        if tied is not None and (gather or weights.world_size == 1):
            # An even vocab split is the embedding's own split: no second read.
            weight = tied.weight.data
        else:
            weight = weights.get_sharded(name, 0) if gather else weights.get_tensor(name)
        linear = weights.loader.get_head(weight).get_linear(None)
        return cls(linear, weights.process_group, gather)

    def forward(self, hidden: Tensor) -> Tensor:
        logits = self.linear(hidden)  # [N, vocab / world_size] or [N, vocab]
        if not self.gather:
            return logits
        parts = [torch.empty_like(logits) for _ in range(world_size_of(self.process_group))]
        dist.all_gather(parts, logits.contiguous(), group=self.process_group)
        return torch.cat(parts, dim=-1)  # [N, vocab]
