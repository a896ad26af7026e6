"""The LoRA adapters one model serves: every loaded one's host copy (at most
`--max-cpu-loras`), and the resident ones attached to its layers by slot (at most
`--max-loras`; slot 0 is the base).

Which adapters are resident is the router's choice (router/engine/lora_residency.py: it
knows what runs), sent with a step (`StepPlan.lora_residency`) and applied here before
the step runs (`reside`): evicting detaches an adapter's updates from the layers and keeps
its host copy; making one resident copies that to the model's device and folds the layers'
pairs again. A step never runs a row on an adapter that is not resident (`slot_of`).

A runtime load is two halves so that running streams wait at most one step for it:
`LoraSlots.read` (the folder read, converted and checked against the base, into host
memory; any thread, the model keeps stepping) and `LoraSlots.add` (kept; the model
thread, between two steps). `unload` detaches it where resident and drops the host copy.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from textgate.shard_server.layers.lora import (
    LoraLayer,
    Placement,
    apply,
    detach,
    place,
    place_modules,
)
from textgate.shard_server.layers.lora_adapter import LoraAdapter, LoraError
from textgate.shard_server.layers.lora_limits import LoraLimits

HOST = torch.device("cpu")


@dataclass(frozen=True)
class ReadAdapter:
    """An adapter read from its folder and checked against the model: its host copy, cut to
    this rank's share (`placements`, in host memory; pinned where the model is on a GPU)."""

    adapter: LoraAdapter
    placements: list[Placement]


class LoraSlots:
    """The adapters of `model`: `loaded` (id -> host copy) and `slots` (the resident ones,
    id -> slot).

    `unsupported` says why this model takes no adapters; every load then fails with it."""

    def __init__(
        self, model: Any, limits: LoraLimits | None = None, unsupported: str | None = None
    ) -> None:
        self.model = model
        self.limits = limits or LoraLimits()
        self.unsupported = unsupported
        self.loaded: dict[str, ReadAdapter] = {}
        """Every loaded adapter's host copy, by id, in load order."""
        self.slots: dict[str, int] = {}
        """The resident adapters' slots (1 .. max_loras), by id."""

    def read(self, name: str, path: Path) -> ReadAdapter:
        """Read the PEFT folder `path` as adapter `name` into host memory and check it
        against the model and the limits (LoraError saying why not); the model is not
        touched."""
        self._check_room(name)
        adapter = LoraAdapter.load(name, path, self.model.dtype, HOST, self.limits.max_rank)
        placements = self._place(adapter)
        if torch.device(self.model.device).type == "cuda":
            placements = [p.pinned() for p in placements]
        return ReadAdapter(adapter, placements)

    def _place(self, adapter: LoraAdapter) -> list[Placement]:
        """A native model's layers by PEFT target (`place`); a model run by transformers'
        modules (`hf`) by module path (`place_modules`)."""
        hf = getattr(self.model, "hf", None)
        if hf is None:
            return place(self.model, adapter)
        return place_modules(hf, adapter, hf.get_output_embeddings())

    def add(self, read: ReadAdapter) -> None:
        """Keep a `read` adapter (model thread, between steps); it becomes resident when a
        step's residency names it."""
        self._check_room(read.adapter.name)
        self.loaded[read.adapter.name] = read

    def load(self, name: str, path: Path) -> LoraAdapter:
        """`read` then `add`, in the calling thread, and resident while a slot is free
        (startup)."""
        read = self.read(name, path)
        self.add(read)
        if len(self.slots) < self.limits.max_loras:
            self.reside([*self.slots, name])
        return read.adapter

    def reside(self, names: Sequence[str]) -> None:
        """Hold exactly the loaded adapters of `names` resident (model thread, between
        steps): every other is evicted (its host copy kept), then the missing ones are
        attached in order, each in the lowest free slot; the layers they change are folded
        once. Ids not loaded (unloaded since the router chose) are ignored."""
        wanted = [name for name in dict.fromkeys(names) if name in self.loaded]
        if len(wanted) > self.limits.max_loras:
            raise LoraError(
                f"{len(wanted)} LoRA adapters asked resident, over --max-loras "
                f"{self.limits.max_loras}: {', '.join(wanted)}"
            )
        touched: dict[int, LoraLayer] = {}
        for name in [name for name in self.slots if name not in wanted]:
            touched.update(
                (id(layer), layer) for layer in detach(self.model, self.slots[name], False)
            )
            del self.slots[name]
        device = torch.device(self.model.device)
        for name in wanted:
            if name in self.slots:
                continue
            read = self.loaded[name]
            slot = min(set(range(1, self.limits.max_loras + 1)) - set(self.slots.values()))
            placements = [p.to(device) for p in read.placements]
            layers = apply(slot, read.adapter.scale, placements, fold=False)
            touched.update((id(layer), layer) for layer in layers)
            self.slots[name] = slot
        for layer in touched.values():
            if layer.updates:
                layer.fuse()

    def slot_of(self, name: str) -> int:
        """The slot a row on adapter `name` runs with ("" the base: 0); LoraError when it is
        not resident (the router makes an adapter resident before it schedules its rows)."""
        if not name:
            return 0
        slot = self.slots.get(name)
        if slot is None:
            raise LoraError(
                f"LoRA adapter {name!r} is not resident (resident: "
                f"{', '.join(sorted(self.slots)) or 'none'}): a step ran a request on it "
                "before a StepPlan.lora_residency named it"
            )
        return slot

    def unload(self, name: str) -> None:
        """Detach adapter `name` where resident and drop its host copy (model thread,
        between steps)."""
        if name not in self.loaded:
            raise LoraError(f"LoRA adapter {name!r} is not loaded (loaded: {self._names()})")
        slot = self.slots.pop(name, None)
        if slot is not None:
            detach(self.model, slot)
        del self.loaded[name]

    def _check_room(self, name: str) -> None:
        if self.unsupported is not None:
            raise LoraError(self.unsupported)
        if name in self.loaded:
            raise LoraError(f"LoRA adapter {name!r} is already loaded")
        if len(self.loaded) >= self.limits.max_loaded:
            raise LoraError(
                f"cannot load LoRA adapter {name!r}: {len(self.loaded)} of --max-cpu-loras "
                f"{self.limits.max_loaded} already loaded ({self._names()}); unload one first"
            )

    def _names(self) -> str:
        return ", ".join(sorted(self.loaded)) or "none"
