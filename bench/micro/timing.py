"""Round-robin best-of timing for comparing kernel candidates in one process."""

from __future__ import annotations

import time
from collections.abc import Callable

import torch


def best_seconds(
    fns: dict[str, Callable[[torch.Tensor], torch.Tensor]],
    x: torch.Tensor,
    rounds: int,
    window_s: float = 0.02,
) -> dict[str, float]:
    """Each candidate's best per-call time over `rounds` round-robin windows of ~`window_s`.

    Interleaving the candidates and keeping the best window makes the ratios hold up on a
    machine shared with other work, where a median of back-to-back runs does not.
    """
    reps = {}
    for name, fn in fns.items():
        fn(x)
        start = time.perf_counter()
        fn(x)
        reps[name] = max(1, min(50, int(window_s / max(time.perf_counter() - start, 1e-7))))
    best = dict.fromkeys(fns, float("inf"))
    for _ in range(rounds):
        for name, fn in fns.items():
            start = time.perf_counter()
            for _ in range(reps[name]):
                fn(x)
            best[name] = min(best[name], (time.perf_counter() - start) / reps[name])
    return best
