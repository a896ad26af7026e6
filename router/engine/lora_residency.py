"""Which LoRA adapters the shards hold in their `--max-loras` slots, least recently used
first, and which waiting requests must wait for a slot.

More adapters may be registered (`--lora-adapters`, runtime loads; the shards keep a host
copy of each) than there are slots. The router decides residency, because it knows what
runs: a request on an adapter without a slot takes a free slot, else the slot of the least
recently used adapter no running request uses (evicted; its host copy stays). When every
slot's adapter has requests running, the request waits in the queue, never failed: the
least recently used of them stops admitting new requests (it *drains*) until it is idle,
so its slot frees within the time its running requests take, while the base and the other
resident adapters keep being admitted past the waiting request.

The shards are told the whole resident set with the first step after it changes
(`StepPlan.lora_residency`): declarative, so every rank ends in the same state and a step
that failed is simply told again (`resend`). Prefix-cache salts name an adapter's load,
not its slot, so blocks cached before an eviction stay valid after the reload.

Pure Python, as the scheduler that calls it.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Collection, Iterable
from typing import Protocol


class OnAdapter(Protocol):
    """A waiting request, as the gate reads it."""

    adapter: str
    """Its LoRA adapter ("" the base)."""


class LoraResidency:
    """The adapters resident on the shards (at most `max_loras`), least recently used first."""

    def __init__(self, max_loras: int, resident: Iterable[str] = ()) -> None:
        """`resident`: the adapters the shards hold already (their Info)."""
        if max_loras < 1:
            raise ValueError(f"max_loras must be at least 1, got {max_loras}")
        self.max_loras = max_loras
        self._resident: OrderedDict[str, None] = OrderedDict.fromkeys(resident)
        if len(self._resident) > max_loras:
            raise ValueError(f"{len(self._resident)} adapters resident, over max_loras {max_loras}")
        self._sent: frozenset[str] | None = frozenset(self._resident)
        """What the shards were last told (None: unknown, tell them again)."""
        self.draining: str | None = None
        """A resident adapter admitting no new request until it is idle, so that a request
        waiting for a slot gets one."""
        self.num_loads = 0
        """Adapters made resident since startup (the first use, or again after eviction)."""
        self.num_evictions = 0
        """Resident adapters evicted to make room for another."""

    @property
    def resident(self) -> tuple[str, ...]:
        """The resident adapters, least recently used first."""
        return tuple(self._resident)

    def __contains__(self, name: object) -> bool:
        return name in self._resident

    def gate(self, busy: Callable[[], Collection[str]]) -> LoraGate:
        """One step's admission by adapter; `busy()` names the adapters with requests
        running (called only when a slot must be found)."""
        return LoraGate(self, busy)

    def acquire(self, name: str, busy: Callable[[], Collection[str]]) -> bool:
        """Make `name` resident and most recently used, for a request about to run on it:
        True when it is (already, in a free slot, or in the slot of the least recently used
        adapter `busy()` does not name, evicted); False when every slot's adapter is busy."""
        if name in self._resident:
            self._resident.move_to_end(name)
            return True
        if len(self._resident) >= self.max_loras:
            in_use = busy()
            victim = next((n for n in self._resident if n not in in_use), None)
            if victim is None:
                return False
            del self._resident[victim]
            self.num_evictions += 1
            if victim == self.draining:
                self.draining = None
        self._resident[name] = None
        self.num_loads += 1
        return True

    def drain_for(self, name: str) -> None:
        """`name` waits for a slot: unless one drains already, the least recently used
        resident adapter admits no new request until it is idle."""
        if self.draining is None and name not in self._resident and self._resident:
            self.draining = next(iter(self._resident))

    def forget(self, name: str) -> None:
        """`name` was unloaded (the shards detached it themselves)."""
        self._resident.pop(name, None)
        if self._sent is not None:
            self._sent -= {name}
        if self.draining == name:
            self.draining = None

    def changes(self) -> tuple[str, ...] | None:
        """The resident set to send with the next step, least recently used first; None when
        the shards hold it already."""
        current = frozenset(self._resident)
        if current == self._sent:
            return None
        self._sent = current
        return tuple(self._resident)

    def resend(self) -> None:
        """A step failed: what the shards hold is not known, the next one tells them again."""
        self._sent = None


class LoraGate:
    """One `schedule()`'s admission by adapter: which waiting requests pass over this step
    (their adapter has no slot, or drains), and the slots taken for those admitted."""

    def __init__(self, residency: LoraResidency, busy: Callable[[], Collection[str]]) -> None:
        self._residency = residency
        self._busy = busy
        draining = residency.draining
        if draining is not None and draining not in busy():
            residency.draining = draining = None  # idle: its slot is up for grabs again
        self._waiting: set[str] = set() if draining is None else {draining}

    @property
    def passed_over(self) -> Callable[[OnAdapter], bool] | None:
        """Which waiting requests admission passes over this step (their adapter waits for a
        slot, or drains); None while none is."""
        if not self._waiting:
            return None
        waiting = self._waiting
        return lambda request: request.adapter in waiting

    def admit(self, adapter: str) -> bool:
        """Whether a request on `adapter` ("" the base) may run now; its adapter is then
        resident. False: it waits for a slot (and a resident adapter starts draining)."""
        if not adapter:
            return True
        if adapter in self._waiting:
            return False
        if self._residency.acquire(adapter, self._busy):
            return True
        self._residency.drain_for(adapter)
        self._waiting.add(adapter)
        if self._residency.draining is not None:
            self._waiting.add(self._residency.draining)
        return False
