"""The shard's KV tiers: host copies of prefix blocks evicted from the device cache, and
their files on disk.

The router decides everything (router/engine/kv_tiers.py); a step's plan lists the
copies (`KvTransfer`), and `KvTierStore.apply` runs them in that order before the step
writes any KV: OFFLOAD copies a device block into the host pool under its chain hash,
RESTORE copies a host (or disk) block into a device block, DEMOTE drops a block from the
host pool, writing it to the disk tier first when there is one.

A block copy is one tensor per cache component, [2 (K, V), num_layers, block_size,
H_kv, D] (and [2, num_layers, block_size, H_kv] float32 scales for a quantized cache),
this rank's heads only: under tensor parallelism each rank keeps its own share.

On a GPU the copies run on a side stream into pinned host memory, so the step's host
thread only enqueues them; the step's own stream waits for them on the device (a block
being reused is read before it is overwritten, a restored one is in place before
attention). On a CPU both tiers are RAM and a copy is a plain memcpy, paid in the step
(a restore copies twice: staged, then into the cache). Disk writes run on a writer
thread, never the step's; a restore from disk reads the file in the step.

The disk tier lives under one folder per model, weights' quantization, KV dtype, block
size and per-rank layout (`disk_dir`), so after a restart only a server whose KV would be
bit-identical finds the files; a file is named by its block's hash and written whole
(to a temporary name, then renamed) before it is listed.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
from collections.abc import Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from itertools import groupby
from pathlib import Path

import torch
from torch import Tensor

from textgate.proto import generate_pb2 as pb
from textgate.shard_server.step.kv_cache import KVCache

log = logging.getLogger("textgate.shard")

DISK_SUFFIX = ".kv"
"""Extension of a disk-tier block file (torch.save of its tensors)."""


@dataclass(frozen=True)
class KvLayout:
    """What a block's KV depends on besides its tokens: the disk tier's folder key."""

    model_id: str
    quantize: str
    kv_dtype: str
    block_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    rank: int
    world_size: int

    def folder_name(self) -> str:
        """A readable, filesystem-safe name that changes whenever any field does."""
        digest = hashlib.sha256(repr(self).encode()).hexdigest()[:16]
        readable = re.sub(r"[^A-Za-z0-9._-]+", "_", self.model_id.rstrip("/").split("/")[-1])
        return f"{readable}-{self.kv_dtype}-b{self.block_size}-r{self.rank}of{self.world_size}-{digest}"


@dataclass
class BlockCopy:
    """One block's KV off the device: a tensor per cache component (see the module)."""

    tensors: tuple[Tensor, ...]
    ready: torch.cuda.Event | None = None
    """Recorded after the device-to-host copy (GPU); None on a CPU."""

    def wait(self) -> None:
        """Block the calling thread until the tensors hold the block (before a disk write)."""
        if self.ready is not None:
            self.ready.synchronize()


