"""The LoRA adapters resident on one model, by slot: loaded at startup or at runtime and
unloaded, within `--max-loras` and `--max-lora-rank`.

A runtime load is two halves so that running streams wait at most one step for it:
`LoraSlots.read` (the folder read, converted and checked against the base; any thread,
the model keeps stepping) and `LoraSlots.attach` (the slot taken and the layers' pairs
folded again; the model thread, between two steps). `unload` frees the slot between two
steps too; a slot is reused by the next load.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from textgate.shard_server.layers.lora import Placement, apply, detach, place
from textgate.shard_server.layers.lora_adapter import LoraAdapter, LoraError
from textgate.shard_server.layers.lora_limits import LoraLimits


@dataclass(frozen=True)
class ReadAdapter:
    """An adapter read from its folder and checked against the model, not attached yet."""

    adapter: LoraAdapter
    placements: list[Placement]


class LoraSlots:
    """The adapters attached to `model`: id -> slot (slot 0 is the base).

    `unsupported` says why this model takes no adapters (transformers' modules); every
    load then fails with it."""

    def __init__(
        self, model: Any, limits: LoraLimits | None = None, unsupported: str | None = None
    ) -> None:
        self.model = model
        self.limits = limits or LoraLimits()
        self.unsupported = unsupported
        self.slots: dict[str, int] = {}

    def read(self, name: str, path: Path) -> ReadAdapter:
        """Read the PEFT folder `path` as adapter `name` and check it against the model
        and the limits (LoraError saying why not); the model is not touched."""
        self._check_room(name)
        adapter = LoraAdapter.load(
            name, path, self.model.dtype, self.model.device, self.limits.max_rank
        )
        return ReadAdapter(adapter, place(self.model, adapter))

    def attach(self, read: ReadAdapter) -> int:
        """Attach a `read` adapter in the lowest free slot (model thread, between steps)."""
        self._check_room(read.adapter.name)
        slot = min(set(range(1, len(self.slots) + 2)) - set(self.slots.values()))
        apply(slot, read.adapter.scale, read.placements)
        self.slots[read.adapter.name] = slot
        return slot

    def load(self, name: str, path: Path) -> LoraAdapter:
        """`read` then `attach`, in the calling thread (startup)."""
        read = self.read(name, path)
        self.attach(read)
        return read.adapter

    def unload(self, name: str) -> None:
        """Detach adapter `name` and free its slot (model thread, between steps)."""
        slot = self.slots.pop(name, None)
        if slot is None:
            raise LoraError(f"LoRA adapter {name!r} is not loaded (loaded: {self._names()})")
        detach(self.model, slot)

    def _check_room(self, name: str) -> None:
        if self.unsupported is not None:
            raise LoraError(self.unsupported)
        if name in self.slots:
            raise LoraError(f"LoRA adapter {name!r} is already loaded")
        if len(self.slots) >= self.limits.max_loras:
            raise LoraError(
                f"cannot load LoRA adapter {name!r}: {len(self.slots)} of --max-loras "
                f"{self.limits.max_loras} already loaded ({self._names()}); unload one first"
            )

    def _names(self) -> str:
        return ", ".join(sorted(self.slots)) or "none"
