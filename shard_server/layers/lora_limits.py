"""How many LoRA adapters a shard holds and how large they may be (--max-loras,
--max-lora-rank); importable without torch, so the launcher's flags read the defaults."""

from __future__ import annotations

from dataclasses import dataclass

DEFAULT_MAX_LORAS = 8
"""Adapters resident at once unless --max-loras says otherwise."""
DEFAULT_MAX_LORA_RANK = 64
"""Highest adapter rank unless --max-lora-rank says otherwise (vLLM's default is 16)."""


@dataclass(frozen=True)
class LoraLimits:
    """How many adapters a shard holds and how large they may be."""

    max_loras: int = DEFAULT_MAX_LORAS
    """Most adapters resident at once (--max-loras); a load past it is refused."""
    max_rank: int = DEFAULT_MAX_LORA_RANK
    """Highest rank (PEFT's r) an adapter may have (--max-lora-rank)."""

    def __post_init__(self) -> None:
        if self.max_loras < 1:
            raise ValueError(f"--max-loras must be at least 1, got {self.max_loras}")
        if self.max_rank < 1:
            raise ValueError(f"--max-lora-rank must be at least 1, got {self.max_rank}")
