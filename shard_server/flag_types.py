"""Parsers for shard flags the launcher also takes, importable without torch.

The launcher validates these before it spawns a shard; the shard's own CLI parses the
same text again. Both import them from here (the shard must not import the launcher).
"""

from __future__ import annotations

import argparse


def cuda_graph_sizes(text: str) -> tuple[int, ...]:
    """`--cuda-graphs`: comma-separated decode batch sizes, ascending; "0" (or "") = none."""
    if text.strip() in ("", "0"):
        return ()
    try:
        sizes = [int(part) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated batch sizes like 1,2,4,8, or 0, got {text!r}"
        ) from None
    if any(size < 1 for size in sizes):
        raise argparse.ArgumentTypeError(
            f"batch sizes must be positive (0 alone disables): {text!r}"
        )
    return tuple(sorted(set(sizes)))
