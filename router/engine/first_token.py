"""Time-to-first-token deadlines: how many prompt tokens per step the waiting prompts need.

The batch controller asks, while planning a step, what prefill share would give every
waiting prompt its first token within the TTFT target, served in order (the unfinished
prefill, then the queue), each step predicted at that share by the cost fit. A prompt
already late, or clearly out of reach (1.5x the time it has left even at the most the
step may take), is judged lost for good: it is not waited for later, when what is left of
it looks feasible (a long prompt near its end), for it will miss anyway.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from textgate.router.engine.step_cost import StepCostModel

OUT_OF_REACH = 1.5
"""A prompt needing this many times the time it has left, at the most a step may take, is lost."""


@dataclass(frozen=True)
class Backlog:
    """The prompt work waiting when a step is planned, in the order it will be served:
    what a TTFT target weighs."""

    prompts: tuple[tuple[int, int, float], ...]
    """(request id, prompt tokens still to compute, how long it has waited on the
    controller's clock) of the unfinished prefill, then of each request that may join."""


class FirstTokenDeadlines:
    """The catch-up share for a TTFT target, and the requests it no longer waits for."""

    def __init__(self) -> None:
        self._lost: set[int] = set()

    def catch_up(
        self,
        cost: StepCostModel,
        target_s: float | None,
        backlog: Backlog | None,
        num_decodes: int,
        context: int,
        share: int,
        room: int,
    ) -> int:
        """Prompt tokens per step, in [share, room] or 0, that give every waiting prompt
        that can still make `target_s` its first token in time, served in order: one
        already past it, or that would need more than `room` per step, is not waited for
        (0: nothing to catch up with, or no target)."""
        if backlog is None or target_s is None:
            return 0
        self._lost &= {request_id for request_id, _, _ in backlog.prompts}
        needed, ahead = 0, 0
        for request_id, tokens, age_s in backlog.prompts:
            ahead += tokens  # its own tokens and everything served before it
            if request_id in self._lost:
                continue
            left_s = target_s - age_s
            rate = _rate_within(cost, ahead, left_s, num_decodes, context, share, room)
            if rate is not None:
                needed = max(needed, rate)
            elif left_s <= 0 or _time_at(cost, ahead, room, num_decodes, context) > (
                OUT_OF_REACH * left_s
            ):
                self._lost.add(request_id)  # late, or clearly out of reach: for good
        return needed


def _time_at(cost: StepCostModel, tokens: int, rate: int, num_decodes: int, context: int) -> float:
    """Predicted time to compute `tokens` prompt tokens at `rate` per step."""
    if rate <= 0:
        return math.inf
    return math.ceil(tokens / rate) * cost.predict(num_decodes, rate, context)


def _rate_within(
    cost: StepCostModel,
    tokens: int,
    left_s: float,
    num_decodes: int,
    context: int,
    low: int,
    high: int,
) -> int | None:
    """The fewest prompt tokens per step in [low, high] that compute `tokens` within
    `left_s`, each step predicted at that share (None: not even `high` does)."""

    def in_time(rate: int) -> bool:
        return _time_at(cost, tokens, rate, num_decodes, context) <= left_s

    if left_s <= 0 or high < low or not in_time(high):
        return None
    while low < high:  # the time taken falls as the share grows (fewer steps)
        middle = (low + high) // 2
        if in_time(middle):
            high = middle
        else:
            low = middle + 1
    return low
