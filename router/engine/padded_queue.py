"""The waiting queue and TGI's rule for which waiting requests join the batch next.

Pure Python, no I/O: the padded engine asks `Queue.admit` between steps and prefills what
it returns. Two budgets bound a new batch: its prompt tokens (what one prefill may
compute) and its prompt + generation tokens (what the running batch leaves of
`max_batch_total_tokens`). While a batch runs, new requests only join once enough
of them wait (`waiting_served_ratio`) or the queue waited `max_waiting_tokens` steps,
so a trickle of arrivals does not stall the running batch with a prefill every step.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar


class Waiting(Protocol):
    """What the queue needs to know about a waiting request."""

    @property
    def input_length(self) -> int: ...

    @property
    def max_new_tokens(self) -> int: ...


W = TypeVar("W", bound=Waiting)


@dataclass(frozen=True)
class BatchLimits:
    """Budgets a batch works under (TGI's launcher flags)."""

    max_batch_prefill_tokens: int
    """Most prompt tokens one prefill may compute."""
    max_batch_total_tokens: int
    """Most prompt + generation tokens of all requests in the shards at once."""
    max_batch_size: int | None = None
    """Most requests in the running batch; None: unlimited."""
    waiting_served_ratio: float = 0.3
    """Join a running batch once waiting >= ratio * running."""
    max_waiting_tokens: int = 20
    """...or once this many decode steps passed since the last prefill."""
    requires_padding: bool = False
    """Prompts are padded to the longest one, so a prefill costs size * longest tokens."""


@dataclass(frozen=True)
class Running:
    """The running batch as the queue sees it."""

    size: int
    """Requests in the running batch."""
    max_tokens: int
    """Their prompt + generation budget, in tokens."""
    steps_since_prefill: int
    """Decode steps since the last prefill (TGI's `waiting_tokens`)."""


class Queue(Generic[W]):
    """Waiting requests in arrival order."""

    def __init__(self, limits: BatchLimits) -> None:
        self.limits = limits
        self._entries: deque[W] = deque()

    def __len__(self) -> int:
        return len(self._entries)

    def __iter__(self) -> Iterator[W]:
        return iter(self._entries)

    def append(self, entry: W) -> None:
        self._entries.append(entry)

    def remove_if(self, predicate: Callable[[W], bool]) -> list[W]:
        """Remove and return the entries matching `predicate` (e.g. cancelled ones)."""
        removed = [e for e in self._entries if predicate(e)]
        if removed:
            self._entries = deque(e for e in self._entries if not predicate(e))
        return removed

    def admit(self, running: Running | None) -> list[W]:
        """The requests to prefill now (removed from the queue); empty when none should."""
        limits = self.limits
        if running is None:
            return self.next_batch(
                None,
                limits.max_batch_size,
                limits.max_batch_prefill_tokens,
                limits.max_batch_total_tokens,
            )
        max_size = None
        if limits.max_batch_size is not None:
            max_size = limits.max_batch_size - running.size
            if max_size <= 0:
                return []
        return self.next_batch(
            min_join_size(running, limits),
            max_size,
            limits.max_batch_prefill_tokens,
            limits.max_batch_total_tokens - running.max_tokens,
        )

    def next_batch(
        self, min_size: int | None, max_size: int | None, prefill_budget: int, token_budget: int
    ) -> list[W]:
        """The longest prefix of the queue within the budgets; empty if under `min_size`."""
        if min_size is not None and len(self._entries) < min_size:
            return []
        chosen: list[W] = []
        num_prompt = longest = num_decode = 0
        for entry in self._entries:
            if max_size is not None and len(chosen) >= max_size:
                break
            next_prompt = num_prompt + entry.input_length
            next_longest = max(longest, entry.input_length)
            next_decode = num_decode + entry.max_new_tokens
            # Padded prefills compute every prompt at the longest one's length.
            num_prefill = (
                (len(chosen) + 1) * next_longest if self.limits.requires_padding else next_prompt
            )
            if num_prefill > prefill_budget or num_prefill + next_decode > token_budget:
                break
            chosen.append(entry)
            num_prompt, longest, num_decode = next_prompt, next_longest, next_decode
        if not chosen or (min_size is not None and len(chosen) < min_size):
            return []
        for _ in chosen:
            self._entries.popleft()
        return chosen


def min_join_size(running: Running, limits: BatchLimits) -> int | None:
    """How many must wait before they may join `running`; None: any number may."""
    if running.steps_since_prefill >= limits.max_waiting_tokens:
        return None
    return math.floor(running.size * limits.waiting_served_ratio)
