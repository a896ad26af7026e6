"""The LoRA adapters the shards hold, by name, each with the load it came from: the names
requests may give, and the prefix-cache salt of each load."""

from __future__ import annotations

import itertools
from collections.abc import Iterable


class LoraRegistry:
    """Adapter name -> its load's number, in load order (--lora-adapters first).

    A name unloaded and loaded again gets a new number, so blocks cached under the old
    adapter are never served to the new one (`cache_salt`)."""

    def __init__(self, names: Iterable[str] = ()) -> None:
        self._loads = itertools.count(1)
        self._load_of: dict[str, int] = {name: next(self._loads) for name in names}

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(self._load_of)

    def __contains__(self, name: object) -> bool:
        return name in self._load_of

    def __len__(self) -> int:
        return len(self._load_of)

    def add(self, name: str, load: int | None = None) -> int:
        """Register `name` as loaded (a new load, or `load` given back by `remove`)."""
        self._load_of[name] = next(self._loads) if load is None else load
        return self._load_of[name]

    def remove(self, name: str) -> int:
        """Forget `name`; its load's number (KeyError when it is not loaded)."""
        return self._load_of.pop(name)

    def cache_salt(self, adapter_id: str | None) -> str:
        """What a request's KV blocks are salted with: "" for the base, `name#load` for an
        adapter; ValueError (the validation message) for one not loaded."""
        if not adapter_id:
            return ""
        load = self._load_of.get(adapter_id)
        if load is None:
            raise ValueError(self.not_loaded(adapter_id))
        return f"{adapter_id}#{load}"

    def not_loaded(self, adapter_id: str) -> str:
        """TGI-style message for an `adapter_id` that names no loaded adapter."""
        loaded = ", ".join(self._load_of) or "none (--lora-adapters)"
        return f"`adapter_id` {adapter_id!r} is not a loaded adapter; loaded: {loaded}"
