"""LoRA adapters loaded and unloaded while the server runs (vLLM's /v1/load_lora_adapter
and /v1/unload_lora_adapter): the shards first, then the registry requests are checked
against, one change at a time.

An adapter with requests in flight is not unloaded: the unload is refused, naming how many,
so a running request never loses its adapter. Once an unload has begun, new requests
naming it are refused as unknown; a load is usable once every shard has it.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import grpc

from textgate.router.engine.lora_registry import LoraRegistry
from textgate.router.engine.lora_residency import LoraResidency
from textgate.router.shard_client import ShardedClient, ShardError

log = logging.getLogger("textgate.router")


class AdapterError(Exception):
    """A load or unload refused; `status` is vLLM's (400; 404 for a name not loaded)."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status


class AdapterLoader:
    """Loads and unloads adapters on `shards` and keeps `adapters` in step with them.

    `num_active_on(name)` counts the requests running or waiting on an adapter;
    `base_model` is the served model's name, which no adapter may take; `residency` (the
    engine's) forgets an adapter once the shards have unloaded it."""

    def __init__(
        self,
        adapters: LoraRegistry,
        shards: ShardedClient,
        num_active_on: Callable[[str], int],
        base_model: str,
        residency: LoraResidency | None = None,
    ) -> None:
        self._adapters = adapters
        self._residency = residency
        self._shards = shards
        self._num_active_on = num_active_on
        self._base_model = base_model
        self._lock = asyncio.Lock()

    async def load(self, name: str, path: str) -> None:
        """Load the PEFT folder `path` as adapter `name` on every shard (AdapterError)."""
        async with self._lock:
            if name in self._adapters:
                raise AdapterError(f"The lora adapter '{name}' has already been loaded.")
            if name == self._base_model:
                raise AdapterError(f"'{name}' is the base model's name; pick another lora_name")
            try:
                loaded = await self._shards.load_adapter(name, path)
            except ShardError as exc:
                raise _refused(exc) from exc
            self._adapters.add(name)
        log.info("LoRA adapter %r loaded from %s (rank %d)", name, path, loaded.rank)

    async def unload(self, name: str) -> None:
        """Unload adapter `name` from every shard; refused while requests use it."""
        async with self._lock:
            if name not in self._adapters:
                raise AdapterError(f"The lora adapter '{name}' cannot be found.", 404)
            in_flight = self._num_active_on(name)
            if in_flight:
                raise AdapterError(
                    f"adapter {name!r} has {in_flight} requests in flight; unload it once "
                    "they have finished"
                )
            # From here requests naming it are refused, so none can start on it.
            load = self._adapters.remove(name)
            try:
                await self._shards.unload_adapter(name)
            except ShardError as exc:
                if exc.code != grpc.StatusCode.INVALID_ARGUMENT:  # not "not loaded": still held
                    self._adapters.add(name, load)
                raise _refused(exc) from exc
            finally:
                if self._residency is not None and name not in self._adapters:
                    self._residency.forget(name)  # the shards detached it themselves
        log.info("LoRA adapter %r unloaded", name)


def _refused(exc: ShardError) -> AdapterError:
    """The shards' refusal as the client's error (400), anything else as the server's (500)."""
    if exc.code == grpc.StatusCode.INVALID_ARGUMENT:
        return AdapterError(exc.details)
    return AdapterError(str(exc), 500)
