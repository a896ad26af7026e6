"""Checkpoint tensors read from safetensors files, sliced for one tensor-parallel rank."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors import safe_open

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

    from textgate.quantization.base import Weight, WeightsLoader


@dataclass(frozen=True)
class Shard:
    """The half-open range [start, stop) of one dimension that a rank owns."""

    start: int
    stop: int

    @property
    def size(self) -> int:
        return self.stop - self.start


def even_shard(size: int, rank: int, world_size: int) -> Shard:
    """Rank `rank`'s part of `size` items split as evenly as possible.

    The first `size % world_size` ranks own one item more than the others, so any
    size splits (vocabularies, intermediate sizes that do not divide evenly).
    """
    base, extra = divmod(size, world_size)
    start = rank * base + min(rank, extra)
    return Shard(start, start + base + (1 if rank < extra else 0))


class Weights:
    """The tensors of a safetensors checkpoint, read lazily through mmap.

    Knows the target dtype and device and the tensor-parallel process group, so the
    `get_sharded*` methods return only this rank's slice (read from disk as a slice,
    never as the whole tensor). Floating-point tensors are cast to `dtype`; integer
    tensors (packed quantized weights) keep theirs. `aliases` maps a missing name to
    names to try instead (e.g. `lm_head.weight` to the embedding of a tied model).
    Linear layers are read through `loader`, which knows the quantization method.
    """

    def __init__(
        self,
        filenames: Iterable[str | Path],
        *,
        device: torch.device | str,
        dtype: torch.dtype,
        process_group: ProcessGroup | None = None,
        loader: WeightsLoader | None = None,
        aliases: Mapping[str, Sequence[str]] | None = None,
    ) -> None:
        self.device = torch.device(device)
        self.dtype = dtype
        self.process_group = process_group
        self.aliases = dict(aliases or {})
        if loader is None:
            from textgate.quantization.registry import get_weights_loader

            loader = get_weights_loader(None)
        self.loader = loader
        self._routing: dict[str, str] = {}
        self._handles: dict[str, Any] = {}
        for filename in filenames:
            self._index(str(filename))
        if not self._routing:
            raise ValueError("no tensors found: the checkpoint has no safetensors files")

    def _index(self, filename: str) -> None:
        handle = safe_open(filename, framework="pt")
        for name in handle.keys():  # noqa: SIM118  (safe_open handles are not iterable)
            if name in self._routing:
                raise ValueError(f"tensor {name!r} is in both {self._routing[name]} and {filename}")
            self._routing[name] = filename
        self._handles[filename] = handle

    @property
    def rank(self) -> int:
        return 0 if self.process_group is None else self.process_group.rank()

    @property
    def world_size(self) -> int:
        return 1 if self.process_group is None else self.process_group.size()

    def names(self) -> list[str]:
        """Every tensor name in the checkpoint."""
        return list(self._routing)

    def has_tensor(self, name: str) -> bool:
        """Whether `name` (or one of its aliases) is in the checkpoint."""
        return self._resolve(name, required=False) is not None

    def _resolve(self, name: str, *, required: bool = True) -> str | None:
        for candidate in (name, *self.aliases.get(name, ())):
            if candidate in self._routing:
                return candidate
        if required:
            raise KeyError(f"tensor {name!r} is not in the checkpoint")
        return None

    def _slice(self, name: str) -> Any:
        resolved = self._resolve(name)
        assert resolved is not None
        return self._handles[self._routing[resolved]].get_slice(resolved)

    def get_shape(self, name: str) -> list[int]:
        """The stored shape of `name`, without reading it."""
        return list(self._slice(name).get_shape())

    def get_tensor(self, name: str, *, to_dtype: bool = True) -> torch.Tensor:
        """The whole tensor `name` (replicated on every rank)."""
        resolved = self._resolve(name)
        assert resolved is not None
        tensor = self._handles[self._routing[resolved]].get_tensor(resolved)
        return self._finish(tensor, to_dtype)

    def get_partial(
        self, name: str, dim: int, shard: Shard, *, to_dtype: bool = True
    ) -> torch.Tensor:
        """Rows `shard.start:shard.stop` of dimension `dim` of `name`."""
        view = self._slice(name)
        ndim = len(view.get_shape())
        if not 0 <= dim < ndim:
            raise ValueError(f"cannot slice dim {dim} of {name!r}, which has {ndim} dims")
        index = (slice(None),) * dim + (slice(shard.start, shard.stop),)
        return self._finish(view[index], to_dtype)

    def get_sharded(
        self, name: str, dim: int, shard: Shard | None = None, *, to_dtype: bool = True
    ) -> torch.Tensor:
        """This rank's slice of `name` along `dim` (an even split unless `shard` is given)."""
        if shard is None:
            shard = self.even_shard(self.get_shape(name)[dim])
        return self.get_partial(name, dim, shard, to_dtype=to_dtype)

    def even_shard(self, size: int) -> Shard:
        """This rank's part of a dimension of `size` items."""
        return even_shard(size, self.rank, self.world_size)

    def _finish(self, tensor: torch.Tensor, to_dtype: bool) -> torch.Tensor:
        if to_dtype and tensor.is_floating_point():
            tensor = tensor.to(self.dtype)
        return tensor.to(self.device)

    def get_weights(self, prefix: str) -> Weight:
        """A replicated linear weight, read by the loader."""
        return self.loader.get_weights(self, prefix)

    def get_weights_col(self, prefix: str, shard: Shard | None = None) -> Weight:
        """A column-parallel linear weight, read by the loader."""
        return self.loader.get_weights_col(self, prefix, shard)

    def get_multi_weights_col(
        self, prefixes: Sequence[str], dim: int = 0, shards: Sequence[Shard] | None = None
    ) -> Weight:
        """Column-parallel weights fused along `dim` (q/k/v, gate/up), read by the loader."""
        return self.loader.get_multi_weights_col(self, prefixes, dim, shards)

    def get_weights_row(self, prefix: str, shard: Shard | None = None) -> Weight:
        """A row-parallel linear weight, read by the loader."""
        return self.loader.get_weights_row(self, prefix, shard)
