"""A stand-in for a torch.distributed process group: just a rank and a world size.

Loaders and layers ask the group only these two things to pick their slice of a tensor.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class FakeGroup:
    rank_: int
    size_: int

    def rank(self) -> int:
        return self.rank_

    def size(self) -> int:
        return self.size_