class KvTierStore:
    """The host pool (by block hash) and, with `disk_dir`, the disk tier's folder.

    The pool holds exactly what the router's index says: the shard adds and drops blocks
    only as the plan's transfers say.
    """

    def __init__(self, device: torch.device, disk_dir: Path | None = None) -> None:
        self.device = device
        self.disk_dir = disk_dir
        self.host: dict[bytes, BlockCopy] = {}
        # Demoted blocks whose file is being written (a restore may still read them here).
        self._writing: dict[bytes, BlockCopy] = {}
        self._writer: ThreadPoolExecutor | None = None
        self._pending: list[Future[None]] = []
        if disk_dir is not None:
            disk_dir.mkdir(parents=True, exist_ok=True)
            self._writer = ThreadPoolExecutor(1, thread_name_prefix="kv-disk")
        self._stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    @staticmethod
    def folder(root: Path, layout: KvLayout) -> Path:
        """The disk tier's folder for `layout` under `root` (--kv-offload-dir)."""
        return root / layout.folder_name()

    def disk_hashes(self) -> list[bytes]:
        """The block hashes the disk tier holds (what an earlier run wrote)."""
        if self.disk_dir is None:
            return []
        hashes = []
        for path in self.disk_dir.glob(f"*{DISK_SUFFIX}"):
            try:
                hashes.append(bytes.fromhex(path.stem))
            except ValueError:
                continue  # not a block file of ours
        return hashes

    # -- the plan's transfers --------------------------------------------------------

    def apply(self, transfers: Sequence[pb.KvTransfer], cache: KVCache) -> None:
        """Run `transfers` in order; consecutive ones of a kind are batched."""
        for kind, run in groupby(transfers, key=lambda t: t.kind):
            batch = list(run)
            if kind == pb.KV_TRANSFER_KIND_OFFLOAD:
                self._offload(batch, cache)
            elif kind == pb.KV_TRANSFER_KIND_RESTORE:
                self._restore(batch, cache)
            elif kind == pb.KV_TRANSFER_KIND_DEMOTE:
                for transfer in batch:
                    self._demote(transfer.block_hash)
            else:
                raise ValueError(f"unknown KV transfer kind {kind}")

    def clear(self) -> None:
        """Drop the host pool (ClearCache: the router no longer trusts it); files stay."""
        self.host.clear()

    def flush(self) -> None:
        """Wait for every disk write queued so far (tests, shutdown)."""
        for future in self._pending:
            future.result()
        self._pending = []

    def _offload(self, batch: Sequence[pb.KvTransfer], cache: KVCache) -> None:
        pin = self._stream is not None
        with self._side_stream():  # what is allocated here is used on that stream only
            ids = torch.tensor([t.block_id for t in batch], device=self.device)
            copies: list[list[Tensor]] = [[] for _ in batch]
            for keys, values in _components(cache):
                # [2, L, n, block_size, ...]: every layer's rows of the n blocks.
                gathered = torch.stack(
                    [
                        torch.stack([c.index_select(0, ids) for c in keys]),
                        torch.stack([c.index_select(0, ids) for c in values]),
                    ]
                )
                for index, tensors in enumerate(copies):
                    block = gathered[:, :, index]
                    host = torch.empty(block.shape, dtype=block.dtype, pin_memory=pin)
                    tensors.append(host.copy_(block, non_blocking=pin))
        ready = self._record()
        for transfer, tensors in zip(batch, copies, strict=True):
            self.host[transfer.block_hash] = BlockCopy(tuple(tensors), ready)

    def _restore(self, batch: Sequence[pb.KvTransfer], cache: KVCache) -> None:
        sources = [self._find(t.block_hash) for t in batch]
        with self._side_stream():
            ids = torch.tensor([t.block_id for t in batch], device=self.device)
            for component, (keys, values) in enumerate(_components(cache)):
                first = sources[0].tensors[component]
                # [n, 2, L, block_size, ...] on the device, one copy per block.
                staged = torch.empty(
                    (len(batch), *first.shape), dtype=first.dtype, device=self.device
                )
                for index, source in enumerate(sources):
                    staged[index].copy_(source.tensors[component], non_blocking=True)
                for layer, (key, value) in enumerate(zip(keys, values, strict=True)):
                    key.index_copy_(0, ids, staged[:, 0, layer])
                    value.index_copy_(0, ids, staged[:, 1, layer])
        self._record()

    def _demote(self, block_hash: bytes) -> None:
        copy = self.host.pop(block_hash)
        if self._writer is None or self._path(block_hash).exists():
            return
        self._writing[block_hash] = copy
        self._pending = [f for f in self._pending if not f.done()]
        self._pending.append(self._writer.submit(self._write, block_hash, copy))

    def _write(self, block_hash: bytes, copy: BlockCopy) -> None:
        """On the writer thread: the whole file under a temporary name, then renamed."""
        try:
            copy.wait()
            path = self._path(block_hash)
            temporary = path.with_suffix(f".tmp{os.getpid()}")
            torch.save(list(copy.tensors), temporary)
            os.replace(temporary, path)
        except OSError as exc:
            log.error("KV disk tier: writing block %s failed: %s", block_hash.hex()[:16], exc)
        finally:
            self._writing.pop(block_hash, None)

    def _find(self, block_hash: bytes) -> BlockCopy:
        """The block from the host pool, a write in progress, or its file."""
        copy = self.host.get(block_hash) or self._writing.get(block_hash)
        if copy is not None:
            return copy
        path = self._path(block_hash) if self.disk_dir is not None else None
        if path is None or not path.exists():
            raise RuntimeError(
                f"KV tier holds no block {block_hash.hex()[:16]}: the router's index and "
                "this shard disagree"
            )
        tensors = torch.load(path, map_location="cpu", weights_only=True)
        return BlockCopy(tuple(tensors))

    def _path(self, block_hash: bytes) -> Path:
        assert self.disk_dir is not None
        return self.disk_dir / f"{block_hash.hex()}{DISK_SUFFIX}"

    def _side_stream(self) -> torch.cuda.StreamContext | _NoStream:
        """The copies' stream (GPU): it waits for the step's stream, which then waits for
        it at `_record`, on the device."""
        if self._stream is None:
            return _NoStream()
        self._stream.wait_stream(torch.cuda.current_stream(self.device))
        return torch.cuda.stream(self._stream)

    def _record(self) -> torch.cuda.Event | None:
        """After the side stream's copies (GPU): an event the step's stream waits for."""
        if self._stream is None:
            return None
        event = torch.cuda.Event()
        event.record(self._stream)
        torch.cuda.current_stream(self.device).wait_event(event)
        return event


class _NoStream:
    """The CPU's stand-in for a stream context: copies run in the calling thread."""

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


def _components(cache: KVCache) -> Iterable[tuple[list[Tensor], list[Tensor]]]:
    """(keys, values) per layer, then their scales when the cache is quantized."""
    yield cache.key_caches, cache.value_caches
    if cache.key_scales is not None and cache.value_scales is not None:
        yield cache.key_scales, cache.value_scales
