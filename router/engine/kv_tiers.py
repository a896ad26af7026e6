"""The router's index of the KV tiers below the device cache: host memory, then disk.

A prefix-cache block the allocator evicts from the device is not lost: the shards copy
it into a bounded host pool (`--kv-offload-bytes`), and the host pool's least recently
used blocks move on to a disk directory (`--kv-offload-dir`) when it is full. A later
prompt whose chain hashes miss the device cache but hit a tier gets a fresh device block
that the shards fill from the tier before the step runs: those tokens count as computed,
so they are not recomputed.

This index is the router's picture of what the tiers hold, so it knows what is
restorable; the shards keep the tensors and do exactly what the plan's transfers say,
in order (`KvTransfer` in generate.proto), so their pools mirror this index without a
rule of their own. Pure Python, like the allocator it serves.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass
from enum import Enum

BlockHash = bytes


class KvTier(Enum):
    """Where a prefix-cache hit came from."""

    DEVICE = "device"
    HOST = "host"
    DISK = "disk"


class TransferKind(Enum):
    """What the shards do with one block (generate.proto's KvTransferKind)."""

    OFFLOAD = 1
    """Device block -> host tier, before the block is reused."""
    RESTORE = 2
    """Host (or disk) tier -> device block, before attention reads it."""
    DEMOTE = 3
    """Out of the full host tier; written to the disk tier when there is one."""


@dataclass(frozen=True)
class KvTransfer:
    """One copy the shards run before the step writes: `block_id` is unused by DEMOTE."""

    kind: TransferKind
    block_hash: BlockHash
    block_id: int = 0


class KvTierIndex:
    """Which block hashes the host and disk tiers hold, and the copies not yet planned.

    `num_host_blocks` bounds the host pool (0 with a disk tier: every offloaded block goes
    straight on to disk); the disk tier is unbounded, it starts with `disk_hashes` (what an
    earlier run left there). `block_bytes` is what one block takes on a shard (metrics).
    """

    def __init__(
        self,
        num_host_blocks: int,
        *,
        block_bytes: int = 0,
        disk: bool = False,
        disk_hashes: Iterable[BlockHash] = (),
    ) -> None:
        if num_host_blocks < 0:
            raise ValueError(f"num_host_blocks must be >= 0, got {num_host_blocks}")
        if num_host_blocks == 0 and not disk:
            raise ValueError("a KV tier needs host blocks or a disk tier")
        self.num_host_blocks = num_host_blocks
        self.block_bytes = block_bytes
        self.disk = disk
        # Least recently offloaded or hit first.
        self._host: OrderedDict[BlockHash, None] = OrderedDict()
        self._disk: set[BlockHash] = set(disk_hashes) if disk else set()
        self._transfers: list[KvTransfer] = []
        # Hashes the last planned step demoted: on disk only once that step has run.
        self._last_demoted: set[BlockHash] = set()
        self.num_offloaded_blocks = 0
        self.num_restored_blocks = {KvTier.HOST: 0, KvTier.DISK: 0}

    @property
    def num_host_used(self) -> int:
        """Blocks the host pool holds now."""
        return len(self._host)

    @property
    def num_disk_blocks(self) -> int:
        """Blocks the disk tier holds (written, or being written)."""
        return len(self._disk)

    def tier_of(self, block_hash: BlockHash) -> KvTier | None:
        """Which tier would restore `block_hash` (host before disk), None when neither."""
        if block_hash in self._host:
            return KvTier.HOST
        if block_hash in self._disk:
            return KvTier.DISK
        return None

    def offload(self, block_id: int, block_hash: BlockHash) -> None:
        """The allocator evicts device block `block_id`, published under `block_hash`.

        A block the host pool holds already (it was restored from there) is not copied
        again, only marked recently used.
        """
        if block_hash in self._host:
            self._host.move_to_end(block_hash)
            return
        self._transfers.append(KvTransfer(TransferKind.OFFLOAD, block_hash, block_id))
        self.num_offloaded_blocks += 1
        self._host[block_hash] = None

    def restore(self, block_hash: BlockHash, block_id: int) -> KvTier:
        """Plan the copy of `block_hash` from its tier into device block `block_id`."""
        tier = self.tier_of(block_hash)
        if tier is None:
            raise KeyError(f"block {block_hash.hex()[:16]} is in no KV tier")
        if tier is KvTier.HOST:
            self._host.move_to_end(block_hash)
        self._transfers.append(KvTransfer(TransferKind.RESTORE, block_hash, block_id))
        self.num_restored_blocks[tier] += 1
        return tier

    def take_transfers(self) -> tuple[KvTransfer, ...]:
        """The copies planned since the last call, in order: the next step runs them.

        The host pool is trimmed to its bound here, once per step, rather than at each
        offload: a block the step restores stays restorable until its RESTORE has run,
        whatever the step evicts after finding it (the pool holds at most one step's
        offloads over its bound, for the time of that step's transfers).
        """
        self._last_demoted = set()
        while len(self._host) > self.num_host_blocks:
            demoted, _ = self._host.popitem(last=False)
            self._transfers.append(KvTransfer(TransferKind.DEMOTE, demoted))
            if self.disk and demoted not in self._disk:
                self._disk.add(demoted)
                self._last_demoted.add(demoted)
        transfers, self._transfers = tuple(self._transfers), []
        return transfers

    def forget_host(self) -> None:
        """A step failed, so which of its transfers ran is unknown: trust no host block
        (the shards drop theirs on ClearCache), nor the disk blocks that step demoted."""
        self._host.clear()
        self._transfers.clear()
        self._disk -= self._last_demoted
        self._last_demoted = set()
