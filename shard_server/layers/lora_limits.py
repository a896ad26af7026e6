"""How many LoRA adapters a shard holds and how large they may be (--max-loras,
--max-cpu-loras, --max-lora-rank); importable without torch, so the launcher's flags read
the defaults."""

from __future__ import annotations

from dataclasses import dataclass

DEFAULT_MAX_LORAS = 8
"""Adapters resident at once unless --max-loras says otherwise."""
DEFAULT_MAX_LORA_RANK = 64
"""Highest adapter rank unless --max-lora-rank says otherwise (vLLM's default is 16)."""
CPU_LORAS_PER_SLOT = 4
"""Adapters loaded (host copies) per resident slot unless --max-cpu-loras says otherwise."""


@dataclass(frozen=True)
class LoraLimits:
    """How many adapters a shard holds and how large they may be."""

    max_loras: int = DEFAULT_MAX_LORAS
    """Most adapters resident at once, attached to the layers (--max-loras); the least
    recently used idle one makes room for another."""
    max_rank: int = DEFAULT_MAX_LORA_RANK
    """Highest rank (PEFT's r) an adapter may have (--max-lora-rank)."""
    max_cpu_loras: int | None = None
    """Most adapters loaded at once, resident or not, each with its host copy
    (--max-cpu-loras; None: CPU_LORAS_PER_SLOT x max_loras); a load past it is refused."""

    def __post_init__(self) -> None:
        if self.max_loras < 1:
            raise ValueError(f"--max-loras must be at least 1, got {self.max_loras}")
        if self.max_rank < 1:
            raise ValueError(f"--max-lora-rank must be at least 1, got {self.max_rank}")
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError(
                f"--max-cpu-loras ({self.max_cpu_loras}) must be at least --max-loras "
                f"({self.max_loras})"
            )

    @property
    def max_loaded(self) -> int:
        """Most adapters loaded at once (--max-cpu-loras, or its default)."""
        if self.max_cpu_loras is not None:
            return self.max_cpu_loras
        return CPU_LORAS_PER_SLOT * self.max_loras
