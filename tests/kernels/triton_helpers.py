"""What the Triton kernel tests share: seeded inputs and the bounds their results meet."""

from __future__ import annotations

import torch

# One rounding of the result apart: the sums differ in order, and the interpreter
# truncates float32 -> bfloat16 where a GPU rounds.
TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}


def randn(
    *shape: int, dtype: torch.dtype, device: str, seed: int, scale: float = 1.0
) -> torch.Tensor:
    """Normal values made on the CPU from `seed` (the same on every device), then moved."""
    values = torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale
    return values.to(dtype).to(device)
